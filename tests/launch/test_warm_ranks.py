"""Cells on some ranks of a warm job (``ranks=``), and the names the ranks hold: real
torchrun ranks (gloo on CPU). Every test ends by proving, from every process on the
machine, that nothing of the job is left.
"""

import time

import pytest

from nbgpu.errors import UserInputError
from nbgpu.launch import warm
from nbgpu.launch.held import held_names
from nbgpu.launch.launcher import torchrun
from nbgpu.launch.warm import CellFailed
from tests.launch.test_warm import Screen, gone

pytestmark = pytest.mark.slow

GROUP = (
    "import os\nimport nbgpu.rank\nnbgpu.rank.init(timeout_s={timeout})\n"
    "import torch\nimport torch.distributed as dist\nrank = int(os.environ['RANK'])\n"
)


def start(env, name, nproc=3, timeout=30):
    screen = Screen()
    code = GROUP.format(timeout=timeout)
    job = torchrun(code, nproc, keep=True, name=name, environ=env, write=screen)
    return job, screen


def every_rank(name, variable, screen):
    """Each rank's value of *variable* (None where it has none)."""
    result = torchrun("pass", on=name, write=screen, pull=[variable], pull_all_ranks=True)
    return [values.get(variable) for values in result.pulled_all]


def test_a_cell_on_chosen_ranks_leaves_the_others_as_they_were(env):
    job, screen = start(env, "some")
    try:
        pids = job.run.warm.pids()
        torchrun("x = rank", on="some", write=screen)
        result = torchrun(
            "x = 100 + rank\nprint('ran', rank)", on="some", ranks="0,2", write=screen
        )
        assert sorted(result.statuses) == [0, 2]
        assert result.idle == (1,)
        assert "ok on rank 0,2" in result.summary()
        assert "rank 1 idle (--ranks)" in result.summary()
        assert "[rank1] ran" not in screen.text
        assert every_rank("some", "x", screen) == [100, 1, 102]  # rank 1 kept its own x
        # A range, a list and a single rank (the Python forms).
        pulled = torchrun("y = rank", on="some", ranks="1-2", write=screen, pull=["y"])
        assert pulled.pulled == {"y": 1}  # the first rank that ran it (rank 0 did not)
        assert every_rank("some", "y", screen) == [None, 1, 2]
        torchrun("y = -1", on="some", ranks=[0], write=screen)
        torchrun("y *= 10", on="some", ranks=2, write=screen)
        assert every_rank("some", "y", screen) == [-1, 1, 20]
        # Rank 1's log marks only the cells it ran.
        marks = (job.run.dir / "rank1.log").read_text().count("#### nbgpu cell ")
        assert marks == job.cells - 3
        assert job.run.warm.pids() == pids
    finally:
        job.stop()
    assert gone(job.run.run_id)


def test_bad_ranks_are_one_line_and_leave_the_job_as_it_was(env):
    job, screen = start(env, "badranks")
    try:
        torchrun("kept = rank", on="badranks", write=screen)
        cases = [
            ({"on": "badranks", "ranks": "5"}, "--ranks 5: the job has ranks 0-2, not 5"),
            ({"on": "badranks", "ranks": "1,3-4"}, "--ranks 1,3-4: the job has ranks 0-2, not 3-4"),
            ({"on": "badranks", "ranks": ""}, "--ranks '': no rank given; expected ranks of the"),
            ({"on": "badranks", "ranks": []}, "--ranks '': no rank given"),
            ({"on": "badranks", "ranks": "a"}, "--ranks 'a': 'a' is not a rank or range; expec"),
            ({"on": "badranks", "ranks": "3-1"}, "--ranks '3-1': '3-1' is not a rank or range"),
            ({"on": "badranks", "ranks": "0,,1"}, "'' is not a rank or range"),
            ({"nproc": 2, "ranks": "0"}, "ranks='0': a new job runs on every rank; ranks= picks"),
        ]
        cells = job.cells
        for options, message in cases:
            nproc = options.pop("nproc", None)
            with pytest.raises(UserInputError) as error:
                # (timeout_s: a cell sent by mistake ends, and the test fails, in seconds)
                torchrun("kept = -1", nproc, environ=env, write=screen, timeout_s=5, **options)
            assert message in str(error.value)
            assert "\n" not in str(error.value)
        assert job.cells == cells  # nothing was sent
        assert every_rank("badranks", "kept", screen) == [0, 1, 2]
        assert job.state == "warm"
    finally:
        job.stop()
    assert gone(job.run.run_id)


