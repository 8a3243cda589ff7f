"""The memory figure, checked by what a reader must see: labels that never cover each
other, one label per death event, a unit that fits the values, a colour per rank number.

Records are written as a run writes them (``mem-rank{N}.jsonl``) and read by the same
reader (:func:`memory_report`); the figure is laid out by matplotlib's own renderer.
"""

import json

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_hex
from matplotlib.text import Text

from nbgpu.profile.report import memory_report

MIB = 1024**2
PHASES = (("start", 0.0, 0.03), ("imports", 0.03, 0.06), ("run", 0.06, 3.0))


def write_rank(directory, rank, *, mib=100.0, died_in=None):
    """A rank through PHASES, its memory climbing by a step each 0.1 s from *mib* MiB;
    with *died_in*, it stops inside that phase (no end, no close): it died there."""
    lines = [{"k": "proc", "t": 0.0, "rank": rank, "pid": 1000 + rank, "mem_total": 16 << 30}]
    for number, (name, start, end) in enumerate(PHASES):
        value = int(mib * MIB * (1 + start))
        lines.append({"k": "begin", "id": number, "phase": name, "parent": None, "depth": 0,
                      "t": start, "rss": value, "pss": value})  # fmt: skip
        steps = [start + 0.1 * i for i in range(1, int((end - start) / 0.1))]
        lines += [{"k": "s", "t": t, "rss": int(mib * MIB * (1 + t)), "pss": int(mib * MIB * (1 + t))}
                  for t in steps]  # fmt: skip
        if name == died_in:
            break
        lines.append({"k": "end", "id": number, "phase": name, "t": end, "rss": value,
                      "pss": value, "peak_rss": value, "peak_pss": value})  # fmt: skip
    else:
        lines.append({"k": "close", "t": 3.0})
    (directory / f"mem-rank{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def shown_texts(figure):
    """Every text a reader sees in *figure*, once laid out, with its box in pixels."""
    renderer = FigureCanvasAgg(figure).get_renderer()
    figure.draw_without_rendering()
    texts = [t for t in figure.findobj(Text) if t.get_visible() and t.get_text().strip()]
    return [(t.get_text(), t.get_window_extent(renderer)) for t in texts]


def assert_no_overlap(figure):
    texts = shown_texts(figure)
    for i, (text, box) in enumerate(texts):
        for other, other_box in texts[i + 1 :]:
            assert not box.overlaps(other_box), f"{text!r} covers {other!r}"


@pytest.mark.parametrize("nproc", [2, 8, 64])
def test_ranks_that_died_together_get_one_label_and_no_text_covers_another(tmp_path, nproc):
    for rank in range(nproc):
        write_rank(tmp_path, rank, died_in="run")
    figure = memory_report(tmp_path).figure()
    assert_no_overlap(figure)
    deaths = [text for text, _ in shown_texts(figure) if "died in" in text]
    assert deaths == [f"ranks 0-{nproc - 1} died in 'run'"]


def test_deaths_in_two_phases_at_one_moment_are_two_labels_apart(tmp_path):
    for rank in range(8):
        write_rank(tmp_path, rank, died_in="run" if rank % 2 else "imports")
    figure = memory_report(tmp_path).figure()
    assert_no_overlap(figure)
    deaths = sorted(text for text, _ in shown_texts(figure) if "died in" in text)
    assert deaths == ["ranks 0, 2, 4, 6 died in 'imports'", "ranks 1, 3, 5, 7 died in 'run'"]


def test_narrow_phase_bands_keep_only_the_names_that_fit(tmp_path):
    # 'start' and 'imports' last 0.03 s each in a 3 s run: their names would overlap.
    for rank in range(2):
        write_rank(tmp_path, rank)
    figure = memory_report(tmp_path).figure()
    assert_no_overlap(figure)
    bands = [
        t.get_text() for t in figure.axes[0].texts if t.get_visible() and "'" not in t.get_text()
    ]
    assert "run" in bands
    assert ("start" in bands) != ("imports" in bands), bands


def test_a_small_run_reads_in_mib(tmp_path):
    for rank in range(2):
        write_rank(tmp_path, rank, mib=12)
    texts = [text for text, _ in shown_texts(memory_report(tmp_path).figure())]
    assert "host MiB (PSS)" in texts
    assert any(
        text.startswith("node peak 9") and text.endswith("MiB · all in 'run'") for text in texts
    )
    assert not any("0.0 GiB" in text for text in texts)


def test_a_rank_has_its_numbers_colour_whoever_else_ran(tmp_path):
    for rank in (3, 7):
        write_rank(tmp_path, rank)
    figure = memory_report(tmp_path).figure()
    colours = {line.get_label(): to_hex(line.get_color()) for line in figure.axes[0].lines}
    # tab10 by rank number: rank3 red, rank7 grey, though they are the first two lines.
    assert colours["rank3"] == "#d62728"
    assert colours["rank7"] == "#7f7f7f"


def test_a_death_at_the_node_peak_steps_its_label_clear_of_the_peaks(tmp_path):
    # rank1 holds nearly all the memory and dies at the node's peak: both labels want the
    # same spot; one steps down a line, neither is dropped.
    write_rank(tmp_path, 0, mib=1)
    write_rank(tmp_path, 1, mib=100, died_in="run")
    figure = memory_report(tmp_path).figure()
    assert_no_overlap(figure)
    texts = [text for text, _ in shown_texts(figure)]
    assert "rank1 died in 'run'" in texts
    assert any(text.startswith("node peak ") for text in texts)
