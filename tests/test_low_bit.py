"""`LowBit`: a rule's moments kept quantised, against an explicit step-by-step computation and
against torchao's AdamW8bit / AdamW4bit / AdamWFp8, on NumPy, PyTorch and JAX; ties,
thresholds, the nonnegative hook, adjust, checkpoints and bad input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import optimisers as opt

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy

FORMATS = [8, 4, "fp8"]
SHAPE = (32, 256)  # 8192 elements: above min_size, a multiple of every block


def gradients(steps, shape=SHAPE, seed=0):
    rng = np.random.default_rng(seed)
    scales = np.exp(rng.uniform(-6, 1, (shape[0], 1)))  # moments over several decades
    return [(rng.standard_normal(shape) * scales).astype(np.float32) for _ in range(steps)]


def start(shape=SHAPE, seed=1):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def leaf_state(state):
    """The rule state of a State set up for one bare array."""
    return state.tree.state


def host(a):
    return a.detach().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def zero_state(zeros, bits, signed):
    q = opt.quantise(zeros, bits, signed)
    return dataclasses.replace(q, scale=q.scale * 0)


def reference_adamw(x, grads, bits, eta=1e-2, lambd=0.01, beta=(0.9, 0.999), eps=1e-8):
    """LowBit(AdamW) written out: zero moments with zero scales (as torchao and bitsandbytes
    start them: zero exactly), then each step float32 moments from their dequantised values,
    the step from the new float32 moments, the moments quantised (m signed, v unsigned)."""
    b1, b2 = beta
    x = x.copy()
    m, v = (zero_state(np.zeros_like(x), bits, signed) for signed in (True, False))
    for t, g in enumerate(grads, start=1):
        m_new = np.float32(b1) * opt.dequantise(m) + np.float32(1 - b1) * g
        v_new = np.float32(b2) * opt.dequantise(v) + np.float32(1 - b2) * g * g
        root = np.sqrt(v_new / np.float32(1 - b2**t))
        direction = (m_new / np.float32(1 - b1**t)) / (root + np.float32(eps))
        x = x - np.float32(eta) * (direction + np.float32(lambd) * x)
        m, v = opt.quantise(m_new, bits, True), opt.quantise(v_new, bits, False)
    return x, m, v


@pytest.mark.parametrize("bits", FORMATS)
@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_lowbit_adamw_follows_the_explicit_computation(bits, backend):
    x0, grads = start(), gradients(12)
    expected, m, v = reference_adamw(x0, grads, bits)
    convert = {"numpy": np.array, "torch": torch.tensor, "jax": jnp.asarray}[backend]
    x = convert(x0)
    state = opt.setup(opt.LowBit(opt.AdamW(1e-2, lambd=0.01), bits=bits), x)
    step = jax.jit(opt.update) if backend == "jax" else opt.update_
    for g in grads:
        state, x = step(state, x, convert(g))
    moved = np.abs(expected - x0).max()
    np.testing.assert_allclose(host(x), expected, rtol=0, atol=1e-5 * moved)
    qm, qv, t = leaf_state(state)
    assert int(t) == 12 and (qm.signed, qv.signed, qm.bits, qv.bits) == (True, False, bits, bits)
    # the kept moments are the explicit ones, up to the codes that the parameter's rounding moved
    assert np.mean(host(qv.codes) == v.codes) > 0.99 and np.mean(host(qm.codes) == m.codes) > 0.99


def torchao_class(bits):
    pytest.importorskip("torchao.optim")
    from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8

    return {8: AdamW8bit, 4: AdamW4bit, "fp8": AdamWFp8}[bits]


def torchao_trajectory(bits, x0, grads):
    p = torch.nn.Parameter(torch.from_numpy(x0.copy()))
    theirs = torchao_class(bits)([p], lr=1e-2, weight_decay=0.01)
    for g in grads:
        p.grad = torch.from_numpy(g.copy())
        theirs.step()
    return p.detach().numpy()


def against_torchao(test):
    """Marks for a test that runs torchao's optimisers (compiled by torch.compile: slow)."""
    marks = [
        pytest.mark.slow,
        pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
        pytest.mark.filterwarnings("ignore:.*_stable_hash_for_caching:UserWarning"),  # torchao's classes
    ]
    for mark in marks:
        test = mark(test)
    return test


