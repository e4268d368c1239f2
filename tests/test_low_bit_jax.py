"""`LowBit` on JAX: the quantiser's shortcuts give NumPy's codes, sharded parameters keep their
placement and numbers under one compile, `optimisers.optax.transform` in a chain, checkpoints.

(tests/test_low_bit.py and tests/test_quantise.py hold the rest: JAX against NumPy, torch and
torchao, one jitted step, a TrainState through msgpack, one orbax restore.)
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

import optimisers as opt

jax = pytest.importorskip("jax")
jnp = jax.numpy

FORMATS = [(8, True), (8, False), (4, True), (4, False), ("fp8", True)]


def moments(shape, seed=0, nonnegative=False):
    """Values over many decades, a row at a time, as optimiser moments are."""
    rng = np.random.default_rng(seed)
    rows = shape[0] if len(shape) > 1 else 1
    scales = np.exp(rng.uniform(-14, 3, (rows, 1)))
    x = (rng.standard_normal((rows, int(np.prod(shape)) // rows)) * scales).astype(np.float32)
    x = x.reshape(shape)
    return np.abs(x) if nonnegative else x


def float8_decision_points():
    """Float32 values at and one or two ulps either side of every midpoint between float8_e4m3fn
    values (where the cast's rounding decides), both signs, with 448 to 1e30, NaN and ±inf."""
    positive = np.unique(np.abs(jnp.arange(256, dtype=jnp.uint8).view(jnp.float8_e4m3fn).astype(np.float32)))
    positive = positive[np.isfinite(positive)].astype(np.float64)
    mids = ((positive[:-1] + positive[1:]) / 2).astype(np.float32)  # exact: one more bit
    near = mids.view(np.int32)[:, None] + np.arange(-2, 3, dtype=np.int32)
    extreme = np.array([448, 455.9, 464, 464.1, 500, 1e30, np.inf, np.nan], np.float32)
    y = np.concatenate([near.reshape(-1).view(np.float32), positive.astype(np.float32), extreme])
    return np.concatenate([y, -y])


def test_fp8_codes_from_the_cast_equal_numpys_tables_at_every_decision_point():
    """JAX quantises FP8 with XLA's float8 cast, NumPy from tables: the same codes, also past
    448 and for NaN and infinities (±448, by the sign bit)."""
    from optimisers.backends import jax_quant, numpy_quant
    from optimisers.core.quant_lookup import codebook

    y = float8_decision_points()
    book = codebook("fp8", True)
    ours = np.asarray(jax.jit(jax_quant.codes_of, static_argnums=1)(jnp.asarray(y), book))
    np.testing.assert_array_equal(ours, numpy_quant.codes_of(y, book))


def test_fp8_and_4_bit_values_equal_the_maps_bit_for_bit():
    from optimisers.backends import jax_quant
    from optimisers.core.quant_lookup import codebook

    book = codebook("fp8", True)
    values = np.asarray(jax_quant._values_of(jnp.arange(256, dtype=jnp.uint8), book))
    np.testing.assert_array_equal(values.view(np.uint32), book.values.view(np.uint32))  # NaNs too
    for signed in (True, False):
        book = codebook(4, signed)
        pairs = jax_quant._pair_values(book)
        every_byte = np.arange(256)
        np.testing.assert_array_equal(pairs[:, 0], book.values[every_byte >> 4])
        np.testing.assert_array_equal(pairs[:, 1], book.values[every_byte & 15])


@pytest.mark.parametrize("bits, signed", FORMATS)
@pytest.mark.parametrize("shape", [(6, 512), (3, 2, 256), (5, 300), (1001,), (4, 128)])
def test_jitted_quantise_and_dequantise_equal_numpy_bit_for_bit(bits, signed, shape):
    """Rows of whole blocks (blocks split off the last axis) and not (the flat path)."""
    x = moments(shape, seed=len(shape), nonnegative=not signed)
    x.reshape(-1)[:3] = [np.nan, np.inf, 0.0]  # one block with a NaN scale, as NumPy has it
    expected = opt.quantise(x, bits, signed)
    q = jax.jit(lambda a: opt.quantise(a, bits, signed))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(q.codes), expected.codes)
    np.testing.assert_array_equal(np.asarray(q.scale), expected.scale)
    back = jax.jit(opt.dequantise)(q)
    assert back.shape == shape
    np.testing.assert_array_equal(np.asarray(back), opt.dequantise(expected))


