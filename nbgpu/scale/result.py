"""The result of scaling a config: each step explained, the plan with its diff,
overrides, rescaled file text and JSON.

Pure rendering over values; never reads files (``files.py`` writes them).
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field, replace
from typing import Any

from nbgpu._render import Blank, Block, Line, Problems, Result, Title
from nbgpu._serial import to_data
from nbgpu.problems import Problem
from nbgpu.scale.kv import KvCheck
from nbgpu.scale.values import override_text, short_text

__all__ = ["ScalePlan", "ScaleStep"]


@dataclass(frozen=True)
class ScaleStep:
    """One recognised key: its value before and after, the rule, and why."""

    key: str  # dotted path, e.g. "actor_rollout_ref.rollout.tensor_model_parallel_size"
    rule: str
    old: Any
    new: Any
    reason: str
    path: tuple[Any, ...] = field(default=(), compare=False, repr=False)  # keys into the config

    @property
    def changed(self) -> bool:
        return bool(self.old != self.new)


@dataclass(frozen=True)
class ScalePlan(Result):
    """A config rescaled from ``from_gpus`` to ``to_gpus`` GPUs.

    ``config`` is the new config as data (a nested mapping, or a list of ``key=value``
    overrides); ``to_text()`` is the new file in its own form and layout (a YAML file keeps
    its comments, a launch script its lines), ``diff()`` compares it with the old one;
    ``steps`` explains every recognised key, changed or not; ``problems`` block, ``warnings``
    do not.
    """

    from_gpus: int
    to_gpus: int
    steps: tuple[ScaleStep, ...]
    problems: tuple[Problem, ...]
    warnings: tuple[Problem, ...]
    kv: KvCheck | None
    config: Any = field(compare=False)
    original: Any = field(compare=False)
    source: str | None = None  # the file it was read from
    form: str = "mapping"  # "mapping" | "overrides" | "yaml" | "json" | "script"
    original_text: str | None = field(default=None, compare=False, repr=False)
    new_text: str | None = field(default=None, compare=False, repr=False)
    written_to: str | None = None  # where save() wrote the new config

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def changes(self) -> tuple[ScaleStep, ...]:
        return tuple(s for s in self.steps if s.changed)

    def to_yaml(self) -> str:
        """The new config as YAML (for a list of overrides: one ``key=value`` per line)."""
        if self.form == "yaml" and self.new_text is not None:
            return self.new_text
        if isinstance(self.config, list):
            return "\n".join(self.config) + "\n"
        from nbgpu.scale.yamldoc import dump_yaml  # noqa: PLC0415  (ruamel: only when asked)

        return dump_yaml(self.config)

    def to_text(self) -> str:
        """The new config in the form it came in: the file's own text, changed values only."""
        return self.new_text if self.new_text is not None else self.to_yaml()

    def save(self, path: str | os.PathLike[str]) -> ScalePlan:
        """Write :meth:`to_text` to *path* (e.g. ``run_8gpu.sh`` next to ``run.sh``).

        Returns the plan with ``written_to`` set, so its text says where the file went.
        """
        from nbgpu.scale.files import write_text  # noqa: PLC0415  (YAML and scripts: heavy)

        write_text(path, self.to_text(), like=self.source)
        return replace(self, written_to=os.fspath(path))

    def to_overrides(self) -> list[str]:
        """The changed keys as Hydra-style ``key=value`` overrides."""
        return [f"{s.key}={override_text(s.new)}" for s in self.changes]

    def diff(self) -> str:
        """A unified diff of the old and the new config, as YAML (or overrides)."""
        if self.original_text is not None and self.new_text is not None:
            old, new = self.original_text.splitlines(), self.new_text.splitlines()
        elif isinstance(self.config, list):
            old, new = self.original, self.config
        else:
            from nbgpu.scale.yamldoc import dump_yaml  # noqa: PLC0415

            old = dump_yaml(self.original).splitlines()
            new = dump_yaml(self.config).splitlines()
        lines = difflib.unified_diff(
            old,
            new,
            fromfile=f"{self.source or 'config'} ({self.from_gpus} GPUs)",
            tofile=f"{self.source or 'config'} ({self.to_gpus} GPUs)",
            lineterm="",
        )
        return "\n".join(lines) + "\n"

    def content(self) -> list[Block]:
        verdict = "ready" if self.ok else "NOT READY"
        src = f" {self.source}" if self.source else ""
        blocks: list[Block] = [
            Title(f"nbgpu plan scale{src}: {self.from_gpus} → {self.to_gpus} GPUs · {verdict}")
        ]
        for s in self.steps:
            change = f"{s.key}: {short_text(s.old)} → {short_text(s.new)}"
            blocks.append(Line(change, indent="* " if s.changed else "  ",
                               level="warn" if s.changed else ""))  # fmt: skip
            blocks.append(Line(s.reason, indent="      "))
        if self.kv is not None:
            blocks.append(Line(self.kv.text))
        if self.written_to is not None:
            blocks.append(Line(f"new config written to {self.written_to}"))
        every = (*self.problems, *self.warnings)
        return blocks + ([Blank(), Problems(every)] if every else [])

    def records(self) -> list[dict[str, Any]]:
        return [
            {
                "key": s.key,
                "rule": s.rule,
                "old": s.old,
                "new": s.new,
                "changed": s.changed,
                "reason": s.reason,
            }
            for s in self.steps
        ]

    def to_dict(self) -> dict[str, Any]:
        # The file's own text is what to_text() and diff() are for; steps say what changed.
        data: dict[str, Any] = {**to_data(self), "ok": self.ok, "steps": self.records()}
        for text in ("original", "original_text", "new_text"):
            del data[text]
        return data
