import json

import pytest

import nbgpu.plan
from nbgpu.errors import UserInputError
from nbgpu.plan import Plan, plan_from_json

from .conftest import all_free


@pytest.fixture
def busy_gpu0_plan(inventory) -> Plan:
    return nbgpu.plan(
        "sglang.d1t1p1+d3t1p1",
        inventory=inventory("busy-gpu0"),
        global_batch=8,
        model="1.5B",
        port_is_free=all_free,
    )


def test_json_round_trip_is_exact_including_alternatives(busy_gpu0_plan):
    again = plan_from_json(busy_gpu0_plan.to_json())
    assert again == busy_gpu0_plan
    assert again.alternatives[0].plan == busy_gpu0_plan.alternatives[0].plan


def test_json_carries_what_a_launcher_reads(busy_gpu0_plan):
    data = json.loads(busy_gpu0_plan.alternatives[0].plan.to_json())
    assert data["nbgpu_plan"] == 1
    assert data["ok"] is True
    train = data["roles"][1]
    assert train["cuda_visible_devices"] == "2,3"
    assert train["nproc_per_node"] == 2
    assert train["master_port"] == 29501
    assert train["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert [g["uuid"][:4] for g in train["gpus"]] == ["GPU-", "GPU-"]


def test_plan_from_a_file_and_a_sweep_run(tmp_path, inventory):
    sweep = nbgpu.plan.sweep(
        runs=2, gpus_per_run=2, inventory=inventory("healthy"), port_is_free=all_free
    )
    path = tmp_path / "sweep.json"
    path.write_text(sweep.to_json())
    assert plan_from_json(path, run=1) == sweep.runs[1]
    assert plan_from_json(str(path), run="run0") == sweep.runs[0]
    with pytest.raises(UserInputError, match=r"is a sweep of 2 runs; pass run=0\.\.1"):
        plan_from_json(path)
    single = tmp_path / "plan.json"
    single.write_text(sweep.runs[0].to_json())
    assert plan_from_json(single) == sweep.runs[0]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("{not json", "not valid JSON"),
        ('{"nbgpu_plan": 7}', "nbgpu_plan = 7; expected 1"),
        ('{"nbgpu_plan": 1, "allocation": "d1"}', "has no 'roles'"),
    ],
)
def test_bad_plan_json_is_one_line(text, fragment):
    with pytest.raises(UserInputError, match=fragment):
        plan_from_json(text)


def test_bad_plan_field_names_its_path(busy_gpu0_plan):
    data = json.loads(busy_gpu0_plan.to_json())
    data["roles"][0]["data_parallel"] = "one"
    with pytest.raises(UserInputError, match=r"roles\[0\]\.data_parallel = 'one' is not"):
        plan_from_json(json.dumps(data))


def test_missing_plan_file():
    with pytest.raises(UserInputError, match=r"plan file 'nope\.json' does not exist"):
        plan_from_json("nope.json")


def test_text_fits_80_columns_and_labels_simulation(busy_gpu0_plan):
    text = busy_gpu0_plan.text()
    assert "SIMULATED fleet 'busy-gpu0'" in text
    assert "NOT READY" in text
    assert max(len(line) for line in text.splitlines()) <= 80
    ready = busy_gpu0_plan.alternatives[0].plan.text()
    assert "· ready" in ready
    assert max(len(line) for line in ready.splitlines()) <= 80


def test_html_and_frame(busy_gpu0_plan):
    html = busy_gpu0_plan.alternatives[0].plan._repr_mimebundle_()["text/html"]
    assert 'class="nbgpu-sim"' in html
    assert ">SIMULATED</span>" in html
    assert "GPU-" in html  # UUIDs are shown in the notebook
    frame = busy_gpu0_plan.alternatives[0].plan.to_frame()
    assert list(frame["nvml_index"]) == [1, 2, 3]
    assert list(frame["cuda_index"]) == [0, 0, 1]


def test_plan_files_that_say_verdict_still_load(busy_gpu0_plan):
    # Before 0.1 a left-out GPU's health was written as "verdict" (here and in alternatives).
    text = busy_gpu0_plan.to_json().replace('"health":', '"verdict":')
    assert '"verdict":' in text
    assert plan_from_json(text) == busy_gpu0_plan


def _older(data):
    """A plan file as 0.1 wrote it: issues without severity or subject, reasons and fixes."""
    if isinstance(data, list):
        return [_older(item) for item in data]
    if not isinstance(data, dict):
        return data
    out = {key: _older(value) for key, value in data.items()}
    if "nvml_index" in out and "problems" in out:
        problems = out.pop("problems")
        out["reasons"] = [p["message"] for p in problems]
        out["fixes"] = [fix for p in problems for fix in p["fixes"]]
    if "severity" in out and "code" in out:
        out = {key: out[key] for key in ("code", "message", "fixes")}
    return out


def test_plan_files_with_issues_and_reasons_still_load(busy_gpu0_plan):
    old = json.dumps(_older(json.loads(busy_gpu0_plan.to_json())))
    assert '"reasons":' in old
    assert '"severity":' not in old
    again = plan_from_json(old)
    assert [(p.code, p.message, p.fixes) for p in again.problems] == [
        (p.code, p.message, p.fixes) for p in busy_gpu0_plan.problems
    ]
    assert {p.severity for p in again.problems} == {"bad"}
    assert again.excluded[0].problems[0].message == busy_gpu0_plan.excluded[0].problems[0].message
    assert again.excluded[0].fixes == busy_gpu0_plan.excluded[0].fixes
    assert again.roles == busy_gpu0_plan.roles


@pytest.mark.parametrize("where", ["one box", "nodes"])
def test_the_footer_says_a_batch_that_runs_and_leaves_a_refused_one_to_its_problem(where):
    def make(batch):
        if where == "nodes":
            return nbgpu.plan.nodes("2x(4)", global_batch=batch)
        return nbgpu.plan(inventory="4xA40", global_batch=batch, port_is_free=all_free)

    ok, refused = make(8), make(7)
    assert ok.ok
    assert "batch: global batch 8 = " in ok.text()
    assert [p.code for p in refused.problems] == ["batch"]
    assert "batch:" not in refused.text()
    assert "memory: not checked" in refused.text()
