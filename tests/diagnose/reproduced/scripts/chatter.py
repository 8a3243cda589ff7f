"""Training chatter the reproduction scripts print before they fail (loss, lr, shards)."""

from __future__ import annotations

import os
import random
import time


def chatter(tag: str, steps: int, every: float = 0.0) -> None:
    rank = int(os.environ.get("RANK", "0"))
    rng = random.Random(rank)  # noqa: S311  (made-up loss curves, not secrets)
    loss = 2.3 + rank * 0.01
    for step in range(steps):
        loss *= 0.995 + rng.random() * 0.004
        lr = 3e-4 * min(1, (step + 1) / 50)
        tokens = 9000 + rng.randint(-400, 400)
        line = f"rank {rank} step {step:4d} loss {loss:.4f} lr {lr:.2e} tokens/s {tokens}"
        print(f"[{tag}] {line}", flush=True)
        if step % 25 == 0:
            samples = rng.randint(4000, 5000)
            shard = f"shard {step // 25} of {steps // 25}, {samples} samples"
            print(f"[{tag}] rank {rank} data: {shard}", flush=True)
        if every:
            time.sleep(every)
