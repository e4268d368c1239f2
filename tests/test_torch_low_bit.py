"""The low-bit drop-ins of `optimisers.torch` (`AdamW8bit` & co.) against the libraries they
stand in for: torchao's trajectories (its AdamW8bit / AdamW4bit / AdamWFp8 / Adam8bit, 20 steps)
and bitsandbytes' state layout (a `bnb.optim.AdamW8bit` stepped on the CPU, saved, loaded here,
stepped, saved and loaded back), torch.optim.AdamW checkpoints, thresholds and refusals."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest

import optimisers as opt

torch = pytest.importorskip("torch")
import optimisers.torch as ot  # noqa: E402
from optimisers.checkpoints.state_dict import CheckpointError  # noqa: E402

SHAPE = (32, 256)  # 8192 elements: above min_8bit_size, a multiple of every block
QUANT_KEYS = ("state1", "qmap1", "absmax1", "state2", "qmap2", "absmax2")


def gradients(steps, shape=SHAPE, seed=0):
    rng = np.random.default_rng(seed)
    scales = np.exp(rng.uniform(-6, 1, (shape[0], 1)))  # moments over several decades
    return [torch.from_numpy((rng.standard_normal(shape) * scales).astype(np.float32)) for _ in range(steps)]


def start(shape=SHAPE, seed=1):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def trajectory(cls, x0, grads, **kwargs):
    p = torch.nn.Parameter(x0.clone())
    optimizer = cls([p], **kwargs)
    for g in grads:
        p.grad = g.clone()
        optimizer.step()
    return p.detach(), optimizer


def torchao_slow(test):
    """Marks for a test that runs torchao's optimisers (compiled by torch.compile: slow)."""
    marks = [
        pytest.mark.slow,
        pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
        pytest.mark.filterwarnings("ignore:.*_stable_hash_for_caching:UserWarning"),
    ]
    for mark in marks:
        test = mark(test)
    return test


@torchao_slow
@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("AdamW8bit", dict(lr=1e-2, weight_decay=0.01)),
        ("AdamW4bit", dict(lr=1e-2, weight_decay=0.01)),
        ("AdamWFp8", dict(lr=1e-2, weight_decay=0.01, betas=(0.8, 0.99))),
        ("Adam8bit", dict(lr=1e-2, weight_decay=0.1)),
    ],
)
def test_trajectory_matches_torchao(name, kwargs):
    """20 steps beside torchao's class of the same name: every element within 1e-4 of the
    distance moved, on every format (the moments start at zero exactly, with zero scales, as
    torchao's do)."""
    torchao_optim = pytest.importorskip("torchao.optim")
    x0, grads = start(), gradients(20)
    expected, _ = trajectory(getattr(torchao_optim, name), x0, grads, **kwargs)
    ours, _ = trajectory(getattr(ot, name), x0, grads, **kwargs)
    moved = (ours - x0).abs().max()
    torch.testing.assert_close(ours, expected, rtol=0, atol=float(1e-4 * moved))


