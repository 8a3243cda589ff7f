"""Property tests: every plan nbgpu returns really satisfies its constraints.

Fleets are drawn as simulator specs (any size, any mix of faults), allocations and batches
at random; the real inventory and planner run on them.
"""

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nbgpu.plan
from nbgpu.devices.inventory import take_inventory
from nbgpu.errors import UserInputError
from nbgpu.plan import Plan, plan_from_json
from nbgpu.plan.placement import candidates_from_inventory

ENV = {
    k: v
    for k, v in os.environ.items()
    if k not in ("NBGPU_SIMULATE", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
}
FAULTS = ("busy", "lost", "zombie", "otherns", "prohibited", "noperm", "exclusive", "wedged")
SETTINGS = settings(max_examples=80, deadline=None, database=None)


@st.composite
def fleet_specs(draw):
    count = draw(st.integers(1, 8))
    model = draw(st.sampled_from(["A40", "H100"]))
    faults = draw(st.dictionaries(st.integers(0, count - 1), st.sampled_from(FAULTS)))
    return ",".join([f"{count}x{model}", *(f"{kind}={i}" for i, kind in sorted(faults.items()))])


@st.composite
def allocations(draw):
    parts = []
    for n in range(draw(st.integers(1, 3))):
        backend = draw(st.sampled_from(["", "sglang.", "vllm."])) if n == 0 else ""
        d, t = draw(st.integers(1, 3)), draw(st.integers(1, 2))
        parts.append(f"{backend}d{d}t{t}p1")
    return "+".join(parts)


def _snapshot(spec):
    inventory = take_inventory({**ENV, "NBGPU_SIMULATE": spec}, scan_device_files=False)
    return inventory, {c.nvml_index: c for c in candidates_from_inventory(inventory)}


def _check_invariants(plan: Plan, candidates, busy_ports):
    assigned = [g.nvml_index for r in plan.roles for g in r.gpus]
    assert len(assigned) == len(set(assigned)), "a GPU is in two roles"
    for index in assigned:
        assert candidates[index].usable, f"unusable GPU {index} was given a role"
    for role in plan.roles:
        if role.gpus:
            assert len(role.gpus) == role.nproc_per_node
            assert [g.cuda_index for g in role.gpus] == list(range(len(role.gpus)))
    ports = [r.master_port for r in plan.roles if r.master_port is not None]
    assert len(ports) == len(set(ports)), "two roles share a port"
    assert not set(ports) & busy_ports
    if plan.roles and plan.roles[0].gpus:
        first = plan.roles[0].gpus[0].nvml_index
        # Logical device 0 of the job is the best GPU its role got.
        assert candidates[first].grade == min(
            candidates[g.nvml_index].grade for g in plan.roles[0].gpus
        )
    if plan.ok:
        assert all(r.gpus for r in plan.roles)
        assert all(r.master_port is not None for r in plan.roles)
        if plan.batch is not None and plan.batch.global_batch is not None:
            d = plan.batch.data_parallel
            assert plan.batch.global_batch % d == 0
            for split in plan.batch.splits:
                assert d * split.micro_batch * split.grad_accum == plan.batch.global_batch
            for _, k in plan.batch.divisors:
                assert plan.batch.global_batch % k == 0


@SETTINGS
@given(
    spec=fleet_specs(),
    allocation=allocations(),
    batch=st.none() | st.integers(1, 64),
    divisor=st.none() | st.integers(1, 6),
    busy_ports=st.sets(st.integers(29500, 29506), max_size=4),
)
def test_property_plans_satisfy_their_constraints(spec, allocation, batch, divisor, busy_ports):
    inventory, candidates = _snapshot(spec)
    kwargs = {
        "inventory": inventory,
        "global_batch": batch,
        "divisors": {"k": divisor} if divisor else None,
        "port_is_free": lambda p: p not in busy_ports,
    }
    total = nbgpu.plan.allocation.parse_allocation(allocation).gpu_count
    if total > len(candidates):
        with pytest.raises(UserInputError, match="needs"):
            nbgpu.plan(allocation, **kwargs)
        return
    plan = nbgpu.plan(allocation, **kwargs)
    _check_invariants(plan, candidates, busy_ports)
    usable = sum(c.usable for c in candidates.values())
    assert any(p.code == "not_enough_gpus" for p in plan.problems) == (usable < total)
    for alternative in plan.alternatives:
        if alternative.plan is not None:
            _check_invariants(alternative.plan, candidates, busy_ports)
            assert (
                alternative.plan.ok
                or any(p.code == "batch" for p in alternative.plan.problems)
                or not alternative.plan.batch
            )
    assert plan_from_json(plan.to_json()) == plan


@SETTINGS
@given(
    spec=fleet_specs(),
    runs=st.integers(1, 5),
    per_run=st.integers(1, 3),
    busy_ports=st.sets(st.integers(29500, 29506), max_size=4),
)
def test_property_sweeps_are_disjoint_with_distinct_ports(spec, runs, per_run, busy_ports):
    inventory, candidates = _snapshot(spec)
    is_free = lambda p: p not in busy_ports  # noqa: E731
    if runs * per_run > len(candidates):
        with pytest.raises(UserInputError, match="this box has"):
            nbgpu.plan.sweep(runs, per_run, inventory=inventory, port_is_free=is_free)
        return
    sweep = nbgpu.plan.sweep(runs, per_run, inventory=inventory, port_is_free=is_free)
    usable = sum(c.usable for c in candidates.values())
    assert len(sweep.runs) == min(runs, usable // per_run)
    gpus = [g.nvml_index for run in sweep.runs for r in run.roles for g in r.gpus]
    # A run on GPUs other jobs are using is not ready (share=False): the sweep says so.
    in_use = {i for i, c in candidates.items() if c.in_use}
    free_runs = [
        run for run in sweep.runs if not {g.nvml_index for r in run.roles for g in r.gpus} & in_use
    ]
    assert sweep.runs_ready == len(free_runs)
    assert sweep.ok == (len(sweep.runs) == runs == len(free_runs))
    assert len(gpus) == len(set(gpus)) == len(sweep.runs) * per_run
    assert all(candidates[i].usable for i in gpus)
    ports = [r.master_port for run in sweep.runs for r in run.roles]
    assert None not in ports
    assert len(ports) == len(set(ports))
    assert not set(ports) & busy_ports
