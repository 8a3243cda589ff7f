"""The streaming scanner: same lines as a full scan, whatever the chunking; bounded memory."""

from __future__ import annotations

import random

from nbgpu.diagnose.window import MAX_LINE_BYTES, WindowScanner


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
