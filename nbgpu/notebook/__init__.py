"""The notebook face: magics and widgets, the only layer that imports IPython (and loading
imports IPython's magic machinery only).
"""

from typing import Any

__all__ = ["load_ipython_extension", "magics_classes", "unload_ipython_extension"]


def magics_classes() -> tuple[type[Any], ...]:
    from nbgpu.notebook.launch_magics import LaunchMagics  # noqa: PLC0415
    from nbgpu.notebook.magics import GPUMagics  # noqa: PLC0415
    from nbgpu.notebook.watch import WatchMagics  # noqa: PLC0415

    return (GPUMagics, LaunchMagics, WatchMagics)


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nbgpu``: register the magics."""
    from nbgpu.notebook.launch_magics import keep_empty_cell_body, torchrun_matcher  # noqa: PLC0415

    ipython.register_magics(*magics_classes())
    matchers = getattr(getattr(ipython, "Completer", None), "custom_matchers", None)
    if matchers is not None and torchrun_matcher not in matchers:
        matchers.append(torchrun_matcher)  # --on and --pull complete from the warm jobs
    # `%%torchrun ARGS` with an empty body must reach the magic (see the transformer).
    cleanup = getattr(ipython, "input_transformers_cleanup", None)
    if cleanup is not None and keep_empty_cell_body not in cleanup:
        cleanup.append(keep_empty_cell_body)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext nbgpu``: remove exactly the magics the classes declare (``cls.magics``, from
    ``magics_class``; IPython has no public unregister), so a new magic needs no second list."""
    from nbgpu.notebook.launch_magics import keep_empty_cell_body, torchrun_matcher  # noqa: PLC0415

    manager = ipython.magics_manager
    for cls in magics_classes():
        for kind, names in cls.magics.items():
            for name in names:
                manager.magics[kind].pop(name, None)
        manager.registry.pop(cls.__name__, None)
    cleanup = getattr(ipython, "input_transformers_cleanup", [])
    cleanup[:] = [step for step in cleanup if step is not keep_empty_cell_body]
    matchers = getattr(getattr(ipython, "Completer", None), "custom_matchers", [])
    matchers[:] = [matcher for matcher in matchers if matcher is not torchrun_matcher]
