"""A gloo warm-up on CPU, then the model moves to cuda:LOCAL_RANK."""

import os

import torch
import torch.distributed as dist
from chatter import chatter

dist.init_process_group(backend="gloo")
chatter("cpu", 100)
model = torch.nn.Linear(8, 8).to(f"cuda:{os.environ['LOCAL_RANK']}")
