"""Checkpoints on NumPy: the state-dict format, round trips, resumed runs bit for bit, the file
format, atomic writes, and every way a checkpoint can fail to match (each leaves the state as it
was)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest

import optimisers as opt
import optimisers.checkpoints.state_dict as _checkpoint
from _checkpoint_helpers import (
    SEED,
    assert_same_snapshot,
    assert_states_equal,
    copy_model,
    make_grads,
    make_model,
    snapshot,
    trained,
)
from optimisers import schedules
from optimisers.core.state import leaf_paths
from rules_registry import checkpoint_rules, routed

# --- the state dict ------------------------------------------------------------------------------


def test_state_dict_keys_and_values():
    state, model = trained()
    opt.freeze_(state["head"]["bias"])
    d = opt.state_dict(state)
    adam = "Adam(eta=0.01, beta=(0.9, 0.999), epsilon=1e-08)"
    expected = {"__format__": "optimisers.state_dict.v1"}
    for name in ("embed", "layers.0.w", "layers.0.b", "layers.1.w", "head.bias"):
        expected[f"{name}/rule"] = adam
        expected[f"{name}/frozen"] = name == "head.bias"
        expected[f"{name}/state/2"] = 3
    expected["layers.2.w/tied_to"] = "layers.0.w"
    expected["layers.2.b/tied_to"] = "layers.0.b"
    expected["head.weight/tied_to"] = "embed"
    for key, value in expected.items():
        assert d[key] == value and type(d[key]) is type(value), key
    arrays = {k for k, v in d.items() if isinstance(v, np.ndarray)}
    assert arrays == {
        f"{n}/state/{i}"
        for n in ("embed", "layers.0.w", "layers.0.b", "layers.1.w", "head.bias")
        for i in (0, 1)
    }
    assert set(d) == set(expected) | arrays
    m, v, t = state["embed"].state
    assert np.array_equal(d["embed/state/0"], m) and np.array_equal(d["embed/state/1"], v)
    assert d["embed/state/0"].dtype == np.float32
    # plain types only: arrays, str, bool, int
    assert all(isinstance(v, (np.ndarray, str, bool, int)) for v in d.values())


def test_state_dict_of_a_single_array_and_of_nested_rules():
    x = np.ones(3)
    state = opt.setup(opt.Momentum(0.1), x)
    state, x = opt.update(state, x, np.ones(3))
    d = opt.state_dict(state)
    assert d["<model>/rule"] == "Momentum(eta=0.1, rho=0.9)"
    assert np.array_equal(d["<model>/state"], np.full(3, 0.1))
    back = opt.load_state_dict(opt.setup(opt.Momentum(0.1), x), d)
    assert isinstance(back.tree, opt.Leaf) and np.array_equal(back.tree.state, d["<model>/state"])

    chain = opt.OptimiserChain(opt.ClipGrad(1.0), opt.Adam(0.01))
    state = opt.setup(chain, {"w": np.ones(2)})
    state, _ = opt.update(state, {"w": np.ones(2)}, {"w": np.ones(2)})
    d = opt.state_dict(state)
    assert d["w/rule"] == (
        "OptimiserChain(rules=(ClipGrad(delta=1.0), Adam(eta=0.01, beta=(0.9, 0.999), epsilon=1e-08)))"
    )
    assert {k for k in d if k.startswith("w/state")} == {"w/state/1/0", "w/state/1/1", "w/state/1/2"}


def test_state_dict_rejects_ambiguous_names():
    state = opt.setup(opt.Adam(), {"a.b": np.ones(2), "a": {"b": np.ones(2)}})
    with pytest.raises(ValueError, match="both read 'a.b'"):
        opt.state_dict(state)


def test_argument_errors():
    state, model = trained()
    with pytest.raises(TypeError, match="did you pass the model"):
        opt.state_dict(model)
    with pytest.raises(TypeError, match="did you pass the model"):
        opt.load_state_dict(model, opt.state_dict(state))
    with pytest.raises(ValueError, match="hyperparameters must be one of"):
        opt.load_state_dict(state, opt.state_dict(state), hyperparameters="mine")
    with pytest.raises(TypeError, match="expects the dict from state_dict"):
        opt.load_state_dict(state, [1, 2])


# --- round trips ---------------------------------------------------------------------------------


def test_round_trip_is_exact_and_pure():
    state, model = trained()
    opt.freeze_(state["layers"][1])
    d = opt.state_dict(state)
    d_before = {k: (np.array(v, copy=True) if isinstance(v, np.ndarray) else v) for k, v in d.items()}
    fresh = opt.setup(opt.Adam(0.01), copy_model(model))
    fresh_before = snapshot(fresh)

    loaded = opt.load_state_dict(fresh, d)

    assert loaded is not fresh
    assert_same_snapshot(snapshot(fresh), fresh_before)  # the argument is untouched
    for k, v in d.items():  # and so is the dict
        assert np.array_equal(v, d_before[k]) if isinstance(v, np.ndarray) else v == d_before[k]
    assert_states_equal(loaded, state)
    # ties are shared Leafs again, and the shared container is still one sub-tree
    assert loaded["head"]["weight"] is loaded["embed"]
    assert loaded["layers"][2]["w"] is loaded["layers"][0]["w"]
    assert loaded.tree["layers"][2] is loaded.tree["layers"][0]
    assert loaded["layers"][1]["w"].frozen and not loaded["embed"].frozen
    # the loaded arrays are fresh: later in-place updates cannot reach the dict's arrays
    for _, leaf in leaf_paths(loaded.tree):
        for _, v in _checkpoint._state_items(leaf.state, "s", []):
            if isinstance(v, np.ndarray):
                assert not any(np.shares_memory(v, a) for a in d.values() if isinstance(a, np.ndarray))
                assert v.flags.writeable


def test_rules_shared_by_leafs_stay_shared():
    state, model = trained()
    state = opt.adjust(state, 0.003)
    loaded = opt.load_state_dict(opt.setup(opt.Adam(0.01), copy_model(model)), opt.state_dict(state))
    rules = {id(leaf.rule) for leaf in loaded.leaves()}
    assert len(rules) == 1 and loaded["embed"].rule.eta == 0.003


@pytest.mark.parametrize("rule", checkpoint_rules(), ids=lambda r: type(r).__name__)
def test_every_rule_resumes_bit_for_bit(rule, tmp_path):
    rng = np.random.default_rng(SEED)
    model = make_model(rng)
    grads = [make_grads(rng, model) for _ in range(6)]
    state = opt.setup(routed(rule), model)
    for g in grads[:3]:
        state, model = opt.update_(state, model, g)
    opt.save(tmp_path / "opt.npz", state)
    resumed_model = copy_model(model)
    resumed = opt.load(tmp_path / "opt.npz", opt.setup(routed(rule), resumed_model))
    for g in grads[3:]:
        state, model = opt.update_(state, model, g)
        resumed, resumed_model = opt.update_(resumed, resumed_model, g)
    for a, b in zip(opt.trainables(model), opt.trainables(resumed_model)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert resumed_model["head"]["weight"] is resumed_model["embed"]
    assert_states_equal(resumed, state)


# --- resuming a run ------------------------------------------------------------------------------


def run(state, model, grads, sched, start, stop, pure):
    step_fn = opt.update if pure else opt.update_
    for t in range(start, stop):
        if pure:
            state = opt.adjust(state, eta=sched(t))
        else:
            opt.adjust_(state, eta=sched(t))
        if t == 2:
            opt.freeze_(state["layers"][1])
        if t == 5:
            opt.thaw_(state["layers"][1])
            opt.freeze_(state["head"]["bias"])
        state, model = step_fn(state, model, grads[t])
    return state, model


@pytest.mark.parametrize("pure", [False, True], ids=["update_", "update"])
def test_resume_bit_for_bit(pure, tmp_path):
    rng = np.random.default_rng(SEED)
    model0 = make_model(rng)
    grads = [make_grads(rng, model0) for _ in range(10)]
    sched = schedules.Cosine(0.01, 10, warmup=2, final=0.001)
    rule = opt.OptimiserChain(opt.ClipNorm(2.0), opt.AdamW(0.01, lambd=0.01))

    full_state, full = run(opt.setup(rule, copy_model(model0)), copy_model(model0), grads, sched, 0, 10, pure)

    model = copy_model(model0)
    state, model = run(opt.setup(rule, model), model, grads, sched, 0, 4, pure)
    opt.save(tmp_path / "opt.npz", state)
    np.savez(tmp_path / "model.npz", *opt.trainables(model))
    del state, model

    with np.load(tmp_path / "model.npz") as z:
        saved = [z[f"arr_{i}"] for i in range(len(z.files))]
    model = copy_model(model0)  # a fresh model of the same architecture...
    for x, value in zip(opt.trainables(model), saved):
        x[...] = value  # ...given the saved weights
    state = opt.load(tmp_path / "opt.npz", opt.setup(rule, model))
    assert state["layers"][1]["w"].frozen
    state, model = run(state, model, grads, sched, 4, 10, pure)

    for a, b in zip(opt.trainables(full), opt.trainables(model)):
        assert np.array_equal(a, b)
    assert model["head"]["weight"] is model["embed"]
    assert model["layers"][2] is model["layers"][0]
    assert_states_equal(state, full_state)


RESUME_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import optimisers as opt
    sys.path.insert(0, {tests!r})
    from _checkpoint_helpers import copy_model, make_grads, make_model

    rng = np.random.default_rng({seed})
    model = make_model(rng)
    grads = [make_grads(rng, model) for _ in range(8)]
    with np.load({model_file!r}) as z:
        for x, name in zip(opt.trainables(model), sorted(z.files, key=lambda n: int(n[4:]))):
            x[...] = z[name]
    state = opt.load({opt_file!r}, opt.setup(opt.Adam(0.01), model))
    for g in grads[4:]:
        state, model = opt.update_(state, model, g)
    np.savez({out!r}, *opt.trainables(model))
    """
)