@against_torchao
@pytest.mark.parametrize("bits", FORMATS)
def test_torchao_steps_are_our_quantiser_in_their_order(bits):
    """torchao's step written out with `quantise`/`dequantise` (its moments by `lerp`, from
    zero scales): the same trajectory to float32 rounding, every element, for every format. So
    the codes, the scales and the order (dequantise, step with the new moments, quantise) are
    theirs."""
    x0, grads = start(), gradients(20)
    expected = torchao_trajectory(bits, x0, grads)
    x, lr = torch.from_numpy(x0.copy()), torch.tensor(1e-2)
    m, v = (opt.quantise(torch.zeros_like(x), bits, signed) for signed in (True, False))
    m, v = (dataclasses.replace(q, scale=torch.zeros_like(q.scale)) for q in (m, v))  # torchao's zeros
    for t, g in enumerate(map(torch.from_numpy, grads), start=1):
        x = x - lr * 0.01 * x
        m_new = opt.dequantise(m).lerp(g, 1 - 0.9)
        v_new = opt.dequantise(v).lerp(g.square(), 1 - 0.999)
        bc1, bc2 = 1 - 0.9 ** torch.tensor(float(t)), 1 - 0.999 ** torch.tensor(float(t))
        x = x - lr * (m_new / bc1) / (v_new.sqrt() / bc2.sqrt() + 1e-8)
        m, v = opt.quantise(m_new, bits, True), opt.quantise(v_new, bits, False)
    moved = np.abs(expected - x0).max()
    np.testing.assert_allclose(x.numpy(), expected, rtol=0, atol=1e-5 * moved)


@against_torchao
@pytest.mark.parametrize("bits", FORMATS)
def test_lowbit_adamw_trajectory_matches_torchao(bits):
    """`LowBit(AdamW)` beside torchao's class over 20 steps: every element within 1e-4 of the
    distance moved, on every format. (The moments start at zero with zero scales, as torchao's:
    a start at the unsigned 4-bit map's smallest value times 1e-12 moved 1% of the 4-bit codes
    to a neighbour, and those elements by a few percent.)"""
    x0, grads = start(), gradients(20)
    expected = torchao_trajectory(bits, x0, grads)
    x = x0.copy()
    state = opt.setup(opt.LowBit(opt.AdamW(1e-2, lambd=0.01), bits=bits), x)
    for g in grads:
        state, x = opt.update_(state, x, g)
    moved = np.abs(x - x0).max()
    np.testing.assert_allclose(expected, x, rtol=0, atol=1e-4 * moved)


# --- which arrays are quantised --------------------------------------------------------------


def test_only_parameter_shaped_state_of_min_size_is_quantised():
    big, small = np.ones((64, 64), np.float32), np.ones((63, 64), np.float32)
    model = {"big": big, "small": small}
    state = opt.setup(opt.LowBit(opt.Adam()), model)
    m, v, t = state["big"].state
    assert isinstance(m, opt.Quantised) and isinstance(v, opt.Quantised) and t == 0
    assert all(isinstance(p, np.ndarray) for p in state["small"].state[:2])  # 4032 < 4096
    state = opt.setup(opt.LowBit(opt.Adam(), min_size=100), model)
    assert isinstance(state["small"].state[0], opt.Quantised)
    # Adafactor's factored second moment has other shapes: left alone
    state = opt.setup(opt.LowBit(opt.Adafactor(), min_size=1), big)
    flat: list = []
    from optimisers.core.state import flatten_state

    flatten_state(leaf_state(state), flat)
    for part in flat:
        assert not isinstance(part, opt.Quantised) or part.shape == big.shape


def test_nonnegative_state_takes_the_unsigned_maps_in_chains_and_wrappers():
    x = np.ones(4096, np.float32)
    chain = opt.OptimiserChain(opt.ClipGrad(1.0), opt.Momentum(), opt.AdamW(), opt.RMSProp())
    state = leaf_state(opt.setup(opt.LowBit(chain), x))
    assert state[1].signed  # Momentum's velocity
    assert state[2][0].signed and not state[2][1].signed  # AdamW's m, v
    assert not state[3].signed  # RMSProp's mean square
    skip = leaf_state(opt.setup(opt.LowBit(opt.SkipNonFinite(opt.AdaGrad())), x))
    assert not skip[0].signed
    scheduled = leaf_state(opt.setup(opt.LowBit(opt.Adam(lambda t: 1e-3)), x))
    assert scheduled.state[0].signed and not scheduled.state[1].signed