@pytest.mark.parametrize("name, bits", [("AdamW8bit", 8), ("AdamW4bit", 4), ("AdamWFp8", "fp8")])
def test_steps_are_lowbit_adamw_written_out(name, bits):
    """Each step as the formula says: float32 moments from the dequantised ones, AdamW's step
    with the new moments (decay lr·wd·p), the moments quantised again (m signed, v unsigned):
    the same codes."""
    x0, grads = start(), gradients(5)
    ours, optimizer = trajectory(getattr(ot, name), x0, grads, lr=1e-2, weight_decay=0.1)
    x = x0.clone()
    m, v = (opt.quantise(torch.zeros_like(x), bits, signed) for signed in (True, False))
    m, v = (dataclasses.replace(q, scale=torch.zeros_like(q.scale)) for q in (m, v))  # (a zero start)
    for t, g in enumerate(grads, start=1):
        m_new = 0.9 * opt.dequantise(m) + (1 - 0.9) * g
        v_new = 0.999 * opt.dequantise(v) + (1 - 0.999) * g * g
        direction = (m_new / (1 - 0.9**t)) / ((v_new / (1 - 0.999**t)).sqrt() + 1e-8)
        x = x - 1e-2 * (direction + 0.1 * x)
        m, v = opt.quantise(m_new, bits, True), opt.quantise(v_new, bits, False)
    torch.testing.assert_close(ours, x, rtol=0, atol=float(1e-4 * (x - x0).abs().max()))
    state = optimizer.state[optimizer.param_groups[0]["params"][0]]
    assert state["step"] == 5
    assert torch.equal(state["state1"].reshape(-1), m.codes.reshape(-1))
    assert torch.equal(state["state2"].reshape(-1), v.codes.reshape(-1))
    assert (state["absmax2"] - v.scale).abs().max() < 1e-6


def bnb_optim():
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    return bnb.optim


def stepped(optimizer, params, steps, seed):
    for g in gradients(steps, seed=seed):
        params[0].grad = g.clone()
        params[1].grad = g[0, :100].clone()
        optimizer.step()


