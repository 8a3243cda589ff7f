"""Following logs and putting them on screen: nothing lost, nothing flooded."""

import time

from nbgpu._render import rank_colour
from nbgpu.launch.streams import LogTail, ScreenWriter, in_turn


def append(path, data: bytes):
    with path.open("ab") as fh:
        fh.write(data)


def test_utf8_split_across_reads_stays_intact(tmp_path):
    log = tmp_path / "rank0.log"
    tail = LogTail(log)
    assert tail.poll() == []  # the file does not exist yet
    word = "naïve ünïcödé 日本\n".encode()
    append(log, word[:7])  # cut inside the two-byte "ï"
    assert tail.poll() == []
    append(log, word[7:])
    assert tail.poll() == ["naïve ünïcödé 日本"]


def test_carriage_returns_render_as_one_updating_line(tmp_path):
    log = tmp_path / "rank0.log"
    tail = LogTail(log)
    append(log, b"epoch 1\n" + b"".join(b"\r%3d%%|" % i for i in range(0, 101, 10)))
    assert tail.poll() == ["epoch 1"]
    assert tail.live == "100%|"
    append(log, b"\nwindows line\r\n")
    assert tail.poll() == ["100%|", "windows line"]


def test_last_line_without_newline_is_flushed_at_close(tmp_path):
    log = tmp_path / "rank0.log"
    tail = LogTail(log)
    append(log, b"first\nlast words before the crash \xe2\x82")  # a torn euro sign
    assert tail.poll() == ["first"]
    assert tail.close() == ["last words before the crash \ufffd"]


def test_big_log_is_read_completely(tmp_path):
    log = tmp_path / "rank0.log"
    with log.open("wb") as fh:
        for i in range(200_000):
            fh.write(b"line %d\n" % i)
    tail = LogTail(log)
    lines = []
    while True:
        got = tail.poll()
        if not got:
            break
        lines.extend(got)
    lines.extend(tail.close())
    assert len(lines) == 200_000
    assert lines[-1] == "line 199999"
    assert log.stat().st_size == tail.bytes_read


def test_screen_writer_coalesces_and_budgets():
    out = []
    writer = ScreenWriter(out.append, rate_bytes_per_s=10_000, tail_lines=5)
    for i in range(5000):
        writer.add("rank0", [f"step {i}"])
        writer.add("rank1", [f"step {i}"])
    writer.flush()
    writer.finish("/runs/x")
    text = "".join(out)
    assert len(out) <= 3  # batched, not one write per line
    assert len(text) < 30_000  # the budget held
    assert "[rank0] … 4999 lines not shown (output rate limit)" in text
    assert "last lines (complete log: /runs/x)" in text
    # The last lines of each rank are always on screen.
    assert "[rank0] step 4999" in text
    assert "[rank1] step 4999" in text
    assert writer.lines_not_shown > 9000
    assert writer.lines_shown + writer.lines_not_shown == 10_000


def test_screen_stays_live_after_a_burst():
    # A config dump bigger than the budget must not hide the progress that follows.
    out = []
    writer = ScreenWriter(out.append, rate_bytes_per_s=5_000)
    writer.add("rank0", [f"config line {i} " + "x" * 80 for i in range(2000)])
    writer.flush()
    assert "[rank0] … 1999 lines not shown" in out[-1]
    for step in range(3):
        time.sleep(0.15)
        writer.add("rank0", [f"step {step}"])
        writer.flush()
        assert out[-1] == f"[rank0] step {step}\n"  # on screen at the next tick, in full


def test_screen_writer_passes_small_output_untouched():
    out = []
    writer = ScreenWriter(out.append)
    writer.add("rank1", ["hello", "world"])
    writer.flush()
    assert out == ["[rank1] hello\n[rank1] world\n"]
    assert writer.lines_not_shown == 0


