"""A rank's place in its job (rank, sizes, rank 0), its device and process group, turns across a
node's ranks (``one_at_a_time``) and a cap on its address space (``set_memory_limit``).

Every function reads ``environ`` (default ``os.environ``). ``is_main()`` and ``print0()`` treat a
process outside any job as the single rank 0; the other queries raise a one-line ``UserInputError``
there. torch is imported lazily; ``nbgpu.devices.sim.cuda`` only under ``NBGPU_SIMULATE``.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from nbgpu._backends import BACKENDS
from nbgpu.devices.cuda_errors import (
    CUDA_ERROR_INVALID_DEVICE,
    ordinal_hint,
    torch_cuda_message,
    visible_setting,
)
from nbgpu.devices.sim import simulation_source
from nbgpu.errors import UserInputError
from nbgpu.profile.recorder import status_bytes
from nbgpu.sizes import gib
from nbgpu.sizes import parse_size as _parse_size

if TYPE_CHECKING:
    import torch

__all__ = [
    "NOT_IN_JOB", "RUN_DIR_ENV", "all_reduce_sum", "barrier", "destroy", "device", "init",
    "is_main", "local_rank", "local_world_size", "one_at_a_time", "parse_size", "print0", "rank",
    "set_memory_limit", "world_size",
]  # fmt: skip

#: The one line every job query raises outside a distributed job.
NOT_IN_JOB = "not inside a distributed job: RANK is unset (launch with %%torchrun N or torchrun)"
#: Set by the launcher: the run directory (per-rank logs, locks, results).
RUN_DIR_ENV = "NBGPU_RUN_DIR"
_LOCK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# Simulation labels already printed by this process: each is said once, not per call.
_announced: set[str] = set()


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def _in_job(env: Mapping[str, str]) -> bool:
    return bool(env.get("RANK", "").strip())


def _job_int(env: Mapping[str, str], key: str) -> int:
    raw = env.get(key, "").strip()
    if not raw:
        if key == "RANK" or not _in_job(env):
            raise UserInputError(NOT_IN_JOB)
        raise UserInputError(
            f"not inside a torchrun job: RANK is set but {key} is unset (launch with "
            "%%torchrun N or torchrun, which set both)"
        )
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise UserInputError(f"{key}={raw!r} is not a whole number >= 0 as torchrun sets it")
    return value


def _after_rank(environ: Mapping[str, str] | None, key: str) -> int:
    env = _env(environ)
    _job_int(env, "RANK")  # outside a job, say so in the words of RANK
    return _job_int(env, key)


def rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's global rank (``RANK``), 0 .. world_size-1."""
    return _job_int(_env(environ), "RANK")


