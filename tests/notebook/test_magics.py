"""The magics in a real IPython InteractiveShell (the kernel's environment is os.environ)."""

import json

import pytest
from IPython.core.error import UsageError

from nbgpu.devices.doctor import DoctorReport
from nbgpu.devices.inventory import Inventory
from nbgpu.notebook import magics_classes


def test_gpu_status_returns_the_inventory(ip):
    result = ip.run_line_magic("gpu_status", "")
    assert isinstance(result, Inventory)
    assert result.fleet_name == "busy-gpu0"
    assert result.findings[0][0].code == "exclusive_dead_holder"


def test_gpu_status_json_is_a_fleet_document(ip, capsys):
    assert ip.run_line_magic("gpu_status", "--json") is None
    data = json.loads(capsys.readouterr().out)
    assert data["nbgpu_fleet"] == 1
    assert len(data["gpus"]) == 4


@pytest.mark.parametrize("flag", ["--env 2,3", "--env CUDA_VISIBLE_DEVICES=2,3", "--env '2,3'"])
def test_gpu_status_env_mapping(ip, flag):
    result = ip.run_line_magic("gpu_status", flag)
    assert [(d.cuda_index, d.nvml_index) for d in result.visible.devices] == [(0, 2), (1, 3)]


def test_gpu_status_probe(ip):
    result = ip.run_line_magic("gpu_status", "--probe")
    assert result.probe is not None
    assert result.probe.for_nvml_index(0).outcome == "busy"


def test_gpu_status_follows_env_changes(ip):
    ip.run_line_magic("env", "NBGPU_SIMULATE=2xT4")
    assert len(ip.run_line_magic("gpu_status", "").gpus) == 2


@pytest.mark.parametrize(
    ("magic", "line", "fragment"),
    [
        ("gpu_status", "--bogus", "unrecognized arguments: --bogus"),
        ("gpu_status", "--env FOO=1", "only CUDA_VISIBLE_DEVICES can be given"),
        ("gpu_doctor", "--nproc 0", "--nproc 0: expected a whole number >= 1"),
        ("gpu_doctor", "--nproc many", "invalid int value: 'many'"),
        ("gpu_clean", "--grace -1", "--grace -1.0: expected seconds >= 0"),
    ],
)
def test_bad_arguments_are_one_line_usage_errors(ip, magic, line, fragment):
    with pytest.raises(UsageError) as info:
        ip.run_line_magic(magic, line)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_fleet_spec_is_a_usage_error(ip, monkeypatch):
    monkeypatch.setenv("NBGPU_SIMULATE", "4xB200")
    with pytest.raises(UsageError, match="unknown GPU model 'B200'"):
        ip.run_line_magic("gpu_status", "")


def test_usage_error_through_run_cell_is_not_a_traceback(ip, capsys):
    result = ip.run_cell("%gpu_status --nope")
    assert isinstance(result.error_in_exec, UsageError)
    err = capsys.readouterr().err
    assert "UsageError: %gpu_status: unrecognized arguments: --nope (see %gpu_status -h)" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("magic", ["gpu_status", "gpu_doctor", "gpu_clean"])
def test_every_magic_has_dash_h(ip, capsys, magic):
    assert ip.run_line_magic(magic, "-h") is None
    out = capsys.readouterr().out
    assert out.startswith(f"%{magic} ")
    assert "options:" in out


def test_dash_h_for_every_registered_magic(ip, capsys):
    # Whatever nbgpu registers must answer -h with usage text, not an error.
    line_magics = [name for cls in magics_classes() for name in cls.magics["line"]]
    assert {"gpu_status", "gpu_memory", "gpu_watch", "torchrun"} <= set(line_magics)
    for magic in line_magics:
        assert ip.run_line_magic(magic, "-h") is None, magic
        out = capsys.readouterr().out
        assert magic in out, magic
        assert len(out.splitlines()) >= 3, magic


def test_gpu_doctor(ip):
    report = ip.run_line_magic("gpu_doctor", "--no-probe --nproc 7")
    assert isinstance(report, DoctorReport)
    codes = {f.code for f in report.findings}
    assert {"exclusive_dead_holder", "nproc_exceeds_gpus"} <= codes


def test_gpu_clean_dry_run_lists_and_signals_nothing(ip):
    report = ip.run_line_magic("gpu_clean", "--dry-run")
    assert report.dry_run
    assert report.outcomes == ()


def test_gpu_clean_without_stdin_asks_nobody(ip):
    # A plain InteractiveShell has stdin; with nothing stale there is nothing to ask.
    report = ip.run_line_magic("gpu_clean", "")
    assert report.outcomes == ()


def test_gpu_plan_memory_terms_and_max_micro_auto(ip):
    ip.run_line_magic("env", "NBGPU_SIMULATE=4xA40")
    plan = ip.run_line_magic(
        "gpu_plan",
        "d4 --model Qwen/Qwen2.5-1.5B-Instruct --seq-len 2048 --max-micro auto --batch 64 "
        "--strategy zero2",
    )
    (check,) = plan.memory
    assert check.max_micro_batch >= 1
    assert "logits/loss" in [line.component for line in check.lines]
    assert "logits/loss" in plan.html()