def test_optax_transform_in_a_chain_equals_update_bit_for_bit():
    optax = pytest.importorskip("optax")
    import optimisers.optax

    rule = opt.LowBit(opt.AdamW(1e-2, lambd=0.01), bits=8)
    params = {"w": jnp.asarray(moments((64, 256), seed=1)), "b": jnp.zeros(5)}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optimisers.optax.transform(rule))
    clip = optax.clip_by_global_norm(1.0)

    @jax.jit
    def through_optax(tx_state, params, grads):
        updates, tx_state = tx.update(grads, tx_state, params)
        return tx_state, optax.apply_updates(params, updates)

    @jax.jit
    def through_update(state, params, grads):
        clipped, _ = clip.update(grads, clip.init(params))
        return opt.update(state, params, clipped)

    tx_state, state, expected = tx.init(params), opt.setup(rule, params), params
    for step in range(4):
        grads = {"w": jnp.asarray(moments((64, 256), seed=10 + step)), "b": jnp.ones(5)}
        tx_state, params = through_optax(tx_state, params, grads)
        state, expected = through_update(state, expected, grads)
    for name in ("w", "b"):
        np.testing.assert_array_equal(np.asarray(params[name]), np.asarray(expected[name]))
    theirs, ours = tx_state[1]["w"].state, state["w"].state
    for a, b in zip(theirs[:2], ours[:2]):
        assert isinstance(a, opt.Quantised) and (a.bits, a.signed) == (b.bits, b.signed)
        np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
        np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))


# --- checkpoints: orbax and msgpack, every format, resumed bit for bit ------------------------


def _train(state, params, steps, first=0):
    step = jax.jit(opt.update)
    for t in range(first, first + steps):
        grads = {"w": jnp.asarray(moments((32, 256), seed=100 + t)), "b": jnp.full(3, 0.1 * t)}
        state, params = step(state, params, grads)
    return state, params


def _resumed_equals_uninterrupted(save_and_restore, bits):
    rule = opt.LowBit(opt.AdamW(1e-2, lambd=0.01), bits=bits)
    params = {"w": jnp.asarray(moments((32, 256), seed=3)), "b": jnp.zeros(3)}
    state, params = _train(opt.setup(rule, params), params, 2)
    restored = save_and_restore(state)
    q = restored["w"].state[0]
    assert isinstance(q, opt.Quantised) and q.codes.dtype == jnp.uint8 and q.scale.dtype == jnp.float32
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    resumed = _train(restored, params, 3, first=2)
    uninterrupted = _train(state, params, 3, first=2)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4, "fp8"])
def test_orbax_keeps_codes_and_scales_and_resumes_bit_for_bit(tmp_path, bits):
    ocp = pytest.importorskip("orbax.checkpoint")

    def save_and_restore(state):
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp_path / "state", state)
            checkpointer.wait_until_finished()
            target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
            return checkpointer.restore(tmp_path / "state", target)

    _resumed_equals_uninterrupted(save_and_restore, bits)


@pytest.mark.parametrize("bits", [8, 4, "fp8"])
def test_msgpack_keeps_codes_and_scales_and_resumes_bit_for_bit(bits):
    serialization = pytest.importorskip("flax.serialization")

    def save_and_restore(state):
        data = serialization.msgpack_serialize(jax.tree.map(np.asarray, jax.tree.leaves(state)))
        leaves = [jnp.asarray(a) for a in serialization.msgpack_restore(data)]
        return jax.tree.unflatten(jax.tree.structure(state), leaves)

    _resumed_equals_uninterrupted(save_and_restore, bits)


# --- sharded parameters on 8 CPU devices (a subprocess: XLA reads the device count at start) ---

