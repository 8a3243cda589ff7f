"""%%torchrun, %gpu_runs and %gpu_stop in a real InteractiveShell with real torchrun jobs."""

import time

import psutil
import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from nbgpu.launch.execute import runs
from nbgpu.launch.run import RunFailed, leftover_processes
from nbgpu.notebook import widgets
from nbgpu.notebook.launch_magics import keep_empty_cell_body


@pytest.mark.slow
def test_torchrun_cell_flags_end_to_end(ip, capsys):
    ip.user_ns["cfg"] = {"lr": 0.5}
    cell = (
        "import os\n"
        "import resource\n"
        "import sys\n"
        "import nbgpu.rank as R\n"
        "R.init()\n"
        "import torch.distributed as dist\n"
        "rank = R.rank()\n"
        "soft, _ = resource.getrlimit(resource.RLIMIT_AS)\n"
        "print('lr', cfg['lr'], 'cvd', os.environ['CUDA_VISIBLE_DEVICES'], 'argv', sys.argv[1:],"
        " 'backend', dist.get_backend(), 'limit_gib', soft // 2**30)\n"
        "answer = rank + 41\n"
    )
    run = ip.run_cell_magic(
        "torchrun",
        "2 --name magic-ok --push cfg --pull answer,nothere --serial-imports --mem-limit 16G "
        "--backend gloo -- --epochs 2",
        cell,
    )
    captured = capsys.readouterr()
    out = captured.out
    assert run.state == "succeeded"
    assert "lr 0.5 cvd 1,2,3 argv ['--epochs', '2'] backend gloo limit_gib 16" in out
    assert "[nbgpu] GPU 0 left out: BUSY: dead holder" in out
    assert ip.user_ns["answer"] == 41
    assert "--pull nothere: rank 0 never set 'nothere'" in captured.err
    # --serial-imports: each rank took the lock for its leading imports, one at a time.
    logs = [run.logs[f"rank{r}"].read_text() for r in (0, 1)]
    assert all("LOCK: acquired" in text and "LOCK: released" in text for text in logs)
    table = ip.run_line_magic("gpu_runs", "")
    assert "magic-ok" in table.text()
    assert "succeeded" in table.text()


@pytest.mark.slow
def test_failed_cell_raises_short_error(ip):
    with pytest.raises(RunFailed) as info:
        ip.run_cell_magic("torchrun", "2 --name magic-bad", "raise KeyError('missing shard')\n")
    lines = info.value._render_traceback_()
    assert lines[0].startswith("RunFailed: run 'magic-bad' failed: rank")
    assert "KeyError: 'missing shard'" in lines[0]
    assert len(lines) < 15
    diagnosis = ip.run_line_magic("gpu_diagnose", "")
    assert diagnosis.status == "failure"
    assert diagnosis.failed_rank in (0, 1)
    assert ip.run_line_magic("gpu_diagnose", "magic-bad").cause == diagnosis.cause
    with pytest.raises(UsageError, match="no such file or directory"):
        ip.run_line_magic("gpu_diagnose", "/no/such/run")


@pytest.mark.slow
def test_background_run_and_gpu_stop(ip):
    ip.run_cell_magic(
        "torchrun",
        "2 --bg --name sleeper",
        "import time\nprint('ready', flush=True)\ntime.sleep(120)\n",
    )
    run = runs()["sleeper"]
    deadline = time.time() + 60
    while time.time() < deadline and not all(
        p.exists() and "ready" in p.read_text() for p in (run.logs["rank0"], run.logs["rank1"])
    ):
        time.sleep(0.05)
    pids = leftover_processes(run)
    assert len(pids) >= 3
    summary = ip.run_line_magic("gpu_stop", "sleeper")
    assert "stopped 'sleeper'" in summary.text()
    assert run.state == "stopped"
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert leftover_processes(run) == []


@pytest.mark.parametrize(
    ("line", "cell", "fragment"),
    [
        ("0", "x = 1\n", "nproc 0: expected a whole number >= 1"),
        ("two", "x = 1\n", "nproc 'two' is not a number"),
        ("2 --bogus", "x = 1\n", "unrecognized arguments: --bogus"),
        ("2 --push nothere", "x = 1\n", "--push nothere: no variable 'nothere'"),
        ("2 --env NOEQUALS", "x = 1\n", "--env 'NOEQUALS': expected KEY=VALUE"),
        ("2 --gpus 0", "x = 1\n", "GPU 0 is not usable"),
        ("2 --gpus 8", "x = 1\n", "GPU 8 does not exist"),
        ("7", "x = 1\n", "nproc 7 but 4 GPUs are visible"),
        ("2", "   \n", "the cell is empty"),
        ("2 --mem-limit lots", "x = 1\n", "--mem-limit 'lots'"),
        ("2 --all-ranks", "x = 1\n", "--all-ranks needs --pull NAME"),
    ],
)
def test_bad_input_is_one_line_and_starts_nothing(ip, line, cell, fragment):
    before = set(ip.run_line_magic("gpu_runs", "").entries)
    with pytest.raises(UsageError) as info:
        ip.run_cell_magic("torchrun", line, cell)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)
    assert set(ip.run_line_magic("gpu_runs", "").entries) == before


