"""Two nodes: node 0's rank finishes and exits; node 1's rank writes a checkpoint for 340 s."""

import os
import time

import torch
import torch.distributed as dist
from chatter import chatter

dist.init_process_group(backend="gloo")
chatter("train", 150, every=0.01)
dist.all_reduce(torch.ones(100))
dist.destroy_process_group()
rank = int(os.environ["RANK"])
if rank:
    for part in range(34):
        print(f"rank {rank}: writing checkpoint part {part}/34 to slow storage", flush=True)
        time.sleep(10)
print(f"rank {rank}: done", flush=True)
