"""Launch overhead: a hello-world gloo job, bare torchrun vs nbgpu's three faces.

Every case runs the same work (``init_process_group("gloo")``, one ``all_reduce``,
one print per rank, ``destroy_process_group``) on 2 ranks, alternating, in one run:

a. bare ``python -m torch.distributed.run`` given the rendezvous arguments nbgpu's
   agent passes (``--nnodes 1 --node-rank 0 --nproc-per-node 2 --master-addr
   127.0.0.1 --master-port <free port> --max-restarts 0``): the anchor, same work
t. the same as (a) through ``bench/torchrun_no_teardown.py``: a launcher that ends in
   ``os._exit`` as nbgpu's agent does, skipping torch's interpreter teardown in the
   launcher (the ranks tear down in every case): the like-for-like anchor
s. bare ``torchrun --standalone --nproc-per-node 2 hello.py`` for reference: c10d
   dynamic rendezvous, with its deliberate waits (about 1 s per sync step); the
   difference (s) - (a) is the rendezvous alone, not anything nbgpu does
b. ``nbgpu run -n 2 hello.py`` (the CLI; runs directory in a temp dir; no simulation)
c. ``%%torchrun 2`` on the same code in a real Jupyter kernel driven by jupyter_client
   (one kernel, ``%load_ext nbgpu`` once; each cell timed from execute_request to
   ``status: idle``)
d. accelerate's ``notebook_launcher(hello, num_processes=2)`` in a second real kernel,
   if accelerate is importable (see ``ACCELERATE_SITE``); otherwise the reason is printed

Reported: median wall time and CPU (the child and its reaped descendants; for kernels
the kernel's own CPU plus its children's), ratios (b)/(a) and (c)/(a) against the
1.10 budget, (b)/(t) and (c)/(t) against 1.00, and the time to the first rank line as the user sees it: for
subprocesses the arrival time of the first ``hello from rank`` line on the child's
stdout pipe, for kernels the arrival of the first iopub ``stream`` message holding it.

    .venv/bin/python bench/bench_launch.py [N]       # N timed rounds (default 7)

accelerate is not a dependency of nbgpu. To include (d) without touching the venv
(it would add anyio's pytest plugin, tqdm, httpx... to everyone's test runs)::

    .venv/bin/pip install --no-deps --target ~/.cache/nbgpu-bench/accelerate-site \\
        accelerate==1.15.0 pyyaml safetensors huggingface_hub

An accelerate installed in the venv itself is used as well.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from harness import PYTHON, VENV_BIN, Case, Row, child_env, print_ratios, print_table, run_once

BUDGET_RATIO = 1.10
RUN_TIMEOUT_S = 90.0
NO_TEARDOWN = Path(__file__).resolve().parent / "torchrun_no_teardown.py"
TAG_ENV = "NBGPU_BENCH_TAG"  # every process a benchmark starts carries it: the leak check
ACCELERATE_SITE = Path(
    os.environ.get(
        "NBGPU_BENCH_ACCELERATE_SITE",
        str(Path.home() / ".cache" / "nbgpu-bench" / "accelerate-site"),
    )
)

HELLO_BODY = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"hello from rank {dist.get_rank()}/{dist.get_world_size()} sum={t.item():g}", flush=True)
dist.destroy_process_group()
"""
MARKER = "hello from rank"

# accelerate launches a function (fork); the same statements, indented into one.
ACCELERATE_SETUP = """\
import sys
if {site!r} not in sys.path:
    sys.path.insert(0, {site!r})
from accelerate import notebook_launcher

def hello():
{body}
"""

# Compiled into the harness's private bytecode cache before anything is timed.
PRIME = (
    "import torch, torch.distributed.run, nbgpu.cli, nbgpu.launch.run, nbgpu.rank.agent, "
    "nbgpu.rank.worker, nbgpu.launch.launcher, nbgpu.notebook.launch_magics, ipykernel.kernelapp, "
    "jupyter_client"
)


# -- one timed execution ----------------------------------------------------------------


@dataclass
class Timed:
    """One execution: wall and CPU seconds, when the first rank line arrived, the output."""

    wall_s: float
    cpu_s: float
    first_line_s: float | None
    text: str


