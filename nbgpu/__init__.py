"""nbgpu: probe, plan, launch and debug multi-GPU training from a Jupyter notebook.

    %load_ext nbgpu          # %gpu_status, %gpu_doctor, %gpu_clean, %%torchrun, ...
    import nbgpu; nbgpu.status(); nbgpu.doctor(); nbgpu.torchrun(code, 2)

Importing this package is cheap: the API below is resolved lazily (PEP 562), so
``%load_ext nbgpu`` imports none of torch, pynvml, pandas, matplotlib or ipywidgets.
"""

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0.dev0"

__all__ = ["__version__", "clean", "diagnose", "doctor", "errors", "estimate",
           "load_ipython_extension", "memory", "phase", "plan", "runs", "simulate", "status",
           "torchrun", "unload_ipython_extension"]  # fmt: skip

# name -> module that defines it; imported on first attribute access.
_LAZY = {
    **dict.fromkeys(("status", "doctor", "clean", "memory", "simulate"), "nbgpu.api"),
    "phase": "nbgpu.profile.phases",  # nbgpu.phase("model"), nbgpu.phase.mark("POST-MODEL")
    "torchrun": "nbgpu.launch.launcher",
    "runs": "nbgpu.launch.execute",
    "plan": "nbgpu.plan",  # a callable module: nbgpu.plan(...), nbgpu.plan.sweep(...)
    "diagnose": "nbgpu.diagnose",  # a callable module: nbgpu.diagnose(run_or_path)
    "estimate": "nbgpu.estimate",  # nbgpu.estimate(...), nbgpu.estimate.compare(...)
    # %load_ext / %unload_ext nbgpu: nbgpu.notebook imports IPython's magic machinery only.
    **dict.fromkeys(("load_ipython_extension", "unload_ipython_extension"), "nbgpu.notebook"),
}

if TYPE_CHECKING:
    from nbgpu import diagnose, errors, estimate, plan
    from nbgpu.api import clean, doctor, memory, simulate, status
    from nbgpu.launch.execute import runs
    from nbgpu.launch.launcher import torchrun
    from nbgpu.notebook import load_ipython_extension, unload_ipython_extension
    from nbgpu.profile.phases import phase
else:
    from nbgpu import errors  # light: the exception tree only


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nbgpu' has no attribute {name!r}")
    imported = importlib.import_module(module)
    value = imported if module == f"nbgpu.{name}" else getattr(imported, name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
