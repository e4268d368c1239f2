"""Run by tests/test_torch_distributed.py: train the tied TinyGPT sharded by FSDP2's
`fully_shard` on 2 CPU processes (gloo), once per optimiser (torch.optim.AdamW, the
`optimisers.torch.Optimizer` adapter, `optimisers.update_`), and save each run's final
parameters (gathered). Usage: python _torch_fsdp_worker.py RANK PORT OUTDIR STEPS."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import optimisers as opt  # noqa: E402
import optimisers.torch  # noqa: E402
from _torch_models import batch, lm_loss, make_gpt  # noqa: E402

WORLD = 2
LR, DECAY, OMEGA = 1e-2, 0.1, 0.05


def rules():
    """The runs besides torch.optim.AdamW: AdamW (torch's fused kernel on the local shards),
    and a chain whose ClipNorm needs each parameter's global norm."""
    chain = opt.OptimiserChain(opt.ClipNorm(OMEGA), opt.Momentum(LR, 0.9))
    return {"adamw": opt.AdamW(LR, lambd=DECAY), "clip_momentum": chain}


def sharded_gpt(mesh):
    model = make_gpt(torch.float64)
    fully_shard(model, mesh=mesh)
    assert model.head.weight is model.embed.weight  # FSDP2 keeps the tie: one DTensor
    return model


class FusedSpy:
    """Stands in for torch._fused_adamw_ and records whether each call got plain tensors (the
    local shards) rather than DTensors."""

    def __init__(self):
        self.real, self.calls = torch._fused_adamw_, []

    def __call__(self, params, *args, **kwargs):
        self.calls.append(all(type(p) is torch.Tensor for p in params))
        return self.real(params, *args, **kwargs)

    def __enter__(self):
        torch._fused_adamw_ = self
        return self

    def __exit__(self, *exc):
        torch._fused_adamw_ = self.real


def train(kind, mesh, rank, steps):
    with FusedSpy() as spy:
        out = _train(kind, mesh, rank, steps)
    if kind in ("adapter", "adamw"):
        out["fused_on_local_shards"] = bool(spy.calls) and all(spy.calls)
    return out


def _train(kind, mesh, rank, steps):
    model = sharded_gpt(mesh)
    if kind == "torch":
        torch_opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    elif kind == "adapter":
        torch_opt = optimisers.torch.Optimizer(model, opt.AdamW(LR, lambd=DECAY))
    else:
        state = opt.setup(rules()[kind], model)
        pure_agrees = True
    inputs, targets = batch()
    shard = slice(rank * len(inputs) // WORLD, (rank + 1) * len(inputs) // WORLD)
    for _ in range(steps):
        model.zero_grad()
        # FSDP2 averages gradients over ranks: equal shards give the full-batch mean gradient
        lm_loss(model, inputs[shard], targets[shard]).backward()
        if kind in ("torch", "adapter"):
            torch_opt.step()
        else:
            grads = opt.grads(model)
            # the pure update's model is new module objects that FSDP2 does not manage (training
            # goes on with update_), but its values must equal the in-place step's bit for bit
            _, pure = opt.update(state, model, grads)
            state, out = opt.update_(state, model, grads)
            assert out is model and pure.head.weight is pure.embed.weight
            pure_agrees &= all(
                torch.equal(p.full_tensor(), q.full_tensor())
                for p, q in zip(pure.parameters(), model.parameters())
            )
        assert model.head.weight is model.embed.weight
    out = {name: p.full_tensor().detach() for name, p in model.named_parameters(remove_duplicate=False)}
    if kind in rules():
        out["pure_agrees"] = pure_agrees
    return out


def setup_before_sharding_error(mesh):
    model = make_gpt(torch.float64)
    state = opt.setup(opt.Adam(LR), model)
    fully_shard(model, mesh=mesh)
    inputs, targets = batch()
    lm_loss(model, inputs, targets).backward()
    before = {n: p.full_tensor() for n, p in model.named_parameters()}
    try:
        opt.update_(state, model, opt.grads(model))
    except ValueError as e:
        message = str(e)
    else:
        message = "no error"
    unchanged = all(torch.equal(p.full_tensor(), before[n]) for n, p in model.named_parameters())
    return {"message": message, "unchanged": unchanged}


def run(rank, port, outdir, steps):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        out = {kind: train(kind, mesh, rank, steps) for kind in ["torch", "adapter", *rules()]}
        out["setup_before_sharding"] = setup_before_sharding_error(mesh)
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
        dist.barrier()  # both ranks done before either tears gloo down (see _torch_ddp_worker)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