def test_a_collective_that_needs_idle_ranks_fails_at_once(env):
    job, screen = start(env, "collective")
    try:
        began = time.monotonic()
        with pytest.raises(CellFailed) as failure:
            torchrun(
                "t = torch.ones(1)\ndist.all_reduce(t)\n", on="collective", ranks="0", write=screen
            )
        assert time.monotonic() - began < 4  # not the group's 30 s timeout
        line = failure.value.result.errors[0]
        assert line == (
            "IdleRanksError: all_reduce needs ranks 1,2 of the default group, which do not run "
            "this cell (--ranks 0): run it on every rank, or leave it out"
        )
        assert "rank 1-2 idle (--ranks)" in failure.value._render_traceback_()[0]
        # A name bound before the cell is checked too; a peer outside the cell as well.
        torchrun("from torch.distributed import barrier as wait_all", on="collective", write=screen)
        with pytest.raises(CellFailed, match="barrier needs rank 0 of the default group"):
            torchrun("wait_all()", on="collective", ranks="1-2", write=screen)
        with pytest.raises(CellFailed, match="send needs rank 2 as its peer"):
            torchrun("dist.send(torch.ones(1), dst=2)", on="collective", ranks="0,1", write=screen)
        # A group made of the cell's ranks is theirs to use: no refusal, a real all_reduce.
        torchrun("pair = dist.new_group([0, 1])", on="collective", write=screen)
        torchrun(
            "s = torch.ones(1) * (rank + 1)\ndist.all_reduce(s, group=pair)\ns = int(s)",
            on="collective",
            ranks="0,1",
            write=screen,
        )
        assert every_rank("collective", "s", screen) == [3, 3, None]
        # The wrappers are gone after the cell: every rank's all_reduce works as torch's.
        torchrun("u = torch.ones(1)\ndist.all_reduce(u)\nu = int(u)", on="collective", write=screen)
        assert every_rank("collective", "u", screen) == [3, 3, 3]
        assert torchrun(
            "same = dist.all_reduce is dist.distributed_c10d.all_reduce and "
            "dist.all_reduce.__module__.startswith('torch')",
            on="collective",
            write=screen,
            pull=["same"],
        ).pulled == {"same": True}
    finally:
        job.stop()
    assert gone(job.run.run_id)


def test_a_wait_no_wrapper_sees_is_reported_not_waited_for(env, monkeypatch):
    monkeypatch.setattr(warm, "INTERRUPT_WAIT_S", 2.0)
    job, screen = start(env, "ddp", nproc=2, timeout=8)
    try:
        began = time.monotonic()
        with pytest.raises(CellFailed) as failure:
            # DDP checks the parameters' shapes across ranks from C++: no wrapper sees it.
            torchrun(
                "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))",
                on="ddp",
                ranks="0",
                write=screen,
            )
        assert time.monotonic() - began < 7  # the report, not the group's 8 s timeout
        result = failure.value.result
        assert result.waiting == [0]
        assert result.errors[0] == "in _verify_param_shape_across_processes at cell2.py:1 for 2 s"
        said = failure.value._render_traceback_()
        assert "waits in a collective that needs the idle ranks" in said[1]
        assert "%gpu_stop ddp ends the job" in said[1]
        with pytest.raises(UserInputError, match="rank 0 is still in cell 2"):
            torchrun("print(1)", on="ddp", write=screen)
        # The group's timeout ends the wait; rank 0 answers late and the job is usable.
        deadline = time.monotonic() + 30
        while job.run.warm.busy and time.monotonic() < deadline:
            job.run.warm.catch_up()
            time.sleep(0.2)
        assert every_rank("ddp", "rank", screen) == [0, 1]
    finally:
        job.stop()
    assert gone(job.run.run_id)


