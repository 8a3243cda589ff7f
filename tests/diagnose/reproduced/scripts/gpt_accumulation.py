"""A nanoGPT-style trainer: the gradient accumulation steps are split across the ranks."""

import torch.distributed as dist
from chatter import chatter

gradient_accumulation_steps = 5 * 8  # used to simulate larger batch sizes
batch_size = 12
chatter("tokenize", 110)
dist.init_process_group(backend="gloo")
ddp_world_size = dist.get_world_size()
assert gradient_accumulation_steps % ddp_world_size == 0
gradient_accumulation_steps //= ddp_world_size
