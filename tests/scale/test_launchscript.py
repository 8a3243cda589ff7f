"""verl/VAGEN launch scripts of Hydra overrides: read as bash reads them, rescaled in place.

The scripts are run by a real bash with a stand-in ``python3`` on ``PATH`` that prints the
arguments it was given, so what nbgpu reads is checked against what bash really passes.
"""

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nbgpu.plan
from nbgpu.cli import main
from nbgpu.errors import UserInputError
from nbgpu.scale.files import rewrite_script
from nbgpu.scale.script import read_script

CONFIGS = Path(__file__).parent / "configs"
VAGEN = CONFIGS / "vagen_2gpu.sh"
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash to run the launch scripts")


def bash_arguments(script: str, tmp_path: Path) -> dict[str, str]:
    """The key=value arguments bash hands to python3 (and CUDA_VISIBLE_DEVICES) for *script*."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python3"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        "print('CUDA_VISIBLE_DEVICES=' + os.environ.get('CUDA_VISIBLE_DEVICES', ''))\n"
        "for a in sys.argv[1:]: print(a)\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "logs").mkdir(exist_ok=True)
    path = tmp_path / "run.sh"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if k not in ("N_GPUS", "CUDA_VISIBLE_DEVICES")}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    out = subprocess.run(
        [BASH, str(path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    pairs = [line.partition("=") for line in out.stdout.splitlines() if "=" in line]
    return {k: v for k, _, v in pairs if not k.startswith("-")}


def nbgpu_arguments(script: str) -> dict[str, str]:
    read = read_script(script)
    out = {k: read.resolve(v) for k, v in read.overrides.items()}
    cvd = read.variable("CUDA_VISIBLE_DEVICES", read.command_at + 1)
    out["CUDA_VISIBLE_DEVICES"] = read.resolve(cvd.value) if cvd else ""
    return out


def test_the_script_is_read_as_bash_runs_it(tmp_path):
    text = VAGEN.read_text()
    assert nbgpu_arguments(text) == bash_arguments(text, tmp_path)


def test_rescaled_script_changes_values_where_they_are_written(tmp_path):
    plan = nbgpu.plan.scale(VAGEN, to_gpus=4)
    assert plan.ok
    assert plan.form == "script"
    old, new = VAGEN.read_text().splitlines(), plan.to_text().splitlines()
    assert len(old) == len(new)
    assert [(a, b) for a, b in zip(old, new, strict=True) if a != b] == [
        (
            "N_GPUS=${N_GPUS:-2}          # GPUs on this box",
            "N_GPUS=${N_GPUS:-4}          # GPUs on this box",
        ),
        ("BATCH=2", "BATCH=4"),
        (
            "CUDA_VISIBLE_DEVICES=0,1 python3 -m verl.trainer.main_ppo \\",
            "CUDA_VISIBLE_DEVICES=0,1,2,3 python3 -m verl.trainer.main_ppo \\",
        ),
    ]
    # And bash now passes exactly the new values.
    passed = bash_arguments(plan.to_text(), tmp_path)
    assert passed["data.train_batch_size"] == "4"
    assert passed["actor_rollout_ref.actor.ppo_mini_batch_size"] == "4"
    assert passed["trainer.n_gpus_per_node"] == "4"
    assert passed["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert passed["actor_rollout_ref.rollout.tensor_model_parallel_size"] == "2"
    assert passed["trainer.experiment_name"] == "sokoban_4gpu"  # built from $N_GPUS


def test_scaled_tensor_parallel_moves_its_variable_and_the_engine_limits(tmp_path):
    plan = nbgpu.plan.scale(VAGEN, to_gpus=4, tensor_parallel="scale")
    passed = bash_arguments(plan.to_text(), tmp_path)
    assert passed["actor_rollout_ref.rollout.tensor_model_parallel_size"] == "4"
    assert "TP=4                         # rollout tensor parallel" in plan.to_text()
    assert passed["actor_rollout_ref.rollout.max_num_seqs"] == "8"
    assert passed["actor_rollout_ref.rollout.max_num_batched_tokens"] == "3600"
    assert 'gpu_memory_utilization="0.34"' in plan.to_text()  # kept, quotes and all


SHARED = """\
N=2
python3 -m verl.trainer.main_ppo \\
  data.train_batch_size=8 \\
  trainer.n_gpus_per_node=$N \\
  actor_rollout_ref.rollout.tensor_model_parallel_size=$N
"""


def test_a_variable_two_keys_read_is_not_moved_under_the_one_that_keeps_its_value(tmp_path):
    path = tmp_path / "shared.sh"
    path.write_text(SHARED)
    plan = nbgpu.plan.scale(path, to_gpus=4)
    passed = bash_arguments(plan.to_text(), tmp_path)
    assert passed["trainer.n_gpus_per_node"] == "4"
    assert passed["actor_rollout_ref.rollout.tensor_model_parallel_size"] == "2"
    assert "N=4\n" in plan.to_text()
    notes = " ".join(w.message for w in plan.warnings)
    assert (
        "tensor_model_parallel_size (line 5): $N is shared with trainer.n_gpus_per_node, "
        "which change it" in notes
    )


def test_arithmetic_follows_its_variable_or_is_replaced_and_said_so(tmp_path):
    script = (
        "G=2\n"
        "python3 train.py trainer.n_gpus_per_node=$G data.train_batch_size=$((G*4)) \\\n"
        "    actor_rollout_ref.actor.ppo_mini_batch_size=$(( 4 + 4 ))\n"
    )
    path = tmp_path / "expr.sh"
    path.write_text(script)
    plan = nbgpu.plan.scale(path, to_gpus=4)
    assert plan.from_gpus == 2  # $G read through its assignment
    text = plan.to_text()
    # $((G*4)) already becomes 16 once G=4: left as written.
    assert "G=4\n" in text
    assert "data.train_batch_size=$((G*4))" in text
    # $(( 4 + 4 )) does not follow the GPUs: replaced by the value it must have, and said so.
    assert "ppo_mini_batch_size=16\n" in text
    notes = [w.message for w in plan.warnings]
    assert any(
        "(line 3): the expression $(( 4 + 4 )) was replaced by the value 16" in n for n in notes
    )
    passed = bash_arguments(text, tmp_path)
    assert passed["data.train_batch_size"] == "16"
    assert passed["actor_rollout_ref.actor.ppo_mini_batch_size"] == "16"


def test_quotes_continuations_comments_and_separators(tmp_path):
    script = """#!/usr/bin/env bash
