"""DistributedDataParallel and FSDP2 with optimisers as the optimiser: 2 processes (gloo on
127.0.0.1) train the tied TinyGPT on halves of a batch and must end where one process ends on the
whole (and, under FSDP2, where torch.optim.AdamW ends under the same sharding)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

import optimisers as opt
from _torch_models import batch, lm_loss, make_gpt

STEPS = 10
HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_torch_ddp_worker.py")
FSDP_WORKER = os.path.join(HERE, "_torch_fsdp_worker.py")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process(steps, rule=None):
    model = make_gpt(torch.float64)
    state = opt.setup(opt.Adam(1e-2) if rule is None else rule, model)
    inputs, targets = batch()
    for _ in range(steps):
        model.zero_grad()
        lm_loss(model, inputs, targets).backward()
        state, model = opt.update_(state, model, opt.grads(model))
    return dict(model.named_parameters(remove_duplicate=False))


def two_ranks(worker, tmp_path, steps, timeout=120):
    """Run `worker` as ranks 0 and 1 and load what each saved."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, worker, str(rank), port, str(tmp_path), str(steps)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


def test_ddp_two_ranks_match_one_process_on_the_full_batch(tmp_path):
    ranks = two_ranks(WORKER, tmp_path, STEPS)
    assert ranks[0].keys() == ranks[1].keys()
    for name in ranks[0]:
        assert torch.equal(ranks[0][name], ranks[1][name]), name  # replicas never drift
    expected = single_process(STEPS)
    moved = (expected["embed.weight"] - make_gpt(torch.float64).embed.weight).abs().max()
    assert moved > 1e-3
    for name, p in expected.items():
        # the only difference is the order of summation in the gradient (two half-batch means
        # averaged vs one mean), amplified through 10 Adam steps
        torch.testing.assert_close(ranks[0][name], p.detach(), rtol=1e-10, atol=1e-12, msg=name)
    assert torch.equal(ranks[0]["head.weight"], ranks[0]["embed.weight"])


def test_fsdp2_sharded_tied_model_matches_torch_adamw_and_one_process(tmp_path):
    import _torch_fsdp_worker as worker

    ranks = two_ranks(FSDP_WORKER, tmp_path, STEPS, timeout=240)
    runs = ["torch", "adapter", *worker.rules()]
    for kind in runs:
        assert ranks[0][kind].pop("pure_agrees", True) and ranks[1][kind].pop("pure_agrees", True)
        # AdamW by update_ and by the adapter: torch's fused kernel, called on the local shards
        fused = [r[kind].pop("fused_on_local_shards", None) for r in ranks]
        assert fused == ([True, True] if kind in ("adamw", "adapter") else [None, None]), (kind, fused)
        for name, p in ranks[0][kind].items():
            assert torch.equal(p, ranks[1][kind][name]), (kind, name)  # ranks gather one model
        assert torch.equal(ranks[0][kind]["head.weight"], ranks[0][kind]["embed.weight"])
    start = dict(make_gpt(torch.float64).named_parameters(remove_duplicate=False))
    reference = ranks[0]["torch"]
    assert (reference["embed.weight"] - start["embed.weight"]).abs().max() > 1e-3
    for name, p in reference.items():
        # torch.optim's single-tensor AdamW against torch's fused kernel on the local shards
        torch.testing.assert_close(ranks[0]["adamw"][name], p, rtol=1e-12, atol=1e-14, msg=name)
        # the torch.optim adapter steps through update_: the same numbers, bit for bit
        assert torch.equal(ranks[0]["adapter"][name], ranks[0]["adamw"][name]), name
    # ClipNorm needs each parameter's global norm, which a shard-local computation would miss;
    # one unsharded process on the full batch is the independent reference
    chain = worker.rules()["clip_momentum"]
    expected = single_process(STEPS, chain)
    model = make_gpt(torch.float64)
    lm_loss(model, *batch()).backward()
    assert any(p.grad.norm() > worker.OMEGA for p in model.parameters())  # clipping is active
    for name, p in expected.items():
        got = ranks[0]["clip_momentum"][name]
        torch.testing.assert_close(got, p.detach(), rtol=1e-10, atol=1e-12, msg=name)
    failed = ranks[0]["setup_before_sharding"]
    assert "setup after fully_shard" in failed["message"], failed["message"]
    assert failed["unchanged"]
