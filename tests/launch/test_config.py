"""Launch arguments are validated before anything starts: one line per mistake."""

import pytest

from nbgpu.errors import UserInputError
from nbgpu.launch.config import (
    LaunchConfig,
    SlurmOptions,
    parse_env_pairs,
    parse_gpu_list,
    parse_nproc,
    parse_size,
    pickle_pushed,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("60G", 60 * 1024**3), ("512M", 512 * 1024**2), ("1.5T", int(1.5 * 1024**4)),
     ("4096", 4096), ("2GiB", 2 * 1024**3), (" 8 g ", 8 * 1024**3), (1234, 1234)],
)  # fmt: skip
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "-5G", "0", "G", "5X", 0])
def test_bad_sizes(text):
    with pytest.raises(UserInputError, match="--mem-limit"):
        parse_size(text)


def test_nproc():
    assert parse_nproc("4") == 4
    with pytest.raises(UserInputError, match="'four' is not a number"):
        parse_nproc("four")
    with pytest.raises(UserInputError, match="nproc 0: expected a whole number >= 1"):
        parse_nproc("0")
    with pytest.raises(UserInputError, match="nproc -2"):
        parse_nproc("-2")


def test_env_pairs():
    assert parse_env_pairs(["A=1", "NCCL_DEBUG=INFO", "EMPTY="]) == {
        "A": "1", "NCCL_DEBUG": "INFO", "EMPTY": "",
    }  # fmt: skip
    with pytest.raises(UserInputError, match="expected KEY=VALUE"):
        parse_env_pairs(["NCCL_DEBUG"])
    with pytest.raises(UserInputError, match="not a valid variable name"):
        parse_env_pairs(["1X=2"])


def test_gpu_lists():
    assert parse_gpu_list("0,1,3", [0, 1, 2, 3]) == (0, 1, 3)
    with pytest.raises(UserInputError, match="GPU 7 does not exist"):
        parse_gpu_list("0,7", [0, 1, 2, 3])
    with pytest.raises(UserInputError, match="listed twice"):
        parse_gpu_list("1,1", [0, 1])
    with pytest.raises(UserInputError, match="'x' is not a GPU index"):
        parse_gpu_list("0,x", [0, 1])
    with pytest.raises(UserInputError, match="expected GPU indices"):
        parse_gpu_list(" , ", [0])


def test_push_pickles_and_refuses_live_objects():
    blobs = pickle_pushed(["cfg"], {"cfg": {"lr": 0.1}})
    assert set(blobs) == {"cfg"}
    with pytest.raises(UserInputError, match="no variable 'missing'"):
        pickle_pushed(["missing"], {})
    with pytest.raises(UserInputError, match="generator cannot be pickled"):
        pickle_pushed(["gen"], {"gen": (i for i in range(3))})


def test_config_rules(tmp_path):
    with pytest.raises(UserInputError, match="the cell is empty"):
        LaunchConfig(nproc=2, code="   \n")
    with pytest.raises(UserInputError, match="does not exist"):
        LaunchConfig(nproc=2, script=tmp_path / "nope.py")
    with pytest.raises(UserInputError, match="either a cell"):
        LaunchConfig(nproc=2)
    with pytest.raises(UserInputError, match="--timeout 0"):
        LaunchConfig(nproc=2, code="x=1", timeout_s=0)
    with pytest.raises(UserInputError, match="--backend 'tcp'"):
        LaunchConfig(nproc=2, code="x=1", backend="tcp")


def test_the_launch_flag_and_rank_init_accept_the_same_backends():
    import argparse  # noqa: PLC0415

    from nbgpu.cli import _build_parser  # noqa: PLC0415
    from nbgpu.rank import job  # noqa: PLC0415

    sub = next(a for a in _build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    backend = next(a for a in sub.choices["run"]._actions if "--backend" in a.option_strings)
    assert tuple(backend.choices) == job.BACKENDS
    assert "ucc" in backend.choices  # what torch accepts, not a subset


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"nnodes": 0}, r"--nodes 0: expected a whole number >= 1"),
        ({"nnodes": 2}, r"--nodes 2 without --slurm: give --rdzv-endpoint HOST:PORT"),
        ({"nnodes": 2, "rdzv_endpoint": "node1"}, r"not 'node1'"),
        (
            {"nnodes": 2, "rdzv_endpoint": "n1:29400", "node_rank": 2},
            r"--node-rank 2: expected 0 to 1",
        ),
        ({"node_rank": 1}, r"--node-rank and --rdzv-endpoint are for runs over several nodes"),
        ({"nnodes": 2, "slurm": SlurmOptions(), "node_rank": 0}, r"--slurm chooses node ranks"),
        (
            {"nnodes": 2, "rdzv_endpoint": "n1:29400", "keep": True},
            r"--keep with several nodes needs --slurm",
        ),
    ],
)
def test_node_options_are_checked_before_anything_starts(keywords, message):
    with pytest.raises(UserInputError, match=message):
        LaunchConfig(nproc=2, code="x = 1", **keywords)


@pytest.mark.parametrize("value", ["soon", "1:2:3:4", "-5"])
def test_slurm_time_is_read_in_slurms_forms(value):
    with pytest.raises(UserInputError, match=rf"--time '{value}': expected SLURM's forms"):
        SlurmOptions(time=value)
    for fine in ("30", "1:00:00", "1-12", "2-00:30:00", "UNLIMITED"):
        SlurmOptions(time=fine)


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        (
            {"hang_after_s": -1},
            r"^--hang-after -1: expected seconds from 1 to 86400 \(e\.g\. 300\)",
        ),
        ({"hang_after_s": 0.5}, r"^--hang-after 0\.5: expected seconds from 1 to 86400"),
        ({"on_hang": "kill"}, r"^--on-hang 'kill': expected report or stop$"),
    ],
)
def test_stall_options_are_checked_before_anything_starts(keywords, message):
    with pytest.raises(UserInputError, match=message):
        LaunchConfig(nproc=2, code="x = 1", **keywords)
    assert LaunchConfig(nproc=2, code="x = 1", hang_after_s=0).hang_after_s == 0  # 0: never look
