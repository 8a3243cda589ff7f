"""The terminal face, run as a real subprocess: output, exit codes, one-line errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nbgpu import cli
from tests.conftest import NO_DRIVER, real_nvml_present

NBGPU = [sys.executable, "-m", "nbgpu"]


def run(args, simulate=None, stdin=None, **env):
    environ = {k: v for k, v in os.environ.items() if k not in ("NBGPU_SIMULATE", "NPROC_PER_NODE")}
    if simulate is not None:
        environ["NBGPU_SIMULATE"] = simulate
    environ.update(env)
    return subprocess.run(
        NBGPU + args,
        input=stdin,
        capture_output=True,
        text=True,
        env=environ,
        timeout=120,
        check=False,
    )


def test_status_text_and_json_round_trip(tmp_path):
    out = run(["status"], simulate="busy-gpu0")
    assert out.returncode == 0
    assert "SIMULATED fleet 'busy-gpu0'" in out.stdout
    assert "BUSY: dead holder" in out.stdout
    js = run(["status", "--json"], simulate="8xH100,procs=40")
    data = json.loads(js.stdout)
    assert len(data["gpus"]) == 8
    assert sum(len(g["processes"]) for g in data["gpus"]) == 40
    pod = tmp_path / "pod.json"
    pod.write_text(js.stdout)
    replay = run(["status", "--json"], simulate=str(pod))
    assert replay.returncode == 0
    assert [g["uuid"] for g in json.loads(replay.stdout)["gpus"]] == [
        g["uuid"] for g in data["gpus"]
    ]


def test_doctor_exit_code_reflects_findings():
    assert run(["doctor", "--no-probe"], simulate="healthy").returncode == 0
    bad = run(["doctor"], simulate="busy-gpu0")
    assert bad.returncode == 1
    assert "Recommendation: launch 3 ranks on GPUs 1,2,3" in bad.stdout


def test_doctor_sees_nproc_from_environment():
    out = run(["doctor", "--no-probe"], simulate="4xH100", NPROC_PER_NODE="7")
    assert "NPROC_PER_NODE=7 but 4 GPUs are visible" in out.stdout


@pytest.mark.parametrize(
    "simulate",
    [
        pytest.param(
            None,
            marks=pytest.mark.skipif(
                real_nvml_present(), reason="this machine has an NVIDIA driver"
            ),
            id="real-no-driver",
        ),
        pytest.param(NO_DRIVER, id="simulated-no-driver"),
    ],
)
def test_no_gpu_machine_explains_itself(simulate):
    out = run(["doctor", "--no-probe"], simulate=simulate)
    assert out.returncode == 1
    assert "No NVIDIA driver library" in out.stdout
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("args", "simulate", "fragment"),
    [
        (["status"], "4xB200", "unknown GPU model 'B200'"),
        (["status"], "nosuchfleet", "is not a scenario, a fleet file or a spec"),
        (["status"], "/nonexistent/pod.json", "does not exist"),
        (["status", "--bogus"], "healthy", "unrecognized arguments: --bogus"),
        (["frobnicate"], "healthy", "invalid choice: 'frobnicate'"),
        (["doctor", "--nproc", "0"], "healthy", "--nproc 0: expected a whole number >= 1"),
        (["clean", "--grace", "-2"], "healthy", "--grace -2.0: expected seconds >= 0"),
        ([], "healthy", "choose a command"),
    ],
)
def test_usage_errors_are_one_line_exit_2(args, simulate, fragment):
    out = run(args, simulate=simulate)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert fragment in lines[0]
    assert lines[0].startswith("nbgpu: error: ")


def test_no_command_names_every_command():
    out = run([], simulate="healthy")
    said = out.stderr.split("choose a command:")[1]
    for name in cli._build_parser()._subparsers._group_actions[0].choices:
        assert name in said, name


def test_bad_fleet_json_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"nbgpu_fleet": 1, "gpus": [{"name": "A40"}]}')
    out = run(["status"], simulate=str(bad))
    assert out.returncode == 2
    assert "gpus[0] has no 'memory_total_bytes'" in out.stderr


def test_clean_dry_run_lists_nothing_on_a_fleet_with_no_live_holders():
    out = run(["clean", "--dry-run"], simulate="busy-gpu0")
    assert out.returncode == 0
    assert out.stdout.strip()


def test_diagnose_a_log_file_and_stdin():
    corpus = Path(__file__).parent / "diagnose" / "corpus" / "cuda_oom"
    log = sorted(corpus.glob("*.log"))[0]
    out = run(["diagnose", str(log)])
    assert out.returncode == 1  # a failure was found
    assert "[cuda_oom]" in out.stdout
    piped = run(["diagnose", "-", "--json"], stdin=log.read_text())
    assert json.loads(piped.stdout)["cause"] == "cuda_oom"
    clean = run(["diagnose", "-"], stdin="all good\n")
    assert clean.returncode == 0
    missing = run(["diagnose", "/no/such/file.log"])
    assert missing.returncode == 2
    assert "no such file or directory" in missing.stderr


def test_estimate_command_text_and_json():
    args = ["estimate", "Qwen/Qwen2.5-7B-Instruct", "--strategy", "zero2", "--world-size", "8"]
    args += ["--micro", "4", "--seq-len", "4096"]
    out = run(args)
    assert out.returncode == 0, out.stderr
    assert "activations" in out.stdout
    assert "Korthikanti" in out.stdout
    data = json.loads(run([*args, "--json"]).stdout)
    assert data["strategy"] == "zero2"
    assert {t["name"] for t in data["terms"]} >= {"weights", "logits/loss", "NCCL buffers"}


def test_estimate_command_largest_micro_and_bad_input():
    args = "estimate llama-3.1-8b --strategy zero3 --world-size 8 --seq-len 4096 --checkpointing"
    out = run([*args.split(), "--budget", "40GB", "--max-micro", "auto"])
    assert out.returncode == 0, out.stderr
    assert "largest micro batch" in out.stdout
    bad = run(["estimate", "7B", "--precision", "fp8"])
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1
    assert "precision='fp8'" in bad.stderr
    small = run(["estimate", "7B", "--budget", "10GB"])
    assert small.returncode == 1
    assert "smallest change that fits: strategy='zero3'" in small.stdout


def test_estimate_command_grad_dtype_offload_and_no_flash():
    args = "estimate 7B --strategy zero2 --world-size 8 --gpus-per-node 4 --grad-dtype fp32"
    out = run([*args.split(), "--offload", "optimizer", "--no-flash", "--json"])
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert (data["grad_dtype"], data["offload"], data["gpus_per_node"]) == (
        "fp32",
        ["optimizer"],
        4,
    )
    assert data["host_bytes"] > 0
    assert data["flash_attention"] is False


def test_plan_with_model_name_seq_len_and_max_micro_auto():
    args = "plan d4t1p1 --fleet 4xA40 --model Qwen/Qwen2.5-1.5B-Instruct --seq-len 2048"
    out = run([*args.split(), "--max-micro", "auto", "--strategy", "zero2", "--batch", "64"])
    assert out.returncode == 0, out.stderr + out.stdout
    assert "logits/loss" in out.stdout
    assert "largest micro batch" in out.stdout
