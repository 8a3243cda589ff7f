"""A DDP script written for a GPU box: cuda:LOCAL_RANK, as PyTorch's DDP tutorial picks it."""

import os

import torch
import torch.distributed as dist
from chatter import chatter


def ddp_setup() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")


if __name__ == "__main__":
    chatter("prep", 120)  # the data pipeline's warm-up prints before the GPUs are set up
    ddp_setup()
