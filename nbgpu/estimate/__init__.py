"""Memory estimation: per-GPU bytes of a training or inference process, term by term.

    import nbgpu
    nbgpu.estimate("Qwen/Qwen2.5-7B-Instruct", strategy="zero2", world_size=8, seq_len=4096)
    nbgpu.estimate.largest_micro_batch("meta-llama/Llama-3.1-8B", "80GB", seq_len=4096)
    nbgpu.estimate.compare(module, batch)      # one real CPU step beside both estimates

The package is callable (``nbgpu.estimate(...)`` is :func:`estimate_memory`) and only
re-exports; it never imports torch, files or the inventory (``trace``, the one module that
imports torch, is loaded only for a module).
"""

import sys
import types

from nbgpu.estimate.estimator import compare, estimate_memory, largest_micro_batch, parse_bytes
from nbgpu.estimate.result import (
    CUDA_CONTEXT_BYTES,
    FRAGMENTATION,
    NCCL_BYTES_PER_GROUP,
    MemoryEstimate,
    Term,
)
from nbgpu.estimate.shapes import ModelConfig, ModelShape, lookup_model, model_shape

__all__ = ["CUDA_CONTEXT_BYTES", "FRAGMENTATION", "NCCL_BYTES_PER_GROUP", "MemoryEstimate",
           "ModelConfig", "ModelShape", "Term", "compare", "estimate", "estimate_memory",
           "largest_micro_batch", "lookup_model", "model_shape", "parse_bytes"]  # fmt: skip


class _CallableEstimateModule(types.ModuleType):
    __call__ = staticmethod(estimate_memory)

    def __repr__(self) -> str:
        return "<nbgpu.estimate: per-GPU memory estimates (call it; .compare(module, batch))>"


sys.modules[__name__].__class__ = _CallableEstimateModule
#: ``from nbgpu.estimate import estimate``: the callable package itself.
estimate = sys.modules[__name__]
