"""Run by tests/test_low_bit_dtensor.py, and imported by it for the unsharded reference: step a
small tied model whose parameters are DTensors sharded over 2 CPU processes (gloo, Shard(0), as
FSDP2's `fully_shard` makes them) with `LowBit(AdamW)` and with the torch drop-ins, in every
format, and save what each run ends with, gathered. Usage: python _torch_low_bit_dtensor_worker.py
RANK PORT OUTDIR STEPS."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import optimisers as opt  # noqa: E402
import optimisers.torch as ot  # noqa: E402
from optimisers.core.state import flatten_state  # noqa: E402

WORLD = 2
FORMATS = (8, 4, "fp8")
DROP_INS = {8: ot.AdamW8bit, 4: ot.AdamW4bit, "fp8": ot.AdamWFp8}
LR, DECAY = 1e-2, 0.1
SHAPES = {
    # 6144 elements, 3072 a shard: quantised, as the threshold counts the whole array's elements
    "embed": (96, 64),
    # rows cut 5 and 4: a shard's blocks are not torch's even cut of the 1-D scales
    "wide": (9, 512),
    "square": (64, 64),  # min_size exactly
    "bias": (64,),  # below min_size: float32 moments
}
NAMES = ("embed", "head", "wide", "square", "bias")  # "head" is "embed": one array, tied


def model_of(place):
    """The model, its arrays made by `place` from the same seeded values on every process."""
    g = torch.Generator().manual_seed(0)
    arrays = {k: torch.nn.Parameter(place(torch.randn(s, generator=g))) for k, s in SHAPES.items()}
    return {k: arrays["embed" if k == "head" else k] for k in NAMES}


def grads_of(step, place):
    """Each place's gradient at `step`: the same seeded values on every process."""
    g = torch.Generator().manual_seed(100 + step)
    return {k: place(torch.randn(SHAPES["embed" if k == "head" else k], generator=g)) for k in NAMES}


def full(x):
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def train_low_bit(bits, steps, place):
    """`LowBit(AdamW)` by `update_`: the final parameters and each part of each state, gathered
    (a Quantised as its codes and flat scales)."""
    model = model_of(place)
    rule = opt.LowBit(opt.AdamW(LR, lambd=DECAY), bits=bits)
    state = opt.setup(rule, model)
    for step in range(steps):
        state, model = opt.update_(state, model, grads_of(step, place))
    assert model["head"] is model["embed"]
    out = {"params": {k: full(p).detach().clone() for k, p in model.items()}, "state": {}}
    # a checkpoint of the state, loaded into a fresh setup, steps on as the state does
    twin = _copied(model, place)
    resumed = opt.load_state_dict(opt.setup(rule, twin), _cloned(opt.state_dict(state)))
    more = grads_of(steps, place)
    (state, model), (resumed, twin) = opt.update_(state, model, more), opt.update_(resumed, twin, more)
    out["resumes_bit_for_bit"] = _same_trees((model, opt.state_dict(state)), (twin, opt.state_dict(resumed)))
    for k in SHAPES:
        parts: list = []
        flatten_state(state[k].state, parts)
        out["state"][k] = [_gathered(p, model[k]) for p in parts]
    return out


def _gathered(part, x):
    if isinstance(part, opt.Quantised):
        return {
            "codes": full(part.codes),
            "scale": full(part.scale).reshape(-1),
            "sharded_like_x": _sharded_like(part.codes, x) and _sharded_like(part.scale, x),
        }
    return full(part) if torch.is_tensor(part) else part


def _sharded_like(y, x) -> bool:
    """`y` is a DTensor placed as `x` whose shard holds part of it only (no process has it all)."""
    if not hasattr(x, "placements"):
        return True  # the unsharded reference
    return (
        hasattr(y, "placements")
        and y.placements == x.placements
        and y.device_mesh == x.device_mesh
        and y.to_local().numel() < y.numel()
    )


