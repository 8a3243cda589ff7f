"""One job across nodes: nodes chosen, each node's GPUs, the world's batch and memory."""

import json

import pytest

import nbgpu
from nbgpu.devices.inventory import take_inventory
from nbgpu.errors import UserInputError
from nbgpu.plan.multinode import default_shape

CLUSTER = {"n1": "4xA40,busy=0", "n2": "4xA40,lost=2", "n3": "4xA40"}


@pytest.mark.parametrize(
    ("capacities", "nodes", "shape"),
    [
        ([4, 4, 4], None, (3, 4)),
        ([3, 3, 4], None, (3, 3)),  # 9 ranks beat 1 node x 4
        ([4, 2], None, (1, 4)),  # 4 = 2 x 2: the larger per-node count on a tie
        ([4, 3, 3], 2, (2, 3)),
        ([0, 0], None, (0, 0)),
        ([2], 3, (3, 0)),
    ],
)
def test_default_shape(capacities, nodes, shape):
    assert default_shape(capacities, nodes) == shape


def test_each_node_gives_its_usable_gpus_and_the_clean_node_comes_first():
    p = nbgpu.plan.nodes(CLUSTER, nodes=2, nproc_per_node=3, global_batch=12)
    assert p.ok, p.text()
    # n3 has nothing wrong: chosen first; then n1 before n2 (equally flawed, listed first).
    assert p.nodelist == "n1,n3"
    gpus = {"n1": "1,2,3", "n2": "0,1,3", "n3": "0,1,2"}
    assert all(p.node_gpus[n] == gpus[n] for n in p.node_gpus)
    assert (p.job_nodes, p.nproc_per_node, p.world_size) == (2, 3, 6)
    assert p.batch is not None
    assert p.batch.ok
    left = {n.node: n.reason for n in p.left_out}
    assert len(left) == 1
    assert "not needed" in next(iter(left.values()))


def test_excluded_gpus_are_named_per_node():
    p = nbgpu.plan.nodes(CLUSTER, nproc_per_node=3)
    assert p.ok
    assert p.job_nodes == 3
    excluded = {n.node: [(e.nvml_index, e.health) for e in n.excluded] for n in p.nodes}
    assert excluded["n1"] == [(0, "BUSY: dead holder")]
    assert excluded["n2"] == [(2, "LOST")]
    assert excluded["n3"] == []
    text = p.text()
    assert "GPU 0: BUSY: dead holder" in text
    assert "GPU 2: LOST" in text


def test_too_few_full_nodes_names_each_and_offers_what_fits():
    p = nbgpu.plan.nodes(CLUSTER, nodes=2, nproc_per_node=4, global_batch=64)
    assert not p.ok
    problem = p.problems[0]
    assert problem.code == "not_enough_nodes"
    assert "1 of the 3 node(s) do" in problem.message
    assert "n1: 3 of 4 GPUs usable, 4 needed (GPU 0: BUSY: dead holder)" in problem.message
    assert "n2: 3 of 4 GPUs usable, 4 needed (GPU 2: LOST)" in problem.message
    assert any(f.startswith("on n1: ") for f in problem.fixes)  # the dead holder's fix
    titles = [a.title for a in p.alternatives]
    assert titles[0] == "1 node(s) × 4 GPUs (n3)"
    # 2 x 3 ranks: 64 is not divisible by 6, so the alternative carries a batch that is.
    assert titles[1] == "2 node(s) × 3 GPUs (n1, n3), global batch 66 instead of 64"
    assert all(a.plan is not None and a.plan.ok for a in p.alternatives)


def test_the_batch_is_checked_for_every_rank_of_every_node():
    p = nbgpu.plan.nodes(CLUSTER, nodes=3, nproc_per_node=3, global_batch=48)
    assert [i.code for i in p.problems] == ["batch"]
    assert "9 ranks: global batch 48 is not divisible by 9" in p.problems[0].message
    assert "global_batch=45" in p.problems[0].fixes[0]


