"""CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER resolution (nbgpu.devices.visible).

Cases follow CUDA's env-var docs, PyTorch's own parser tests, nvitop, and datadog-agent's
recorded MIG behaviour; UUIDs are the ones in reference/nvidia.md section 9.2.
"""

from __future__ import annotations

import ast
import inspect
import sys
from dataclasses import dataclass, field

import pytest

from nbgpu.devices import visible
from nbgpu.devices.visible import (
    GpuIdentity,
    VisibleDevice,
    VisibleMap,
    normalize_pci_bus_id,
    resolve_visible,
)
from nbgpu.errors import UserInputError, VisibleDevicesError

UUID_849D = "GPU-849d5a8d-610e-eeea-1fd4-81ff44a23794"
UUID_18EF = "GPU-18ef14e9-dec6-1d7e-1284-3010c6ce98b1"
UUID_96DE = "GPU-96de99c9-d68f-84c8-424c-7c75e59cc0a0"
UUID_3EB7 = "GPU-3eb79704-1571-707c-aee8-f43ce747313d"
UUID_1D0C = "GPU-1d0c23ba-38ae-9977-97c5-ae814c4a83a3"  # the A40 from nvidia-docker #1447
MIG_D184 = "MIG-d184f67c-c95f-5ef2-a935-195bd0094fbd"
MIG_37B5 = "MIG-37b51284-1df4-5451-979d-3231ccb0822e"  # = MIG-GPU-3eb79704/13/0

# Four A40s; "GPU-1" is ambiguous here (GPU-18ef14e9 and GPU-1d0c23ba).
A40S = (
    GpuIdentity(0, UUID_849D, "00000000:18:00.0", (8, 6)),
    GpuIdentity(1, UUID_18EF, "00000000:3B:00.0", (8, 6)),
    GpuIdentity(2, UUID_96DE, "00000000:86:00.0", (8, 6)),
    GpuIdentity(3, UUID_1D0C, "00000000:AF:00.0", (8, 6)),
)
# An A40 on the lowest bus, an H100 (faster: CC 9.0) after it, another A40 last.
MIXED = (
    GpuIdentity(0, UUID_849D, "00000000:18:00.0", (8, 6)),
    GpuIdentity(1, UUID_18EF, "00000000:53:00.0", (9, 0)),
    GpuIdentity(2, UUID_96DE, "00000000:86:00.0", (8, 6)),
)
# Three A100s; the middle one has MIG on with two instances (GI/CI 7/0 and 13/0).
MIG = (
    GpuIdentity(0, UUID_849D, "00000000:07:00.0"),
    GpuIdentity(
        1,
        UUID_3EB7,
        "00000000:0F:00.0",
        mig_enabled=True,
        mig_uuids=(MIG_D184, MIG_37B5),
        mig_instance_ids=((7, 0), (13, 0)),
    ),
    GpuIdentity(2, UUID_96DE, "00000000:47:00.0"),
)
# The same box as seen by a fleet that does not record GI/CI ids.
MIG_NO_IDS = (
    MIG[0],
    GpuIdentity(1, UUID_3EB7, "00000000:0F:00.0", mig_enabled=True, mig_uuids=(MIG_D184,)),
)
# Two UUIDs (from PyTorch's parser tests) whose common prefix is a hex letter, not a digit.
E_UUIDS = (
    GpuIdentity(0, "GPU-e429a63e-c61c-4795-b757-5132caeb8e70", "00000000:18:00.0"),
    GpuIdentity(1, "GPU-eee1dfbc-0a0f-6ad8-5ff6-dc942a8b9d98", "00000000:3B:00.0"),
)
MIG_EMPTY = (
    GpuIdentity(0, UUID_3EB7, "00000000:07:00.0", mig_enabled=True),  # MIG on, no instance
    GpuIdentity(1, UUID_849D, "00000000:0F:00.0"),
)


