"""nbgpu.phase records in one process: nesting, peaks, crash leftovers, bad input."""

import json
import time
from pathlib import Path

import pytest

from nbgpu.errors import UserInputError
from nbgpu.profile import recorder as procmem
from nbgpu.profile.phases import Phase, parse_sample_interval
from nbgpu.profile.recorder import Recorder
from nbgpu.profile.records import read_file
from nbgpu.profile.report import memory_report, report_from_recorder

MIB = 1024 * 1024


def touch(n_bytes):
    buf = bytearray(n_bytes)
    for i in range(0, n_bytes, 4096):
        buf[i] = 1
    return buf


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_phase_records_its_allocation_in_its_peak_and_nested_phases_keep_theirs(tmp_path):
    rec = Recorder(tmp_path / "mem-rank0.jsonl", {"rank": 0}, sample_s=0)
    with Phase("outer", rec):
        with Phase("inner", rec):
            held = touch(200 * MIB)
            del held
        time.sleep(0.01)
    rec.close()
    ranks = read_file(tmp_path / "mem-rank0.jsonl")
    spans = {p.path: p for p in ranks.phases}
    assert set(spans) == {"outer", "outer > inner"}
    assert all(p.status == "done" for p in spans.values())
    report = memory_report(tmp_path)
    frame = report.to_frame()
    inner_peak = frame.loc[("outer > inner", "rank0"), "peak_rss_bytes"]
    outer_peak = frame.loc[("outer", "rank0"), "peak_rss_bytes"]
    inner_end = frame.loc[("outer > inner", "rank0"), "rss_end_bytes"]
    # The 200 MiB was freed before the inner phase ended: only the peak shows it, and the
    # outer phase keeps it although the inner one reset the high-water mark.
    assert inner_peak - inner_end >= 150 * MIB
    assert outer_peak >= inner_peak - 4 * MIB


def test_sampling_catches_a_transient_between_phase_ends(tmp_path):
    rec = Recorder(tmp_path / "mem-rank0.jsonl", {"rank": 0}, sample_s=0.02)
    rec.start_sampling()
    with Phase("work", rec):
        held = touch(150 * MIB)
        time.sleep(0.3)
        del held
    rec.close()
    records = lines(tmp_path / "mem-rank0.jsonl")
    samples = [r for r in records if r["k"] == "s"]
    assert len(samples) >= 5
    end = next(r for r in records if r["k"] == "end")
    assert end["peak_rss"] - end["rss"] >= 100 * MIB  # the sampled peak, not just the ends


def test_phase_entered_never_left_is_died_in_and_a_cut_off_line_is_a_note(tmp_path):
    path = tmp_path / "mem-rank1.jsonl"
    rec = Recorder(path, {"rank": 1}, sample_s=0)
    Phase("model", rec).start()
    rec._fd = None  # the process "dies": nothing more is written
    with path.open("a") as handle:
        handle.write('{"k":"s","t":')  # killed mid-write
    # A pid that is not alive stands for the dead rank.
    data = [json.loads(x) for x in path.read_text().splitlines()[:-1]]
    data[0]["pid"] = 2**22 + 12345
    path.write_text("".join(json.dumps(d) + "\n" for d in data) + '{"k":"s","t":')
    ranks = read_file(path)
    assert ranks.died_in is not None
    assert ranks.died_in.name == "model"
    assert any("cut off mid-write" in n for n in ranks.notes)
    report = memory_report(tmp_path)
    assert "rank1 died in 'model'" in report.text()
    assert "✗died" in report.text()


def test_phases_closed_out_of_order_are_kept_and_said(tmp_path):
    rec = Recorder(tmp_path / "mem-rank0.jsonl", {"rank": 0}, sample_s=0)
    outer = Phase("outer", rec).start()
    inner = Phase("inner", rec).start()
    outer.stop()
    inner.stop()
    rec.close()
    ranks = read_file(tmp_path / "mem-rank0.jsonl")
    assert {p.name: p.status for p in ranks.phases} == {"outer": "done", "inner": "done"}
    assert any("ended before its nested phase(s) 'inner'" in n for n in ranks.notes)


def test_a_failing_block_marks_its_phase_failed():
    rec = Recorder(None, {}, sample_s=0)
    with pytest.raises(ZeroDivisionError), Phase("boom", rec):
        1 / 0  # noqa: B018
    report = report_from_recorder(rec)
    assert report.records()[0]["status"] == "failed"


@pytest.mark.parametrize("bad", ["-1", "abc", "", "nan", "1e9", True])
def test_bad_sample_intervals_get_one_line(bad):
    with pytest.raises(
        UserInputError, match=r"--mem-sample .*expected seconds between memory samples"
    ):
        parse_sample_interval(bad)


def test_good_sample_intervals():
    assert parse_sample_interval("0") == 0
    assert parse_sample_interval(0.1) == 0.1


@pytest.mark.parametrize("name", ["", "   ", None, 3])
def test_bad_phase_names(name):
    with pytest.raises(UserInputError, match="phase name"):
        Phase(name)


def test_a_directory_without_records_is_a_clear_empty_report(tmp_path):
    (tmp_path / "rank0.log").write_text("hello\n")
    report = memory_report(tmp_path)
    assert report.ranks == ()
    assert "no memory records" in report.text()
    assert report.to_frame().empty
    with pytest.raises(UserInputError, match="not a run directory"):
        memory_report(tmp_path / "missing")


def test_process_memory_figures_are_real_or_absent_with_a_reason():
    own = procmem.process_memory()
    assert own.rss_bytes is not None
    assert own.rss_bytes > 1 * MIB
    if Path("/proc/self/smaps_rollup").exists():
        assert 0 < own.uss_bytes <= own.pss_bytes <= own.rss_bytes
    cuda, why = procmem.cuda_memory()
    assert cuda is None  # no CUDA here, and never initialised for the profiler
    assert why
    node = procmem.node_memory()
    assert node.total_bytes > node.available_bytes > 0


def test_the_figure_renders_a_png(tmp_path):
    rec = Recorder(tmp_path / "mem-rank0.jsonl", {"rank": 0}, sample_s=0.02)
    rec.start_sampling()
    with Phase("imports", rec):
        touch(50 * MIB)
    rec.close()
    png = memory_report(tmp_path).png()
    assert png.startswith(b"\x89PNG")
    assert len(png) > 10_000
    # Drawn in, the figure is part of the report's content: an image in its HTML
    # (inline, no <style>), a line naming it in text; the plain report draws nothing.
    report = memory_report(tmp_path)
    drawn = report.with_figure()
    assert 'src="data:image/png;base64,iVBOR' in drawn.html()
    assert "<style" not in drawn.html()
    assert "figure: memory of run" in drawn.text()
    assert "<img" not in report.html()
    assert drawn.text().replace(drawn.text().splitlines()[1] + "\n", "") == report.text()