def saved_and_read(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def assert_same_entry(ours: dict, theirs: dict):
    assert set(ours) == set(theirs)
    assert int(ours["step"]) == int(theirs["step"])
    for key in set(ours) - {"step"}:
        a, b = ours[key], theirs[key]
        assert a.dtype == b.dtype and a.shape == b.shape, key
        assert torch.equal(a, b), key


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_bitsandbytes_checkpoint_loads_here_and_back():
    """bnb's AdamW8bit, stepped on the CPU, saved and read with weights_only=True, loads into
    ours: `state[p]` holds its tensors bit for bit; ours, stepped, saves the same layout
    (nesting, keys, dtypes, shapes, maps) and loads into bnb's, whose `state[p]` then holds
    ours bit for bit and which steps on from it."""
    bnb = bnb_optim()
    params = [torch.nn.Parameter(start()), torch.nn.Parameter(torch.zeros(100))]  # the second: small
    theirs = bnb.AdamW8bit(params, lr=1e-3)
    stepped(theirs, params, 3, seed=0)
    their_dict = theirs.state_dict()
    ours = ot.AdamW8bit(params, lr=1e-3)
    ours.load_state_dict(saved_and_read(their_dict))
    for p in params:
        assert_same_entry(ours.state[p], theirs.state[p])
    # the loaded codes mean what they meant to bitsandbytes
    q = theirs.state[params[0]]
    their_m = bnb_functional_dequantised(q["state1"], q["absmax1"], q["qmap1"])
    m = opt.dequantise(ours._book.leaf(params[0]).state[0])
    assert torch.equal(m, their_m)

    stepped(ours, params, 2, seed=1)
    our_dict = saved_and_read(ours.state_dict())
    assert structure(our_dict["state"]) == structure(their_dict["state"])
    back = bnb.AdamW8bit(params, lr=1e-3)
    back.load_state_dict(our_dict)
    for p in params:
        assert_same_entry(ours.state[p], back.state[p])
    stepped(back, params, 1, seed=2)  # bitsandbytes steps on from our state
    assert back.state[params[0]]["step"] == 6


def bnb_functional_dequantised(codes, absmax, qmap):
    import bitsandbytes.functional as F

    return F.dequantize_blockwise(codes, absmax=absmax, code=qmap, blocksize=256)


def structure(state: dict):
    """Each entry's keys (nested ones too), with the dtype and shape of each tensor."""

    def described(entry):
        return {
            k: described(v) if isinstance(v, dict) else (v.dtype, v.shape) if torch.is_tensor(v) else type(v)
            for k, v in entry.items()
        }

    return {k: described(v) for k, v in state.items()}


def test_torch_adamw_checkpoint_is_quantised_on_load():
    """A torch.optim.AdamW state dict (moments, step, torch's switches) loads: its moments are
    quantised as `quantise` quantises them, the small parameter's kept in float32, and the next
    step goes on from there (the same as one from a state quantised by hand)."""
    params = [torch.nn.Parameter(start()), torch.nn.Parameter(torch.zeros(100))]
    theirs = torch.optim.AdamW(params, lr=1e-3)
    stepped(theirs, params, 3, seed=0)
    ours = ot.AdamW8bit(params, lr=1e-3)
    ours.load_state_dict(saved_and_read(theirs.state_dict()))
    big, small = (theirs.state[p] for p in params)
    m, v, t = ours._book.leaf(params[0]).state
    assert t == 3 and ours.state[params[0]]["step"] == 3
    for q, moment, signed in ((m, big["exp_avg"], True), (v, big["exp_avg_sq"], False)):
        expected = opt.quantise(moment, 8, signed)
        assert torch.equal(q.codes, expected.codes) and torch.equal(q.scale, expected.scale)
    assert torch.equal(ours.state[params[1]]["state1"], small["exp_avg"])
    assert torch.equal(ours.state[params[1]]["state2"], small["exp_avg_sq"])


def test_torch_adam_checkpoints_load_into_the_class_that_decays_as_they_do():
    params = [torch.nn.Parameter(start())]
    adam = torch.optim.Adam(params, lr=1e-3, weight_decay=0.1)
    stepped_one(adam, params)
    with pytest.raises(CheckpointError, match="matching class"):
        ot.AdamW8bit(params).load_state_dict(adam.state_dict())
    ours = ot.Adam8bit(params)
    ours.load_state_dict(adam.state_dict())
    assert ours.param_groups[0]["weight_decay"] == 0.1 and ours.state[params[0]]["step"] == 1
    maximising = torch.optim.AdamW(params, lr=1e-3, maximize=True)
    stepped_one(maximising, params)
    with pytest.raises(CheckpointError, match="maximize=True"):
        ot.AdamW8bit(params).load_state_dict(maximising.state_dict())


def stepped_one(optimizer, params):
    params[0].grad = torch.ones_like(params[0])
    optimizer.step()


def test_min_8bit_size_and_block_size_decide_the_layout():
    p = torch.nn.Parameter(start((10, 100)))  # 1000 elements
    small = ot.AdamW8bit([p])
    stepped_one(small, [p])
    assert set(small.state[p]) == {"step", "state1", "state2"}
    assert small.state[p]["state1"].dtype == torch.float32
    quantised = ot.AdamW8bit([p], min_8bit_size=1000, block_size=64)
    stepped_one(quantised, [p])
    entry = quantised.state[p]
    assert set(entry) == {"step", *QUANT_KEYS}
    assert entry["absmax1"].shape == (16,) and entry["state1"].dtype == torch.uint8  # ceil(1000 / 64)
    four = ot.AdamW4bit([p], min_8bit_size=0)
    stepped_one(four, [p])
    assert four.state[p]["state1"].shape == (500,) and four.state[p]["qmap2"].shape == (16,)


def test_tied_weight_has_one_quantised_state_and_stays_tied():
    embed = torch.nn.Embedding(64, 128)
    head = torch.nn.Linear(128, 64, bias=False)
    head.weight = embed.weight
    model = torch.nn.Sequential(embed, head)
    optimizer = ot.AdamW8bit(model.parameters(), lr=1e-2)
    loss = model(torch.arange(8)).square().mean()
    loss.backward()
    optimizer.step()
    assert len(optimizer.state_dict()["state"]) == 1 and head.weight is embed.weight
    assert optimizer.state[embed.weight]["state1"].dtype == torch.uint8


def bf16_run(rounding: bool, steps=3):
    p = torch.nn.Parameter(start().to(torch.bfloat16))
    optimizer = ot.AdamW8bit([p], lr=1e-4, bf16_stochastic_round=rounding)
    for _ in range(steps):
        stepped_one(optimizer, [p])
    return p, optimizer


def test_bf16_stochastic_round_moves_bfloat16_weights_on_average_and_keeps_the_layout():
    """With lr 1e-4, most updates are below bfloat16's resolution: rounded to nearest they are
    lost, rounded stochastically the mean movement is the float32 run's."""
    x0 = start().to(torch.bfloat16)
    float32, _ = trajectory(ot.AdamW8bit, x0.float(), [torch.ones(SHAPE)] * 3, lr=1e-4)
    wanted = (float32 - x0.float()).mean()
    p, optimizer = bf16_run(True)
    nearest, _ = bf16_run(False)
    assert p.dtype == torch.bfloat16 and optimizer.state[p]["step"] == 3
    assert set(optimizer.state[p]) == {"step", *QUANT_KEYS}
    assert abs((p.detach().float() - x0.float()).mean() / wanted - 1) < 0.1
    assert abs((nearest.detach().float() - x0.float()).mean() / wanted - 1) > 0.2
    again = ot.AdamW8bit([p], lr=1e-4, bf16_stochastic_round=True)
    again.load_state_dict(saved_and_read(optimizer.state_dict()))
    assert_same_entry(again.state[p], optimizer.state[p])


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda ps: ot.AdamW8bit(ps, amsgrad=True), "amsgrad=False"),
        (lambda ps: ot.AdamW8bit(ps, optim_bits=8), "optim_bits=32"),
        (lambda ps: ot.AdamW8bit(ps, percentile_clipping=5), "percentile_clipping=100"),
        (lambda ps: ot.AdamW8bit(ps, block_wise=False), "block_wise=True"),
        (lambda ps: ot.AdamW4bit(ps, block_size=0), "block_size must be an integer >= 1"),
        (lambda ps: ot.AdamWFp8(ps, min_8bit_size=-1), "min_8bit_size must be an integer >= 0"),
        (lambda ps: ot.AdamW8bit(ps, lr=-1.0), "Invalid lr"),
    ],
)
def test_bad_arguments_raise_naming_what_was_expected(make, words):
    with pytest.raises(ValueError, match=words):
        make([torch.nn.Parameter(start())])


