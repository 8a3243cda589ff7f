"""Traced estimates (fake tensors) against one real CPU step's measured peak."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from nbgpu.errors import UserInputError  # noqa: E402
from nbgpu.estimate import estimate, estimate_memory, estimator, largest_micro_batch  # noqa: E402
from nbgpu.estimate.trace import measure_step, trace_step  # noqa: E402

from .toy_models import (  # noqa: E402
    CacheFromTwo,
    CustomOp,
    DataDependent,
    Gram,
    NoBatch,
    TinyGPT,
    cases,
    mlp,
)


@pytest.mark.parametrize(("name", "model", "batches"), cases(), ids=lambda c: str(c)[:8])
def test_traced_within_a_hundredth_of_a_percent_of_the_measured_peak(name, model, batches) -> None:
    # README and bench/RESULTS.md §7.2 claim "within 0.01 %" for these three models: the
    # MLP is 12 bytes under, the GPT exact, the conv net 512 bytes under (-0.0096 % at
    # batch 8), so the claim holds, with little room.
    for batch in batches:
        measured = measure_step(model, batch)
        traced = trace_step(model, batch).total
        assert abs(traced - measured) <= 1e-4 * measured, (name, tuple(batch.shape))
    # and the peak grows with the batch (activations are really counted)
    small, large = (trace_step(model, b).total for b in batches)
    assert large > small


def test_compare_puts_all_three_side_by_side() -> None:
    model, batch = mlp(256), torch.randn(16, 256)
    result = estimate.compare(model, batch)
    methods = [r["method"] for r in result.records()]
    assert methods[0].startswith("measured")
    assert methods[1].startswith("traced")
    assert abs(result.records()[1]["error_vs_measured"]) < 0.05
    assert "MemTracker" in result.text()
    assert "<table" in result.html()
    with pytest.raises(UserInputError, match=r"torch\.nn\.Module"):
        estimate.compare("7B", batch)


def test_estimate_of_a_module_is_traced_and_says_so() -> None:
    est = estimate(TinyGPT(), seq_len=64, micro_batch=4, precision="fp32")
    assert est.method == "traced"
    assert est.trace_note.startswith("traced in ")
    assert est.text().count("under FakeTensorMode") == 1  # the tool is named once, as a source
    assert est.term("activations", traced=True).bytes_per_gpu > 0
    assert est.term("optimizer states", traced=True).bytes_per_gpu > 0  # steady state
    # the analytic column is still there, side by side
    assert est.term("weights").bytes_per_gpu == 4 * sum(p.numel() for p in TinyGPT().parameters())


def test_micro_batch_resizes_the_example_batch() -> None:
    model = mlp(256)
    as_given = estimate(model, example_input=torch.randn(8, 256), precision="fp32")
    assert as_given.layout.micro_batch == 8  # default: the example's own batch size
    one = estimate(model, example_input=torch.randn(1, 256), micro_batch=8, precision="fp32")
    other = estimate(model, example_input=torch.randn(64, 256), micro_batch=8, precision="fp32")
    assert one.traced_bytes == other.traced_bytes
    assert as_given.traced_bytes == one.traced_bytes


def test_untraceable_model_falls_back_to_analytic_with_the_reason() -> None:
    est = estimate(DataDependent(), example_input=torch.randn(4, 16), precision="fp32")
    assert est.method == "analytic"
    assert "data-dependent control flow" in est.trace_note
    assert "analytic" in est.trace_note
    assert est.total_bytes == est.analytic_bytes


def test_a_custom_op_without_a_fake_kernel_falls_back_with_the_reason() -> None:
    est = estimate(CustomOp(), example_input=torch.randn(4, 16), precision="fp32")
    assert est.method == "analytic"
    assert "traced: failed" in est.trace_note
    assert "an operator without a fake (meta) kernel" in est.trace_note


def test_a_module_without_an_input_is_one_clear_line() -> None:
    with pytest.raises(UserInputError, match="example_input="):
        estimate(mlp(64))


def test_a_meta_built_model_traces_without_real_memory() -> None:
    psutil = pytest.importorskip("psutil")
    with torch.device("meta"):
        big = TinyGPT(vocab=32000, d=1024, layers=8, heads=16, ctx=512)  # ~170M parameters
    rss = psutil.Process().memory_info().rss
    est = estimate(big, seq_len=512, micro_batch=2, precision="bf16")
    grown = psutil.Process().memory_info().rss - rss
    assert est.method == "traced", est.trace_note
    assert est.traced_bytes > 2 * 170e6  # bf16 weights alone
    # real bf16 weights + grads + states would be > 2 GB; tracing stays far below
    assert grown < 400e6


def test_a_tiny_traced_model_gets_its_largest_micro_batch() -> None:
    # Millions of samples fit: the search halves its way down from the slope's guess (one
    # step at a time would not end), and the trace's transient buffers, which grow with
    # the batch, are not taken for memory needed before any sample.
    from nbgpu.estimate import estimate_memory, largest_micro_batch  # noqa: PLC0415

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    batch = torch.randn(8, 64)
    best = largest_micro_batch(model, "1GB", example_input=batch)
    assert best.max_micro_batch > 100_000
    assert best.fits
    above = estimate_memory(model, example_input=batch, micro_batch=best.max_micro_batch + 1)
    assert above.total_bytes > 10**9
    assert "fake-tensor traces, 0 real steps" in best.notes[-1]


def test_an_offloaded_module_is_estimated_analytically_and_says_why() -> None:
    model, batch = mlp(), torch.zeros(4, 256)
    est = estimate(model, example_input=batch, strategy="zero2", world_size=2, offload="optimizer")
    assert est.method == "analytic"
    assert "offload is analytic only" in est.trace_note
    assert est.host_bytes > 0


# The traced search for the largest micro batch (estimator.largest_micro_batch): a slope from
# micro batches 1 and 2, then a check of its guess, stepping down when the guess does not
# fit and up, in doubling steps, while it does. Each test forces one path with a model whose
# traced memory is affine, convex or concave in the batch, and compares the answer with
# the traced totals themselves (fragmentation 0 keeps the totals exact).
def _mlp_64() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


SETTINGS = {"precision": "fp32", "fragmentation": 0}


def _total(model: torch.nn.Module, micro: int) -> int:
    example = torch.randn(1, 64)
    return estimate_memory(model, example_input=example, micro_batch=micro, **SETTINGS).total_bytes


def _search(monkeypatch, model: torch.nn.Module, budget: int) -> tuple[int, list[int]]:
    """The answer and the micro batches the search traced, in order."""
    tried: list[int] = []
    real = estimator.estimate_memory

    def counted(*args, **kwargs):
        tried.append(kwargs["micro_batch"])
        return real(*args, **kwargs)

    monkeypatch.setattr(estimator, "estimate_memory", counted)
    best = largest_micro_batch(model, budget, example_input=torch.randn(1, 64), **SETTINGS)
    monkeypatch.undo()
    if best.max_micro_batch:
        assert f"found with {len(tried)} fake-tensor traces, 0 real steps" in best.notes[-1]
    return best.max_micro_batch, tried


def _is_the_largest(model: torch.nn.Module, budget: int, micro: int) -> None:
    assert _total(model, micro) <= budget < _total(model, micro + 1)


def test_an_affine_trace_is_answered_by_the_slope_and_one_check(monkeypatch) -> None:
    model = _mlp_64()
    assert _total(model, 3) - _total(model, 2) == _total(model, 2) - _total(model, 1)
    budget = _total(model, 7) + (_total(model, 8) - _total(model, 7)) // 2
    best, tried = _search(monkeypatch, model, budget)
    assert (best, tried) == (7, [1, 2, 7, 8])  # the slope's guess, and guess + 1 does not fit
    _is_the_largest(model, budget, best)


def test_a_convex_trace_steps_down_from_the_slopes_guess(monkeypatch) -> None:
    model = Gram()
    budget = _total(model, 16)
    best, tried = _search(monkeypatch, model, budget)
    guess = tried[2]
    assert guess > 17, tried  # the slope from 1 to 2 underestimates a square
    assert all(micro < guess for micro in tried[3:]), tried  # halved down from the guess
    assert best == 16
    _is_the_largest(model, budget, best)


@pytest.mark.parametrize("cache_floats", [256, 4096])
def test_a_concave_trace_steps_up_from_the_slopes_guess(monkeypatch, cache_floats) -> None:
    # The cache counted from two samples on makes the slope from 1 to 2 too steep: the
    # guess is 11 with the small cache and 2 with the large one, against 30. (Stepping up
    # one sample at a time, at most 8 times, answered 19 and 10 before issue 24.)
    model = CacheFromTwo(cache_floats)
    budget = _total(model, 30)
    best, tried = _search(monkeypatch, model, budget)
    assert tried[2] < 30, tried
    assert all(micro > tried[2] for micro in tried[3:]), tried  # only up from the guess
    assert len(tried) <= 12, tried  # doubling steps, then halving: not one sample a time
    assert best == 30
    _is_the_largest(model, budget, best)


def test_a_budget_below_one_sample_answers_zero(monkeypatch) -> None:
    model = _mlp_64()
    budget = _total(model, 1) - 1
    best, tried = _search(monkeypatch, model, budget)
    assert (best, tried) == (0, [1, 2])


def test_a_trace_that_does_not_grow_with_the_batch_is_one_clear_line() -> None:
    with pytest.raises(UserInputError, match="nothing in this estimate grows with the batch"):
        largest_micro_batch(NoBatch(), "1GB", example_input=torch.tensor(2.0), **SETTINGS)
