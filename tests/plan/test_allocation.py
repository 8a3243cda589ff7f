import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbgpu.errors import UserInputError
from nbgpu.plan.allocation import parse_allocation


def test_areal_decoupled_allocation_one_server_three_trainers():
    alloc = parse_allocation("sglang.d1t1p1+d3t1p1")
    inference, train = alloc.roles
    assert (inference.name, inference.kind, inference.backend) == ("sglang", "inference", "sglang")
    assert (train.name, train.kind, train.data_parallel) == ("train", "train", 3)
    assert alloc.gpu_count == 4
    assert alloc.text == "sglang.d1t1p1+d3t1p1"


def test_vllm_with_tensor_parallel_counts_every_degree():
    alloc = parse_allocation("vllm.d2t2p1+d4t1p1")
    assert [r.gpu_count for r in alloc.roles] == [4, 4]
    assert alloc.roles[0].tensor_parallel == 2


def test_degrees_in_any_order_missing_ones_are_one_and_m_means_tensor():
    assert parse_allocation("d4t1p1") == parse_allocation("p1t1d4") == parse_allocation("d4")
    assert parse_allocation("sglang:d2m2").roles[0].tensor_parallel == 2


def test_roles_form_infers_kinds_and_keeps_order():
    alloc = parse_allocation("inference:1,train:3")
    assert [(r.name, r.kind, r.gpu_count) for r in alloc.roles] == [
        ("inference", "inference", 1),
        ("train", "train", 3),
    ]
    assert alloc.text == "inference.d1t1p1+d3t1p1"


def test_two_unnamed_trainers_get_distinct_names():
    assert [r.name for r in parse_allocation("d2+d2").roles] == ["train", "train2"]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty"),
        ("sglang.d1x1p1+d3t1p1", "cannot read 'sglang.d1x1p1'"),
        ("d0t1p1", "d0"),
        ("d2d2", "data-parallel degree twice"),
        ("sglang.d1+", "empty part"),
        (
            "sglang:d4|fsdp:d2",
            "same world size: sglang spans 4 GPUs, train 2; e.g. 'sglang:d4|fsdp:d4'",
        ),
        ("sglang:d2c2", "an inference engine takes d, t and p; context-parallel (c) is a training"),
        ("vllm:d2e2", "nearest form: 'vllm:d2'"),
        (
            "fsdp:d2p2",
            "pipeline-parallel (p) needs megatron or archon; nearest form: 'megatron:d2p2'",
        ),
        ("megatron:d3e2", "e2 must divide the GPUs of one pipeline stage (d × t × c = 3)"),
        ("megatron:(attn:d4p2|ffn:d2p1e2)", "the same pipeline degree"),
        ("megatron:(attn:d4|ffn:d4e2)", "attn spans 4 GPUs but ffn 8"),
        ("megatron:(attn:d4e2|ffn:d2e2)", "e goes in the ffn section"),
        ("sglang:d2|", "empty part"),
        ("sglang.d4+eval", "CPU"),
        ("train:0", "no GPU"),
        ("train:1,train:2", "listed twice"),
    ],
)
def test_malformed_allocations_get_one_line_naming_value_and_form(text, fragment):
    with pytest.raises(UserInputError) as err:
        parse_allocation(text)
    message = str(err.value)
    assert fragment in message
    assert "\n" not in message
    assert repr(text) in message or text == ""


def test_context_parallel_counts_in_the_world_size():
    (role,) = parse_allocation("d1c4").roles
    assert (role.context_parallel, role.world_size) == (4, 4)
    assert parse_allocation("fsdp:d2c2").gpu_count == 4


def test_expert_parallel_does_not_count_in_the_world_size():
    # AReaL's reference: megatron:d2p2t4 and megatron:d2p2t4e4 both need 16 GPUs.
    assert parse_allocation("megatron:d2p2t4").gpu_count == 16
    alloc = parse_allocation("megatron:d2p2t4e4")
    assert alloc.gpu_count == 16
    assert alloc.roles[0].expert_parallel == 4
    assert parse_allocation("sglang:d4t4+megatron:d2p2t4e4").gpu_count == 32


