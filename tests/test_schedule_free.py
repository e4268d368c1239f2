"""ScheduleFreeAdamW and ScheduleFreeSGD against the `schedulefree` package (the oracle: its
AdamWScheduleFree and SGDScheduleFree, float32 and float64) and optax.contrib's schedule_free_*
(under jit), over 25 steps: NumPy, PyTorch and JAX, random and tied models (a tied array = the
package's one parameter fed the summed gradient), in a chain, through `adjust` and `freeze_`, a
checkpoint round trip, float16/bfloat16, `eval_params` (the package's params after `eval()`);
and the drop-in classes `optimisers.torch.AdamWScheduleFree` / `SGDScheduleFree` against the
package's classes: signatures, group keys, modes, state dicts."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import optimisers as opt

torch = pytest.importorskip("torch")
schedulefree = pytest.importorskip("schedulefree")
jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import optimisers.torch as otorch  # noqa: E402
from optimisers.optax import transform  # noqa: E402

STEPS = 25
SHAPES = {"w": (4, 3), "b": (3,)}

# (rule, the package's class and keywords): every hyperparameter away from its default somewhere
SETTINGS = {
    "AdamW": (opt.ScheduleFreeAdamW(0.01), "AdamWScheduleFree", dict(lr=0.01)),
    "AdamW(all)": (
        opt.ScheduleFreeAdamW(0.02, (0.8, 0.99), 1e-6, lambd=0.1, warmup=5, r=1.0, weight_lr_power=1.0),
        "AdamWScheduleFree",
        dict(
            lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, warmup_steps=5, r=1.0, weight_lr_power=1.0
        ),
    ),
    "SGD": (opt.ScheduleFreeSGD(0.1), "SGDScheduleFree", dict(lr=0.1)),
    "SGD(all)": (
        opt.ScheduleFreeSGD(0.2, 0.8, lambd=0.1, warmup=5, r=2.0, weight_lr_power=0.0),
        "SGDScheduleFree",
        dict(lr=0.2, momentum=0.8, weight_decay=0.1, warmup_steps=5, r=2.0, weight_lr_power=0.0),
    ),
}


def initial(tied: bool) -> dict:
    gen = np.random.default_rng(0)
    model = {k: gen.standard_normal(s) for k, s in SHAPES.items()}
    if tied:
        model["tied"] = model["w"]  # one array at two places
    return model


def gradients(tied: bool, steps: int = STEPS) -> list[dict]:
    gen = np.random.default_rng(1)
    names = [*SHAPES, "tied"] if tied else list(SHAPES)
    return [{k: gen.standard_normal(SHAPES["w" if k == "tied" else k]) for k in names} for _ in range(steps)]


class Package:
    """The package's optimizer over one torch parameter per distinct array, in train mode."""

    def __init__(self, name, kwargs, model, dtype=torch.float64):
        self.params = {
            k: torch.nn.Parameter(torch.tensor(v, dtype=dtype)) for k, v in model.items() if k != "tied"
        }
        self.optimizer = getattr(schedulefree, name)(list(self.params.values()), **kwargs)
        self.optimizer.train()

    def step(self, grads):
        for k, p in self.params.items():
            g = grads.get(k)
            if k == "w" and "tied" in grads:
                g = g + grads["tied"]  # the tied parameter's gradient is the sum over its places
            p.grad = None if g is None else torch.tensor(g, dtype=p.dtype)
        self.optimizer.step()

    def values(self) -> dict:
        return {k: p.detach().double().numpy().copy() for k, p in self.params.items()}

    def eval_values(self) -> dict:
        self.optimizer.eval()
        out = self.values()
        self.optimizer.train()
        return out


def as_numpy(tree) -> dict:
    return {
        k: np.asarray(torch.as_tensor(v).double() if isinstance(v, torch.Tensor) else v, np.float64)
        for k, v in tree.items()
    }


def assert_close(ours, theirs, rtol, atol):
    ours = as_numpy(ours)
    for k, v in theirs.items():
        np.testing.assert_allclose(ours[k], v, rtol=rtol, atol=atol, err_msg=k)
    if "tied" in ours:
        np.testing.assert_array_equal(ours["tied"], ours["w"])


# --- the rule against the package ------------------------------------------------------------------


def _model_for(backend, tied):
    """The initial model on `backend`, a tied array being one object at both places."""
    base = initial(tied)
    convert = {
        "numpy": lambda v: v.copy(),
        "torch": lambda v: torch.tensor(v, dtype=torch.float32),
        "jax": lambda v: jax.numpy.asarray(v, jax.numpy.float32),
    }[backend]
    model = {k: convert(v) for k, v in base.items() if k != "tied"}
    if tied:
        model["tied"] = model["w"]
    return model


