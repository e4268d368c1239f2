"""`muon_or`: Muon on the hidden matrices, another rule on the rest; a tied embedding gets one rule,
keeps its tie, and trains as the untied model fed the summed gradient, on every backend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import optimisers as opt

STEPS = 5


def tied_model(to):
    rng = np.random.default_rng(0)
    E = to(rng.normal(size=(12, 8)).astype(np.float32))
    return {
        "embed": E,
        "block": {"w1": to(rng.normal(size=(8, 16)).astype(np.float32)),
                  "b1": to(np.zeros(16, np.float32)),
                  "w2": to(rng.normal(size=(16, 8)).astype(np.float32))},
        "lm_head": E,
    }


def grads(to, step):
    rng = np.random.default_rng(100 + step)
    g = lambda *s: to(rng.normal(size=s).astype(np.float32))  # noqa: E731
    return {"embed": g(12, 8), "block": {"w1": g(8, 16), "b1": g(16), "w2": g(16, 8)}, "lm_head": g(12, 8)}


def untied(tree):
    return {"embed": tree["embed"], "block": tree["block"]}


def summed(gs):
    return {"embed": gs["embed"] + gs["lm_head"], "block": gs["block"]}


def host(x):
    return np.asarray(x.detach().numpy() if isinstance(x, torch.Tensor) else x)


ROUTE = opt.muon_or(opt.AdamW(1e-2, lambd=0.01), muon=opt.Muon(eta=0.02))

BACKENDS = {
    "numpy": (lambda a: a.copy(), False),
    "torch": (torch.tensor, False),
    "jax-jit": (jnp.asarray, True),
}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_tied_embedding_keeps_its_tie_and_equals_the_untied_model(backend):
    to, jit = BACKENDS[backend]
    model, reference = tied_model(to), untied(tied_model(to))
    state, ref_state = opt.setup(ROUTE, model), opt.setup(ROUTE, reference)
    assert isinstance(state["embed"].rule, opt.AdamW) and state["lm_head"] is state["embed"]
    assert isinstance(state["block"]["w1"].rule, opt.Muon)
    assert isinstance(state["block"]["b1"].rule, opt.AdamW)
    update = jax.jit(opt.update) if jit else opt.update
    for step in range(STEPS):
        gs = grads(to, step)
        state, model = update(state, model, gs)
        ref_state, reference = update(ref_state, reference, summed(gs))
    if jit:  # a jitted function returns one array per output place, equal in value
        np.testing.assert_array_equal(host(model["lm_head"]), host(model["embed"]))
    else:
        assert model["lm_head"] is model["embed"]
    pairs = [("embed",), ("block", "w1"), ("block", "b1"), ("block", "w2")]
    for path in pairs:
        a, b = model, reference
        for k in path:
            a, b = a[k], b[k]
        # XLA may fuse the summed gradient differently: float32 rounding under jit
        np.testing.assert_allclose(host(a), host(b), rtol=1e-6 if jit else 0, atol=1e-7 if jit else 0)


def test_patterns_that_split_a_tie_are_refused_naming_both_places():
    route = opt.muon_or(opt.AdamW(), exclude=("embed",))
    with pytest.raises(ValueError, match=r"at embed and .* at lm_head"):
        opt.setup(route, tied_model(lambda a: a))
