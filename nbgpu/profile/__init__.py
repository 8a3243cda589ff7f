"""Profile: memory through every phase of a process, on every rank, as records and reports.

Layout: ``phases`` (``nbgpu.phase``) · ``recorder`` (this process's and this node's
memory from /proc, CUDA figures only where CUDA already runs; the phase stack, the
crash-safe JSONL records, the sampling thread) · ``records`` (reading the JSONL back,
tolerating a truncated last line; the ranks on one clock: series, the node's sum, peaks,
the import storm) · ``report`` (the phase x rank report, its figure drawn in) · ``live``
(following a running job's records) · ``figure`` (the matplotlib figure, imported only
when drawn).

The recording side (``phases``, ``recorder``) runs inside ranks: standard library only.
Nothing here imports ``nbgpu.launch`` or ``nbgpu.notebook``; pandas and matplotlib are
imported inside the functions that draw or tabulate.
"""

from __future__ import annotations

__all__: list[str] = []
