"""%%gpu_phase and %gpu_memory in a real InteractiveShell."""

import re
from types import SimpleNamespace

import pytest
from IPython.core.error import UsageError
from matplotlib.text import Text

from nbgpu.notebook.run_record import MemoryTimeline
from nbgpu.profile import phases
from nbgpu.profile.phases import Phase
from nbgpu.profile.recorder import Recorder
from nbgpu.profile.report import MemoryReport
from tests.notebook.conftest import svg_images
from tests.profile.test_figure import write_rank


@pytest.fixture
def ip(ip, monkeypatch):
    monkeypatch.setattr(phases, "_RECORDER", [])  # a fresh kernel recorder per test
    yield ip
    for rec in phases._RECORDER:
        rec.close()


def test_gpu_phase_records_the_cells_allocation_in_the_kernel(ip, capsys):
    ip.run_cell_magic(
        "gpu_phase",
        "load model",
        "blob = bytearray(120 << 20)\nfor i in range(0, len(blob), 4096): blob[i] = 1\n",
    )
    out = capsys.readouterr().out
    assert "[nbgpu] phase 'load model':" in out
    assert "blob" in ip.user_ns
    report = ip.run_line_magic("gpu_memory", "kernel --no-figure")
    assert isinstance(report, MemoryReport)
    row = report.records()[0]
    assert row["phase"] == "load model"
    assert row["status"] == "done"
    assert row["peak_rss_bytes"] - row["rss_start_bytes"] >= 100 << 20


def test_gpu_phase_marks_a_failing_cell_failed(ip):
    ip.run_cell_magic("gpu_phase", "boom", "1/0")
    report = ip.run_line_magic("gpu_memory", "kernel --no-figure")
    assert report.records()[-1]["status"] == "failed"


@pytest.mark.parametrize(
    ("magic", "line", "fragment"),
    [
        ("gpu_memory", "no-such-run", "no run named 'no-such-run'"),
        ("gpu_memory", "a b", "unrecognized arguments"),
    ],
)
def test_bad_input_is_one_line(ip, magic, line, fragment):
    with pytest.raises(UsageError, match=fragment):
        ip.run_line_magic(magic, line)


@pytest.mark.parametrize("value", ["-1", "abc"])
def test_bad_sample_interval(ip, value):
    with pytest.raises(UsageError, match="--mem-sample"):
        ip.run_cell_magic("gpu_phase", f"x --mem-sample {value}", "pass")


def test_torchrun_refuses_a_bad_sample_interval_before_starting(ip):
    with pytest.raises(UsageError, match="--mem-sample 'abc'"):
        ip.run_cell_magic("torchrun", "2 --mem-sample abc", "print(1)")


@pytest.mark.parametrize(("magic", "cell"), [("gpu_phase", "pass"), ("gpu_memory", None)])
def test_help(ip, capsys, magic, cell):
    if cell is None:
        ip.run_line_magic(magic, "-h")
    else:
        ip.run_cell_magic(magic, "-h", cell)
    out = capsys.readouterr().out
    prefix = "%%" if cell is not None else "%"
    assert out.startswith(f"{prefix}{magic} ["), out
    assert ("--mem-sample" if cell is not None else "--png") in out


def test_gpu_memory_of_a_directory_without_records(ip, tmp_path):
    (tmp_path / "old").mkdir()
    report = ip.run_line_magic("gpu_memory", str(tmp_path / "old"))
    assert "no memory records" in report.text()


def test_panel_timeline_draws_each_rank_and_the_summary(tmp_path):
    for rank in (0, 1):
        rec = Recorder(tmp_path / f"mem-rank{rank}.jsonl", {"rank": rank}, sample_s=0)
        Phase("imports", rec).start()
        rec.sample()
        rec.sample()
    run = SimpleNamespace(dir=tmp_path, config=SimpleNamespace(nproc=2, world_size=2), done=False)
    timeline = MemoryTimeline(run)
    timeline.refresh()
    html = timeline.html
    assert svg_images(html).count("<polyline") == 3  # two ranks and their sum
    assert "<svg" not in html  # an image: untrusted notebooks strip inline SVG
    assert "in &#x27;imports&#x27;" in html
    timeline.refresh()  # within the second: no new message to the frontend
    assert timeline.updates == 1


def _small_run(tmp_path, ranks):
    """*ranks* of a run that died in 'run', each under 160 MiB, the higher rank the more."""
    for rank in ranks:
        write_rank(tmp_path, rank, mib=25 + 5 * rank, died_in="run")
    run = SimpleNamespace(dir=tmp_path, config=SimpleNamespace(nproc=4, world_size=4), done=False)
    return MemoryTimeline(run)


def test_panel_timeline_of_a_small_run_says_mib_names_the_node_and_colours_by_rank(tmp_path):
    timeline = _small_run(tmp_path, (2, 3))  # ranks 0 and 1 wrote nothing
    timeline.refresh()
    svg = svg_images(timeline.html)
    assert re.search(r'<text x="2" y="12">\d+\.\d MiB</text>', svg)
    assert "0.0 GiB" not in svg + timeline.html
    assert svg.endswith('fill="black">node</text></svg>')
    # tab10 by rank number: rank2 green, rank3 red (not the first two colours).
    assert 'stroke="#2ca02c"' in svg
    assert 'stroke="#d62728"' in svg
    assert "#1f77b4" not in svg
    assert re.search(r"max rank3: \d+\.\d MiB in &#x27;run&#x27;", timeline.html)


def test_the_record_says_the_runs_peak_once(tmp_path):
    text, page = _small_run(tmp_path, (0, 1)).record()
    assert re.fullmatch(
        r"memory: node peak: \d+\.\d MiB summed over 2 ranks at \d+\.\d s, every rank in 'run'"
        r" · largest rank1: \d+\.\d MiB in 'run'",
        text,
    )
    assert "mem:" not in text + page
    assert text.removeprefix("memory: ").replace("'", "&#x27;") in page


def test_gpu_memory_kernel_speaks_of_the_kernel_not_a_run(ip):
    ip.run_cell_magic("gpu_phase", "load", "blob = bytearray(60 << 20)\n")
    report = ip.run_line_magic("gpu_memory", "kernel --no-figure")
    texts = [t.get_text() for t in report.figure().findobj(Text)]
    assert "seconds since the first phase" in texts
    assert any(t.endswith("(no GPU figures: CUDA not used by the kernel)") for t in texts)
    assert not any("run started" in t or "no rank" in t for t in texts)
    assert "CUDA was not initialised by the kernel" in report.text()
    # The caption is a line of its own: as a table's caption it wrapped at the width of
    # a one-rank table, three lines for one sentence.
    assert "<caption" not in report.html()
    assert re.search(r"peak host memory \(RSS, [MG]iB\) by phase:\n *phase +kernel", report.text())
