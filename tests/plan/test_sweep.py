import pytest

import nbgpu.plan
from nbgpu.errors import UserInputError

from .conftest import all_free


def sweep(inv, runs=None, gpus_per_run=None, **kwargs):
    kwargs.setdefault("port_is_free", all_free)
    return nbgpu.plan.sweep(runs, gpus_per_run, inventory=inv, **kwargs)


def test_shared_sweeps_four_runs_of_two_gpus_disjoint_with_distinct_ports(inventory):
    s = sweep(inventory("shared-sweeps"), 4, 2, share=True)
    assert s.ok
    # GPUs 0-3 already run the box's first two sweeps: the free pairs come first.
    assert [r.roles[0].cuda_visible_devices for r in s.runs] == ["4,5", "6,7", "0,1", "2,3"]
    assert [r.roles[0].master_port for r in s.runs] == [29500, 29501, 29502, 29503]
    assert [r.name for r in s.runs] == ["run0", "run1", "run2", "run3"]
    assert max(len(line) for line in s.text().splitlines()) <= 80
    # Sharing was asked for: what the runs share is still said.
    assert "GPU 0 is shared with 1 other process(es) using 31.0 GiB" in s.text()


def test_runs_on_gpus_other_jobs_use_are_not_ready_unless_shared(inventory):
    # GPUs 0-3 run two other sweeps at 97 % utilisation; 4-7 are free.
    s = sweep(inventory("shared-sweeps"), 4, 2)
    assert not s.ok
    assert [r.ok for r in s.runs] == [True, True, False, False]
    assert s.runs_ready == 2
    (problem,) = s.problems
    assert problem.message.startswith("2 of 4 runs fit on free GPUs now; run2, run3 would share")
    assert "GPUs 0-3: 1 process each, 97% busy" in problem.message
    assert problem.fixes == ("runs=2", "share=True")
    text = s.text()
    assert "NOT READY" in text.splitlines()[0] + text.splitlines()[1]
    assert text.count("NO: GPUs in use") == 2
    assert "is shared with" not in text  # said once, by the sweep
    # Each such run is a plan that is not ready on its own either (a launch refuses it).
    assert [p.code for p in s.runs[2].problems] == ["gpus_in_use"]
    assert "run2: its GPUs run other jobs (GPUs 0,1: 1 process each, 97% busy)" in (
        s.runs[2].problems[0].message
    )


def test_as_many_runs_as_fit_leaves_gpus_in_use_out_unless_shared(inventory):
    s = sweep(inventory("shared-sweeps"), None, 2)
    assert s.ok
    assert [r.roles[0].cuda_visible_devices for r in s.runs] == ["4,5", "6,7"]
    (warning,) = s.warnings
    assert "left out, in use by other jobs: GPUs 0-3" in warning.message
    assert len(sweep(inventory("shared-sweeps"), None, 2, share=True).runs) == 4


def test_dead_or_zombie_holders_are_not_jobs_at_work(inventory):
    # A zombie keeps memory but runs nothing: the GPU is not "in use by another job".
    s = sweep(inventory("4xA40,zombie=1"), 4, 1)
    assert s.ok


def test_shared_sweeps_ports_in_use_are_skipped(inventory):
    # Hand-started sweeps all ran on MASTER_PORT 12345; say someone holds 12346 already.
    s = sweep(inventory("shared-sweeps"), 2, 4, base_port=12345, port_is_free=lambda p: p != 12346)
    assert [r.roles[0].master_port for r in s.runs] == [12345, 12347]


def test_unusable_gpus_shrink_the_sweep_and_say_why(inventory):
    s = sweep(inventory("8xH100,lost=3"), 4, 2)
    assert not s.ok
    assert len(s.runs) == 3
    assert all(3 not in r.roles[0].nvml_indices for r in s.runs)
    (problem,) = s.problems
    assert "7 usable (GPU 3: LOST)" in problem.message
    assert problem.fixes == ("runs=3", "gpus_per_run=1")
    assert max(len(line) for line in s.text().splitlines()) <= 80


def test_as_many_runs_as_fit(inventory):
    s = sweep(inventory("busy-gpu0"), None, 1)
    assert [r.roles[0].nvml_indices for r in s.runs] == [(1,), (2,), (3,)]
    assert [e.nvml_index for e in s.excluded] == [0]


def test_runs_with_an_allocation_and_a_pool(inventory):
    s = sweep(inventory("shared-sweeps"), 2, allocation="vllm.d1t1p1+d1t1p1", gpus="4,5,6,7")
    assert s.ok
    first, second = s.runs
    assert first.role("vllm").nvml_indices == (4,)
    assert first.role("train").nvml_indices == (5,)
    assert second.role("vllm").nvml_indices == (6,)
    ports = [r.master_port for run in s.runs for r in run.roles]
    assert ports == [29500, 29501, 29502, 29503]


def test_batch_is_checked_per_run(inventory):
    s = sweep(inventory("shared-sweeps"), 2, 3, global_batch=8)
    assert not s.ok
    assert "-> global_batch=6" in s.text()
    assert s.text().count("not divisible by 3") == 1  # said once, not per run


def test_mixed_box_runs_on_identical_gpus(mixed_path):
    s = sweep(mixed_path, 2, 2)
    assert [r.roles[0].nvml_indices for r in s.runs] == [(0, 1), (2, 3)]
    assert not [w for r in s.runs for w in r.warnings if w.code == "mixed_gpus"]


@pytest.mark.parametrize(
    ("args", "kwargs", "fragment"),
    [
        ((5, 2), {}, "5 runs × 2 GPUs need 10 GPUs but this box has 8"),
        ((0, 2), {}, "runs=0"),
        ((2, 0), {}, "gpus_per_run=0"),
        ((2, 3), {"allocation": "d2"}, "uses 2 GPUs per run but gpus_per_run=3"),
        ((2, 1), {"gpus": "9"}, "gpus: GPU 9 does not exist"),
    ],
)
def test_bad_sweep_input(inventory, args, kwargs, fragment):
    with pytest.raises(UserInputError) as err:
        sweep(inventory("shared-sweeps"), *args, **kwargs)
    assert fragment in str(err.value)


def test_cli_sweep_on_a_shared_node_exits_1_until_shared(capsys):
    from nbgpu.cli import main  # noqa: PLC0415

    assert main(["plan", "--sweep", "4", "--per-run", "2", "--fleet", "shared-sweeps"]) == 1
    out = capsys.readouterr().out
    assert "2 of 4 runs fit on free GPUs now" in " ".join(out.split())
    assert (
        main(["plan", "--sweep", "4", "--per-run", "2", "--fleet", "shared-sweeps", "--share"]) == 0
    )
    capsys.readouterr()
    assert main(["plan", "--share", "--fleet", "shared-sweeps"]) == 2
    assert "--share goes with --sweep" in capsys.readouterr().err
