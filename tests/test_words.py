"""Users read nbgpu's words: scenario names, descriptions, messages, help, docstrings, comments.

None of them may mention "seeds" (the project's background notes, which users never
see); each names the situation itself. Earlier scenario names stay accepted, unlisted.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

import nbgpu
from nbgpu.devices.sim.fleet import SCENARIOS, load_fleet
from nbgpu.errors import FleetSpecError

PACKAGE = Path(nbgpu.__file__).parent
SEED_WORD = re.compile(r"\bseeds?\b|seed\s*\d", re.IGNORECASE)


def _words(path: Path) -> list[tuple[int, str]]:
    """Every string literal and comment of a module, with its line."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    kinds = {tokenize.STRING, tokenize.COMMENT, getattr(tokenize, "FSTRING_MIDDLE", -1)}
    return [(tok.start[0], tok.string) for tok in tokens if tok.type in kinds]


def test_no_string_or_comment_in_the_package_mentions_seeds():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, text in _words(path):
            if SEED_WORD.search(text):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {text[:70]}")
    assert not found, "\n".join(found)


def test_the_check_itself_catches_a_mention():
    # The scan would fail on words like these (so the test above can fail).
    assert SEED_WORD.search("seed 000's busy GPU")
    assert SEED_WORD.search("a scenario such as 'seed002'")
    assert SEED_WORD.search("# one per seed situation")
    assert not SEED_WORD.search("torch.manual_seed(0)")


def test_scenarios_are_named_and_described_for_what_they_are():
    for name in ("busy-gpu0", "nproc-mismatch", "shared-sweeps", "import-storm", "rescale-2-to-4"):
        assert name in SCENARIOS
    for name in SCENARIOS:
        description = load_fleet(name).description
        assert not SEED_WORD.search(name), name
        assert not SEED_WORD.search(description), description


@pytest.mark.parametrize("old", [f"seed00{i}" for i in range(5)])
def test_the_old_internal_names_are_refused_with_the_current_ones(old):
    # The scenarios were first named after internal notes; those names are gone, and a
    # user who still has one set is told, in one line, which names exist now.
    with pytest.raises(FleetSpecError) as info:
        load_fleet(old)
    message = str(info.value)
    assert repr(old) in message
    for name in ("busy-gpu0", "nproc-mismatch", "shared-sweeps", "import-storm", "rescale-2-to-4"):
        assert name in message


def test_unknown_scenario_lists_only_the_new_names():
    with pytest.raises(FleetSpecError) as info:
        load_fleet("busygpu")
    assert "busy-gpu0" in str(info.value)
    assert not SEED_WORD.search(str(info.value))
