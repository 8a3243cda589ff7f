"""The planning functions users call (``nbgpu.plan()``, ``.sweep()``, ``.nodes()``, ``.scale()``,
``.plan_from_json()``): the one module of ``plan/`` that takes inventories (a saved one is read
back with its findings and holders) or reads files; it checks the input once and hands plain
data on. Never imports IPython; pynvml and psutil only with the inventory, for a snapshot.
"""

from __future__ import annotations

import inspect
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any, TypeVar

from nbgpu._serial import from_data, to_data
from nbgpu.errors import FleetSpecError, UserInputError, user_path
from nbgpu.estimate import lookup_model, model_shape
from nbgpu.plan.job import GpuList, Job, JobRequest, make_job, parse_gpu_list, whole_number
from nbgpu.plan.multinode import NodesPlan, build_nodes_plan, short_nodes
from nbgpu.plan.placement import Candidate, PortChecker, candidates_from_inventory, order_pool
from nbgpu.plan.placement import port_is_free as _port_is_free
from nbgpu.plan.planner import NO_GPU, build_plan
from nbgpu.plan.result import PLAN_FILE_FORMAT, Plan
from nbgpu.plan.sweep import SweepPlan, build_sweep
from nbgpu.problems import Problem
from nbgpu.scale import ScalePlan, builtin_shape, scale_config
from nbgpu.scale.files import load_config, parse_json, read_config, read_text, rescaled_text

if TYPE_CHECKING:
    from nbgpu.devices.inventory import Inventory

__all__ = ["inventory_snapshot", "nodes", "plan", "plan_from_json", "scale", "sweep"]


def inventory_snapshot(
    inventory: Inventory | str | None, environ: Mapping[str, str] | None
) -> Inventory:
    """The GPUs a plan places on: *inventory* as given, read from its spec or file, or
    this machine's now. Imported here: the inventory pulls in pynvml and psutil, planning
    itself needs neither."""
    from nbgpu.devices.inventory import Inventory, saved_inventory, take_inventory  # noqa: PLC0415

    if isinstance(inventory, Inventory):
        return inventory
    env = dict(os.environ if environ is None else environ)
    if inventory is not None:
        if not isinstance(inventory, str) or not inventory.strip():
            raise UserInputError(
                f"inventory={inventory!r}: expected an Inventory (nbgpu.status()), a fleet "
                "spec such as '4xA40,busy=0', a scenario such as 'busy-gpu0', or a fleet .json"
            )
        saved = saved_inventory(inventory)  # `nbgpu status --json`'s file: read, not replayed
        if saved is not None:
            return saved
        env["NBGPU_SIMULATE"] = inventory
    return take_inventory(env, scan_device_files=False)


def _gpus(
    inventory: Inventory | str | None, environ: Mapping[str, str] | None
) -> tuple[tuple[Candidate, ...], str, bool]:
    """(the snapshot's GPUs as candidates, the fleet or host name, simulated?)."""
    snapshot = inventory_snapshot(inventory, environ)
    if snapshot.nvml_error:
        why = f" (NVML: {snapshot.nvml_error})"
        raise UserInputError(NO_GPU.format(why=why, example="4xA40"))
    name = (snapshot.fleet_name or "simulated") if snapshot.simulated else snapshot.hostname
    return candidates_from_inventory(snapshot), name, snapshot.simulated


F = TypeVar("F", bound=Callable[..., Any])
P = TypeVar("P", Plan, SweepPlan, NodesPlan)
# The job keywords a sweep and a plan across nodes do not take (they choose those themselves).
_NOT_SWEEP = ("num_gpus", "require")
_NOT_NODES = ("num_gpus", "require", "exclude", "base_port")
_CLUSTER_FORMS = (
    "expected a cluster: %gpu_status --slurm's result, the JSON file `nbgpu status --slurm "
    "--json` writes, a mapping of node names to fleets such as {'n1': '4xA40', 'n2': "
    "'4xA40,busy=0'}, N simulated nodes of one fleet such as '24x(8xH100)' or N described "
    "nodes of G GPUs such as '24x(8)'"
)
_NODES = re.compile(r"^\s*(\d+)\s*[xX\u00d7]\s*\((.+)\)\s*$")  # 24x(8xH100,busy=0), 24x(8)
_SEVERITY_OF = {"problems": "bad", "warnings": "warn"}  # plan files older than severities


