"""The job's process group: join it from torchrun's environment, barrier, a sum.

``init`` picks the backend (gloo on CPU and under simulation, nccl on CUDA), checks the
device first (so a busy GPU fails with CUDA's words) and records the ``init`` memory phase
through ``nbgpu.profile.phases`` (standard library only). torch is imported lazily.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from datetime import timedelta

from nbgpu._backends import BACKENDS
from nbgpu.devices.sim import simulation_source
from nbgpu.errors import UserInputError
from nbgpu.rank.device import _announce, device
from nbgpu.rank.job import _env, _in_job, rank, world_size

__all__ = ["all_reduce_sum", "barrier", "destroy", "init"]


def init(
    backend: str | None = None,
    timeout_s: float = 300,
    *,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Join the job's process group from torchrun's environment; a second call is a no-op.

    ``backend``: None takes ``NBGPU_BACKEND`` (``%%torchrun --backend``) if set, else
    picks ``nccl`` on real CUDA and ``gloo`` otherwise; under
    ``NBGPU_SIMULATE`` always ``gloo`` (an explicit ``nccl`` runs as gloo there, labelled,
    so a cell written for the real box runs unchanged). On CUDA and under simulation
    ``device()`` runs first, so a busy GPU or an invalid ordinal fails here with CUDA's
    words. ``environ`` is read for these checks; the rendezvous itself is torch's
    ``env://``, which always reads this process's own environment.
    """
    import torch.distributed as dist  # noqa: PLC0415

    if dist.is_available() and dist.is_initialized():
        return
    with _init_phase():  # memory phase 'init' (nbgpu.profile): the group's cost shows
        _init_group(backend, timeout_s, environ)


def _init_group(backend: str | None, timeout_s: float, environ: Mapping[str, str] | None) -> None:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    if not dist.is_available():
        raise UserInputError("this torch build has no torch.distributed; install a full torch")
    if dist.is_initialized():
        return
    env = _env(environ)
    # %%torchrun --backend sets the default for every rank; an explicit argument wins.
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


@contextlib.contextmanager
def _init_phase() -> Iterator[None]:
    """The standard ``init`` memory phase: from here until the process group is up."""
    from nbgpu.profile.phases import recorder  # noqa: PLC0415  (standard library only)

    rec = recorder()
    phase_id = rec.begin("init")
    try:
        yield
    except BaseException as exc:
        rec.end(phase_id, error=f"{type(exc).__name__}: {exc}"[:300])
        raise
    rec.end(phase_id)


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


def destroy() -> None:
    """Leave the process group if this process joined one (safe to call always)."""
    # Never import torch just to learn that nothing was initialised.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _initialized(env: Mapping[str, str]) -> bool:
    """Whether collectives can run; a lone process outside a job needs none."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
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
