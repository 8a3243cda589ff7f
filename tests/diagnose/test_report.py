"""Rendering: 80-column text, escaped HTML, JSON, pandas; the headline for failure summaries."""

from __future__ import annotations

import json

from nbgpu.diagnose import Diagnosis, FoundCause, diagnose
from nbgpu.problems import Problem

TEXT = (
    "[rank3]: <script>alert(1)</script>\n"
    "[rank3]: ValueError: batch size(8) must be divisible by world_size(3)!\n"
    "[rank0]: [E ProcessGroupNCCL.cpp:1] [Rank 0] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=1, OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600100 milliseconds before timing out.\n"
)


def test_text_fits_80_columns_and_leads_with_the_root() -> None:
    result = diagnose(TEXT, name="cell")
    text = result.text()
    assert all(len(line) <= 80 for line in text.splitlines()), text
    lines = text.splitlines()
    assert lines[4] == "  rank 3 failed first · confidence 0.95"
    assert lines[0].startswith("nbgpu diagnose - cell")
    assert lines[2].startswith("ROOT CAUSE: Batch (or parallel size) not divisible")
    assert "nearest valid batch sizes: 6 or 9" in " ".join(text.split())
    assert "consequence: Collective operation timed out [nccl_timeout] on rank 0" in " ".join(lines)
    assert str(result) == text


def test_headline_for_failure_summaries() -> None:
    result = diagnose(TEXT)
    assert result.headline.startswith(
        "Batch (or parallel size) not divisible by the ranks on rank 3"
    )
    assert "6 or 9" in result.headline


def test_html_is_escaped_and_complete() -> None:
    bundle = diagnose(TEXT)._repr_mimebundle_()
    html = bundle["text/html"]
    assert "<script>" not in html
    assert "<style" not in html  # colours inline: untrusted notebooks keep them
    assert "batch_divisibility" in html
    assert "<table" in html
    assert bundle["text/plain"].startswith("nbgpu diagnose")


def test_dict_json_and_frame() -> None:
    result = diagnose(TEXT)
    data = json.loads(result.to_json())
    assert data["cause"] == "batch_divisibility"
    assert data["status"] == "failure"
    root = data["findings"][0]
    assert root["role"] == "root"
    assert root["first_rank"] == 3
    assert root["evidence"][0] == {
        "source": "<text>",
        "line": 2,
        "rank": 3,
        "text": "ValueError: batch size(8) must be divisible by world_size(3)!",
    }
    frame = result.to_frame()
    assert list(frame["cause"]) == ["batch_divisibility", "nccl_timeout"]
    finding = result.root
    assert isinstance(finding, FoundCause)
    assert finding.to_dict()["fixes"] == list(finding.fixes)
    assert finding.summary().startswith("Batch (or parallel size)")
    assert "evidence:" in finding.text()
    html = finding.html()
    assert "border-left:3px solid #c0392b" in html  # a root cause is ruled red, inline
    assert "<code>%gpu_plan</code>" in html


def test_each_cause_is_a_problem_with_its_fixes() -> None:
    result = diagnose(TEXT)
    root, consequence = result.problems
    assert isinstance(root, Problem)
    assert (root.severity, root.code, root.subject) == ("bad", "batch_divisibility", "rank 3")
    assert root.fixes == result.root.fixes
    assert root.message.startswith("Batch (or parallel size) not divisible by the ranks: ")
    assert (consequence.severity, consequence.code) == ("warn", "nccl_timeout")


def test_no_failure_renders_plainly() -> None:
    result = diagnose("all good\n")
    assert isinstance(result, Diagnosis)
    assert result.text().splitlines()[-1] == "no failure found"
    assert result.to_dict()["findings"] == []
    assert len(result.to_frame()) == 0