def test_help_and_line_use(ip, capsys):
    assert ip.run_line_magic("torchrun", "-h") is None
    out = capsys.readouterr().out
    assert out.startswith("%%torchrun")
    for flag in (
        "--gpus",
        "--bg",
        "--timeout",
        "--push",
        "--pull",
        "--serial-imports",
        "--mem-limit",
    ):
        assert flag in out
    with pytest.raises(UsageError, match="runs a whole cell"):
        ip.run_line_magic("torchrun", "2")
    with pytest.raises(UsageError, match="no run named 'ghost'"):
        ip.run_line_magic("gpu_stop", "ghost")
    with pytest.raises(UsageError, match="%gpu_stop NAME or %gpu_stop --all"):
        ip.run_line_magic("gpu_stop", "")


@pytest.mark.slow
def test_background_widget_panel_tracks_ranks_and_stops(ip):
    with capture_output() as shown:
        ip.run_cell_magic(
            "torchrun",
            "2 --bg --view widgets --name paneled",
            "import os, time\n"
            "for i in range(300):\n"
            "    print('rank', os.environ['RANK'], 'line', i)\n"
            "print('rank says hi', os.environ['RANK'], flush=True)\n"
            "time.sleep(120)\n",
        )
        run = runs()["paneled"]
        deadline = time.time() + 60
        while time.time() < deadline and not all(
            p.exists() and "hi" in p.read_text() for p in (run.logs["rank0"], run.logs["rank1"])
        ):
            time.sleep(0.05)
        panel = run.writer
        time.sleep(0.6)  # let the panel refresh (at most 4 Hz)
        assert panel.ranks.options == ("rank0", "rank1")
        panel.ranks.value = "rank1"  # the face follows the picked rank at once
        face = panel.view.shown["text/html"]
        assert "rank says hi 1" in face
        # The tail is bounded (200 lines) and says where the earlier lines are.
        assert f"… 101 earlier lines only in {run.logs['rank1']}\nrank 1 line 101\n" in face
        assert "rank 1 line 100\n" not in face
        assert "max-height:20em;overflow:auto" in face
        assert "rank0 · GPU 1: running" in face
        assert "rank1 · GPU 2: running" in face
        panel.stop_button.click()
        run.thread.join(timeout=20)
    assert run.state == "stopped"
    assert panel.stop_button.disabled
    assert leftover_processes(run) == []
    # Two outputs: the controls (a widget, nothing else to read), then the face, static
    # HTML and text from the start; once the run ended the controls are emptied and the
    # face is the record. No output a saved notebook keeps needs the widget's model.
    controls, face = shown.outputs[0], shown.outputs[1]
    assert "application/vnd.jupyter.widget-view+json" in controls.data
    assert controls.data["text/plain"] == ""
    assert "application/vnd.jupyter.widget-view+json" not in face.data
    assert face.data["text/plain"].startswith("run 'paneled' · running")
    assert "run &#x27;paneled&#x27; · running" in face.data["text/html"]
    updates = shown.outputs[2:]
    assert all("application/vnd.jupyter.widget-view+json" not in o.data for o in updates)
    assert {"text/plain": ""} in [o.data for o in updates]  # the controls, emptied
    last = shown.outputs[-1]
    assert last.data == panel.record
    record_text, record_html = last.data["text/plain"], last.data["text/html"]
    for rank in (0, 1):
        assert f"rank says hi {rank}" in record_text
        assert f"rank says hi {rank}" in record_html
        assert f"only in {run.logs[f'rank{rank}']}" in record_text
    assert "rank0 · GPU 1: stopped" in record_text
    assert "rank0 · GPU 1: stopped" in record_html
    assert "run 'paneled' · stopped" in record_text.splitlines()[0]
    assert "<details" in record_html
    assert "\x1b[" not in record_text + record_html


@pytest.mark.slow
def test_foreground_widget_view_on_request(ip, capsys):
    with capture_output() as shown:
        run = ip.run_cell_magic(
            "torchrun",
            "2 --view widgets --name fg-panel",
            "import os\nprint('hello', os.environ['RANK'])\n",
        )
    panel = run.writer
    assert run.state == "succeeded"
    # The interrupt button stops foreground runs: no dead Stop button, a note instead.
    assert panel.stop_button.layout.display == "none"
    live_face = shown.outputs[1].data["text/html"]
    assert "interrupt button" in live_face
    assert "rank0 · GPU 1: ok" in panel.record["text/html"]
    assert "[rank0]" not in capsys.readouterr().out  # the text went to the panel
    assert shown.outputs[-1].data == panel.record
    assert "hello 1" in panel.record["text/plain"]
    assert "interrupt" not in panel.record["text/html"]  # a finished run needs no stopping


