"""Only flags before ``--`` are nbgpu's: the rest reaches the ranks' sys.argv untouched."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

PRINT_ARGV = "import sys\nprint('argv', sys.argv[1:], flush=True)\n"


@pytest.fixture
def fleet():
    return "4xH100"


def test_help_after_double_dash_goes_to_the_cell(ip, capsys):
    run = ip.run_cell_magic("torchrun", "2 -- --help -h", PRINT_ARGV)
    out = capsys.readouterr().out
    assert run.state == "succeeded"
    assert "argv ['--help', '-h']" in out
    assert "--serial-imports" not in out  # nbgpu's help was not printed


def test_help_before_double_dash_is_nbgpus(ip, capsys):
    assert ip.run_cell_magic("torchrun", "2 --help -- --lr 1", PRINT_ARGV) is None
    assert capsys.readouterr().out.startswith("%%torchrun")


def test_cli_run_passes_help_after_the_script_and_after_double_dash(tmp_path):
    script = tmp_path / "show.py"
    script.write_text(PRINT_ARGV)
    # the real terminal face, in a subprocess
    env_args = {"NBGPU_SIMULATE": "4xH100", "NBGPU_RUNS_DIR": str(tmp_path / "runs")}

    env = {**os.environ, **env_args}
    for argv, expected in (
        ([str(script), "--help"], "['--help']"),
        (["--", str(script), "--help"], "['--help']"),
        ([str(script), "--", "--help"], "['--help']"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "nbgpu", "run", "-n", "1", *argv],
            env=env,
            check=False,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode == 0, done.stderr
        assert f"argv {expected}" in done.stdout, (argv, done.stdout)


def test_prune_and_stacks_magics(ip, capsys, tmp_path):
    from IPython.core.error import UsageError  # noqa: PLC0415

    root = tmp_path / "runs"
    for i in range(3):
        run_dir = root / f"old-{i}"
        run_dir.mkdir(parents=True)
        (run_dir / "run.json").write_text(
            f'{{"run_id": "r{i}", "state": "succeeded", "started_at": {1000 + i}}}'
        )
    report = ip.run_line_magic("gpu_runs", "--prune --keep 1")
    assert sorted(n for n, _ in report.removed) == ["old-0", "old-1"]
    with pytest.raises(UsageError, match="--keep 'x': expected a whole number"):
        ip.run_line_magic("gpu_runs", "--prune --keep x")
    with pytest.raises(UsageError, match=r"unrecognized arguments: --bogus \(see %gpu_runs -h\)"):
        ip.run_line_magic("gpu_runs", "--bogus")
    with pytest.raises(UsageError, match="--keep and --budget go with --prune"):
        ip.run_line_magic("gpu_runs", "--keep 1")
    assert ip.run_line_magic("gpu_stacks", "-h") is None
    assert capsys.readouterr().out.startswith("%gpu_stacks [--native] [--timeout S] run")
    with pytest.raises(UsageError, match="required: run"):
        ip.run_line_magic("gpu_stacks", "")
    with pytest.raises(UsageError, match="'ghost': not a run directory"):
        ip.run_line_magic("gpu_stacks", "ghost")
