"""Which physical GPU ``cuda:N`` means: ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``.

Given the GPUs NVML reports and a process environment: which logical CUDA ordinals exist,
and which GPU (NVML index, UUID, MIG instance) each is. Answered as CUDA does (the CUDA
env-var docs, PyTorch's ``_parse_visible_devices`` and ``_transform_uuid_to_ordinals``,
nvitop, datadog-agent's ``pkg/gpu/cuda/env.go``):

- unset means every GPU; an empty value means none;
- entries are indices (read like ``strtoul``: ``1gpu2`` is 1), ``GPU-`` UUIDs or unique UUID
  prefixes, ``MIG-<uuid>`` or legacy ``MIG-GPU-<uuid>/<gi>/<ci>``;
- the first invalid entry ends the list; a device named twice empties it;
- indices count in CUDA order (fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``), with
  MIG-enabled GPUs listed last, each as its first MIG instance;
- a process sees at most one MIG instance, and then nothing else.

Everything CUDA would do silently is said in ``VisibleMap.problems``; ``strict=True`` turns a
mistake that hides a device the user named into a one-line ``VisibleDevicesError``. Pure
functions, no I/O.
"""

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nbgpu._render import Block, Bullets, Line, Result
from nbgpu.errors import VisibleDevicesError

__all__ = [
    "FASTEST_FIRST", "ORDERS", "PCI_BUS_ID", "GpuIdentity", "VisibleDevice", "VisibleMap",
    "gpu_identities", "normalize_pci_bus_id", "resolve_visible",
]  # fmt: skip

FASTEST_FIRST = "FASTEST_FIRST"
PCI_BUS_ID = "PCI_BUS_ID"
#: The values CUDA accepts in ``CUDA_DEVICE_ORDER``; the first is its default.
ORDERS = (FASTEST_FIRST, PCI_BUS_ID)

# strtoul: optional sign, leading decimal digits, and whatever follows (which CUDA ignores).
_ORDINAL = re.compile(r"([+-]?)(\d+)(.*)", re.DOTALL)
_HEX = re.compile(r"[0-9a-fA-F-]+")
_LEGACY_MIG = re.compile(r"MIG-(GPU-[0-9a-fA-F-]+)/(\d+)/(\d+)")
_PCI = re.compile(r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])")
# The entries CUDA takes, each with what it resolves to; the entry is None when unset.
_Chosen = list[tuple[str | None, "_Target"]]


@dataclass(frozen=True)
class GpuIdentity:
    """What the parser needs to know about one physical GPU (as NVML reports it)."""

    nvml_index: int
    uuid: str  # "GPU-xxxxxxxx-xxxx-..."
    pci_bus_id: str  # NVML form "00000000:18:00.0"; compared after normalize_pci_bus_id
    compute_capability: tuple[int, int] = (8, 0)
    mig_enabled: bool = False
    mig_uuids: tuple[str, ...] = ()  # "MIG-<uuid>" children, in NVML order
    # (gpu_instance_id, compute_instance_id) of each child, parallel to mig_uuids; only the
    # legacy MIG-GPU-<uuid>/<gi>/<ci> form needs them.
    mig_instance_ids: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class VisibleDevice:
    cuda_index: int  # logical ordinal, cuda:N
    nvml_index: int  # physical GPU (NVML index, = nvidia-smi index)
    uuid: str  # the physical GPU's UUID
    mig_uuid: str | None = None  # set when this logical device is a MIG instance


@dataclass(frozen=True)
class VisibleMap(Result):
    """The logical CUDA devices a process with a given environment sees."""

    raw: str | None  # the CUDA_VISIBLE_DEVICES value (None = unset)
    order: str  # "FASTEST_FIRST" or "PCI_BUS_ID" (from CUDA_DEVICE_ORDER)
    devices: tuple[VisibleDevice, ...]
    stopped_at: str | None  # the first invalid entry, where CUDA stops enumerating
    problems: tuple[str, ...]  # sentences for users: the value, and what is accepted
    key: str = "CUDA_VISIBLE_DEVICES"

    def physical(self, cuda_index: int) -> VisibleDevice | None:
        """The device behind ``cuda:<cuda_index>``, or None if CUDA has no such ordinal."""
        return self.devices[cuda_index] if 0 <= cuda_index < len(self.devices) else None

    def cuda_index_of(self, nvml_index: int) -> int | None:
        """The first logical ordinal that uses physical GPU ``nvml_index``, if any."""
        return next((d.cuda_index for d in self.devices if d.nvml_index == nvml_index), None)

    def content(self) -> list[Block]:
        setting = f"{self.key}={self.raw!r}" if self.raw is not None else f"{self.key} unset"
        blocks: list[Block] = [Line(f"{setting}, order {self.order}", wrap=False)]
        for d in self.devices:
            instance = f" {_short_uuid(d.mig_uuid)}" if d.mig_uuid else ""
            where = f"GPU {d.nvml_index}{instance} ({_short_uuid(d.uuid)})"
            blocks.append(Line(f"cuda:{d.cuda_index} -> {where}", wrap=False))
        if not self.devices:
            blocks.append(Line("CUDA sees no GPU", wrap=False))
        if self.stopped_at is not None:
            blocks.append(Line(f"CUDA stops reading at entry {self.stopped_at!r}", wrap=False))
        # Wrapped at spaces only: a broken UUID cannot be copied back into the environment.
        return [*blocks, Bullets(self.problems, marker="! ", level="warn")]


