"""The failures a new user meets first, produced here for real, named with the fix.

Each log under ``reproduced/<cause>/`` is the unedited output of real torchrun (2-4 ranks,
gloo on the CPU build of torch) running a script of ``reproduced/scripts/``: hundreds of
lines of several ranks' training chatter around the failure. ``reproduced_runs/`` holds
run directories (nbgpu's launcher; two torchrun nodes). Each case checks the cause, the
rank that failed first, what the details say and a fix the user can type.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from nbgpu.diagnose import diagnose

HERE = Path(__file__).resolve().parent
REPRODUCED = HERE / "reproduced"
RUNS = HERE / "reproduced_runs"
SCRIPTS = REPRODUCED / "scripts"

# fixture, cause, first rank (None: the agent, not a rank), words in the details, in a fix
CASES = [
    ("cpu_torch/set_device_on_cpu_build_2ranks.log", "cpu_torch", 0,
     "CPU build", "download.pytorch.org/whl/cu124"),
    ("cpu_torch/to_cuda_after_gloo_3ranks_tee.log", "cpu_torch", 0,
     "CPU build", "--backend gloo"),
    ("missing_module/boto3_on_rank0_4ranks.log", "missing_module", 0,
     "could not import 'boto3'", "-m pip install boto3"),
    ("agent_hangup/sighup_to_agent_2ranks.log", "agent_hangup", None,
     None, "--signals-to-handle SIGTERM,SIGINT,SIGQUIT"),
    # Every rank fails the assert at once; torchrun's banner saw rank 1 first.
    ("batch_divisibility/gradient_accumulation_assert_3ranks.log", "batch_divisibility", 1,
     "multiple of ddp_world_size = 3 ranks", "multiple of world size"),
    ("exit_barrier/node0_exit_barrier.log", "exit_barrier", None,
     "waited 300 s", "dist.barrier()"),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_reproduced_failure_gives_cause_rank_and_fix(
    case: tuple[str, str, int | None, str | None, str],
) -> None:
    name, cause_id, first_rank, detail, fix = case
    text = (REPRODUCED / name).read_text(encoding="utf-8")
    assert text.count("\n") >= 150, "a realistic log, not an excerpt"
    result = diagnose(text)
    assert result.cause == cause_id, result.text()
    assert result.failed_rank == first_rank
    root = result.root
    assert root is not None
    if detail is not None:
        assert any(detail in d for d in root.details), root.details
    assert any(fix in f for f in root.fixes), root.fixes


def test_ranks_that_lost_their_peer_are_not_the_root() -> None:
    # Rank 0 could not import boto3; ranks 1-3 then lost it in the barrier.
    result = diagnose((REPRODUCED / "missing_module/boto3_on_rank0_4ranks.log").read_text())
    roles = {r.rank: r.role for r in result.ranks}
    assert roles[0] == "root"
    assert all(roles[r] != "root" for r in (1, 2, 3))


def test_cpu_build_shadows_the_driver_reading_of_the_same_line() -> None:
    # "Torch not compiled with CUDA enabled" once read as a driver problem: one line, one cause.
    result = diagnose((REPRODUCED / "cpu_torch/to_cuda_after_gloo_3ranks_tee.log").read_text())
    assert [f.cause for f in result.findings] == ["cpu_torch"]


def test_no_gpu_visible_is_told_apart_from_a_cpu_build() -> None:
    text = (HERE / "corpus/cpu_torch/corgs_23_no_cuda_gpus_set_device.log").read_text()
    root = diagnose(text).root
    assert root is not None
    assert "sees no GPU" in root.details[0]
    # A CUDA build that sees no GPU needs a GPU, not another torch.
    assert not any("install the CUDA build where the ranks look" in f for f in root.fixes)
    cpu = diagnose((REPRODUCED / "cpu_torch/set_device_on_cpu_build_2ranks.log").read_text())
    assert cpu.root is not None
    assert cpu.root.fixes[0].startswith(
        "install the CUDA build where the ranks look: `/work/main/.venv/bin/python -m pip "
        "install torch --index-url https://download.pytorch.org/whl/cu124`"
    )


def test_missing_module_names_the_interpreter_run_json_recorded(tmp_path: Path) -> None:
    run = shutil.copytree(RUNS / "missing_module_nbgpu_run", tmp_path / "run")
    meta = json.loads((run / "run.json").read_text())
    assert meta["python"]  # the launcher recorded it
    meta["python"] = "/opt/envs/train/bin/python"  # as if the kernel were another env's
    (run / "run.json").write_text(json.dumps(meta))
    result = diagnose(run)
    assert result.cause == "missing_module"
    assert result.failed_rank == 0
    root = result.root
    assert root is not None
    assert "/opt/envs/train/bin/python (run.json)" in root.details[0]
    assert f"this session runs {sys.executable}" in root.details[0]
    assert root.fixes[0].startswith(
        "install it where the ranks look: `/opt/envs/train/bin/python -m pip install boto3`"
    )


def test_the_recorded_run_as_the_launcher_left_it() -> None:
    result = diagnose(RUNS / "missing_module_nbgpu_run")
    assert (result.cause, result.failed_rank) == ("missing_module", 0)
    root = result.root
    assert root is not None
    assert "they ran /work/main/.venv/bin/python (run.json)" in root.details[0]


def test_world_size_assert_reads_the_value_from_the_script(tmp_path: Path) -> None:
    # The assertion prints no numbers: the script at the traceback's path says 5 * 8.
    log = (REPRODUCED / "batch_divisibility/gradient_accumulation_assert_3ranks.log").read_text()
    recorded = re.search(r'File "([^"]*gpt_accumulation\.py)"', log).group(1)  # type: ignore[union-attr]
    script = tmp_path / "gpt_accumulation.py"
    shutil.copy(SCRIPTS / "gpt_accumulation.py", script)
    result = diagnose(log.replace(recorded, str(script)))
    assert result.cause == "batch_divisibility"
    assert any(
        "gradient_accumulation_steps = 40 (gpt_accumulation.py line 6): valid for 3 ranks: "
        "39 or 42; or run 1, 2, 4, 5, 8, 10, 20, 40 ranks" in d
        for d in result.root.details  # type: ignore[union-attr]
    )


def test_two_nodes_the_barrier_is_the_root_the_store_loss_its_echo() -> None:
    # Node 0 gave up after 300 s and took the rendezvous store with it; node 1 then lost it.
    result = diagnose(RUNS / "exit_barrier_two_nodes")
    assert result.cause == "exit_barrier", result.text()
    assert [f.cause for f in result.findings][1:] == ["rendezvous"]


def test_ray_memory_numbers_and_the_node_to_ask() -> None:
    text = (HERE / "corpus/ray_oom/plantf_28_feature_cache.log").read_text()
    root = diagnose(text).root
    assert root is not None
    assert "Ray killed 12 worker(s) on node 172.31.105.218" in root.details[0]
    assert "`ray logs raylet.out -ip 172.31.105.218`" in root.details[1]


def test_python_m_names_its_own_interpreter() -> None:
    # `sudo bash script.sh` ran the system python, which has no torch.
    text = (HERE / "corpus/missing_module/squash_27_python_m_launch.log").read_text()
    root = diagnose(text).root
    assert root is not None
    assert "they ran /usr/bin/python (its own message)" in root.details[0]
    assert "`/usr/bin/python -m pip install torch`" in root.fixes[0]