def test_a_checkpoint_of_another_format_is_refused_and_changes_nothing():
    p = torch.nn.Parameter(start())
    fp8 = ot.AdamWFp8([p])
    stepped_one(fp8, [p])
    eight = ot.AdamW8bit([p])
    stepped_one(eight, [p])
    before = {k: v.clone() if torch.is_tensor(v) else v for k, v in eight.state[p].items()}
    with pytest.raises(CheckpointError, match="qmap1"):
        eight.load_state_dict(fp8.state_dict())
    other_block = ot.AdamW8bit([p], block_size=128)
    stepped_one(other_block, [p])
    mislabelled = other_block.state_dict()
    mislabelled["param_groups"][0]["block_size"] = 256  # (a bnb checkpoint has no block_size: ours)
    with pytest.raises(CheckpointError, match="block_size"):
        eight.load_state_dict(mislabelled)
    assert_same_entry(eight.state[p], before)
    # as torch.optim does, a checkpoint brings its hyperparameters: its block size too
    eight.load_state_dict(other_block.state_dict())
    assert eight.param_groups[0]["block_size"] == 128
    assert_same_entry(eight.state[p], other_block.state[p])
    stepped_one(eight, [p])


def test_changing_the_layout_after_construction_is_refused():
    p = torch.nn.Parameter(start())
    optimizer = ot.AdamW8bit([p])
    stepped_one(optimizer, [p])
    optimizer.param_groups[0]["block_size"] = 128
    with pytest.raises(ValueError, match="block_size"):
        stepped_one(optimizer, [p])


