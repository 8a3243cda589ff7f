"""Helpers for code running *inside* a rank of a ``%%torchrun`` job (or any torchrun job).

    import nbgpu.rank as nr
    nr.init()                       # process group from torchrun's environment
    dev = nr.device()               # cuda:LOCAL_RANK, validated; CPU when simulated
    nr.print0("world", nr.world_size())
    with nr.one_at_a_time("imports"):
        import transformers         # heavy imports one rank at a time

This module owns what a rank asks about itself: its place in the job (``rank``,
``local_rank``, ``world_size``, ``local_world_size``, ``is_main``), its device
(``device``: "invalid device ordinal" caught before CUDA sees it, and, under
``NBGPU_SIMULATE``, CUDA's own errors for the simulated fleet), the process group
(``init``, ``destroy``, ``barrier``, ``all_reduce_sum``), serialised blocks across the
ranks of one node (``one_at_a_time``, behind ``--serial-imports``) and a per-rank
address-space limit (``set_memory_limit``, behind ``--mem-limit``).

Every function reads the job from ``environ`` (default ``os.environ``), so tests pass a
dict. ``is_main()`` and ``print0()`` treat a process outside any job as the single rank
0; the other job queries raise a one-line ``UserInputError`` there.

Importing this module is cheap: it must never import torch at module level (torch is
imported inside the functions that need it), and never IPython, pynvml or psutil at all.
Under simulation it reads the fleet through ``nbgpu.devices`` (simulated CUDA driver and
``CUDA_VISIBLE_DEVICES`` resolution); ``init`` records the memory phase ``init`` through
``nbgpu.profile.phases`` (standard library only); nothing else of nbgpu.
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

from nbgpu.errors import UserInputError

if TYPE_CHECKING:
    import torch

    from nbgpu.devices.fleet import SimGpu

__all__ = [
    "NOT_IN_JOB",
    "RUN_DIR_ENV",
    "all_reduce_sum",
    "barrier",
    "destroy",
    "device",
    "init",
    "is_main",
    "local_rank",
    "local_world_size",
    "one_at_a_time",
    "parse_size",
    "print0",
    "rank",
    "set_memory_limit",
    "world_size",
]

#: The one line every job query raises outside a distributed job.
NOT_IN_JOB = "not inside a distributed job: RANK is unset (launch with %%torchrun N or torchrun)"
#: Set by the launcher: the run directory (per-rank logs, locks, results).
RUN_DIR_ENV = "NBGPU_RUN_DIR"
_SIMULATE_ENV = "NBGPU_SIMULATE"  # the same name as nbgpu.devices.cuda_driver.SIMULATE_ENV

# cudaError_t names (cudaGetErrorName) of the codes a context creation can return. torch
# quotes the *runtime* name in its help line; the driver's CUDA_ERROR_* names differ.
_RUNTIME_ERROR_NAMES: Mapping[int, str] = {
    2: "cudaErrorMemoryAllocation",
    3: "cudaErrorInitializationError",
    46: "cudaErrorDevicesUnavailable",
    100: "cudaErrorNoDevice",
    101: "cudaErrorInvalidDevice",
    214: "cudaErrorECCUncorrectable",
    304: "cudaErrorOperatingSystem",
    800: "cudaErrorNotPermitted",
    801: "cudaErrorNotSupported",
    802: "cudaErrorSystemNotReady",
    803: "cudaErrorSystemDriverMismatch",
    999: "cudaErrorUnknown",
}
_CUDA_ERROR_INVALID_DEVICE = 101
_CUDA_ERROR_DEVICE_UNAVAILABLE = 46
_CUDA_ERROR_UNKNOWN = 999
_LOCK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(?:i?B)?", re.IGNORECASE)
_SIZE_FORM = "bytes, or a number with K, M, G or T (powers of 1024), e.g. 60G or 512M"

# Simulation labels already printed by this process: each is said once, not per call.
_announced: set[str] = set()


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


# ----------------------------------------------------------------------------- the job


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


def rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's global rank (``RANK``), 0 .. world_size-1."""
    return _job_int(_env(environ), "RANK")