def _grads_for(backend, grads):
    if backend == "numpy":
        return grads
    if backend == "torch":
        return {k: torch.tensor(v, dtype=torch.float32) for k, v in grads.items()}
    return {k: jax.numpy.asarray(v, jax.numpy.float32) for k, v in grads.items()}


@pytest.mark.parametrize("tied", [False, True], ids=["random", "tied"])
@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_rule_matches_the_package(name, backend, tied):
    rule, cls, kwargs = SETTINGS[name]
    wide = backend == "numpy"  # float64 there, float32 on torch and JAX (jitted)
    theirs = Package(cls, kwargs, initial(tied), torch.float64 if wide else torch.float32)
    model = _model_for(backend, tied)
    state = opt.setup(rule, model)
    update = jax.jit(opt.update) if backend == "jax" else opt.update_ if backend == "torch" else opt.update
    for grads in gradients(tied):
        theirs.step(grads)
        state, model = update(state, model, _grads_for(backend, grads))
    rtol, atol = (1e-12, 1e-13) if wide else (2e-5, 2e-6)
    assert_close(model, theirs.values(), rtol, atol)
    assert_close(opt.eval_params(state, model), theirs.eval_values(), rtol, atol)


def test_the_parameter_is_y_and_eval_params_the_average():
    """Over many steps with a noisy gradient, the average x sits nearer the minimum than y."""
    rule = opt.ScheduleFreeSGD(0.5)
    model = {"w": np.full(200, 3.0)}
    state = opt.setup(rule, model)
    gen = np.random.default_rng(2)
    for _ in range(300):
        state, model = opt.update(state, model, {"w": model["w"] + gen.standard_normal(200)})
    x = opt.eval_params(state, model)["w"]
    assert np.mean(x**2) < 0.5 * np.mean(model["w"] ** 2)


def test_eval_params_is_pure_and_keeps_ties():
    rule, cls, kwargs = SETTINGS["AdamW(all)"]
    model = initial(tied=True)
    state = opt.setup(rule, model)
    for grads in gradients(True, 5):
        state, model = opt.update(state, model, grads)
    before_model = {k: v.copy() for k, v in model.items()}
    before_state = opt.state_dict(state)
    ev = opt.eval_params(state, model)
    assert ev["w"] is ev["tied"] and ev["w"] is not model["w"]
    assert not np.array_equal(ev["w"], model["w"])
    for k in model:
        np.testing.assert_array_equal(model[k], before_model[k])
    after_state = opt.state_dict(state)
    assert before_state.keys() == after_state.keys()
    for k, v in before_state.items():
        np.testing.assert_array_equal(np.asarray(after_state[k]), np.asarray(v))


def test_eval_params_before_any_step_is_the_model():
    model = initial(tied=False)
    ev = opt.eval_params(opt.setup(opt.ScheduleFreeAdamW(), model), model)
    for k in model:
        np.testing.assert_array_equal(ev[k], model[k])


def test_in_a_chain_after_clipgrad():
    rule = opt.OptimiserChain(opt.ClipGrad(0.5), opt.ScheduleFreeAdamW(0.01, lambd=0.1))
    theirs = Package("AdamWScheduleFree", dict(lr=0.01, weight_decay=0.1), initial(True))
    model = initial(True)
    state = opt.setup(rule, model)
    for grads in gradients(True):
        theirs.step(
            {k: np.clip(g, -0.5, 0.5) for k, g in grads.items() if k != "tied"}
            | {"w": np.clip(grads["w"] + grads["tied"], -0.5, 0.5)}
        )
        state, model = opt.update(state, model, grads)
    assert_close(model, theirs.values(), 1e-12, 1e-13)
    assert_close(opt.eval_params(state, model), theirs.eval_values(), 1e-12, 1e-13)


@pytest.mark.parametrize("name", ["AdamW(all)", "SGD(all)"])
def test_adjust_is_the_package_changing_its_lr(name):
    rule, cls, kwargs = SETTINGS[name]
    theirs = Package(cls, kwargs, initial(False))
    model = initial(False)
    state = opt.setup(rule, model)
    for t, grads in enumerate(gradients(False)):
        if t == 12:  # lower, then (t == 18) higher than before: lr_max follows the largest
            state = opt.adjust(state, eta=kwargs["lr"] / 4)
            theirs.optimizer.param_groups[0]["lr"] = kwargs["lr"] / 4
        if t == 18:
            state = opt.adjust(state, eta=kwargs["lr"] * 2)
            theirs.optimizer.param_groups[0]["lr"] = kwargs["lr"] * 2
        theirs.step(grads)
        state, model = opt.update(state, model, grads)
    assert_close(model, theirs.values(), 1e-12, 1e-13)


