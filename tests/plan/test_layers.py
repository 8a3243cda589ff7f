"""plan/, estimate/ and scale/ are pure: what each module may import, what it says of itself."""

import ast
import importlib
import inspect
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import nbgpu.estimate
import nbgpu.plan
import nbgpu.scale

PACKAGES = ("nbgpu.plan", "nbgpu.estimate", "nbgpu.scale")
MODULES = sorted(
    [*PACKAGES]
    + [
        m.name
        for package in PACKAGES
        for m in pkgutil.walk_packages(
            [str(Path(importlib.import_module(package).__file__).parent)], prefix=f"{package}."
        )
    ]
)
NEVER = {"IPython", "ipywidgets", "matplotlib", "pynvml", "psutil", "subprocess", "torch"}


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module.split(".")[0])
    return found


def _path(module: str) -> Path:
    return Path(importlib.import_module(module).__file__)


# trace.py runs a fake-tensor step and a real CPU one: the module that imports torch.
# Others import it inside the function that needs it only (tested below).
TORCH = ("nbgpu.estimate.trace",)
ALLOWED = {module: {"torch"} for module in TORCH}


def test_no_plan_module_imports_processes_hardware_or_notebook_code():
    for module in MODULES:
        bad = _imports(_path(module)) & (NEVER - ALLOWED.get(module, set()))
        assert not bad, f"{module} imports {bad}"


def test_trace_is_imported_lazily_only():
    for module in MODULES:
        if module in TORCH:
            continue
        tree = ast.parse(_path(module).read_text())
        top = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module]
        assert all(n.module not in TORCH for n in top), module


def test_only_ports_binds_sockets_and_only_files_reads_files():
    for module in MODULES:
        source = _path(module).read_text()
        if "socket" in _imports(_path(module)):
            assert module == "nbgpu.plan.placement", module
        # shapes.py reads the one HF config.json a user names (read_hf_config).
        if module not in ("nbgpu.scale.files", "nbgpu.estimate.shapes"):
            assert ".read_text(" not in source, module
            assert "open(" not in source, module


def test_every_module_says_what_it_owns_and_must_never_import():
    for module in MODULES:
        doc = importlib.import_module(module).__doc__ or ""
        assert len(doc.splitlines()) >= 3, module
        assert "never" in doc.lower(), f"{module}'s docstring does not say what it never imports"


def test_all_lists_every_public_definition():
    for module in MODULES:
        mod = importlib.import_module(module)
        public = {
            name
            for name, obj in vars(mod).items()
            if not name.startswith("_")
            and (inspect.isfunction(obj) or inspect.isclass(obj))
            and obj.__module__ == module
        }
        assert public <= set(mod.__all__), f"{module}: {public - set(mod.__all__)}"


def test_the_packages_themselves_are_callable():
    assert type(nbgpu.plan).__name__ == "_CallablePlanModule"
    assert inspect.signature(type(nbgpu.plan).__call__) == inspect.signature(nbgpu.plan.plan)
    call = type(nbgpu.estimate).__call__
    assert inspect.signature(call) == inspect.signature(nbgpu.estimate.estimate_memory)


def test_importing_plan_stays_light():
    script = (
        "import json, sys, nbgpu.plan, nbgpu.estimate; "
        "print(json.dumps([m for m in ('torch', 'pynvml', 'psutil', 'pandas', 'IPython') "
        "if m in sys.modules]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert json.loads(out.stdout) == []
