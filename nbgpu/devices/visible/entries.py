"""How CUDA reads one entry of ``CUDA_VISIBLE_DEVICES``: an index, a UUID, a MIG device.

:func:`resolve_entry` turns one entry into the GPU (or MIG instance) it names, or into
why CUDA rejects it and what it would have accepted; the list as a whole (order, repeats,
the one-MIG-instance rule) is the package's business. Pure functions, standard library.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the package imports this module: only the type is needed here
    from nbgpu.devices.visible import GpuIdentity

__all__ = ["Bad", "Target", "resolve_entry", "short_uuid"]

# strtoul: optional sign, leading decimal digits, and whatever follows (which CUDA ignores).
_ORDINAL = re.compile(r"([+-]?)(\d+)(.*)", re.DOTALL)
_HEX = re.compile(r"[0-9a-fA-F-]+")
_LEGACY_MIG = re.compile(r"MIG-(GPU-[0-9a-fA-F-]+)/(\d+)/(\d+)")


@dataclass(frozen=True)
class Target:
    """What one entry resolves to: a whole GPU, or one MIG instance on it."""

    gpu: GpuIdentity
    mig_uuid: str | None = None

    @property
    def key(self) -> tuple[int, str | None]:
        return (self.gpu.nvml_index, self.mig_uuid)

    def describe(self) -> str:
        if self.mig_uuid:
            return f"MIG instance {short_uuid(self.mig_uuid)} of GPU {self.gpu.nvml_index}"
        return f"GPU {self.gpu.nvml_index}"


@dataclass(frozen=True)
class Bad:
    """Why CUDA rejects an entry, and what it would have accepted."""

    reason: str
    accepted: str


def _accepted(count: int) -> str:
    if count == 0:
        return "this machine has no GPU CUDA can use"
    if count == 1:
        return "index 0 or a GPU UUID"
    return f"indices 0-{count - 1} or GPU UUIDs"


def resolve_entry(
    entry: str,
    gpus: Sequence[GpuIdentity],
    slots: Sequence[Target],
    setting: str,
    problems: list[str],
) -> tuple[Target | Bad, bool]:
    """Resolve one entry; the flag says it was read as an index (so CUDA order matters)."""
    if not entry:
        return Bad("is empty", _accepted(len(slots))), False
    if entry.startswith("MIG-GPU-"):
        return _legacy_mig(entry, gpus), False
    if entry.startswith("MIG-"):
        return _mig(entry, gpus), False
    if entry.startswith("GPU-"):
        return _by_uuid(entry, entry, gpus, setting, problems), False
    number = _ORDINAL.fullmatch(entry)
    if number is not None and not number.group(3):
        return _by_index(entry, number, slots, setting, problems), True
    # A UUID without its "GPU-" prefix; plain digits were taken as an index above.
    if _HEX.fullmatch(entry) and any(g.uuid.startswith("GPU-" + entry) for g in gpus):
        return _by_uuid(entry, "GPU-" + entry, gpus, setting, problems), False
    if number is not None:
        index = int(number.group(1) + number.group(2))
        problems.append(
            f"{setting}: entry {entry!r} is read as index {index}: CUDA ignores everything "
            "after the leading digits"
        )
        return _by_index(entry, number, slots, setting, problems), True
    return Bad("is neither a GPU index nor a GPU UUID", _accepted(len(slots))), False


def _by_index(
    entry: str, number: re.Match[str], slots: Sequence[Target], setting: str, problems: list[str]
) -> Target | Bad:
    index = int(number.group(1) + number.group(2))  # "-0" is 0, as strtoul reads it
    if index < 0:
        return Bad("is negative", _accepted(len(slots)))
    if index >= len(slots):
        return Bad("is not a GPU on this machine", _accepted(len(slots)))
    slot = slots[index]
    if slot.mig_uuid:
        problems.append(
            f"{setting}: entry {entry!r} is {slot.describe()}: CUDA numbers MIG-enabled GPUs "
            "after the others, each as its first MIG instance"
        )
    return slot


def _known(uuids: Sequence[str]) -> str:
    shown = ", ".join(short_uuid(u) for u in uuids[:8])
    return f"{shown}, ..." if len(uuids) > 8 else shown or "see nvidia-smi -L"


def _by_uuid(
    entry: str, prefix: str, gpus: Sequence[GpuIdentity], setting: str, problems: list[str]
) -> Target | Bad:
    matches = [g for g in gpus if g.uuid.startswith(prefix)]
    if not matches:
        return Bad("matches no GPU UUID on this machine", _known([g.uuid for g in gpus]))
    if len(matches) > 1:
        which = " and ".join(f"GPU {g.nvml_index}" for g in matches)
        return Bad(f"is ambiguous: it starts the UUIDs of {which}", "a longer, unique UUID prefix")
    gpu = matches[0]
    if not gpu.mig_enabled:
        return Target(gpu)
    if not gpu.mig_uuids:
        return Bad(
            f"names GPU {gpu.nvml_index}, which has MIG enabled but no MIG instance",
            "create a MIG instance, or disable MIG on it",
        )
    problems.append(
        f"{setting}: entry {entry!r} names GPU {gpu.nvml_index}, which has MIG enabled: CUDA "
        f"uses its first MIG instance, {short_uuid(gpu.mig_uuids[0])}"
    )
    return Target(gpu, gpu.mig_uuids[0])


def _mig(entry: str, gpus: Sequence[GpuIdentity]) -> Target | Bad:
    instances = [(g, m) for g in gpus if g.mig_enabled for m in g.mig_uuids]
    matches = [(g, m) for g, m in instances if m.startswith(entry)]
    if not matches:
        return Bad("matches no MIG instance on this machine", _known([m for _, m in instances]))
    if len(matches) > 1:
        which = ", ".join(short_uuid(m) for _, m in matches)
        return Bad(f"is ambiguous: it starts {which}", "a longer, unique MIG UUID prefix")
    return Target(*matches[0])


def _legacy_mig(entry: str, gpus: Sequence[GpuIdentity]) -> Target | Bad:
    m = _LEGACY_MIG.fullmatch(entry)
    if m is None:
        return Bad("is not a MIG device", "MIG-<uuid> or MIG-GPU-<uuid>/<gi>/<ci>")
    parents = [g for g in gpus if g.uuid.startswith(m.group(1))]
    if len(parents) != 1:
        found = "no GPU" if not parents else f"{len(parents)} GPUs"
        return Bad(f"names {found} on this machine", _known([g.uuid for g in gpus]))
    gpu, ids = parents[0], (int(m.group(2)), int(m.group(3)))
    if not gpu.mig_enabled:
        return Bad(
            f"names GPU {gpu.nvml_index}, which does not have MIG enabled",
            f"its GPU UUID, {short_uuid(gpu.uuid)}",
        )
    if not gpu.mig_instance_ids:
        # The fleet did not say which instance has which GI/CI: trust the entry as written.
        return Target(gpu, f"MIG-{gpu.uuid}/{ids[0]}/{ids[1]}")
    for mig_uuid, instance in zip(gpu.mig_uuids, gpu.mig_instance_ids, strict=False):
        if instance == ids:
            return Target(gpu, mig_uuid)
    existing = ", ".join(f"{gi}/{ci}" for gi, ci in gpu.mig_instance_ids)
    return Bad(f"names no MIG instance of GPU {gpu.nvml_index}", f"GI/CI {existing}")


def short_uuid(uuid: str) -> str:
    """``GPU-1d0c23ba-38ae-...`` -> ``GPU-1d0c23ba``; legacy MIG ids keep their ``/gi/ci``."""
    if uuid.startswith("MIG-GPU-"):
        head, _, instance = uuid.partition("/")
        return f"MIG-{short_uuid(head[4:])}/{instance}"
    kind, _, rest = uuid.partition("-")
    return f"{kind}-{rest.split('-')[0]}" if rest else uuid
