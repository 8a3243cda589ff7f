"""Scaling a training config from N GPUs to M: every change explained, combinations checked.

Moving a 2-GPU verl/VAGEN config to 4 GPUs by hand means editing a dozen coupled values;
:func:`scale_config` does it from rules (:data:`RULES`; a key is matched by its last name anywhere
in the config, so nested YAML, flat ``a.b.c`` keys and Hydra overrides all work). A global batch is
scaled with the GPU count (``batch="scale"``, per-GPU work constant) or kept (``"keep"``), then
moved to the nearest value verl accepts; a per-engine budget follows the sequences each inference
engine serves. The new values then pass the checks verl and vLLM make at start and, with a model and
a GPU size, the KV cache each GPU can hold is checked with ``reference/memory.md`` §5c's formula.

``nbgpu.plan.scale()`` is the face: it reads the file (``files``: YAML, JSON or a launch
script) and the inventory, then calls :func:`scale_config`.

This package only re-exports, from modules that work on plain data: importing it (or
:class:`ScalePlan`) never loads ruamel.yaml or the shell lexer (``files``, ``script`` and
``yamldoc`` are imported when a file is read or written), the inventory, sockets or processes.
"""

from nbgpu.scale.checks import KV_RESERVE_BYTES, KvCheck
from nbgpu.scale.rules import RULES, builtin_shape
from nbgpu.scale.scaler import ScalePlan, ScaleStep, scale_config

__all__ = ["KV_RESERVE_BYTES", "RULES", "KvCheck", "ScalePlan", "ScaleStep", "builtin_shape",
           "scale_config"]  # fmt: skip
