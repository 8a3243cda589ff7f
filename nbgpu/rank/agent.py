"""The torchrun agent, wrapped: ``python -m nbgpu.rank.agent RESULT.json -- <torchrun args>``.

It is torchrun (what torchrun leaves when a rank fails: see :func:`_as_torchrun_reports`),
plus: it dies with the process that launched it (and its workers with it), listens on one
address only, and writes a machine-readable result (per-rank exit codes, signals, error files).
"""

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn

from nbgpu.rank.worker import die_with

__all__ = ["main", "main_and_exit"]


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2), encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        # A full disk: the exit code still tells nbgpu whether every rank succeeded.
        with contextlib.suppress(OSError):
            print(f"nbgpu agent: could not write {path.name}: {exc}", file=sys.stderr)


def _as_torchrun_reports(exc: Any) -> None:
    """What torchrun itself leaves for a failed child: ``@record`` copies the first failed
    rank's error file to ``TORCHELASTIC_ERROR_FILE`` (``agent-error.json``), and the uncaught
    ChildFailedError prints the "Root Cause" banner on stderr (``agent.log``)."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler  # noqa: PLC0415

    _, failure = exc.get_first_failure()
    # A rank killed by a signal wrote no error file (torchrun says "<N/A>"): torchrun
    # then copies nothing either, and neither must we.
    copied = failure.error_file if os.environ.get("TORCHELASTIC_ERROR_FILE") else None
    if copied and Path(copied).is_file():
        try:
            get_error_handler().dump_error_file(copied, failure.exitcode)
        except Exception:  # noqa: BLE001  (an unreadable child file must not hide the banner)
            traceback.print_exc()
    traceback.print_exception(exc)  # stderr is unbuffered (PYTHONUNBUFFERED)


def _listen_on_one_address(args: Any) -> None:
    """Every listening socket of the job on one address: loopback on one node, else the one
    this node reaches the rendezvous host from (also its ``--local-addr``: c10d's MASTER_ADDR).
    torchrun's stores (static; c10d's, and the one it shares with the ranks) listen on ``[::]``
    whatever host they are given (``--master-addr``/``--local-addr`` change only what ranks are
    told); ``master_listen_fd``, a socket the caller bound, is the one way to choose: so in
    this process (no user code) ``TCPStore`` binds one first. On one node gloo and NCCL listen
    on ``lo`` (their ``*_SOCKET_IFNAME``), over a user's value too: no other node needs them."""
    import torch.distributed as dist  # noqa: PLC0415

    if args.rdzv_backend == "static":
        address = args.master_addr = "127.0.0.1"  # bound, and told to the ranks
        os.environ.update(GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")  # the ranks inherit
    else:
        host, port = args.rdzv_endpoint.rsplit(":", 1)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, int(port)))  # UDP: picks the route, sends nothing
            address = args.local_addr = args.local_addr or probe.getsockname()[0]

    class BoundStore(dist.TCPStore):  # type: ignore[misc,name-defined]  # exported, not by name
        def __init__(self, host_name: str, port: int, *args: Any, **kwargs: Any) -> None:
            if kwargs.get("is_master", args[1:2] == (True,)):  # args: world_size, is_master...
                try:
                    sock = socket.create_server((address, port))
                except OSError as exc:  # c10d then joins as a client: another node hosts
                    raise RuntimeError(f"cannot listen on {address}:{port}: {exc}") from exc
                port, kwargs["master_listen_fd"] = sock.getsockname()[1], sock.detach()
            try:
                super().__init__(host_name, port, *args, **kwargs)
            except NotImplementedError:  # libuv servers before pytorch#150215 took no fd
                super().__init__(host_name, port, *args, **kwargs, use_libuv=False)

    dist.TCPStore = BoundStore  # type: ignore[attr-defined]


# Environment that decides what this interpreter loaded (which Python packages and libraries,
# torch's own logging): a run that changes one gets an agent started again with it.
_LOADED_BY = ("PYTHON", "LD_", "TORCH_", "LOGLEVEL")
_READ_BY_RANKS = ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",)  # nbgpu's own, per run


