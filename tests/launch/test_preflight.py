"""Before launch: code asking for CUDA the ranks' torch cannot give is one line, or a refusal."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from nbgpu.errors import UserInputError
from nbgpu.launch import preflight
from nbgpu.launch.config import LaunchConfig
from nbgpu.launch.flags import add_flags, prepare_options
from nbgpu.launch.launcher import prepare, torchrun
from nbgpu.launch.preflight import TorchBuild, cuda_asks, cuda_line, torch_build

ASKS_CUDA = "import os, torch\ntorch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n"
PORTABLE = "import nbgpu.rank, torch\nx = torch.ones(2, device=nbgpu.rank.device())\n"


CPU_BUILD = TorchBuild("2.5.1+cpu", None)
CUDA_BUILD = TorchBuild("2.5.1+cu124", "12.4")


def _cuda_notes(notes: tuple[str, ...]) -> list[str]:
    return [n for n in notes if "asks for CUDA" in n or "asks for nccl" in n]


@pytest.fixture
def cpu_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare() sees a CPU build whatever torch this machine has (read for real below)."""
    monkeypatch.setattr(preflight, "torch_build", lambda: CPU_BUILD)


def test_this_machines_torch_is_read_without_importing_it() -> None:
    script = (
        "import sys\nfrom nbgpu.launch.preflight import torch_build\n"
        "b = torch_build()\nprint('torch' in sys.modules, b.version, b.cuda)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    import torch  # noqa: PLC0415  (the answer to compare with: the test may import it)

    assert out.stdout.split() == ["False", torch.__version__, str(torch.version.cuda)]
    assert torch_build() == type(torch_build())(torch.__version__, torch.version.cuda)


def test_a_cuda_build_is_read_from_its_version_file(tmp_path: Path) -> None:
    # A stand-in install first on the path: its metadata and torch/version.py, never imported.
    info = tmp_path / "torch-2.5.1+cu124.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.5.1+cu124\n")
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "version.py").write_text(
        "from typing import Optional\n__version__ = '2.5.1+cu124'\ncuda: Optional[str] = '12.4'\n"
    )
    script = "from nbgpu.launch.preflight import torch_build\nprint(torch_build())\n"
    env = {"PYTHONPATH": f"{tmp_path}:{Path(__file__).resolve().parents[2]}", "PATH": "/usr/bin"}
    out = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.stdout.strip() == "TorchBuild(version='2.5.1+cu124', cuda='12.4')", out.stderr


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (ASKS_CUDA, (2, "torch.cuda.set_device")),
        ("model = Net()\nmodel.cuda()\n", (2, ".cuda()")),
        ("x = torch.zeros(3, device='cuda')\n", (1, 'device="cuda"')),
        ("x = x.to(f'cuda:{rank}')\n", (1, '"cuda" device')),
        ('dist.init_process_group(backend="nccl")\n', (1, "nccl")),
        ("dist.init_process_group('nccl')\n", (1, "nccl")),
        ("# torch.cuda.set_device(0) on the GPU box\nprint(1)\n", None),
        (PORTABLE, None),
        ("%%time\nx = 1\n", None),  # IPython syntax: read as text, nothing asked
        # Code that looks before it asks chooses its own device.
        ("device = 'cuda' if torch.cuda.is_available() else 'cpu'\n", None),
        ("if torch.cuda.device_count():\n    model.cuda()\n", None),
    ],
)
def test_what_asks_for_cuda(source: str, expected: tuple[int, str] | None) -> None:
    assert cuda_asks(source) == expected


@pytest.mark.usefixtures("cpu_build")
def test_cpu_build_and_cuda_code_is_one_line_and_the_run_is_prepared(sim_env) -> None:
    prepared = prepare(code=ASKS_CUDA, nproc=2, environ=sim_env)
    (line,) = _cuda_notes(prepared.notes)
    assert line.startswith("the cell line 2 asks for CUDA (torch.cuda.set_device), but this torch")
    assert "is a CPU build" in line
    assert "--backend gloo" in line
    assert "\n" not in line