def test_resume_in_a_new_process(tmp_path):
    rng = np.random.default_rng(SEED)
    model = make_model(rng)
    grads = [make_grads(rng, model) for _ in range(8)]
    state = opt.setup(opt.Adam(0.01), model)
    for g in grads[:4]:
        state, model = opt.update_(state, model, g)
    opt.freeze_(state["layers"][1])
    opt.save(tmp_path / "opt.npz", state)
    np.savez(tmp_path / "model.npz", *opt.trainables(model))
    for g in grads[4:]:
        state, model = opt.update_(state, model, g)

    script = RESUME_SCRIPT.format(
        tests=os.path.dirname(__file__),
        seed=SEED,
        model_file=str(tmp_path / "model.npz"),
        opt_file=str(tmp_path / "opt.npz"),
        out=str(tmp_path / "out.npz"),
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    with np.load(tmp_path / "out.npz") as z:
        resumed = [z[f"arr_{i}"] for i in range(len(z.files))]
    for a, b in zip(opt.trainables(model), resumed):
        assert np.array_equal(a, b)


# --- hyperparameters -----------------------------------------------------------------------------


def test_hyperparameters_from_the_checkpoint_by_default():
    state, model = trained()
    state = opt.adjust(state, 0.002, beta=(0.8, 0.99))
    opt.adjust_(state["layers"][1], 0.5)
    d = opt.state_dict(state)
    fresh = opt.setup(opt.Adam(0.01), copy_model(model))

    loaded = opt.load_state_dict(fresh, d)
    assert loaded["embed"].rule == opt.Adam(0.002, (0.8, 0.99))
    assert loaded["layers"][1]["w"].rule == opt.Adam(0.5, (0.8, 0.99))
    assert fresh["embed"].rule == opt.Adam(0.01)

    kept = opt.load_state_dict(fresh, d, hyperparameters="state")
    assert all(leaf.rule is fresh["embed"].rule for leaf in kept.leaves())
    assert np.array_equal(kept["embed"].state[0], d["embed/state/0"])

    with pytest.raises(opt.CheckpointError) as e:
        opt.load_state_dict(fresh, d, hyperparameters="check")
    msg = str(e.value)
    assert "embed: Adam.eta is 0.002 in the checkpoint, 0.01 in this state" in msg
    assert "embed: Adam.beta[0] is 0.8 in the checkpoint, 0.9 in this state" in msg
    assert "layers.1.w: Adam.eta is 0.5 in the checkpoint" in msg
    assert opt.load_state_dict(
        opt.setup(opt.Adam(0.01), model), opt.state_dict(trained()[0]), hyperparameters="check"
    )


def test_nested_rule_hyperparameters_are_restored():
    chain = opt.MixedPrecision(opt.OptimiserChain(opt.WeightDecay(0.1), opt.Adam(0.01)), np.float64)
    model = {"w": np.ones(3, np.float32)}
    state = opt.adjust(opt.setup(chain, model), 0.123, lambd=0.5)
    loaded = opt.load_state_dict(opt.setup(chain, model), opt.state_dict(state))
    assert loaded["w"].rule == state["w"].rule
    inner = loaded["w"].rule.rule.rules
    assert inner[0].lambd == 0.5 and inner[1].eta == 0.123


# --- other checkpointers -------------------------------------------------------------------------


def test_through_np_savez_and_torch_save(tmp_path):
    torch = pytest.importorskip("torch")
    state, model = trained()
    opt.freeze_(state["layers"][0])
    d = opt.state_dict(state)

    np.savez(tmp_path / "plain.npz", **d)  # strings and numbers become 0-d arrays
    with np.load(tmp_path / "plain.npz", allow_pickle=False) as z:
        from_npz = {k: z[k] for k in z.files}
    torch.save(d, tmp_path / "plain.pt")
    from_torch = torch.load(tmp_path / "plain.pt", weights_only=False)

    for restored in (from_npz, from_torch):
        loaded = opt.load_state_dict(opt.setup(opt.Adam(0.01), copy_model(model)), restored)
        assert_states_equal(loaded, state)


def test_safetensors_file(tmp_path):
    pytest.importorskip("safetensors")
    state, model = trained()
    opt.save(tmp_path / "opt.safetensors", state)
    loaded = opt.load(tmp_path / "opt.safetensors", opt.setup(opt.Adam(0.01), copy_model(model)))
    assert_states_equal(loaded, state)
    from safetensors.numpy import load_file

    assert "embed/state/0" in load_file(tmp_path / "opt.safetensors")


def test_bfloat16_state_round_trips_through_a_file(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(SEED)
    model = {"w": rng.standard_normal(5).astype(bf16), "v": np.ones(2, np.float16)}
    rule = opt.Momentum(0.01)
    state = opt.setup(rule, model)
    grads = {"w": rng.standard_normal(5).astype(bf16), "v": np.ones(2, np.float16)}
    state, model = opt.update(state, model, grads)
    opt.save(tmp_path / "opt.npz", state)
    with np.load(tmp_path / "opt.npz") as z:
        meta = json.loads(z["__optimisers__"].item())
        assert z["w/state"].dtype == np.uint16  # the bits; the dtype is in the metadata
    assert meta["dtypes"] == {"w/state": "bfloat16"}
    loaded = opt.load(tmp_path / "opt.npz", opt.setup(rule, model))
    assert loaded["w"].state.dtype == bf16
    assert_states_equal(loaded, state)


def test_file_layout(tmp_path):
    state, model = trained()
    path = tmp_path / "ckpt"  # no suffix: the exact name is written
    opt.save(path, state)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
    assert "embed/state/0.npy" in names and "__optimisers__.npy" in names
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(z["__optimisers__"].item())
    assert meta["format"] == "optimisers.state_dict.v1"
    assert meta["entries"]["head.weight/tied_to"] == "embed"
    assert meta["entries"]["embed/state/2"] == 3
    assert meta["entries"]["embed/frozen"] is False


# --- atomic writes -------------------------------------------------------------------------------


def test_a_failed_save_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    state, model = trained(steps=1)
    path = tmp_path / "opt.npz"
    opt.save(path, state)
    before = path.read_bytes()
    later, _ = trained(steps=2)

    def broken_savez(f, **arrays):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError("disk full")

    monkeypatch.setattr(_checkpoint.np, "savez", broken_savez)
    with pytest.raises(OSError, match="disk full"):
        opt.save(path, later)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["opt.npz"]  # no temporary file left behind


def test_a_crash_mid_write_leaves_the_old_checkpoint(tmp_path):
    state, model = trained(steps=1)
    path = tmp_path / "opt.npz"
    opt.save(path, state)
    before = path.read_bytes()
    script = textwrap.dedent(
        f"""
        import os, sys
        import numpy as np
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import optimisers as opt
        from _checkpoint_helpers import trained
        state, _ = trained(steps=2)
        os.fsync = lambda fd: os._exit(3)  # the process dies after writing, before the rename
        opt.save({str(path)!r}, state)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], timeout=120)
    assert result.returncode == 3
    assert path.read_bytes() == before
    opt.load(path, opt.setup(opt.Adam(0.01), copy_model(model)))


def test_save_keeps_the_mode_of_an_existing_file(tmp_path):
    state, _ = trained(steps=1)
    path = tmp_path / "opt.npz"
    opt.save(path, state)
    os.chmod(path, 0o640)
    opt.save(path, state)
    assert os.stat(path).st_mode & 0o777 == 0o640


# --- checkpoints that do not match ---------------------------------------------------------------


def expect_rejected(fresh, load, *fragments):
    """`load()` raises a CheckpointError naming each fragment and leaves `fresh` as it was."""
    before = snapshot(fresh)
    with pytest.raises(opt.CheckpointError) as e:
        load()
    for fragment in fragments:
        assert fragment in str(e.value), (fragment, str(e.value))
    assert_same_snapshot(snapshot(fresh), before)
    return str(e.value)


@pytest.fixture
def saved(tmp_path):
    state, model = trained()
    path = tmp_path / "opt.npz"
    opt.save(path, state)
    return path, state, model


def test_truncated_file(saved):
    path, state, model = saved
    fresh = opt.setup(opt.Adam(0.01), copy_model(model))
    data = path.read_bytes()
    for cut in (0, 10, len(data) // 2, len(data) - 5):
        path.write_bytes(data[:cut])
        msg = expect_rejected(fresh, lambda: opt.load(path, fresh), "cannot read the checkpoint")
        assert "truncated or damaged" in msg


def test_not_a_checkpoint(tmp_path):
    state, model = trained()
    fresh = opt.setup(opt.Adam(0.01), copy_model(model))
    path = tmp_path / "model.npz"
    np.savez(path, *opt.trainables(model))
    expect_rejected(fresh, lambda: opt.load(path, fresh), "not an optimisers checkpoint", "arr_0")
    expect_rejected(
        fresh,
        lambda: opt.load_state_dict(fresh, {"w": np.ones(2)}),
        "not an optimisers state dict",
        "(its keys: w)",
    )
    d = opt.state_dict(state)
    d["__format__"] = "optimisers.state_dict.v9"
    expect_rejected(fresh, lambda: opt.load_state_dict(fresh, d), "unknown checkpoint format")
    path.write_bytes(b"\x00" * 100)
    expect_rejected(fresh, lambda: opt.load(path, fresh), "cannot read the checkpoint")
    with pytest.raises(FileNotFoundError):
        opt.load(tmp_path / "nothing.npz", fresh)


def test_damaged_metadata(saved, tmp_path):
    path, state, model = saved
    fresh = opt.setup(opt.Adam(0.01), copy_model(model))
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["__optimisers__"] = np.array("{not json")
    bad = tmp_path / "bad.npz"
    np.savez(bad, **arrays)
    expect_rejected(fresh, lambda: opt.load(bad, fresh), "is not valid JSON")


def test_wrong_shapes_and_dtypes(saved):
    path, state, model = saved
    rng = np.random.default_rng(0)
    other = make_model(rng)
    other["head"]["bias"] = np.zeros(7, np.float32)
    other["layers"][1]["w"] = other["layers"][1]["w"].astype(np.float64)
    fresh = opt.setup(opt.Adam(0.01), other)
    expect_rejected(
        fresh,
        lambda: opt.load(path, fresh),
        str(path),
        "head.bias/state/0: shape (6,) in the checkpoint, (7,) in this state",
        "head.bias/state/1: shape (6,) in the checkpoint, (7,) in this state",
        "layers.1.w/state/0: dtype float32 in the checkpoint, float64 in this state",
        "nothing was loaded",
    )


def test_missing_and_extra_entries(saved):
    path, state, model = saved
    fresh = opt.setup(opt.Adam(0.01), copy_model(model))
    d = opt.state_dict(state)
    for key in ("embed/state/1", "layers.0.w/frozen", "layers.0.b/state/2"):
        broken = {k: v for k, v in d.items() if k != key}
        expect_rejected(fresh, lambda b=broken: opt.load_state_dict(fresh, b), f"{key}: missing")
    broken = {**d, "embed/state/7": np.ones(2), "stray": 1}
    expect_rejected(
        fresh,
        lambda: opt.load_state_dict(fresh, broken),
        "embed/state/7: in the checkpoint, but the state of Adam here has no such entry",
        "entries this format does not have: stray",
    )
    broken = {k: v for k, v in d.items() if not k.startswith("layers.1.w/")}
    expect_rejected(
        fresh,
        lambda: opt.load_state_dict(fresh, broken),
        "in this state but not in the checkpoint: layers.1.w",
    )
    small = opt.setup(opt.Adam(0.01), {"embed": model["embed"], "extra": np.ones(3, np.float32)})
    expect_rejected(
        small,
        lambda: opt.load(path, small),
        "in this state but not in the checkpoint: extra",
        "in the checkpoint but not in this state: layers.0.w, layers.0.b, layers.1.w, "
        "layers.2.w, layers.2.b, head.weight, head.bias",
    )
    broken = {**d, "embed/state/0": "text"}
    expect_rejected(
        fresh, lambda: opt.load_state_dict(fresh, broken), "embed/state/0: the checkpoint holds a str"
    )
    broken = {**d, "embed/state/2": 2.5}
    expect_rejected(
        fresh,
        lambda: opt.load_state_dict(fresh, broken),
        "embed/state/2: a real number in the checkpoint, an integer in this state",
    )
    broken = {**d, "embed/frozen": "yes"}
    expect_rejected(fresh, lambda: opt.load_state_dict(fresh, broken), "embed/frozen: expected True or False")


def test_ties_that_differ(saved):
    path, state, model = saved
    # the checkpoint has embed and head.weight tied; this model has them separate
    untied = copy_model(model)
    untied["head"] = {"weight": untied["embed"].copy(), "bias": untied["head"]["bias"]}
    fresh = opt.setup(opt.Adam(0.01), untied)
    expect_rejected(
        fresh,
        lambda: opt.load(path, fresh),
        "head.weight: the checkpoint ties it to embed, this state keeps it separate",
    )

    # a checkpoint of the untied model loaded into the tied one: a tie split in two
    trained_untied = opt.update(fresh, untied, make_grads(np.random.default_rng(0), untied))[0]
    tied = opt.setup(opt.Adam(0.01), copy_model(model))
    expect_rejected(
        tied,
        lambda: opt.load_state_dict(tied, opt.state_dict(trained_untied)),
        "head.weight: this state ties it to embed, the checkpoint stores it separately (a tie split in two?)",
    )

    # a tie edited by hand to point elsewhere, or to nothing
    d = opt.state_dict(state)
    expect_rejected(
        tied,
        lambda: opt.load_state_dict(tied, {**d, "head.weight/tied_to": "head.bias"}),
        "head.weight: this state ties it to embed, the checkpoint to head.bias",
    )
    expect_rejected(
        tied,
        lambda: opt.load_state_dict(tied, {**d, "head.weight/tied_to": "nowhere"}),
        "head.weight: the checkpoint ties it to nowhere, which it does not store",
    )


def test_wrong_rule(saved):
    path, state, model = saved
    for rule, shown in [
        (opt.Momentum(0.01), "this state has Momentum(eta=0.01, rho=0.9)"),
        (opt.OptimiserChain(opt.Adam(0.01)), "this state has OptimiserChain(rules=(Adam("),
        (opt.AdamW(0.01), "this state has AdamW("),
    ]:
        fresh = opt.setup(rule, copy_model(model))
        expect_rejected(
            fresh,
            lambda f=fresh: opt.load(path, f),
            "embed: the checkpoint has rule Adam(eta=0.01, beta=(0.9, 0.999), epsilon=1e-08), " + shown,
        )
    mixed = opt.setup(opt.MixedPrecision(opt.Adam(0.01), np.float64), copy_model(model))
    d = opt.state_dict(opt.setup(opt.MixedPrecision(opt.Adam(0.01)), copy_model(model)))
    expect_rejected(mixed, lambda: opt.load_state_dict(mixed, d), "they differ at MixedPrecision.dtype")
    fresh = opt.setup(opt.Adam(0.01), copy_model(model))
    d = opt.state_dict(state)
    expect_rejected(
        fresh,
        lambda: opt.load_state_dict(fresh, {**d, "embed/rule": "Adam(eta="}),
        "embed/rule: cannot read the rule",
    )
    expect_rejected(
        fresh,
        lambda: opt.load_state_dict(fresh, {**d, "embed/rule": "__import__('os')"}),
        "embed/rule: cannot read the rule",
    )


def test_many_problems_are_listed_together(saved):
    path, state, model = saved
    rng = np.random.default_rng(0)
    other = {f"p{i}": rng.standard_normal(3) for i in range(40)}
    fresh = opt.setup(opt.Adam(), other)
    msg = expect_rejected(fresh, lambda: opt.load(path, fresh), "in this state but not in the checkpoint")
    assert "p0, p1" in msg and "and 32 more" in msg


def test_a_failed_load_after_a_good_one_changes_nothing(saved):
    path, state, model = saved
    fresh = opt.setup(opt.Adam(0.01), copy_model(model))
    loaded = opt.load(path, fresh)
    before = snapshot(loaded)
    d = opt.state_dict(state)
    d["head.bias/state/0"] = np.zeros(5, np.float32)
    with pytest.raises(opt.CheckpointError):
        opt.load_state_dict(loaded, d)
    assert_same_snapshot(snapshot(loaded), before)


def test_in_memory_buffer_paths_are_not_supported_but_pathlike_is(saved):
    path, state, model = saved
    fresh = opt.setup(opt.Adam(0.01), copy_model(model))
    assert_states_equal(opt.load(str(path), fresh), state)
    with pytest.raises(TypeError):
        opt.save(io.BytesIO(), state)
