"""Sizes as users write them and as we print them: one meaning of every unit.

``GiB``/``Gi``/``G`` are powers of 1024 (what ``ulimit``, SLURM's ``--mem=80G``,
``free -g`` and nvidia-smi's MiB mean); ``GB`` is a power of 1000 (what SI, disk
vendors and Hugging Face's ``max_memory="80GB"`` mean). So ``80G`` is 80 GiB and
``80GB`` is 74.5 GiB, in ``--mem-limit``, ``nbgpu.estimate(budget=)``,
``plan --gpu-memory`` and ``--keep-bytes`` alike, and every answer that repeats a size
prints its unit (:func:`fmt_bytes`). Standard library only: ranks use it too.
"""

import math
import re

from nbgpu.errors import UserInputError

__all__ = ["SIZE_FORM", "fmt_bytes", "fmt_used_total", "gib", "parse_size"]

SIZE_FORM = (
    "a size in bytes, or with a unit: K/M/G/T or KiB/MiB/GiB/TiB (powers of 1024), "
    "KB/MB/GB/TB (powers of 1000), e.g. 80G, 80GiB, 80GB or 512M"
)

_UNITS: dict[str, int] = {"": 1, "b": 1}
for _power, _prefix in enumerate("kmgt", 1):
    _UNITS[_prefix] = _UNITS[f"{_prefix}i"] = _UNITS[f"{_prefix}ib"] = 1024**_power
    _UNITS[f"{_prefix}b"] = 1000**_power

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?(?:[eE]\+?\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(value: object, label: str = "size ") -> int:
    """Bytes from ``80G``, ``80GiB``, ``80GB``, ``"4096"`` or a whole number of bytes;
    *label* (``"--mem-limit "``, ``"budget="``) starts the one-line error."""
    size: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        # A float is a byte count only when whole (80e9); 1.5 bytes is a mistake.
        if math.isfinite(value) and float(value).is_integer():
            size = float(value)
    elif isinstance(value, str):
        m = _SIZE.fullmatch(value)
        if m and m.group(2).lower() in _UNITS:
            size = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if size is None or not 1 <= size < math.inf:
        raise UserInputError(f"{label}{value!r}: expected {SIZE_FORM}")
    return int(size)


_PRINTED_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def fmt_bytes(value: int | None) -> str:
    """1073741824 → '1.0 GiB'; None → '-'. Binary units, as nvidia-smi's MiB."""
    if value is None:
        return "-"
    size = float(value)
    for unit in _PRINTED_UNITS:
        if abs(size) < 1024 or unit == _PRINTED_UNITS[-1]:
            break
        size /= 1024
    return f"{size:.0f} {unit}" if unit in ("B", "KiB") else f"{size:.1f} {unit}"


def fmt_used_total(used: int | None, total: int | None) -> str:
    """Used and total in the total's unit: '22.5/45.0 GiB' (fits a narrow column)."""
    if total is None:
        return fmt_bytes(used)
    number, unit = fmt_bytes(total).split()
    scale = 1024 ** _PRINTED_UNITS.index(unit)
    used_text = "-" if used is None else f"{used / scale:.1f}"
    return f"{used_text}/{number} {unit}"


def gib(value: float) -> str:
    return f"{value / 1024**3:.2f} GiB"
