"""What a cause's evidence says in numbers and names, turned into advice: the nearest batch
sizes that divide, the collective and its timeout, the failed allocation, the taken port,
the module a rank could not import and the interpreter it ran, the memory Ray saw. What
the logs do not say is :mod:`nbgpu.diagnose.enrich`'s.
"""

import re
import sys
from collections.abc import Sequence

__all__ = ["install_fixes", "interpreter", "nearest", "specifics"]

_NUM = r"\(?(\d+)\)?"
_BATCH_WORLD = re.compile(
    rf"batch[ _]?size\s*{_NUM}\s*(?:must|should) be divisible by\s*[\w ]*?{_NUM}", re.IGNORECASE
)
_DEEPSPEED = re.compile(r"world_size\s*(\d+)\s*!=\s*(\d+)\s*\*\s*(\d+)\s*\*\s*(\d+)")
_CHUNK = re.compile(r"size of DataProto (\d+) and chunk (\d+)")
_MEGATRON = re.compile(
    rf"global batch size\s*{_NUM}\s*is not divisible by micro batch size\s*{_NUM}\s*times data "
    rf"parallel size\s*{_NUM}",
    re.IGNORECASE,
)
_GENERIC_DIV = re.compile(r"(\d+)\s*(?:is not|must be|should be) (?:evenly )?divisible by\s*(\d+)")
_OP = re.compile(r"OpType=(\w+)")
_TIMEOUT = re.compile(r"Timeout\(ms\)=(\d+)\) ran for (\d+) milliseconds")
_ALLOC = re.compile(r"Tried to allocate ([\d.]+ ?[KMGT]?i?B)")
_GPU_TOTAL = re.compile(r"GPU (\d+)?\s*(?:has a total capac\w* of|;)\s*([\d.]+ ?[KMGT]i?B)")
_FREE = re.compile(r"of which ([\d.]+ ?[KMGT]?i?B) is free|([\d.]+ ?[KMGT]?i?B) free")
_PORT = re.compile(r"(?:\[::\]|0\.0\.0\.0|port)\s*:?\s*(\d{2,5})\b")
_ENDPOINT = re.compile(r"connect to \(?([\w.\-]+)[, :]+(\d{2,5})\)?")
_ASSERTION = re.compile(r"Assertion `(.+?)` failed")
_DRIVER_VERSION = re.compile(r"found version (\d+)")
_ASSERT_DIV = re.compile(r"assert\s+\(?\s*([\w.]+)\s*%\s*\(?\s*([\w.]+)\s*\)?\s*==\s*0")
_MODULE = re.compile(r"No module named '?([\w.]+)")
_PYTHON_M = re.compile(r"(/\S*python[\d.]*): No module named")
# Import names whose pip package is named otherwise.
_PIP_NAMES = {"cv2": "opencv-python", "PIL": "pillow", "yaml": "pyyaml", "sklearn": "scikit-learn",
              "skimage": "scikit-image", "bs4": "beautifulsoup4", "attr": "attrs"}  # fmt: skip
# A frame of the launcher's own traceback names its script: its bin/ holds the ranks' python.
_BIN = re.compile(r'File "([^"]*/bin/)(torchrun|deepspeed|accelerate|python[\d.]*)"')
_SITE = re.compile(r'File "([^"]*)/lib/(python\d+\.\d+)/site-packages/')
_TORCH_AT = re.compile(r'File "([^"]*/site-packages/torch)/cuda/')
_BARRIER = re.compile(r"exit barrier\. Elapsed: (\d+(?:\.\d+)?)")
_RAY_KILLED = re.compile(r"(\d+) Workers \(tasks / actors\) killed due to memory pressure")
_RAY_NODE = re.compile(r"IP: ([\d.]+)")
_RAY_USE = re.compile(r"was ([\d.]+ ?[KMGT]?B) / ([\d.]+ ?[KMGT]?B) \(([\d.]+)\), which exceeds the "
                      r"memory usage threshold of (\d+(?:\.\d+)?)")  # fmt: skip