def test_a_frozen_part_does_not_move_nor_count():
    rule, cls, kwargs = SETTINGS["AdamW(all)"]
    model = initial(False)
    state = opt.setup(rule, model)
    opt.freeze_(state.tree["b"])
    theirs = Package(cls, kwargs, {"w": model["w"]})
    for grads in gradients(False):
        theirs.step({"w": grads["w"]})
        state, model = opt.update(state, model, grads)
    np.testing.assert_array_equal(model["b"], initial(False)["b"])
    assert state.tree["b"].state[2] == 0  # its own counter: no steps taken
    assert_close({"w": model["w"]}, theirs.values(), 1e-12, 1e-13)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_checkpoint_round_trip_continues_bit_for_bit(name):
    rule = SETTINGS[name][0]
    grads = gradients(True)
    model = initial(True)
    state = opt.setup(rule, model)
    for g in grads[:10]:
        state, model = opt.update(state, model, g)
    saved = opt.state_dict(state)
    resumed_model = {"w": model["w"].copy(), "b": model["b"].copy()}
    resumed_model["tied"] = resumed_model["w"]
    resumed = opt.load_state_dict(opt.setup(rule, resumed_model), saved)
    for g in grads[10:]:
        state, model = opt.update(state, model, g)
        resumed, resumed_model = opt.update(resumed, resumed_model, g)
    for k in model:
        np.testing.assert_array_equal(resumed_model[k], model[k])
    ev, ev_resumed = opt.eval_params(state, model), opt.eval_params(resumed, resumed_model)
    for k in model:
        np.testing.assert_array_equal(ev_resumed[k], ev[k])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["AdamW(all)", "SGD(all)"])
def test_half_precision_stays_near_the_package_in_float32(name, dtype):
    rule, cls, kwargs = SETTINGS[name]
    theirs = Package(cls, kwargs, initial(False), torch.float32)
    model = {k: torch.tensor(v, dtype=dtype) for k, v in initial(False).items()}
    state = opt.setup(rule, model)
    for grads in gradients(False, 20):
        theirs.step(grads)
        state, model = opt.update_(state, model, {k: torch.tensor(g, dtype=dtype) for k, g in grads.items()})
    assert all(v.dtype == dtype for v in model.values())
    assert state.tree["w"].state[0].dtype == dtype  # z in the parameter's dtype
    eps = torch.finfo(dtype).eps
    assert_close(model, theirs.values(), 0, 20 * eps * 3)
    assert_close(opt.eval_params(state, model), theirs.eval_values(), 0, 40 * eps * 3)


# --- optax.contrib, under jit ---------------------------------------------------------------------


OPTAX = {
    "AdamW": (
        opt.ScheduleFreeAdamW(0.02, (0.8, 0.99), 1e-6, lambd=0.1, weight_lr_power=1.0),
        lambda: optax.contrib.schedule_free_adamw(
            0.02, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1, weight_lr_power=1.0
        ),
    ),
    "SGD": (
        opt.ScheduleFreeSGD(0.2, 0.8, lambd=0.1),
        lambda: optax.contrib.schedule_free_sgd(0.2, b1=0.8, weight_decay=0.1),
    ),
}


