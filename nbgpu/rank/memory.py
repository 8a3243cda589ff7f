"""A per-rank cap on address space (``--mem-limit``).

Standard library only; ``resource`` is imported when a cap is set.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from nbgpu.errors import UserInputError
from nbgpu.sizes import parse_size as _parse_size

__all__ = ["parse_size", "set_memory_limit"]


def parse_size(size: int | str) -> int:
    """Bytes from a memory limit as written (``60G``, ``80GB``; :mod:`nbgpu.sizes`)."""
    return _parse_size(size, "memory limit ")


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
