"""Run directories: the first failing rank wins over the loud ones that failed because of it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nbgpu.diagnose import diagnose

from .helpers import write_run

NCCL_TIMEOUT = (
    "[rank{r}]:[E1206 18:44:12.7 ProcessGroupNCCL.cpp:607] [Rank {r}] Watchdog caught collective "
    "operation timeout: WorkNCCL(SeqNum=7753, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
    "Timeout(ms)=600000) ran for 600061 milliseconds before timing out.\n"
)
OOM = (
    "[rank2]: Traceback (most recent call last):\n"
    '[rank2]:   File "train.py", line 88, in <module>\n'
    "[rank2]:     loss.backward()\n"
    "[rank2]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.50 GiB. GPU 2 has a "
    "total capacity of 44.34 GiB of which 1.02 GiB is free.\n"
)


def _rank(
    rank: int, exit_code: int | None, ended: float, signal: str | None = None
) -> dict[str, object]:
    return {
        "rank": rank,
        "local_rank": rank,
        "exit_code": exit_code,
        "signal": signal,
        "pid": 4000 + rank,
        "ended_at": ended,
    }


def test_oom_rank_that_ended_first_is_the_root(tmp_path: Path) -> None:
    run = write_run(
        tmp_path / "run",
        ranks=[
            _rank(0, -15, 1010.0, "SIGTERM"),
            _rank(1, -15, 1010.2, "SIGTERM"),
            _rank(2, 1, 1000.0),
            _rank(3, -15, 1010.1, "SIGTERM"),
        ],
        logs={
            0: "step 1\n" + NCCL_TIMEOUT.format(r=0),
            1: NCCL_TIMEOUT.format(r=1),
            2: "step 1\n" + OOM,
            3: "step 1\n" + NCCL_TIMEOUT.format(r=3),
        },
    )
    result = diagnose(run)
    assert result.cause == "cuda_oom"
    assert result.failed_rank == 2
    assert result.root.evidence[0].where == "rank2.log:5"
    assert "tried to allocate 2.50 GiB on GPU 2 of 44.34 GiB" in result.root.details[0]
    assert {r.rank: r.role for r in result.ranks} == {
        0: "secondary",
        1: "secondary",
        2: "root",
        3: "secondary",
    }
    assert result.findings[1].cause == "nccl_timeout"
    assert result.findings[1].role == "consequence"
    assert result.world_size == 4
    assert result.input.startswith("run 'run'")


def test_the_clock_decides_not_the_order_of_the_files(tmp_path: Path) -> None:
    # rank0.log is read first, but rank 3 ended first: rank 3 is the root.
    run = write_run(
        tmp_path / "run",
        ranks=[
            _rank(0, 1, 1005.0),
            _rank(1, -15, 1006.0, "SIGTERM"),
            _rank(2, -15, 1006.0, "SIGTERM"),
            _rank(3, 1, 1000.0),
        ],
        logs={
            0: "RuntimeError: CUDA error: an illegal memory access was encountered\n",
            3: "RuntimeError: CUDA error: device-side assert triggered\n",
        },
    )
    result = diagnose(run)
    assert (result.cause, result.failed_rank) == ("device_assert", 3)
    assert result.findings[1].cause == "illegal_access"
    assert result.findings[1].role == "also"


def test_without_a_clock_the_more_specific_cause_wins_with_less_confidence(tmp_path: Path) -> None:
    run = tmp_path / "plain"
    run.mkdir()
    (run / "rank0.log").write_text(
        "torch.distributed.DistBackendError: NCCL error in: x, unhandled cuda error\n"
    )
    (run / "rank1.log").write_text(
        "RuntimeError: CUDA error: CUDA-capable device(s) is/are busy or unavailable\n"
    )
    (run / "rank2.log").write_text("RuntimeError: CUDA error: out of memory\n")
    result = diagnose(run)
    assert (result.cause, result.failed_rank) == ("cuda_busy", 1)
    assert result.root.confidence < 0.95
    assert any("no timestamps" in n for n in result.notes)


def test_exit_signals_are_evidence(tmp_path: Path) -> None:
    run = write_run(
        tmp_path / "run",
        ranks=[_rank(0, -15, 1002.0, "SIGTERM"), _rank(1, -9, 1000.0, "SIGKILL")],
        logs={0: "step 7\n", 1: "step 7\nloading shard 3/8\n"},
    )
    result = diagnose(run)
    assert (result.cause, result.failed_rank) == ("host_oom", 1)
    assert 0.4 < result.root.confidence < 0.7
    assert "--serial-imports" in " ".join(result.root.fixes)
    run11 = write_run(tmp_path / "segv", ranks=[_rank(0, -11, 1000.0)], logs={0: "step 1\n"})
    assert diagnose(run11).cause == "segfault"


def test_unknown_still_shows_the_root_cause_traceback(tmp_path: Path) -> None:
    run = write_run(
        tmp_path / "run",
        ranks=[_rank(0, 1, 1000.0), _rank(1, -15, 1001.0, "SIGTERM")],
        logs={
            0: 'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\n'
            "    cfg['lr']\nKeyError: 'lr'\n",
            1: "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.1]:4242\n",
        },
    )
    result = diagnose(run)
    assert (result.cause, result.failed_rank) == ("unknown", 0)
    assert result.root.traceback[-1] == "KeyError: 'lr'"
    assert "KeyError: 'lr'" in result.text()


def test_clean_exit_is_no_failure_even_with_errors_logged(tmp_path: Path) -> None:
    run = write_run(
        tmp_path / "run",
        ranks=[_rank(0, 0, 1000.0), _rank(1, 0, 1000.0)],
        logs={0: "RuntimeError: CUDA error: out of memory (retrying with a smaller batch)\n"},
        agent_exit_code=0,
    )
    result = diagnose(run)
    assert result.status == "no_failure"
    assert any("exited with code 0" in n for n in result.notes)


def test_real_torch_error_file_and_banner(tmp_path: Path) -> None:
    """The error file and ChildFailedError banner as this torch writes them."""
    run = tmp_path / "run"
    run.mkdir()
    script = textwrap.dedent(
        """
        import os, sys
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
        from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler
        d = sys.argv[1]
        os.environ["TORCHELASTIC_ERROR_FILE"] = d + "/error-rank1.json"
        try:
            raise RuntimeError("CUDA error: CUDA-capable device(s) is/are busy or unavailable")
        except RuntimeError as e:
            ErrorHandler().record_exception(e)
        failures = {
            1: ProcessFailure(local_rank=1, pid=4243, exitcode=1, error_file=d + "/error-rank1.json"),
            0: ProcessFailure(local_rank=0, pid=4242, exitcode=-15, error_file=d + "/missing.json"),
        }
        print(ChildFailedError("train.py", failures).format_msg())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(run)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    (run / "agent.log").write_text(out.stdout)
    (run / "rank0.log").write_text("RuntimeError: [gloo] Connection reset by peer\n")
    (run / "rank1.log").write_text("step 0\n")
    data = json.loads((run / "error-rank1.json").read_text())
    assert "py_callstack" in data["message"]["extraInfo"]
    result = diagnose(run)
    assert (result.cause, result.failed_rank) == ("cuda_busy", 1)
    assert any(e.source == "error-rank1.json" for e in result.root.evidence)
    assert {r.rank: r.role for r in result.ranks}[0] == "secondary"


