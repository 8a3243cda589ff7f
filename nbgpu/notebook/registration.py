"""``%load_ext nbgpu`` / ``%unload_ext nbgpu``: register and remove the magics.

The magics are whatever the Magics classes below declare (IPython's ``magics_class``
records each class's line and cell magics in ``cls.magics``): unloading removes
exactly those names, so a magic added to a class needs no second list here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["magics_classes", "register", "unregister"]


def magics_classes() -> tuple[type[Any], ...]:
    """nbgpu's Magics classes (importing them imports IPython's magic machinery only)."""
    from nbgpu.notebook.launch_magics import LaunchMagics  # noqa: PLC0415
    from nbgpu.notebook.magics import GPUMagics  # noqa: PLC0415
    from nbgpu.notebook.memory_magics import MemoryMagics  # noqa: PLC0415
    from nbgpu.notebook.watch import WatchMagics  # noqa: PLC0415

    return (GPUMagics, LaunchMagics, MemoryMagics, WatchMagics)


def register(ipython: Any) -> None:
    for cls in magics_classes():
        ipython.register_magics(cls)


def unregister(ipython: Any) -> None:
    # IPython has no public unregister; remove exactly the names the classes declare.
    from nbgpu.notebook.launch_magics import keep_empty_cell_body  # noqa: PLC0415

    manager = ipython.magics_manager
    for cls in magics_classes():
        for kind, names in cls.magics.items():
            for name in names:
                manager.magics[kind].pop(name, None)
        manager.registry.pop(cls.__name__, None)
    cleanup = getattr(ipython, "input_transformers_cleanup", [])
    while keep_empty_cell_body in cleanup:
        cleanup.remove(keep_empty_cell_body)
