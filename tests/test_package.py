"""Package-wide rules: the public surface, the import layers, cheap loading."""

import ast
import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import nbgpu

PACKAGE = Path(nbgpu.__file__).parent
HEAVY = ("torch", "pynvml", "pandas", "matplotlib", "ipywidgets")


def test_all_is_complete_and_resolvable():
    for name in nbgpu.__all__:
        assert getattr(nbgpu, name) is not None, name
    # Every public callable reachable from the package is listed in __all__.
    public = {
        n
        for n in dir(nbgpu)
        if not n.startswith("_")
        and callable(getattr(nbgpu, n))
        and getattr(getattr(nbgpu, n), "__module__", "").startswith("nbgpu")
    }
    assert public <= set(nbgpu.__all__), public - set(nbgpu.__all__)


def test_unknown_attribute_is_a_clear_error():
    with pytest.raises(AttributeError, match="not_a_thing"):
        nbgpu.not_a_thing  # noqa: B018


def test_every_module_declares_a_true_all():
    for name in (i.name for i in pkgutil.walk_packages([str(PACKAGE)], prefix="nbgpu.")):
        if name.endswith("__main__"):
            continue
        module = importlib.import_module(name)
        exported = getattr(module, "__all__", None)
        assert exported is not None, f"{name} has no __all__"
        for item in exported:
            assert hasattr(module, item), f"{name}.__all__ lists missing {item}"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_only_nvml_module_imports_pynvml():
    importers = sorted(
        str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if "pynvml" in _imports(p)
    )
    assert importers == ["devices/nvml.py"]


def test_layers_below_the_faces_never_import_ipython_widgets_or_matplotlib():
    faces = {"notebook"}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in faces:
            continue
        bad = _imports(path) & {"IPython", "ipywidgets", "matplotlib"}
        if str(rel) == "profile/figure.py":
            # The one drawing module below the faces: matplotlib inside draw() only.
            top = ast.parse(path.read_text()).body
            assert not any(
                isinstance(n, ast.Import | ast.ImportFrom) and "matplotlib" in ast.dump(n)
                for n in top
            )
            bad -= {"matplotlib"}
        assert not bad, f"{rel} imports {bad}"