@pytest.mark.parametrize("prefix", ["[default1]:", "[rank1]:", ""])
def test_rank_prefixes(prefix: str) -> None:
    text = f"{prefix}RuntimeError: CUDA error: invalid device ordinal\n"
    expected = 1 if prefix else None
    assert diagnose(text).failed_rank == expected


NO_NCCL = "RuntimeError: Distributed package doesn't have NCCL built in"


def _error_file(message: str, whole_seconds: int, precise: float) -> dict[str, object]:
    return {
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": f"Traceback (most recent call last):\n{message}\n",
                "timestamp": str(whole_seconds),
                "nbgpu_time": repr(precise),
            },
        }
    }


def test_sub_second_clock_orders_ranks_failing_within_one_second(tmp_path: Path) -> None:
    # Every rank of a bad init fails in the same second; nbgpu's ranks write a precise
    # clock next to torch's whole seconds, and it decides (rank 1 was 52 ms earlier).
    log = f"[rank{{r}}]: Traceback (most recent call last):\n[rank{{r}}]: {NO_NCCL}\n"
    run = write_run(
        tmp_path / "run",
        ranks=[_rank(0, -15, 1795476436.348, "SIGTERM"), _rank(1, 1, 1795476436.296)],
        logs={0: log.format(r=0), 1: log.format(r=1)},
        errors={
            0: _error_file(NO_NCCL, 1795476436, 1795476436.348),
            1: _error_file(NO_NCCL, 1795476436, 1795476436.296),
        },
    )
    result = diagnose(run)
    assert result.cause == "backend_unavailable"
    assert result.failed_rank == 1
    assert any("gloo" in fix for fix in result.root.fixes)


@pytest.mark.parametrize(("code", "signal"), [(-9, "SIGKILL"), (137, "SIGKILL"), (-2, "SIGINT")])
def test_an_exit_code_names_its_signal_in_a_log_and_in_run_json(
    tmp_path: Path, code: int, signal: str
) -> None:
    # torchrun says -N for signal N; a shell between it and Python says 128+N. The log's
    # banner and run.json are read with the same table.
    log = tmp_path / "job.log"
    log.write_text(
        "step 7\n"
        f"E1206 18:44:12 api.py:906] failed (exitcode: {code}) local_rank: 0 (pid: 4000) of "
        "binary: /usr/bin/python\n"
    )
    run = write_run(tmp_path / "run", ranks=[_rank(0, code, 1000.0)], logs={0: "step 7\n"})
    for source in (log, run):
        ranks = {r.rank: r.signal for r in diagnose(source).ranks}
        assert ranks == {0: signal}, source