def test_lion8bit_is_lowbit_lion_with_decoupled_decay():
    x0, grads = start(), gradients(4)
    ours, optimizer = trajectory(ot.Lion8bit, x0, grads, lr=1e-3, weight_decay=0.5)
    x, m = x0.clone(), opt.quantise(torch.zeros_like(x0), 8, True)
    for g in grads:
        old = opt.dequantise(m)
        x = x * (1 - 1e-3 * 0.5) - 1e-3 * torch.sign(0.9 * old + (1 - 0.9) * g)
        m = opt.quantise(0.99 * old + (1 - 0.99) * g, 8, True)
    torch.testing.assert_close(ours, x, rtol=0, atol=1e-6)
    p = optimizer.param_groups[0]["params"][0]
    assert (
        set(optimizer.state[p]) == {"step", "state1", "qmap1", "absmax1"} and optimizer.state[p]["step"] == 4
    )
    again = ot.Lion8bit([p], lr=1e-3, weight_decay=0.5)
    again.load_state_dict(saved_and_read(optimizer.state_dict()))
    assert_same_entry(again.state[p], optimizer.state[p])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lion8bit_checkpoint_loads_into_bitsandbytes_and_back():
    bnb = bnb_optim()
    params = [torch.nn.Parameter(start()), torch.nn.Parameter(torch.zeros(100))]
    ours = ot.Lion8bit(params, lr=1e-4)
    stepped(ours, params, 2, seed=0)
    theirs = bnb.Lion8bit(params, lr=1e-4)
    theirs.load_state_dict(saved_and_read(ours.state_dict()))
    for p in params:
        assert_same_entry(ours.state[p], theirs.state[p])
    stepped(theirs, params, 1, seed=1)
    back = ot.Lion8bit(params, lr=1e-4)
    back.load_state_dict(saved_and_read(theirs.state_dict()))
    for p in params:
        assert_same_entry(back.state[p], theirs.state[p])


def test_paged_adamw8bit_is_adamw8bit():
    x0, grads = start(), gradients(3)
    a, _ = trajectory(ot.PagedAdamW8bit, x0, grads)
    b, _ = trajectory(ot.AdamW8bit, x0, grads)
    assert torch.equal(a, b)


def test_an_lr_scheduler_reaches_the_rule():
    """StepLR halving lr each step: the trajectory is the written-out LowBit(AdamW) with those lrs."""
    x0, grads = start(), gradients(4)
    p = torch.nn.Parameter(x0.clone())
    optimizer = ot.AdamW8bit([p], lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for g in grads:
        p.grad = g.clone()
        optimizer.step()
        scheduler.step()
    x = x0.clone()
    m, v = opt.quantise(torch.zeros_like(x), 8, True), opt.quantise(torch.zeros_like(x), 8, False)
    for t, g in enumerate(grads, start=1):
        lr = 1e-2 * 0.5 ** (t - 1)
        m_new = 0.9 * opt.dequantise(m) + (1 - 0.9) * g
        v_new = 0.999 * opt.dequantise(v) + (1 - 0.999) * g * g
        direction = (m_new / (1 - 0.9**t)) / ((v_new / (1 - 0.999**t)).sqrt() + 1e-8)
        x = x - lr * (direction + 0.1 * x)
        m, v = opt.quantise(m_new, 8, True), opt.quantise(v_new, 8, False)
    torch.testing.assert_close(p.detach(), x, rtol=0, atol=float(1e-4 * (x - x0).abs().max()))


def test_state_of_one_parameter_can_be_set_from_another_optimizer():
    p = torch.nn.Parameter(start())
    source = ot.AdamW4bit([p])
    stepped_one(source, [p])
    target = ot.AdamW4bit([p])
    target.state[p] = source.state[p]
    assert_same_entry(target.state[p], source.state[p])
    with pytest.raises(CheckpointError, match="qmap1"):
        target.state[p] = {**source.state[p], "qmap1": source.state[p]["qmap2"]}
    assert_same_entry(target.state[p], source.state[p])