set -euo pipefail
export CUDA_VISIBLE_DEVICES="0,1"  # pinned
PROJECT='my proj'; STEPS=10
if [ -d logs ]; then echo "logs # here"; fi
PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1 python3 -m verl.trainer.main_ppo \\
    data.train_batch_size=\\
16 \\
    trainer.project_name="$PROJECT" \\
    'trainer.logger=["console","wandb"]' \\
    +trainer.val_before_train=false \\
    trainer.n_gpus_per_node="2" && echo done
"""
    assert nbgpu_arguments(script) == {
        k: v for k, v in bash_arguments(script, tmp_path).items() if k != "PYTHONUNBUFFERED"
    }
    read = read_script(script)
    assert read.config()["+trainer.val_before_train"] is False
    new, notes = rewrite_script(
        read, {"trainer.n_gpus_per_node": "4", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    )
    assert notes == []
    assert 'export CUDA_VISIBLE_DEVICES="0,1,2,3"  # pinned' in new
    assert 'trainer.n_gpus_per_node="4" && echo done' in new
    assert bash_arguments(new, tmp_path)["trainer.n_gpus_per_node"] == "4"


@pytest.mark.parametrize(
    ("script", "message"),
    [
        ("python3 -m verl.trainer.main_ppo data.x='1 \\\n", r"line 1: ' is not closed"),
        ("echo hello\nls -l\n", "no Hydra overrides found"),
        ('python3 train.py a.b="${X\n', r"line 1: \$\{ is not closed"),
    ],
)
def test_bad_scripts_are_one_line(script, message):
    with pytest.raises(UserInputError, match=message):
        read_script(script, "config 'run.sh'")


def test_cli_writes_the_rescaled_script(tmp_path, capsys):
    out = tmp_path / "run_8gpu.sh"
    code = main(["plan", "--scale", str(VAGEN), "--to", "8", "--output", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "trainer.n_gpus_per_node: 2 → 8" in printed
    text = out.read_text()
    assert "N_GPUS=${N_GPUS:-8}" in text
    assert "BATCH=8" in text
    assert out.stat().st_mode & 0o777 == VAGEN.stat().st_mode & 0o777  # still executable
    assert main(["plan", "--scale", str(VAGEN), "--to", "8", "--diff"]) == 0
    assert "+BATCH=8" in capsys.readouterr().out


VALUES = st.one_of(
    st.integers(0, 4096).map(str),
    st.sampled_from(["0.34", "true", "[0,1]", "Qwen/Qwen2.5-3B", "a b", "x#y", "it's"]),
)
QUOTES = st.sampled_from(["plain", "single", "double"])


def _quoted(value: str, style: str) -> str:
    if style == "single" and "'" not in value:
        return f"'{value}'"
    if style == "double" or " " in value or "'" in value or "#" in value:
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return value


@st.composite
def scripts(draw):
    """Launch scripts in the verl style: variables, then overrides reading some of them."""
    lines, names = ["#!/bin/bash", "set -e"], []
    for n in range(draw(st.integers(0, 3))):
        name = f"V{n}"
        value = _quoted(draw(VALUES), draw(QUOTES))
        if draw(st.booleans()):
            value = f"${{{name}:-{draw(st.integers(1, 64))}}}"
        comment = "   # a note" if draw(st.booleans()) else ""
        lines.append(f"{'export ' if draw(st.booleans()) else ''}{name}={value}{comment}")
        names.append(name)
    args = []
    for n in range(draw(st.integers(1, 5))):
        if names and draw(st.booleans()):
            ref = draw(st.sampled_from(names))
            value = draw(
                st.sampled_from([f"${ref}", f"${{{ref}}}", f'"${ref}"', f"$(( {ref} * 2 ))"])
            )
            if "((" in value and not any(
                line.startswith((f"{ref}=", f"export {ref}="))
                and line.split("=", 1)[1].split()[0].strip("'\"").isdigit()
                for line in lines
            ):
                value = f"${ref}"
        else:
            value = _quoted(draw(VALUES), draw(QUOTES))
        args.append(f"    section{n}.key_{n}={value}")
    lines.append("python3 -m verl.trainer.main_ppo \\")
    lines.append(" \\\n".join(args))
    return "\n".join(lines) + "\n"


@settings(max_examples=40, deadline=None)
@given(scripts())
def test_property_overrides_are_read_as_bash_passes_them(tmp_path_factory, script):
    tmp_path = tmp_path_factory.mktemp("script")
    passed = bash_arguments(script, tmp_path)
    passed.pop("CUDA_VISIBLE_DEVICES")
    read = read_script(script)
    assert {k: read.resolve(v) for k, v in read.overrides.items()} == passed