SHARDED = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import optimisers as opt

    assert len(jax.devices()) == 8
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    rng = np.random.default_rng(0)

    def arrays(shape):
        scales = np.exp(rng.uniform(-8, 1, (shape[0], 1)))
        return [(rng.standard_normal(shape) * scales).astype(np.float32) for _ in range(4)]

    def train(bits, sharding, w0, grads):
        place = (lambda a: jax.device_put(jnp.asarray(a), sharding)) if sharding else jnp.asarray
        model = {"w": place(w0)}  # every array quantised: the step count is placed by the codes
        state = opt.setup(opt.LowBit(opt.AdamW(1e-2, lambd=0.01), bits=bits), model)
        placements = [state["w"].state[0].codes.sharding, state["w"].state[0].scale.sharding]
        traces = []

        def step(state, model, grads):
            traces.append(1)
            return opt.update(state, model, grads)

        jitted = jax.jit(step)
        for g in grads:
            state, model = jitted(state, model, {"w": place(g)})
        # one trace; sharded, one compile too (unsharded, the first call's arrays are uncommitted)
        assert len(traces) == 1 and (jitted._cache_size() == 1 or not sharding), (bits, sharding)
        m = state["w"].state[0]
        assert [m.codes.sharding, m.scale.sharding] == placements or not sharding, (bits, sharding)
        return model, state

    # (shape, the parameter's spec, the 1-D arrays' specs: 4-bit codes, scales)
    CASES = [
        ((256, 512), P("a"), P("a"), P("a")),
        ((256, 512), P(("a", "b")), P(("a", "b")), P(("a", "b"))),
        ((256, 512), P("a", "b"), P("a"), P("a")),
        ((256, 512), P(None, "b"), P(), P()),
        ((64, 300), P("a"), P("a"), P()),  # rows of part blocks: 75 or 150 scales, not split in 4
    ]
    for shape in {case[0] for case in CASES}:
        w0, *grads = arrays(shape)
        for bits in (8, 4, "fp8"):
            model, state = train(bits, None, w0, grads)
            expected = [*jax.tree.leaves(model), *jax.tree.leaves(state)]
            for _, spec, codes_1d, scales in (case for case in CASES if case[0] == shape):
                sharding = NamedSharding(mesh, spec)
                model, state = train(bits, sharding, w0, grads)
                assert model["w"].sharding.is_equivalent_to(sharding, 2)
                for moment in state["w"].state[:2]:
                    if bits == 4:  # two codes a byte, 1-D
                        assert moment.codes.sharding.is_equivalent_to(NamedSharding(mesh, codes_1d), 1)
                    else:  # codes shaped as the parameter: its sharding
                        assert moment.codes.sharding.is_equivalent_to(sharding, 2), (bits, spec)
                    assert moment.scale.sharding.is_equivalent_to(NamedSharding(mesh, scales), 1)
                for a, b in zip([*jax.tree.leaves(model), *jax.tree.leaves(state)], expected):
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{bits} {spec}")
    print("ok")
    """
)


@pytest.mark.slow
def test_sharded_codes_follow_the_parameter_and_equal_the_unsharded_run_compiling_once():
    from _host_devices import run_on_host_devices

    assert run_on_host_devices(SHARDED, 8).stdout.strip() == "ok"


@pytest.mark.slow
def test_the_benchmark_prints_a_row_for_each_step_against_optax():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "low_bit_jax.py"
    out = subprocess.run(
        [sys.executable, str(script), "--steps", "1", "--repeats", "1", "--only", "blocks"],
        capture_output=True, text=True, timeout=600, check=True,
    ).stdout  # fmt: skip
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| blocks")]
    assert [cells[1].strip() for cells in rows] == [
        "optax.adamw", "AdamW (float32 state)", "LowBit(AdamW), 8-bit", "LowBit(AdamW), 4-bit",
        'LowBit(AdamW), "fp8"',
    ]  # fmt: skip
    assert rows[0][3].strip() == "1.00×" and all(float(cells[2]) > 0 for cells in rows)