def local_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank on its node (``LOCAL_RANK``): the ``cuda:N`` it should use."""
    env = _env(environ)
    _job_int(env, "RANK")  # outside a job, say so in the words of RANK
    return _job_int(env, "LOCAL_RANK")


def world_size(environ: Mapping[str, str] | None = None) -> int:
    """The number of ranks in the job (``WORLD_SIZE``)."""
    env = _env(environ)
    _job_int(env, "RANK")
    return _job_int(env, "WORLD_SIZE")


def local_world_size(environ: Mapping[str, str] | None = None) -> int:
    """The number of ranks on this node (``LOCAL_WORLD_SIZE``)."""
    env = _env(environ)
    _job_int(env, "RANK")
    return _job_int(env, "LOCAL_WORLD_SIZE")


def is_main(environ: Mapping[str, str] | None = None) -> bool:
    """True on global rank 0, and in a process outside any job (RANK unset).

    A single process is the whole job, so code guarded by ``is_main()`` runs the same in
    the notebook kernel and on rank 0 of ``%%torchrun``.
    """
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


# -------------------------------------------------------------------------- the device


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
    source = env.get(_SIMULATE_ENV, "").strip()
    if source:
        return _simulated_device(source, ordinal, env)
    import torch  # noqa: PLC0415  (lazy: `import nbgpu.rank` must stay cheap)

    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if ordinal >= count:
        raise _cuda_error(_CUDA_ERROR_INVALID_DEVICE, _ordinal_hint(ordinal, count, env))
    try:
        torch.cuda.set_device(ordinal)
    except RuntimeError as exc:
        # torch's own error stays as it is (diagnosis matches its text); the note only
        # adds which device of which mapping refused. add_note: Python >= 3.11.
        add_note = getattr(exc, "add_note", None)
        if add_note is not None:
            add_note(
                f"[nbgpu] cuda:{ordinal} ({_visible_setting(env)}) refused a CUDA context: "
                "see %gpu_doctor"
            )
        raise
    return torch.device("cuda", ordinal)


def _visible_setting(env: Mapping[str, str]) -> str:
    value = env.get("CUDA_VISIBLE_DEVICES")
    return "CUDA_VISIBLE_DEVICES unset" if value is None else f"CUDA_VISIBLE_DEVICES={value}"


def _ordinal_hint(ordinal: int, count: int, env: Mapping[str, str]) -> str:
    return (
        f"[nbgpu] local_rank {ordinal} >= {count} visible devices ({_visible_setting(env)}): "
        f"launch at most {count} ranks per node, e.g. %%torchrun {count}"
    )


def _torch_cuda_message(code: int) -> str:
    """The text torch 2.13 raises for a failed CUDA runtime call returning ``code``.

    ``c10_cuda_check_implementation`` (c10/cuda/CUDAException.cpp) joins: "CUDA error: "
    + cudaGetErrorString, ``get_cuda_error_help`` (its own sentence for an invalid
    device, else where to look the name up), ``get_cuda_async_error_suffix`` (the
    CUDA_LAUNCH_BLOCKING hint only for asynchronous kernel faults, never for the
    context and ordinal errors raised here) and the device-side-assertion line, which
    CUDA builds of 2.13 always compile in and leave disabled at runtime.
    """
    from nbgpu.devices.cuda_driver import error_string  # noqa: PLC0415

    # The runtime's strings equal the driver's for every code a context can return.
    text = error_string(code) or "unrecognized error code"
    if code == _CUDA_ERROR_INVALID_DEVICE:
        help_line = "GPU device may be out of range, do you have enough GPUs?"
    else:
        name = _RUNTIME_ERROR_NAMES.get(code, "unrecognized error code")
        help_line = (
            f"Search for `{name}' in "
            "https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html "
            "for more information."
        )
    return "\n".join(
        [
            f"CUDA error: {text}",
            help_line,
            "For more detailed error information, run with CUDA_LOG_FILE=stderr",
            "Device-side assertion tracking was not enabled by user.",
        ]
    )


def _cuda_error(code: int, explanation: str) -> RuntimeError:
    """The exception torch raises for CUDA error ``code``, plus nbgpu's explanation line."""
    import torch  # noqa: PLC0415

    message = f"{_torch_cuda_message(code)}\n{explanation}"
    error_type = getattr(torch, "AcceleratorError", None)  # torch >= 2.8
    if isinstance(error_type, type) and issubclass(error_type, RuntimeError):
        error = error_type(message)
        # torch sets the cudaError_t on the instance after construction, as we do.
        error.error_code = code  # type: ignore[attr-defined]
        return error
    return RuntimeError(message)


