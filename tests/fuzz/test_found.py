"""What the generated inputs found (issue 26), each pinned by one example, and the rule
behind the fix: every magic reads its argument line through one parser."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from IPython.core.error import UsageError

from nbgpu.cli import main
from nbgpu.notebook import magics_classes

MAGICS = [
    (kind, name) for cls in magics_classes() for kind, names in cls.magics.items() for name in names
]


@pytest.mark.parametrize(("kind", "name"), MAGICS)
def test_every_magic_reads_its_line_through_one_parser(shell, kind, name):
    # magic_arguments' parser on each (what parse_or_help reads with), and the same one-line
    # answers: an open quote names the magic and the line, an unknown flag points at -h.
    assert getattr(shell.magics_manager.magics[kind][name], "__func__", None).parser
    run = (
        shell.run_line_magic
        if kind == "line"
        else lambda n, line: shell.run_cell_magic(n, line, "\n")
    )
    shown = f"%%{name}" if name in shell.magics_manager.magics["cell"] else f"%{name}"
    with pytest.raises(UsageError) as info:
        run(name, "x 'open")
    assert str(info.value).startswith(f'{shown} "x \'open": No closing quotation')
    with pytest.raises(UsageError) as info:
        run(name, "x --no-such-flag")  # x: a positional where the magic takes one
    assert f"{shown}: unrecognized arguments: " in str(info.value)
    assert f"--no-such-flag (see {shown} -h)" in str(info.value)
    assert "\n" not in str(info.value)


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["estimate", "~nosuchuser"], "'~nosuchuser': no user 'nosuchuser' here"),
        (["diagnose", "~nosuchuser/rank0.log"], "no user 'nosuchuser' here"),
        (["estimate", "1e400"], "model '1e400': expected a parameter count"),
        (["estimate", "7B", "--budget", "1e400"], "budget='1e400': expected a size"),
        (["stacks", "/"], "'/': not a run directory"),
        (["plan", "--nodes", str(10**11), "--gpus-per-node", "1"], "and <= 100000"),
        (["plan", "--nodes", "2", "--gpus-per-node", "100"], "GPUs per node=100"),
    ],
)
def test_arguments_that_gave_a_traceback(sandbox, argv, said):  # noqa: ARG001
    code, _, err = _cli(argv)
    assert (code, err.count("\n")) == (2, 1), err
    assert said in err


def test_a_fleet_file_that_is_not_utf8_is_named(sandbox, monkeypatch):
    path = sandbox["inputs"] / "latin1.json"
    path.write_bytes(b'{"nbgpu_fleet": 1, "name": "caf\xe9"\n')  # cut short, and not UTF-8
    monkeypatch.setenv("NBGPU_SIMULATE", str(path))
    code, _, err = _cli(["status"])
    assert code == 2
    assert f"fleet file {str(path)!r} is not valid JSON" in err


def test_memory_records_with_damaged_fields_are_skipped(sandbox):
    run = sandbox["inputs"] / "damaged-run"
    run.mkdir()
    lines = [
        {"k": "proc", "t": 1.0, "pid": 1, "rank": 0},
        {"k": "begin", "id": 0, "phase": "load", "t": 2.0, "rss": [1, 2]},  # a list for bytes
        {"k": "s", "rss": 5},  # no time
        {"k": "end", "id": 0, "phase": "load", "t": {"at": 3}},  # a time that is no number
        {"k": "end", "id": 0, "phase": "load", "t": 3.0, "peak_rss": "big", "rss": 7},
    ]
    (run / "mem-rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    code, out, err = _cli(["memory", str(run), "--json"])
    assert code == 0, err
    data = json.loads(out)
    assert [row["phase"] for row in data["phases"]] == ["load"]
    assert "mem-rank0.jsonl: 2 unreadable line(s) skipped" in data["notes"]