def test_a_ddp_forward_on_some_ranks_fails_at_once_not_in_its_backward(env):
    # The backward's gradient all-reduce runs in autograd's C++ engine, where no Python
    # frame shows the wait: without the check on forward this cell would wait for the
    # group's timeout (8 s here).
    job, screen = start(env, "ddpfwd", nproc=2, timeout=8)
    try:
        torchrun(
            "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))",
            on="ddpfwd",
            write=screen,
        )
        began = time.monotonic()
        with pytest.raises(CellFailed) as failure:
            torchrun(
                "model(torch.ones(3, 2)).sum().backward()", on="ddpfwd", ranks="0", write=screen
            )
        assert time.monotonic() - began < 4
        assert failure.value.result.errors[0].startswith(
            "IdleRanksError: DistributedDataParallel's forward needs rank 1 of its group"
        )
        # On every rank the same step runs, and the gradients agree.
        torchrun("model(torch.ones(3, 2)).sum().backward()", on="ddpfwd", write=screen)
        grads = torchrun(
            "g = model.module.weight.grad.tolist()",
            on="ddpfwd",
            write=screen,
            pull=["g"],
            pull_all_ranks=True,
        ).pulled_all
        assert grads[0]["g"] == grads[1]["g"]
    finally:
        job.stop()
    assert gone(job.run.run_id)


def test_the_names_each_rank_holds_are_listed_without_values(env):
    job, screen = start(env, "names")
    try:
        torchrun(
            "secret = 'do-not-show-me'\nbatch = [1, 2, 3]\ndef step():\n    pass\n",
            on="names",
            write=screen,
        )
        torchrun(
            "w = torch.zeros(4, 3)\nclass Net(torch.nn.Module):\n    def __init__(self):\n"
            "        super().__init__()\n        self.fc = torch.nn.Linear(2, 2)\nnet = Net()\n",
            on="names",
            ranks="0,2",
            write=screen,
        )
        names = held_names("names")
        rows = {row["name"]: row for row in names.records()}
        assert rows["w"] == {
            "name": "w",
            "type": "Tensor",
            "size": "4x3 float32, 48 B",
            "ranks": [0, 2],
        }
        assert rows["net"]["size"] == "6 params, 24 B"
        assert rows["batch"]["size"] == "len 3"
        assert rows["batch"]["ranks"] == [0, 1, 2]
        assert rows["secret"]["type"] == "str"
        assert rows["step"]["type"] == "function"
        # No modules, no dunders, no values; each rank's own int is one row per size.
        assert not {"os", "torch", "dist", "nbgpu", "__file__", "__builtins__"} & set(rows)
        assert "do-not-show-me" not in names.to_json() + names.text() + names.html()
        text = names.text()
        assert "Names held by 'names' after cell 3" in text
        assert [line.split()[0] for line in text.splitlines()[2:]] == [
            "Net",
            "batch",
            "net",
            "rank",
            "secret",
            "step",
            "w",
        ]
        assert text.splitlines()[3].split()[-1] == "all"  # batch: every rank, one row
        assert "<style" not in names.html()
        assert "<table" in names.html()
    finally:
        job.stop()
    assert gone(job.run.run_id)
    last = held_names("names")  # what it held, said to be gone
    assert last.text().splitlines()[:2] == [
        "Names 'names' held after cell 3, its last",
        "the job has ended (stopped): its ranks and their names are gone",
    ]
    assert last.to_dict()["ended"] == "stopped"
    assert last.records() == names.records()