@dataclass(frozen=True)
class Case:
    id: str
    gpus: tuple[GpuIdentity, ...]
    cvd: str | None  # None: CUDA_VISIBLE_DEVICES unset
    expect: tuple[int | tuple[int, str], ...]  # nvml index, or (nvml index, MIG uuid)
    stopped_at: str | None = None
    problems: tuple[str, ...] = ()  # a fragment of each expected problem, in order
    order: str | None = None  # CUDA_DEVICE_ORDER
    extra: dict[str, str] = field(default_factory=dict)


CASES = [
    # -- unset, empty
    Case("unset-all", A40S, None, (0, 1, 2, 3)),
    Case("empty-none", A40S, "", ()),
    Case("whitespace-none", A40S, "  ", ()),
    # -- indices (reference 9.4 item 12)
    Case("reorder", A40S, "1,0", (1, 0)),
    Case("single", A40S, "2", (2,)),
    Case("strtoul-junk", A40S, "1gpu2", (1,), problems=("'1gpu2' is read as index 1",)),
    Case(
        "strtoul-pytorch",
        A40S,
        "1gpu2,2ampere",
        (1, 2),
        problems=("'1gpu2' is read as index 1", "'2ampere' is read as index 2"),
    ),
    Case("leading-space", A40S, " 0, 1", (0, 1)),
    Case("plus-and-minus-zero", A40S, "2, +3, -0, 1", (2, 3, 0, 1)),
    Case(
        "negative-stops",
        A40S,
        "0,2,-1,1",
        (0, 2),
        stopped_at="-1",
        problems=(
            (
                "entry '-1' is negative (indices 0-3 or GPU UUIDs); CUDA stops there and "
                "also hides '1'"
            ),
        ),
    ),
    Case(
        "out-of-range-stops",
        A40S,
        "1,5,0",
        (1,),
        stopped_at="5",
        problems=("entry '5' is not a GPU on this machine",),
    ),
    Case(
        "word-stops",
        A40S,
        "3,two,one",
        (3,),
        stopped_at="two",
        problems=("'two' is neither a GPU index nor a GPU UUID",),
    ),
    Case("word-first", A40S, "one,two,3,4", (), stopped_at="one", problems=("'one'",)),
    Case(
        "empty-entry-stops",
        A40S,
        "0,,1",
        (0,),
        stopped_at="",
        problems=(
            "entry '' is empty (indices 0-3 or GPU UUIDs); CUDA stops there and also hides '1'",
        ),
    ),
    Case("trailing-comma", A40S, "0,1,", (0, 1), stopped_at="", problems=("entry '' is empty",)),
    Case("no-gpu", (), "0", (), stopped_at="0", problems=("this machine has no GPU",)),
    # -- duplicates empty the list
    Case("dup-ordinal", A40S, "0,0", (), problems=("'0,0' names GPU 0 twice: CUDA then sees no",)),
    Case("dup-later", A40S, "0,1,2,1", (), problems=("names GPU 1 twice",)),
    Case(
        "dup-index-and-uuid",
        A40S,
        "0,GPU-849d5a8d",
        (),
        problems=("names GPU 0 twice ('0' and 'GPU-849d5a8d')",),
    ),
    Case("dup-after-stop-ignored", A40S, "0,-1,0", (0,), stopped_at="-1", problems=("'-1'",)),
    Case("dup-before-stop-wins", A40S, "0,0,-1", (), problems=("names GPU 0 twice",)),
    # -- UUIDs
    Case("uuid-full", A40S, UUID_96DE, (2,)),
    Case("uuid-abbreviated", A40S, "GPU-18ef14e9", (1,)),
    Case("uuid-order-kept", A40S, "GPU-1d0c,GPU-849d", (3, 0)),
    Case("uuid-without-prefix", A40S, "1d0c23ba", (3,)),
    Case("uuid-and-index-mixed", A40S, "GPU-96de,0", (2, 0)),
    Case(
        "uuid-ambiguous-stops",
        A40S,
        "GPU-96de,GPU-1,0",
        (2,),
        stopped_at="GPU-1",
        problems=("'GPU-1' is ambiguous: it starts the UUIDs of GPU 1 and GPU 3",),
    ),
    Case(
        "uuid-unknown-stops",
        A40S,
        "GPU-3eb79704,0",
        (),
        stopped_at="GPU-3eb79704",
        problems=("matches no GPU UUID on this machine (GPU-849d5a8d, GPU-18ef14e9",),
    ),
    Case(
        "bare-uuid-typo-is-an-index",
        A40S,
        "1d0c23bb",
        (1,),
        problems=("'1d0c23bb' is read as index 1",),
    ),
    Case(
        "bare-prefix-ambiguous-stops",
        E_UUIDS,
        "e429,e",
        (0,),
        stopped_at="e",
        problems=("'e' is ambiguous: it starts the UUIDs of GPU 0 and GPU 1",),
    ),
    # -- CUDA order
    Case(
        "fastest-first-default",
        MIXED,
        "1,0",
        (0, 1),  # cuda order is H100 (nvml 1), A40 (nvml 0), A40 (nvml 2)
        problems=(
            (
                "fastest first by its own heuristic, not in nvidia-smi's order; "
                "set CUDA_DEVICE_ORDER=PCI_BUS_ID"
            ),
        ),
    ),
    Case("pci-bus-order", MIXED, "1,0", (1, 0), order="PCI_BUS_ID"),
    Case(
        "fastest-first-unset",
        MIXED,
        None,
        (1, 0, 2),
        problems=("compute capability 9.0, 8.6",),
    ),
    # Asked for explicitly: the user knows, so no warning.
    Case("explicit-fastest-first", MIXED, None, (1, 0, 2), order="FASTEST_FIRST"),
    Case("pci-unset", MIXED, None, (0, 1, 2), order="PCI_BUS_ID"),
    Case("uuids-ignore-order", MIXED, "GPU-849d,GPU-18ef", (0, 1)),
    Case(
        "unknown-order",
        MIXED,
        "0",
        (1,),
        order="pci",
        problems=("CUDA_DEVICE_ORDER='pci' is not FASTEST_FIRST or PCI_BUS_ID", "heuristic"),
    ),
    Case("empty-order-is-default", A40S, "0", (0,), order=""),
    Case("homogeneous-no-warning", A40S, "3,2", (3, 2)),
    # -- MIG (datadog's recorded behaviour)
    Case("mig-uuid", MIG, MIG_37B5, ((1, MIG_37B5),)),
    Case("mig-uuid-abbreviated", MIG, "MIG-d184f67c", ((1, MIG_D184),)),
    Case("mig-legacy", MIG, "MIG-GPU-3eb79704/13/0", ((1, MIG_37B5),)),
    Case(
        "mig-legacy-without-ids",
        MIG_NO_IDS,
        "MIG-GPU-3eb79704/13/0",
        ((1, f"MIG-{UUID_3EB7}/13/0"),),
    ),
    Case(
        "mig-unset",
        MIG,
        None,
        ((1, MIG_D184),),
        problems=(
            "GPU 1 has MIG enabled: CUDA sees only its first MIG instance, MIG-d184f67c",
            (
                "only one MIG instance per process, so it sees MIG instance MIG-d184f67c of GPU 1 "
                "alone and hides GPU 0, GPU 2"
            ),
        ),
    ),
    Case("mig-index-whole-gpu", MIG, "1", (2,)),  # MIG-enabled GPUs are numbered last
    Case(
        "mig-index-instance",
        MIG,
        "2",
        ((1, MIG_D184),),
        problems=("'2' is MIG instance MIG-d184f67c of GPU 1",),
    ),
    Case("mig-index-beyond", MIG, "0,3", (0,), stopped_at="3", problems=("indices 0-2",)),
    Case(
        "mig-parent-uuid",
        MIG,
        "GPU-3eb79704",
        ((1, MIG_D184),),
        problems=("names GPU 1, which has MIG enabled: CUDA uses its first MIG instance",),
    ),
    Case(
        "mig-second-instance-hidden",
        MIG,
        f"{MIG_D184},{MIG_37B5}",
        ((1, MIG_D184),),
        problems=(f"only one MIG instance per process and then hides '{MIG_37B5}'",),
    ),
    Case(
        "mig-hides-earlier-gpu",
        MIG,
        "0,MIG-37b5",
        ((1, MIG_37B5),),
        problems=(
            (
                "includes MIG instance MIG-37b51284 of GPU 1: CUDA enumerates only one MIG "
                "instance per process and then hides '0'"
            ),
        ),
    ),
    Case(
        "mig-dup-parent-and-instance",
        MIG,
        "GPU-3eb79704,MIG-d184",
        (),
        problems=("MIG enabled", "names MIG instance MIG-d184f67c of GPU 1 twice"),
    ),
    Case("mig-ambiguous", MIG, "MIG-", (), stopped_at="MIG-", problems=("is ambiguous",)),
    Case(
        "mig-unknown",
        MIG,
        "MIG-00000000",
        (),
        stopped_at="MIG-00000000",
        problems=("matches no MIG instance on this machine (MIG-d184f67c, MIG-37b51284)",),
    ),
    Case(
        "mig-legacy-unknown-instance",
        MIG,
        "MIG-GPU-3eb79704/5/0",
        (),
        stopped_at="MIG-GPU-3eb79704/5/0",
        problems=("names no MIG instance of GPU 1 (GI/CI 7/0, 13/0)",),
    ),
    Case(
        "mig-legacy-on-whole-gpu",
        MIG,
        "MIG-GPU-849d5a8d/0/0",
        (),
        stopped_at="MIG-GPU-849d5a8d/0/0",
        problems=("names GPU 0, which does not have MIG enabled (its GPU UUID, GPU-849d5a8d)",),
    ),
    Case(
        "mig-legacy-malformed",
        MIG,
        "MIG-GPU-3eb79704/x",
        (),
        stopped_at="MIG-GPU-3eb79704/x",
        problems=("is not a MIG device (MIG-<uuid> or MIG-GPU-<uuid>/<gi>/<ci>)",),
    ),
    Case(
        "mig-enabled-without-instance-skipped",
        MIG_EMPTY,
        None,
        (1,),
        problems=("GPU 0 has MIG enabled but no MIG instance: CUDA skips it",),
    ),
    Case("mig-empty-index-shift", MIG_EMPTY, "0", (1,)),
    Case(
        "mig-empty-by-uuid",
        MIG_EMPTY,
        "GPU-3eb7",
        (),
        stopped_at="GPU-3eb7",
        problems=("which has MIG enabled but no MIG instance (create a MIG instance",),
    ),
]


