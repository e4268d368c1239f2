"""DistributedDataParallel with optimisers as the optimiser: 2 processes (gloo on 127.0.0.1)
train the tied TinyGPT on halves of a batch and must end where one process ends on the whole."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

import optimisers as opt
from _torch_models import batch, lm_loss, make_gpt, one_thread

STEPS = 10
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_torch_ddp_worker.py")


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    with one_thread():
        yield


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process(steps):
    model = make_gpt(torch.float64)
    state = opt.setup(opt.Adam(1e-2), model)
    inputs, targets = batch()
    for _ in range(steps):
        model.zero_grad()
        lm_loss(model, inputs, targets).backward()
        state, model = opt.update_(state, model, opt.grads(model))
    return dict(model.named_parameters(remove_duplicate=False))


def test_ddp_two_ranks_match_one_process_on_the_full_batch(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, str(rank), port, str(tmp_path), str(STEPS)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
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
