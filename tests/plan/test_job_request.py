"""The job keywords are declared once (JobRequest) and every entry point takes them."""

import inspect
from dataclasses import fields

import pytest

import nbgpu
from nbgpu.cli import main
from nbgpu.errors import UserInputError
from nbgpu.plan.job import JobRequest


def test_plan_and_sweep_show_every_job_keyword_in_their_signatures():
    declared = {f.name for f in fields(JobRequest)}
    assert declared - {"allocation"} <= set(inspect.signature(nbgpu.plan.plan).parameters)
    sweep = set(inspect.signature(nbgpu.plan.sweep).parameters)
    assert declared - {"num_gpus", "require"} <= sweep
    assert not {"num_gpus", "require"} & sweep


def test_an_unknown_keyword_is_one_line_naming_the_accepted_ones():
    with pytest.raises(UserInputError, match=r"^nbgpu\.plan\(\): globl_batch= is not a keyword"):
        nbgpu.plan(inventory="4xA40", globl_batch=8)
    with pytest.raises(UserInputError, match=r"sweep\(\): require= is not a keyword it takes"):
        nbgpu.plan.sweep(2, inventory="4xA40", require=[0])


def test_the_request_is_checked_once_whichever_face_sent_it():
    # The same bad value, through the Python API and the CLI's parser, gives the same line.
    with pytest.raises(UserInputError, match=r"^micro_batch=0: expected a whole number >= 1"):
        nbgpu.plan(inventory="4xA40", micro_batch=0)
    assert main(["plan", "--fleet", "4xA40", "--micro", "0"]) == 2


@pytest.mark.parametrize(
    ("value", "line"),
    [
        ("many", "max_micro_batch='many': expected a whole number >= 1 or 'auto'"),
        ("0", "max_micro_batch=0: expected a whole number >= 1"),
    ],
)
def test_max_micro_is_read_by_the_request_for_the_cli_as_for_the_api(capsys, value, line):
    with pytest.raises(UserInputError) as caught:
        nbgpu.plan(inventory="4xA40", max_micro_batch=value)
    assert str(caught.value) == line
    assert main(["plan", "--fleet", "4xA40", "--max-micro", value]) == 2
    assert capsys.readouterr().err == f"nbgpu: error: {line}\n"
    assert main(["plan", "--fleet", "4xA40", "--max-micro", "3", "--batch", "12"]) == 0
    assert "micro 3 × accum 1" in capsys.readouterr().out