@pytest.mark.parametrize("name", list(OPTAX))
def test_optax_contrib_under_jit(name):
    """warmup=0, r=0: the settings where optax computes the same steps (it forms x, so float32
    results agree up to rounding)."""
    rule, make = OPTAX[name]
    tx = make()
    params = _model_for("jax", False)
    model = dict(params)
    opt_state, state = tx.init(params), opt.setup(rule, model)

    @jax.jit
    def theirs(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    ours = jax.jit(opt.update)
    for grads in gradients(False):
        g = _grads_for("jax", grads)
        params, opt_state = theirs(params, opt_state, g)
        state, model = ours(state, model, g)
    expected = as_numpy({k: np.asarray(v) for k, v in params.items()})
    assert_close({k: np.asarray(v) for k, v in model.items()}, expected, 1e-5, 1e-6)
    evaluated = optax.contrib.schedule_free_eval_params(opt_state, params)
    ev = jax.jit(opt.eval_params)(state, model)
    assert_close(
        {k: np.asarray(v) for k, v in ev.items()},
        as_numpy({k: np.asarray(v) for k, v in evaluated.items()}),
        1e-5,
        1e-6,
    )


def test_optimisers_optax_transform_under_jit_matches_update():
    rule = SETTINGS["AdamW(all)"][0]
    tx = transform(rule)
    params = _model_for("jax", False)
    model = dict(params)
    tstate, state = tx.init(params), opt.setup(rule, model)

    @jax.jit
    def through_optax(params, tstate, grads):
        updates, tstate = tx.update(grads, tstate, params)
        return optax.apply_updates(params, updates), tstate

    for grads in gradients(False, 10):
        g = _grads_for("jax", grads)
        params, tstate = through_optax(params, tstate, g)
        state, model = jax.jit(opt.update)(state, model, g)
    assert_close(
        {k: np.asarray(v) for k, v in params.items()},
        as_numpy({k: np.asarray(v) for k, v in model.items()}),
        1e-6,
        1e-7,
    )


def test_hyperparameters_are_checked():
    with pytest.raises(ValueError, match=r"beta\[0\]"):
        opt.ScheduleFreeAdamW(beta=(0.0, 0.999))
    with pytest.raises(ValueError, match=r"beta\[1\]"):
        opt.ScheduleFreeAdamW(beta=(0.9, 1.0))
    with pytest.raises(ValueError, match="beta"):
        opt.ScheduleFreeSGD(beta=1.5)
    with pytest.raises(ValueError, match="warmup"):
        opt.ScheduleFreeSGD(warmup=-1)
    with pytest.raises(TypeError, match="warmup"):
        opt.ScheduleFreeSGD(warmup=2.5)
    with pytest.raises(ValueError, match="lambd"):
        opt.ScheduleFreeAdamW(lambd=-0.1)


# --- the torch classes against the package's ------------------------------------------------------

DROPINS = {
    "AdamWScheduleFree": dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, warmup_steps=5, r=1.0),
    "SGDScheduleFree": dict(lr=0.1, momentum=0.8, weight_decay=0.1, warmup_steps=5, weight_lr_power=1.0),
}


