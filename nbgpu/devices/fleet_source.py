"""``NBGPU_SIMULATE``'s value resolved to a fleet: a scenario name, a fleet file, a spec.

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

__all__ = ["load_fleet"]


def load_fleet(source: str, *, cwd: Path | None = None) -> Fleet:
    """Resolve ``NBGPU_SIMULATE``: a scenario name, a ``.json`` path, or a spec."""
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
