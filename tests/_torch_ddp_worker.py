"""Run by tests/test_torch_distributed.py: train the tied TinyGPT under DistributedDataParallel
on 2 CPU processes (gloo), with `optimisers.update_` as the optimiser, and save each rank's
final parameters. Usage: python _torch_ddp_worker.py RANK PORT OUTDIR STEPS, once per rank."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import optimisers as opt  # noqa: E402
from _torch_models import batch, lm_loss, make_gpt  # noqa: E402

WORLD = 2


def rule():
    return opt.Adam(1e-2)


def run(rank, port, outdir, steps):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        model = make_gpt(torch.float64)
        ddp = DistributedDataParallel(model)
        state = opt.setup(rule(), ddp.module)
        inputs, targets = batch()
        shard = slice(rank * len(inputs) // WORLD, (rank + 1) * len(inputs) // WORLD)
        for _ in range(steps):
            ddp.zero_grad()
            # DDP averages gradients over ranks: equal shards give the full-batch mean gradient
            lm_loss(ddp, inputs[shard], targets[shard]).backward()
            state, out = opt.update_(state, ddp.module, opt.grads(ddp.module))
            assert out is model and model.head.weight is model.embed.weight
        torch.save(
            {name: p.detach() for name, p in model.named_parameters(remove_duplicate=False)},
            os.path.join(outdir, f"rank{rank}.pt"),
        )
        # both ranks done before either tears gloo down: a rank that destroys the group while the
        # other still talks to it can abort the other ("terminate called without an active
        # exception", seen once in a loaded CI run)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
