"""One meaning of every size unit, whichever face reads it (nbgpu.sizes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import nbgpu
from nbgpu.cli import main
from nbgpu.errors import UserInputError
from nbgpu.launch.launcher import prepare
from nbgpu.sizes import parse_size

CONFIG = Path(__file__).parent / "scale" / "configs" / "vagen_2gpu.sh"
# G and GiB are powers of 1024 (ulimit, SLURM --mem, nvidia-smi); GB powers of 1000 (SI, HF).
MEANS = {"80GB": 80 * 10**9, "80GiB": 80 * 2**30, "80G": 80 * 2**30}


@pytest.mark.parametrize("written", MEANS)
def test_a_size_means_the_same_in_mem_limit_estimate_and_plan(written, sim_env, capsys):
    expected = MEANS[written]
    env = {**sim_env, "NBGPU_SIMULATE": "2xA40"}
    launch = prepare("print(1)", nproc=1, mem_limit=written, environ=env)
    assert launch.config.mem_limit_bytes == expected
    estimate = nbgpu.estimate("Qwen/Qwen2.5-0.5B", micro_batch=1, budget=written)
    assert estimate.budget_bytes == expected
    main(["plan", "--scale", str(CONFIG), "--to", "4", "--gpu-memory", written, "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv"]["gpu_memory_bytes"] == expected


@pytest.mark.parametrize(
    ("written", "expected"),
    [("512M", 512 * 2**20), ("512MiB", 512 * 2**20), ("512MB", 512 * 10**6), ("1.5T", 3 * 2**39),
     (" 8 g ", 8 * 2**30), ("2kb", 2000), ("4096", 4096), (4096, 4096), (80e9, 80 * 10**9)],
)  # fmt: skip
def test_units(written, expected):
    assert parse_size(written) == expected


@pytest.mark.parametrize("written", ["", "lots", "-5G", "0", "G", "5X", "80 GBs", 0, 1.5, True])
def test_a_bad_size_is_one_line_naming_it_and_the_units(written):
    with pytest.raises(UserInputError) as info:
        parse_size(written, "--mem-limit ")
    message = str(info.value)
    assert message.startswith(f"--mem-limit {written!r}: expected")
    assert "powers of 1024" in message
    assert "powers of 1000" in message
    assert "\n" not in message
