"""nbgpu's exceptions: a small tree under :class:`NbgpuError`, so callers can catch by meaning.

User mistakes render as one line in a notebook (``_render_traceback_``) and in the
CLI (exit code 2); only bugs show a traceback. This module imports nothing else of
nbgpu and may be imported from every layer; :func:`user_path` is here for that reason.
"""

import os
from pathlib import Path

__all__ = ["FleetSpecError", "GpuLostError", "NbgpuError", "NvmlError", "NvmlPermissionError",
           "NvmlUnavailable", "ProbeError", "UserInputError", "VisibleDevicesError",
           "user_path"]  # fmt: skip


class NbgpuError(Exception):
    """Base of every error nbgpu raises on purpose."""

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of printing a traceback: one readable line.
        return [f"{type(self).__name__}: {self}"]


class UserInputError(NbgpuError, ValueError):
    """A user's value nbgpu cannot accept; the message names it and the accepted form."""


def user_path(text: str | os.PathLike[str]) -> Path:
    """A path a user wrote, ``~`` expanded; ``~name`` with no such user is a UserInputError."""
    try:
        return Path(text).expanduser()
    except RuntimeError:  # pathlib: "Could not determine home directory"
        user = os.fspath(text).split("/")[0]
        raise UserInputError(
            f"{os.fspath(text)!r}: no user {user[1:]!r} here: write the path"
        ) from None


class FleetSpecError(UserInputError):
    """An ``NBGPU_SIMULATE`` spec, scenario name or fleet JSON file is malformed."""


class VisibleDevicesError(UserInputError):
    """A ``CUDA_VISIBLE_DEVICES`` value cannot be resolved."""


class NvmlError(NbgpuError):
    """The NVIDIA management library reported an error; ``code`` is its ``NVML_ERROR_*``."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class NvmlUnavailable(NvmlError):
    """NVML cannot be used at all: no library, no driver, or a version mismatch."""


class NvmlPermissionError(NvmlError):
    """NVML refused access (cgroup device rules, container without the runtime)."""


class GpuLostError(NvmlError):
    """The GPU has fallen off the bus (Xid 79) or is otherwise inaccessible."""


class ProbeError(NbgpuError):
    """The active health probe could not be run (not: a GPU failed it)."""