def _simulated_device(source: str, ordinal: int, env: Mapping[str, str]) -> torch.device:
    # Imported here: only simulated ranks need the fleet and the fake driver.
    import torch  # noqa: PLC0415

    from nbgpu.devices.cuda_driver import (  # noqa: PLC0415
        CudaCallError,
        CudaDriver,
        error_name,
    )
    from nbgpu.devices.simulate_cuda import load_simulated_cuda  # noqa: PLC0415

    cpu = torch.device("cpu")
    try:
        library = load_simulated_cuda(source, env)
    except OSError as exc:
        # No libcuda: torch.cuda.is_available() is False and torch runs on the CPU.
        _announce(f"[nbgpu] simulated fleet {source!r}: no CUDA driver ({exc}); computing on CPU")
        return cpu
    fleet = library.fleet
    driver = CudaDriver(library)
    try:
        driver.init()
    except CudaCallError as exc:
        # cuInit failing makes torch.cuda.is_available() False: torch falls back to CPU.
        _announce(
            f"[nbgpu] simulated fleet {fleet.name!r}: CUDA is unavailable "
            f"({error_name(exc.code) or exc.code}); computing on CPU"
        )
        return cpu
    count = driver.device_count()
    if ordinal >= count:
        hint = _ordinal_hint(ordinal, count, env)
        raise _cuda_error(
            _CUDA_ERROR_INVALID_DEVICE,
            hint.replace("[nbgpu] ", f"[nbgpu] simulated fleet {fleet.name!r}: ", 1),
        )
    target = library.devices[ordinal]
    try:
        driver.retain_primary_context(ordinal)
    except CudaCallError as exc:
        gpu = target.gpu
        what = f"cuda:{ordinal} is physical GPU {gpu.index} ({gpu.uuid})"
        if target.mig is not None:
            what += f" as MIG instance {target.mig.uuid}"
        raise _cuda_error(
            exc.code,
            f"[nbgpu] simulated fleet {fleet.name!r}: {what}, {_refusal(gpu, exc.code)}: "
            "see %gpu_doctor",
        ) from None
    driver.release_primary_context(ordinal)
    _announce(
        f"[nbgpu] simulated fleet {fleet.name!r}: cuda:{ordinal} -> GPU {target.gpu.index} "
        f"({target.name}); computing on CPU"
    )
    return cpu


def _refusal(gpu: SimGpu, code: int) -> str:
    """Why a simulated GPU refuses a context, in the words of nvidia-smi's columns."""
    if code == _CUDA_ERROR_DEVICE_UNAVAILABLE and gpu.compute_mode == "prohibited":
        return "compute mode prohibited"
    if code == _CUDA_ERROR_DEVICE_UNAVAILABLE and gpu.processes:
        holders = ", ".join(
            f"{p.pid} ({p.observed.state})" if p.observed else str(p.pid) for p in gpu.processes
        )
        mode = gpu.compute_mode.replace("_", "-")
        return f"{mode}, held by pid{'s' if len(gpu.processes) > 1 else ''} {holders}"
    if code == _CUDA_ERROR_UNKNOWN and gpu.fault == "lost":
        return "which has fallen off the bus (Xid 79)"
    return f"which refuses a CUDA context (CUDA error {code})"


def _announce(line: str) -> None:
    if line not in _announced:
        _announced.add(line)
        _write(line + "\n", sys.stderr)


# ------------------------------------------------------------------- the process group

