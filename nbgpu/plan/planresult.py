"""The plan itself: roles on GPUs, batch and memory checks, problems, alternatives.

Renders as text and HTML, converts with ``to_frame()``/``to_json()``, and reads back a
plan file (``nbgpu plan --json``) for ``nbgpu run --plan``. Pure data; never reads the
inventory nor binds sockets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from html import escape
from typing import Any, ClassVar

from nbgpu._render import Result, Table, fix_html, fixes_html, fmt_bytes, title_html, wrap
from nbgpu._serial import from_data, to_data
from nbgpu.errors import UserInputError
from nbgpu.plan.batch import BatchCheck
from nbgpu.plan.result import (
    ExcludedGpu,
    Issue,
    MemoryCheck,
    RolePlan,
    fit_title,
    notes_html,
    notes_text,
)

__all__ = ["PLAN_FORMAT", "Alternative", "Plan", "plan_from_dict"]

PLAN_FORMAT = 1


@dataclass(frozen=True)
class Alternative:
    """Another way to run the job when this plan cannot: a ready plan, or steps first."""

    title: str
    reason: str
    fixes: tuple[str, ...] = ()
    plan: Plan | None = None


@dataclass(frozen=True)
class Plan(Result):
    """A launchable answer: which GPUs each role gets, in what order, on which port.

    What launchers read (``%%torchrun --plan p``, ``nbgpu run --plan FILE``):

    - ``ok``: no blocking problem; launch only then.
    - ``roles``: per role ``name``, ``kind``, ``gpus`` (each with ``nvml_index``, ``uuid``
      and ``cuda_index``, the logical order), ``nvml_indices``, ``uuids``,
      ``cuda_visible_devices`` (NVML indices in order; valid with
      ``CUDA_DEVICE_ORDER=PCI_BUS_ID``), ``nproc_per_node``, ``master_port`` and ``env``
      (the variables to set, including ``CUDA_DEVICE_ORDER``).
    - ``cuda_visible_devices``: all roles' GPUs in role order, for launchers that take
      one list and split it by position (AReaL): logical device 0 is the first role's.
    - ``problems`` (blocking) and ``warnings``: each an ``Issue`` with ``code``,
      ``message`` (the reason) and ``fixes``.

    Also: ``excluded`` (GPUs left out, and why), ``batch`` (divisibility, nearest valid
    values, micro/accumulation splits), ``memory`` (per-GPU model states versus free
    memory), ``alternatives`` (ready plans or steps when this one cannot run).
    """

    JSON_EXTRAS: ClassVar[tuple[str, ...]] = ("ok", "cuda_visible_devices")

    allocation: str  # canonical allocation: "sglang.d1t1p1+d3t1p1"
    roles: tuple[RolePlan, ...]
    problems: tuple[Issue, ...]
    warnings: tuple[Issue, ...]
    excluded: tuple[ExcludedGpu, ...]
    batch: BatchCheck | None
    memory: tuple[MemoryCheck, ...]
    alternatives: tuple[Alternative, ...]
    fleet: str  # where the inventory came from: host name or fleet name
    simulated: bool
    name: str | None = None  # a sweep's run name ("run0")

    @property
    def ok(self) -> bool:
        return not self.problems

    def simulated_fleet(self) -> str | None:
        return self.fleet if self.simulated else None

    @property
    def cuda_visible_devices(self) -> str:
        # A colocated role runs on GPUs already listed: each GPU appears once.
        return ",".join(
            r.cuda_visible_devices for r in self.roles if r.gpus and r.colocated_with is None
        )

    def role(self, name: str) -> RolePlan:
        for role in self.roles:
            if role.name == name:
                return role
        raise KeyError(f"{name!r}: roles are {', '.join(r.name for r in self.roles)}")

    # -- rendering ---------------------------------------------------------------

    def _title(self) -> str:
        source = f"SIMULATED fleet '{self.fleet}'" if self.simulated else f"host {self.fleet}"
        run = f"{self.name}: " if self.name else ""
        verdict = "ready" if self.ok else "NOT READY"
        return f"nbgpu plan — {run}{self.allocation} on {source} · {verdict}"

    def _role_table(self) -> Table:
        table = Table(["role", "kind", "degrees", "GPUs (CUDA_VISIBLE_DEVICES)", "nproc", "port"])
        for r in self.roles:
            table.add(
                r.name,
                r.kind,
                r.degrees,
                r.cuda_visible_devices or "-",
                r.nproc_per_node,
                "-" if r.master_port is None else r.master_port,
                level="" if r.gpus else "bad",
            )
        return table

    def _memory_table(self) -> Table:
        table = Table(["role", "term", "per GPU", "formula"], flex=3)
        for m in self.memory:
            for line in m.lines:
                table.add(m.role, line.component, fmt_bytes(line.bytes_per_gpu), line.formula)
            for missing in m.not_estimated:
                name, _, why = missing.partition(" (")
                table.add(m.role, name, "?", why.rstrip(")"), level="warn")
            free = (
                "free: ?"
                if m.available_bytes is None
                else f"free {fmt_bytes(m.available_bytes)} on GPU {m.deciding_gpu}"
            )
            fits = {True: "fits", False: "does NOT fit", None: "not compared"}[m.fits]
            level = "bad" if m.fits is False else ("warn" if m.tight else "")
            table.add(m.role, "total", fmt_bytes(m.needed_bytes), f"{fits}: {free}", level=level)
        return table

    def _memory_lines(self) -> list[str]:
        lines = []
        for m in self.memory:
            if len(m.gpu_free) > 1:
                each = ", ".join(f"GPU {i} {fmt_bytes(b)}" for i, b in m.gpu_free)
                lines.append(wrap(f"free memory {m.role}: {each} (the smallest decides)", ""))
            if m.max_micro_batch is not None:
                lines.append(
                    wrap(
                        f"largest micro batch {m.role}: {m.max_micro_batch} within GPU "
                        f"{m.deciding_gpu}'s free memory (computed from the estimate, no "
                        "trials)",
                        "",
                    )
                )
        return lines

    def _excluded_lines(self) -> list[str]:
        return [
            wrap(f"GPU {e.nvml_index} ({e.health}): {e.reasons[0] if e.reasons else ''}", "  ")
            for e in self.excluded
        ]

    @staticmethod
    def _alternative_head(alt: Alternative) -> str:
        status = ""
        if alt.plan is not None:
            status = " — ready" if alt.plan.ok else " — also blocked"
        return f"{alt.title}{status}: {alt.reason}"

    def _alternative_lines(self) -> list[str]:
        lines = []
        for n, alt in enumerate(self.alternatives, 1):
            lines.append(wrap(self._alternative_head(alt), f"  {n}. "))
            lines.extend(wrap(fix, "       ") for fix in alt.fixes)
        return lines

    def _alternatives_html(self) -> str:
        # One numbered item per alternative; its steps are a sub-list of that item.
        items = "".join(
            f"<li>{fix_html(self._alternative_head(alt))}{fixes_html(alt.fixes)}</li>"
            for alt in self.alternatives
        )
        return f"<div>alternatives:<ol>{items}</ol></div>"

    def _footer(self) -> list[str]:
        lines = []
        if self.batch is not None and self.batch.ok:
            lines.append(f"batch: {self.batch.summary}")
        if self.memory:
            lines.extend(wrap(f"memory {m.role}: {m.accounting}", "") for m in self.memory)
            lines.extend(self._memory_lines())
            if any(m.not_estimated for m in self.memory):
                lines.append(
                    wrap(
                        "memory terms marked ? need the model's shape (a name such as "
                        "'Qwen/Qwen2.5-7B-Instruct' or an HF config.json) and seq_len",
                        "  ",
                    )
                )
        elif self.roles and self.roles[0].gpus:
            lines.append("memory: not checked (pass model= to compare with free memory)")
        if self.cuda_visible_devices and len(self.roles) > 1:
            first = self.roles[0]
            lines.append(
                wrap(
                    f"one-list form: CUDA_VISIBLE_DEVICES={self.cuda_visible_devices} "
                    f"(logical device 0 = GPU {first.nvml_indices[0]}, role {first.name})",
                    "",
                )
            )
        if any(r.gpus for r in self.roles):
            lines.append("GPU numbers are nvidia-smi's: each role's env sets PCI_BUS_ID order.")
        return lines

    def text(self) -> str:
        lines = [fit_title(self._title()), self._role_table().text()]
        if self.excluded:
            lines.append("left out:")
            lines.extend(self._excluded_lines())
        lines.extend(self._footer())
        if self.memory:
            lines.append(self._memory_table().text())
        notes = notes_text(self.problems, self.warnings)
        if notes:
            lines.append("")
            lines.extend(notes)
        if self.alternatives:
            lines.append("alternatives:")
            lines.extend(self._alternative_lines())
        return "\n".join(lines)

    def html_body(self) -> str:
        title = title_html(self._title(), simulated=self.simulated)
        parts = [f"<b>{title}</b>", self._role_table().html()]
        if self.roles and any(r.gpus for r in self.roles):
            uuids = Table(["role", "cuda", "GPU", "UUID", "name", "free"])
            for r in self.roles:
                for g in r.gpus:
                    uuids.add(
                        r.name,
                        g.cuda_index,
                        g.nvml_index,
                        g.uuid or "-",
                        (g.name or "-").replace("NVIDIA ", ""),
                        fmt_bytes(g.memory_free_bytes),
                    )
            parts.append(uuids.html())
        if self.excluded:
            items = "".join(
                f"<li>GPU {e.nvml_index} ({escape(e.health)}): {fix_html(' '.join(e.reasons))}"
                f"{fixes_html(e.fixes)}</li>"
                for e in self.excluded
            )
            parts.append(f"<div>left out:<ul>{items}</ul></div>")
        parts.append("".join(f"<div>{fix_html(line)}</div>" for line in self._footer()))
        if self.memory:
            parts.append(self._memory_table().html())
        parts.append(notes_html(self.problems, self.warnings))
        if self.alternatives:
            parts.append(self._alternatives_html())
        return "".join(parts)

    # -- data --------------------------------------------------------------------

    def records(self) -> list[dict[str, Any]]:
        rows = []
        for r in self.roles:
            base = {
                "plan": self.name,
                "role": r.name,
                "kind": r.kind,
                "degrees": r.degrees,
                "nproc_per_node": r.nproc_per_node,
                "master_port": r.master_port,
                "cuda_visible_devices": r.cuda_visible_devices,
                "ok": self.ok,
                "simulated": self.simulated,
            }
            if not r.gpus:
                rows.append({**base, "cuda_index": None, "nvml_index": None, "uuid": None})
            rows.extend(
                {
                    **base,
                    "cuda_index": g.cuda_index,
                    "nvml_index": g.nvml_index,
                    "uuid": g.uuid,
                    "name": g.name,
                    "memory_total_bytes": g.memory_total_bytes,
                    "memory_free_bytes": g.memory_free_bytes,
                }
                for g in r.gpus
            )
        return rows

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = to_data(self)
        return {"nbgpu_plan": PLAN_FORMAT, **data}


def plan_from_dict(data: Any) -> Plan:
    """Rebuild a :class:`Plan` from ``Plan.to_dict()`` (or its JSON, decoded)."""
    if not isinstance(data, dict):
        raise UserInputError("plan JSON: the top level is not an object")
    fmt = data.get("nbgpu_plan")
    if fmt != PLAN_FORMAT:
        raise UserInputError(
            f"plan JSON: nbgpu_plan = {json.dumps(fmt)}; expected {PLAN_FORMAT} "
            "(write one with `nbgpu plan ... --json > plan.json`)"
        )
    return from_data(Plan, _health_named(data), prefix="plan JSON")


def _health_named(data: Any) -> Any:
    """Plan files written before 0.1 called a left-out GPU's health "verdict": read them too."""
    if isinstance(data, list):
        return [_health_named(item) for item in data]
    if not isinstance(data, dict):
        return data
    out = {key: _health_named(value) for key, value in data.items()}
    if "verdict" in out and "health" not in out and "nvml_index" in out:
        out["health"] = out.pop("verdict")
    return out
