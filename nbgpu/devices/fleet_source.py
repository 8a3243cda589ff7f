"""``NBGPU_SIMULATE``'s value resolved to a fleet: a scenario name, a fleet file, a spec.

A cluster file (what ``nbgpu status --slurm --json`` writes: one fleet per node under
``"nodes"``) is a fleet per node: each process plays the node it is told it is on
(``node``, from :func:`~nbgpu.devices.simenv.simulated_node`), so every SLURM node of a
test cluster on one machine sees its own GPUs.

Each mistake is one ``FleetSpecError`` line naming the value and what is accepted. Reads
the one file named; never touches NVML.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from nbgpu.devices.fleet import Fleet, fleet_from_dict
from nbgpu.devices.fleetspec import apply_options, parse_spec
from nbgpu.devices.scenarios import SCENARIOS, scenario, scenario_key
from nbgpu.errors import FleetSpecError

__all__ = ["cluster_nodes", "is_cluster", "load_fleet"]


def load_fleet(source: str, *, cwd: Path | None = None, node: str | None = None) -> Fleet:
    """Resolve ``NBGPU_SIMULATE``: a scenario name, a ``.json`` path, or a spec.

    *node*: the node this process plays, for a cluster file (one fleet per node).
    """
    text = source.strip()
    if scenario_key(text) is not None:
        return scenario(text)
    head, _, extra = text.partition(",")
    key = scenario_key(head)
    if key is not None:
        # A scenario with more options: "busy-gpu0,procs=8" adds them to the scenario.
        options = [part.strip() for part in extra.split(",")]
        return replace(apply_options(scenario(key), options, spec=text), name=text)
    path = Path(text).expanduser()
    if cwd is not None and not path.is_absolute():
        path = cwd / path
    try:
        is_file = path.is_file()
    except OSError:  # a long spec is not a valid file name (ENAMETOOLONG)
        is_file = False
    if text.endswith(".json") or is_file:
        try:
            raw = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FleetSpecError(f"fleet file {text!r} does not exist") from None
        except OSError as exc:
            raise FleetSpecError(f"fleet file {text!r} cannot be read: {exc.strerror}") from None
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise FleetSpecError(
                f"fleet file {text!r} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
                f"{exc.msg})"
            ) from None
        if is_cluster(data):
            return _node_fleet(data, text, node)
        return fleet_from_dict(data, default_name=path.name)
    try:
        return parse_spec(text)
    except FleetSpecError as exc:
        if "," not in text and "x" not in text.lower():
            raise FleetSpecError(
                f"NBGPU_SIMULATE={text!r} is not a scenario, a fleet file or a spec; scenarios: "
                f"{', '.join(SCENARIOS)}"
            ) from None
        raise exc from None


def is_cluster(data: object) -> bool:
    """Whether a decoded JSON document is a cluster file (fleets per node)."""
    return (
        isinstance(data, dict) and "nbgpu_fleet" not in data and isinstance(data.get("nodes"), list)
    )


def cluster_nodes(data: object, where: str) -> dict[str, dict[str, object]]:
    """A cluster file's fleet documents by node name, in the file's order."""
    if not is_cluster(data):
        raise FleetSpecError(
            f"{where} is not a cluster file (write one with `nbgpu status --slurm --json`)"
        )
    out: dict[str, dict[str, object]] = {}
    for i, entry in enumerate(data["nodes"]):  # type: ignore[index]
        if not isinstance(entry, dict) or not isinstance(entry.get("node"), str):
            raise FleetSpecError(f"{where}: nodes[{i}] has no node name")
        out[entry["node"]] = entry
    if not out:
        raise FleetSpecError(f"{where}: the cluster file lists no node")
    return out


def _node_fleet(data: object, source: str, node: str | None) -> Fleet:
    nodes = cluster_nodes(data, f"fleet file {source!r}")
    if node not in nodes:
        raise FleetSpecError(
            f"fleet file {source!r} describes nodes {', '.join(nodes)}; this process is on "
            f"{node!r} (SLURMD_NODENAME, NBGPU_NODE or the host name)"
        )
    return fleet_from_dict(nodes[node], default_name=f"{Path(source).name}:{node}")
