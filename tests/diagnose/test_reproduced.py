"""Failures produced for real on this kind of machine (no GPU needed), and the causes named.

Each file under ``tests/diagnose/reproduced/<cause>/`` is the unedited output of the
command its first line names (torch's CPU build, real torchrun, real bash): the messages
torch, gloo, the C++ runtime and the shell print today, next to the public threads of the
corpus. Together with the corpus they exercise every pattern of the catalog (checked below).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nbgpu.diagnose import diagnose
from nbgpu.diagnose.catalog import CATALOG, SECONDARY

HERE = Path(__file__).resolve().parent
REPRODUCED = sorted((HERE / "reproduced").glob("*/*.log"))
# The root rank where the run had more than one rank.
EXPECT_RANK = {"gloo_recv_timeout.log": 0, "torchrun_banner_other_rank_sigterm.log": 0}


@pytest.mark.parametrize("log", REPRODUCED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_reproduced_failure_is_named(log: Path) -> None:
    text = log.read_text(encoding="utf-8")
    assert text.startswith("# reproduced: "), "each file says how it was produced"
    result = diagnose(text)
    assert result.cause == log.parent.name, result.text()
    if log.name in EXPECT_RANK:
        assert result.failed_rank == EXPECT_RANK[log.name]


def _every_test_text() -> str:
    return "\n".join(
        path.read_text(encoding="utf-8", errors="replace")
        for path in HERE.parent.rglob("*")
        if path.is_file() and path.suffix in (".log", ".py")
    )


# Patterns no public thread or reproduction here shows yet: glog's CHECK of CUDA error 101
# needs a GPU and a caffe-style binary. Named, so the list can only shrink.
NOT_YET_EXERCISED = {
    "check-101",
}


def test_every_pattern_is_exercised_by_a_real_or_reproduced_log() -> None:
    blob = _every_test_text()
    patterns = [p for c in CATALOG for p in c.patterns] + list(SECONDARY)
    # The scanner matches line by line: anchors mean line ends here (MULTILINE).
    unexercised = {
        p.name
        for p in patterns
        if not re.compile(p.regex.pattern, p.regex.flags | re.MULTILINE).search(blob)
    }
    assert unexercised <= NOT_YET_EXERCISED, sorted(unexercised - NOT_YET_EXERCISED)
    # A pattern exercised since must leave the list.
    assert unexercised >= NOT_YET_EXERCISED, sorted(NOT_YET_EXERCISED - unexercised)