def _takes_job_keywords(but: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Show the :class:`JobRequest` fields in a ``**job`` function's signature (help, ``?``)."""

    def decorate(func: F) -> F:
        signature = inspect.signature(func)
        own = [p for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD]
        skip = {p.name for p in own} | set(but)
        job = inspect.signature(JobRequest).parameters.values()
        extra = [p.replace(kind=p.KEYWORD_ONLY) for p in job if p.name not in skip]
        func.__signature__ = signature.replace(parameters=[*own, *extra])  # type: ignore[attr-defined]
        return func

    return decorate


def _model(model: Any) -> Any:
    """A path to an HF ``config.json`` (or YAML) is read here; other forms pass through."""
    if isinstance(model, os.PathLike) or (
        isinstance(model, str) and model.endswith((".json", ".yaml", ".yml"))
    ):
        return load_config(model)
    return model


def _job(where: str, keywords: Mapping[str, Any], but: tuple[str, ...] = (), why: str = "") -> Job:
    """The checked job; an unknown keyword is one line naming the known (*why*: for one of *but*)."""
    known = [f.name for f in fields(JobRequest) if f.name not in but]
    unknown = sorted(set(keywords) - set(known), key=lambda k: (k not in but, k))
    if unknown:
        taken = why if why and unknown[0] in but else f"its job keywords are {', '.join(known)}"
        raise UserInputError(f"{where}: {unknown[0]}= is not a keyword it takes; {taken}")
    return make_job(JobRequest(**{**keywords, "model": _model(keywords.get("model"))}))


def _scale_model(model: Any) -> Any:
    """A model for the KV check: a built-in name (``Qwen/Qwen2.5-VL-3B-Instruct``) or as plan()."""
    if isinstance(model, str) and not model.endswith((".json", ".yaml", ".yml")):
        shape = builtin_shape(model)
        if shape is not None:
            return shape
        if "/" in model or "-" in model:
            lookup_model(model)  # not a size such as "7B": one line naming close matches
    return model_shape(_model(model))


@_takes_job_keywords()
def plan(
    allocation: str | None = None,
    *,
    inventory: Inventory | str | None = None,
    port_is_free: PortChecker | None = None,
    environ: Mapping[str, str] | None = None,
    **job: Any,
) -> Plan:
    """Place a job's roles on healthy GPUs and check its batch and memory.

    ``allocation``: ``"sglang.d1t1p1+d3t1p1"`` (AReaL), ``"inference:1,train:3"``, or None for
    one training role on ``num_gpus`` GPUs (default: every usable GPU). ``require``/``exclude``:
    GPUs (NVML indices) that must / must not be used; required ones come first, in the order
    given. ``global_batch``, ``micro_batch``, ``grad_accum``, ``max_micro_batch``: checked
    against the first training role's data-parallel size; ``divisors`` must divide the global
    batch, ``step_divisors`` the ranks × micro batch (TRL GRPO's ``num_generations``). ``model``
    (a parameter count, ``"7B"``, an HF config dict or its ``config.json`` path, a built-in name
    such as ``"Qwen/Qwen2.5-7B-Instruct"``, or a torch module) with ``precision``/``strategy``/
    ``optimizer`` adds a per-GPU memory check of every term (:func:`nbgpu.estimate`);
    ``seq_len`` adds activations, logits and the KV cache, and ``max_micro_batch="auto"``
    computes the largest micro batch the smallest GPU of the first training role holds.
    ``port_is_free`` replaces the socket test (tests pass a function).
    """
    job_ = _job("nbgpu.plan()", {"allocation": allocation, **job})
    return build_plan(*_gpus(inventory, environ), job_, is_free=port_is_free or _port_is_free)


@_takes_job_keywords(but=_NOT_SWEEP)
def sweep(
    runs: int | None = None,
    gpus_per_run: int | None = None,
    *,
    gpus: GpuList = None,
    inventory: Inventory | str | None = None,
    port_is_free: PortChecker | None = None,
    environ: Mapping[str, str] | None = None,
    share: bool = False,
    **job: Any,
) -> SweepPlan:
    """Split the usable GPUs into *runs* disjoint sets with distinct free ports.

    Each run is a full :class:`Plan` (``sweep.runs[i]``) of ``gpus_per_run`` GPUs (default
    1), or of ``allocation`` when given. ``runs=None`` plans as many runs as fit. ``gpus``
    limits the sweep to these GPUs. Batch and model arguments are checked per run, as in
    :func:`plan`. A run on GPUs that other jobs are using is not ready (it would share
    their compute and memory) unless ``share=True``; the sweep says how many runs fit now.
    """
    why = "a sweep's GPUs are gpus_per_run= per run, from gpus= (default: every usable GPU)"
    job_ = _job("nbgpu.sweep()", job, but=_NOT_SWEEP, why=why)
    pool = parse_gpu_list(gpus, "gpus")
    return build_sweep(
        *_gpus(inventory, environ),
        job_,
        runs=runs,
        gpus_per_run=gpus_per_run,
        pool=pool,
        is_free=port_is_free or _port_is_free,
        share=share,
    )


@_takes_job_keywords(but=_NOT_NODES)
def nodes(
    cluster: Any, *, nodes: int | None = None, nproc_per_node: int | None = None, **job: Any
) -> NodesPlan:
    """Plan a job across a cluster's nodes: which nodes, which GPUs on each, for which role.

    ``cluster``: ``%gpu_status --slurm``'s result (``nbgpu status --slurm --json``'s file),
    a mapping of node names to fleets (``{"n1": "4xA40,busy=0", "n2": "4xA40"}``),
    ``"24x(8xH100)"`` (simulated n1..n24) or ``"24x(8)"`` (described, not seen). ``nodes``
    (default: all that fit) × ``nproc_per_node`` ranks (default: the most a node count
    allows), or an ``allocation`` on at most as many of each. Batch and model keywords are
    those of :func:`plan`, for the ranks ``%%torchrun --plan p`` starts.
    """
    job_ = _job("nbgpu.plan.nodes()", job, but=_NOT_NODES)
    whole_number("nodes", nodes)
    whole_number("nproc_per_node", nproc_per_node)
    spec = _NODES.match(cluster) if isinstance(cluster, str) else None
    found = _spec_cluster(spec) if spec else _cluster(cluster)
    return build_nodes_plan(*found, job_, nodes=nodes, nproc_per_node=nproc_per_node)


def scale(
    config: Mapping[str, Any] | str | os.PathLike[str] | Sequence[str],
    *,
    to_gpus: int | None = None,
    from_gpus: int | None = None,
    batch: str = "scale",
    tensor_parallel: str | int = "keep",
    rules: Mapping[str, str] | None = None,
    model: Any = None,
    max_model_len: int | None = None,
    precision: str | None = None,
    inventory: Inventory | str | None = None,
    cluster: Any = None,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    gpu_memory_bytes: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> ScalePlan:
    """Rescale a training config (dict, YAML/JSON file, launch script, or ``key=value`` overrides).

    A file (YAML, JSON, or a shell script that runs ``python3 -m verl.trainer.main_ppo
    key=value ...``) comes back as ``to_text()``: the same file with only the changed values
    rewritten (comments, order, quoting, ``$VAR`` references and line continuations kept);
    ``save(path)`` writes it.

    ``to_gpus`` defaults to the usable GPUs of ``inventory`` (one node) or of ``cluster``'s nodes
    (as :func:`nodes` takes them). Past one node the job spreads over nodes of
    ``gpus_per_node`` GPUs (default: the inventory's, the cluster's, the config's own nodes, else
    8, said as assumed), or over ``nodes`` nodes: ``nnodes`` and ``n_gpus_per_node`` are both
    written. ``batch="scale"`` keeps the per-GPU work, ``"keep"`` the global batches (checked).
    ``tensor_parallel``: ``"keep"`` (more engines), ``"scale"`` (bigger ones) or a number.
    ``rules`` maps your keys to a rule (``nbgpu.scale.RULES``). With ``model`` (an HF config) and
    a GPU size the KV cache per GPU is checked. No inventory is taken unless asked for.
    """
    source = text_source = None
    if isinstance(config, str | os.PathLike):
        source = os.fspath(config)
        text_source = read_config(read_text(config, "config"), source)
        if not isinstance(text_source.data, Mapping):
            raise UserInputError(f"config {source!r} is not a mapping of keys to values")
        config = text_source.data
    shape = None if model is None else _scale_model(model)
    given = whole_number("gpus_per_node", gpus_per_node)
    node_size = None if given is None else (given, "--gpus-per-node")
    gpus: dict[str, tuple[Candidate, ...]] = {}  # node → its GPUs ("": the one fleet)
    if inventory is not None and cluster is not None:
        raise UserInputError("scale: give inventory= (--fleet: one node) or cluster=, not both")
    if inventory is not None or cluster is not None:
        gpus = _cluster(cluster)[0] if cluster is not None else {"": _gpus(inventory, environ)[0]}
        where = "the fleet's nodes" if inventory is not None else "the cluster's nodes"
        node_size = node_size or (min(len(c) for c in gpus.values()), where)
        usable = min(sum(c.usable for c in g) for g in gpus.values())
        to_gpus = usable * (nodes or len(gpus)) if to_gpus is None else to_gpus
        sizes = (c.memory_total_bytes for g in gpus.values() for c in g if c.memory_total_bytes)
        gpu_memory_bytes = gpu_memory_bytes or min(sizes, default=None)  # the smallest GPU
    if to_gpus is None and nodes is not None and gpus_per_node is not None:
        to_gpus = nodes * gpus_per_node
    if to_gpus is None:
        raise UserInputError(
            "scale: pass to_gpus=N (--to N), inventory= (--fleet), or nodes= with gpus_per_node="
        )
    result = scale_config(
        config,
        to_gpus=to_gpus,
        from_gpus=from_gpus,
        batch=batch,
        tensor_parallel=tensor_parallel,
        rules=rules,
        model=shape,
        max_model_len=max_model_len,
        precision=precision,
        devices=[c.nvml_index for c in order_pool(gpus[""])] if "" in gpus else None,
        gpu_memory_bytes=gpu_memory_bytes,
        source=source,
        nodes=nodes,
        node_size=node_size,
    )
    if gpus:
        result = replace(result, problems=(*result.problems, *short_nodes(result, gpus)))
    if text_source is None:
        return result
    new_text, notes = rescaled_text(text_source, result)
    notes_ = tuple(Problem("warn", "script", "script", note) for note in notes)
    return replace(
        result,
        form=text_source.form,
        original_text=text_source.text,
        new_text=new_text,
        warnings=result.warnings + notes_,
    )


def _spec_cluster(spec: re.Match[str]) -> tuple[dict[str, tuple[Candidate, ...]], str, bool]:
    """``24x(8xH100)``: 24 simulated nodes of one fleet; ``24x(8)``: 24 described nodes."""
    names = [f"n{i + 1}" for i in range(whole_number("nodes", int(spec[1]), 100_000))]
    if not spec[2].lstrip("-").isdigit():
        found, _, simulated = _cluster(dict.fromkeys(names, spec[2]))
        return found, spec[0].strip(), simulated
    ok = Candidate(0, None, None, None, None, usable=True, grade=0, health="ok")
    per_node = whole_number("GPUs per node", int(spec[2]), 64)  # as a fleet spec's
    source = f"{len(names)} described nodes of {per_node} GPUs (not seen)"
    gpus = tuple(replace(ok, nvml_index=i) for i in range(per_node))
    return dict.fromkeys(names, gpus), source, False


def _cluster(cluster: Any) -> tuple[dict[str, tuple[Candidate, ...]], str, bool]:
    """(node → its GPUs as candidates, where they came from, simulated?)."""
    from nbgpu.devices.inventory import Inventory  # noqa: PLC0415
    from nbgpu.devices.model import cluster_nodes, is_cluster  # noqa: PLC0415

    if hasattr(cluster, "to_dict") and hasattr(cluster, "nodes"):
        cluster = cluster.to_dict()  # a ClusterStatus
    where, source = "the cluster", "the cluster"
    if isinstance(cluster, str | os.PathLike):
        path, name = user_path(cluster), f"cluster file {os.fspath(cluster)!r}"
        cluster = parse_json(read_text(path, "cluster file"), name)
        if not is_cluster(cluster):
            raise UserInputError(f"{name}: {_CLUSTER_FORMS}")
        where, source = f"cluster file {path.name!r}", path.name
    inventories: dict[str, Inventory] = {}
    if isinstance(cluster, Mapping) and is_cluster(cluster):
        try:
            documents = cluster_nodes(dict(cluster), where)
        except FleetSpecError as exc:
            raise UserInputError(str(exc)) from None
        for node, document in documents.items():
            inventories[node] = Inventory.from_dict(document, where=f"{where}, node {node}")
        simulated = any(inventory.simulated for inventory in inventories.values())
        source = str(cluster.get("source") or source)
    elif isinstance(cluster, Mapping) and cluster:  # nodes described by their fleets
        seen: dict[str, Inventory] = {}  # one snapshot per fleet: 64 nodes cost one
        for node, fleet in cluster.items():
            given = isinstance(fleet, Inventory) or (isinstance(fleet, str) and fleet.strip())
            if not isinstance(node, str) or not node or not given:
                raise UserInputError(f"cluster: node {node!r} = {fleet!r}: {_CLUSTER_FORMS}")
            try:  # a capture is read; anything else is simulated
                key = fleet if isinstance(fleet, str) else str(id(fleet))
                inventories[node] = seen.get(key) or seen.setdefault(
                    key, inventory_snapshot(fleet, {})
                )
            except FleetSpecError as exc:
                raise UserInputError(f"node {node}: {exc}") from None
        simulated = all(not isinstance(f, Inventory) or f.simulated for f in cluster.values())
        source = f"{len(inventories)} described node(s)"
    else:
        raise UserInputError(f"cluster={type(cluster).__name__}: {_CLUSTER_FORMS}")
    # A node without a GPU has none to give; the plan says so for that node.
    gpus = {
        id(i): () if i.nvml_error else candidates_from_inventory(i) for i in inventories.values()
    }
    return {node: gpus[id(i)] for node, i in inventories.items()}, source, simulated


def plan_from_json(
    source: str | os.PathLike[str], *, run: int | str | None = None
) -> Plan | NodesPlan:
    """Load a plan written by ``Plan.to_json()`` (JSON text or a file path).

    A sweep file (``SweepPlan.to_json()``) needs ``run``: its index or name (``"run2"``).
    """
    text = source if isinstance(source, str) and source.lstrip().startswith("{") else None
    where = "plan JSON"
    if text is None:
        where = f"plan file {os.fspath(source)!r}"
        text = read_text(source, "plan file")
    data = parse_json(text, where)
    if isinstance(data, dict) and "nbgpu_nodes_plan" in data:
        if run is not None:
            raise UserInputError(f"run={run!r}: {where} is a plan across nodes, not a sweep")
        return _plan_file(data, NodesPlan, "nbgpu_nodes_plan")
    if isinstance(data, dict) and "nbgpu_sweep" in data:
        swept = _plan_file(data, SweepPlan, "nbgpu_sweep")
        names = [r.name for r in swept.runs]
        if run is None:
            raise UserInputError(
                f"{where} is a sweep of {len(names)} runs; pass run=0..{len(names) - 1} or a name"
            )
        if isinstance(run, int) and not isinstance(run, bool) and 0 <= run < len(names):
            return swept.runs[run]
        if run in names:
            return swept.runs[names.index(run)]
        raise UserInputError(
            f"run={run!r}: the sweep has runs 0..{len(names) - 1} ({', '.join(map(str, names))})"
        )
    if run is not None:
        raise UserInputError(f"run={run!r}: {where} is a single plan, not a sweep")
    return _plan_file(data, Plan, "nbgpu_plan")


def _plan_file(data: Any, kind: type[P], key: str) -> P:
    """The *kind* of plan in *data*, its format key checked; older versions read as today's."""
    got = data.get(key) if isinstance(data, dict) else None
    if got != PLAN_FILE_FORMAT:
        raise UserInputError(
            f"plan JSON: {key} = {json.dumps(got)}; expected {PLAN_FILE_FORMAT} "
            "(write one with `nbgpu plan ... --json > plan.json`)"
        )
    prefix = "sweep JSON" if kind is SweepPlan else "plan JSON"
    return from_data(kind, _upgraded(data), prefix=prefix)


def _upgraded(data: Any, key: str = "") -> Any:
    """Older plan files as today's: a left-out GPU's health was "verdict" (before 0.1), its
    problems "reasons" and "fixes"; problems and warnings had no severity nor subject."""
    if isinstance(data, list):
        return [_upgraded(item, key) for item in data]
    if not isinstance(data, dict):
        return data
    out = {k: _upgraded(v, k) for k, v in data.items()}
    if "nvml_index" in out and "verdict" in out and "health" not in out:
        out["health"] = out.pop("verdict")
    if "nvml_index" in out and "reasons" in out and "problems" not in out:
        where, fixes = f"GPU {out['nvml_index']}", out.pop("fixes", [])
        problems = (
            Problem("bad", "unusable", where, reason, tuple(fixes) if n == 0 else ())
            for n, reason in enumerate(out.pop("reasons"))
        )
        out["problems"] = [to_data(p) for p in problems]
    if key in _SEVERITY_OF and "message" in out and "severity" not in out:
        out = {"severity": _SEVERITY_OF[key], "subject": "plan", **out}
    return out