@dataclass(frozen=True)
class _Target:
    gpu: GpuIdentity
    mig_uuid: str | None = None

    def describe(self) -> str:
        if self.mig_uuid:
            return f"MIG instance {_short_uuid(self.mig_uuid)} of GPU {self.gpu.nvml_index}"
        return f"GPU {self.gpu.nvml_index}"


@dataclass(frozen=True)
class _Bad:
    reason: str
    accepted: str


def normalize_pci_bus_id(bus_id: str) -> str:
    """``00000000:3B:00.0`` (NVML) and ``0000:3b:00.0`` (CUDA, sysfs) -> ``0000:3b:00.0``."""
    fields = _pci_fields(bus_id)
    return bus_id.strip().lower() if fields is None else "{:04x}:{:02x}:{:02x}.{:x}".format(*fields)


def gpu_identities(gpus: Iterable[Any]) -> list[GpuIdentity]:
    """Identities from inventory GPUs (anything with the inventory's attribute names)."""
    return [
        GpuIdentity(
            nvml_index=g.nvml_index,
            uuid=g.uuid or f"GPU-unknown-{g.nvml_index}",
            pci_bus_id=g.pci_bus_id or "",
            compute_capability=g.compute_capability or (0, 0),
            mig_enabled=bool(g.mig_enabled),
            mig_uuids=tuple(m.uuid for m in g.mig_devices),
        )
        for g in gpus
    ]


def resolve_visible(
    gpus: Sequence[GpuIdentity],
    environ: Mapping[str, str],
    *,
    key: str = "CUDA_VISIBLE_DEVICES",
    strict: bool = False,
) -> VisibleMap:
    """Map each logical ``cuda:N`` of a process with ``environ`` to a physical GPU; raises
    only if ``strict``, for an entry CUDA would drop (invalid, repeated, or a hidden MIG)."""
    raw = environ.get(key)
    problems: list[str] = []
    requested = (environ.get("CUDA_DEVICE_ORDER") or "").strip()
    order = requested if requested in ORDERS else FASTEST_FIRST
    if requested and requested not in ORDERS:
        value = environ["CUDA_DEVICE_ORDER"]
        problems.append(
            f"CUDA_DEVICE_ORDER={value!r} is not {' or '.join(ORDERS)}: CUDA uses {FASTEST_FIRST}"
        )
    # What integer entries index into (observed by datadog on CUDA 12.4): GPUs without MIG
    # first, then each MIG-enabled GPU as its first MIG instance (none: not listed at all).
    ordered = _cuda_order(gpus, order)
    slots = [_Target(g) for g in ordered if not g.mig_enabled]
    slots += [_Target(g, g.mig_uuids[0]) for g in ordered if g.mig_enabled and g.mig_uuids]

    def fail(message: str) -> None:
        if strict:
            raise VisibleDevicesError(message)

    chosen: _Chosen = []
    stopped_at = None
    used_indices = raw is None
    if raw is None:
        chosen = [(None, slot) for slot in slots]
        problems.extend(_mig_numbering(gpus))
    elif raw.strip():
        entries = [e.strip() for e in raw.split(",")]
        for pos, entry in enumerate(entries):
            found, by_index = _resolve_entry(entry, gpus, slots, f"{key}={raw!r}", problems)
            if isinstance(found, _Bad):
                stopped_at = entry
                line = f"{key}={raw!r}: entry {entry!r} {found.reason} ({found.accepted})"
                hidden = [e for e in entries[pos + 1 :] if e]
                if entry or hidden:  # a trailing empty entry hides nothing
                    fail(line)
                tail = f" and also hides {', '.join(map(repr, hidden))}" if hidden else ""
                problems.append(f"{line}; CUDA stops there{tail}")
                break
            first = next((e for e, t in chosen if t == found), None)
            if first is not None:
                what = found.describe()
                fail(f"{key}={raw!r}: entry {entry!r} repeats {what} (name each device once)")
                named = "" if first == entry else f" ({first!r} and {entry!r})"
                problems.append(
                    f"{key}={raw!r} names {what} twice{named}: CUDA then sees no GPU at all"
                )
                chosen = []
                break
            chosen.append((entry, found))
            used_indices = used_indices or by_index

    chosen = _one_mig_instance(chosen, key, raw, problems, fail)
    # Warn about the heuristic only when it decided something and nobody asked for it.
    if order == FASTEST_FIRST and used_indices and requested != FASTEST_FIRST:
        problems.extend(_heuristic_warning(gpus))
    devices = tuple(
        VisibleDevice(n, t.gpu.nvml_index, t.gpu.uuid, t.mig_uuid)
        for n, (_, t) in enumerate(chosen)
    )
    return VisibleMap(raw, order, devices, stopped_at, tuple(problems), key)


