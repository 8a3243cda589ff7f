"""The simulation, fenced: simulated GPU boxes served at the NVML and CUDA library seams.

This package's own module is only the switch, ``NBGPU_SIMULATE``, read the same way by
every process nbgpu starts (CLI, probe, torchrun's agent, ranks): surrounding whitespace
ignored, empty means unset. Standard library only: ranks import it first, and it loads
nothing of the simulation, which only the seams import (``tests/test_package.py`` lists
them): ``box`` (a box as data) · ``fleet`` (what ``NBGPU_SIMULATE`` names, as a box) ·
``nvml`` (the fake NVML library) · ``cuda`` (the fake CUDA driver, and nbgpu's ranks on a
simulated fleet).
"""

import socket
from collections.abc import Mapping

__all__ = ["SIMULATE_ENV", "simulated_node", "simulation_source"]

#: The environment variable that carries a fleet (spec, scenario name or JSON path).
SIMULATE_ENV = "NBGPU_SIMULATE"


def simulation_source(environ: Mapping[str, str]) -> str | None:
    """The fleet ``environ`` asks to simulate, or None for real hardware."""
    return environ.get(SIMULATE_ENV, "").strip() or None


def simulated_node(environ: Mapping[str, str]) -> str:
    """The node of a simulated cluster this process plays (a cluster file's key): SLURM's
    ``SLURMD_NODENAME`` (every task), else ``NBGPU_NODE`` (nbgpu's ranks), else the host name."""
    names = (environ.get(key, "").strip() for key in ("SLURMD_NODENAME", "NBGPU_NODE"))
    return next(filter(None, names), None) or socket.gethostname()
