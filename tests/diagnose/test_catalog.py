"""The catalog as data: ids, patterns, fixes that name nbgpu calls, layering of the package."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import nbgpu.diagnose
from nbgpu.diagnose import CATALOG, CAUSE_IDS, UNKNOWN, cause
from nbgpu.diagnose.catalog import SECONDARY, TRIGGERS
from tests.runtime_imports import runtime_imports

REQUIRED = {
    "backend_unavailable",
    "cuda_busy",
    "invalid_ordinal",
    "cuda_oom",
    "host_oom",
    "nccl_timeout",
    "nccl_error",
    "port_in_use",
    "rendezvous",
    "batch_divisibility",
    "cuda_init_fork",
    "driver",
    "device_assert",
    "illegal_access",
    "segfault",
    "gpu_lost",
    "collective_mismatch",
    "cpu_torch",
    "missing_module",
    "agent_hangup",
    "exit_barrier",
    "ray_oom",
    "unknown",
}
PACKAGE = Path(nbgpu.diagnose.__file__).parent
# A fix names an nbgpu call or flag: a magic, the CLI, the API or a launcher flag.
NBGPU_FIX = re.compile(r"%%?\w+|`nbgpu[ .]\w+|--[a-z][\w-]+")


def test_required_cause_ids() -> None:
    assert set(CAUSE_IDS) == REQUIRED
    assert len(set(CAUSE_IDS)) == len(CAUSE_IDS)
    assert cause("unknown") is UNKNOWN


def test_every_cause_is_complete() -> None:
    for c in CATALOG:
        assert c.title, c.id
        assert c.explanation.endswith("."), c.id
        assert len(c.patterns) >= 2, c.id
        assert c.keywords, c.id
        assert all(k == k.lower() for k in c.keywords), c.id
        assert any(NBGPU_FIX.search(f) for f in c.fixes), c.id
        assert len({p.name for p in c.patterns}) == len(c.patterns), c.id
        for p in c.patterns:
            assert 0 < p.confidence < 1, (c.id, p.name)
    assert all(p.consequence for p in SECONDARY)
    assert all(isinstance(t, bytes) and len(t) >= 3 for t in TRIGGERS)


def test_fixes_name_the_flags_of_the_issue() -> None:
    text = json.dumps([c.fixes for c in CATALOG])
    for needle in (
        "%gpu_doctor",
        "nbgpu clean",
        "%%torchrun --gpus 1,2,3",
        "--serial-imports",
        "--mem-limit 60G",
        "--master-port",
        "%gpu_plan",
    ):
        assert needle in text, needle


def test_layer_rule_no_ipython_torch_pynvml_psutil() -> None:
    banned = ("IPython", "torch", "pynvml", "psutil", "ipywidgets", "matplotlib", "pandas")
    for path in PACKAGE.glob("*.py"):
        for name in runtime_imports(path):
            assert not name.startswith(banned), f"{path.name} imports {name}"
            if name.startswith("nbgpu.devices"):
                assert name.startswith("nbgpu.devices.visible"), f"{path.name} imports {name}"


def test_importing_and_running_loads_nothing_heavy() -> None:
    script = (
        "import sys, nbgpu.diagnose as d\n"
        "d('RuntimeError: CUDA error: out of memory')\n"
        "print(sorted(m for m in ('torch', 'pynvml', 'psutil', 'IPython', 'pandas') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"


def test_every_module_has_a_docstring_and_all() -> None:
    for path in PACKAGE.glob("*.py"):
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree), path.name
        assert any(
            isinstance(n, ast.AnnAssign | ast.Assign) and "__all__" in ast.unparse(n)
            for n in tree.body
        ), path.name