def _pci_fields(bus_id: str) -> tuple[int, ...] | None:
    """(domain, bus, device, function) of a bus id in NVML's or CUDA's form."""
    m = _PCI.fullmatch(bus_id.strip())
    return None if m is None else tuple(int(g or "0", 16) for g in m.groups())


def _cuda_order(gpus: Sequence[GpuIdentity], order: str) -> list[GpuIdentity]:
    def key(g: GpuIdentity) -> tuple[object, ...]:
        # CUDA's "fastest first" heuristic: higher compute capability first, then bus order.
        major, minor = (0, 0) if order == PCI_BUS_ID else g.compute_capability
        fields = _pci_fields(g.pci_bus_id)
        bus = (1,) if fields is None else (0, *fields)  # one not from NVML goes last
        return (-major, -minor, bus, g.nvml_index)

    return sorted(gpus, key=key)


def _mig_numbering(gpus: Sequence[GpuIdentity]) -> list[str]:
    """With the variable unset, say how MIG changes the list (once per MIG-enabled GPU)."""
    notes = []
    for g in gpus:
        if g.mig_enabled and g.mig_uuids:
            notes.append(
                f"GPU {g.nvml_index} has MIG enabled: CUDA sees only its first MIG instance, "
                f"{_short_uuid(g.mig_uuids[0])}"
            )
        elif g.mig_enabled:
            notes.append(f"GPU {g.nvml_index} has MIG enabled but no MIG instance: CUDA skips it")
    return notes


def _one_mig_instance(
    chosen: _Chosen, key: str, raw: str | None, problems: list[str], fail: Callable[[str], None]
) -> _Chosen:
    """CUDA enumerates a single MIG instance, and then no other device (datadog, CUDA 12.4)."""
    first = next((i for i, (_, t) in enumerate(chosen) if t.mig_uuid), None)
    if first is None or len(chosen) == 1:
        return chosen
    kept = chosen[first][1]
    hidden = [(e, t) for i, (e, t) in enumerate(chosen) if i != first]
    if raw is None:
        names = ", ".join(t.describe() for _, t in hidden)
        problems.append(
            f"{key} is unset: CUDA enumerates only one MIG instance per process, so it sees "
            f"{kept.describe()} alone and hides {names}"
        )
    else:
        entries = [e for e, _ in hidden]
        fail(
            f"{key}={raw!r}: entry {entries[0]!r} is hidden because CUDA enumerates only one "
            "MIG instance per process (one MIG device alone, or whole GPUs only)"
        )
        problems.append(
            f"{key}={raw!r} includes {kept.describe()}: CUDA enumerates only one MIG instance "
            f"per process and then hides {', '.join(map(repr, entries))}"
        )
    return [chosen[first]]


def _heuristic_warning(gpus: Sequence[GpuIdentity]) -> list[str]:
    capabilities = sorted({g.compute_capability for g in gpus}, reverse=True)
    if len(capabilities) < 2:
        return []
    listed = ", ".join(f"{major}.{minor}" for major, minor in capabilities)
    warning = (
        f"CUDA numbers these mixed GPUs (compute capability {listed}) fastest first by its own "
        "heuristic, not in nvidia-smi's order; set CUDA_DEVICE_ORDER=PCI_BUS_ID so that "
        "indices follow nvidia-smi"
    )
    return [warning]


def _accepted(count: int) -> str:
    if count == 0:
        return "this machine has no GPU CUDA can use"
    if count == 1:
        return "index 0 or a GPU UUID"
    return f"indices 0-{count - 1} or GPU UUIDs"


def _resolve_entry(
    entry: str, gpus: Sequence[GpuIdentity], slots: list[_Target], setting: str, problems: list[str]
) -> tuple[_Target | _Bad, bool]:
    """The entry's target; the flag says it was read as an index (so CUDA order matters)."""
    if not entry:
        return _Bad("is empty", _accepted(len(slots))), False
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
    return _Bad("is neither a GPU index nor a GPU UUID", _accepted(len(slots))), False


