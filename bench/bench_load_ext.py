"""``%load_ext nbgpu``: its cost on a bare IPython shell start, and warm ``%gpu_status``.

Budgets (DESIGN.md, "The user-facing surface"): loading adds at most 50 ms to a
bare shell start and imports none of torch, pynvml, pandas, matplotlib, ipywidgets;
a warm ``%gpu_status`` on 8 GPUs takes under 20 ms.

1. Fresh subprocesses, alternating: a bare ``InteractiveShell.instance()`` versus the
   same plus ``%load_ext nbgpu``. The difference of the medians is the cost; the
   loading child also times the ``load_ext`` call itself (in-process, less noisy).
2. One shell on ``NBGPU_SIMULATE=8xH100``: ``%gpu_status`` once to warm up, then
   repeatedly; median of the magic call, and of the call plus the rich rendering a
   notebook would do with the result (``_repr_mimebundle_``: text and HTML).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from harness import (
    PYTHON,
    Case,
    Row,
    alternate,
    prime_bytecode,
    print_table,
    run_once,
    validate,
)

LOAD_BUDGET_MS = 50.0
STATUS_BUDGET_MS = 20.0
WARM_SPECS = ("8xH100", "8xH100,procs=40")
HEAVY = ("torch", "pynvml", "pandas", "matplotlib", "ipywidgets")

SHELL = """\
import json, sys, time
from IPython.core.interactiveshell import InteractiveShell
ip = InteractiveShell.instance()
"""

# Both start-up children run the same code except for the one load_ext call, and
# report what is imported at the end (the bare one: IPython's own baseline).
START = (
    SHELL
    + """\
t0 = time.perf_counter()
if LOAD:
    ip.run_line_magic("load_ext", "nbgpu")
load_ms = (time.perf_counter() - t0) * 1000
heavy = [m for m in HEAVY if m in sys.modules]
print(json.dumps({"load_ext_ms": load_ms, "heavy": heavy, "psutil": "psutil" in sys.modules}))
"""
)

WARM_STATUS = (
    SHELL
    + """\
ip.run_line_magic("load_ext", "nbgpu")
t0 = time.perf_counter()
first = ip.run_line_magic("gpu_status", "")
cold_ms = (time.perf_counter() - t0) * 1000
magic, rendered = [], []
for _ in range(REPEATS):
    t0 = time.perf_counter()
    result = ip.run_line_magic("gpu_status", "")
    t1 = time.perf_counter()
    bundle = result._repr_mimebundle_()
    t2 = time.perf_counter()
    magic.append((t1 - t0) * 1000)
    rendered.append((t2 - t0) * 1000)
names = [g.name for g in result.gpus]
print(json.dumps({"cold_ms": cold_ms, "magic_ms": magic, "rendered_ms": rendered,
                  "gpus": names, "html": "text/html" in bundle}))
