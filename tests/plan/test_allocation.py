import pytest

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
        ("vllm.d2t2|megatron.d2t2", "'|'"),
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
