"""The memory facts an OOM diagnosis adds, from hand-written records of four ranks."""

import json

from nbgpu.diagnose.enrich import memory_details
from nbgpu.profile.records import import_storm
from nbgpu.profile.report import memory_report

GIB = 1024**3
MIB = 1024**2


def write_rank(directory, rank, imports, *, settled, transient, dies=False):
    """One rank's records: start, imports from imports[0] to imports[1], then run."""
    t0, t1 = imports
    lines = [
        {"k": "proc", "t": 0.0, "rank": rank, "pid": 2**22 + rank, "host": "elsewhere",
         "mem_total": 8 * GIB},
        {"k": "begin", "id": 0, "phase": "start", "parent": None, "depth": 0, "t": 0.0,
         "rss": 20 * MIB, "pss": 10 * MIB, "avail": 6 * GIB},
        {"k": "end", "id": 0, "phase": "start", "t": t0, "rss": 20 * MIB, "pss": 10 * MIB,
         "peak_rss": 20 * MIB, "peak_pss": 10 * MIB, "avail": 6 * GIB},
        {"k": "begin", "id": 1, "phase": "imports", "parent": None, "depth": 0, "t": t0,
         "rss": 20 * MIB, "pss": 10 * MIB, "avail": 6 * GIB},
        {"k": "s", "t": (t0 + t1) / 2, "rss": transient, "pss": transient, "avail": GIB // 4},
    ]  # fmt: skip
    if not dies:
        lines += [
            {"k": "end", "id": 1, "phase": "imports", "t": t1, "rss": settled, "pss": settled,
             "peak_rss": transient, "peak_pss": transient, "avail": 5 * GIB},
            {"k": "close", "t": t1 + 1},
        ]  # fmt: skip
    text = "".join(json.dumps(line) + "\n" for line in lines)
    (directory / f"mem-rank{rank}.jsonl").write_text(text)


def test_every_rank_importing_at_the_peak_names_serial_imports_with_numbers(tmp_path):
    for rank in range(4):
        write_rank(tmp_path, rank, (1.0, 3.0), settled=200 * MIB, transient=GIB)
    report = memory_report(tmp_path)
    peak = report.node_peak()
    assert peak.all_in == "imports"
    assert peak.total_bytes == 4 * GIB
    line = import_storm(report)
    # Measured: 4 x 1 GiB at once; one transient (824 MiB above settling) plus four
    # settled ranks (800 MiB) when taking turns.
    assert "node peaked at 4.00 GiB (4 ranks)" in line
    assert "rose up to 0.80 GiB above where it settled" in line
    assert "the peak would be about 1.59 GiB" in line  # 1624 MiB


def test_ranks_that_took_turns_give_no_storm_hint(tmp_path):
    for rank in range(4):
        write_rank(tmp_path, rank, (1.0 + 2 * rank, 2.5 + 2 * rank), settled=200 * MIB,
                   transient=GIB)  # fmt: skip
    assert import_storm(memory_report(tmp_path)) is None


def test_a_rank_that_died_importing_is_named_with_the_available_memory(tmp_path):
    for rank in range(4):
        write_rank(tmp_path, rank, (1.0, 3.0), settled=200 * MIB, transient=GIB, dies=rank == 2)
    details = memory_details(tmp_path)
    assert "rank2 died in phase 'imports' (memory records)" in details
    assert any(d.startswith("node MemAvailable at the last sample:") for d in details)
    assert any("every rank was in 'imports' at once" in d for d in details)


def test_no_records_no_details(tmp_path):
    assert memory_details(tmp_path) == ()
