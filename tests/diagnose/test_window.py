"""The streaming scanner: same lines as a full scan, whatever the chunking; bounded memory."""

from __future__ import annotations

import random

from nbgpu.diagnose.lines import MAX_LINE_BYTES, WindowScanner


def _collect(data: bytes, *, full: bool, pieces: list[int]) -> dict[int, bytes]:
    got: dict[int, bytes] = {}
    scanner = WindowScanner(got.__setitem__, full=full, before=3, after=5)
    position = 0
    for size in pieces:
        scanner.feed(data[position : position + size])
        position += size
    scanner.feed(data[position:])
    scanner.close()
    assert scanner.lines == data.count(b"\n") + (0 if data.endswith(b"\n") else 1)
    return got


def _log() -> bytes:
    lines = [f"step {i} loss=0.{i:04d}".encode() for i in range(3000)]
    lines[1500] = "RuntimeError: CUDA error: invalid device ordinal ✓".encode()
    lines[2999] = b"[rank1]: Traceback (most recent call last):"
    return b"\n".join(lines) + b"\n"


def test_windows_are_the_same_lines_for_any_chunking() -> None:
    data = _log()
    full = _collect(data, full=True, pieces=[])
    rng = random.Random(7)  # noqa: S311  (chunk sizes, not crypto)
    for _ in range(5):
        pieces = [rng.randint(1, 4096) for _ in range(200)]
        windowed = _collect(data, full=False, pieces=pieces)
        assert sorted(windowed) == list(range(1498, 1507)) + list(range(2997, 3001))
        for lineno, line in windowed.items():
            assert line == full[lineno]


def test_one_byte_at_a_time_keeps_utf8_and_numbering() -> None:
    data = _log()
    windowed = _collect(data, full=False, pieces=[1] * 60_000)
    assert windowed[1501].decode() == "RuntimeError: CUDA error: invalid device ordinal ✓"


def test_last_line_without_newline_is_handed_over() -> None:
    got = _collect(b"ok\nRuntimeError: x", full=False, pieces=[])
    assert got[2] == b"RuntimeError: x"


def test_lines_are_capped() -> None:
    data = b"x" * (3 * MAX_LINE_BYTES) + b"\rRuntimeError: y\n"
    got = _collect(data, full=False, pieces=[1000] * 100)
    assert len(got[1]) <= MAX_LINE_BYTES
    assert got[1].endswith(b"RuntimeError: y")


def _chatty_log(failure: list[str]) -> bytes:
    # What NCCL_DEBUG=INFO produces: an NCCL INFO line every few lines, all run long.
    lines: list[str] = []
    for i in range(5000):
        lines.append(f"[rank{i % 4}]:step {i} loss=0.{i:04d}")
        if i % 3 == 0:
            lines.append(
                f"node-1:4301:4400 [{i % 4}] NCCL INFO Channel {i % 24:02d}/24 : 0[0] -> 1[1] via P2P/IPC"
            )
        if i == 2500:
            lines.extend(failure)
    return ("\n".join(lines) + "\n").encode()


def test_nccl_info_chatter_opens_no_window() -> None:
    got = _collect(_chatty_log([]), full=False, pieces=[4096] * 50)
    assert got == {}


def test_trouble_on_an_nccl_line_is_still_found() -> None:
    # The same prefix with a failure on it: "NCCL WARN", or an INFO line carrying an error.
    failure = [
        "node-1:4302:4401 [1] NCCL WARN Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000",
        "node-1:4302:4401 [1] NCCL INFO transport/net_ib.cc:1295 -> 12 Got completion with error 12",
    ]
    data = _chatty_log(failure)
    got = _collect(data, full=False, pieces=[1000] * 200)
    texts = list(got.values())
    for line in failure:
        assert line.encode() in texts
    full = _collect(data, full=True, pieces=[])
    assert all(full[n] == line for n, line in got.items())
