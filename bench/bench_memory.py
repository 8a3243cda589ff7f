"""Memory phases: the import storm with and without --serial-imports, and the sampler's cost.

    .venv/bin/python bench/bench_memory.py [--ranks 4] [--rounds 6]

(a) The import storm. A synthetic heavy module (its import allocates a ~1 GiB transient,
holds it for a second, then settles to ~200 MiB: what importing and compiling a large
library does) is imported by every rank of a real ``nbgpu.torchrun`` job on CPU, once
with the ranks importing at once and once with ``serial_imports=True``; the same cell,
the same ranks, one run after the other. From each run's memory records: the node's
peak of the ranks' summed PSS, the phase every rank was in at that peak, the
``imports`` phases' overlap, and what the OOM diagnosis would say.

(b) The sampler's cost. A small CPU training step (an MLP, torch, one thread) timed in
one process in alternating rounds with and without nbgpu's recorder sampling at the
default 0.1 s (the same Recorder and Sampler a rank runs). Prints Markdown.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

HEAVY_MODULE = """
import time
_transient = bytearray(1 << 30)        # ~1 GiB while "compiling" (memset: resident)
time.sleep(1.0)
del _transient
settled = bytearray(200 << 20)         # what the module keeps
"""
# After its imports each rank joins the process group and waits for the others, as a
# training script would: ranks that finished importing keep their memory meanwhile.
CELL = """
import heavymod
import nbgpu.rank as nr

nr.init()
nr.barrier()
nr.print0("all ranks imported", flush=True)
"""


def import_storm(ranks: int, base: Path) -> list[str]:
    import nbgpu  # noqa: PLC0415
    from nbgpu.profile.records import import_storm as storm_line  # noqa: PLC0415

    (base / "heavymod.py").write_text(HEAVY_MODULE)
    env = {**os.environ, "NBGPU_RUNS_DIR": str(base / "runs"), "PYTHONPATH": str(base)}
    env.pop("NBGPU_SIMULATE", None)
    rows = []
    reports = {}
    for serial in (False, True):
        started = time.monotonic()
        run = nbgpu.torchrun(CELL, ranks, environ=env, write=lambda _t: None, serial_imports=serial)
        wall = time.monotonic() - started
        report = run.memory
        reports[serial] = report
        peak = report.node_peak()
        assert peak is not None
        spans = []
        for rank in report.ranks:
            spans += [p for p in rank.phases if p.name == "imports"]
        overlap = max(
            sum(1 for s in spans if s.start_t <= t <= (s.end_t or t))
            for t in [s.start_t for s in spans]
        )
        png = base / f"storm-{'serial' if serial else 'together'}.png"
        png.write_bytes(report.png())
        rows.append(
            f"| {'--serial-imports' if serial else 'all at once'} | {ranks} | "
            f"{peak.total_bytes / 2**30:.2f} | {peak.all_in or ', '.join(sorted(set(filter(None, peak.phases.values()))))} | "
            f"{overlap} | {wall:.1f} |"
        )
    ratio = reports[True].node_peak().total_bytes / reports[False].node_peak().total_bytes  # type: ignore[union-attr]
    return [
        "| imports | ranks | node peak Σ PSS GiB | phase(s) at the peak | most ranks in `imports` at once | wall s |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"Peak with --serial-imports / without: **{ratio:.2f}**.",
        "",
        f'What the OOM diagnosis would add for the run without it: "{storm_line(reports[False])}"',
        "",
        f"Figures: {base}/storm-together.png, {base}/storm-serial.png",
    ]


def sampling_overhead(rounds: int, steps: int) -> list[str]:
    import torch  # noqa: PLC0415

    from nbgpu.profile.recorder import Recorder, Sampler  # noqa: PLC0415

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(128, 512)
    y = torch.randint(0, 10, (128,))

    def step() -> None:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    for _ in range(20):
        step()  # warm-up
    times: dict[bool, list[float]] = {False: [], True: []}
    ratios = []
    samples = 0
    sampler_cpu = 0.0
    recorded_s = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        # One recorder for the whole process, as in a rank; its sampler thread runs only
        # in the "on" rounds. Its USS/PSS budget carries over from round to round.
        rec = Recorder(Path(tmp) / "mem-rank0.jsonl", {"rank": 0}, sample_s=0.1)
        for i in range(rounds):
            pair = {}
            # Alternate which comes first, so drift in the machine's load cancels out.
            for recording in (False, True) if i % 2 == 0 else (True, False):
                sampler = Sampler(rec, 0.1) if recording else None
                if sampler is not None:
                    sampler.start()
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                wall = time.perf_counter() - t0
                pair[recording] = wall / steps
                times[recording].append(wall / steps)
                if sampler is not None:
                    sampler.stop()
                    samples += sampler.count
                    sampler_cpu += sampler.cpu_s
                    recorded_s += wall
            ratios.append(pair[True] / pair[False])
        rec.close()
    off = statistics.median(times[False])
    on = statistics.median(times[True])
    return [
        "| recording | rounds | steps/round | median step ms | samples taken |",
        "|---|---|---|---|---|",
        f"| off | {rounds} | {steps} | {off * 1000:.3f} | - |",
        f"| on (0.1 s) | {rounds} | {steps} | {on * 1000:.3f} | {samples} |",
        "",
        (
            f"Overhead: median of the {rounds} paired rounds' ratios "
            f"**{(statistics.median(ratios) - 1) * 100:+.2f}%** (quartiles "
            f"{(_quartiles(ratios)[0] - 1) * 100:+.2f}% .. {(_quartiles(ratios)[1] - 1) * 100:+.2f}%) "
            f"of a step's wall time (budget < 1%); ratio of medians {(on / off - 1) * 100:+.2f}%; "
            f"ratio of the fastest rounds {(min(times[True]) / min(times[False]) - 1) * 100:+.2f}%. "
            f"The sampler thread itself used {sampler_cpu / max(samples, 1) * 1000:.3f} ms CPU "
            f"per sample, {sampler_cpu / max(recorded_s, 1e-9) * 100:.2f}% of one core while "
            "recording."
        ),
    ]


def _quartiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--skip-storm", action="store_true")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="nbgpu-bench-memory-"))
    if not args.skip_storm:
        print("## (a) import storm\n")
        print("\n".join(import_storm(args.ranks, base)))
    print("\n## (b) sampling overhead\n")
    print("\n".join(sampling_overhead(args.rounds, args.steps)))


if __name__ == "__main__":
    main()
