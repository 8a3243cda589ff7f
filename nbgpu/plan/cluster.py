"""The nodes of a cluster as the planner sees them: each node's GPUs as candidates.

A cluster comes as what ``nbgpu status --slurm --json`` writes (every node's own
inventory, under ``"nodes"``), as that document decoded, as the ``ClusterStatus`` that
``%gpu_status --slurm`` returns, or as a mapping of node names to fleets (``{"n1":
"4xA40,busy=0", "n2": "4xA40"}``, or ``Inventory`` objects) for planning a cluster you
describe. A node's document is read back the way any fleet file is: the simulated NVML
library replays it (``NBGPU_SIMULATE`` set to the cluster file, the node named), so its
GPUs get exactly the findings, health and holders they had where it was taken.

Touches the system only to take those snapshots (one temporary file, through
``files.py``, for a document given in memory); never imports pynvml, psutil or sockets.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbgpu.errors import FleetSpecError, UserInputError
from nbgpu.plan.placement import Candidate, candidates_from_inventory
from nbgpu.scale.files import read_text, write_text

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
    from nbgpu.devices.fleet_source import cluster_nodes, is_cluster  # noqa: PLC0415

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
        return _replayed(data, path, path.name)
    if isinstance(cluster, Mapping) and is_cluster(cluster):
        try:
            cluster_nodes(cluster, "the cluster")
        except FleetSpecError as exc:
            raise UserInputError(str(exc)) from None
        with tempfile.TemporaryDirectory(prefix="nbgpu-cluster-") as tmp:
            path = Path(tmp) / "cluster.json"
            write_text(path, json.dumps(cluster))
            return _replayed(dict(cluster), path, str(cluster.get("source") or "the cluster"))
    if isinstance(cluster, Mapping) and cluster:
        return _described(cluster)
    raise UserInputError(f"cluster={type(cluster).__name__}: {_EXPECTED}")


def _replayed(data: Mapping[str, Any], path: Path, source: str) -> ClusterCandidates:
    from nbgpu.devices.fleet_source import cluster_nodes  # noqa: PLC0415
    from nbgpu.devices.inventory import take_inventory  # noqa: PLC0415

    try:
        documents = cluster_nodes(data, f"cluster file {source!r}")
    except FleetSpecError as exc:
        raise UserInputError(str(exc)) from None
    out: dict[str, tuple[Candidate, ...]] = {}
    simulated = False
    for node, document in documents.items():
        env = {"NBGPU_SIMULATE": str(path), "SLURMD_NODENAME": node}
        try:
            inventory = take_inventory(env, scan_device_files=False)
        except FleetSpecError as exc:
            raise UserInputError(f"node {node}: {exc}") from None
        out[node] = _candidates(inventory)
        simulated = simulated or bool(document.get("simulated"))
    return out, str(data.get("source") or source), simulated


def _described(cluster: Mapping[Any, Any]) -> ClusterCandidates:
    from nbgpu.devices.inventory import Inventory, take_inventory  # noqa: PLC0415

    out: dict[str, tuple[Candidate, ...]] = {}
    for node, fleet in cluster.items():
        if not isinstance(node, str) or not node:
            raise UserInputError(f"cluster: node name {node!r}: {_EXPECTED}")
        if isinstance(fleet, Inventory):
            inventory = fleet
        elif isinstance(fleet, str) and fleet.strip():
            try:
                inventory = take_inventory({"NBGPU_SIMULATE": fleet}, scan_device_files=False)
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
