"""A rescaled YAML config keeps every byte but the changed values (comments, order, quotes)."""

import difflib
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nbgpu.plan
from nbgpu.errors import UserInputError
from nbgpu.scale.yamldoc import load_yaml, rewrite_yaml

CONFIGS = Path(__file__).parent / "configs"
PPO = CONFIGS / "ppo_2gpu.yaml"


def changed_lines(old: str, new: str) -> list[tuple[str, str]]:
    """(old line, new line) pairs of a diff that changes lines one for one."""
    a, b = old.splitlines(), new.splitlines()
    assert len(a) == len(b), "lines were added or removed"
    return [(x, y) for x, y in zip(a, b, strict=True) if x != y]


def test_rescaled_yaml_changes_only_the_values_it_names():
    plan = nbgpu.plan.scale(PPO, to_gpus=4)
    assert plan.ok
    assert plan.form == "yaml"
    old = PPO.read_text()
    assert changed_lines(old, plan.to_text()) == [
        (
            "CUDA_VISIBLE_DEVICES: '0,1'   # the two A40s",
            "CUDA_VISIBLE_DEVICES: '0,1,2,3' # the two A40s",
        ),
        (
            "  train_batch_size: 64        # prompts per step",
            "  train_batch_size: 128       # prompts per step",
        ),
        ("    ppo_mini_batch_size: 32", "    ppo_mini_batch_size: 64"),
        ("  n_gpus_per_node: 2", "  n_gpus_per_node: 4"),
    ]
    # What a dump of the whole document would lose is still there, byte for byte.
    new = plan.to_text()
    for kept in ("# Values marked", "---\n", "tokenizer: null", "return_raw_chat: False", "True\n"):
        assert kept in new
    assert plan.to_yaml() == new
    # The diff is of the user's file, not of a re-dump.
    diff = plan.diff()
    assert "-  train_batch_size: 64        # prompts per step" in diff
    assert not [line for line in diff.splitlines() if line[:1] in "+-" and "tokenizer" in line]


def test_quotes_and_flow_lists_keep_their_style():
    text = "a: \"0,1\"   # double\nb: '0,1'\nc: [0, 1]\nd: 0,1\ne: 2\n"
    new = rewrite_yaml(
        text,
        {("a",): "0,1,2,3", ("b",): "0,1,2,3", ("c",): [0, 1, 2, 3], ("d",): "0,1,2", ("e",): 4},
    )
    assert new == "a: \"0,1,2,3\" # double\nb: '0,1,2,3'\nc: [0, 1, 2, 3]\nd: 0,1,2\ne: 4\n"


def test_a_string_that_would_read_back_as_another_type_is_quoted():
    new = rewrite_yaml("a: x\nb: x\n", {("a",): "12", ("b",): "true"})
    assert load_yaml(new, plain=True) == {"a": "12", "b": "true"}


def test_a_block_list_grows_or_shrinks_in_place():
    text = "# devices\ndevices:\n    - 0   # first\n    - 1\nkeep: True\n"
    grown = rewrite_yaml(text, {("devices",): [0, 1, 2]})
    assert grown == "# devices\ndevices:\n    - 0   # first\n    - 1\n    - 2\nkeep: True\n"
    shrunk = rewrite_yaml(text, {("devices",): [3]})
    assert shrunk == "# devices\ndevices:\n    - 3   # first\nkeep: True\n"
    quoted = rewrite_yaml('d:\n- "0"\n- "1"\n', {("d",): ["0", "1", "2"]})
    assert quoted == 'd:\n- "0"\n- "1"\n- "2"\n'


def test_a_value_that_changes_shape_goes_through_the_round_trip_dump():
    # A scalar that becomes a list: no span to splice; ruamel.yaml's dump keeps the comment.
    text = "# top\ndevices: 0  # one GPU\nother: 1\n"
    new = rewrite_yaml(text, {("devices",): [0, 1]})
    assert load_yaml(new, plain=True) == {"devices": [0, 1], "other": 1}
    assert new.startswith("# top\n")


def test_unchanged_rewrite_is_the_same_text():
    text = PPO.read_text()
    assert rewrite_yaml(text, {}) == text


def test_json_keeps_key_order_and_indentation(tmp_path):
    data = {"trainer": {"n_gpus_per_node": 2, "nnodes": 1}, "data": {"train_batch_size": 8}}
    path = tmp_path / "ppo.json"
    path.write_text(json.dumps(data, indent=4) + "\n")
    plan = nbgpu.plan.scale(path, to_gpus=4)
    assert plan.form == "json"
    assert (
        plan.to_text()
        == json.dumps(
            {"trainer": {"n_gpus_per_node": 4, "nnodes": 1}, "data": {"train_batch_size": 16}},
            indent=4,
        )
        + "\n"
    )


def test_broken_yaml_is_one_line_naming_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("data:\n  train_batch_size: [2\ntrainer: {\n")
    with pytest.raises(UserInputError, match=r"config '.*bad.yaml' is not valid YAML \(line \d+\)"):
        nbgpu.plan.scale(path, to_gpus=4)


def test_save_writes_the_new_file(tmp_path):
    out = tmp_path / "ppo_4gpu.yaml"
    plan = nbgpu.plan.scale(PPO, to_gpus=4).save(out)
    assert out.read_text() == plan.to_text()
    assert plan.written_to == str(out)
    assert f"new config written to {out}" in " ".join(plan.text().split())


KEYS = st.from_regex(r"[a-z][a-z_]{0,8}", fullmatch=True)
SCALARS = st.one_of(
    st.integers(-(10**6), 10**6),
    st.sampled_from([0.5, 0.34, 1e-6, 2.0]),
    st.booleans(),
    st.text(st.sampled_from("abc019,._-: #'\""), min_size=1, max_size=8),
)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(KEYS, SCALARS, min_size=1, max_size=6), st.data())
def test_any_scalar_change_reads_back_and_touches_one_line(values, data):
    text = "".join(f"{k}: {json.dumps(v)}  # note {i}\n" for i, (k, v) in enumerate(values.items()))
    key = data.draw(st.sampled_from(sorted(values)))
    new_value = data.draw(SCALARS)
    new = rewrite_yaml(text, {(key,): new_value})
    assert load_yaml(new, plain=True) == {**values, key: new_value}
    diff = [d for d in difflib.ndiff(text.splitlines(), new.splitlines()) if d[:1] in "+-"]
    assert len(diff) <= 2
    assert all(f"# note {list(values).index(key)}" in d for d in diff)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(SCALARS, min_size=1, max_size=5),
    st.lists(SCALARS, min_size=0, max_size=6),
    st.sampled_from(["", "  ", "    "]),
)
def test_any_block_list_change_reads_back_and_keeps_the_rest(old, new, indent):
    items = "".join(f"{indent}- {json.dumps(v)}\n" for v in old)
    text = f"# head\nbefore: 1  # kept\nlist:\n{items}after: True\n"
    out = rewrite_yaml(text, {("list",): new})
    assert load_yaml(out, plain=True) == {"before": 1, "list": new, "after": True}
    assert out.startswith("# head\nbefore: 1  # kept\nlist:")
    if new:  # an empty list has no item to copy the style of: it goes through the dump
        assert out.endswith("after: True\n")