"""
)


def _script(source: str, **constants: object) -> list[str]:
    header = "".join(f"{name} = {value!r}\n" for name, value in constants.items())
    return [PYTHON, "-c", header + source]


def _shell_env(ipython_dir: str) -> dict[str, str]:
    # A private IPYTHONDIR: no user profile or startup files, no writes to ~/.ipython.
    return {"IPYTHONDIR": ipython_dir}


def _load_check(proc: subprocess.CompletedProcess[str]) -> str | None:
    return None if "load_ext_ms" in _last_json(proc.stdout) else "no report printed"


def _last_json(stdout: str) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    return report


def measure_load(n: int, ipython_dir: str) -> tuple[Row, Row, list[dict[str, Any]]]:
    """(bare row, load_ext row, [one bare child's report, the loading children's reports])."""
    env = _shell_env(ipython_dir)
    bare = Case(
        "bare InteractiveShell start", _script(START, HEAVY=HEAVY, LOAD=False), env, _load_check
    )
    loaded = Case(
        "same + %load_ext nbgpu", _script(START, HEAVY=HEAVY, LOAD=True), env, _load_check
    )
    for case in (bare, loaded):
        problem = validate(case)
        if problem:
            raise RuntimeError(f"{case.name}: {problem}")
    rows = alternate([bare, loaded], n)
    reports = [_last_json(out) for out in rows[loaded.name].stdouts]
    baseline = _last_json(rows[bare.name].stdouts[-1])
    return rows[bare.name], rows[loaded.name], [baseline, *reports]


@dataclass(frozen=True)
class WarmStatus:
    spec: str
    gpus: list[str]
    cold_ms: float
    magic_ms: list[float]
    rendered_ms: list[float]

    @property
    def label(self) -> str:
        return f"{self.spec}, {len(self.gpus)} GPUs"


def measure_warm_status(spec: str, repeats: int, ipython_dir: str) -> WarmStatus:
    env = {**_shell_env(ipython_dir), "NBGPU_SIMULATE": spec}
    case = Case(f"warm %gpu_status {spec}", _script(WARM_STATUS, REPEATS=repeats), env)
    run = run_once(case)
    if run.proc.returncode != 0:
        raise RuntimeError(f"{case.name} failed: {run.proc.stderr.strip()[-500:]}")
    data = _last_json(run.proc.stdout)
    wanted = int(spec.split("x", maxsplit=1)[0])
    if len(data["gpus"]) != wanted or not data["html"]:
        raise RuntimeError(f"{case.name}: saw GPUs {data['gpus']}, html={data['html']}")
    return WarmStatus(spec, data["gpus"], data["cold_ms"], data["magic_ms"], data["rendered_ms"])


def _verdict(value: float, budget: float) -> str:
    return f"budget {budget:.0f} ms: {'OK' if value <= budget else 'OVER'}"


def _warm_rows(warm: WarmStatus) -> list[Row]:
    magic = statistics.median(warm.magic_ms)
    full = statistics.median(warm.rendered_ms)
    return [
        Row(f"first %gpu_status ({warm.label})", [warm.cold_ms], note="cold: first call"),
        Row(
            f"warm %gpu_status ({warm.label})",
            warm.magic_ms,
            note=_verdict(magic, STATUS_BUDGET_MS),
        ),
        Row(
            f"warm %gpu_status + text/HTML render ({warm.label})",
            warm.rendered_ms,
            note=_verdict(full, STATUS_BUDGET_MS),
        ),
    ]


def main(n: int = 15, repeats: int = 50) -> dict[str, float]:
    """Run both parts, print their tables; return the headline figures."""
    prime_bytecode()
    with tempfile.TemporaryDirectory(prefix="nbgpu-bench-ipython-") as ipython_dir:
        bare, loaded, reports = measure_load(n, ipython_dir)
        warm = [measure_warm_status(s, repeats, ipython_dir) for s in WARM_SPECS]
    added = loaded.median_wall - bare.median_wall
    paired = statistics.median(b - a for a, b in zip(bare.wall_ms, loaded.wall_ms, strict=True))
    loaded.note = (
        f"{added:+.1f} ms vs bare ({_verdict(added, LOAD_BUDGET_MS)}); "
        f"median of per-round differences {paired:+.1f} ms"
    )
    baseline, loading = reports[0], reports[1:]
    call = Row(
        "the load_ext call alone (perf_counter in those children)",
        [float(r["load_ext_ms"]) for r in loading],
    )
    print_table("%load_ext nbgpu: fresh subprocesses, alternating", [bare, loaded, call])
    heavy = sorted({m for r in loading for m in r["heavy"]})
    print(f"\nheavy modules in sys.modules after %load_ext nbgpu: {heavy or 'none'}", end="")
    print(f" (bare shell: {baseline['heavy'] or 'none'})")
    psutil = any(r["psutil"] for r in loading)
    print(f"(informational) psutil in sys.modules after %load_ext: {psutil}")

    rows = [row for w in warm for row in _warm_rows(w)]
    print_table("%gpu_status in one warm shell (in-process perf_counter)", rows, cpu=False)
    return {
        "load_ext_added_ms": added,
        "warm_status_ms": rows[1].median_wall,
        "warm_status_rendered_ms": rows[2].median_wall,
    }


if __name__ == "__main__":
    main(n=int(sys.argv[1]) if len(sys.argv) > 1 else 15)
