"""The entry point of every rank: ``torchrun -m nbgpu.rank.worker``.

Before any user code: die with the agent (parent-death signal); send stdout and stderr,
at the file-descriptor level (NCCL too), into ``rank{N}.log``, complete on disk even if
the rank is killed right after writing; answer the kernel's requests for stacks and flight
records. Standard library at import time; torch only once the user's code has imported it.
"""

import contextlib
import errno
import faulthandler
import io
import json
import os
import pickle
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from nbgpu._children import die_with_parent
from nbgpu.profile.phases import configure
from nbgpu.rank.debugger import refuse_breakpoints
from nbgpu.rank.usercode import pull_payload, report_error, run_once, serve

__all__ = ["FR_REQUEST", "die_with", "dump_flight_record", "main", "serve_flight_records"]


def die_with(parent_env: str, sig: int, run_dir: Path | None, who: str) -> None:
    """Get *sig* when the process named in *parent_env* dies; when the kernel refuses,
    leave a marker the launcher shows once and records in run.json."""
    problem = die_with_parent(sig, int(os.environ.get(parent_env, "0") or 0))
    if problem is not None and run_dir is not None:
        with contextlib.suppress(OSError):
            (run_dir / f"pdeathsig-{who}.txt").write_text(problem + "\n", encoding="utf-8")


class _DiskFullTolerant(io.RawIOBase):
    """fd 1/2 under sys.stdout/sys.stderr: a full disk drops output until writes succeed
    again (a print() would raise ENOSPC in the user's code), never the rank; the first
    failure is noted in ``logfull-rank{N}.txt`` when a few bytes still fit."""

    def __init__(self, fd: int, marker: Path) -> None:
        super().__init__()
        self._fd = fd
        self._marker = marker
        self.dropped_since: float | None = None

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):  # whole writes: the text layer ignores short ones
                done += os.write(self._fd, view[done:])
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            if self.dropped_since is None:
                self.dropped_since = time.time()
                with contextlib.suppress(OSError):
                    self._marker.write_text(repr(self.dropped_since), encoding="utf-8")
        return len(view)  # all written, or dropped: the rank's work beats its log


def _redirect_output(log_path: Path, marker: Path) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Unbuffered, as `python -u` makes it: the log is complete up to the last write.
    sys.stdout, sys.stderr = (
        io.TextIOWrapper(  # type: ignore[type-var]
            _DiskFullTolerant(std_fd, marker),
            encoding="utf-8",
            errors="backslashreplace",
            write_through=True,
        )
        for std_fd in (1, 2)
    )


_STACKS_SIGNAL = signal.SIGRTMIN + 3  # what nbgpu.launch.procs sends (a test ties the two)
_stack_files: list[Any] = []  # kept open for the life of the rank


def _register_stack_dumps(run_dir: Path, rank: int) -> None:
    """`nbgpu stacks` / `%gpu_stacks`: every thread's Python stack on a signal, written by
    faulthandler from the handler itself, so a rank blocked in a collective answers too."""
    # On failure: no stacks on request; the run itself is unaffected.
    with contextlib.suppress(OSError, RuntimeError, ValueError):
        dump = (run_dir / f"stacks-rank{rank}.txt").open("ab", buffering=0)
        faulthandler.register(_STACKS_SIGNAL, file=dump, all_threads=True, chain=False)
        _stack_files.append(dump)
        (run_dir / f"stacks-rank{rank}.pid").write_text(str(os.getpid()), encoding="utf-8")


FR_REQUEST = "fr-request"  # what nbgpu.launch.outcomes writes (a test ties the two)


def dump_flight_record(run_dir: Path, rank: int, token: str) -> None:
    """``fr-rank{N}.json``: PyTorch's record of this rank's last collectives (kept when
    ``TORCH_FR_BUFFER_SIZE`` is set, as the launcher does), tagged with *token*; an empty
    trace when the user's code never imported torch.distributed or this torch has none."""
    trace = b"{}"  # an answer all the same: the kernel need not wait for this rank
    # Taken from sys.modules, never imported: a rank imports no torch before the user's code
    # does (tests/test_package.py). torch 2.13 has it, CPU builds too.
    c10d = sys.modules.get("torch._C._distributed_c10d")
    if "torch.distributed" in sys.modules and c10d is not None:
        with contextlib.suppress(AttributeError, RuntimeError):
            trace = bytes(c10d._dump_fr_trace_json())
    head = f'{{"token": "{token}", "pid": {os.getpid()}, "time_ns": {time.time_ns()}, "trace": '
    path = run_dir / f"fr-rank{rank}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(OSError):
        tmp.write_bytes(head.encode() + trace + b"}")
        tmp.replace(path)  # atomic: the kernel never reads half a record


def _flight_request(request: Path) -> str | None:
    with contextlib.suppress(OSError):
        return request.read_text(encoding="utf-8").strip() or None
    return None


