"""Count the tracebacks the property-based suite (tests/fuzz) finds, per entry point (issue 26).

    PYTHONPATH=. .venv/bin/python bench/fuzz_tracebacks.py [--scale K] [--json FILE]

Runs ``pytest tests/fuzz`` with ``NBGPU_FUZZ_TALLY`` (count, do not fail) and
``NBGPU_FUZZ_SCALE=K`` (K times each entry point's examples; the inputs are derandomized,
so two runs at one K feed the same inputs) and prints a Markdown table: entry point,
generated inputs, results, one-line refusals, tracebacks, and the first tracebacks seen.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=5.0, help="examples x K (default 5)")
    parser.add_argument("--json", help="also keep the tally in this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tally = Path(args.json or Path(tmp) / "tally.json").resolve()
        env = {**os.environ, "NBGPU_FUZZ_TALLY": str(tally), "NBGPU_FUZZ_SCALE": str(args.scale)}
        env["PYTHONPATH"] = str(ROOT)
        command = [sys.executable, "-m", "pytest", "tests/fuzz", "-q", "-p", "no:cacheprovider"]
        subprocess.run(command, cwd=ROOT, env=env, check=False)
        data = json.loads(tally.read_text(encoding="utf-8"))
    print("\n| entry point | inputs | results | refused (one line) | tracebacks |")
    print("|---|---:|---:|---:|---:|")
    for entry, row in sorted(data.items()):
        counts = [row.get(k, 0) for k in ("inputs", "result", "refused", "traceback")]
        print(f"| `{entry}` | " + " | ".join(map(str, counts)) + " |")
    for entry, row in sorted(data.items()):
        for example in row["examples"]:
            print(f"- {entry}: {example}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
