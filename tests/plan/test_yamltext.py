import pytest

from nbgpu.plan.yamltext import dump_yaml, format_scalar


def test_configs_render_as_plain_readable_yaml():
    data = {
        "CUDA_VISIBLE_DEVICES": "0,1",
        "data": {"train_batch_size": 2, "files": ["a.parquet", "b.parquet"]},
        "rollout": {"n": 1, "gpu_memory_utilization": 0.34, "lr": 1e-06, "name": None},
        "logger": [{"name": "console", "on": True}],
        "empty": {},
    }
    assert dump_yaml(data) == (
        'CUDA_VISIBLE_DEVICES: "0,1"\n'
        "data:\n"
        "  train_batch_size: 2\n"
        "  files: [a.parquet, b.parquet]\n"
        "rollout:\n"
        "  n: 1\n"
        "  gpu_memory_utilization: 0.34\n"
        "  lr: 1.0e-06\n"
        "  name: null\n"
        "logger:\n"
        "  - name: console\n"
        '    "on": true\n'
        "empty: {}\n"
    )


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("yes", '"yes"'),
        ("12", '"12"'),
        ("1.5", '"1.5"'),
        ("${oc.env:HOME}", '"${oc.env:HOME}"'),
        ("Qwen/Qwen2.5-VL-3B-Instruct", "Qwen/Qwen2.5-VL-3B-Instruct"),
        ("with space", '"with space"'),
        (float("inf"), ".inf"),
        (1e20, "1.0e+20"),
        (False, "false"),
    ],
)
def test_scalars_read_back_as_themselves(value, text):
    assert format_scalar(value) == text


def test_round_trip_through_pyyaml_when_installed():
    yaml = pytest.importorskip("yaml")
    data = {"a": {"b": [0, 1, 2], "c": "0,1", "d": 1e-06, "e": "no", "f": [{"g": 1}]}}
    assert yaml.safe_load(dump_yaml(data)) == data
