"""The words of a rendezvous that timed out, from what the nodes left in the run directory."""

import json

import pytest

from nbgpu.launch.config import LaunchConfig, SlurmOptions
from nbgpu.launch.run_view import rendezvous_timeout_words
from nbgpu.launch.slurm import _never_starts


def slurm_config(nodes):
    return LaunchConfig(nproc=2, code="x=1", name="big", nnodes=nodes, slurm=SlurmOptions())


def test_nodes_that_never_started_are_named(tmp_path):
    (tmp_path / "rdzv.json").write_text(json.dumps({"node_names": ["a1", "a2", "a3", "a4"]}))
    (tmp_path / "node0.started").write_text("a1")
    (tmp_path / "node2.started").write_text("a3")
    words = rendezvous_timeout_words(tmp_path, slurm_config(4), 30)
    assert words.startswith("the 4 nodes did not meet within 30 s (--rdzv-timeout): ")
    assert "SLURM gave the job nodes a2, a4 but it never started their agent" in words
    assert "(started: a1, a3)" in words


def test_without_the_node_names_the_nodes_are_counted(tmp_path):
    (tmp_path / "node0.started").write_text("a1")
    words = rendezvous_timeout_words(tmp_path, slurm_config(3), 120)
    assert words.endswith(": 1 of 3 nodes started their agent")


def test_by_hand_the_words_say_what_to_run_on_the_others(tmp_path):
    config = LaunchConfig(
        nproc=1, code="x=1", name="m", nnodes=4, node_rank=2, rdzv_endpoint="head:29400"
    )
    words = rendezvous_timeout_words(tmp_path, config, 600)
    assert "--nodes 4 --rdzv-endpoint head:29400 --name m and --node-rank 0..3 (not 2)" in words


@pytest.mark.parametrize(
    ("reason", "srun_words", "never"),
    [
        ("Resources", [], False),
        ("Priority", [], False),
        ("PartitionConfig", [], True),
        ("AssocMaxWallDurationPerJobLimit", [], True),
        ("Job's account not known, so it can't use this partition", [], False),
        (
            "Job's account not known, so it can't use this partition",
            ["Requested partition configuration not available now"],
            True,
        ),
    ],
)
def test_which_pending_reasons_never_end(reason, srun_words, never):
    assert _never_starts(reason, srun_words) is never
