"""Launching distributed jobs: torchrun processes, their trees, logs and results.

``launch/`` owns processes. It may import ``devices/`` (to validate GPUs) and the
standard library, psutil and filelock; never IPython, ipywidgets or matplotlib (the
notebook face renders), and never torch: what runs inside the agent and the ranks is ``nbgpu.rank``.
"""

__all__: list[str] = []
