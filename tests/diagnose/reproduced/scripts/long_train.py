"""A long gloo training loop: an all-reduce every 25 steps, progress on every step."""

import torch
import torch.distributed as dist
from chatter import chatter

dist.init_process_group(backend="gloo")
for epoch in range(100):
    chatter(f"epoch{epoch}", 25, every=0.02)
    dist.all_reduce(torch.ones(1000))
