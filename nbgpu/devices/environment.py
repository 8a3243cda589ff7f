"""The distributed-launch environment checked against the visible, healthy GPUs.

``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``NPROC_PER_NODE``, ``MASTER_ADDR`` /
``MASTER_PORT`` and ``CUDA_VISIBLE_DEVICES`` as the doctor finds them: a number of ranks
the GPUs cannot hold, a rank beyond the world, a port already taken (one socket bind
tells), a setting that hides every GPU. Each problem is a doctor's :class:`Problem`.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING

from nbgpu.faces import launch_hint
from nbgpu.problems import Problem

if TYPE_CHECKING:  # the inventory is only read here
    from nbgpu.devices.inventory import Inventory

__all__ = ["DIST_VARS", "environment_findings"]

DIST_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NPROC_PER_NODE",
)


def _int_env(environ: Mapping[str, str], key: str, out: list[Problem]) -> int | None:
    raw = environ.get(key)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        out.append(
            Problem(
                "bad",
                "bad_env",
                "environment",
                f"{key}={raw!r} is not a whole number.",
                (f"`unset {key}` or set it to a number",),
            )
        )
        return None
    if value < 0:
        out.append(Problem("bad", "bad_env", "environment", f"{key}={value} is negative."))
        return None
    return value


def _port_in_use(host: str, port: int) -> bool:
    # Binding is the only reliable test: connect() says nothing about TIME_WAIT etc.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host if host not in ("localhost", "") else "127.0.0.1", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def environment_findings(
    inventory: Inventory,
    environ: Mapping[str, str],
    *,
    nproc: int | None = None,
    face: str = "notebook",
) -> list[Problem]:
    """Findings about the launch environment against the visible, healthy GPUs."""
    out: list[Problem] = []
    if inventory.nvml_error:
        return out
    visible = inventory.visible.devices if inventory.visible is not None else ()
    n_visible = len(visible)
    healthy = set(inventory.healthy_indices)
    healthy_visible = [d for d in visible if d.nvml_index in healthy]
    if inventory.visible is not None:
        out.extend(
            Problem("warn", "visible_devices", "CUDA_VISIBLE_DEVICES", problem)
            for problem in inventory.visible.problems
        )
    if inventory.gpus and n_visible == 0:
        out.append(
            Problem(
                "bad",
                "nothing_visible",
                "CUDA_VISIBLE_DEVICES",
                f"CUDA_VISIBLE_DEVICES={inventory.visible_value!r} hides every GPU: CUDA will "
                "report no device.",
                ("`unset CUDA_VISIBLE_DEVICES`, or list GPUs by index or UUID (e.g. 0,1)",),
            )
        )
    wanted = nproc if nproc is not None else _int_env(environ, "NPROC_PER_NODE", out)
    source = "nproc" if nproc is not None else "NPROC_PER_NODE"
    if wanted is not None and wanted > n_visible:
        out.append(
            Problem(
                "bad",
                "nproc_exceeds_gpus",
                "environment",
                f"{source}={wanted} but {n_visible} GPUs are visible: ranks {n_visible}.."
                f"{wanted - 1} would fail with 'CUDA error: invalid device ordinal'.",
                (
                    (
                        f"launch {len(healthy_visible) or n_visible} ranks "
                        f"(`{launch_hint(face)}` sizes nproc from the healthy GPUs when you "
                        "give no number)"
                    ),
                    f"or `export NPROC_PER_NODE={len(healthy_visible) or n_visible}`",
                ),
            )
        )
    elif wanted is not None and wanted > len(healthy_visible):
        out.append(
            Problem(
                "warn",
                "nproc_exceeds_healthy",
                "environment",
                f"{source}={wanted} but only {len(healthy_visible)} of the {n_visible} visible GPUs "
                "are healthy.",
                ("fix the GPUs flagged above, or launch fewer ranks on the healthy ones",),
            )
        )
    local_rank = _int_env(environ, "LOCAL_RANK", out)
    if local_rank is not None and local_rank >= n_visible:
        out.append(
            Problem(
                "bad",
                "local_rank_exceeds_gpus",
                "environment",
                f"local_rank {local_rank} >= {n_visible} visible devices: "
                f"torch.cuda.set_device({local_rank}) fails with 'invalid device ordinal'.",
                ("launch at most one rank per visible GPU; check CUDA_VISIBLE_DEVICES per job",),
            )
        )
    rank = _int_env(environ, "RANK", out)
    world = _int_env(environ, "WORLD_SIZE", out)
    if rank is not None and world is not None and rank >= world:
        out.append(
            Problem(
                "bad",
                "rank_exceeds_world",
                "environment",
                f"RANK={rank} but WORLD_SIZE={world}: ranks are 0..{world - 1}.",
            )
        )
    port_text = environ.get("MASTER_PORT")
    if port_text:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            out.append(
                Problem(
                    "bad",
                    "bad_env",
                    "environment",
                    f"MASTER_PORT={port_text!r} is not a port number (1-65535).",
                )
            )
        elif rank in (None, 0) and _port_in_use(
            environ.get("MASTER_ADDR", "127.0.0.1"), int(port_text)
        ):
            out.append(
                Problem(
                    "warn",
                    "port_in_use",
                    "environment",
                    f"MASTER_PORT={port_text} is already in use on this machine: a new rendezvous "
                    "there fails with 'address already in use' (another run on this box).",
                    ("unset MASTER_PORT and let nbgpu pick a free port, or choose another one",),
                )
            )
    return out
