"""Run by tests/test_torch_exit.py: a few FSDP2 steps on 2 CPU processes (gloo) with one optimiser
(torch.optim.AdamW, the `optimisers.torch.Optimizer` adapter, or `optimisers.update_`), then
`destroy_process_group()`, then a record of the threads still alive in the process (Python's, and
the native ones by name from /proc) and whether the library made its thread pool.
Usage: python _torch_exit_worker.py RANK PORT OUTDIR KIND."""

from __future__ import annotations

import gc
import json
import os
import sys
import threading

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def native_threads() -> list[str]:
    names = []
    for task in sorted(os.listdir("/proc/self/task")):
        with open(f"/proc/self/task/{task}/comm") as f:
            names.append(f.read().strip())
    return sorted(names)


def train(kind: str, mesh) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    fully_shard(model, mesh=mesh)
    if kind == "torch":
        optimiser = torch.optim.AdamW(model.parameters(), lr=1e-2)
    elif kind == "adapter":
        import optimisers
        import optimisers.torch

        optimiser = optimisers.torch.Optimizer(model, optimisers.AdamW(1e-2))
    else:
        import optimisers

        state = optimisers.setup(optimisers.AdamW(1e-2), model)
    for _ in range(2):
        model.zero_grad()
        model(torch.ones(4, 8)).square().mean().backward()
        if kind == "update_":
            state, model = optimisers.update_(state, model, optimisers.grads(model))
        else:
            optimiser.step()


def run(rank: int, port: int, outdir: str, kind: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        train(kind, init_device_mesh("cpu", (2,)))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    gc.collect()
    engine = sys.modules.get("optimisers.engine.chunks")
    record = {
        "python_threads": sorted(t.name for t in threading.enumerate()),
        "native_threads": native_threads(),
        "engine_pool": None if engine is None else repr(engine._POOL),
        "optimisers_imported": "optimisers" in sys.modules,
    }
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    run(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
