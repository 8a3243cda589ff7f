"""``nbgpu status --json`` against gpustat and nvitop on the same simulated fleet.

Every tool runs as a whole fresh subprocess (interpreter start included), N times,
alternating. gpustat and nvitop see the fleet through ``bench/with_fleet.py``, which
installs nbgpu's fake NVML library as ``pynvml.nvmlLib``. That shim's own cost
(importing nbgpu's fleet and simulator, building the fleet) is measured alone as
"shim, no tool"; nbgpu pays the same fleet setup inside its own run.

Two fleets of 8 H100s with 40 processes:

* ``8xH100,procs=40``: the processes' pids are fictional (above pid_max), so every
  tool's lookup of them fails fast: nbgpu reports 40 dead holders, nvitop 40 rows
  of "No Such Process", gpustat drops them (it lists only processes psutil finds).
* the same 40 processes as live holders: real ``sleep`` processes started for the
  run (``holder=GPU:PID``), so every tool looks up 40 real processes. This is the
  like-for-like comparison: in the first fleet the processes are *records* (state,
  user, command captured elsewhere), which nbgpu takes as they are without the
  ``/proc`` lookups the other tools still attempt. Compare CPU time as well as wall
  time: gpustat sleeps 0.1 s per GPU on purpose.

Like for like: nbgpu runs through the same shim too (``nbgpu status --json (via shim)``),
on its driver path, the fake in pynvml where the driver's library would be, and every
tool's shim setup is subtracted the same way. But the shim's own imports (nbgpu's device
model, on which the simulator is built, and the standard library under it: dataclasses,
inspect, json, socket...) are also modules the tools need themselves; subtracting them
would credit each tool with work of its own. So each tool's modules (what importing its
command loads; a lower bound: lazy imports are missed) that the shim loads too are timed
alone, after pynvml ("X: its modules the shim preloads"), and added back to that tool:
like for like = via shim - shim + those modules. The direct ``nbgpu status --json`` row
pays for its simulated hardware (the simulator, the fleet) inside its run, which the
anchors' strict rows do not: its "strict" ratio is the reading issue 24 named.

Before timing, each tool runs once untimed and must really show the 8 simulated GPUs
and the 40 processes (gpustat: the live ones); a tool that fails is reported with
the reason instead of a number. Traced runs list the NVML symbols each tool asked
for and did not get from the fake.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from harness import (
    BENCH_DIR,
    PYTHON,
    VENV_BIN,
    Case,
    Row,
    alternate,
    prime_bytecode,
    print_ratios,
    print_table,
    run_once,
    validate,
)

from nbgpu.devices.sim.fleet import FICTIONAL_PID_BASE, parse_spec

GPUS = 8
PROCS = 40
GPU_NAME = "H100"
SHIM = str(BENCH_DIR / "with_fleet.py")
INSUFFICIENT_SIZE = 7  # NVML's two-call protocol for process lists, not a failure
NVITOP_PROCESS_ROW = re.compile(r"^│\s+\d+\s+(\d+)\s", re.MULTILINE)
NVITOP_GPU_ROW = re.compile(rf"^│\s+\d+\s+{GPU_NAME}\b", re.MULTILINE)

Check = Callable[[subprocess.CompletedProcess[str]], str | None]


@dataclass(frozen=True)
class Scenario:
    title: str
    spec: str
    pids: frozenset[int]  # the processes every tool should list
    live: bool  # real processes: gpustat lists them too


def fictional_scenario() -> Scenario:
    pids = frozenset(range(FICTIONAL_PID_BASE, FICTIONAL_PID_BASE + PROCS))
    spec = f"8xH100,procs={PROCS}"
    return Scenario(f"{spec} (fictional pids)", spec, pids, live=False)


@contextlib.contextmanager
def live_scenario() -> Iterator[Scenario]:
    """40 real idle processes (``sleep``), spread over the 8 GPUs as holders.

    The spec ``8xH100,holder=0:PID+1:PID+...`` is longer than a file name may be,
    and ``load_fleet`` stats it as a path first (OSError ENAMETOOLONG), so every
    tool gets the fleet as a JSON file instead.
    """
    sleepers = [subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL) for _ in range(PROCS)]
    try:
        holders = "+".join(f"{i % GPUS}:{p.pid}" for i, p in enumerate(sleepers))
        pids = frozenset(p.pid for p in sleepers)
        with tempfile.TemporaryDirectory(prefix="nbgpu-bench-fleet-") as tmp:
            path = Path(tmp) / "live-holders.json"
            path.write_text(parse_spec(f"8xH100,holder={holders}").to_json(), encoding="utf-8")
            yield Scenario(f"8xH100 with {PROCS} live holders", str(path), pids, live=True)
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()


# ---------------------------------------------------------------------- checks


def _mismatch(what: str, found: object, wanted: object) -> str | None:
    return None if found == wanted else f"printed {what} {found!r}, expected {wanted!r}"


def _h100_count(gpus: list[dict[str, object]]) -> int:
    return sum(1 for g in gpus if GPU_NAME in str(g["name"]))


def checks(scenario: Scenario) -> dict[str, Check]:
    wanted = set(scenario.pids)

    def nbgpu(proc: subprocess.CompletedProcess[str], *, simulated: bool = True) -> str | None:
        data = json.loads(proc.stdout)
        pids = {p["pid"] for g in data["gpus"] for p in g.get("processes", [])}
        if bool(data.get("simulated")) != simulated:
            return f"the snapshot says simulated={data.get('simulated')}, not {simulated}"
        return _mismatch("H100 GPUs", _h100_count(data["gpus"]), GPUS) or _mismatch(
            "process count", len(pids & wanted), PROCS
        )

    def nbgpu_driver_path(proc: subprocess.CompletedProcess[str]) -> str | None:
        return nbgpu(proc, simulated=False)  # the fake sits where the driver's library would

    def gpustat(proc: subprocess.CompletedProcess[str]) -> str | None:
        data = json.loads(proc.stdout)
        pids = {p["pid"] for g in data["gpus"] for p in g.get("processes") or []}
        listed = PROCS if scenario.live else 0
        return _mismatch("H100 GPUs", _h100_count(data["gpus"]), GPUS) or _mismatch(
            "process count", len(pids & wanted), listed
        )

    def nvitop(proc: subprocess.CompletedProcess[str]) -> str | None:
        pids = {int(pid) for pid in NVITOP_PROCESS_ROW.findall(proc.stdout)}
        gpu_rows = len(NVITOP_GPU_ROW.findall(proc.stdout))
        return _mismatch("H100 GPU rows", gpu_rows, GPUS) or _mismatch(
            "process rows", len(pids & wanted), PROCS
        )

    return {"nbgpu": nbgpu, "nbgpu-shim": nbgpu_driver_path, "gpustat": gpustat, "nvitop": nvitop}


# ----------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Tool:
    name: str
    case: Case
    traced: Case | None = None  # the same run with NVML tracing, for the report


def _shim(spec: str, tool: str, *args: str, trace: bool = False) -> list[str]:
    return [PYTHON, SHIM, *(["--trace"] if trace else []), spec, "--", tool, *args]


# What importing each tool's command loads (a lower bound of what it needs).
IMPORTS = {
    "nbgpu-shim": "import nbgpu.cli, nbgpu.api",
    "nvitop": "import nvitop.cli",
    "gpustat": "import gpustat",
}


def modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running *code*."""
    probe = f"{code}\nimport sys\nprint(' '.join(m for m, v in sys.modules.items() if v))\n"
    return set(run_once(Case("modules", [PYTHON, "-c", probe])).proc.stdout.split())