class TiedNet(torch.nn.Module):
    """An embedding tied to the output layer: one Parameter at two places."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.embed = torch.nn.Embedding(10, 6)
        self.hidden = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.hidden(self.embed(tokens))))


def _train(model, optimizer, steps, switch_at=()):
    gen = torch.Generator().manual_seed(4)
    for t in range(steps):
        tokens = torch.randint(0, 10, (16,), generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(tokens), (tokens + 1) % 10).backward()
        optimizer.step()
        if t in switch_at:
            optimizer.eval()
            optimizer.eval()  # a second call does nothing
            optimizer.train()


def _assert_same_run(ours_model, theirs_model, ours, theirs, rtol=2e-5, atol=2e-6):
    for (name, a), b in zip(ours_model.named_parameters(), theirs_model.parameters()):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=name)
        torch.testing.assert_close(ours.state[a]["z"], theirs.state[b]["z"], rtol=rtol, atol=atol)
    for g, h in zip(ours.param_groups, theirs.param_groups):
        assert g.keys() == h.keys()
        for k in ("k", "train_mode", "lr_max", "scheduled_lr"):
            assert g[k] == h[k], k
        assert g["weight_sum"] == pytest.approx(h["weight_sum"], rel=1e-12)


@pytest.mark.parametrize("name", list(DROPINS))
def test_dropin_matches_the_package_on_a_tied_model(name):
    kwargs = DROPINS[name]
    ours_model, theirs_model = TiedNet(), TiedNet()
    ours = getattr(otorch, name)(ours_model.parameters(), **kwargs)
    theirs = getattr(schedulefree, name)(theirs_model.parameters(), **kwargs)
    ours.train()
    theirs.train()
    _train(ours_model, ours, 25, switch_at=(7, 15))
    _train(theirs_model, theirs, 25, switch_at=(7, 15))
    assert ours_model.head.weight is ours_model.embed.weight
    _assert_same_run(ours_model, theirs_model, ours, theirs)
    ours.eval()
    theirs.eval()
    _assert_same_run(ours_model, theirs_model, ours, theirs)


@pytest.mark.parametrize("name", list(DROPINS))
def test_dropin_matches_the_package_with_two_groups(name):
    """Two param groups with their own learning rates; float32, random model."""
    torch.manual_seed(5)
    theirs_model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    ours_model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    ours_model.load_state_dict(theirs_model.state_dict())

    def groups(m):
        return [{"params": m[0].parameters()}, {"params": m[2].parameters(), "lr": DROPINS[name]["lr"] / 3}]

    ours = getattr(otorch, name)(groups(ours_model), **DROPINS[name])
    theirs = getattr(schedulefree, name)(groups(theirs_model), **DROPINS[name])
    ours.train()
    theirs.train()
    gen = torch.Generator().manual_seed(6)
    for _ in range(22):
        x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)
        for m, o in ((ours_model, ours), (theirs_model, theirs)):
            o.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
            o.step()
    _assert_same_run(ours_model, theirs_model, ours, theirs)


@pytest.mark.parametrize("name", list(DROPINS))
def test_dropin_signature_defaults_and_group_keys_are_the_packages(name):
    ours_cls, theirs_cls = getattr(otorch, name), getattr(schedulefree, name)
    ours_sig = inspect.signature(ours_cls.__init__).parameters
    theirs_sig = inspect.signature(theirs_cls.__init__).parameters
    assert list(ours_sig) == list(theirs_sig)
    for k in ours_sig:
        assert ours_sig[k].default == theirs_sig[k].default, k
    p, q = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    ours, theirs = ours_cls([p]), theirs_cls([q])
    mine = {k: v for k, v in ours.param_groups[0].items() if k != "params"}
    expected = {k: v for k, v in theirs.param_groups[0].items() if k != "params"}
    assert list(mine) == list(expected) and mine == expected


@pytest.mark.parametrize("name", list(DROPINS))
def test_dropin_starts_in_eval_mode_and_refuses_to_step_there(name):
    p = torch.nn.Parameter(torch.ones(3))
    ours = getattr(otorch, name)([p])
    p.grad = torch.ones(3)
    assert ours.param_groups[0]["train_mode"] is False
    with pytest.raises(Exception, match="not in train mode") as raised:
        ours.step()
    q = torch.nn.Parameter(torch.ones(3))
    q.grad = torch.ones(3)
    with pytest.raises(Exception, match="not in train mode"):
        getattr(schedulefree, name)([q]).step()
    assert isinstance(raised.value, RuntimeError)
    torch.testing.assert_close(p.detach(), torch.ones(3))
    ours.train()
    ours.step()
    ours.eval()
    with pytest.raises(RuntimeError, match="not in train mode"):
        ours.step()


def test_sgd_dropin_refuses_momentum_outside_0_1():
    for momentum in (0.0, 1.0):
        with pytest.raises(ValueError, match="momentum"):
            otorch.SGDScheduleFree([torch.nn.Parameter(torch.ones(2))], momentum=momentum)


@pytest.mark.parametrize("name", list(DROPINS))
def test_dropin_state_dict_round_trip(name):
    """Saved in eval mode (as the package asks) mid-training, loaded into a new optimizer: the
    run continues bit for bit; and the package's own state dict loads and continues like it."""
    kwargs = DROPINS[name]
    model, copy, theirs_model = TiedNet(), TiedNet(), TiedNet()
    ours = getattr(otorch, name)(model.parameters(), **kwargs)
    theirs = getattr(schedulefree, name)(theirs_model.parameters(), **kwargs)
    ours.train()
    theirs.train()
    _train(model, ours, 10)
    _train(theirs_model, theirs, 10)
    ours.eval()
    theirs.eval()
    saved, saved_theirs = ours.state_dict(), theirs.state_dict()
    assert set(saved["state"][0]) == set(saved_theirs["state"][0])
    copy.load_state_dict(model.state_dict())
    resumed = getattr(otorch, name)(copy.parameters(), **kwargs)
    resumed.load_state_dict(saved)
    from_package_model = TiedNet()
    from_package_model.load_state_dict(theirs_model.state_dict())
    from_package = getattr(otorch, name)(from_package_model.parameters(), **kwargs)
    from_package.load_state_dict(saved_theirs)
    for o in (ours, resumed, theirs, from_package):
        assert o.param_groups[0]["train_mode"] is False
        o.train()
    _train(model, ours, 12)
    _train(copy, resumed, 12)
    _train(theirs_model, theirs, 12)
    _train(from_package_model, from_package, 12)
    for a, b in zip(model.parameters(), copy.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    _assert_same_run(from_package_model, theirs_model, from_package, theirs)


def test_a_traced_learning_rate_with_a_concrete_state():
    """`adjust` to a traced eta inside `jit`, the state closed over (its counters plain numbers):
    the step is traced through, and equals the eager one."""
    model = {"w": jax.numpy.ones(3)}
    state = opt.setup(opt.ScheduleFreeAdamW(lambd=0.1, warmup=2), model)
    grads = {"w": jax.numpy.asarray([1.0, -2.0, 0.5])}

    def stepped(eta):
        return opt.update(opt.adjust(state, eta=eta), model, grads)[1]["w"]

    np.testing.assert_allclose(jax.jit(stepped)(0.1), stepped(0.1), rtol=1e-6)