def test_signed_moments_stay_accurate_and_unsigned_ones_non_negative():
    x, grads = start(), gradients(5)
    state = opt.setup(opt.LowBit(opt.Adam(1e-3), bits=4), x)
    for g in grads:
        state, x = opt.update_(state, x, g)
    m, v, _ = leaf_state(state)
    assert np.all(opt.dequantise(v) > 0)
    assert np.any(opt.dequantise(m) < 0)


# --- ties, adjust, JAX ------------------------------------------------------------------------


@pytest.mark.parametrize("pure", [True, False])
def test_a_tied_array_keeps_one_quantised_state_and_stays_tied(pure):
    W = start((64, 128))
    model = {"embed": W, "head": W, "bias": np.zeros(8, np.float32)}
    state = opt.setup(opt.LowBit(opt.Adam(1e-2)), model)
    assert state["embed"] is state["head"]
    g1, g2 = gradients(2, (64, 128))
    grads = {"embed": g1, "head": g2, "bias": np.ones(8, np.float32)}
    single = opt.setup(opt.LowBit(opt.Adam(1e-2)), W.copy())
    single, expected = opt.update_(single, W.copy(), g1 + g2)
    step = opt.update if pure else opt.update_
    new_state, new_model = step(state, model, grads)
    assert new_model["embed"] is new_model["head"]
    assert new_state["embed"] is new_state["head"]
    np.testing.assert_array_equal(new_model["embed"], expected)
    for ours, theirs in zip(new_state["embed"].state[:2], leaf_state(single)[:2]):
        np.testing.assert_array_equal(ours.codes, theirs.codes)
        np.testing.assert_array_equal(ours.scale, theirs.scale)
    if pure:
        assert model["embed"] is W and state["embed"].state[2] == 0


def test_adjust_and_hyperparameters_reach_the_inner_rule():
    x = np.ones(4096, np.float32)
    state = opt.setup(opt.LowBit(opt.OptimiserChain(opt.WeightDecay(), opt.Adam(1e-3)), bits=4), x)
    rule = state.tree.rule
    decay = rule.rule.rules[0].hyperparameters()
    assert set(rule.hyperparameters()) == {*decay, "eta", "beta", "epsilon"}
    state = opt.adjust(state, 0.5, beta=(0.8, 0.99))
    adam = state.tree.rule.rule.rules[1]
    assert adam.eta == 0.5 and adam.beta == (0.8, 0.99) and state.tree.rule.bits == 4
    with pytest.raises(ValueError, match="bogus"):
        opt.adjust(state, bogus=1.0)


def test_jax_jit_compiles_once_and_equals_the_eager_update():
    params = {"w": jnp.asarray(start()), "b": jnp.zeros(7)}
    grads = [{"w": jnp.asarray(g), "b": jnp.ones(7)} for g in gradients(3)]
    state = opt.setup(opt.LowBit(opt.AdamW(1e-2), bits="fp8"), params)
    traces = []

    def step(s, p, g):
        traces.append(1)
        return opt.update(s, p, g)

    jitted = jax.jit(step)
    s1, p1, s2, p2 = state, params, state, params
    for g in grads:
        s1, p1 = jitted(s1, p1, g)
        s2, p2 = opt.update(s2, p2, g)
    assert len(traces) == 1
    np.testing.assert_allclose(np.asarray(p1["w"]), np.asarray(p2["w"]), rtol=0, atol=1e-6)
    leaves = jax.tree_util.tree_leaves(s1)
    assert any(getattr(leaf, "dtype", None) == jnp.uint8 for leaf in leaves)


def test_torch_module_is_stepped_in_place():
    layer = torch.nn.Linear(128, 64)
    weight = layer.weight
    state = opt.setup(opt.LowBit(opt.AdamW(1e-2)), layer)
    layer(torch.ones(2, 128)).sum().backward()
    before = weight.detach().clone()
    state, layer = opt.update_(state, layer, opt.grads(layer))
    assert layer.weight is weight and not torch.equal(weight.detach(), before)
    m, v, t = state["weight"].state
    assert isinstance(m.codes, torch.Tensor) and m.codes.dtype == torch.uint8 and t == 1
    assert isinstance(state["bias"].state[0], torch.Tensor)  # 64 elements: kept in float32


# --- checkpoints ------------------------------------------------------------------------------


def _run(state, x, grads):
    for g in grads:
        state, x = opt.update_(state, x, g)
    return state, x


