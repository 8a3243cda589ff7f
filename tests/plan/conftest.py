"""Fixtures for plan tests: inventories of simulated fleets, and ports that are all free."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from nbgpu.devices.inventory import Inventory, take_inventory
from nbgpu.devices.sim.box import Fleet
from nbgpu.devices.sim.fleet import parse_spec


def all_free(_port: int) -> bool:
    return True


@pytest.fixture
def inventory(sim_env) -> Callable[[str], Inventory]:
    """inventory("busy-gpu0") -> the snapshot the simulator serves for that fleet."""

    def take(spec: str) -> Inventory:
        return take_inventory({**sim_env, "NBGPU_SIMULATE": spec}, scan_device_files=False)

    return take


def mixed_fleet(*specs: str) -> Fleet:
    """One box from several specs: '2xA100-80GB', '2xA100' -> GPUs 0-1 80 GB, 2-3 40 GB."""
    gpus = []
    for spec in specs:
        for gpu in parse_spec(spec).gpus:
            gpus.append(replace(gpu, index=len(gpus), uuid=f"{gpu.uuid[:-4]}{len(gpus):04d}"))
    return Fleet(gpus=tuple(gpus), name="mixed", description="mixed A100 80/40 GB box")


@pytest.fixture
def mixed_path(tmp_path: Path) -> str:
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(mixed_fleet("2xA100-80GB", "2xA100").to_dict()))
    return str(path)
