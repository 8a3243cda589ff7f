"""``nbgpu.torchrun(...)``: from what the user asked to a validated config and a Run. Without
``--gpus`` the ranks default to the healthy visible GPUs, and unhealthy ones (busy, held by a
dead process, lost) are left out of ``CUDA_VISIBLE_DEVICES`` with a note, so rank 0 never lands
on a busy GPU 0. ``--gpus`` is checked against the inventory and the CUDA probe (``force``
overrides); more ranks than GPUs is refused before anything starts.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast, overload

from nbgpu.errors import UserInputError, user_path
from nbgpu.faces import doctor_hint, launch_hint
from nbgpu.launch.config import (
    HANG_AFTER_S,
    LaunchConfig,
    LaunchPlan,
    NodesLaunchPlan,
    PlanRole,
    Prepared,
    SlurmOptions,
    is_nodes_plan,
    parse_gpu_list,
    parse_size,
    pickle_pushed,
    start_only,
    take_nodes_plan,
)
from nbgpu.launch.execute import WarmJob, execute, run_cell, to_screen
from nbgpu.launch.run import RUNS, Run
from nbgpu.launch.rundirs import check_name
from nbgpu.launch.slurm import check_request
from nbgpu.launch.warm import CellResult
from nbgpu.profile.phases import parse_sample_interval

if TYPE_CHECKING:
    from nbgpu.devices.inventory import Inventory

__all__ = ["prepare", "torchrun"]


def _unhealthy_reason(
    inventory: Inventory, nvml_index: int, *, short: bool = False, face: str = "notebook"
) -> str | None:
    from nbgpu.devices.model import gpu_health  # noqa: PLC0415

    if nvml_index in inventory.healthy_indices:
        return None
    for gpu, findings in zip(inventory.gpus, inventory.findings, strict=True):
        if gpu.nvml_index == nvml_index:
            if short:
                return gpu_health(gpu, findings)[0] + f" (see {doctor_hint(face)})"
            bad = (f.message for f in findings if f.severity == "bad")
            return next(bad, gpu.error or "unhealthy")
    return "not found"


def _unique_name(requested: str | None, script: Path | None) -> str:
    if requested:
        existing = RUNS.get(check_name(requested))
        if existing is not None and not existing.done:
            raise UserInputError(
                f"--name {requested!r}: a run with this name is still running "
                f"(%gpu_stop {requested})"
            )
        return requested
    base = script.stem if script is not None else "cell"
    base = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in base)[:40] or "run"
    return next(f"{base}-{n}" for n in itertools.count(1) if f"{base}-{n}" not in RUNS)


def _named_gpus(
    inv: Inventory,
    gpus: str | Sequence[int],
    nproc: int | None,
    *,
    force: bool,
    notes: list[str],
    environ: Mapping[str, str],
    face: str = "notebook",
) -> tuple[int, str, tuple[int, ...]]:
    """--gpus: every named GPU must exist, look healthy, and pass the CUDA probe."""
    if inv.nvml_error or not inv.gpus:
        why = inv.nvml_error or "no GPU found"
        raise UserInputError(
            f"--gpus {gpus}: there is no GPU here ({why}); drop --gpus to run on CPU"
        )
    text = gpus if isinstance(gpus, str) else ",".join(str(g) for g in gpus)
    chosen = parse_gpu_list(text, [g.nvml_index for g in inv.gpus])
    for index in chosen:
        reason = _unhealthy_reason(inv, index)
        if reason and not force:
            raise UserInputError(
                f"--gpus {text}: GPU {index} is not usable: {reason} (--force to use it anyway)"
            )
        if reason:
            notes.append(f"GPU {index} used despite: {reason} (--force)")
    if not force:
        # A context on each named GPU (in a subprocess) before committing ranks to it: NVML
        # can look clean while CUDA refuses the GPU (a holder in another container).
        env = {**environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, chosen))}
        from nbgpu.devices.inventory import probe_gpus  # noqa: PLC0415

        report = probe_gpus({**env, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, inv.gpus, 30.0)
        # (An init_error: CUDA itself cannot start here; the ranks will say so in their words.)
        failed = [r for r in report.results if r.outcome != "ok" and report.init_error is None]
        if failed:
            where = f"GPU {failed[0].nvml_index}" if failed[0].nvml_index is not None else "a GPU"
            raise UserInputError(
                f"--gpus {text}: {where} fails the CUDA probe: {failed[0].message} "
                f"({failed[0].error_name or failed[0].cuda_error}); see {doctor_hint(face)} "
                "(--force to use it anyway)"
            )
    if nproc is None:
        nproc = len(chosen)
    elif nproc > len(chosen) and not force:
        raise UserInputError(
            f"nproc {nproc} but --gpus {text} names {len(chosen)} GPUs: ranks {len(chosen)}.."
            f"{nproc - 1} would fail with 'invalid device ordinal' (--force to launch anyway)"
        )
    return nproc, ",".join(str(i) for i in chosen), chosen


def _visible_gpus(
    inv: Inventory, nproc: int | None, *, force: bool, notes: list[str], face: str = "notebook"
) -> tuple[int, str | None, tuple[int, ...] | None]:
    """No --gpus: size from the healthy visible GPUs and leave the unhealthy ones out."""
    visible = [d.nvml_index for d in inv.visible.devices] if inv.visible is not None else []
    healthy = [i for i in visible if i in inv.healthy_indices]
    left_out = [i for i in visible if i not in inv.healthy_indices]
    if nproc is None:
        if not healthy:
            raise UserInputError(
                f"no healthy GPU is visible (see {doctor_hint(face)}); give a number of CPU "
                f"processes to run on CPU anyway, e.g. {launch_hint(face, 2, force=True)}"
            )
        nproc = len(healthy)
    if nproc > len(visible) and not force:
        raise UserInputError(
            f"nproc {nproc} but {len(visible)} GPUs are visible: ranks {len(visible)}..{nproc - 1} "
            "would fail with 'invalid device ordinal'; use "
            f"{launch_hint(face, len(healthy) or len(visible))}, or --force for CPU-only ranks"
        )
    if left_out and nproc <= len(healthy):
        # Keep rank 0 (and every rank) off GPUs that would refuse a context.
        notes.extend(
            f"GPU {i} left out: {_unhealthy_reason(inv, i, short=True, face=face)}"
            for i in left_out
        )
        return nproc, ",".join(str(i) for i in healthy), tuple(healthy)
    if left_out:
        notes.append(
            f"{nproc} ranks on {len(visible)} visible GPUs includes unhealthy GPU(s) "
            f"{','.join(map(str, left_out))}: expect failures (see {doctor_hint(face)})"
        )
    return nproc, None, None


def prepare(
    code: str | None = None,
    script: str | Path | None = None,
    *,
    nproc: int | None = None,
    gpus: str | Sequence[int] | None = None,
    force: bool = False,
    name: str | None = None,
    env: Mapping[str, str] | None = None,
    push: Mapping[str, Any] | None = None,
    pull: Sequence[str] = (),
    mem_limit: str | int | None = None,
    mem_sample: float | str = 0.1,
    strict: bool = False,
    script_args: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
    inventory: Inventory | None = None,
    plan: LaunchPlan | NodesLaunchPlan | None = None,
    role: str | None = None,
    master_port: int | None = None,
    nnodes: int = 1,
    slurm: SlurmOptions | None = None,
    hang_after_s: float | None = None,
    face: str = "notebook",
    **fields: Any,
) -> Prepared:
    """Validate everything and decide nproc and GPUs; starts nothing. Hints name commands
    the user can type in the ``face`` ("notebook", "terminal", "python"). ``plan``
    (``nbgpu.plan``) supplies GPUs, nproc and port for its ``role`` (default: the only one, or
    "train"); a plan across nodes, the nodes, ranks per node and each node's GPUs of a SLURM
    run. Code asking for CUDA this torch cannot give is a note (``strict``: refused). Other
    keywords are :class:`LaunchConfig` fields, as given (``timeout_s``, ``quiet``, ``keep``...)."""
    environ = dict(os.environ if environ is None else environ)
    notes: list[str] = []
    if plan is not None and is_nodes_plan(plan):
        nproc, nnodes, slurm, env = take_nodes_plan(
            plan,
            nproc=nproc,
            nnodes=nnodes,
            slurm=slurm,
            gpus=gpus,
            role=role,
            env=env or {},
            notes=notes,
        )
    elif plan is not None:
        if gpus is not None:
            raise UserInputError("--plan and --gpus both choose GPUs: give one of them")
        chosen_role = _plan_role(cast("LaunchPlan", plan), role)
        gpus = chosen_role.cuda_visible_devices
        nproc = chosen_role.nproc_per_node if nproc is None else nproc
        master_port = master_port or chosen_role.master_port
        notes.append(
            f"plan role '{chosen_role.name}': GPUs {gpus}, {chosen_role.nproc_per_node} ranks, "
            f"port {master_port}"
        )
    cvd: str | None = None
    chosen: tuple[int, ...] | None = None
    inv: Inventory | None = None
    if slurm is not None:
        # The GPUs are the nodes', not this machine's: SLURM assigns them (--gpus-per-node).
        if gpus is not None:
            raise UserInputError(
                "--gpus names this machine's GPUs; with --slurm ask for GPUs per node "
                "(--gpus-per-node G) and SLURM assigns them"
            )
        if nproc is None:
            if not slurm.gpus_per_node:
                raise UserInputError(
                    "--slurm: give the ranks per node (--nproc-per-node N), or --gpus-per-node G "
                    "for one rank per GPU"
                )
            nproc = slurm.gpus_per_node
        notes.extend(check_request(nnodes, slurm, environ))
    else:  # this machine's GPUs (imported here: a SLURM run starts sooner without them)
        from nbgpu.devices.inventory import take_inventory  # noqa: PLC0415

        inv = inventory or take_inventory(environ, scan_device_files=False)
        if gpus is not None:
            nproc, cvd, chosen = _named_gpus(
                inv, gpus, nproc, force=force, notes=notes, environ=environ, face=face
            )
        elif not inv.nvml_error and inv.gpus:
            nproc, cvd, chosen = _visible_gpus(inv, nproc, force=force, notes=notes, face=face)
        elif nproc is None:
            why = inv.nvml_error or "no GPU found"
            raise UserInputError(
                f"no GPU here ({why.rstrip('.')}): give the number of CPU processes, e.g. "
                f"{launch_hint(face, 2)} (ranks use gloo on CPU)"
            )
        if inv.simulated:
            notes.append(f"SIMULATED fleet '{inv.fleet_name}': ranks compute on CPU (gloo)")
    script_path = user_path(script) if script is not None else None
    config = LaunchConfig(
        nproc=nproc,
        code=code,
        script=script_path,
        script_args=tuple(script_args),
        name=_unique_name(name, script_path),
        cuda_visible_devices=cvd,
        gpus=chosen,
        env=dict(env or {}),
        push=pickle_pushed(list(push), push) if push else {},
        pull=tuple(pull),
        mem_limit_bytes=None if mem_limit is None else parse_size(mem_limit),
        mem_sample_s=parse_sample_interval(mem_sample),
        master_port=master_port,
        strict=strict,
        nnodes=nnodes,
        slurm=slurm,
        hang_after_s=HANG_AFTER_S if hang_after_s is None else hang_after_s,
        **fields,
    )
    if inv is not None:  # (SLURM's nodes are not this machine: no preflight line)
        from nbgpu.launch.preflight import cuda_line, torch_build  # noqa: PLC0415

        real_gpus = bool(inv.gpus) and not inv.nvml_error and not inv.simulated
        fleet = (inv.fleet_name or "?") if inv.simulated else None
        line = cuda_line(config, torch_build(), gpus_here=real_gpus, fleet=fleet)
        if line is not None:
            if strict:
                raise UserInputError(f"--strict: {line}")
            notes.append(line)
    return Prepared(config=config, notes=tuple(notes))


def _plan_role(plan: LaunchPlan, role: str | None) -> PlanRole:
    roles: Sequence[PlanRole] | None = getattr(plan, "roles", None)  # a variable may hold anything
    if roles is None:
        raise UserInputError(
            f"--plan: expected a plan from nbgpu.plan(...), got {type(plan).__name__}"
        )
    if not plan.ok:
        first = plan.problems[0].message if plan.problems else "not ready"
        raise UserInputError(f"--plan: the plan is not ready: {first}")
    names = [r.name for r in roles]
    if role is None:
        if len(roles) == 1:
            return roles[0]
        if "train" in names:
            return roles[names.index("train")]
        raise UserInputError(f"--plan has roles {', '.join(names)}: choose one with --role")
    if role not in names:
        raise UserInputError(f"--role {role!r}: the plan's roles are {', '.join(names)}")
    return roles[names.index(role)]


# One return type per form: a cold run, a warm job (keep=True), a cell on one (on=).
@overload
def torchrun(
    code_or_path: str,
    nproc: int | None = None,
    *,
    check: bool = True,
    write: Callable[[str], object] | None = None,
    environ: Mapping[str, str] | None = None,
    keep: Literal[False] = False,
    on: None = None,
    **options: Any,
) -> Run: ...
@overload
def torchrun(
    code_or_path: str,
    nproc: int | None = None,
    *,
    check: bool = True,
    write: Callable[[str], object] | None = None,
    environ: Mapping[str, str] | None = None,
    keep: Literal[True],
    on: None = None,
    **options: Any,
) -> WarmJob: ...
@overload
def torchrun(
    code_or_path: str,
    nproc: int | None = None,
    *,
    check: bool = True,
    write: Callable[[str], object] | None = None,
    environ: Mapping[str, str] | None = None,
    keep: Literal[False] = False,
    on: str,
    **options: Any,
) -> CellResult | None: ...


def torchrun(
    code_or_path: str,
    nproc: int | None = None,
    *,
    check: bool = True,
    write: Callable[[str], object] | None = None,
    environ: Mapping[str, str] | None = None,
    keep: bool = False,
    on: str | None = None,
    **options: Any,
) -> Run | WarmJob | CellResult | None:  # the forms above, one each
    """Run *code_or_path* (cell source, or a ``.py`` path) as a torchrun job and wait.

    Streams every rank's output (prefixed ``[rankN]``) through *write* (default:
    ``sys.stdout``), keeps complete per-rank logs in the run directory, and returns
    the :class:`Run`. With ``check`` (default) a failed run raises
    :class:`RunFailed`, whose ``.run`` holds the details. Options: ``gpus``,
    ``force``, ``name``, ``timeout_s``, ``env``, ``push`` (dict of values),
    ``pull``, ``pull_all_ranks``, ``serial_imports``, ``mem_limit``, ``mem_sample``
    (seconds between memory samples in every rank, 0 off; ``run.memory`` reports them),
    ``backend``, ``quiet``, ``script_args``, ``strict`` (refuse code that asks for CUDA
    this machine's torch cannot give; without it, one line and the run starts).

    ``keep=True`` keeps the ranks (their globals, process group, CUDA context) after
    the code ran and returns a :class:`WarmJob` (``idle_timeout_s`` ends it when
    unused); ``on="name"`` runs the code on that warm job's ranks and returns the
    cell's :class:`CellResult` (a cell that raised is ``CellFailed`` with ``check``);
    ``ranks="0,2"`` (or ``"1-3"``, ``[0, 2]``) with it runs the cell on those ranks only.
    """
    out = write or (lambda text: print(text, end="", flush=True))
    if on is not None:
        if keep:
            raise start_only("keep=", on)
        options.pop("face", None)
        return run_cell(on, code_or_path, out, check=check, nproc=nproc, **options)
    if options.get("ranks") is not None:
        raise UserInputError(
            f"ranks={options['ranks']!r}: a new job runs on every rank; ranks= picks ranks of "
            "a warm job for one cell: add on='NAME' (a warm job starts with keep=True)"
        )
    looks_like_path = code_or_path.endswith(".py") and "\n" not in code_or_path
    options.setdefault("face", "python")
    prepared = prepare(
        code=None if looks_like_path else code_or_path,
        script=code_or_path if looks_like_path else None,
        nproc=nproc,
        environ=environ,
        keep=keep,
        **options,
    )
    run = execute(
        prepared,
        to_screen(out, quiet=prepared.config.quiet),
        announce=lambda line: out(line + "\n"),
        check=check,
        environ=environ,
    )
    return WarmJob(run, out) if keep else run
