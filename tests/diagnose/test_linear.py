"""Diagnosis in linear time whatever the log looks like: counted, not timed (issue 21).

The scanner counts the lines its windows step over (``walked``) and the trigger lines it
leaves alone as routine (``routine``); the source scan counts its catalog lookups and the
causes whose patterns it runs. Each test below puts a bound on one of those counts on a
log where every line carries a trigger, the shape that made diagnosis 45x slower.
"""

from __future__ import annotations

import string

from nbgpu.diagnose import diagnose
from nbgpu.diagnose.catalog import CATALOG, SECONDARY
from nbgpu.diagnose.lines import ROUTINE_REPEATS, WindowScanner
from nbgpu.diagnose.scan import SECONDARY_ID, SourceScan

from .helpers import corpus_logs

_DDP = (
    "UserWarning: Grad strides do not match bucket view strides. This may indicate grad was "
    "not created according to the gradient layout contract. This is not an error, but may "
    "impair performance."
)
_FAILURE = [
    "[rank2]:Traceback (most recent call last):",
    '[rank2]:  File "/workspace/train.py", line 188, in main',
    "[rank2]:    loss.backward()",
    (
        "[rank2]:torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.50 GiB. GPU 2 has "
        "a total capacity of 44.34 GiB of which 1.02 GiB is free."
    ),
]


def _letters(number: int) -> str:
    """A different word for every number (with nothing a shape strips: no digits, no a-f)."""
    word = ""
    while True:
        number, digit = divmod(number, 20)
        word += string.ascii_lowercase[6 + digit]
        if number == 0:
            return word


def _scan(data: bytes, piece: int = 65536) -> tuple[WindowScanner, dict[int, bytes]]:
    got: dict[int, bytes] = {}
    scanner = WindowScanner(got.__setitem__)
    for start in range(0, len(data), piece):
        scanner.feed(data[start : start + piece])
    scanner.close()
    return scanner, got


def test_overlapping_windows_step_over_each_line_a_bounded_number_of_times() -> None:
    # Every line a trigger of its own shape: every line opens a window of 12 + 40 lines.
    # Stepping through each window from its hit would walk every line ~40 times.
    lines = [
        f"[rank{i % 4}]:RuntimeError: worker {_letters(i)} lost its lease" for i in range(6000)
    ]
    data = ("\n".join(lines) + "\n").encode()
    for piece in (65536, 4096, 333):
        scanner, got = _scan(data, piece)
        assert sorted(got) == list(range(1, 6001))  # every line handed over, once
        assert scanner.routine == 0
        assert scanner.walked <= 2 * scanner.lines, (piece, scanner.walked, scanner.lines)