@dataclass
class Series:
    """All timed executions of one case."""

    name: str
    runs: list[Timed] = field(default_factory=list)

    def row(self, note: str = "") -> Row:
        return Row(
            self.name,
            [r.wall_s * 1000 for r in self.runs],
            [r.cpu_s * 1000 for r in self.runs],
            note=note,
        )

    @property
    def first_line_ms(self) -> float:
        values = [r.first_line_s * 1000 for r in self.runs if r.first_line_s is not None]
        return statistics.median(values) if values else float("nan")


def _children_cpu_s() -> float:
    import resource  # noqa: PLC0415

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def run_subprocess(
    argv: list[str], env: Mapping[str, str], cwd: Path, *, timeout_s: float = RUN_TIMEOUT_S
) -> tuple[Timed, str, int]:
    """Run *argv* to the end; stdout lines are timestamped as they arrive on the pipe.

    Returns (timing, stderr, exit code). The child gets its own session, so a timeout
    kills its whole process group (nbgpu's own agent has its own session and dies
    with its parent; the leak check at the end catches anything else).
    """
    lines: list[tuple[float, str]] = []
    errors: list[bytes] = []
    cpu_before = _children_cpu_s()
    started = time.perf_counter()
    proc = subprocess.Popen(
        argv,
        env=dict(env),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    out_pipe, err_pipe = proc.stdout, proc.stderr

    def read_out() -> None:
        lines.extend(
            (time.perf_counter() - started, raw.decode("utf-8", "replace")) for raw in out_pipe
        )

    def read_err() -> None:
        errors.append(err_pipe.read())

    readers = [threading.Thread(target=f, daemon=True) for f in (read_out, read_err)]
    for reader in readers:
        reader.start()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise RuntimeError(f"timed out after {timeout_s:g} s: {' '.join(argv)}") from None
    wall = time.perf_counter() - started
    for reader in readers:
        reader.join(timeout=10)
    out_pipe.close()
    err_pipe.close()
    cpu = _children_cpu_s() - cpu_before
    first = next((t for t, line in lines if MARKER in line), None)
    text = "".join(line for _, line in lines)
    return (
        Timed(wall, cpu, first, text),
        b"".join(errors).decode("utf-8", "replace"),
        proc.returncode,
    )


# -- a real Jupyter kernel -----------------------------------------------------------


@dataclass
class Cell:
    """One executed cell, as a Jupyter client saw it."""

    wall_s: float
    cpu_s: float
    status: str  # the execute_reply status: ok / error / aborted
    error: str | None
    streams: list[tuple[float, str, str]]  # (seconds after execute_request, name, text)
    messages: int  # iopub messages for this cell, status/execute_input excluded

    @property
    def text(self) -> str:
        return "".join(text for _, _, text in self.streams)

    def first(self, marker: str) -> float | None:
        return next((t for t, _, text in self.streams if marker in text), None)


class Kernel:
    """One ipykernel for this interpreter, started with *env* in *workdir*."""

    def __init__(self, workdir: Path, env: Mapping[str, str], name: str) -> None:
        from jupyter_client import KernelManager  # noqa: PLC0415
        from jupyter_client.kernelspec import KernelSpecManager  # noqa: PLC0415

        spec_dir = workdir / "kernels" / name
        spec_dir.mkdir(parents=True)
        (spec_dir / "kernel.json").write_text(
            json.dumps(
                {
                    "argv": [PYTHON, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                    "display_name": f"nbgpu bench {name}",
                    "language": "python",
                }
            )
        )
        specs = KernelSpecManager()
        specs.kernel_dirs = [str(workdir / "kernels")]
        self.km = KernelManager(kernel_name=name, kernel_spec_manager=specs)
        self.km.start_kernel(env=dict(env), cwd=str(workdir))
        self.client = self.km.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)
        self.pid = self.km.provisioner.process.pid

    def _cpu_s(self) -> float:
        try:
            t = psutil.Process(self.pid).cpu_times()
        except psutil.Error:
            return float("nan")
        return t.user + t.system + t.children_user + t.children_system

    def execute(self, code: str, timeout_s: float = RUN_TIMEOUT_S) -> Cell:
        """Run *code*; wall time from execute_request to ``status: idle``."""
        cpu_before = self._cpu_s()
        started = time.perf_counter()
        msg_id = self.client.execute(code)
        streams: list[tuple[float, str, str]] = []
        error = None
        messages = 0
        deadline = started + timeout_s
        while True:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                self.km.interrupt_kernel()
                raise RuntimeError(f"cell timed out after {timeout_s:g} s: {code[:60]!r}")
            try:
                msg = self.client.get_iopub_msg(timeout=remaining)
            except queue.Empty:
                continue
            now = time.perf_counter() - started
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind not in ("status", "execute_input"):
                messages += 1
            if kind == "stream":
                streams.append((now, content["name"], content["text"]))
            elif kind == "error":
                error = f"{content['ename']}: {content['evalue']}"
            elif kind == "status" and content["execution_state"] == "idle":
                break
        wall = time.perf_counter() - started
        reply = self.client.get_shell_msg(timeout=30)
        status = reply["content"]["status"]
        if status != "ok" and error is None:
            error = f"execute_reply {status}: {''.join(t for _, n, t in streams if n == 'stderr')}"
        return Cell(wall, self._cpu_s() - cpu_before, status, error, streams, messages)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.stop_channels()
        with contextlib.suppress(Exception):
            if self.km.is_alive():
                self.km.shutdown_kernel(now=False)
        with contextlib.suppress(Exception):
            if self.km.is_alive():
                self.km.shutdown_kernel(now=True)
        with contextlib.suppress(Exception):
            self.km.cleanup_resources()
        with contextlib.suppress(Exception):
            self.km.context.term()  # otherwise zmq's Context.__del__ warns at exit


@contextlib.contextmanager
def kernel(workdir: Path, env: Mapping[str, str], name: str) -> Iterator[Kernel]:
    k = Kernel(workdir, env, name)
    try:
        yield k
    finally:
        k.close()


# -- housekeeping ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tagged_processes(tag: str) -> list[psutil.Process]:
    """Live processes (any we started, at any depth) whose environment carries *tag*."""
    needle = f"{TAG_ENV}={tag}".encode()
    return [proc for proc in psutil.process_iter() if _carries(proc, needle)]


def _carries(proc: psutil.Process, needle: bytes) -> bool:
    try:
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        return needle in environ and proc.status() != psutil.STATUS_ZOMBIE
    except (OSError, psutil.Error):
        return False


def leak_check(tag: str, wait_s: float = 10.0) -> list[str]:
    """Processes left behind by this benchmark (waits for stragglers, then kills them)."""
    deadline = time.monotonic() + wait_s
    left = tagged_processes(tag)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = tagged_processes(tag)
    described = []
    for proc in left:
        with contextlib.suppress(psutil.Error):
            described.append(f"{proc.pid} {' '.join(proc.cmdline())[:100]}")
            proc.kill()  # ours: it carries this run's tag
    return described


def accelerate_available(env: Mapping[str, str]) -> str | None:
    """None if ``from accelerate import notebook_launcher`` works here; else why not."""
    code = (
        f"import sys; sys.path.insert(0, {str(ACCELERATE_SITE)!r}); "
        "import torch, accelerate; from accelerate import notebook_launcher; "
        "print(accelerate.__version__, torch.__version__)"
    )
    proc = subprocess.run(
        [PYTHON, "-c", code],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["?"]
        return f"accelerate not importable ({tail[0]}); see this module's docstring to install it"
    return None


def _accelerate_version(env: Mapping[str, str]) -> str:
    code = (
        f"import sys; sys.path.insert(0, {str(ACCELERATE_SITE)!r}); "
        "import accelerate; print(accelerate.__version__)"
    )
    proc = subprocess.run(
        [PYTHON, "-c", code], env=dict(env), capture_output=True, text=True, timeout=60, check=False
    )
    return proc.stdout.strip() or "?"


def _check_ranks(name: str, text: str, nproc: int = 2) -> None:
    for rank in range(nproc):
        if f"{MARKER} {rank}/{nproc} sum={nproc}" not in text:
            raise RuntimeError(f"{name}: no line from rank {rank} in the output:\n{text[-2000:]}")


# -- the benchmark ----------------------------------------------------------------------


@dataclass
class Setup:
    work: Path
    env: dict[str, str]
    script: Path
    cases: dict[str, Callable[[], Timed]]
    skipped: dict[str, str]


def _subprocess_case(
    name: str, argv: list[str] | Callable[[], list[str]], env: Mapping[str, str], cwd: Path
) -> Callable[[], Timed]:
    def run() -> Timed:
        timed, stderr, code = run_subprocess(argv() if callable(argv) else argv, env, cwd)
        if code != 0:
            raise RuntimeError(f"{name}: exit code {code}: {stderr.strip()[-1500:]}")
        _check_ranks(name, timed.text)
        return timed

    return run


def _kernel_case(name: str, k: Kernel, make_code: Callable[[], str]) -> Callable[[], Timed]:
    def run() -> Timed:
        cell = k.execute(make_code())
        if cell.error:
            raise RuntimeError(f"{name}: {cell.error}\n{cell.text[-1500:]}")
        _check_ranks(name, cell.text)
        return Timed(cell.wall_s, cell.cpu_s, cell.first(MARKER), cell.text)

    return run


CASE_A = "a. bare torchrun, nbgpu's static rendezvous"
CASE_T = "t. bare torchrun as (a), launcher skips teardown"
CASE_S = "s. bare torchrun --standalone (c10d)"
CASE_B = "b. nbgpu run -n 2 (CLI)"
CASE_C = "c. %%torchrun 2 (real kernel)"
CASE_D = "d. accelerate notebook_launcher (real kernel)"


def measure(n: int, stack: contextlib.ExitStack, work: Path, tag: str) -> dict[str, Series]:
    env = child_env({TAG_ENV: tag, "NBGPU_RUNS_DIR": str(work / "runs")})
    env.pop("PYTHONUNBUFFERED", None)  # bare torchrun gets none; nbgpu sets its own
    script = work / "hello.py"
    script.write_text(HELLO_BODY, encoding="utf-8")
    torchrun = [PYTHON, "-m", "torch.distributed.run"]
    standalone = [*torchrun, "--standalone", "--nproc-per-node", "2", str(script)]

    def static(launcher: list[str] = torchrun) -> list[str]:
        # Exactly the rendezvous arguments nbgpu's Run.start gives its agent.
        return [
            *launcher,
            "--nnodes",
            "1",
            "--node-rank",
            "0",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "--max-restarts",
            "0",
            str(script),
        ]

    cases: dict[str, Callable[[], Timed]] = {
        CASE_A: _subprocess_case(CASE_A, static, env, work),
        CASE_T: _subprocess_case(CASE_T, lambda: static([PYTHON, str(NO_TEARDOWN)]), env, work),
        CASE_S: _subprocess_case(CASE_S, standalone, env, work),
        CASE_B: _subprocess_case(
            CASE_B, [str(VENV_BIN / "nbgpu"), "run", "-n", "2", str(script)], env, work
        ),
    }
    nb = stack.enter_context(kernel(work, {**env, "IPYTHONDIR": str(work / "ipy")}, "nbgpu"))
    loaded = nb.execute("%load_ext nbgpu")
    if loaded.error:
        raise RuntimeError(f"%load_ext nbgpu failed in the kernel: {loaded.error}")
    cases[CASE_C] = _kernel_case(CASE_C, nb, lambda: "%%torchrun 2\n" + HELLO_BODY)

    why_not = accelerate_available(env)
    if why_not is None:
        acc = stack.enter_context(kernel(work, {**env, "IPYTHONDIR": str(work / "ipy")}, "acc"))
        body = "".join("    " + line + "\n" for line in HELLO_BODY.splitlines())
        setup = acc.execute(ACCELERATE_SETUP.format(site=str(ACCELERATE_SITE), body=body))
        if setup.error:
            why_not = f"accelerate set-up cell failed: {setup.error}"
        else:
            cases[CASE_D] = _kernel_case(
                CASE_D,
                acc,
                # A fresh port each time: its default 29500 would collide with anything.
                lambda: f"notebook_launcher(hello, num_processes=2, use_port='{free_port()}')",
            )
    if why_not is not None:
        print(f"\n(d) accelerate notebook_launcher: not measured: {why_not}")

    series = {name: Series(name) for name in cases}
    names = list(cases)
    for round_index in range(1 + n):  # one untimed warm-up round
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            try:
                timed = cases[name]()
            except RuntimeError as exc:
                if name != CASE_D:
                    raise
                # accelerate's launcher has hung here (a cell past RUN_TIMEOUT_S): the
                # anchor is dropped with its reason; nbgpu's own cases are kept.
                print(f"\n(d) accelerate notebook_launcher dropped in round {round_index}: {exc}")
                names.remove(name)
                del series[name]
                continue
            if round_index:
                series[name].runs.append(timed)
    return series


def _paired_ratio(num: Series, den: Series) -> float:
    return statistics.median(
        a.wall_s / b.wall_s for a, b in zip(num.runs, den.runs, strict=True) if b.wall_s
    )


def report(series: dict[str, Series]) -> dict[str, float]:
    bare, like = series[CASE_A], series[CASE_T]
    rows = []
    figures: dict[str, float] = {}
    for name, s in series.items():
        note = f"first rank line {s.first_line_ms:.0f} ms"
        if name in (CASE_B, CASE_C):
            r = s.row().median_wall / like.row().median_wall
            verdict = "OK" if r <= 1.0 else "OVER"
            note += f"; wall/(t) {r:.2f} (goal 1.00: {verdict})"
            note += f", per-round median {_paired_ratio(s, like):.2f}"
            r = s.row().median_wall / bare.row().median_wall
            verdict = "OK" if r <= BUDGET_RATIO else "OVER"
            note += f"; wall/(a) {r:.2f} (budget {BUDGET_RATIO:.2f}: {verdict})"
        elif name in (CASE_D, CASE_S, CASE_T):
            note += f"; wall/(a) {s.row().median_wall / bare.row().median_wall:.2f}"
        rows.append(s.row(note))
    print_table("Launch overhead, 2 ranks, hello-world gloo (medians, alternating)", rows)
    for anchor, title in (
        (CASE_T, "the like-for-like anchor: bare torchrun whose launcher also skips teardown"),
        (CASE_A, "bare torchrun with the same static rendezvous"),
    ):
        pairs = [
            (f"({name[0]}) / ({anchor[0]})", series[name].row(), series[anchor].row())
            for name in (CASE_T, CASE_S, CASE_B, CASE_C, CASE_D)
            if name in series and name != anchor
        ]
        print_ratios(f"Ratios (each / {title})", pairs)
    a_ms, s_ms = bare.row().median_wall, series[CASE_S].row().median_wall
    t_ms = like.row().median_wall
    print(f"(a) - (t) = {a_ms - t_ms:+.0f} ms: torch's interpreter teardown in the launcher")
    for name in (CASE_B, CASE_C):
        extra = series[name].row().median_wall - t_ms
        print(
            f"{name}: {extra:+.0f} ms over (t), same rendezvous, same teardown skip: "
            "nbgpu's own work (CLI or magic, inventory, agent wrapper, log following, "
            "result collection, the orphan sweep)"
        )
    print(f"(s) - (a) = {s_ms - a_ms:+.0f} ms: c10d's dynamic rendezvous alone (--standalone)")
    print(
        "\n| time to first rank line | median ms | minus (a) | per-round median minus (a) "
        "| minus (t) | per-round median minus (t) |"
    )
    print("|---|---|---|---|---|---|")
    for name, s in series.items():
        cells = [f"{s.first_line_ms:.0f}"]
        for anchor in (bare, like):
            diffs = [
                (a.first_line_s - b.first_line_s) * 1000
                for a, b in zip(s.runs, anchor.runs, strict=True)
                if a.first_line_s is not None and b.first_line_s is not None
            ]
            paired = statistics.median(diffs) if diffs else float("nan")
            cells += [f"{s.first_line_ms - anchor.first_line_ms:+.0f}", f"{paired:+.0f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    for name, s in series.items():
        figures[f"{name[0]}_wall_ms"] = s.row().median_wall
        figures[f"{name[0]}_first_line_ms"] = s.first_line_ms
    return figures


def main(n: int = 7) -> dict[str, float]:
    """Prime bytecode, time every case *n* rounds, print tables, check for leftovers."""
    run_once(Case("prime bytecode", [PYTHON, "-c", PRIME]), timeout_s=300)
    tag = secrets.token_hex(6)
    work = Path(tempfile.mkdtemp(prefix="nbgpu-bench-launch-"))
    started = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            series = measure(n, stack, work, tag)
        if CASE_D in series:
            print(f"\naccelerate {_accelerate_version(child_env({}))} from {ACCELERATE_SITE}")
        figures = report(series)
    finally:
        leaked = leak_check(tag)
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nprocesses left behind (psutil, by this run's tag): {leaked or 'none'}")
    print(f"launch benchmark time: {time.perf_counter() - started:.0f} s")
    if leaked:
        raise RuntimeError(f"processes left behind: {leaked}")
    return figures


if __name__ == "__main__":
    main(n=int(sys.argv[1]) if len(sys.argv) > 1 else 7)