def test_colour_prefixes_differ_per_rank():
    out = []
    writer = ScreenWriter(out.append, colour=rank_colour)
    writer.add("rank0", ["a"])
    writer.add("rank1", ["b"])
    writer.flush()
    first, second = out[0].splitlines()
    assert first.startswith("\x1b[")
    assert second.startswith("\x1b[")
    assert first.split("m", 1)[0] != second.split("m", 1)[0]


def test_a_rank_keeps_its_colour_whoever_prints_first():
    # Issue 23: rank0 was cyan in one cell and yellow in the next (colours went by order).
    def prefixes(order):
        out = []
        writer = ScreenWriter(out.append, colour=rank_colour)
        for label in order:
            writer.add(label, ["x"])
        writer.flush()
        return {line.split("]")[0] for line in out[0].splitlines()}

    assert prefixes(["rank0", "rank1", "n1/rank2"]) == prefixes(["n1/rank2", "rank1", "rank0"])
    # rank0 is matplotlib's first colour (#1f77b4), as in the panel and the figures.
    assert "\x1b[38;2;31;119;180m[rank0" in prefixes(["rank1", "rank0"])


def _busy_tick(ranks, per_node=8, lines=5):
    sent = []
    writer = ScreenWriter(sent.append)
    writer._tokens = 0  # mid-run: the budget is spent
    for r in range(ranks):
        writer.add(f"n{r // per_node}/rank{r}", [f"rank {r} step {i}" for i in range(lines)])
    writer.flush()
    return writer, "".join(sent)


def test_over_the_budget_a_few_ranks_still_get_a_line_each():
    _writer, text = _busy_tick(16)
    assert text.count("\n") == 32  # a count line and the newest line per rank
    assert "[n1/rank15] rank 15 step 4" in text


def test_many_ranks_over_the_budget_get_a_line_per_node():
    writer, text = _busy_tick(128)
    lines = text.splitlines()
    assert len(lines) == 16
    assert lines[3] == "[n3] 8 ranks, 40 lines not shown; newest, rank31: rank 31 step 4"
    assert writer.lines_not_shown == 128 * 5


def test_more_nodes_than_lines_get_one_line_for_the_job():
    _writer, text = _busy_tick(4096)
    assert text == (
        "[nbgpu] 4096 ranks on 512 node(s) printed 20480 lines (output rate limit: every "
        "line is in its rank's log); newest, n511/rank4095: rank 4095 step 4\n"
    )


def test_the_end_shows_the_last_lines_of_a_few_ranks_and_counts_the_rest():
    writer, _text = _busy_tick(128)
    sent = []
    writer._write = sent.append
    writer.finish("/runs/big")
    text = "".join(sent)
    assert text.count("… last lines (complete log: /runs/big):") == 16
    assert text.endswith(
        "[nbgpu] … 112 more ranks have lines not shown here; every rank's complete log: /runs/big\n"
    )


def test_logs_take_turns_beyond_the_limit():
    assert in_turn(8, 0) == (list(range(8)), 0)
    first, cursor = in_turn(600, 0)
    assert (first[0], first[-1], cursor) == (0, 255, 256)
    second, cursor = in_turn(600, cursor)
    assert (second[0], second[-1], cursor) == (256, 511, 512)
    third, cursor = in_turn(600, cursor)
    assert third[:88] == list(range(512, 600))
    assert third[88:] == list(range(168))  # wraps around: every log is read in turn
    assert cursor == 168


def test_a_tail_that_does_not_keep_its_file_open_reads_on_where_it_stopped(tmp_path):
    path = tmp_path / "rank0.log"
    path.write_text("one\ntw")
    tail = LogTail(path, keep_open=False)
    assert tail.poll() == ["one"]
    assert tail._fd is None  # no descriptor between polls
    with path.open("a") as log:
        log.write("o\nthree\n")
    assert tail.poll() == ["two", "three"]
    assert tail._fd is None
    with path.open("a") as log:
        log.write("four")
    assert tail.close() == ["four"]
