"""Before launch: code written for a GPU box (``.cuda()``, ``backend="nccl"``) started where
torch is a CPU build fails on every rank at that line, after the imports and the rendezvous:
:func:`cuda_line` says so before anything starts (``--strict`` makes it a refusal). The
ranks' torch is this interpreter's (the agent runs ``sys.executable``); its build is read
without importing it (``%load_ext`` imports no torch; a file read, not seconds). A simulated
fleet has no CUDA behind its GPUs (ranks run gloo on CPU), so only real CUDA calls are worth a
line there; ``nbgpu.rank.device()`` picks the CPU by itself and is never one.
"""

import contextlib
import importlib.metadata
import io
import re
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

from nbgpu.launch.config import LaunchConfig

__all__ = ["TorchBuild", "cuda_asks", "cuda_line", "torch_build"]

# What asks torch for CUDA in a rank's code, each with the words the line shows.
_ASKS = (
    (re.compile(r"torch\.cuda\.set_device\s*\("), "torch.cuda.set_device"),
    (re.compile(r"\.cuda\s*\("), ".cuda()"),
    (re.compile(r"""device\s*=\s*(?:torch\.device\s*\(\s*)?["']cuda"""), 'device="cuda"'),
    (re.compile(r"""(?:torch\.device|\.to)\s*\(\s*f?["']cuda"""), '"cuda" device'),
    (re.compile(r"""backend\s*=\s*["']nccl["']|init_process_group\s*\(\s*["']nccl["']"""), "nccl"),
)
_CHOOSES = re.compile(r"cuda\.(?:is_available|device_count)\s*\(")
_SCRIPT_BYTES = 2 * 1024 * 1024  # a script larger than this is not read
_CUDA_LINE = re.compile(r"""^cuda\s*(?::[^=]*)?=\s*(?:["']([^"']*)["']|None)""", re.MULTILINE)


@dataclass(frozen=True)
class TorchBuild:
    """The torch this interpreter would import: its version and CUDA (None: CPU build)."""

    version: str
    cuda: str | None


def torch_build() -> TorchBuild | None:
    """This interpreter's torch, without importing it (None: no torch installed)."""
    loaded = sys.modules.get("torch")
    if loaded is not None and hasattr(loaded, "version"):
        return TorchBuild(str(loaded.__version__), loaded.version.cuda)
    try:
        dist = importlib.metadata.distribution("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    text = ""
    with contextlib.suppress(OSError):
        text = Path(str(dist.locate_file("torch/version.py"))).read_text(encoding="utf-8")
    if m := _CUDA_LINE.search(text):
        return TorchBuild(dist.version, m.group(1) or None)
    # No version.py to read: the wheel's local version says it (2.5.1+cpu).
    return TorchBuild(dist.version, None if dist.version.endswith("+cpu") else "unknown")


def _code_lines(source: str) -> list[tuple[int, str]]:
    """``(line number, code)`` with comments cut (they ask for nothing)."""
    starts: dict[int, int] = {}  # line -> where its comment starts (one a line at most)
    # A cell with IPython syntax does not tokenize: it is read as it is.
    with contextlib.suppress(tokenize.TokenError, IndentationError, SyntaxError):
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                starts[tok.start[0]] = tok.start[1]
    return [(n, line[: starts.get(n, len(line))]) for n, line in enumerate(source.splitlines(), 1)]


def cuda_asks(source: str) -> tuple[int, str] | None:
    """The first line of ``source`` that asks torch for CUDA, and what it asks; None for code
    that asks whether CUDA is there (``is_available()``, ``device_count()``): it chooses."""
    lines = _code_lines(source)
    if any(_CHOOSES.search(line) for _number, line in lines):
        return None
    for number, line in lines:
        for pattern, words in _ASKS:
            if pattern.search(line):
                return number, words
    return None


def _source(config: LaunchConfig) -> tuple[str, str] | None:
    """``(what the message calls it, its text)``: the cell or the script."""
    if config.code is not None:
        return "the cell", config.code
    if config.script is None:
        return None
    with contextlib.suppress(OSError):
        if config.script.stat().st_size <= _SCRIPT_BYTES:
            return config.script.name, config.script.read_text(encoding="utf-8", errors="replace")
    return None


def cuda_line(
    config: LaunchConfig, build: TorchBuild | None, *, gpus_here: bool, fleet: str | None = None
) -> str | None:
    """One line when the code asks for CUDA that the ranks will not have, else None.
    ``gpus_here``: GPUs CUDA can use (a simulated fleet's do not count)."""
    if build is None:
        return None  # no torch here: the ranks fail at `import torch`, which says it all
    found = None
    if (named := _source(config)) is not None and (asks := cuda_asks(named[1])) is not None:
        found = f"{named[0]} line {asks[0]} asks for CUDA ({asks[1]})"
    elif config.backend == "nccl" and fleet is None:
        # Simulated ranks' nbgpu.rank.init() runs nccl as gloo: only a real run needs CUDA.
        found = "--backend nccl asks for CUDA"
    elif any(a == "nccl" or a.endswith("=nccl") for a in config.script_args):
        found = "the script's arguments ask for nccl (CUDA)"
    if found is None:
        return None
    rehearse = "rehearse on CPU with nbgpu.rank.device() and --backend gloo"
    if build.cuda is None:
        return (
            f"{found}, but this torch ({build.version}) is a CPU build: every rank will fail "
            f"there; {rehearse}, or install torch's CUDA build"
        )
    if fleet is not None:
        return (
            f"{found}, but the simulated fleet '{fleet}' has no CUDA behind it (its ranks "
            f"compute on CPU): the ranks will fail there; use nbgpu.rank.device() for the device"
        )
    if not gpus_here:
        return (
            f"{found}, but no GPU is visible here: every rank will fail with 'No CUDA GPUs are "
            f"available'; {rehearse}"
        )
    return None