def test_memory_is_checked_on_the_tightest_node_for_the_whole_world():
    cluster = {"a": "2xA40", "b": "2xA100"}
    p = nbgpu.plan.nodes(cluster, nproc_per_node=2, model="7B", strategy="zero3")
    assert p.memory_node == "b"  # its GPUs have the least free memory
    (check,) = p.memory
    assert "Ψ/4" in check.accounting  # zero3 shards over 2 nodes x 2 ranks
    assert any(w.code == "mixed_gpus" for w in p.warnings)
    ddp = nbgpu.plan.nodes(cluster, nproc_per_node=2, model="7B")
    assert not ddp.ok
    assert ddp.problems[0].message.startswith("role train on b: training needs ")


def test_json_round_trip_and_frame():
    p = nbgpu.plan.nodes(CLUSTER, nproc_per_node=2, global_batch=12)
    data = json.loads(p.to_json())
    assert data["nbgpu_nodes_plan"] == 1
    assert data["node_gpus"] == p.node_gpus
    assert nbgpu.plan.plan_from_json(p.to_json()) == p
    frame = p.to_frame()
    assert list(frame["node"]) == [n for n in p.node_gpus for _ in range(2)]
    with pytest.raises(UserInputError, match="is a plan across nodes, not a sweep"):
        nbgpu.plan.plan_from_json(p.to_json(), run=0)


def test_a_status_file_and_a_description_plan_alike(tmp_path):
    nodes = [
        {"node": n, **take_inventory({"NBGPU_SIMULATE": s}, scan_device_files=False).to_dict()}
        for n, s in CLUSTER.items()
    ]
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"source": "allocation 7", "nodes": nodes}))
    from_file = nbgpu.plan.nodes(str(path), nproc_per_node=3)
    described = nbgpu.plan.nodes(CLUSTER, nproc_per_node=3)
    assert from_file.node_gpus == described.node_gpus
    assert from_file.source == "allocation 7"
    assert from_file.simulated
    from_dict = nbgpu.plan.nodes({"source": "allocation 7", "nodes": nodes}, nproc_per_node=3)
    assert from_dict.node_gpus == described.node_gpus


@pytest.mark.parametrize(
    ("cluster", "keywords", "message"),
    [
        (CLUSTER, {"nodes": 0}, r"nodes=0: expected a whole number >= 1"),
        (CLUSTER, {"nodes": 4}, r"nodes=4: the cluster has 3 node\(s\) \(n1, n2, n3\)"),
        (CLUSTER, {"nproc_per_node": -1}, r"nproc_per_node=-1: expected a whole number"),
        (CLUSTER, {"exclude": "0"}, r"exclude= is not a keyword it takes"),
        ("4xA40", {}, r"cluster file '4xA40' does not exist"),
        ("0x(8xH100)", {}, r"nodes=0: expected a whole number >= 1"),
        ("2x(9xZZ)", {}, r"node n1: "),
        (None, {"nodes": 2}, r"cluster=NoneType: expected a cluster"),
        ("2x(0)", {}, r"GPUs per node=0: expected a whole number >= 1"),
        ("2x(-1)", {}, r"GPUs per node=-1: expected a whole number >= 1"),
        ({}, {}, r"cluster=dict: expected a cluster"),
        ({"n1": 3}, {}, r"node 'n1' = 3: expected a cluster"),
        ({"n1": "9xZZ"}, {}, r"node n1: "),
        ("/nowhere/cluster.json", {}, r"cluster file '/nowhere/cluster.json' does not exist"),
    ],
)
def test_bad_input_is_one_line(cluster, keywords, message):
    with pytest.raises(UserInputError, match=message) as error:
        nbgpu.plan.nodes(cluster, **keywords)
    assert "\n" not in str(error.value)


def test_a_node_without_gpus_is_left_out_with_its_reason():
    p = nbgpu.plan.nodes({"n1": "2xA40", "n2": "no-driver"}, nodes=2, nproc_per_node=2)
    assert not p.ok
    assert "n2: 0 of 0 GPUs usable, 2 needed" in p.problems[0].message


