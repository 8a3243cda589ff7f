"""Memory over several nodes: sums per node, never across machines."""

import json

from nbgpu.profile.live import MemoryFollower
from nbgpu.profile.report import memory_report

GIB = 1024**3


def write_run(tmp_path, per_rank, *, closed=True):
    """Ranks 0-1 on n1, 2-3 on n2; *per_rank* GiB each, all at t=1..3."""
    for rank, gib in enumerate(per_rank):
        node = "n1" if rank < 2 else "n2"
        (tmp_path / f"rank{rank}.node").write_text(node)
        lines = [{"k": "proc", "t": 0.0, "pid": 100 + rank, "mem_total": 16 * GIB, "rank": rank}]
        lines += [
            {"k": "s", "t": float(t), "rss": int(gib * GIB), "pss": int(gib * GIB),
             "avail": 8 * GIB}
            for t in (1, 2, 3)
        ]  # fmt: skip
        if closed:
            lines.append({"k": "close", "t": 4.0})
        (tmp_path / f"mem-rank{rank}.jsonl").write_text(
            "".join(json.dumps(line) + "\n" for line in lines)
        )


def test_the_peak_is_the_highest_nodes_sum(tmp_path):
    write_run(tmp_path, [1, 1, 3, 2])
    report = memory_report(tmp_path)
    assert report.node_names == ["n1", "n2"]
    peak = report.node_peak()
    assert peak.node == "n2"
    assert peak.total_bytes == 5 * GIB  # n2's two ranks, not all four (7 GiB)
    assert set(peak.phases) == {"rank2", "rank3"}
    assert any(
        f.startswith("node peak on n2: 5.0 GiB summed over 2 ranks") for f in report.findings()
    )
    assert report.to_dict()["node_peak"]["node"] == "n2"
    figure = report.figure()
    labels = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    assert "node n1: its ranks (Σ PSS)" in labels
    assert "node n2: its ranks (Σ PSS)" in labels


def test_one_node_sums_every_rank_as_before(tmp_path):
    write_run(tmp_path, [1, 1, 3, 2])
    for rank in range(4):
        (tmp_path / f"rank{rank}.node").unlink()
    report = memory_report(tmp_path)
    assert report.node_names == []
    assert report.node_peak().total_bytes == 7 * GIB
    assert report.node_peak().node is None


def test_the_live_line_sums_each_node_against_its_own_memory(tmp_path):
    write_run(tmp_path, [1, 1, 3, 2], closed=False)
    line = MemoryFollower(tmp_path, 4, several_nodes=True).summary()
    assert line.startswith("mem: n2 5.0 GiB of 16.0 GiB, n1 2.0 GiB of 16.0 GiB (Σ PSS per node)")
    assert "max rank2 on n2: 3.0 GiB" in line