def train_drop_in(bits, steps, place):
    """The drop-in class of `bits` (`AdamW8bit`, ...) over the distinct parameters, the tied
    one's gradient the sum of its places': the final parameters, and `state[p]` gathered."""
    model = model_of(place)
    params = [model[k] for k in SHAPES]
    optimizer = DROP_INS[bits](params, lr=LR, weight_decay=DECAY)
    for step in range(steps):
        g = grads_of(step, place)
        g["embed"] = g["embed"] + g.pop("head")
        for k, p in zip(SHAPES, params):
            p.grad = g[k]
        optimizer.step()
    state = {
        k: {name: full(v).clone() if torch.is_tensor(v) else v for name, v in optimizer.state[p].items()}
        for k, p in zip(SHAPES, params)
    }
    quantised = ("state1", "state2", "absmax1", "absmax2")
    sharded = {
        k: all(_sharded_like(v, p) for name, v in optimizer.state[p].items() if name in quantised)
        for k, p in zip(SHAPES, params)
    }
    out = {"params": {k: full(p).detach().clone() for k, p in zip(SHAPES, params)}}
    out.update(state=state, sharded_like_x=sharded)
    # its state_dict, loaded into a fresh drop-in over copies of the parameters, steps on alike
    twin = _copied(dict(zip(SHAPES, params)), place)
    twins = [twin[k] for k in SHAPES]
    resumed = DROP_INS[bits](twins, lr=LR, weight_decay=DECAY)
    resumed.load_state_dict(_cloned(optimizer.state_dict()))
    g = grads_of(steps, place)
    g["embed"] = g["embed"] + g.pop("head")
    for k, p, q in zip(SHAPES, params, twins):
        p.grad, q.grad = g[k], g[k].clone()
    optimizer.step()
    resumed.step()
    out["resumes_bit_for_bit"] = _same_trees((params, optimizer.state_dict()), (twins, resumed.state_dict()))
    return out


def _copied(model, place):
    """New parameters with `model`'s values (a tie kept)."""
    twin = model_of(place)
    with torch.no_grad():
        for k in model:
            twin[k].copy_(model[k])
    return twin


def _cloned(tree):
    """A checkpoint's copy, its tensors sharing nothing with the state it came from."""
    if isinstance(tree, dict):
        return {k: _cloned(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_cloned(v) for v in tree)
    return tree.detach().clone() if torch.is_tensor(tree) else tree


def _same_trees(a, b) -> bool:
    """Equal bit for bit (NaN where NaN: FP8's `qmap`), every tensor gathered."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_trees(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same_trees(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        a, b = full(a), full(b)
        return torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
    return a == b


def refusals(place, mesh):
    """The messages of `setup` on a parameter whose shards would cut a block of 256, of the
    drop-in's first step on it, and of `setup` on a parameter sharded along its columns; and
    whether the parameters and the drop-in's state are unchanged."""
    from torch.distributed.tensor import Shard, distribute_tensor

    w = torch.nn.Parameter(place(torch.ones(75, 64)))  # shards of 38 and 37 rows: 2432 elements
    columns = torch.nn.Parameter(distribute_tensor(torch.ones(64, 128), mesh, [Shard(1)]))
    drop_in = ot.AdamW8bit([w])
    w.grad = place(torch.ones(75, 64))
    attempts = {
        "straddle": lambda: opt.setup(opt.LowBit(opt.AdamW(LR)), {"layers": [{"w": w}]}),
        "drop_in": drop_in.step,
        "columns": lambda: opt.setup(opt.LowBit(opt.AdamW(LR)), {"columns": columns}),
    }
    out = {}
    for kind, attempt in attempts.items():
        try:
            attempt()
        except ValueError as e:
            out[kind] = str(e)
        else:
            out[kind] = "no error"
    out["unchanged"] = bool((full(w) == 1).all() and (full(columns) == 1).all()) and not drop_in.state
    return out


def run(rank, port, outdir, steps):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))

        def place(t):
            return distribute_tensor(t, mesh, [Shard(0)])

        out = {
            bits: {"low_bit": train_low_bit(bits, steps, place), "drop_in": train_drop_in(bits, steps, place)}
            for bits in FORMATS
        }
        out["refused"] = refusals(place, mesh)
        # HSDP's placements: replicated over the mesh's first dimension, sharded over its second
        hybrid = init_device_mesh("cpu", (1, WORLD))

        def place_hybrid(t):
            return distribute_tensor(t, hybrid, [Replicate(), Shard(0)])

        out["hybrid"] = train_low_bit(4, steps, place_hybrid)
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
        dist.barrier()  # both ranks done before either tears gloo down
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