def preloaded(spec: str) -> dict[str, list[str]]:
    """For each tool: its modules that the shim (beyond pynvml and the interpreter's
    own) imports too, not counting the simulator itself."""
    base = modules_after("import pynvml")
    install = f"import sys\nsys.path.insert(0, {str(BENCH_DIR)!r})\nimport with_fleet\n"
    shim = modules_after(f"{install}with_fleet.install_fleet({spec!r})") - base
    return {
        tool: sorted(m for m in shim & modules_after(code) if not m.startswith("nbgpu.devices.sim"))
        for tool, code in IMPORTS.items()
    }


def _import_all(modules: list[str]) -> list[str]:
    code = f"import pynvml\nfor name in {modules!r}:\n    __import__(name)\n"
    return [PYTHON, "-W", "ignore", "-c", code]


def tools(scenario: Scenario) -> list[Tool]:
    spec, check = scenario.spec, checks(scenario)
    nbgpu = [str(VENV_BIN / "nbgpu"), "status", "--json"]
    out = [
        Tool("nbgpu", Case("nbgpu status --json", nbgpu, {"NBGPU_SIMULATE": spec}, check["nbgpu"]))
    ]
    for name, args in (("gpustat", ("--json",)), ("nvitop", ("--once",))):
        label = " ".join((name, *args))
        case = Case(f"{label} (via shim)", _shim(spec, name, *args), check=check[name])
        out.append(Tool(name, case, Case(label, _shim(spec, name, *args, trace=True))))
    shimmed = Case(
        "nbgpu status --json (via shim)",
        _shim(spec, "nbgpu", "status", "--json"),
        check=check["nbgpu-shim"],
    )
    out.append(Tool("nbgpu-shim", shimmed))
    out.append(Tool("shim", Case("shim, no tool", _shim(spec, "none"))))
    for tool, modules in preloaded(spec).items():
        label = f"{tool.removesuffix('-shim')}: its modules the shim preloads ({len(modules)})"
        print(f"{label}: {', '.join(modules)}")
        out.append(Tool(f"{tool} preloaded", Case(label, _import_all(modules))))
    out.append(Tool("pynvml", Case("python -c 'import pynvml'", [PYTHON, "-c", "import pynvml"])))
    out.append(Tool("python", Case("python -c pass (interpreter floor)", [PYTHON, "-c", "pass"])))
    return out


# ---------------------------------------------------------------------- report