@pytest.mark.parametrize("bits", FORMATS)
def test_state_dict_round_trip_resumes_bit_for_bit(bits):
    rule = opt.LowBit(opt.AdamW(1e-2, lambd=0.01), bits=bits)
    grads = gradients(6)
    state, x = _run(opt.setup(rule, start()), start(), grads[:3])
    saved = opt.state_dict(state)
    assert saved["<model>/state/0/codes"].dtype == np.uint8
    assert saved["<model>/state/1/scale"].dtype == np.float32
    copied = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in saved.items()}
    resumed = opt.load_state_dict(opt.setup(rule, x.copy()), copied)
    _, expected = _run(state, x.copy(), grads[3:])
    _, got = _run(resumed, x.copy(), grads[3:])
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_save_and_load_keep_codes_and_scales(tmp_path, suffix):
    if suffix == ".safetensors":
        pytest.importorskip("safetensors")
    W = torch.from_numpy(start())
    model = {"embed": W, "head": W}
    rule = opt.LowBit(opt.Adam(1e-2), bits=4)
    state = opt.setup(rule, model)
    g = torch.from_numpy(gradients(1)[0])
    state, model = opt.update_(state, model, {"embed": g, "head": None})
    path = tmp_path / f"state{suffix}"
    opt.save(path, state)
    loaded = opt.load(path, opt.setup(rule, {"embed": W, "head": W}))
    assert loaded["embed"] is loaded["head"]
    for ours, theirs in zip(loaded["embed"].state[:2], state["embed"].state[:2]):
        assert torch.equal(ours.codes, theirs.codes) and torch.equal(ours.scale, theirs.scale)
        assert (ours.bits, ours.signed, ours.shape) == (theirs.bits, theirs.signed, theirs.shape)


def test_a_checkpoint_of_plain_state_is_refused():
    x = np.ones(4096, np.float32)
    saved = opt.state_dict(opt.setup(opt.Adam(), x))
    with pytest.raises(opt.CheckpointError):
        opt.load_state_dict(opt.setup(opt.LowBit(opt.Adam()), x), saved)


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make,error,words",
    [
        (lambda: opt.LowBit(opt.Adam(), bits=2), ValueError, "LowBit: bits must be 8, 4 or 'fp8'"),
        (lambda: opt.LowBit(opt.Adam(), block=-1), ValueError, "LowBit: block must be a positive"),
        (lambda: opt.LowBit(opt.Adam(), min_size=-1), ValueError, "min_size must be a non-negative"),
        (lambda: opt.LowBit(opt.Adam, bits=8), TypeError, "rule must be an optimisers.Rule"),
    ],
)
def test_bad_arguments_raise_naming_what_was_expected(make, error, words):
    with pytest.raises(error, match=words):
        make()


@pytest.mark.parametrize(
    "rule",
    [
        opt.MixedPrecision(opt.Adam()),
        opt.Lookahead(opt.Adam()),
        opt.ScheduleFreeAdamW(),
        opt.ScheduleFreeSGD(),
        opt.SOAP(),
        opt.OptimiserChain(opt.ClipNorm(1.0), opt.Lookahead(opt.AdamW(lambda t: 1e-3))),
    ],
    ids=lambda r: type(r).__name__,
)
def test_copies_of_the_parameter_stay_exact(rule):
    """What a rule declares exact (its copies of the parameter, SOAP's bases of a square
    parameter) is never quantised; the moments beside it are."""
    from optimisers.core.state import flatten_state

    x = start((64, 64))
    plain, low = opt.setup(rule, x.copy()), opt.setup(opt.LowBit(rule), x.copy())
    plain_parts, low_parts = [], []
    flatten_state(leaf_state(plain), plain_parts)
    flatten_state(leaf_state(low), low_parts)
    exact = rule.exact_parts(leaf_state(plain))
    assert exact and len(plain_parts) == len(low_parts)
    for i, (p, q) in enumerate(zip(plain_parts, low_parts)):
        if i in exact:
            assert type(q) is type(p) and (p is None or np.array_equal(p, q))
        elif getattr(p, "shape", None) == x.shape:
            assert isinstance(q, opt.Quantised)
    for g in gradients(3, (64, 64)):
        low, y = opt.update_(low, x, g)
    assert np.all(np.isfinite(y))


def test_wrapping_outside_works():
    x = np.ones(4096, np.float32)
    state = opt.setup(opt.MixedPrecision(opt.LowBit(opt.Adam())), x.astype(np.float16))
    master, inner = leaf_state(state)
    assert master.dtype == np.float32 and isinstance(inner[0], opt.Quantised)
    state, y = opt.update_(state, x.astype(np.float16), np.ones(4096, np.float16))
    assert y.dtype == np.float16


