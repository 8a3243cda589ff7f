"""Inputs: strings vs paths, streams, stdin, files, directories, and every kind of bad input."""

from __future__ import annotations

import io
import json
import random
import sys
import types
from pathlib import Path

import pytest

from nbgpu.diagnose import diagnose
from nbgpu.diagnose.sources import load_error_file, load_run_json, resolve
from nbgpu.errors import UserInputError

OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n"


def test_missing_path_is_a_one_line_user_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "train.log"
    with pytest.raises(UserInputError) as info:
        diagnose(str(missing))
    message = str(info.value)
    assert "\n" not in message
    assert str(missing) in message
    assert "expected a log file" in message
    with pytest.raises(UserInputError):
        diagnose("runs/does-not-exist")
    with pytest.raises(UserInputError):
        diagnose(12345)


def test_a_message_is_text_and_a_path_is_a_path(tmp_path: Path) -> None:
    assert resolve("RuntimeError: CUDA error: invalid device ordinal").kind == "text"
    assert resolve(OOM).kind == "text"
    assert resolve(b"some bytes").kind == "text"
    log = tmp_path / "train.log"
    log.write_text(OOM)
    assert resolve(str(log)).kind == "file"
    assert resolve(log).kind == "file"
    assert diagnose(log).cause == "cuda_oom"
    # A file name too long for the file system is text, not an OSError.
    assert diagnose("x" * 300 + " RuntimeError: CUDA error: out of memory").cause == "cuda_oom"


def test_empty_inputs_get_an_answer(tmp_path: Path) -> None:
    for source in ("", b"", io.BytesIO(b"")):
        result = diagnose(source)
        assert result.status == "empty"
        assert result.cause == "none"
        assert "empty" in result.headline
    empty = tmp_path / "empty.log"
    empty.write_bytes(b"")
    assert diagnose(empty).status == "empty"


def test_binary_garbage_is_noted_not_fatal() -> None:
    garbage = random.Random(4).randbytes(300_000)  # noqa: S311  (test data, not crypto)
    result = diagnose(garbage)
    assert result.status in ("no_failure", "failure")
    assert any("binary" in note for note in result.notes)
    assert diagnose(b"\x00" * 5000 + OOM.encode()).cause == "cuda_oom"


def test_directory_without_logs(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 10)
    (tmp_path / "sub").mkdir()
    result = diagnose(tmp_path)
    assert result.status == "no_logs"
    assert "no log files" in " ".join(result.notes)
    assert result.headline == "nothing to diagnose: no log files found"


def test_log_without_failure() -> None:
    text = "".join(f"step {i} loss={1 / (i + 1):.3f}\n" for i in range(500))
    result = diagnose(text)
    assert result.status == "no_failure"
    assert result.root is None
    assert result.headline == "no failure found"
    assert "no failure found" in result.text()


def test_streams_and_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    assert diagnose(io.BytesIO(OOM.encode())).cause == "cuda_oom"
    assert diagnose(io.StringIO(OOM), name="cell").root.evidence[0].source == "cell"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(OOM.encode())))
    result = diagnose("-")
    assert result.input == "<stdin>"
    assert result.cause == "cuda_oom"


def test_carriage_returns_and_split_utf8(tmp_path: Path) -> None:
    bar = "".join(f"\r {p}%|█████| {p}/100 [00:0{p % 10}<00:10]" for p in range(0, 100, 5))
    text = f"épreuve 🚀 step 1\n{bar}\rRuntimeError: CUDA error: an illegal memory access was encountered\n"
    log = tmp_path / "bar.log"
    log.write_bytes(text.encode())
    result = diagnose(log)
    assert result.cause == "illegal_access"
    evidence = result.root.evidence[0]
    assert evidence.lineno == 2  # \r is not a line break; \n is
    assert evidence.text.startswith("RuntimeError: CUDA error: an illegal memory access")


def test_a_huge_line_without_newline_is_cut_not_buffered(tmp_path: Path) -> None:
    log = tmp_path / "one-line.log"
    with log.open("wb") as out:
        for _ in range(40):  # 40 MB of tqdm-style updates, never a newline
            out.write(b"\r 50%|#####     | 500/1000 [01:00<01:00, 8.3it/s]" * 20_000)
        out.write(b"\rRuntimeError: CUDA error: invalid device ordinal")
    result = diagnose(log)
    assert result.cause == "invalid_ordinal"
    assert result.root.evidence[0].lineno == 1


def test_run_object_with_run_dir(tmp_path: Path) -> None:
    (tmp_path / "rank0.log").write_text(OOM)

    class Run:
        run_dir = tmp_path

    result = diagnose(Run())
    assert result.cause == "cuda_oom"
    assert result.failed_rank == 0


def test_nbgpus_own_run_object(tmp_path: Path) -> None:
    # nbgpu.runs()[name] keeps its directory in .dir: diagnosing the run itself works.
    (tmp_path / "rank0.log").write_text(OOM)
    run = types.SimpleNamespace(dir=tmp_path, name="train")
    assert diagnose(run).cause == "cuda_oom"


def test_malformed_run_json_and_error_files_become_notes(tmp_path: Path) -> None:
    notes: list[str] = []
    (tmp_path / "run.json").write_text("{not json")
    assert load_run_json(tmp_path / "run.json", notes) is None
    (tmp_path / "error.json").write_text(json.dumps({"no": "message"}))
    assert load_error_file(tmp_path / "error.json", 0, notes) is None
    (tmp_path / "rank0.log").write_text(OOM)
    result = diagnose(tmp_path)
    assert result.cause == "cuda_oom"
    assert any("run.json" in n for n in result.notes)
    assert any("error.json" in n for n in result.notes)


def test_error_file_formats(tmp_path: Path) -> None:
    notes: list[str] = []
    old = tmp_path / "error-rank1.json"
    old.write_text(
        json.dumps(
            {
                "message": {
                    "message": "RuntimeError: boom",
                    "extraInfo": {
                        "py_callstack": 'Traceback (most recent call last):\n  File "x.py", line 1\nRuntimeError: boom\n',
                        "timestamp": "1700000000",
                    },
                    "errorCode": -9,
                }
            }
        )
    )
    record = load_error_file(old, 1, notes)
    assert record is not None
    assert (record.message, record.error_code, record.rank) == ("RuntimeError: boom", -9, 1)
    assert record.stamp is not None
    assert record.stamp.seconds == 1700000000
    new = tmp_path / "error-rank2.json"
    new.write_text(
        json.dumps({"message": "Signal 9 (SIGKILL) received by PID 7", "timestamp": 1700000005})
    )
    record = load_error_file(new, 2, notes)
    assert record is not None
    assert record.message.startswith("Signal 9")
    assert notes == []


def test_torchelastic_log_dir_layout_gives_ranks(tmp_path: Path) -> None:
    for local in (0, 1):
        worker = tmp_path / "run-id" / "attempt_0" / str(local)
        worker.mkdir(parents=True)
        (worker / "stdout.log").write_text("step 1\n")
        (worker / "stderr.log").write_text(OOM if local == 1 else "")
    result = diagnose(tmp_path)
    assert result.cause == "cuda_oom"
    assert result.failed_rank == 1
