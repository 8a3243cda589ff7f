"""Scaling a training config from N GPUs to M: every change explained, combinations checked.

Moving a 2-GPU verl/VAGEN config to 4 GPUs by hand means editing a dozen coupled values;
:func:`scale_config` does it from rules. Each recognised key has a *rule* (keys are matched
by their last name anywhere in the config, so nested YAML, flat ``a.b.c`` keys and Hydra
overrides all work; verl / VAGEN keys in parentheses):

- ``global_batch`` (``train_batch_size``, ``ppo_mini_batch_size``, ``ppo_micro_batch_size``,
  ``log_prob_micro_batch_size``): scaled with the GPU count (``batch="scale"``, per-GPU work
  constant) or kept (``"keep"``), then moved to the nearest valid value;
- ``per_gpu`` (``*_micro_batch_size_per_gpu``): unchanged; ``tensor_parallel``
  (``tensor_model_parallel_size``): kept (default), scaled, or set;
- ``per_engine`` (``max_num_seqs``, ``max_num_batched_tokens``): scaled with the sequences
  each inference engine serves (batch ÷ engines);
- ``memory_fraction`` (``gpu_memory_utilization``): kept, a fraction of each GPU's memory,
  whose size does not change; KV-checked;
- ``gpu_count`` (``n_gpus_per_node``): target ÷ ``nnodes``; ``devices``
  (``CUDA_VISIBLE_DEVICES``): the target GPUs, a list or "0,1,2,3"; ``keep``: left as is.

Valid means what verl checks at start: ``train_batch_size × rollout.n`` divisible by the
GPU count; ``ppo_mini_batch_size × n ÷ (GPUs ÷ ulysses_sp)`` ≥ 1 and divisible by the micro
batch per GPU; mini ≤ train batch; the rollout world divisible by the tensor-parallel size
(and the attention heads too, as vLLM requires); ``max_num_batched_tokens`` ≥
``max_num_seqs`` and ≥ the maximum model length. With a model and a GPU size, the KV cache
each GPU can hold is checked with ``reference/memory.md`` §5c's formula.

Modules: ``values`` (a config as entries; value text; bash arithmetic) · ``rules`` (the
rules, verl's start-up checks and the KV-cache check) · ``scaler`` (:func:`scale_config`
and :class:`ScalePlan`) · ``files`` (a file read by its form and rewritten in its own
layout) · ``script`` (reading a launch script) · ``yamldoc`` (ruamel.yaml). ``nbgpu.plan.scale()``
is the face: it reads the file and the inventory, then calls :func:`scale_config`.

This package only re-exports, from modules that work on plain data: importing it (or
:class:`ScalePlan`) never loads ruamel.yaml or the shell lexer (``files``, ``script`` and
``yamldoc`` are imported when a file is read or written), the inventory, sockets or
processes.
"""

from nbgpu.scale.rules import KV_RESERVE_BYTES, RULES, KvCheck, builtin_shape
from nbgpu.scale.scaler import ScalePlan, ScaleStep, scale_config

__all__ = [
    "KV_RESERVE_BYTES",
    "RULES",
    "KvCheck",
    "ScalePlan",
    "ScaleStep",
    "builtin_shape",
    "scale_config",
]