def test_load_ext_imports_nothing_heavy_and_unload_is_symmetric():
    script = f"""
import json, sys
from IPython.core.interactiveshell import InteractiveShell
ip = InteractiveShell.instance()
before = set(ip.magics_manager.magics["line"])
cells_before = set(ip.magics_manager.magics["cell"])
ip.run_line_magic("load_ext", "nbgpu")
added = sorted(set(ip.magics_manager.magics["line"]) - before)
added_cells = sorted(set(ip.magics_manager.magics["cell"]) - cells_before)
heavy = [m for m in {HEAVY!r} if m in sys.modules]
ip.run_line_magic("unload_ext", "nbgpu")
after = set(ip.magics_manager.magics["line"]) | set(ip.magics_manager.magics["cell"])
ip.run_line_magic("load_ext", "nbgpu")
again = sorted(set(ip.magics_manager.magics["line"]) - before)
print(json.dumps({{"added": added, "heavy": heavy, "cells": added_cells, "left": sorted(after - before - cells_before), "again": again}}))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["added"] == [
        "gpu_clean", "gpu_debug", "gpu_diagnose", "gpu_doctor", "gpu_memory", "gpu_plan", "gpu_runs", "gpu_stacks",
        "gpu_status", "gpu_stop", "gpu_watch", "torchrun",
    ]  # fmt: skip
    assert result["cells"] == ["gpu_phase", "torchrun"]
    assert result["heavy"] == []
    assert result["left"] == []
    assert result["again"] == result["added"]


def test_planning_results_load_no_yaml_or_shell_parser():
    # The faces of plan/, estimate/ and scale/ re-export from light modules: a result type
    # (what launch, the notebook and plan files need) comes without ruamel.yaml, the
    # launch-script lexer, torch or the inventory.
    script = (
        "import json, sys\n"
        "from nbgpu.plan.result import Plan\n"
        "from nbgpu.plan import NodesPlan, SweepPlan\n"
        "from nbgpu.scale import ScalePlan\n"
        "from nbgpu.estimate import MemoryEstimate\n"
        "light = ('ruamel', 'torch', 'pynvml', 'psutil', 'pandas')\n"
        "parsers = ('nbgpu.scale.script', 'nbgpu.scale.yamldoc', 'nbgpu.devices.inventory')\n"
        "print(json.dumps(sorted(m for m in sys.modules\n"
        "                        if m.split('.')[0] in light or m in parsers)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert json.loads(out.stdout) == []


def test_status_loads_no_launch_plan_or_profile_layer():
    # `nbgpu status` is timed against nvitop (bench/RESULTS.md section 2): the CLI builds
    # only the chosen command's arguments, so the other commands' layers stay unloaded.
    script = (
        "import contextlib, io, json, sys\n"
        "from nbgpu.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['status', '--json'])\n"
        "layers = ('nbgpu.launch', 'nbgpu.plan', 'nbgpu.profile', 'nbgpu.plan_cli')\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(layers))))"
    )
    env = {**os.environ, "NBGPU_SIMULATE": "2xA40"}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env,
        timeout=60,
    )  # fmt: skip
    assert json.loads(out.stdout) == []


def test_python_dash_m_runs_the_cli():
    out = subprocess.run(
        [sys.executable, "-m", "nbgpu", "-h"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0
    assert "status" in out.stdout
    assert "doctor" in out.stdout


def _nbgpu_imports(path: Path) -> set[str]:
    """Every nbgpu module a file imports, at any depth (lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("nbgpu"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nbgpu"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


# Layer -> the nbgpu packages it must never import (DESIGN.md: one-way arrows).
FORBIDDEN = {
    "devices": ("nbgpu.launch", "nbgpu.plan", "nbgpu.diagnose", "nbgpu.notebook", "nbgpu.cli",
                "nbgpu.api", "nbgpu.rank", "nbgpu.profile"),
    # plan/, estimate/ and scale/ are pure: devices/ and the top-level helpers only;
    # plan uses estimate and scale, scale uses estimate, estimate neither.
    "plan": ("nbgpu.launch", "nbgpu.diagnose", "nbgpu.notebook", "nbgpu.cli", "nbgpu.api",
             "nbgpu.rank", "nbgpu.profile", "nbgpu.plan_cli"),
    "estimate": ("nbgpu.plan", "nbgpu.scale", "nbgpu.launch", "nbgpu.diagnose",
                 "nbgpu.notebook", "nbgpu.cli", "nbgpu.api", "nbgpu.rank", "nbgpu.profile"),
    "scale": ("nbgpu.plan", "nbgpu.launch", "nbgpu.diagnose", "nbgpu.notebook", "nbgpu.cli",
              "nbgpu.api", "nbgpu.rank", "nbgpu.profile"),
    # diagnose may read nbgpu.profile's records (memory at the failure), nothing else of it.
    "diagnose": ("nbgpu.launch", "nbgpu.plan", "nbgpu.notebook", "nbgpu.cli", "nbgpu.api",
                 "nbgpu.profile.phases", "nbgpu.profile.recorder",
                 "nbgpu.profile.live", "nbgpu.profile.figure"),
    # launch watches the ranks from the kernel; what runs inside them is rank/'s alone.
    "launch": ("nbgpu.plan", "nbgpu.notebook", "nbgpu.cli", "nbgpu.api", "nbgpu.rank"),
    # rank/ runs inside child processes: it never imports the kernel's side of a run.
    "rank": ("nbgpu.launch", "nbgpu.plan", "nbgpu.estimate", "nbgpu.scale", "nbgpu.diagnose",
             "nbgpu.notebook", "nbgpu.cli", "nbgpu.api"),
    # profile records inside ranks and reports runs; it knows neither launching nor faces.
    "profile": ("nbgpu.launch", "nbgpu.plan", "nbgpu.diagnose", "nbgpu.notebook", "nbgpu.cli",
                "nbgpu.api", "nbgpu.rank"),
}  # fmt: skip
# Estimation and rescaling are planning too: no layer below the faces imports them.
for _layer in ("devices", "diagnose", "launch", "profile"):
    FORBIDDEN[_layer] += ("nbgpu.estimate", "nbgpu.scale")


def test_layers_import_one_way():
    for layer, banned in FORBIDDEN.items():
        for path in (PACKAGE / layer).rglob("*.py"):
            bad = {m for m in _nbgpu_imports(path) if m.startswith(banned)}
            assert not bad, f"{path.relative_to(PACKAGE)} imports {sorted(bad)}"
    worker_profile = {m for m in _nbgpu_imports(PACKAGE / "rank" / "worker.py") if "profile" in m}
    # Ranks record through the light modules only (standard library at import time).
    assert worker_profile <= {"nbgpu.profile.phases", "nbgpu.profile.phases.configure",
                              "nbgpu.profile.recorder", "nbgpu.profile.recorder.Recorder"}  # fmt: skip


# Modules every process imports early (ranks, the probe's child, torchrun's agent): the
# standard library and nothing else, not even the rest of nbgpu.
STDLIB_ONLY = (
    "_backends.py",
    "_children.py",
    "devices/sim/__init__.py",
    "devices/cuda_errors.py",
    "launch/streams.py",
)


def test_a_slurm_node_loads_only_the_standard_library_until_it_becomes_the_agent():
    # rank/slurm_node.py finds the rendezvous with the standard library, then runs the
    # agent (and torch, imported by a thread meanwhile) in the same process: inside its
    # functions only.
    tree = ast.parse((PACKAGE / "rank/slurm_node.py").read_text())
    top = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    top |= {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
    assert top <= sys.stdlib_module_names, sorted(top - sys.stdlib_module_names)


# What a rank runs before the user's code (cold and warm): no third-party import, and of
# nbgpu only the recording side of profile/ and rank/ itself.
RANK_SIDE = ("rank/worker.py", "rank/usercode.py")
RANK_SIDE_NBGPU = (
    "nbgpu._children",
    "nbgpu.profile.phases",
    "nbgpu.profile.recorder",
    "nbgpu.rank",
)


def test_rank_side_modules_stay_light():
    for rel in RANK_SIDE:
        path = PACKAGE / rel
        third_party = {
            m for m in _imports(path) if m not in sys.stdlib_module_names and m != "nbgpu"
        }
        assert not third_party, f"{rel} imports {sorted(third_party)}"
        heavy = {m for m in _nbgpu_imports(path) if not m.startswith(RANK_SIDE_NBGPU)}
        assert not heavy, f"{rel} imports {sorted(heavy)}"


def test_a_cold_rank_starts_without_the_helpers_it_may_never_call():
    # Each rank imports its worker before the user's first line: the job helpers
    # (nbgpu.rank.init and the rest), the warm loop's names and subsets load when used.
    code = (
        "import sys, nbgpu.rank.worker\n"
        "print(sorted(m for m in sys.modules if m.startswith('nbgpu')))\n"
        "import nbgpu.rank as nr\n"
        "print('init' in dir(nr), nr.is_main(), nr.init.__module__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent
    ).stdout.splitlines()
    loaded = set(ast.literal_eval(out[0]))
    assert not loaded & {"nbgpu.rank.job", "nbgpu.rank.held", "nbgpu.rank.subset"}, loaded
    assert out[1] == "True True nbgpu.rank.job"


def test_process_level_helpers_import_the_standard_library_only():
    for rel in STDLIB_ONLY:
        path = PACKAGE / rel
        third_party = {m for m in _imports(path) if m not in sys.stdlib_module_names}
        assert not third_party, f"{rel} imports {sorted(third_party)}"


def test_the_cuda_driver_and_its_simulation_do_not_import_each_other():
    driver = _nbgpu_imports(PACKAGE / "devices" / "cuda_driver.py")
    simulation = _nbgpu_imports(PACKAGE / "devices" / "sim" / "cuda.py")
    assert not {m for m in driver if m.startswith("nbgpu.devices.sim")}
    assert not {m for m in simulation if m.startswith("nbgpu.devices.cuda_driver")}


# The simulation is fenced in devices/sim/: outside it, only these seams import its modules,
# and only inside the function a simulation calls (never at module top). The package's own
# module, nbgpu.devices.sim, is the switch (NBGPU_SIMULATE, standard library only): anyone
# may read it.
SIM_SEAMS = {
    "devices/nvml.py": "the fake NVML library, when NBGPU_SIMULATE names a fleet",
    "devices/health.py": "the fake CUDA driver, in the probe's child",
    "rank/job.py": "what CUDA answers a simulated rank",
}


def test_the_simulation_is_imported_only_at_its_seams():
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    for name, path in paths.items():
        rel = str(path.relative_to(PACKAGE))
        if name.startswith("nbgpu.devices.sim"):
            continue
        sim = {
            m
            for m in _nbgpu_modules_imported(path, set(paths))
            if m.startswith("nbgpu.devices.sim.")
        }
        if not sim:
            continue
        assert rel in SIM_SEAMS, (
            f"{rel} imports {sorted(sim)}; only the seams may ({sorted(SIM_SEAMS)})"
        )
        top = [
            n
            for n in ast.parse(path.read_text()).body
            if isinstance(n, ast.Import | ast.ImportFrom)
        ]
        assert not [ast.unparse(n) for n in top if "nbgpu.devices.sim." in ast.unparse(n)], rel


def test_a_real_rank_never_loads_the_simulation():
    # nbgpu.rank reaches the simulated path through one lazy import, only under
    # NBGPU_SIMULATE; importing it (and asking for the device on CPU) loads none of it.
    script = (
        "import sys, nbgpu.rank\n"
        "sim = ('sim.fleet', 'sim.nvml', 'sim.cuda', 'sim.ranks', 'cuda_driver', 'nvml')\n"
        "print(sorted(m for m in sim if 'nbgpu.devices.' + m in sys.modules))"
    )
    env = {k: v for k, v in os.environ.items() if k != "NBGPU_SIMULATE"}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60,
        env=env,
    )  # fmt: skip
    assert out.stdout.strip() == "[]"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _nbgpu_modules_imported(path: Path, modules: set[str]) -> set[str]:
    """The nbgpu modules *path* imports: every import, lazy and ``TYPE_CHECKING`` ones too
    (an annotation that needs the other module is a real knot)."""
    found = set()
    for imported in _nbgpu_imports(path):
        module = imported
        while module and module not in modules:  # `from pkg import x`: x may be a module
            module = module.rpartition(".")[0]
        if module:
            found.add(module)
    return found


def test_the_import_graph_has_no_circles():
    # A circle means two modules that cannot be understood (or split) one without the
    # other. A package's own __init__ is not counted as a dependency of its modules.
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {
        name: {
            d
            for d in _nbgpu_modules_imported(path, set(paths))
            if d != name and not name.startswith(d + ".")
        }
        for name, path in paths.items()
    }
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            pytest.fail("import circle: " + " -> ".join([*trail[trail.index(name) :], name]))
        if name in done:
            return
        for dep in sorted(graph.get(name, ())):
            visit(dep, [*trail, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_the_kernel_and_its_ranks_use_the_same_words():
    # rank/ never imports launch/ (nor the reverse): each side names what crosses the
    # process boundary itself, and this ties the two names together.
    from nbgpu.launch.config import NODE_GPUS_ENV  # noqa: PLC0415
    from nbgpu.launch.outcomes import FR_REQUEST  # noqa: PLC0415
    from nbgpu.launch.procs import STACKS_SIGNAL  # noqa: PLC0415
    from nbgpu.rank import slurm_node, worker  # noqa: PLC0415

    assert worker._STACKS_SIGNAL == STACKS_SIGNAL
    assert worker.FR_REQUEST == FR_REQUEST
    assert slurm_node._NODE_GPUS_ENV == NODE_GPUS_ENV


# Data, not logic: long by nature (the failure catalog; the built-in model shapes).
DATA_TABLES = ("diagnose/catalog.py", "estimate/shapes.py")
MODULE_LINES = 450


def test_no_module_outgrows_one_reading():
    # A module a reader cannot hold in mind at once holds two ideas: split it by them.
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MODULE_LINES
        and str(path.relative_to(PACKAGE)) not in DATA_TABLES
    }
    assert not long, f"modules over {MODULE_LINES} lines: {long}"


def _is_data(node: ast.AST) -> bool:
    """A literal laid out as rows: constants, names of constants, and containers,
    constructor rows or unions of those; never a comprehension, lambda or f-string."""
    if isinstance(node, ast.Constant | ast.Name | ast.Attribute):
        return True
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return all(_is_data(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(k is None or _is_data(k) for k in node.keys) and all(
            _is_data(v) for v in node.values
        )
    if isinstance(node, ast.Call):
        return all(_is_data(a) for a in node.args) and all(_is_data(k.value) for k in node.keywords)
    if isinstance(node, ast.BinOp | ast.UnaryOp):
        return all(_is_data(c) for c in ast.iter_child_nodes(node) if isinstance(c, ast.expr))
    return False


def test_hand_layout_is_kept_for_data_tables():
    # `ruff format` lays out the code; `# fmt: skip` may keep a table of constants in rows
    # (an __all__, a colour list), never pack statements or calls onto fewer lines.
    packed = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        name = str(path.relative_to(PACKAGE))
        if "# fmt: off" in text and name not in DATA_TABLES:
            packed.append(f"{name}: # fmt: off outside the data tables")
        if "# fmt: skip" not in text:
            continue
        tree = ast.parse(text)
        # Data tables live at module or class level, as assignments.
        tables = {
            node.end_lineno
            for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef))]
            for node in scope.body
            if isinstance(node, ast.Assign | ast.AnnAssign)
            and node.value is not None
            and _is_data(node.value)
        }
        for number, line in enumerate(text.splitlines(), 1):
            if line.rstrip().endswith("# fmt: skip") and number not in tables:
                packed.append(f"{name}:{number}: {line.strip()[:60]}")
    assert not packed, "hand layout on code, not on a data table:\n" + "\n".join(packed)