def _serve_flight(run_dir: Path, rank: int) -> None:
    request = run_dir / FR_REQUEST
    seen = _flight_request(request)  # a request older than this rank is not for it
    while True:
        time.sleep(0.5)
        token = _flight_request(request)
        if token is not None and token != seen:
            seen = token
            dump_flight_record(run_dir, rank, token)


def serve_flight_records(run_dir: Path, rank: int) -> None:
    """Answer the kernel's requests for this rank's flight record from a daemon thread (only
    the rank can read it, and a rank stuck in a collective runs no Python signal handler): a
    new token in ``fr-request``, looked for twice a second (a file, not a signal or a pipe:
    every node of a run dir shared over NFS sees it)."""
    threading.Thread(
        target=_serve_flight, args=(run_dir, rank), name="nbgpu-flight-recorder", daemon=True
    ).start()


def main() -> int:
    run_dir = Path(os.environ["NBGPU_RUN_DIR"])
    rank = int(os.environ.get("RANK", "0"))
    # torchrun starts workers in their own sessions: a SIGKILLed agent would leave
    # them running (and holding GPUs). The kernel delivers SIGKILL to us instead.
    die_with("NBGPU_AGENT_PID", signal.SIGKILL, run_dir, f"rank{rank}")
    if os.environ.get("NBGPU_NODE"):  # several nodes: say where this rank runs (its label)
        with contextlib.suppress(OSError):
            (run_dir / f"rank{rank}.node").write_text(os.environ["NBGPU_NODE"], encoding="utf-8")
    # Interrupting a run means SIGINT (torchrun forwards it): the user's code gets KeyboardInterrupt
    # even when an ancestor ignored SIGINT (nohup, `cmd &`, CI), which Python would otherwise keep.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _redirect_output(run_dir / f"rank{rank}.log", run_dir / f"logfull-rank{rank}.txt")
    _register_stack_dumps(run_dir, rank)
    serve_flight_records(run_dir, rank)
    spec = json.loads((run_dir / "bootstrap.json").read_text(encoding="utf-8"))
    sample_s = spec.get("mem_sample_s", 0.1)
    rec = configure(  # this rank's memory records (mem-rank{N}.jsonl) and its sampler
        run_dir,
        sample_s=float(sample_s) if isinstance(sample_s, int | float) else 0.1,
        extra={"mem_limit": spec.get("mem_limit_bytes")},
    )
    start_phase = rec.begin("start")
    # No Python SIGTERM handler for a last sample: Python runs handlers only when the main thread
    # returns to the interpreter, so a rank blocked in a collective or a rendezvous would ignore
    # torchrun's SIGTERM for its whole grace period (30 s) and every stop would wait for SIGKILL.
    # The sampler's last record is at most one sampling interval old.
    if spec.get("mem_limit_bytes"):
        from nbgpu.rank.job import set_memory_limit  # noqa: PLC0415  (--mem-limit only)

        set_memory_limit(int(spec["mem_limit_bytes"]))
    error_path = os.environ.get("TORCHELASTIC_ERROR_FILE") or str(
        run_dir / f"error-rank{rank}.json"
    )
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
    if spec.get("keep"):
        # A warm job: cells come over the private channel until the kernel says stop.
        rec.end(start_phase)
        code = serve(spec, namespace, rec, rank=rank)
    else:
        refuse_breakpoints()  # no channel for a prompt: one line instead of pdb on stdin
        code, namespace = run_once(spec, namespace, rec, start_phase, error_path)
    exit_phase = rec.begin("exit")
    pull = spec.get("pull") if rank == 0 or spec.get("pull_all_ranks") else None
    try:
        if code == 0 and pull and not spec.get("keep"):
            tmp = run_dir / f".pull-rank{rank}.pkl.tmp"
            tmp.write_bytes(pickle.dumps(pull_payload(pull, namespace)))
            tmp.replace(run_dir / f"pull-rank{rank}.pkl")  # atomic: never read half-written
    except BaseException as exc:  # noqa: BLE001  (an unpicklable pull is reported, not fatal)
        report_error(exc, error_path)
        code = 1
    finally:
        with contextlib.suppress(Exception):
            if "torch.distributed" in sys.modules:  # else there is no process group to leave
                from nbgpu.rank.job import destroy  # noqa: PLC0415

                destroy()
        sys.stdout.flush()
        sys.stderr.flush()
        # The exit record comes before interpreter teardown (atexit, module cleanup): in no phase.
        rec.end(exit_phase)
        rec.close()
    # No gc.freeze() here: it would skip the finalizers of objects in reference
    # cycles at shutdown, and a user's writer that flushes in __del__ would lose its
    # data (tests/launch/test_hardening.py). Correctness beats the ~0.1 s it saved.
    return code


if __name__ == "__main__":
    sys.exit(main())
