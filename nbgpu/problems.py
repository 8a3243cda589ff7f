"""One problem with its fixes, the one type every layer reports trouble with, so a
problem reads, renders and serialises the same in ``%gpu_doctor``, ``%gpu_plan``,
``%gpu_diagnose`` and ``nbgpu.estimate``. Standard library only.
"""

from dataclasses import asdict, dataclass
from typing import Literal

__all__ = ["SEVERITIES", "SEVERITY_ORDER", "Problem", "Severity", "worst"]

Severity = Literal["ok", "info", "warn", "bad"]
#: Mildest first; a report sorts and colours by this.
SEVERITIES: tuple[Severity, ...] = ("ok", "info", "warn", "bad")
SEVERITY_ORDER: dict[str, int] = {s: i for i, s in enumerate(SEVERITIES)}


@dataclass(frozen=True)
class Problem:
    """Something the user should know: ``code``, a stable identifier scripts may match on
    (``exclusive_dead_holder``); ``subject``, where (``GPU 0``, ``role trainer``); ``message``
    and ``fixes``, sentences in which `backticked` spans are commands."""

    severity: str  # one of SEVERITIES (checked: files and callers pass plain words)
    code: str
    subject: str
    message: str
    fixes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.severity not in SEVERITY_ORDER:
            raise ValueError(f"severity = {self.severity!r}; expected one of {SEVERITIES}")

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "fixes": list(self.fixes)}


def worst(problems: tuple[Problem, ...] | list[Problem]) -> str:
    """The most severe severity among *problems*; ``ok`` when there are none."""
    return max((p.severity for p in problems), key=SEVERITY_ORDER.__getitem__, default="ok")