def test_colon_and_dot_after_the_backend_and_names_in_brackets():
    assert parse_allocation("sglang:d4t2+fsdp:d8") == parse_allocation("sglang.d4t2+fsdp.d8")
    alloc = parse_allocation("sglang[rollout]:d2+fsdp[actor]:d4")
    assert [(r.name, r.kind, r.backend) for r in alloc.roles] == [
        ("rollout", "inference", "sglang"),
        ("actor", "train", "fsdp"),
    ]
    assert parse_allocation(alloc.text) == alloc


def test_colocated_parts_share_the_first_parts_gpus():
    # '|' binds tighter than '+': the rollout has its own GPUs, actor and critic share.
    alloc = parse_allocation("sglang[r]:d2+fsdp[a]:d4|fsdp[c]:d4")
    assert [(r.name, r.colocated_with, r.gpu_count) for r in alloc.roles] == [
        ("r", None, 2),
        ("a", None, 4),
        ("c", "a", 0),
    ]
    assert alloc.gpu_count == 6
    assert parse_allocation(alloc.text) == alloc
    hybrid = parse_allocation("sglang:d4|fsdp:d4")
    assert hybrid.gpu_count == 4
    assert hybrid.roles[1].colocated_with == "sglang"


def test_megatron_moe_sections_lay_out_the_same_gpus():
    (role,) = parse_allocation("megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)").roles
    assert role.world_size == 32
    assert (role.context_parallel, role.expert_parallel) == (2, 2)
    # ffn without d: derived from the GPUs attn spans, as AReaL does.
    assert parse_allocation("megatron:(attn:d4t2|ffn:t2e2)").gpu_count == 8


DIMS = st.fixed_dictionaries(
    {},
    optional={k: st.integers(1, 4) for k in "dtpc"},
)
TRAIN = st.sampled_from(["", "megatron:", "archon:"])
INFER = st.sampled_from(["sglang:", "vllm:", "sglang.", "vllm."])


def _dims_text(dims):
    return "".join(f"{k}{v}" for k, v in dims.items()) or "d1"


@st.composite
def allocations(draw):
    """AReaL allocation strings: '+' components of one part or '|' groups of equal worlds."""
    components, expected, worlds = [], 0, []
    for n in range(draw(st.integers(1, 3))):
        first = draw(DIMS)
        inference = draw(st.booleans())
        if inference:
            first = {k: v for k, v in first.items() if k != "c"}
        world = 1
        for v in first.values():
            world *= v
        prefix = draw(INFER) if inference else draw(TRAIN)
        name = f"[p{n}]" if prefix.endswith(":") else ""
        parts = [prefix.replace(":", name + ":") + _dims_text(first)]
        for m in range(draw(st.integers(0, 2))):
            # A colocated part with the same world size, split differently.
            d = draw(st.sampled_from([k for k in range(1, world + 1) if world % k == 0]))
            parts.append(f"megatron[c{n}x{m}]:d{d}t{world // d}")
        components.append("|".join(parts))
        expected += world
        worlds.append(world)
    return "+".join(components), expected


@settings(max_examples=200, deadline=None)
@given(allocations())
def test_property_world_sizes_and_round_trip(case):
    text, gpus = case
    alloc = parse_allocation(text)
    assert alloc.gpu_count == gpus
    for role in alloc.roles:
        assert role.world_size == (
            role.data_parallel
            * role.tensor_parallel
            * role.pipeline_parallel
            * role.context_parallel
        )
        if role.colocated_with is not None:
            anchor = next(r for r in alloc.roles if r.name == role.colocated_with)
            assert anchor.world_size == role.world_size
    assert len({r.name for r in alloc.roles}) == len(alloc.roles)
    assert parse_allocation(alloc.text) == alloc


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="sglang:.dtpcem0123456789+|[]()xfsdp ", max_size=30))
def test_property_any_text_parses_or_is_refused_in_one_line(text):
    message = None
    try:
        alloc = parse_allocation(text)
    except UserInputError as exc:
        message = str(exc)
    if message is not None:
        assert "\n" not in message
        assert repr(text) in message or not text.strip()
    else:
        assert alloc.gpu_count >= 1
        assert parse_allocation(alloc.text) == alloc
