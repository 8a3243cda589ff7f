"""Run a third-party NVML tool against a simulated fleet.

    python bench/with_fleet.py [--trace] SPEC -- TOOL [ARGS...]

Installs ``nbgpu.devices.sim.nvml.FakeNvmlLibrary(load_fleet(SPEC))`` as
``pynvml.nvmlLib`` *before* the tool imports or initialises NVML, then runs the
tool's console entry point in this process with ``sys.argv`` set, exactly as its
``bin/`` script would. pynvml only loads ``libnvidia-ml.so.1`` while ``nvmlLib`` is
None, so the real wrappers, and everything the tool builds on them, call the fake.

TOOL is ``gpustat``, ``nvitop``, ``nbgpu`` (its driver path: the fake where the driver's
library would be, like the others'), or ``none`` (install the fake and exit: the cost of
this shim alone, which the benchmark reports so that it can be subtracted).

``--trace`` (untimed validation runs only) prints to stderr, at exit, one JSON line
``{"nvml_trace": {symbol: [return codes]}}`` for every symbol that did not answer
SUCCESS or that the fake does not export: what the tool asked for and did not get.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pynvml  # noqa: TID251  (the shim's whole job is to patch pynvml)

from nbgpu.devices.sim.fleet import load_fleet
from nbgpu.devices.sim.nvml import FakeNvmlLibrary

USAGE = "usage: with_fleet.py [--trace] SPEC -- {gpustat|nvitop|nbgpu|none} [ARGS...]"
MISSING = "missing"  # the fake does not export the symbol (pynvml: FunctionNotFound)


class TracingLibrary:
    """Wraps the fake library; records every call that did not return SUCCESS."""

    def __init__(self, inner: FakeNvmlLibrary) -> None:
        self._inner = inner
        self.failures: dict[str, set[Any]] = defaultdict(set)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        try:
            function = getattr(self._inner, name)
        except AttributeError:
            self.failures[name].add(MISSING)
            raise

        def call(*args: Any) -> Any:
            code = function(*args)
            if isinstance(code, int) and code != 0:
                self.failures[name].add(code)
            return code

        return call

    def report(self) -> None:
        trace = {name: sorted(codes, key=str) for name, codes in sorted(self.failures.items())}
        print(json.dumps({"nvml_trace": trace}), file=sys.stderr)


def install_fleet(spec: str, *, trace: bool = False) -> FakeNvmlLibrary | TracingLibrary:
    """Make pynvml talk to a simulated fleet instead of libnvidia-ml.so.1."""
    library: FakeNvmlLibrary | TracingLibrary = FakeNvmlLibrary(load_fleet(spec))
    if trace:
        library = TracingLibrary(library)
        atexit.register(library.report)
    pynvml.nvmlLib = library
    pynvml._nvmlGetFunctionPointer_cache.clear()
    return library


def _gpustat_main() -> int | None:
    from gpustat import main  # noqa: PLC0415  (imported after the fake is in place)

    return main()


def _nvitop_main() -> int | None:
    from nvitop.cli import main  # noqa: PLC0415  (imported after the fake is in place)

    return main()


def _nbgpu_main() -> int | None:
    from nbgpu.cli import main  # noqa: PLC0415  (imported after the fake is in place)

    return main()


def _no_tool() -> int:
    return 0


TOOLS: dict[str, Callable[[], int | None]] = {
    "gpustat": _gpustat_main,
    "nvitop": _nvitop_main,
    "nbgpu": _nbgpu_main,
    "none": _no_tool,
}


def parse(argv: list[str]) -> tuple[bool, str, str, list[str]]:
    """(trace, spec, tool, tool args) from ``[--trace] SPEC -- TOOL ARGS...``."""
    trace = bool(argv) and argv[0] == "--trace"
    rest = argv[1:] if trace else argv
    if len(rest) < 3 or rest[1] != "--" or rest[2] not in TOOLS:
        raise SystemExit(USAGE)
    return trace, rest[0], rest[2], rest[3:]


def main(argv: list[str]) -> int:
    trace, spec, tool, tool_args = parse(argv)
    if tool == "nbgpu":
        # nbgpu installs pynvml's library itself, once per environment (none: the
        # driver's); let it choose the driver's first, then put the fake in its place.
        from nbgpu.devices.nvml import backend_for  # noqa: PLC0415

        os.environ.pop("NBGPU_SIMULATE", None)  # its driver path, not its simulator
        backend_for({})
    install_fleet(spec, trace=trace)
    sys.argv = [tool, *tool_args]
    return int(TOOLS[tool]() or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