def test_a_tie_given_lowbit_at_one_place_only_is_refused_naming_both():
    W = np.ones((64, 64), np.float32)

    def choose(path, x):
        return opt.LowBit(opt.Adam()) if path == ("embed",) else opt.Adam()

    with pytest.raises(ValueError, match=r"LowBit\(Adam.* at embed and Adam.* at head"):
        opt.setup(choose, {"embed": W, "head": W})


def test_optax_transform_keeps_codes_and_scales():
    optax_adapter = pytest.importorskip("optimisers.optax")
    params = {"w": jnp.asarray(start()), "b": jnp.zeros(3)}
    tx = optax_adapter.transform(opt.LowBit(opt.AdamW(1e-2), bits=4))
    tx_state = tx.init(params)
    leaves = jax.tree_util.tree_leaves(tx_state)
    assert any(leaf.dtype == jnp.uint8 and leaf.shape == (SHAPE[0] * SHAPE[1] // 2,) for leaf in leaves)
    reference = opt.setup(opt.LowBit(opt.AdamW(1e-2), bits=4), params)
    expected = params
    for g in gradients(3):
        grads = {"w": jnp.asarray(g), "b": jnp.ones(3)}
        updates, tx_state = jax.jit(tx.update)(grads, tx_state, params)
        params = jax.tree_util.tree_map(lambda p, u: p + u, params, updates)
        reference, expected = opt.update(reference, expected, grads)
    np.testing.assert_allclose(np.asarray(params["w"]), np.asarray(expected["w"]), rtol=0, atol=1e-6)


SHARDED = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import optimisers as opt

mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
rng = np.random.default_rng(0)
w = jax.device_put(jnp.asarray(rng.standard_normal((64, 512)), jnp.float32), NamedSharding(mesh, P("a", "b")))
g = jax.device_put(jnp.asarray(rng.standard_normal((64, 512)), jnp.float32), w.sharding)
model, grads = {"w": w, "head": w}, {"w": g, "head": g}
for bits in (8, 4, "fp8"):
    state = opt.setup(opt.LowBit(opt.Adam(1e-2), bits=bits), model)
    eager_state, eager = opt.update(state, model, grads)
    state, new = jax.jit(opt.update)(state, model, grads)
    assert new["w"].sharding.is_equivalent_to(w.sharding, 2)
    np.testing.assert_array_equal(np.asarray(new["w"]), np.asarray(new["head"]))
    np.testing.assert_allclose(np.asarray(new["w"]), np.asarray(eager["w"]), rtol=1e-5, atol=1e-8)
    for q in state["w"].state[:2]:  # split over the devices as XLA propagates it, not gathered
        assert not q.codes.sharding.is_fully_replicated, (bits, q.codes.sharding)
"""


@pytest.mark.slow
def test_sharded_parameters_keep_their_sharding_and_numbers():
    from _host_devices import run_on_host_devices

    run_on_host_devices(SHARDED, 8)


def test_the_torch_optimizer_adapter_saves_plain_tensors(tmp_path):
    from optimisers.torch import Optimizer

    torch.manual_seed(0)
    layer, twin = torch.nn.Linear(128, 64), torch.nn.Linear(128, 64)
    optimizer = Optimizer(layer.parameters(), opt.LowBit(opt.AdamW(1e-2), bits=4))
    layer(torch.ones(2, 128)).sum().backward()
    optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "o.pt")
    saved = torch.load(tmp_path / "o.pt", weights_only=True)  # tensors, numbers and text only
    assert saved["state"][0]["state/0/codes"].dtype == torch.uint8
    twin.load_state_dict(layer.state_dict())
    resumed = Optimizer(twin.parameters(), opt.LowBit(opt.AdamW(1e-2), bits=4))
    resumed.load_state_dict(saved)
    for model, optim in ((layer, optimizer), (twin, resumed)):
        for p in model.parameters():
            p.grad = torch.linspace(-1, 1, p.numel()).reshape(p.shape)
        optim.step()
    for p, q in zip(layer.parameters(), twin.parameters()):
        assert torch.equal(p, q)


@pytest.mark.slow
def test_flax_msgpack_keeps_codes_scales_and_dtype_markers():
    """A linen TrainState whose `tx` is `optimisers.optax.transform(...)`, through msgpack."""
    serialization = pytest.importorskip("flax.serialization")
    train_state = pytest.importorskip("flax.training.train_state")
    optax_adapter = pytest.importorskip("optimisers.optax")

    def params():
        return {"w": jnp.ones((64, 128), jnp.bfloat16), "b": jnp.zeros(3)}

    tx = optax_adapter.transform(opt.KahanSummation(opt.LowBit(opt.AdamW(1e-2), bits=4)))
    grads = {"w": jnp.asarray(gradients(1, (64, 128))[0], jnp.bfloat16), "b": jnp.ones(3)}
    step = jax.jit(lambda state, grads: state.apply_gradients(grads=grads))
    state = step(train_state.TrainState.create(apply_fn=None, params=params(), tx=tx), grads)
    target = train_state.TrainState.create(apply_fn=None, params=params(), tx=tx)
    restored = serialization.from_bytes(target, serialization.to_bytes(state))
    leaves, theirs = jax.tree_util.tree_leaves(restored.opt_state), jax.tree_util.tree_leaves(state.opt_state)
    assert any(leaf.dtype == jnp.uint8 for leaf in leaves)
    for ours, saved in zip(leaves, theirs):
        np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(saved, np.float32))
    after, expected = step(restored, grads), step(state, grads)
    np.testing.assert_array_equal(np.asarray(after.params["w"]), np.asarray(expected.params["w"]))


@pytest.mark.slow
def test_orbax_restores_a_quantised_state_bit_for_bit(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    params = {"w": jnp.asarray(start()), "b": jnp.zeros(3)}
    rule = opt.LowBit(opt.AdamW(1e-2), bits="fp8")
    state = opt.setup(rule, params)
    grads = {"w": jnp.asarray(gradients(1)[0]), "b": jnp.ones(3)}
    step = jax.jit(opt.update)
    state, params = step(state, params, grads)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "state", state)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "state", jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
    assert isinstance(restored["w"].state[0], opt.Quantised)
    _, expected = step(state, params, grads)
    _, got = step(restored, params, grads)
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(expected["w"]))


@pytest.mark.parametrize("bits", FORMATS)
def test_a_zero_state_starts_with_zero_scales_and_is_zero_exactly(bits):
    """As torchao's and bitsandbytes' states start; the unsigned 4-bit map has no zero, and with
    the quantiser's least scale (1e-12) its smallest value would enter the first step."""
    x = np.ones(8192, np.float32)
    m, v, _ = leaf_state(opt.setup(opt.LowBit(opt.Adam(), bits=bits), x))
    for q in (m, v):
        assert not np.any(q.scale) and not np.any(opt.dequantise(q))
    # a state that starts elsewhere is quantised as any array (AdaGrad's accumulator, at ε)
    acc = leaf_state(opt.setup(opt.LowBit(opt.AdaGrad()), x))
    expected = opt.quantise(np.full_like(x, 1e-8), 8, False)
    np.testing.assert_array_equal(acc.scale, expected.scale)
    np.testing.assert_array_equal(acc.codes, expected.codes)


@pytest.mark.parametrize("backend", ["numpy eager", "jax", "jax jit"])
def test_lowbit_around_a_scheduled_rule_steps_at_the_schedules_values(monkeypatch, backend):
    """LowBit's state is its rule's, a schedule's step count included: it is handed on whole
    (LowBit(Adam(schedule)) once failed on JAX, and on NumPy without the compiled way, the count
    taken off by LowBit's own apply). The reference adjusts a plain Adam to each step's value."""
    if backend == "numpy eager":
        from optimisers.engine import compiled

        monkeypatch.setattr(compiled, "ENABLED", False)
    schedule = opt.schedules.Cosine(1e-2, 10, warmup=2)
    x0, grads = start(), gradients(5)
    convert = np.array if backend == "numpy eager" else jnp.asarray
    x = convert(x0)
    state = opt.setup(opt.LowBit(opt.Adam(schedule), bits=8), x)
    step = jax.jit(opt.update) if backend == "jax jit" else opt.update
    for g in grads:
        state, x = step(state, x, convert(g))
    expected = x0.copy()
    theirs = opt.setup(opt.LowBit(opt.Adam(1.0), bits=8), expected)
    for t, g in enumerate(grads):
        theirs, expected = opt.update(opt.adjust(theirs, float(schedule(t))), expected, g)
    assert int(leaf_state(state).count) == len(grads)
    moved = np.abs(expected - x0).max()
    np.testing.assert_allclose(host(x), expected, rtol=0, atol=1e-4 * moved)
