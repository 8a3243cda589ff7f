"""Generated input for nbgpu's public entry points, and how an answer is judged (issue 26).

An answer is a *result* (a return value, an exit code 0 or 1, help printed), a *refusal*
(``UsageError`` / ``UserInputError`` in a notebook, exit code 2 from the CLI, either one
line), or a *traceback*: any other exception, a multi-line refusal, or "Traceback" on the
CLI's stderr. Every judge also checks that no child process is left behind.

``NBGPU_FUZZ_TALLY=FILE`` counts instead of failing: every entry point's inputs and
tracebacks go to FILE as JSON when the session ends (``bench/fuzz_tracebacks.py`` reads it).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError

from nbgpu.errors import UserInputError

TALLY_FILE = os.environ.get("NBGPU_FUZZ_TALLY")
#: entry point -> Counter of outcomes ("result", "refused", "traceback"); examples seen.
TALLY: dict[str, Counter[str]] = {}
FIRST_TRACEBACKS: dict[str, list[str]] = {}
REFUSALS: dict[str, list[str]] = {}  # the first few one-line refusals, to read


def fuzz_settings(examples: int) -> settings:
    """Derandomized (the same inputs before and after a fix), no database in the checkout;
    ``NBGPU_FUZZ_SCALE=K`` gives every entry point K times *examples*."""
    return settings(
        max_examples=round(examples * float(os.environ.get("NBGPU_FUZZ_SCALE", "1"))),
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
    )


# -- what a user can type ----------------------------------------------------------------
# No newline (a magic's argument line is one line); no surrogates (argv and cells are text).
CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r")
NASTY = (
    '"', "'", '"unclosed', "it's", "\\", "--", "-", "=", ",", ":", "-1", "0", "-0", "1e400",
    "nan", "inf", "-inf", "9" * 30, "0x10", "1.5", "1,2", "0,,1", "a=b", "K=V", "=1",
    "CUDA_VISIBLE_DEVICES=", "CUDA_VISIBLE_DEVICES=0,1", "80GB", "5G", "-5G", "0G", "auto",
    "7B", "Qwen/Qwen2.5-7B-Instruct", "d2t1p1", "sglang.d1t1p1+d3t1p1", "inference:1,train:3",
    "kernel", ".", "..", "/", "~", "~nosuchuser", "$HOME", "{x}", "-h", "localhost:0", "host:99999",
    "2xT4", "24x(8xH100)", "zero3", "fsdp", "fp16", "report", "stop", "text", "widgets",
)  # fmt: skip


def values() -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(NASTY),
        st.integers(-(2**70), 2**70).map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(str),
        st.text(CHARS, max_size=12),
    )


def token_lists(vocab: Sequence[str], max_size: int = 6) -> st.SearchStrategy[list[str]]:
    """Tokens: the entry point's own flags (and positionals' likely values), mostly each with
    a value after it, and any values between."""
    item = st.one_of(
        st.tuples(st.sampled_from(list(vocab)), values()).map(list),
        st.sampled_from(list(vocab)).map(lambda flag: [flag]),
        values().map(lambda value: [value]),
    )
    return st.lists(item, max_size=max_size).map(lambda items: [t for i in items for t in i])


def arg_lines(vocab: Sequence[str]) -> st.SearchStrategy[str]:
    """One argument line: tokens joined by spaces (quotes may stay open), or any text."""
    return st.one_of(token_lists(vocab).map(" ".join), st.text(CHARS, max_size=40))


# -- the judges --------------------------------------------------------------------------


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def record(entry: str, outcome: str, detail: str) -> None:
    """Count the outcome; outside tally mode a traceback fails the example."""
    TALLY.setdefault(entry, Counter())[outcome] += 1
    if outcome == "refused" and len(REFUSALS.setdefault(entry, [])) < 8:
        REFUSALS[entry].append(detail[:300])
    if outcome != "traceback":
        return
    if TALLY_FILE is None:
        raise AssertionError(f"{entry}: {detail}")
    FIRST_TRACEBACKS.setdefault(entry, [])
    if len(FIRST_TRACEBACKS[entry]) < 5:
        FIRST_TRACEBACKS[entry].append(detail[:400])


def _one_line(message: str) -> bool:
    return bool(message.strip()) and "\n" not in message.strip()


@contextlib.contextmanager
def _no_child_left() -> Iterator[list[int]]:
    """Yields a list that holds, after the block, the children it left (killed then)."""
    before, left = _children(), []
    yield left
    left += sorted(_children() - before)
    for pid in left:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()


def judge_call(entry: str, shown: str, call: Callable[[], Any]) -> str:
    """Run *call* (a magic, an API function): a result, a one-line refusal, or a traceback."""
    outcome, detail = "result", ""
    with _no_child_left() as left, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a warning is printed to a user, not raised
        try:
            call()
        except (UsageError, UserInputError) as exc:
            outcome = "refused" if _one_line(str(exc)) else "traceback"
            detail = f"{type(exc).__name__}: {exc!s}"
        except Exception as exc:  # noqa: BLE001  (any other exception is the finding)
            outcome, detail = "traceback", f"{type(exc).__name__}: {exc}"
            detail += f" at {_where(exc)}"
    if left:
        outcome, detail = "traceback", f"processes left behind: {left}"
    record(entry, outcome, f"{shown} -> {detail}")
    return outcome


def _where(exc: BaseException) -> str:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return "?" if tb is None else f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"


def judge_cli(entry: str, argv: Sequence[str]) -> str:
    """``nbgpu ARGV`` in this process (``nbgpu.cli.main``), stdin empty."""
    from nbgpu.cli import main  # noqa: PLC0415

    out, err = io.StringIO(), io.StringIO()
    stdin = io.TextIOWrapper(io.BytesIO(b""))
    outcome, detail, shown = "result", "", f"nbgpu {' '.join(argv)!r}"
    saved_stdin, sys.stdin = sys.stdin, stdin
    try:
        with (
            _no_child_left() as left,
            warnings.catch_warnings(),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            warnings.simplefilter("ignore")
            try:
                code: Any = main(list(argv))
            except SystemExit as exc:  # argparse's -h
                code = exc.code
            except Exception as exc:  # noqa: BLE001  (the finding)
                code, detail = None, f"{type(exc).__name__}: {exc} at {_where(exc)}"
    finally:
        sys.stdin = saved_stdin
    if code is None or "Traceback (most recent call last)" in err.getvalue():
        outcome = "traceback"
        detail = detail or err.getvalue()[-400:]
    elif code == 2:
        outcome = "refused" if _one_line(err.getvalue()) else "traceback"
        detail = f"exit 2 with {err.getvalue()!r}"
    elif code not in (0, 1, None):
        outcome, detail = "traceback", f"exit code {code!r}"
    if left:
        outcome, detail = "traceback", f"processes left behind: {left}"
    record(entry, outcome, f"{shown} -> {detail}")
    return outcome


# -- the sandbox -------------------------------------------------------------------------


def tree(root: Path) -> dict[str, tuple[int, float]]:
    """Every file under *root* with its size and mtime (what "touched" compares)."""
    out = {}
    for path in root.rglob("*"):
        with contextlib.suppress(OSError):
            stat = path.lstat()
            out[str(path.relative_to(root))] = (stat.st_size, stat.st_mtime)
    return out


def write_tally() -> None:
    if TALLY_FILE is None:
        return
    data = {
        entry: {
            "inputs": sum(c.values()),
            **c,
            "examples": FIRST_TRACEBACKS.get(entry, []),
            "refusals": REFUSALS.get(entry, []),
        }
        for entry, c in TALLY.items()
    }
    Path(TALLY_FILE).write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