# Backends torch.distributed knows by name (torch 2.13: Backend.backend_list).
_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")


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
    simulated = bool(env.get(_SIMULATE_ENV, "").strip())
    cuda = not simulated and torch.cuda.is_available()
    if wanted is None:
        wanted = "nccl" if cuda else "gloo"
    if "nccl" in wanted and simulated:
        _announce(
            f"[nbgpu] simulated fleet {env[_SIMULATE_ENV].strip()!r}: backend {wanted!r} "
            "runs as 'gloo' on CPU"
        )
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
    unknown = [n for n in names if n not in _BACKENDS]
    if not text or unknown:
        raise UserInputError(
            f"backend {backend!r} is not a torch.distributed backend; expected one of "
            f"{', '.join(_BACKENDS)} (or None: nccl on CUDA, gloo on CPU)"
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


# ------------------------------------------------------------------ serialised blocks


@contextlib.contextmanager
def one_at_a_time(
    name: str = "imports", environ: Mapping[str, str] | None = None
) -> Iterator[None]:
    """Run the block in one rank of this node at a time (a file lock).

    Eight ranks importing and compiling at once can exhaust host memory
    (``std::bad_alloc``); taking turns bounds the peak to one rank's. The lock lives in
    ``NBGPU_RUN_DIR`` (else a private temporary directory keyed by
    ``TORCHELASTIC_RUN_ID``) and carries the host name, so ranks on other nodes do not
    wait even when the run directory is shared. ``[rank N] LOCK:`` lines on stderr say
    who waits, holds and releases.
    """
    from filelock import FileLock, Timeout  # noqa: PLC0415  (only ranks that serialise)

    if not _LOCK_NAME.fullmatch(name):
        raise UserInputError(
            f"lock name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    env = _env(environ)
    who = f"[rank {rank(env) if _in_job(env) else 0}]"
    path = _lock_dir(env) / f"{name}.{socket.gethostname()}.lock"
    lock = FileLock(str(path))
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
        # Said just before releasing, so that in the merged output of all ranks each
        # "released" comes before the next rank's "acquired".
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
    info = base.lstat()
    # /tmp is shared: refuse a directory someone else made (or a symlink) for our locks.
    if not base.is_dir() or base.is_symlink() or info.st_uid != os.getuid():
        raise UserInputError(f"lock directory {base} is not a private directory of this user")
    directory = base / run_id
    directory.mkdir(mode=0o700, exist_ok=True)
    return directory


# -------------------------------------------------------------------- the memory limit


def parse_size(size: int | str) -> int:
    """Bytes from ``60G``, ``512M``, ``1.5GiB`` or a plain number of bytes.

    Suffixes K, M, G, T are powers of 1024 (``KB``/``KiB`` alike), as ``ulimit`` and
    ``--mem-limit`` mean them.
    """
    if isinstance(size, bool) or not isinstance(size, int | str):
        raise UserInputError(f"memory limit {size!r} is not a size; expected {_SIZE_FORM}")
    if isinstance(size, int):
        number, unit = float(size), ""
    else:
        m = _SIZE.fullmatch(size.strip())
        if m is None:
            raise UserInputError(f"memory limit {size!r} is not a size; expected {_SIZE_FORM}")
        number, unit = float(m.group(1)), m.group(2).upper()
    scale = 1024 ** " KMGT".index(unit or " ")
    value = int(number * scale)
    if value <= 0:
        raise UserInputError(f"memory limit {size!r} is not above zero; expected {_SIZE_FORM}")
    return value


def set_memory_limit(size: int | str) -> int:
    """Cap this rank's address space (``RLIMIT_AS``, soft limit) and return it in bytes.

    Past the cap, allocations fail inside this rank (``MemoryError``, ``std::bad_alloc``)
    instead of the host's OOM killer taking a random process. The hard limit
    stays, so the rank may raise its own cap again. Mind that CUDA reserves a large
    virtual address range at initialisation: on real GPUs the cap must leave room for it.
    """
    import resource  # noqa: PLC0415  (POSIX only, and only when asked)

    limit = parse_size(size)
    current = _address_space_bytes()
    if current is not None and limit <= current:
        raise UserInputError(
            f"memory limit {size!r} ({_gib(limit)}) is below this rank's current address "
            f"space ({_gib(current)}): it would fail at once; expected more, e.g. 60G"
        )
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY and limit > hard:
        raise UserInputError(
            f"memory limit {size!r} ({_gib(limit)}) is above the hard limit {_gib(hard)} "
            "that this process may not raise; expected at most that"
        )
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return limit


def _address_space_bytes() -> int | None:
    # Linux: VmSize in /proc/self/status is exactly what RLIMIT_AS counts.
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return None


def _gib(value: int) -> str:
    return f"{value / 1024**3:.2f} GiB"