def local_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank on its node (``LOCAL_RANK``): the ``cuda:N`` it should use."""
    return _after_rank(environ, "LOCAL_RANK")


def world_size(environ: Mapping[str, str] | None = None) -> int:
    """The number of ranks in the job (``WORLD_SIZE``)."""
    return _after_rank(environ, "WORLD_SIZE")


def local_world_size(environ: Mapping[str, str] | None = None) -> int:
    """The number of ranks on this node (``LOCAL_WORLD_SIZE``)."""
    return _after_rank(environ, "LOCAL_WORLD_SIZE")


def is_main(environ: Mapping[str, str] | None = None) -> bool:
    """True on global rank 0, and in a process outside any job (RANK unset): code guarded
    by ``is_main()`` runs the same in the kernel and on rank 0 of ``%%torchrun``."""
    env = _env(environ)
    return not _in_job(env) or _job_int(env, "RANK") == 0


def print0(
    *values: object,
    sep: str | None = " ",
    end: str | None = "\n",
    file: TextIO | None = None,
    flush: bool = False,
    environ: Mapping[str, str] | None = None,
) -> None:
    """``print`` on global rank 0 only (and in a single process, like ``is_main``)."""
    if is_main(environ):
        text = (" " if sep is None else sep).join(map(str, values))
        _write(text + ("\n" if end is None else end), file or sys.stdout, flush=flush)


def _write(text: str, stream: TextIO, *, flush: bool = True) -> None:
    # One write per line: print() writes the text and its end separately, and ranks that
    # share a pipe (bare torchrun) would splice each other's lines in between.
    stream.write(text)
    if flush:
        stream.flush()


@contextlib.contextmanager
def one_at_a_time(
    name: str = "imports", environ: Mapping[str, str] | None = None
) -> Iterator[None]:
    """Run the block in one rank of this node at a time (a file lock).

    Eight ranks importing and compiling at once can exhaust host memory
    (``std::bad_alloc``). The lock lives in ``NBGPU_RUN_DIR`` (else a private temporary
    directory) and carries the node's name, so ranks on other nodes do not wait.
    ``[rank N] LOCK:`` lines on stderr say who waits, holds and releases.
    """
    from filelock import FileLock, Timeout  # noqa: PLC0415  (only ranks that serialise)

    if not _LOCK_NAME.fullmatch(name):
        raise UserInputError(
            f"lock name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    env = _env(environ)
    who = f"[rank {rank(env) if _in_job(env) else 0}]"
    # The node's name: SLURM's for ranks nbgpu started there (NBGPU_NODE), else the host's.
    node = env.get("NBGPU_NODE") or socket.gethostname()
    lock = FileLock(str(_lock_dir(env) / f"{name}.{node}.lock"))
    asked = time.monotonic()
    try:
        lock.acquire(timeout=0)
    except Timeout:
        _say(f"{who} LOCK: waiting for {name!r} (another rank on this node holds it)")
        lock.acquire()
    acquired = time.monotonic()
    _say(f"{who} LOCK: acquired {name!r} after {acquired - asked:.1f} s")
    try:
        yield
    finally:
        # Said before releasing: in the merged output "released" precedes the next one's "acquired".
        _say(f"{who} LOCK: released {name!r} after {time.monotonic() - acquired:.1f} s")
        lock.release()


def _say(line: str) -> None:
    _write(line + "\n", sys.stderr)


def _lock_dir(env: Mapping[str, str]) -> Path:
    run_dir = env.get(RUN_DIR_ENV, "").strip()
    if run_dir:
        return Path(run_dir)
    run_id = re.sub(r"[^A-Za-z0-9_.-]", "_", env.get("TORCHELASTIC_RUN_ID", "") or "none")
    base = Path(tempfile.gettempdir()) / f"nbgpu-locks-{os.getuid()}"
    base.mkdir(mode=0o700, exist_ok=True)
    # /tmp is shared: refuse a directory someone else made (or a symlink) for our locks.
    if not base.is_dir() or base.is_symlink() or base.lstat().st_uid != os.getuid():
        raise UserInputError(f"lock directory {base} is not a private directory of this user")
    directory = base / run_id
    directory.mkdir(mode=0o700, exist_ok=True)
    return directory


def parse_size(size: int | str) -> int:
    """Bytes from a memory limit as written (``60G``, ``80GB``; :mod:`nbgpu.sizes`)."""
    return _parse_size(size, "memory limit ")


def set_memory_limit(size: int | str) -> int:
    """Cap this rank's address space (``RLIMIT_AS``, soft limit); the cap in bytes.

    Past it, allocations fail inside this rank (``MemoryError``, ``std::bad_alloc``) instead
    of the OOM killer taking a random process. CUDA reserves a large virtual range at
    initialisation: on real GPUs the cap must leave room for it.
    """
    import resource  # noqa: PLC0415  (POSIX only, and only when asked)

    limit = parse_size(size)
    current = status_bytes("VmSize")
    if current is not None and limit <= current:
        raise UserInputError(
            f"memory limit {size!r} ({gib(limit)}) is below this rank's current address "
            f"space ({gib(current)}): it would fail at once; expected more, e.g. 60G"
        )
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY and limit > hard:
        raise UserInputError(
            f"memory limit {size!r} ({gib(limit)}) is above the hard limit {gib(hard)} "
            "that this process may not raise; expected at most that"
        )
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return limit


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
    backend: str | None = None, timeout_s: float = 300, *, environ: Mapping[str, str] | None = None
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