def _by_index(
    entry: str, number: re.Match[str], slots: Sequence[_Target], setting: str, problems: list[str]
) -> _Target | _Bad:
    index = int(number.group(1) + number.group(2))  # "-0" is 0, as strtoul reads it
    if index < 0:
        return _Bad("is negative", _accepted(len(slots)))
    if index >= len(slots):
        return _Bad("is not a GPU on this machine", _accepted(len(slots)))
    slot = slots[index]
    if slot.mig_uuid:
        problems.append(
            f"{setting}: entry {entry!r} is {slot.describe()}: CUDA numbers MIG-enabled GPUs "
            "after the others, each as its first MIG instance"
        )
    return slot


def _known(uuids: Sequence[str]) -> str:
    shown = ", ".join(_short_uuid(u) for u in uuids[:8])
    return f"{shown}, ..." if len(uuids) > 8 else shown or "see nvidia-smi -L"


def _by_uuid(
    entry: str, prefix: str, gpus: Sequence[GpuIdentity], setting: str, problems: list[str]
) -> _Target | _Bad:
    matches = [g for g in gpus if g.uuid.startswith(prefix)]
    if not matches:
        return _Bad("matches no GPU UUID on this machine", _known([g.uuid for g in gpus]))
    if len(matches) > 1:
        which = " and ".join(f"GPU {g.nvml_index}" for g in matches)
        return _Bad(f"is ambiguous: it starts the UUIDs of {which}", "a longer, unique UUID prefix")
    gpu = matches[0]
    if not gpu.mig_enabled:
        return _Target(gpu)
    if not gpu.mig_uuids:
        return _Bad(
            f"names GPU {gpu.nvml_index}, which has MIG enabled but no MIG instance",
            "create a MIG instance, or disable MIG on it",
        )
    problems.append(
        f"{setting}: entry {entry!r} names GPU {gpu.nvml_index}, which has MIG enabled: CUDA "
        f"uses its first MIG instance, {_short_uuid(gpu.mig_uuids[0])}"
    )
    return _Target(gpu, gpu.mig_uuids[0])


def _mig(entry: str, gpus: Sequence[GpuIdentity]) -> _Target | _Bad:
    instances = [(g, m) for g in gpus if g.mig_enabled for m in g.mig_uuids]
    matches = [(g, m) for g, m in instances if m.startswith(entry)]
    if not matches:
        return _Bad("matches no MIG instance on this machine", _known([m for _, m in instances]))
    if len(matches) > 1:
        which = ", ".join(_short_uuid(m) for _, m in matches)
        return _Bad(f"is ambiguous: it starts {which}", "a longer, unique MIG UUID prefix")
    return _Target(*matches[0])


def _legacy_mig(entry: str, gpus: Sequence[GpuIdentity]) -> _Target | _Bad:
    m = _LEGACY_MIG.fullmatch(entry)
    if m is None:
        return _Bad("is not a MIG device", "MIG-<uuid> or MIG-GPU-<uuid>/<gi>/<ci>")
    parents = [g for g in gpus if g.uuid.startswith(m.group(1))]
    if len(parents) != 1:
        found = "no GPU" if not parents else f"{len(parents)} GPUs"
        return _Bad(f"names {found} on this machine", _known([g.uuid for g in gpus]))
    gpu, ids = parents[0], (int(m.group(2)), int(m.group(3)))
    if not gpu.mig_enabled:
        return _Bad(
            f"names GPU {gpu.nvml_index}, which does not have MIG enabled",
            f"its GPU UUID, {_short_uuid(gpu.uuid)}",
        )
    if not gpu.mig_instance_ids:
        # The fleet did not say which instance has which GI/CI: trust the entry as written.
        return _Target(gpu, f"MIG-{gpu.uuid}/{ids[0]}/{ids[1]}")
    for mig_uuid, instance in zip(gpu.mig_uuids, gpu.mig_instance_ids, strict=False):
        if instance == ids:
            return _Target(gpu, mig_uuid)
    existing = ", ".join(f"{gi}/{ci}" for gi, ci in gpu.mig_instance_ids)
    return _Bad(f"names no MIG instance of GPU {gpu.nvml_index}", f"GI/CI {existing}")


def _short_uuid(uuid: str) -> str:
    """``GPU-1d0c23ba-38ae-...`` -> ``GPU-1d0c23ba``; legacy MIG ids keep their ``/gi/ci``."""
    if uuid.startswith("MIG-GPU-"):
        head, _, instance = uuid.partition("/")
        return f"MIG-{_short_uuid(head[4:])}/{instance}"
    kind, _, rest = uuid.partition("-")
    return f"{kind}-{rest.split('-')[0]}" if rest else uuid