def test_routine_trigger_lines_open_no_window_however_long_the_log() -> None:
    # The same warning from every rank at every step, a loss line with a field named
    # "error", an error naming a new address each time: the lines handed over must not
    # grow with the length of the log.
    def log(steps: int) -> bytes:
        lines = []
        for step in range(steps):
            lines += [f"[rank{r}]:/torch/autograd/graph.py:825: {_DDP}" for r in range(4)]
            lines.append(f"wandb: ERROR upload of <Request object at 0x7f{step:010x}> failed")
            lines.append(
                f"[rank{step % 4}]:step {step} loss=0.{step:04d} eval_error=0.{step % 97:02d}"
            )
        return ("\n".join(lines + _FAILURE) + "\n").encode()

    _short, got_short = _scan(log(2_000))
    data = log(20_000)
    long, got_long = _scan(data)
    # Handed over: the first 32 steps (6 lines each) with a window after, and the failure.
    assert len(got_long) == len(got_short) < ROUTINE_REPEATS * 6 + 60
    assert long.routine > 95_000
    # Besides the windows, each 64 KiB piece keeps its last 12 lines for the next one
    # (and the line it completes, left over from the piece before).
    assert long.walked <= 2 * len(got_long) + 13 * (len(data) // 65536 + 1)
    assert _scan(data, 4093)[1] == got_long  # the same lines, however the bytes arrive
    # The failure at the end is still read, with the traceback above it.
    tail = list(got_long.values())[-len(_FAILURE) :]
    assert tail == [line.encode() for line in _FAILURE]


def test_each_line_is_looked_up_in_the_catalog_a_bounded_number_of_times() -> None:
    scan = SourceScan("train.log", counter=iter(range(10**9)))
    lines = [
        f"[rank{i % 4}]:step {i} loss=0.{i:04d} eval_error=0.{i % 97:02d} tokens/s={11800 + i % 500}"
        if i % 3
        else f"[rank{i % 4}]:{_DDP}"
        for i in range(3000)
    ]
    for number, line in enumerate(lines + _FAILURE, 1):
        scan.feed(number, line)
    scan.finish()
    fed = scan.lines_seen
    assert fed == len(lines) + len(_FAILURE)
    # One lookup per line (three for a wrapped exception message), and per lookup only
    # the causes one of whose keywords the line holds - not all of them.
    assert scan.catalog_lookups <= fed + 2 * len(_FAILURE)
    assert scan.cause_checks <= fed // 2 < len(CATALOG) * fed
    assert [h.cause for h in scan.hits] == ["cuda_oom"]


def test_every_line_a_trigger_gives_the_full_scans_answer() -> None:
    # ~5 MB (above the size read in full): warnings, renamed fields and a retried
    # request's traceback on every line, then rank 2's OOM and the other ranks' timeouts.
    retry = [
        "Traceback (most recent call last):",
        '  File "/site-packages/wandb/sdk/internal/internal_api.py", line 212, in execute',
        "    return self.client.execute(*args, **kwargs)",
        (
            "requests.exceptions.ReadTimeout: HTTPSConnectionPool(host='api.wandb.ai', port=443): "
            "Read timed out. (read timeout=20)"
        ),
    ]
    lines: list[str] = []
    for step in range(12_000):
        lines += [f"[rank{r}]:{_DDP}" for r in range(4)]
        lines.append(f"[rank{step % 4}]:step {step} loss=0.{step:04d} eval_error=0.{step % 97:02d}")
        lines += [f"[rank{step % 4}]:{line}" for line in retry]
    timeouts = [
        f"[rank{r}]:[E1206 18:44:12.715298746 ProcessGroupNCCL.cpp:607] [Rank {r}] Watchdog caught "
        f"collective operation timeout: WorkNCCL(SeqNum=7753, OpType=ALLREDUCE, NumelIn=1, "
        f"NumelOut=1, Timeout(ms)=600000) ran for 600061 milliseconds before timing out."
        for r in (0, 1, 3)
    ]
    text = "\n".join(lines + _FAILURE + timeouts) + "\n"
    assert len(text) > 5 * 1024 * 1024
    windowed = diagnose(text)
    full = diagnose(text, full_scan=True)
    assert windowed.cause == full.cause == "cuda_oom"
    assert windowed.failed_rank == full.failed_rank == 2


def test_the_keyword_prefilter_finds_what_every_cause_finds() -> None:
    # Every line of every corpus log: the causes matched through the shared keyword pass
    # are the ones each cause finds with its own keywords and patterns.
    scan = SourceScan("corpus", counter=iter(range(10**9)))
    for log in corpus_logs():
        for line in log.text.splitlines():
            lowered = line.lower()
            every = [
                (c, p)
                for c in CATALOG
                if any(k in lowered for k in c.keywords) and (p := c.search(line)) is not None
            ]
            assert scan._matches(line, lowered) == every, line


_SECONDARY_SAMPLES = (
    "ConnectionResetError: [Errno 104] Connection reset by peer",
    "Connection closed by remote peer",
    "BrokenPipeError: [Errno 32] Broken pipe",
    "Sending process 4301 closing signal SIGTERM",
    "torch.distributed.elastic.agent.server.api:Received 1 death signal, shutting down workers",
    "got signal: 15",
    "Signal 15 (SIGTERM) received by PID 4301",
    "exitcode  : -15 (pid: 4303)",
    "torch.distributed.elastic.multiprocessing.api.SignalException: Process 42 got signal: 1",
    "Fatal Python error: Aborted",
    "Signal 6 (SIGABRT) received by PID 4302",
    "exitcode: -6",
    "terminate called after throwing ... taking the entire process down",
)


def test_secondary_markers_pass_their_keyword_test() -> None:
    # Each SECONDARY pattern has a sample here, and every sample still becomes a hit
    # behind the keyword test that now runs first.
    assert all(any(p.regex.search(s) for s in _SECONDARY_SAMPLES) for p in SECONDARY)
    scan = SourceScan("agent.log", counter=iter(range(10**9)))
    for number, sample in enumerate(_SECONDARY_SAMPLES, 1):
        hits = len(scan.hits)
        scan.feed(number, f"[rank{number}]:{sample}")
        assert any(h.cause == SECONDARY_ID for h in scan.hits[hits:]), sample


def test_a_trigger_line_of_new_text_each_time_opens_no_window() -> None:
    # An upload error naming a new file every few lines: never routine (no two alike), and
    # no part of a failure's story, so it opens no window: neither it nor its neighbours
    # are read in Python.
    lines = []
    for step in range(3000):
        lines.append(f"[rank{step % 4}]:step {step} loss=0.{step:04d} tokens/s=11800")
        lines.append(f"[rank{step % 4}]:step {step} grad_norm=0.{step % 97:02d}")
        lines.append(f'wandb: ERROR Error uploading "media/sample_{_letters(step)}.png", retrying')
    data = ("\n".join([*lines, *_FAILURE]) + "\n").encode()
    scanner, got = _scan(data)
    assert scanner.routine == 0
    assert scanner.storyless >= 2990, scanner.storyless
    # The failure with the lines before it, and a window or two (one file is named
    # "sample_oom.png": a catalog keyword opens its window): not 3,000 nor 9,000.
    assert len(got) <= 120, len(got)
    result = diagnose(data)
    assert (result.cause, result.failed_rank) == ("cuda_oom", 2)
    assert (result.cause, result.failed_rank) == (
        diagnose(data, full_scan=True).cause,
        diagnose(data, full_scan=True).failed_rank,
    )