def test_a_shared_gpu_given_to_the_job_is_a_warning_naming_its_node():
    p = nbgpu.plan.nodes({"n1": "4xA40,procs=1", "n2": "4xA40"}, nodes=2, nproc_per_node=4)
    assert p.ok
    caveats = [w.message for w in p.warnings if w.code == "gpu_caveat"]
    assert caveats == ["node n1: GPU 0 is shared with 1 other process(es) using 512.0 MiB"]
    # With room to spare, the shared GPU is left for its other user.
    roomy = nbgpu.plan.nodes({"n1": "4xA40,procs=1", "n2": "4xA40"}, nodes=2, nproc_per_node=3)
    assert roomy.node_gpus == {"n1": "1,2,3", "n2": "0,1,2"}
    assert not [w for w in roomy.warnings if w.code == "gpu_caveat"]


AREAL = "sglang:d80m2p1+d4m2p4"  # AReaL's published allocation for 24 nodes x 8 GPUs


def test_an_allocation_over_24_nodes_gives_each_role_whole_nodes():
    p = nbgpu.plan.nodes("24x(8xH100)", allocation=AREAL, global_batch=64)
    assert p.ok, p.text()
    assert p.simulated
    assert {n.node: n.role for n in p.nodes} == {
        f"n{i}": "sglang" if i <= 20 else "train" for i in range(1, 25)
    }
    assert {n.cuda_visible_devices for n in p.nodes} == {"0,1,2,3,4,5,6,7"}
    assert (p.launched, p.job_nodes, p.nproc_per_node) == ("train", 4, 8)
    assert p.nodelist == "n21,n22,n23,n24"
    assert p.batch is not None
    assert p.batch.data_parallel == 4  # d4 of the trainer, not its 32 GPUs
    text = p.text()
    assert (
        "role sglang: d80t2p1: 20 node(s) × 8 GPUs; 80 instance(s) of 2 GPUs, each within" in text
    )
    assert "role train: d4t2p4: 4 node(s) × 8 GPUs; 4 instance(s) of 8 GPUs, each within" in text
    assert nbgpu.plan.plan_from_json(p.to_json()) == p
    assert set(p.to_frame()["role"]) == {"sglang", "train"}


@pytest.mark.parametrize(
    ("cluster", "allocation", "layout"),
    [
        # Packed in a row, the trainer's first replica would take n1's last 2 GPUs and n2's first 2.
        ("2x(8xA40)", "sglang:d3t2+megatron:d2t2p2", [("n1", "sglang", "0,1,2,3,4,5"),
                                                      ("n2", "train", "0,1,2,3,4,5,6,7")]),
        # Small roles share a node; the other is not needed.
        ("2x(4xA40)", "sglang:d2+d2", [("n1", "sglang", "0,1"), ("n1", "train", "2,3")]),
        # Colocated roles run on the same GPUs of the same nodes.
        ("2x(4xA40)", "sglang:d8|fsdp:d8", [("n1", "sglang", "0,1,2,3"), ("n2", "sglang", "0,1,2,3"),
                                            ("n1", "train", "0,1,2,3"), ("n2", "train", "0,1,2,3")]),
        # Four usable GPUs a node: each node takes whole t2 instances (2 GPUs are left).
        ("2x(8xA40,lost=1+2)", "sglang:d4t2", [("n1", "sglang", "0,3,4,5"),
                                               ("n2", "sglang", "0,3,4,5")]),
    ],
)  # fmt: skip
def test_no_instance_straddles_nodes_when_it_fits_in_one(cluster, allocation, layout):
    p = nbgpu.plan.nodes(cluster, allocation=allocation)
    assert p.ok, p.text()
    assert [(n.node, n.role, n.cuda_visible_devices) for n in p.nodes] == layout
    assert not p.warnings


def test_an_instance_larger_than_a_node_spans_whole_nodes_and_says_so():
    p = nbgpu.plan.nodes("4x(8xA40)", allocation="megatron:d2t4p4")
    assert p.ok
    assert (p.job_nodes, p.nproc_per_node) == (4, 8)
    assert "2 instance(s) of 16 GPUs, each over 2 nodes" in p.text()
    assert not p.warnings  # its tensor-parallel groups (t4) stay inside a node
    wide = nbgpu.plan.nodes("2x(8xA40)", allocation="megatron:d1t16")
    assert wide.ok
    assert [w.code for w in wide.warnings] == ["tensor_across_nodes"]
    assert wide.warnings[0].message == "t16 spans nodes of 8 GPUs: all-reduces cross them"


