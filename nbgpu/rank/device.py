"""A rank's device, checked the way CUDA would check it (the real path).

An ordinal past the visible devices fails with torch's own "invalid device ordinal" text
before CUDA is touched, plus one ``[nbgpu]`` line. Under ``NBGPU_SIMULATE`` the answer
comes from ``nbgpu.devices.sim.cuda`` through one call, imported only then: a real
rank never loads the simulation. torch is imported inside the functions only.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from nbgpu.devices.cuda_errors import (
    CUDA_ERROR_INVALID_DEVICE,
    ordinal_hint,
    torch_cuda_message,
    visible_setting,
)
from nbgpu.devices.sim import simulation_source
from nbgpu.rank.job import _env, _in_job, _write, local_rank

if TYPE_CHECKING:
    import torch

__all__ = ["device"]

# Simulation labels already printed by this process: each is said once, not per call.
_announced: set[str] = set()


def device(environ: Mapping[str, str] | None = None) -> torch.device:
    """The device this rank should compute on, checked the way CUDA would check it.

    - ``NBGPU_SIMULATE`` set: CUDA's behaviour on the simulated fleet (this process's
      ``CUDA_VISIBLE_DEVICES`` resolved against it). A ``LOCAL_RANK`` beyond the visible
      devices raises the "invalid device ordinal" error, a GPU that refuses a context
      (busy, lost, prohibited) raises CUDA's error for it, each as torch 2.13 words it
      plus one ``[nbgpu]`` line naming the physical GPU. Otherwise one labelled line on
      stderr says which GPU ``cuda:N`` stands for, and the rank computes on the CPU.
    - real CUDA: ``LOCAL_RANK`` must be below ``torch.cuda.device_count()`` (else the same
      "invalid device ordinal" error, before CUDA is touched); then
      ``torch.cuda.set_device`` and ``cuda:LOCAL_RANK``.
    - no CUDA: ``cpu``.

    Outside a job (RANK unset) the process counts as local rank 0 of one.
    """
    env = _env(environ)
    ordinal = local_rank(env) if _in_job(env) else 0
    source = simulation_source(env)
    if source is not None:
        return _simulated_device(source, ordinal, env)
    import torch  # noqa: PLC0415  (lazy: `import nbgpu.rank` must stay cheap)

    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if ordinal >= count:
        raise _cuda_error(CUDA_ERROR_INVALID_DEVICE, ordinal_hint(ordinal, count, env))
    try:
        torch.cuda.set_device(ordinal)
    except RuntimeError as exc:
        # torch's own error stays as it is (diagnosis matches its text); the note only
        # adds which device of which mapping refused. add_note: Python >= 3.11.
        add_note = getattr(exc, "add_note", None)
        if add_note is not None:
            add_note(
                f"[nbgpu] cuda:{ordinal} ({visible_setting(env)}) refused a CUDA context: "
                "see %gpu_doctor"
            )
        raise
    return torch.device("cuda", ordinal)


def _cuda_error(code: int, explanation: str) -> RuntimeError:
    """The exception torch raises for CUDA error ``code``, plus nbgpu's explanation line."""
    import torch  # noqa: PLC0415

    message = f"{torch_cuda_message(code)}\n{explanation}"
    error_type = getattr(torch, "AcceleratorError", None)  # torch >= 2.8
    if isinstance(error_type, type) and issubclass(error_type, RuntimeError):
        error = error_type(message)
        # torch sets the cudaError_t on the instance after construction, as we do.
        error.error_code = code  # type: ignore[attr-defined]
        return error
    return RuntimeError(message)


def _simulated_device(source: str, ordinal: int, env: Mapping[str, str]) -> torch.device:
    """CUDA's behaviour on the simulated fleet: its error for this rank, or the CPU."""
    import torch  # noqa: PLC0415

    # Imported here: only simulated ranks load the fleet and the fake driver.
    from nbgpu.devices.sim.cuda import simulated_device  # noqa: PLC0415

    answer = simulated_device(source, ordinal, env)
    if answer.cuda_error is not None:
        raise _cuda_error(answer.cuda_error, answer.line) from None
    _announce(answer.line)
    return torch.device("cpu")


def _announce(line: str) -> None:
    if line not in _announced:
        _announced.add(line)
        _write(line + "\n", sys.stderr)
