"""A rank's device, checked the way CUDA would check it, and the job's process group.

torch is imported lazily; ``nbgpu.devices.sim.cuda`` only under ``NBGPU_SIMULATE``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING

from nbgpu._backends import BACKENDS
from nbgpu.devices.cuda_errors import (
    CUDA_ERROR_INVALID_DEVICE,
    ordinal_hint,
    torch_cuda_message,
    visible_setting,
)
from nbgpu.devices.sim import simulation_source
from nbgpu.errors import UserInputError
from nbgpu.rank.job import _env, _in_job, _write, local_rank, rank, world_size

if TYPE_CHECKING:
    import torch

__all__ = ["all_reduce_sum", "barrier", "destroy", "device", "init"]

# Simulation labels already printed by this process: each is said once, not per call.
_announced: set[str] = set()


def device(environ: Mapping[str, str] | None = None) -> torch.device:
    """The device this rank should compute on, checked the way CUDA would check it.

    - ``NBGPU_SIMULATE`` set: CUDA's behaviour on the simulated fleet. A ``LOCAL_RANK``
      beyond the visible devices, or a GPU that refuses a context (busy, lost, prohibited),
      raises CUDA's error as torch words it plus one ``[nbgpu]`` line naming the physical
      GPU; otherwise one labelled line says which GPU ``cuda:N`` stands for, on the CPU.
    - real CUDA: ``LOCAL_RANK`` below ``torch.cuda.device_count()`` (else the same "invalid
      device ordinal", before CUDA is touched), then ``set_device`` and ``cuda:LOCAL_RANK``.
    - no CUDA: ``cpu``. Outside a job the process counts as local rank 0 of one.
    """
    env = _env(environ)
    ordinal = local_rank(env) if _in_job(env) else 0
    import torch  # noqa: PLC0415  (lazy: `import nbgpu.rank` must stay cheap)

    source = simulation_source(env)
    if source is not None:
        # Imported here: only simulated ranks load the fleet and the fake driver.
        from nbgpu.devices.sim.cuda import simulated_device  # noqa: PLC0415

        answer = simulated_device(source, ordinal, env)
        if answer.cuda_error is not None:
            raise _cuda_error(answer.cuda_error, answer.line) from None
        _announce(answer.line)
        return torch.device("cpu")
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


def _announce(line: str) -> None:
    if line not in _announced:
        _announced.add(line)
        _write(line + "\n", sys.stderr)


def init(
    backend: str | None = None,
    timeout_s: float = 300,
    *,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Join the job's process group from torchrun's environment; a second call is a no-op.

    ``backend``: None takes ``NBGPU_BACKEND`` (``%%torchrun --backend``), else ``nccl`` on
    real CUDA and ``gloo`` otherwise; under ``NBGPU_SIMULATE`` always ``gloo`` (labelled), so
    a cell written for the real box runs unchanged. On CUDA and under simulation
    ``device()`` runs first, so a busy GPU or an invalid ordinal fails here in CUDA's words.
    """
    from nbgpu.profile.phases import Phase  # noqa: PLC0415  (standard library only)

    if _group_up():
        return
    with Phase("init"):  # the memory phase 'init' (nbgpu.profile): the group's cost shows
        _init_group(backend, timeout_s, environ)


def _init_group(backend: str | None, timeout_s: float, environ: Mapping[str, str] | None) -> None:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    if not dist.is_available():
        raise UserInputError("this torch build has no torch.distributed; install a full torch")
    env = _env(environ)
    wanted = _check_backend(backend if backend is not None else env.get("NBGPU_BACKEND") or None)
    if timeout_s <= 0:
        raise UserInputError(f"timeout_s={timeout_s!r}: expected a number of seconds > 0")
    global_rank = rank(env)
    size = world_size(env)
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        if not env.get(key, "").strip():
            raise UserInputError(
                f"not launched by torchrun: {key} is unset (launch with %%torchrun N or torchrun)"
            )
    source = simulation_source(env)
    simulated = source is not None
    cuda = not simulated and torch.cuda.is_available()
    if wanted is None:
        wanted = "nccl" if cuda else "gloo"
    if "nccl" in wanted and simulated:
        _announce(f"[nbgpu] simulated fleet {source!r}: backend {wanted!r} runs as 'gloo' on CPU")
        wanted = "gloo"
    if "nccl" in wanted and not cuda:
        raise UserInputError("backend nccl needs CUDA GPUs; on CPU use backend='gloo'")
    device_id = None
    if cuda or simulated:
        chosen = device(env)
        if chosen.type == "cuda" and "nccl" in wanted:
            device_id = chosen  # binds NCCL to this rank's GPU at once (no guessing later)
    dist.init_process_group(
        backend=wanted,
        init_method="env://",
        rank=global_rank,
        world_size=size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device_id,
    )


def _check_backend(backend: str | None) -> str | None:
    if backend is None:
        return None
    text = backend.strip().lower()
    # "cpu:gloo,cuda:nccl" names one backend per device type; check each name.
    names = [part.partition(":")[2] if ":" in part else part for part in text.split(",")]
    unknown = [n for n in names if n not in BACKENDS]
    if not text or unknown:
        raise UserInputError(
            f"backend {backend!r} is not a torch.distributed backend; expected one of "
            f"{', '.join(BACKENDS)} (or None: nccl on CUDA, gloo on CPU)"
        )
    return text


def _group_up() -> bool:
    # Never import torch just to learn that nothing was initialised.
    dist = sys.modules.get("torch.distributed")
    return dist is not None and bool(dist.is_available() and dist.is_initialized())


def destroy() -> None:
    """Leave the process group if this process joined one (safe to call always)."""
    if _group_up():
        import torch.distributed as dist  # noqa: PLC0415

        dist.destroy_process_group()


def _initialized(env: Mapping[str, str]) -> bool:
    """Whether collectives can run; a lone process outside a job needs none."""
    if _group_up():
        return True
    if _in_job(env):
        raise UserInputError("no process group yet: call nbgpu.rank.init() first")
    return False


def barrier(environ: Mapping[str, str] | None = None) -> None:
    """Wait until every rank gets here (a no-op in a single process)."""
    if _initialized(_env(environ)):
        import torch.distributed as dist  # noqa: PLC0415

        dist.barrier()


def all_reduce_sum(value: float, environ: Mapping[str, str] | None = None) -> float:
    """The sum of ``value`` over all ranks, on every rank (``value`` itself alone)."""
    if not _initialized(_env(environ)):
        return float(value)
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    on = "cpu"
    if "nccl" in str(dist.get_backend()):  # NCCL reduces GPU tensors only
        on = f"cuda:{torch.cuda.current_device()}"
    # float64: integer-valued sums stay exact far beyond float32's 2**24.
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=on)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return float(tensor.item())