def nvml_gaps(case: Case) -> dict[str, list[object]]:
    """Symbols the tool asked for that the fake answered with an error or lacks."""
    stderr = run_once(case).proc.stderr
    for line in reversed(stderr.splitlines()):
        if line.startswith('{"nvml_trace"'):
            trace: dict[str, list[object]] = json.loads(line)["nvml_trace"]
            return {k: v for k, v in trace.items() if v != [INSUFFICIENT_SIZE]}
    return {"(no trace printed)": []}


def report_gaps(usable: list[Tool]) -> None:
    print("\nNVML symbols each tool called that the fake does not serve (3 = NOT_SUPPORTED):")
    for tool in usable:
        if tool.traced is not None:
            gaps = nvml_gaps(tool.traced)
            listed = ", ".join(f"{name} {codes}" for name, codes in gaps.items()) or "none"
            print(f"  {tool.name}: {listed}")


def without_shim_setup(tool: Row, shim: Row, pynvml: Row) -> Row:
    """An estimate of the tool run without the shim's fleet setup, from medians.

    via shim = python + pynvml + fleet setup + tool;  shim alone = python + pynvml +
    fleet setup;  so tool alone ~ via shim - shim alone + (python + import pynvml).
    """
    return Row(
        f"{tool.name.removesuffix(' (via shim)')}, shim setup subtracted",
        wall_ms=[tool.median_wall - shim.median_wall + pynvml.median_wall],
        cpu_ms=[tool.median_cpu - shim.median_cpu + pynvml.median_cpu],
        note="derived from the medians above",
    )


def report_ratios(title: str, by_tool: dict[str, Row]) -> dict[str, float]:
    nbgpu = by_tool.get("nbgpu")
    anchors = [(name, by_tool[name]) for name in ("gpustat", "nvitop") if name in by_tool]
    if nbgpu is None or not anchors:
        print("no ratios: nbgpu or both anchors failed")
        return {}
    raw = [(f"nbgpu / {name}", nbgpu, row) for name, row in anchors]
    print_ratios(f"{title}: ratios of medians, anchors via the shim (< 1: nbgpu faster)", raw)
    strict = [
        (label, nbgpu, without_shim_setup(row, by_tool["shim"], by_tool["pynvml"]))
        for label, _, row in raw
    ]
    print_table(f"{title}: anchors with the shim's fleet setup subtracted", [s[2] for s in strict])
    print_ratios(f"{title}: strict ratios, nbgpu / anchor without shim setup", strict)
    out = {f"{title}: {label} via shim": n.median_wall / d.median_wall for label, n, d in raw}
    out |= {f"{title}: {label} strict": n.median_wall / d.median_wall for label, n, d in strict}
    if all(name in by_tool for name in ("nbgpu-shim", "nvitop preloaded", "gpustat preloaded")):
        alike = {
            name: like_for_like(name, by_tool) for name in ("nbgpu-shim", *anchors_of(by_tool))
        }
        print_table(f"{title}: like for like, every tool through the shim", list(alike.values()))
        pairs = [
            (f"nbgpu / {name}", alike["nbgpu-shim"], alike[name]) for name in anchors_of(by_tool)
        ]
        print_ratios(f"{title}: like-for-like ratios (< 1: nbgpu faster)", pairs)
        for label, n, d in pairs:
            out[f"{title}: {label} like for like"] = n.median_wall / d.median_wall
    return out


def anchors_of(by_tool: dict[str, Row]) -> list[str]:
    return [name for name in ("gpustat", "nvitop") if name in by_tool]


def like_for_like(name: str, by_tool: dict[str, Row]) -> Row:
    """A tool through the shim, the shim subtracted, and the tool's own modules that the
    shim had imported for it added back (their import, timed alone after pynvml)."""
    via, shim, preloaded = by_tool[name], by_tool["shim"], by_tool[f"{name} preloaded"]
    return Row(
        f"{via.name.removesuffix(' (via shim)')}, like for like",
        wall_ms=[via.median_wall - shim.median_wall + preloaded.median_wall],
        cpu_ms=[via.median_cpu - shim.median_cpu + preloaded.median_cpu],
        note="via shim - shim + its modules the shim preloads",
    )


def run_scenario(scenario: Scenario, n: int, *, trace: bool) -> dict[str, float]:
    usable = []
    for tool in tools(scenario):
        problem = validate(tool.case)
        if problem:
            print(f"NOT BENCHMARKED: {tool.case.name} on {scenario.title}: {problem}")
        else:
            usable.append(tool)
    rows = alternate([tool.case for tool in usable], n)
    print_table(f"status snapshot, whole subprocess: {scenario.title}", list(rows.values()))
    if trace:
        report_gaps(usable)
    return report_ratios(scenario.title, {t.name: rows[t.case.name] for t in usable})


def main(n: int = 15) -> dict[str, float]:
    """Validate, time and report both fleets; return the headline ratios."""
    prime_bytecode()
    ratios = run_scenario(fictional_scenario(), n, trace=True)
    with live_scenario() as live:
        ratios |= run_scenario(live, n, trace=False)
    return ratios


if __name__ == "__main__":
    main(n=int(sys.argv[1]) if len(sys.argv) > 1 else 15)