def _environ(case: Case) -> dict[str, str]:
    env = dict(case.extra)
    if case.cvd is not None:
        env["CUDA_VISIBLE_DEVICES"] = case.cvd
    if case.order is not None:
        env["CUDA_DEVICE_ORDER"] = case.order
    return env


def _expected(case: Case) -> tuple[VisibleDevice, ...]:
    uuids = {g.nvml_index: g.uuid for g in case.gpus}
    devices = []
    for n, item in enumerate(case.expect):
        nvml, mig = item if isinstance(item, tuple) else (item, None)
        devices.append(VisibleDevice(n, nvml, uuids[nvml], mig))
    return tuple(devices)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_resolve(case: Case):
    result = resolve_visible(case.gpus, _environ(case))
    assert result.devices == _expected(case)
    assert result.stopped_at == case.stopped_at
    assert result.raw == case.cvd
    assert len(result.problems) == len(case.problems), result.problems
    for fragment, problem in zip(case.problems, result.problems, strict=True):
        assert fragment in problem


def test_gpu_order_in_the_input_does_not_matter():
    shuffled = (MIXED[2], MIXED[0], MIXED[1])
    for order, expect in (("PCI_BUS_ID", [0, 1, 2]), ("FASTEST_FIRST", [1, 0, 2])):
        result = resolve_visible(shuffled, {"CUDA_DEVICE_ORDER": order})
        assert [d.nvml_index for d in result.devices] == expect
        assert result.order == order


