import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbgpu.errors import UserInputError
from nbgpu.plan.job import Split, check_batch, splits_for


def test_busy_gpu0_batch_8_on_3_trainers_offers_6_or_9():
    check = check_batch(3, global_batch=8)
    assert not check.ok
    assert "not divisible by 3" in check.reason
    assert [o.global_batch for o in check.nearest] == [6, 9]
    assert check.nearest[0].splits[0] == Split(2, 1)
    assert "6 (" in check.advice
    assert "9 (" in check.advice


@pytest.mark.parametrize(
    ("batch", "expected"),
    # memory.md §6's verified worked example: dp = 3, max micro 4.
    [(6, (2, 1)), (9, (3, 1)), (48, (4, 4))],
)
def test_llm_analysis_worked_example_valid(batch, expected):
    check = check_batch(3, global_batch=batch, max_micro_batch=4)
    assert check.ok
    assert (check.micro_batch, check.grad_accum) == expected


def test_llm_analysis_worked_example_invalid_50():
    check = check_batch(3, global_batch=50, max_micro_batch=4)
    assert [o.global_batch for o in check.nearest] == [48, 51]


def test_extra_divisor_of_the_global_batch():
    check = check_batch(3, global_batch=12, divisors=[("group_size", 8)])
    assert "group_size=8" in check.reason
    assert [o.global_batch for o in check.nearest] == [24]  # nothing valid below 12


def test_step_divisor_is_trls_num_generations_rule():
    # 3 ranks × micro 2 = 6 generations per step: not a multiple of 4.
    check = check_batch(3, global_batch=12, micro_batch=2, step_divisors=[("num_generations", 4)])
    assert "num_generations=4" in check.reason
    ok = check_batch(3, global_batch=12, step_divisors=[("num_generations", 4)])
    assert ok.ok
    assert ok.micro_batch == 4  # 3 × 4 = 12 is divisible by 4


def test_micro_and_accum_given_must_multiply_out():
    check = check_batch(2, global_batch=8, micro_batch=2, grad_accum=3)
    assert not check.ok
    assert "≠" in check.reason
    assert [o.global_batch for o in check.nearest] == [12]


def test_only_micro_and_accum_derive_the_global_batch():
    check = check_batch(3, micro_batch=2, grad_accum=2)
    assert check.ok
    assert check.global_batch == 12


@pytest.mark.parametrize(
    "kwargs",
    [{"global_batch": 0}, {"global_batch": -8}, {"micro_batch": 0}, {"global_batch": True}],
)
def test_non_positive_values_are_bad_input(kwargs):
    with pytest.raises(UserInputError, match="expected a whole number >= 1"):
        check_batch(3, **kwargs)


def _valid(g, d, divisors, step, max_micro):
    return (
        g % d == 0
        and all(g % k == 0 for k in divisors)
        and bool(
            splits_for(g, d, max_micro_batch=max_micro, step_divisors=[("s", k) for k in step])
        )
    )


@settings(max_examples=150, deadline=None, database=None)
@given(
    g=st.integers(1, 300),
    d=st.integers(1, 8),
    divisors=st.lists(st.integers(1, 8), max_size=2),
    step=st.lists(st.integers(1, 8), max_size=1),
    max_micro=st.none() | st.integers(1, 8),
)
def test_property_batch_answers_splits_and_nearest_values_are_exact(
    g, d, divisors, step, max_micro
):
    check = check_batch(
        d,
        global_batch=g,
        max_micro_batch=max_micro,
        divisors=[("k", k) for k in divisors],
        step_divisors=[("s", k) for k in step],
    )
    assert check.ok == _valid(g, d, divisors, step, max_micro)
    if check.ok:
        for s in check.splits:
            assert d * s.micro_batch * s.grad_accum == g
            assert max_micro is None or s.micro_batch <= max_micro
            assert all((d * s.micro_batch) % k == 0 for k in step)
        return
    for option in check.nearest:
        assert _valid(option.global_batch, d, divisors, step, max_micro)
    lower = [o.global_batch for o in check.nearest if o.global_batch < g]
    upper = [o.global_batch for o in check.nearest if o.global_batch > g]
    # Nearest means nearest: nothing valid lies between them and the batch.
    for candidate in range((lower[0] if lower else 0) + 1, upper[0] if upper else g):
        assert candidate == g or not _valid(candidate, d, divisors, step, max_micro)