@pytest.mark.usefixtures("cpu_build")
def test_strict_refuses_in_one_line(sim_env) -> None:
    with pytest.raises(UserInputError, match=r"^--strict: the cell line 2 asks for CUDA") as err:
        prepare(code=ASKS_CUDA, nproc=2, environ=sim_env, strict=True)
    assert "\n" not in str(err.value)
    # Code that asks for nothing starts under --strict too.
    assert prepare(code=PORTABLE, nproc=2, environ=sim_env, strict=True).config.strict


@pytest.mark.usefixtures("cpu_build")
def test_a_script_is_read_and_named(sim_env, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import torch\n\nmodel = torch.nn.Linear(2, 2).cuda()\n")
    (line,) = _cuda_notes(prepare(script=script, nproc=1, environ=sim_env).notes)
    assert line.startswith("train.py line 3 asks for CUDA (.cuda())")


@pytest.mark.usefixtures("cpu_build")
def test_simulated_fleet_is_quiet_for_nbgpu_rank_device(sim_env) -> None:
    env = {**sim_env, "NBGPU_SIMULATE": "4xA40"}
    assert _cuda_notes(prepare(code=PORTABLE, environ=env).notes) == []
    # nbgpu.rank.init() runs nccl as gloo on the simulated fleet: --backend nccl is fine there.
    assert _cuda_notes(prepare(code=PORTABLE, environ=env, backend="nccl").notes) == []


@pytest.mark.usefixtures("cpu_build")
def test_simulated_fleet_still_names_a_real_cuda_call(sim_env) -> None:
    env = {**sim_env, "NBGPU_SIMULATE": "4xA40"}
    (line,) = _cuda_notes(prepare(code=ASKS_CUDA, environ=env).notes)
    assert "asks for CUDA (torch.cuda.set_device)" in line


def test_backend_nccl_and_no_gpu() -> None:
    config = LaunchConfig(nproc=2, code=PORTABLE, backend="nccl")
    line = cuda_line(config, CPU_BUILD, gpus_here=False)
    assert line is not None
    assert line.startswith(
        "--backend nccl asks for CUDA, but this torch (2.5.1+cpu) is a CPU build"
    )
    # A CUDA build on a machine without GPUs: what "No CUDA GPUs are available" means.
    line = cuda_line(config, CUDA_BUILD, gpus_here=False)
    assert line is not None
    assert "no GPU is visible here" in line
    assert cuda_line(config, CUDA_BUILD, gpus_here=True) is None
    assert cuda_line(config, CPU_BUILD, gpus_here=False, fleet="4xA40") is None
    assert cuda_line(config, None, gpus_here=False) is None  # no torch: import torch says it


def test_strict_flag_in_both_faces() -> None:
    parser = add_flags(argparse.ArgumentParser())
    assert prepare_options(parser.parse_args(["--strict", "s.py"]))["strict"] is True
    assert prepare_options(parser.parse_args(["s.py"]))["strict"] is False


@pytest.mark.slow
def test_the_line_comes_before_the_ranks_and_the_run_still_starts(env) -> None:
    build = torch_build()
    if build is None or build.cuda is not None:
        pytest.skip("needs the CPU build of torch (this machine's ranks meet it for real)")
    out: list[str] = []
    run = torchrun(ASKS_CUDA, 2, check=False, write=out.append, environ=env)
    text = "".join(out)
    assert "asks for CUDA (torch.cuda.set_device)" in text
    assert text.index("asks for CUDA") < text.index("[rank")
    assert run.state == "failed"  # it started, and every rank met the CPU build there
    assert "module 'torch._C' has no attribute '_cuda_setDevice'" in text
    # run.json names the interpreter the ranks ran, for a diagnosis of a missing module.
    assert json.loads((run.dir / "run.json").read_text())["python"] == sys.executable


def test_simulated_fleet_with_a_cuda_build_names_the_fleet() -> None:
    config = LaunchConfig(nproc=2, code=ASKS_CUDA)
    line = cuda_line(config, CUDA_BUILD, gpus_here=False, fleet="4xA40")
    assert line is not None
    assert "the simulated fleet '4xA40' has no CUDA behind it" in line
    assert "nbgpu.rank.device()" in line
