"""Placement planning: GPUs per role, ports, batch sizes, memory per GPU, sweeps, nodes.

    import nbgpu
    p = nbgpu.plan("sglang.d1t1p1+d3t1p1", global_batch=8)      # roles on GPUs, checked
    p.ok, p.problems, p.role("train").cuda_visible_devices, p.alternatives
    s = nbgpu.plan.sweep(runs=4, gpus_per_run=2)                 # disjoint sets, own ports
    n = nbgpu.plan.nodes(cluster, nodes=2, nproc_per_node=4)     # one job across nodes
    c = nbgpu.plan.scale("ppo_2gpu.yaml", to_gpus=4)             # every change explained
    print(c.diff()); print(c.to_yaml())

This package is callable (``nbgpu.plan(...)`` is :func:`plan`) and only re-exports the
functions of ``api.py`` and the result types of the pure modules beside it. Importing it or a
result type loads no YAML or shell parser, and never imports IPython, pynvml or psutil (the
inventory is imported when a snapshot is taken).
"""

import sys
import types

from nbgpu.plan.api import nodes, plan, plan_from_json, scale, sweep
from nbgpu.plan.job import BatchCheck, BatchOption, Split
from nbgpu.plan.multinode import NodesPlan
from nbgpu.plan.result import (
    Alternative,
    ExcludedGpu,
    MemoryCheck,
    MemoryLine,
    Plan,
    PlannedGpu,
    RolePlan,
)
from nbgpu.plan.sweep import SweepPlan
from nbgpu.scale import KvCheck, ScalePlan, ScaleStep

__all__ = ["Alternative", "BatchCheck", "BatchOption", "ExcludedGpu", "KvCheck", "MemoryCheck",
           "MemoryLine", "NodesPlan", "Plan", "PlannedGpu", "RolePlan", "ScalePlan", "ScaleStep",
           "Split", "SweepPlan", "nodes", "plan", "plan_from_json", "scale", "sweep"]  # fmt: skip


class _CallablePlanModule(types.ModuleType):
    __call__ = staticmethod(plan)


sys.modules[__name__].__class__ = _CallablePlanModule
