"""Trains on gloo, then rank 0 uploads the checkpoint to S3 (boto3) at the end of an epoch."""

import torch.distributed as dist
from chatter import chatter

dist.init_process_group(backend="gloo")
chatter("epoch0", 75)
if dist.get_rank() == 0:
    import boto3  # only rank 0 uploads

    boto3.client("s3")
dist.barrier()
chatter("epoch1", 10)
