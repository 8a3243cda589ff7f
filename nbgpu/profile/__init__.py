"""Profile: memory through every phase of a process, on every rank, as records and reports.

The recording side (``phases``, ``recorder``) runs inside ranks: standard library only.
Nothing here imports ``nbgpu.launch`` or ``nbgpu.notebook``; pandas and matplotlib are
imported inside the functions that draw or tabulate.
"""

__all__: list[str] = []
