"""Named fleets: the situations nbgpu was built to explain, and one per failure mode.

Each scenario is a fleet file in ``devices/fleets/`` (``busy-gpu0.json``...), the same
format ``nbgpu status --json`` writes, read by the same reader: a scenario is data, and a
new one is a new file. ``NBGPU_SIMULATE=busy-gpu0,procs=8`` adds spec options to it.
Reads only those files; never touches NVML or processes.
"""

from __future__ import annotations

import json
from pathlib import Path

from nbgpu.devices.fleet import Fleet, fleet_from_dict
from nbgpu.errors import FleetSpecError

__all__ = ["FLEETS_DIR", "SCENARIOS", "scenario", "scenario_key"]

FLEETS_DIR = Path(__file__).with_name("fleets")

#: The scenario names, from the files (their descriptions are read with the fleet).
SCENARIOS: tuple[str, ...] = tuple(sorted(p.stem for p in FLEETS_DIR.glob("*.json")))


def scenario_key(name: str) -> str | None:
    """The scenario a name means, or None."""
    return name if name in SCENARIOS else None


def scenario(name: str) -> Fleet:
    """The named scenario's fleet."""
    if scenario_key(name) is None:
        raise FleetSpecError(f"{name!r} is not a scenario; scenarios: {', '.join(SCENARIOS)}")
    path = FLEETS_DIR / f"{name}.json"
    return fleet_from_dict(json.loads(path.read_text(encoding="utf-8")), default_name=name)
