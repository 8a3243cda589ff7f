"""The plan face's arguments: one parser for ``nbgpu plan`` and ``%gpu_plan``, so their flags
never drift apart. It parses and calls :mod:`nbgpu.plan`; the face prints or shows the result.
"""

import argparse
import functools
import json
import os
from collections.abc import Sequence
from typing import Any

from nbgpu.errors import UserInputError, user_path

__all__ = [
    "add_plan_arguments", "flags_not_read", "one_box_keywords", "plan_from_args",
    "render_plan_output",
]  # fmt: skip


def _pairs(items: Sequence[str], flag: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserInputError(f"{flag} {item!r}: expected NAME=VALUE, e.g. {flag} group=8")
        out[key] = int(value) if value.isdigit() else value
    return out


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    n: dict[str, Any] = {"type": int, "metavar": "N"}  # a whole number, unset (None) by default
    flag = functools.partial(a, action="store_true")
    many = functools.partial(a, action="append", default=[])  # repeatable: a list
    a(
        "allocation",
        nargs="?",
        help="roles: 'sglang.d1t1p1+d3t1p1', 'd4t1p1' or 'inference:1,train:3'",
    )
    a(
        "--fleet",
        metavar="SPEC|FILE",
        help="plan for this fleet (spec, scenario or status JSON) instead of here",
    )
    flag("--slurm", help="plan across the SLURM allocation's nodes (each node's GPUs, seen there)")
    a(
        "--nodes",
        **n,
        help="nodes for the job (with --slurm or a cluster --fleet; default: all that fit)",
    )
    a(
        "--nproc-per-node",
        type=int,
        metavar="P",
        help="ranks (GPUs) per node, with --nodes (default: the most the nodes allow)",
    )
    a("--gpus-per-node", **n, help="GPUs in each node (with --nodes or --scale)")
    a("--partition", metavar="P", help="with --slurm")
    a("--gpus", **n, help="GPUs for the job")
    a("--require", metavar="0,1", help="GPUs that must be used")
    a("--exclude", metavar="0", help="GPUs never to use")
    a("--batch", **n, help="global batch size")
    a("--micro", **n, help="micro batch per GPU")
    a("--accum", **n, help="gradient accumulation")
    a(
        "--max-micro",
        metavar="N|auto",
        help="largest micro batch per GPU; auto: computed from --model and --seq-len",
    )
    many(
        "--divisor",
        metavar="NAME=K",
        help="the global batch must divide by K (e.g. group=8); repeatable",
    )
    many(
        "--step-divisor",
        metavar="NAME=K",
        help="ranks x micro batch must divide by K (TRL num_generations)",
    )
    a(
        "--model",
        metavar="7B|NAME|config.json",
        help="parameter count, model name (Qwen/Qwen2.5-7B-Instruct) or HF config: memory check",
    )
    a(
        "--seq-len",
        **n,
        help="tokens per sample: adds activations, logits and KV cache to the memory check",
    )
    flag("--checkpointing", help="count activations with full activation checkpointing")
    a("--precision", help="bf16 (default), fp16 or fp32")
    a("--strategy", default="ddp", help="ddp, zero1, zero2, zero3 or fsdp")
    a("--optimizer", default="adamw", help="adamw, adam or sgd")
    a(
        "--base-port",
        type=int,
        default=29500,
        metavar="P",
        help="first port to try for the rendezvous",
    )
    a(
        "--sweep",
        type=int,
        metavar="RUNS",
        help="split the box into RUNS disjoint runs (distinct ports)",
    )
    a("--per-run", type=int, metavar="K", help="GPUs per sweep run")
    flag("--share", help="with --sweep: runs may use GPUs that other jobs are using")
    a(
        "--scale",
        metavar="CONFIG",
        help="rescale a YAML/JSON config or a launch script of Hydra overrides to --to GPUs",
    )
    a("--to", **n, help="with --scale: GPUs after")
    a(
        "--output",
        "-o",
        metavar="FILE",
        help="with --scale: write the rescaled config (same form and layout) to FILE",
    )
    a(
        "--from",
        dest="from_gpus",
        **n,
        help="with --scale: GPUs before (default: read from the config)",
    )
    flag("--keep-batch", help="with --scale: keep global batch sizes (default: scale them)")
    a("--tp", default="keep", metavar="keep|scale|N", help="with --scale: tensor-parallel size")
    many(
        "--rule",
        metavar="KEY=RULE",
        help="with --scale: how to treat a key (scale, keep, per_gpu...)",
    )
    a("--max-model-len", **n, help="with --scale: sequence length for the KV-cache check")
    a(
        "--gpu-memory",
        metavar="SIZE",
        help="with --scale: memory per GPU, e.g. 48G (default: from the fleet)",
    )
    out = p.add_mutually_exclusive_group().add_argument
    out("--json", action="store_true", help="print JSON (plan files for --plan)")
    out("--diff", action="store_true", help="with --scale: a unified diff")
    out("--yaml", action="store_true", help="with --scale: the new YAML")
    out("--overrides", action="store_true", help="with --scale: Hydra key=value overrides")


def plan_from_args(args: argparse.Namespace) -> Any:
    from nbgpu import plan as planning  # noqa: PLC0415  (heavy-ish; only when planning)

    common = _job_keywords(args)
    if args.scale is not None:
        from nbgpu.sizes import parse_size  # noqa: PLC0415

        memory = args.gpu_memory
        if args.nproc_per_node is not None:
            raise UserInputError(
                "--nproc-per-node plans a launch; with --scale the node size is --gpus-per-node G"
            )
        if args.slurm and args.fleet is not None:
            raise UserInputError("--slurm asks the nodes themselves; --fleet describes them")
        cluster = _slurm_cluster(args) if args.slurm else None
        if _is_cluster_file(args.fleet):
            cluster, args.fleet = args.fleet, None
        result = planning.scale(
            args.scale,
            to_gpus=args.to,
            from_gpus=args.from_gpus,
            batch="keep" if args.keep_batch else "scale",
            tensor_parallel=int(args.tp) if args.tp.isdigit() else args.tp,
            rules=_pairs(args.rule, "--rule") or None,
            model=args.model,
            max_model_len=args.max_model_len,
            precision=args.precision,
            inventory=args.fleet,
            cluster=cluster,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            gpu_memory_bytes=None if memory is None else parse_size(memory, "--gpu-memory "),
        )
        return result if args.output is None else result.save(args.output)
    if args.diff or args.yaml or args.overrides or args.output:
        raise UserInputError("--diff, --yaml, --overrides and --output go with --scale CONFIG")
    node_flags = args.slurm or {args.nodes, args.nproc_per_node, args.gpus_per_node} != {None}
    if node_flags or _is_cluster_file(args.fleet):
        return _across_nodes(args, common)
    if args.partition is not None:
        raise UserInputError("--partition goes with --slurm (plan across a SLURM allocation)")
    if args.share and args.sweep is None:
        raise UserInputError("--share goes with --sweep RUNS (runs on GPUs other jobs use)")
    if args.sweep is not None:
        return planning.sweep(
            args.sweep,
            args.per_run,
            allocation=args.allocation,
            exclude=args.exclude,
            share=args.share,
            **common,
        )
    return planning.plan(**one_box_keywords(args))


def _job_keywords(args: argparse.Namespace) -> dict[str, Any]:
    """What every kind of plan takes from the flags: the job (batch, model, memory)."""
    return {
        "global_batch": args.batch,
        "micro_batch": args.micro,
        "grad_accum": args.accum,
        "max_micro_batch": args.max_micro,  # make_job reads "4" and "auto"
        "divisors": _pairs(args.divisor, "--divisor") or None,
        "step_divisors": _pairs(args.step_divisor, "--step-divisor") or None,
        "model": args.model,
        "precision": args.precision or "bf16",
        "strategy": args.strategy,
        "optimizer": args.optimizer,
        "base_port": args.base_port,
        "inventory": args.fleet,
        "seq_len": args.seq_len,
        "activation_checkpointing": args.checkpointing,
    }


def one_box_keywords(args: argparse.Namespace) -> dict[str, Any]:
    """``nbgpu.plan``'s keywords for a plan on one box (``%gpu_plan --widget`` starts here)."""
    where = {"num_gpus": args.gpus, "require": args.require, "exclude": args.exclude}
    return {"allocation": args.allocation, **where, **_job_keywords(args)}


def flags_not_read(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The flags given that a plan on one box does not read (found by setting each back to
    its default: no list of flags to keep in step with the parser)."""
    read = one_box_keywords(args)
    return [
        max(action.option_strings, key=len)
        for action in parser._actions
        if action.option_strings
        and getattr(args, action.dest) != action.default
        and one_box_keywords(argparse.Namespace(**{**vars(args), action.dest: action.default}))
        == read
    ]


def _is_cluster_file(fleet: str | None) -> bool:
    """Whether --fleet names what `nbgpu status --slurm --json` writes (fleets per node)."""
    if fleet is None or not fleet.endswith(".json"):
        return False
    from nbgpu.devices.model import is_cluster  # noqa: PLC0415

    try:
        return is_cluster(json.loads(user_path(fleet).read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return False  # the fleet reader says what is wrong with it


def _across_nodes(args: argparse.Namespace, common: dict[str, Any]) -> Any:
    from nbgpu import plan as planning  # noqa: PLC0415

    for flag, value in (
        ("--gpus", args.gpus),
        ("--require", args.require),
        ("--exclude", args.exclude),
        ("--sweep", args.sweep),
    ):
        if value is not None:
            raise UserInputError(
                f"{flag} plans one box; across nodes the plan chooses each node's GPUs"
            )
    fleet = common.pop("inventory")
    common.pop("base_port")  # the rendezvous port is picked on the first node at launch
    if args.slurm + (fleet is not None) + (args.gpus_per_node is not None) > 1:
        raise UserInputError(
            "--slurm asks the nodes themselves; --fleet, --gpus-per-node describe them: give one"
        )
    if not args.slurm and fleet is None and args.gpus_per_node is None:
        raise UserInputError(
            "--nodes: which nodes? add --slurm (asked through srun), --fleet cluster.json (from "
            "`nbgpu status --slurm --json`) or '24x(8xH100)', or --gpus-per-node G (described)"
        )
    cluster = fleet
    if args.gpus_per_node is not None:  # described: N nodes of G GPUs, not seen
        if args.nodes is None:
            raise UserInputError("--gpus-per-node G describes --nodes N nodes: add --nodes N")
        cluster = f"{args.nodes}x({args.gpus_per_node})"
    if args.slurm:
        cluster = _slurm_cluster(args)
    shape = {"nodes": args.nodes, "nproc_per_node": args.nproc_per_node}
    return planning.nodes(cluster, allocation=args.allocation, **shape, **common)


def _slurm_cluster(args: argparse.Namespace) -> Any:
    """The nodes as they see themselves (through srun): a plan chooses among them, so it
    looks at all it may choose from, the allocation's or every node of the partition up."""
    from nbgpu.launch.config import SlurmOptions  # noqa: PLC0415
    from nbgpu.launch.slurm import cluster_status, nodes_up  # noqa: PLC0415

    look = args.nodes
    if not os.environ.get("SLURM_JOB_ID"):
        # More than are up: the request check says so in SLURM's terms.
        look = max(args.nodes or 0, nodes_up(args.partition, os.environ)) or None
    options = SlurmOptions(partition=args.partition)
    return cluster_status(nodes=look, options=options, environ=os.environ)


def render_plan_output(result: Any, args: argparse.Namespace) -> str | None:
    """The text a face prints for --json/--diff/--yaml/--overrides (None: show the result)."""
    for flag, method in (("json", "to_json"), ("diff", "diff"), ("yaml", "to_yaml")):
        if getattr(args, flag):
            return str(getattr(result, method)())
    return "\n".join(result.to_overrides()) if args.overrides else None