def test_a_node_short_of_a_gpu_does_not_split_an_instance_that_fits_a_node():
    p = nbgpu.plan.nodes("2x(8xA40,lost=0)", allocation="d1t8", model="7B")
    assert not p.ok
    assert "role train: d1t8p1: not placed" in p.text()
    assert "memory" not in p.text()  # a model was given: nothing placed, nothing to check
    (problem,) = p.problems
    assert problem.code == "not_enough_nodes"
    assert "1 node(s) with 8 usable GPUs each; 0 of the 2 node(s) do" in problem.message
    assert "n1: 7 of 8 GPUs usable, 8 needed (GPU 0: LOST)" in problem.message


def test_roles_after_the_first_are_placed_on_what_it_left():
    p = nbgpu.plan.nodes("23x(8)", allocation=AREAL)
    assert not p.ok
    assert p.problems[0].message.startswith(
        "role train: 4 node(s) × 8 GPUs needs 4 node(s) with 8 usable GPUs each; 3 of the 23"
    )
    capped = nbgpu.plan.nodes("30x(8xA40)", nodes=20, allocation=AREAL)
    assert [p.code for p in capped.problems] == ["not_enough_nodes"]
    assert "takes 24 node(s); nodes=20 asked for" in capped.problems[0].message


def test_described_nodes_are_planned_as_described_not_seen():
    p = nbgpu.plan.nodes("24x(8)", allocation=AREAL, model="7B")
    assert p.ok
    assert not p.simulated
    assert p.source == "24 described nodes of 8 GPUs (not seen)"
    assert p.nodelist == "n21,n22,n23,n24"
    (check,) = p.memory
    assert check.fits is None  # no GPU sizes to compare with
    assert "Ψ/8" in check.accounting  # the trainer's weights sharded over t2 x p4


def test_memory_and_batch_are_checked_for_the_first_training_role():
    p = nbgpu.plan.nodes(
        "2x(8xA40)", allocation="sglang:d3t2+megatron:d2t2p2", model="7B", global_batch=5
    )
    assert p.memory_node == "n2"
    (check,) = p.memory
    assert check.role == "train on n2"
    assert "Ψ/4" in check.accounting
    assert [i.code for i in p.problems] == ["batch"]
    assert p.problems[0].message.startswith("role train: global batch 5 is not divisible by 2")
    serving = nbgpu.plan.nodes("2x(8xA40)", allocation="sglang:d8t2", global_batch=6)
    assert serving.ok
    assert serving.launched is None
    assert serving.node_gpus == {}
    assert [w.code for w in serving.warnings] == ["batch_unchecked"]
    assert "%%torchrun" not in serving.text()


def test_a_described_spec_takes_one_snapshot_for_many_nodes(monkeypatch):
    from nbgpu.plan import api  # noqa: PLC0415

    taken = []
    snapshot = api.inventory_snapshot
    monkeypatch.setattr(api, "inventory_snapshot", lambda *a: taken.append(a) or snapshot(*a))
    p = nbgpu.plan.nodes("64x(8xH100)", allocation="sglang:d192t2+megatron:d16t2p4")
    assert p.ok
    assert len(p.nodes) == 64
    assert len(taken) == 1


@pytest.mark.parametrize(
    ("call", "name", "what"),
    [
        (nbgpu.plan.nodes, "cluster.json", "cluster file"),
        (nbgpu.plan.plan_from_json, "plan.json", "plan file"),
        (lambda path: nbgpu.plan.scale(path, to_gpus=4), "ppo.json", "config"),
    ],
)
def test_a_broken_json_file_is_one_line_naming_the_file_and_where_it_breaks(
    tmp_path, call, name, what
):
    path = tmp_path / name
    path.write_text('{"n1": \n', encoding="utf-8")
    with pytest.raises(UserInputError) as caught:
        call(str(path))
    said = str(caught.value)
    assert said == f"{what} {str(path)!r} is not valid JSON (line 2, column 1: Expecting value)"
