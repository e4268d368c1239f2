"""`LowBit` state of DTensor parameters (FSDP2's): 2 processes (gloo on 127.0.0.1) step a tied
model sharded Shard(0) with `LowBit(AdamW)` and the torch drop-ins, in every format, and must end
where one unsharded process ends, bit for bit: parameters, codes and scales (the threshold counts
a parameter's elements, not its shard's; blocks tile the whole array in row-major order)."""

from __future__ import annotations

import os

import pytest
import torch

import _torch_low_bit_dtensor_worker as worker
import optimisers.engine.compiled as compiled
from test_torch_distributed import two_ranks

STEPS = 3
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_torch_low_bit_dtensor_worker.py")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return two_ranks(WORKER, tmp_path_factory.mktemp("low_bit_dtensor"), STEPS, timeout=240)


def unsharded(train, bits, monkeypatch):
    # a DTensor steps eagerly (the compiled pass declines it), so the reference does too: the
    # compiled pass on a plain tensor may round the parameter's last bit otherwise
    with monkeypatch.context() as m:
        m.setattr(compiled, "ENABLED", False)
        return train(bits, STEPS, lambda t: t)


def same(a, b) -> bool:
    """Equal bit for bit, whatever the layout of the grid of scales (NaN in FP8's `qmap`)."""
    a, b = a.reshape(-1), b.reshape(-1)
    if a.dtype != b.dtype or not torch.equal(a.isnan(), b.isnan()):
        return False
    return torch.equal(a[~a.isnan()], b[~b.isnan()])


@pytest.mark.parametrize("bits", worker.FORMATS)
def test_low_bit_adamw_on_shards_equals_one_process(ranks, bits, monkeypatch):
    got, other = ranks[0][bits]["low_bit"], ranks[1][bits]["low_bit"]
    assert got["resumes_bit_for_bit"] and other["resumes_bit_for_bit"]
    expected = unsharded(worker.train_low_bit, bits, monkeypatch)
    start = worker.model_of(lambda t: t)
    for name, p in expected["params"].items():
        assert (p - start[name]).abs().max() > 1e-3, name  # it moved
        assert torch.equal(got["params"][name], p), (bits, name)
        assert torch.equal(other["params"][name], p), (bits, name)  # both processes gather one model
    for name, parts in expected["state"].items():
        quantised = [isinstance(p, dict) for p in got["state"][name]]
        # AdamW's (m, v, t): moments quantised from min_size elements of the whole array
        assert quantised == [name != "bias"] * 2 + [False], (bits, name)
        for want, have in zip(parts, got["state"][name]):
            if isinstance(want, dict):
                assert have["sharded_like_x"], (bits, name)
                # 4-bit codes and scales may be laid out as a grid of rows (uneven shards)
                assert same(have["codes"], want["codes"]) and same(have["scale"], want["scale"])
                if bits != 4:
                    assert have["codes"].shape == want["codes"].shape == start[name].shape
            elif torch.is_tensor(want):
                assert have.dtype == torch.float32 and torch.equal(have, want), (bits, name)
            else:
                assert have == want, (bits, name)


@pytest.mark.parametrize("bits", worker.FORMATS)
def test_drop_in_on_shards_equals_one_process(ranks, bits, monkeypatch):
    got = ranks[0][bits]["drop_in"]
    assert got["resumes_bit_for_bit"] and ranks[1][bits]["drop_in"]["resumes_bit_for_bit"]
    expected = unsharded(worker.train_drop_in, bits, monkeypatch)
    for name, p in expected["params"].items():
        assert torch.equal(got["params"][name], p), (bits, name)
        assert got["sharded_like_x"][name], (bits, name)
        assert got["state"][name].keys() == expected["state"][name].keys()
        assert ("absmax1" in got["state"][name]) == (name != "bias"), (bits, name)
        for key, want in expected["state"][name].items():
            have = got["state"][name][key]
            assert same(have, want) if torch.is_tensor(want) else have == want, (bits, name, key)


def test_a_block_that_would_straddle_two_shards_or_columns_sharded_are_refused(ranks):
    refused = ranks[0]["refused"]
    for kind, where in (("straddle", "the parameter at layers.0.w"), ("drop_in", "parameter 0")):
        message = refused[kind]
        assert message.startswith(where + ": a DTensor of shape (75, 64)"), message
        assert "straddle" in message and "multiples of 256" in message and "min_size above 4800" in message
    columns = refused["columns"]
    assert columns.startswith("the parameter at columns:") and "Shard(dim=1)" in columns, columns
    assert refused["unchanged"]


def test_replicated_and_sharded_mesh_dimensions_as_hsdp_give_the_same_state(ranks):
    hybrid, flat = ranks[0]["hybrid"], ranks[0][4]["low_bit"]
    assert hybrid["resumes_bit_for_bit"]
    for name, p in flat["params"].items():
        assert torch.equal(hybrid["params"][name], p), name
    for name, parts in flat["state"].items():
        for want, have in zip(parts, hybrid["state"][name]):
            if isinstance(want, dict):
                assert have["sharded_like_x"], name
                assert torch.equal(have["codes"], want["codes"]) and torch.equal(have["scale"], want["scale"])
