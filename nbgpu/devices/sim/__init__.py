"""The simulation, fenced: simulated GPU boxes served at the NVML and CUDA library seams.

This package's own module is only the switch, ``NBGPU_SIMULATE``, and its one reading.
Every process nbgpu starts (the CLI, the probe, torchrun's agent, each rank) learns
whether it runs on a simulated fleet from this variable, so it is read the same way
everywhere: surrounding whitespace is ignored and an empty value counts as unset.
Standard library only: ranks import it before anything else of nbgpu, and importing it
loads nothing of the simulation.

The simulation itself, imported only at the seams (``devices/nvml.py``, the probe's
child, ``nbgpu.rank``'s device helper; ``tests/test_package.py`` holds the list):
``fleet`` (a box as data, the GPU models, the named fleets in ``fleets/``, and what
``NBGPU_SIMULATE`` names, resolved to a fleet) · ``nvml`` (the fake NVML library, which
also lists nbgpu's ranks as the GPUs' processes) · ``cuda`` (the fake CUDA driver, and
what it answers a simulated rank).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

__all__ = ["SIMULATE_ENV", "simulated_node", "simulation_source"]

#: The environment variable that carries a fleet (spec, scenario name or JSON path).
SIMULATE_ENV = "NBGPU_SIMULATE"


def simulation_source(environ: Mapping[str, str]) -> str | None:
    """The fleet ``environ`` asks to simulate, or None for real hardware."""
    return environ.get(SIMULATE_ENV, "").strip() or None


def simulated_node(environ: Mapping[str, str]) -> str:
    """Which node of a simulated cluster this process plays (a cluster fleet file's key).

    On a SLURM node it is the node's SLURM name (``SLURMD_NODENAME``, set for every task);
    a rank started by nbgpu on a node also has ``NBGPU_NODE``; elsewhere the host name.
    """
    for key in ("SLURMD_NODENAME", "NBGPU_NODE"):
        name = environ.get(key, "").strip()
        if name:
            return name
    return socket.gethostname()