@pytest.mark.slow
def test_background_text_view_leaves_a_record(ip, monkeypatch):
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "x")  # the text view, as under nbval
    with capture_output() as shown:
        ip.run_cell_magic(
            "torchrun",
            "2 --bg --name texty",
            "import os\nprint('\\x1b[31mred\\x1b[0m from', os.environ['RANK'])\n",
        )
        run = runs()["texty"]
        run.thread.join(timeout=120)
    assert run.state == "succeeded"
    record = shown.outputs[-1].data
    assert "red from 1" in record["text/plain"]
    assert "red from 0" in record["text/html"]
    assert "rank1 · GPU 2: ok" in record["text/plain"]
    assert "\x1b" not in record["text/plain"] + record["text/html"]


@pytest.mark.slow
def test_wait_returns_once_the_record_is_drawn(ip, monkeypatch):
    # A notebook saved right after run.wait() holds the run's record: drawing it (made slow
    # here) is done before wait() returns, not after the run is marked finished.
    drawn = widgets.record_bundle

    def slowly(*args, **kwargs):
        time.sleep(1.0)
        return drawn(*args, **kwargs)

    monkeypatch.setattr(widgets, "record_bundle", slowly)
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "x")  # the text view, as under nbval
    with capture_output() as shown:
        ip.run_cell_magic("torchrun", "2 --bg --name waited", "print('hi')\n")
        run = runs()["waited"].wait(timeout_s=120)
        last = shown.outputs[-1].data
    assert run.state == "succeeded"
    assert "text/html" in last  # the record (the live view draws text only)
    assert "hi" in last["text/plain"]
    # While it ran, the face said how to follow and stop it; the record says what happened
    # and nothing in the cell is left telling how to stop a run that is over.
    assert (
        "running in the background: %gpu_runs, %gpu_stop waited"
        in shown.outputs[0].data["text/plain"]
    )
    assert "%gpu_stop" not in last["text/plain"] + shown.stdout


@pytest.mark.parametrize(
    "source",
    ["%%torchrun banana", "%%torchrun banana\n", "%%torchrun banana\n\n", "%torchrun banana"],
)
def test_bad_nproc_is_named_in_cell_and_line_magic(ip, source):
    result = ip.run_cell(source)
    assert isinstance(result.error_in_exec, UsageError), result.error_in_exec
    assert str(result.error_in_exec).startswith("nproc 'banana' is not a number")


def test_empty_cell_says_so_and_unload_removes_the_transformer(ip):
    result = ip.run_cell("%%torchrun 2")
    assert "the cell is empty" in str(result.error_in_exec)
    ip.run_line_magic("unload_ext", "nbgpu")
    try:
        assert keep_empty_cell_body not in ip.input_transformers_cleanup
    finally:
        ip.run_line_magic("load_ext", "nbgpu")
    assert ip.input_transformers_cleanup.count(keep_empty_cell_body) == 1


@pytest.mark.slow
def test_quiet_background_record_has_no_rank_output(ip):
    with capture_output() as shown:
        ip.run_cell_magic(
            "torchrun", "2 --bg --quiet --name hush", "print('secret line', flush=True)\n"
        )
        run = runs()["hush"]
        run.thread.join(timeout=120)
    assert run.state == "succeeded"
    record = shown.outputs[-1].data
    assert "run 'hush' · succeeded" in record["text/plain"]
    assert "secret line" not in record["text/plain"] + record["text/html"]


@pytest.mark.slow
def test_a_warm_cell_in_a_widget_panel_leaves_that_cells_record(ip):
    with capture_output():
        ip.run_cell_magic(
            "torchrun",
            "2 --keep --view widgets --name warm-panel",
            "import os\nrank = os.environ['RANK']\nprint('first cell', rank)\n",
        )
    try:
        with capture_output() as shown:
            result = ip.run_cell_magic(
                "torchrun", "--on warm-panel --view widgets", "print('second cell', rank)\n"
            )
        assert result.ok
        record = shown.outputs[-1].data
        text, page = record["text/plain"], record["text/html"]
        # The record is of this cell: its lines, its outcome, and that the ranks stay.
        assert text.splitlines()[0].startswith("run 'warm-panel' · cell 2 · ok · 2 ranks")
        assert "second cell 1" in text
        assert "second cell 0" in page
        assert "first cell" not in text
        assert "rank1 · GPU 2: ok" in text
        assert "%%torchrun --on warm-panel runs the next cell" in text
        assert "\x1b" not in text + page
        # A cell on one rank: the record says which ran; the other's badge says idle.
        with capture_output() as shown:
            ip.run_cell_magic("torchrun", "--on warm-panel --view widgets --ranks 1", "pass\n")
        text = shown.outputs[-1].data["text/plain"]
        assert text.splitlines()[0].startswith("run 'warm-panel' · cell 3 · ok · 1 of 2 ranks")
        assert "rank0 · GPU 1: idle | rank1 · GPU 2: ok" in text
    finally:
        ip.run_line_magic("gpu_stop", "warm-panel")