def _take_run() -> list[str]:
    """``--wait`` (nbgpu/launch/spare.py): once torch is imported, the run from stdin. Its
    environment is applied here (the ranks inherit it), or, when it changes what this
    interpreter loaded, this agent starts again with it."""
    line = sys.stdin.buffer.readline()
    if not line:
        os._exit(0)  # the launcher started no run: nothing was done, nothing to report
    job = json.loads(line)
    env: dict[str, str] = job["env"]
    os.chdir(job["cwd"])
    # The output so far (a file the launcher gave, read-write) goes first into the log.
    sys.stdout.flush()
    sys.stderr.flush()
    early = b""
    while chunk := os.pread(1, 1 << 16, len(early)):
        early += chunk
    fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    os.write(fd, early)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    changed = {k for k in {*env, *os.environ} if env.get(k) != os.environ.get(k)}
    if any(k.startswith(_LOADED_BY) and k not in _READ_BY_RANKS for k in changed):
        argv = [sys.executable, "-m", "nbgpu.rank.agent", *job["argv"]]
        os.execve(sys.executable, argv, env)  # noqa: S606  (this same program, no shell)
    os.environ.clear()
    os.environ.update(env)
    return list(job["argv"])


def main(argv: list[str]) -> int:
    # SIGTERM, not SIGKILL: torchrun's handler then stops its workers itself; the
    # workers' own parent-death signal covers the case where that fails. Armed before the
    # imports: an agent started early dies with its launcher while it waits for a run.
    die_with("NBGPU_LAUNCHER_PID", signal.SIGTERM, None, "agent")
    # nbgpu stops a run with SIGINT first; an ancestor's ignored SIGINT (nohup, `cmd &`)
    # must not turn that into a wait for SIGTERM.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: PLC0415
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: PLC0415
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError  # noqa: PLC0415
    from torch.distributed.run import parse_args, run  # noqa: PLC0415

    if argv == ["--wait"]:
        argv = _take_run()
    if len(argv) < 2 or argv[1] != "--":
        raise SystemExit("usage: python -m nbgpu.rank.agent RESULT.json -- <torchrun args>")
    result_path = Path(argv[0])
    run_dir = os.environ.get("NBGPU_RUN_DIR")
    if run_dir:  # again, now that the run is known: a refused signal is noted in it
        die_with("NBGPU_LAUNCHER_PID", signal.SIGTERM, Path(run_dir), "agent")
    os.environ["NBGPU_AGENT_PID"] = str(os.getpid())  # inherited by every worker
    args = parse_args(argv[2:])
    _listen_on_one_address(args)
    result: dict[str, Any] = {"failures": [], "signal": None}
    code = 0
    try:
        run(args)
    except ChildFailedError as exc:
        result["failures"] = [
            {
                "rank": int(rank),
                "pid": int(failure.pid),
                "exit_code": int(failure.exitcode),
                "signal": failure.signal_name() if int(failure.exitcode) < 0 else None,
                "error_file": failure.error_file or None,
            }
            for rank, failure in sorted(exc.failures.items())
        ]
        _as_torchrun_reports(exc)
        code = 1
    except SignalException as exc:
        result["signal"] = exc.sigval.name
        code = 128 + int(exc.sigval)
    except KeyboardInterrupt:
        result["signal"] = "SIGINT"
        code = 130
    except RendezvousTimeoutError:
        # torchrun says nothing: the kernel words it from how long (k=v,k=v; else 600 s).
        conf = dict(part.partition("=")[::2] for part in args.rdzv_conf.split(","))
        waited = float(conf.get("join_timeout") or 600)
        result["rendezvous_timeout_s"] = waited
        code = 1
    except Exception as exc:  # noqa: BLE001  (torchrun's own failures: report them, exit non-zero)
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}"
        code = 1
    result["agent_exit_code"] = code
    _write(result_path, result)
    return code


def main_and_exit(argv: list[str]) -> NoReturn:
    exit_code = main(argv)
    # The agent runs no user code and its result is on disk: skip the interpreter's
    # teardown of torch (about a second on 2 cores) instead of making the user wait.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


if __name__ == "__main__":
    main_and_exit(sys.argv[1:])