def test_pci_order_compares_bus_ids_as_numbers_not_text():
    # NVML writes upper-case hex; "0A" must sort after "09", and domains before buses.
    gpus = (
        GpuIdentity(0, UUID_849D, "00000001:05:00.0"),
        GpuIdentity(1, UUID_18EF, "00000000:0A:00.0"),
        GpuIdentity(2, UUID_96DE, "0000:09:00.0"),
    )
    result = resolve_visible(gpus, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert [d.nvml_index for d in result.devices] == [2, 1, 0]


def test_unset_and_default_order_fields():
    result = resolve_visible(A40S, {})
    assert result.raw is None
    assert result.order == "FASTEST_FIRST"
    assert result.key == "CUDA_VISIBLE_DEVICES"
    assert result.problems == ()


def test_other_key():
    result = resolve_visible(A40S, {"CUDA_VISIBLE_DEVICES": "0", "MY_GPUS": "3,-1"}, key="MY_GPUS")
    assert [d.nvml_index for d in result.devices] == [3]
    assert result.problems[0].startswith("MY_GPUS='3,-1': entry '-1'")


# -- strict mode: one line that names the value and the accepted form


@pytest.mark.parametrize(
    ("gpus", "cvd", "message"),
    [
        (
            A40S,
            "0,7",
            (
                "CUDA_VISIBLE_DEVICES='0,7': entry '7' is not a GPU on this machine "
                "(indices 0-3 or GPU UUIDs)"
            ),
        ),
        (A40S, "0,2,-1,1", "entry '-1' is negative (indices 0-3 or GPU UUIDs)"),
        (A40S, "0,0", "CUDA_VISIBLE_DEVICES='0,0': entry '0' repeats GPU 0 (name each device"),
        (A40S, "GPU-1", "entry 'GPU-1' is ambiguous"),
        (A40S, "GPU-3eb79704", "matches no GPU UUID on this machine"),
        (A40S, "0,,1", "entry '' is empty"),
        (MIG, "0,MIG-37b5", "entry '0' is hidden because CUDA enumerates only one MIG instance"),
        (MIG, f"{MIG_D184},{MIG_37B5}", f"entry '{MIG_37B5}' is hidden"),
    ],
)
def test_strict_raises_one_line(gpus, cvd, message):
    with pytest.raises(VisibleDevicesError) as caught:
        resolve_visible(gpus, {"CUDA_VISIBLE_DEVICES": cvd}, strict=True)
    text = str(caught.value)
    assert message in text
    assert "\n" not in text
    assert text.startswith(f"CUDA_VISIBLE_DEVICES={cvd!r}: ")
    assert isinstance(caught.value, UserInputError)  # a user mistake: no traceback


@pytest.mark.parametrize(
    ("gpus", "env"),
    [
        (A40S, {}),
        (A40S, {"CUDA_VISIBLE_DEVICES": ""}),
        (A40S, {"CUDA_VISIBLE_DEVICES": "1gpu2"}),  # read as 1: nothing named is hidden
        (A40S, {"CUDA_VISIBLE_DEVICES": "0,1,"}),  # the trailing empty entry hides nothing
        (MIXED, {"CUDA_VISIBLE_DEVICES": "1,0"}),  # heuristic order: a warning only
        (MIXED, {"CUDA_DEVICE_ORDER": "pci"}),
        (MIG, {}),  # nothing was named, so nothing named is hidden
        (MIG, {"CUDA_VISIBLE_DEVICES": "GPU-3eb79704"}),  # replaced, not hidden
    ],
)
def test_strict_accepts_what_hides_nothing_named(gpus, env):
    assert resolve_visible(gpus, env, strict=True) == resolve_visible(gpus, env)


@pytest.mark.parametrize("cvd", ["0,7", "0,0", "GPU-1", "-1", ",", "MIG-x", "0,MIG-37b5"])
def test_non_strict_never_raises(cvd):
    for gpus in (A40S, MIXED, MIG, MIG_EMPTY, ()):
        assert isinstance(resolve_visible(gpus, {"CUDA_VISIBLE_DEVICES": cvd}), VisibleMap)


# -- the map itself


def test_physical_and_reverse_lookup():
    result = resolve_visible(A40S, {"CUDA_VISIBLE_DEVICES": "2,0"})
    assert result.physical(0) == VisibleDevice(0, 2, UUID_96DE)
    assert result.physical(1) == VisibleDevice(1, 0, UUID_849D)
    assert result.physical(2) is None
    assert result.physical(-1) is None
    assert result.cuda_index_of(0) == 1
    assert result.cuda_index_of(3) is None


def test_text_lists_devices_and_stop():
    result = resolve_visible(A40S, {"CUDA_VISIBLE_DEVICES": "3,1,-1,0"})
    lines = result.text().splitlines()
    assert lines[:4] == [
        "CUDA_VISIBLE_DEVICES='3,1,-1,0', order FASTEST_FIRST",
        "cuda:0 -> GPU 3 (GPU-1d0c23ba)",
        "cuda:1 -> GPU 1 (GPU-18ef14e9)",
        "CUDA stops reading at entry '-1'",
    ]
    assert lines[4].startswith("! CUDA_VISIBLE_DEVICES='3,1,-1,0': entry '-1' is negative")
    assert str(result) == result.text()


def test_text_for_none_and_mig():
    assert resolve_visible(A40S, {"CUDA_VISIBLE_DEVICES": ""}).text().splitlines() == [
        "CUDA_VISIBLE_DEVICES='', order FASTEST_FIRST",
        "CUDA sees no GPU",
    ]
    lines = resolve_visible(MIG, {"CUDA_VISIBLE_DEVICES": MIG_37B5}).text().splitlines()
    assert lines[1] == "cuda:0 -> GPU 1 MIG-37b51284 (GPU-3eb79704)"
    assert resolve_visible(MIG, {}).text().startswith("CUDA_VISIBLE_DEVICES unset, order")


def test_text_fits_80_columns_and_keeps_uuids_whole():
    result = resolve_visible(A40S, {"CUDA_VISIBLE_DEVICES": f"{UUID_18EF},GPU-0"})
    lines = result.text().splitlines()
    assert all(len(line) <= 80 for line in lines if UUID_18EF not in line)
    problem = "\n".join(lines[lines.index(next(x for x in lines if x.startswith("!"))) :])
    assert UUID_18EF in problem  # wrapping must not split a UUID
    assert "GPU-849d5a8d, GPU-18ef14e9, GPU-96de99c9, GPU-1d0c23ba" in " ".join(problem.split())


def test_repr_pretty_uses_text():
    class Printer:
        def __init__(self):
            self.out = ""

        def text(self, s):
            self.out += s

    printer = Printer()
    result = resolve_visible(A40S, {"CUDA_VISIBLE_DEVICES": "1"})
    result._repr_pretty_(printer, cycle=False)
    assert printer.out == result.text()


@pytest.mark.parametrize(
    ("bus_id", "normal"),
    [
        ("00000000:3B:00.0", "0000:3b:00.0"),
        ("0000:3b:00.0", "0000:3b:00.0"),
        ("3B:00.1", "0000:3b:00.1"),
        (" 00000001:AF:1f.7 ", "0001:af:1f.7"),
        ("not-a-bus", "not-a-bus"),
    ],
)
def test_normalize_pci_bus_id(bus_id, normal):
    assert normalize_pci_bus_id(bus_id) == normal


def test_imports_only_stdlib_errors_and_the_renderer():
    roots = set()
    for module in (visible,):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.Import):
                roots.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                roots.add(node.module)
    foreign = {
        name
        for name in roots
        if name.split(".")[0] not in sys.stdlib_module_names
        and name not in ("nbgpu.errors", "nbgpu._render")  # both standard library only
        and not name.startswith("nbgpu.devices.visible")
    }
    assert foreign == set()


def test_all_is_complete():
    public = {
        name
        for name, value in vars(visible).items()
        if not name.startswith("_")
        and (getattr(value, "__module__", None) == visible.__name__ or name.isupper())
    }
    assert public == set(visible.__all__)
