"""The nodes of a cluster as the planner sees them: each node's GPUs as candidates.

A cluster comes as what ``nbgpu status --slurm --json`` writes (every node's own
inventory, under ``"nodes"``), as that document decoded, as the ``ClusterStatus`` that
``%gpu_status --slurm`` returns, or as a mapping of node names to fleets (``{"n1":
"4xA40,busy=0", "n2": "4xA40"}``, or ``Inventory`` objects) for planning a cluster you
describe. A node's document is read back as the inventory it is
(``Inventory.from_dict``), so its GPUs keep exactly the findings, health and holders they
had where it was taken.

Touches the system only to read a cluster file (through ``files.py``) and to simulate a
described node; never imports pynvml, psutil or sockets.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbgpu.errors import FleetSpecError, UserInputError
from nbgpu.plan.placement import Candidate, candidates_from_inventory
from nbgpu.scale.files import read_text

if TYPE_CHECKING:
    from nbgpu.devices.inventory import Inventory

__all__ = ["ClusterCandidates", "cluster_candidates"]

ClusterCandidates = tuple[dict[str, tuple[Candidate, ...]], str, bool]

_EXPECTED = (
    "expected a cluster: %gpu_status --slurm's result, the JSON file `nbgpu status --slurm "
    "--json` writes, or a mapping of node names to fleets such as {'n1': '4xA40', 'n2': "
    "'4xA40,busy=0'}"
)


def cluster_candidates(cluster: Any) -> ClusterCandidates:
    """(node → its GPUs as candidates, where they came from, simulated?)."""
    from nbgpu.devices.model import is_cluster  # noqa: PLC0415

    if hasattr(cluster, "to_dict") and hasattr(cluster, "nodes"):
        cluster = cluster.to_dict()  # a ClusterStatus
    if isinstance(cluster, str | os.PathLike):
        path = Path(cluster).expanduser()
        text = read_text(path, "cluster file")
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise UserInputError(f"cluster file {os.fspath(cluster)!r}: not JSON ({exc})") from None
        if not is_cluster(data):
            raise UserInputError(f"cluster file {os.fspath(cluster)!r}: {_EXPECTED}")
        return _read(data, f"cluster file {path.name!r}", path.name)
    if isinstance(cluster, Mapping) and is_cluster(cluster):
        return _read(dict(cluster), "the cluster", str(cluster.get("source") or "the cluster"))
    if isinstance(cluster, Mapping) and cluster:
        return _described(cluster)
    raise UserInputError(f"cluster={type(cluster).__name__}: {_EXPECTED}")


def _read(data: Mapping[str, Any], where: str, source: str) -> ClusterCandidates:
    from nbgpu.devices.inventory import Inventory  # noqa: PLC0415
    from nbgpu.devices.model import cluster_nodes  # noqa: PLC0415

    try:
        documents = cluster_nodes(data, where)
    except FleetSpecError as exc:
        raise UserInputError(str(exc)) from None
    inventories = {
        node: Inventory.from_dict(document, where=f"{where}, node {node}")
        for node, document in documents.items()
    }
    simulated = any(inventory.simulated for inventory in inventories.values())
    out = {node: _candidates(inventory) for node, inventory in inventories.items()}
    return out, str(data.get("source") or source), simulated


def _described(cluster: Mapping[Any, Any]) -> ClusterCandidates:
    from nbgpu.devices.inventory import (  # noqa: PLC0415
        Inventory,
        saved_inventory,
        take_inventory,
    )

    out: dict[str, tuple[Candidate, ...]] = {}
    for node, fleet in cluster.items():
        if not isinstance(node, str) or not node:
            raise UserInputError(f"cluster: node name {node!r}: {_EXPECTED}")
        if isinstance(fleet, Inventory):
            inventory = fleet
        elif isinstance(fleet, str) and fleet.strip():
            try:  # a capture is read; anything else is simulated
                inventory = saved_inventory(fleet) or take_inventory(
                    {"NBGPU_SIMULATE": fleet}, scan_device_files=False
                )
            except FleetSpecError as exc:
                raise UserInputError(f"node {node}: {exc}") from None
        else:
            raise UserInputError(f"cluster: node {node!r} = {fleet!r}: {_EXPECTED}")
        out[node] = _candidates(inventory)
    simulated = all(not isinstance(f, Inventory) or f.simulated for f in cluster.values())
    return out, f"{len(out)} described node(s)", simulated


def _candidates(inventory: Inventory) -> tuple[Candidate, ...]:
    if inventory.nvml_error:
        return ()  # the node has no GPU to give; the plan says so for that node
    return tuple(candidates_from_inventory(inventory))