def nearest(value: int, divisor: int) -> str:
    """The multiples of ``divisor`` just below and above ``value`` (positive only)."""
    low = (value // divisor) * divisor if divisor > 0 else 0
    near = (low, low + divisor) if divisor > 0 else ()
    return " or ".join(str(v) for v in near if v > 0 and v != value)


def _deepspeed(m: re.Match[str], world_size: int | None) -> list[str]:
    train, micro, gas, world = (int(g) for g in m.groups())
    sizes = f"micro_batch_per_gpu x gradient_accumulation x world_size = {micro} x {gas} x {world}"
    out = [f"DeepSpeed needs train_batch_size = {sizes} = {micro * gas * world}, but it is {train}"]
    if world_size and world == 1 < world_size:
        out.append(
            f"DeepSpeed counted world_size 1 while {world_size} ranks ran: the ranks did "
            "not join one process group (launch through torchrun/deepspeed, not python)"
        )
    step = micro * world
    if train % step == 0:
        out.append(f"keep {train} with gradient_accumulation_steps = {train // step}")
    else:
        low = (train // step) * step
        near = [n for n in (low, low + step) if n > 0 and n != train]
        options = ", ".join(f"{n} (gradient accumulation {n // step})" for n in near)
        out.append(f"valid train_batch_size values near {train}: {options}")
    return out


def _batch(text: str, world_size: int | None) -> str | None:
    if m := _MEGATRON.search(text):
        batch, micro, dp = (int(g) for g in m.groups())
        return (
            f"global batch {batch} must be a multiple of micro batch x data-parallel size "
            f"= {micro} x {dp}; nearest valid: {nearest(batch, micro * dp)}"
        )
    if m := _CHUNK.search(text):
        batch, parts = int(m.group(1)), int(m.group(2))
        return (
            f"a batch of {batch} cannot be split into {parts} equal parts (one per rank); "
            f"use a multiple of {parts}: {nearest(batch, parts) or parts}"
        )
    if m := _BATCH_WORLD.search(text):
        batch, world = int(m.group(1)), int(m.group(2))
        return (
            f"batch size {batch} is not divisible by world size {world}; nearest valid "
            f"batch sizes: {nearest(batch, world)}, or use a number of ranks that divides {batch}"
        )
    if m := _GENERIC_DIV.search(text):
        value, divisor = int(m.group(1)), int(m.group(2))
        return (
            f"{value} is not divisible by {divisor}; nearest multiples: {nearest(value, divisor)}"
        )
    if m := _ASSERT_DIV.search(text):
        # ``assert gradient_accumulation_steps % world_size == 0``: the values that pass.
        what, by = m.groups()
        if world_size is None:
            return f"{what} must be a multiple of {by} (the number of ranks)"
        valid = ", ".join(str(world_size * k) for k in range(1, 4))
        return (
            f"{what} must be a multiple of {by} = {world_size} ranks: {valid}, ...; "
            f"or start a number of ranks that divides {what}"
        )
    if world_size:
        return (
            f"the job ran with world size {world_size}: sizes split across ranks must be "
            f"multiples of {world_size}"
        )
    return None


def interpreter(frames: Sequence[str], python: str | None) -> str | None:
    """The python the ranks ran: run.json's, else the one a traceback's paths point to."""
    if python:
        return python
    for pattern in (_BIN, _SITE):
        for line in frames:
            if (m := pattern.search(line)) and "/.local/" not in m.group(1):
                return m.group(1) + ("python" if pattern is _BIN else "/bin/python")
    return None


def _package(text: str) -> tuple[str, str] | None:
    """``(module, pip package)`` of a "No module named" message."""
    if not (m := _MODULE.search(text)):
        return None
    module = m.group(1)
    top = module.split(".")[0]
    return module, _PIP_NAMES.get(module) or _PIP_NAMES.get(top, top)


def _missing(text: str, frames: Sequence[str], python: str | None) -> tuple[str, ...]:
    if (named := _package(text)) is None:
        return ()
    said = _PYTHON_M.search(text)  # `python -m` names itself
    exe = said.group(1) if said else interpreter(frames, python)
    if exe is None:
        return (f"the ranks could not import '{named[0]}' (pip package {named[1]!r})",)
    source = "its own message" if said else "run.json" if python else "the traceback's paths"
    other = "" if exe == sys.executable else f"; this session runs {sys.executable}"
    return (f"the ranks could not import '{named[0]}': they ran {exe} ({source}){other}",)


def install_fixes(
    cause_id: str, texts: Sequence[str], frames: Sequence[str], python: str | None
) -> tuple[str, ...]:
    """The install command with the ranks' own interpreter, when the run names it."""
    said = _PYTHON_M.search(" ".join(texts))
    exe = said.group(1) if said else interpreter(frames, python)
    if exe is None:
        return ()
    kernel = exe == sys.executable
    if cause_id == "missing_module" and (named := _package(" ".join(texts))) is not None:
        same = (
            f" (this session's python: in a notebook, `%pip install {named[1]}`)" if kernel else ""
        )
        return (f"install it where the ranks look: `{exe} -m pip install {named[1]}`{same}",)
    if cause_id == "cpu_torch" and not any("No CUDA GPUs" in t for t in texts):
        # A CPU build (a CUDA build that sees no GPU needs a GPU, not another torch).
        command = f"{exe} -m pip install torch --index-url https://download.pytorch.org/whl/cu124"
        fix = f"install the CUDA build where the ranks look: `{command}` (a cuXYZ no newer "
        return (fix + "than `nvidia-smi` shows)",)
    return ()


def _cpu_torch(text: str, frames: Sequence[str]) -> tuple[str, ...]:
    if "No CUDA GPUs are available" in text:
        first = (
            "this torch has CUDA but sees no GPU: none on this machine, or "
            "CUDA_VISIBLE_DEVICES names none that exists"
        )
    else:
        first = "this torch is a CPU build: it has no CUDA, whatever GPUs the machine has"
    where = next((m.group(1) for line in frames if (m := _TORCH_AT.search(line))), None)
    return (first, f"the ranks imported torch from {where}") if where is not None else (first,)


def _ray_oom(text: str) -> tuple[str, ...]:
    out = []
    if m := _RAY_KILLED.search(text):
        node = _RAY_NODE.search(text)
        at = f" on node {node.group(1)}" if node else ""
        out.append(f"Ray killed {m.group(1)} worker(s){at} for host memory pressure")
        if node:
            out.append(
                f"which processes held the memory: `ray logs raylet.out -ip {node.group(1)}`"
            )
    if m := _RAY_USE.search(text):
        used, total, share, limit = m.groups()
        out.append(f"node memory {used} of {total} ({share}) passed Ray's threshold {limit}")
    return tuple(out)


def specifics(
    cause_id: str,
    texts: Sequence[str],
    ranks: Sequence[int],
    world_size: int | None,
    *,
    frames: Sequence[str] = (),
    python: str | None = None,
) -> tuple[str, ...]:
    """Sentences with the numbers the evidence gives for ``cause_id``. ``frames``: the run's
    traceback lines (they name the ranks' interpreter and torch); ``python``: run.json's."""
    text = " ".join(texts)
    found: str | None = None
    if cause_id == "missing_module":
        return _missing(text, frames, python)
    if cause_id == "cpu_torch":
        return _cpu_torch(text, frames)
    if cause_id == "ray_oom":
        return _ray_oom(text)
    if cause_id == "exit_barrier" and (m := _BARRIER.search(text)):
        return (f"this node's agent waited {float(m.group(1)):.0f} s for the other nodes' agents",)
    if cause_id == "batch_divisibility":
        if m := _DEEPSPEED.search(text):
            return tuple(_deepspeed(m, world_size))
        found = _batch(text, world_size)
    elif cause_id == "invalid_ordinal":
        first = min(ranks, default=0)
        if first > 0 and (world_size is None or max(ranks) == world_size - 1):
            s = "s" if first != 1 else ""
            found = (
                f"ranks {first} and up found no GPU while ranks below {first} did: the job sees "
                f"{first} GPU{s}, so start {first} rank{s} per node (`%%torchrun {first}`)"
            )
    elif cause_id == "rendezvous" and (m := _ENDPOINT.search(text)):
        found = f"could not reach the rendezvous store at {m.group(1)}:{m.group(2)}"
    elif cause_id == "device_assert" and (m := _ASSERTION.search(text)):
        found = f"the failed kernel assertion: {m.group(1)}"
    elif cause_id == "nccl_timeout":
        op, t = _OP.search(text), _TIMEOUT.search(text)
        what = op.group(1) if op else "a collective"
        if t:
            waited, limit = int(t.group(2)) / 1000, int(t.group(1)) / 1000
            found = (
                f"{what} waited {waited:.0f} s (timeout {limit:.0f} s) for a rank that never "
                "joined it"
            )
        elif op:
            found = f"{what} timed out waiting for a rank that never joined it"
    elif cause_id == "cuda_oom" and (alloc := _ALLOC.search(text)):
        total, free = _GPU_TOTAL.search(text), _FREE.search(text)
        sentence = f"tried to allocate {alloc.group(1)}"
        if total:
            gpu = f"GPU {total.group(1)} " if total.group(1) else "a GPU "
            sentence += f" on {gpu}of {total.group(2)}"
        if free:
            sentence += f" with {free.group(1) or free.group(2)} free"
        found = sentence
    elif cause_id == "port_in_use" and (m := _PORT.search(text)):
        port = int(m.group(1))
        if port < 1024:
            return (f"port {port} is privileged (< 1024): use a port above 1024",)
        shared = " (torchrun's default, shared by every job that keeps it)" if port == 29500 else ""
        found = f"port {port} was already taken{shared}"
    elif cause_id == "driver" and (m := _DRIVER_VERSION.search(text)):
        version = int(m.group(1))
        found = (
            f"the driver supports CUDA up to {version // 1000}.{(version % 1000) // 10} "
            f"(found version {version}); the installed torch needs a newer one"
        )
    return (found,) if found else ()
