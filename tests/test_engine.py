"""The in-place engine (flat group buffers, chunks, threads) agrees bit for bit with the plain
per-Leaf path, through freezing, missing gradients, adjusting, ties and pure updates."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import optimisers as opt
import optimisers.engine.plan as _engine_plan
from optimisers.core.state import flatten_state
from optimisers.engine.layout import holder
from optimisers.engine.plan import PLANS
from rules_registry import RULES as REGISTRY

ELEMENTWISE = [
    opt.Descent(0.1),
    opt.Adam(0.01),
    opt.OptimiserChain(opt.AccumGrad(2), opt.WeightDecay(0.01), opt.AdamW(0.01, lambd=0.1)),
    opt.MixedPrecision(opt.Lion(0.01)),
]
# a first member that scales each parameter's whole gradient by one factor, then elementwise ones
SCALED = [
    opt.OptimiserChain(opt.ClipNorm(1.0), opt.Adam(0.01)),
    opt.OptimiserChain(opt.ClipNorm(0.5, 1), opt.WeightDecay(0.01), opt.Momentum(0.01)),
    opt.LAMB(0.01, lambd=0.01),  # (a factor per array from a direction of its own: a trust ratio)
    opt.LARS(0.1, lambd=0.01, trust=0.02, nesterov=True),
]


pytestmark = pytest.mark.usefixtures("tiny_chunks")


def make_model(seed=0):
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((10, 15)).astype(np.float32)  # 150 elements: split in chunks
    return {
        "tied_a": W,
        "small": [rng.standard_normal(s).astype(np.float32) for s in [(3,), (4, 2), (7,), (1,)]],
        "big": rng.standard_normal(200).astype(np.float32),
        "tied_b": W,
        "tied_c": W,  # three places: three gradients summed
        "f64": rng.standard_normal((5, 5)),  # another dtype: another group
        "scalar": np.array(1.5, np.float32),  # 0-d: per-Leaf path
        "strided": rng.standard_normal((6, 6)).astype(np.float32)[:, ::2],  # not contiguous
    }


def to_backend(model, backend):
    """The model on `backend`, ties kept (one tensor per distinct array)."""
    if backend == "numpy":
        return model
    import torch

    made = {}

    def conv(x):
        if id(x) not in made:
            made[id(x)] = torch.from_numpy(x.copy() if x.flags.c_contiguous else x)
        return made[id(x)]

    return {k: ([conv(a) for a in v] if isinstance(v, list) else conv(v)) for k, v in model.items()}


def as_numpy(x):
    return x.detach().numpy() if hasattr(x, "detach") else x


def random_grads(model, rng, drop=()):
    def g(x):
        out = rng.standard_normal(tuple(x.shape)).astype(as_numpy(x).dtype)
        return out if isinstance(x, np.ndarray) else __import__("torch").from_numpy(out)

    grads = {k: (g(v) if not isinstance(v, list) else [g(a) for a in v]) for k, v in model.items()}
    for k in drop:
        grads[k] = None
    return grads


def assert_same(m1, m2, s1, s2):
    for a, b in zip(opt.trainables(m1), opt.trainables(m2)):
        np.testing.assert_array_equal(as_numpy(a), as_numpy(b))
    for l1, l2 in zip(s1.leaves(), s2.leaves()):
        p1, p2 = [], []
        flatten_state(l1.state, p1)
        flatten_state(l2.state, p2)
        for a, b in zip(p1, p2):
            np.testing.assert_array_equal(as_numpy(a), as_numpy(b))


# and every elementwise rule of rules_registry.py, at the hyperparameters of its `toy` family
REGISTERED = [
    rule
    for rule in (info.make(h) for info in REGISTRY if info.elementwise for h in info.toy)
    if rule not in ELEMENTWISE
]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("rule", ELEMENTWISE + SCALED + REGISTERED, ids=repr)
def test_engine_matches_plain_path_through_events(rule, backend):
    assert rule.elementwise or rule.scaled_elementwise
    model = to_backend(make_model(), backend)
    reference = to_backend(make_model(), backend)
    state = opt.setup(rule, model)
    ref_state = opt.setup(rule, reference)
    rng = np.random.default_rng(1)
    originals = {k: id(v) for k, v in model.items()}
    for step in range(8):
        drop = ("big",) if step == 2 else ()
        grads = random_grads(model, rng, drop)
        if step == 3:
            opt.freeze_(state["small"][1])
            opt.freeze_(ref_state["small"][1])
        if step == 5:
            opt.thaw_(state["small"])
            opt.thaw_(ref_state["small"])
            if "eta" in rule.hyperparameters():  # AdaDelta and the gradient transformations have none
                opt.adjust_(state, eta=0.003)
                ref_state = opt.adjust(ref_state, eta=0.003)
        state, model = opt.update_(state, model, grads)
        ref_state, reference = opt.update(ref_state, reference, grads)
        assert_same(model, reference, state, ref_state)
        assert model["tied_a"] is model["tied_b"] is model["tied_c"]
        assert {k: id(v) for k, v in model.items()} == originals
    assert PLANS.get(state) is not None and len(PLANS[state].groups) >= 2


def test_group_state_is_visible_per_leaf_and_survives_pure_updates():
    model = make_model()
    state = opt.setup(opt.Adam(0.01), model)
    rng = np.random.default_rng(2)
    grads = random_grads(model, rng)
    state, model = opt.update_(state, model, grads)
    leaf = state["big"]
    assert holder(leaf) is not None  # the engine holds it
    m, v, t = leaf.state
    assert t == 1 and m.shape == (200,)
    snapshot = [a.copy() for a in (m, v)]
    # a pure update reads the grouped state but must not touch it
    new_state, _ = opt.update(state, model, grads)
    np.testing.assert_array_equal(state["big"].state[0], snapshot[0])
    assert state["big"].state[2] == 1 and new_state["big"].state[2] == 2
    # replacing a Leaf's state detaches it; the next update_ re-plans
    leaf.state = (np.zeros(200, np.float32), np.zeros(200, np.float32), 0)
    assert holder(leaf) is None
    opt.update_(state, model, grads)
    assert leaf.state[2] == 1 and holder(leaf) is not None


@pytest.mark.parametrize("pure", [opt.update, opt.adjust])
def test_pure_results_do_not_share_the_engine_buffers(pure):
    model = make_model()
    state = opt.setup(opt.Adam(0.01), model)
    rng = np.random.default_rng(3)
    state, model = opt.update_(state, model, random_grads(model, rng))
    if pure is opt.update:  # "big" gets no gradient: its new state is carried over, not computed
        new_state, _ = opt.update(state, model, random_grads(model, rng, drop=("big",)))
    else:
        new_state = opt.adjust(state, eta=0.5)
    kept = [a.copy() for a in new_state["big"].state[:2]]
    opt.update_(state, model, random_grads(model, rng))  # steps the original's buffers in place
    for a, b in zip(kept, new_state["big"].state[:2]):
        np.testing.assert_array_equal(a, b)


def test_copies_at_tied_places_take_the_plain_path():
    W = np.ones(100, np.float32)
    state = opt.setup(opt.Descent(0.5), {"a": W, "b": W})
    copies = {"a": W.copy(), "b": W.copy()}
    g = np.ones(100, np.float32)
    _, new = opt.update_(state, copies, {"a": g, "b": g})
    np.testing.assert_array_equal(new["a"], np.zeros(100, np.float32))
    np.testing.assert_array_equal(new["b"], np.zeros(100, np.float32))


@pytest.mark.parametrize(
    "rule, kernel",
    [(opt.Adam(0.01), "_fused_adam_"), (opt.AdamW(0.01, lambd=0.1), "_fused_adamw_")],
    ids=["Adam", "AdamW"],
)
def test_torch_uses_its_fused_kernel_in_both_paths(rule, kernel, monkeypatch):
    torch = pytest.importorskip("torch")
    calls = []
    original = getattr(torch, kernel)
    monkeypatch.setattr(torch, kernel, lambda *a, **k: calls.append(len(a[0])) or original(*a, **k))
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(30, 7, generator=gen)
    model = {"a": W, "b": [torch.randn(5, generator=gen), W]}
    pure = {"a": W.clone()}
    pure["b"] = [model["b"][0].clone(), pure["a"]]
    s_inplace, s_pure = opt.setup(rule, model), opt.setup(rule, pure)
    for _ in range(4):
        def r(*shape):
            return torch.randn(*shape, generator=gen)

        g = {"a": r(30, 7), "b": [r(5), r(30, 7)]}
        s_inplace, model = opt.update_(s_inplace, model, g)
        s_pure, pure = opt.update(s_pure, pure, g)
        assert torch.equal(model["a"], pure["a"]) and torch.equal(model["b"][0], pure["b"][0])
        assert model["a"] is W and model["b"][1] is W and pure["a"] is pure["b"][1]
    assert 2 in calls  # update_: one call for the whole group of two tensors
    assert 1 in calls  # update: one call per tensor, on copies
    assert s_inplace["a"].state[2] == s_pure["a"].state[2] == 4


def test_torch_rules_without_a_fused_kernel_take_the_generic_maths(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch, "_fused_adam_", None)  # would fail if called
    monkeypatch.setattr(torch, "_fused_adamw_", None)
    # (float16/bfloat16 Adam does take torch's kernel, which computes in float32 as we do)
    cases = [(opt.AdamW(0.01, lambd=0.1, couple=False), dtype) for dtype in (torch.float32, torch.float16)]
    for rule, dtype in cases:
        x = torch.ones(8, dtype=dtype)
        state = opt.setup(rule, {"x": x})
        state, new = opt.update_(state, {"x": x}, {"x": torch.ones(8, dtype=dtype)})
        assert new["x"] is x and x.dtype == dtype and bool((x < 1).all())


@pytest.mark.parametrize("rule", [opt.Adam(0.1), opt.Momentum(0.1)], ids=["Adam", "Momentum"])
@pytest.mark.parametrize("replan", [False, True], ids=["same-plan", "replanned"])
def test_torch_parameter_converted_after_setup_leaves_its_group(rule, replan, monkeypatch):
    # `module.double()` swaps each parameter's data in place: the same objects, another dtype. The
    # engine must give what the per-Leaf path gives (the state promoted to float64), both when the
    # float32 group is still planned and when a new parameter makes it plan again at that very
    # step (its float32 state must not be grouped with the float64 parameter), and the update
    # after that plans a float64 group.
    torch = pytest.importorskip("torch")

    def run(engine):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(16, generator=gen)) for _ in range(3)]
        state = opt.setup(rule, params)
        with monkeypatch.context() as m:
            if not engine:
                m.setattr(_engine_plan, "select", lambda state, found: [])
            for step in range(4):
                if step == 2:
                    params[1].data = params[1].data.double()
                grads = [torch.randn(16, generator=gen) for _ in range(3)]
                if replan and step < 2:
                    grads[2] = None  # params[2] joins at step 2: the plan is made again then
                state, params = opt.update_(state, params, grads)
        return state, params

    state, params = run(engine=True)
    ref_state, ref = run(engine=False)
    assert params[1].dtype == state[1].state[0].dtype == torch.float64
    (wide,) = [g for g in PLANS[state].groups if g.dtype == torch.float64]
    assert wide.leaves == [state[1]]  # grouped again once its state was promoted
    assert_same(params, ref, state, ref_state)


class _FakeLibc:
    def __init__(self, calls):
        self.calls = calls

    def mallopt(self, option, value):
        self.calls.append((option, value))
        return 1


@pytest.mark.parametrize("setting", [None, "default"])
def test_numpy_engine_sets_malloc_thresholds_once_unless_told_not_to(setting, monkeypatch):
    from optimisers.backends import numpy as _numpy

    calls: list = []
    monkeypatch.setattr(_numpy.ctypes, "CDLL", lambda name: _FakeLibc(calls))
    monkeypatch.setattr(_numpy.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(_numpy, "_allocator_tuned", False)
    if setting is None:
        monkeypatch.delenv("OPTIMISERS_MALLOC", raising=False)
    else:
        monkeypatch.setenv("OPTIMISERS_MALLOC", setting)
    model = make_model()
    state = opt.setup(opt.Adam(0.01), model)
    for _ in range(2):
        opt.update_(state, model, model)
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    expected = [(M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 64 << 20)] if setting is None else []
    assert calls == expected


# --- differential: the engine against the per-Leaf path, through random events -------------------

_EVENT_RULES = [
    opt.Adam(0.01),
    opt.AdamW(0.01, lambd=0.1, couple=False),
    opt.Momentum(0.01, 0.9),
    opt.Lion(0.01),
    opt.RAdam(0.01),
    opt.OptimiserChain(opt.AccumGrad(2), opt.Adam(0.01)),
    opt.MixedPrecision(opt.Adam(0.01)),
    *SCALED,
]


def _events_run(backend, rule, shapes, dtype, events, seed, engine, monkeypatch):
    """Six `update_` steps of a model with a tie, with `events[step]` applied before each step:
    freeze, thaw, adjust, a gradient missing, a parameter replaced by a new array, or (torch) a
    parameter converted to the other float dtype in place (`.data =`, as `module.double()`)."""
    torch = pytest.importorskip("torch") if backend == "torch" else None
    rng = np.random.default_rng(seed)

    def array(a):
        return torch.from_numpy(a) if torch is not None else a

    model = {f"p{i}": array(rng.standard_normal(s).astype(dtype)) for i, s in enumerate(shapes)}
    model["tie"] = model["p0"]
    state = opt.setup(rule, model)
    with monkeypatch.context() as m:
        if not engine:
            m.setattr(_engine_plan, "select", lambda state, found: [])
        for event in events:
            grads = {k: array(rng.standard_normal(v.shape).astype(np.float32)) for k, v in model.items()}
            if event == "freeze":
                opt.freeze_(state["p1"])
            elif event == "thaw":
                opt.thaw_(state)
            elif event == "adjust":
                opt.adjust_(state, 0.003)
            elif event == "no-grad":
                grads["p1"] = None
            elif event == "replace":
                model["p1"] = model["p1"].clone() if torch is not None else model["p1"].copy()
            elif event == "convert" and torch is not None:
                p = model["p1"]
                p.data = p.data.double() if p.dtype == torch.float32 else p.data.float()
            state, model = opt.update_(state, model, grads)
    return state, model


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    backend=st.sampled_from(["numpy", "torch"]),
    rule=st.sampled_from(_EVENT_RULES),
    shapes=st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=2).map(tuple), min_size=2, max_size=6),
    dtype=st.sampled_from([np.float32, np.float64]),
    events=st.lists(
        st.sampled_from(["none", "freeze", "thaw", "adjust", "no-grad", "replace", "convert"]),
        min_size=6,
        max_size=6,
    ),
    seed=st.integers(0, 2**16),
)
def test_engine_equals_per_leaf_path_through_random_events(
    backend, rule, shapes, dtype, events, seed, monkeypatch
):
    s1, m1 = _events_run(backend, rule, shapes, dtype, events, seed, True, monkeypatch)
    s2, m2 = _events_run(backend, rule, shapes, dtype, events, seed, False, monkeypatch)
    assert m1["tie"] is m1["p0"]
    for k in m1:
        assert as_numpy(m1[k]).dtype == as_numpy(m2[k]).dtype
    assert_same(m1, m2, s1, s2)


def test_a_clipnorm_chain_steps_in_the_engine_in_chunks():
    model = make_model()
    rule = SCALED[0]
    state = opt.setup(rule, model)
    state, model = opt.update_(state, model, random_grads(model, np.random.default_rng(0)))
    (group,) = [g for g in PLANS[state].groups if g.dtype == np.float32]
    assert group.scaled and len(group.leaves) == 6  # W, four small, big (not the 0-d, strided)
    runs = [c for c in group.chunks if c[0] == "run"]
    assert runs and all(c[2] - c[1] >= 2 for c in runs)  # small members packed, each its factor
    assert sum(c[0] == "big" for c in group.chunks) > 2  # W and big are split


def test_a_clipnorm_that_raises_leaves_every_group_as_it_was():
    model = make_model()
    state = opt.setup(opt.OptimiserChain(opt.ClipNorm(1.0), opt.Adam(0.01)), model)
    rng = np.random.default_rng(0)
    state, model = opt.update_(state, model, random_grads(model, rng))
    before = [x.copy() for x in opt.trainables(model)]
    parts_before = []
    for leaf in state.leaves():
        parts: list = []
        flatten_state(leaf.state, parts)
        parts_before.append([np.array(p, copy=True) for p in parts])
    grads = random_grads(model, rng)
    grads["f64"] = grads["f64"].copy()
    grads["f64"][0, 0] = np.inf  # the float64 group's factor raises; the float32 group is first
    with pytest.raises(ValueError, match="not finite"):
        opt.update_(state, model, grads)
    for x, old in zip(opt.trainables(model), before):
        np.testing.assert_array_equal(x, old)
    for leaf, old in zip(state.leaves(), parts_before):
        parts: list = []
        flatten_state(leaf.state, parts)
        for p, q in zip(parts, old):
            np.testing.assert_array_equal(p, q)


def test_a_dropped_state_frees_its_groups_and_leafs():
    """The engine's side tables hold nothing alive: a State dropped takes its plan, its groups'
    buffers and its Leafs with it."""
    import gc
    import weakref

    model = make_model()
    state = opt.setup(opt.Adam(0.01), model)
    grads = random_grads(model, np.random.default_rng(3))
    for _ in range(2):
        state, model = opt.update_(state, model, grads)
    group = weakref.ref(PLANS[state].groups[0])
    leaf = weakref.ref(state["big"])
    del state
    gc.collect()
    assert group() is None and leaf() is None


def test_a_leaf_outliving_its_group_keeps_its_state_whole():
    """A sub-State (`state["part"]`) plans groups of its own; when it is dropped its Leafs, still
    in the whole State, keep the state its groups stepped, counters included."""
    import gc

    model = {"part": {"a": np.ones(300, np.float32), "b": np.ones(300, np.float32)}}
    state = opt.setup(opt.Adam(0.01), model)
    grads = {"part": {"a": np.ones(300, np.float32), "b": np.ones(300, np.float32)}}
    part = state["part"]
    for _ in range(3):
        opt.update_(part, model["part"], grads["part"])
    assert holder(state["part"]["a"]) is not None
    del part
    gc.collect()
    leaf = state["part"]["a"]
    assert holder(leaf) is None and leaf.state[2] == 3
    m, v, t = leaf.state
    np.testing.assert_allclose(m, 1 - 0.9**3, rtol=1e-6)
    state, model = opt.update_(state, model, grads)
    assert state["part"]["a"].state[2] == 4


@pytest.mark.parametrize("rule", [opt.LAMB(0.01, lambd=0.01), opt.LARS(0.1, lambd=0.01, trust=0.02)],
                         ids=repr)
def test_a_trust_ratio_rule_given_a_schedule_and_then_a_number_again(rule):
    """A schedule keeps LAMB out of the engine (its factors would need the schedule's value
    outside `apply`); `update_` and `update` agree through it, and after it, when the state still
    counts steps (the counter and the rule's own state, unwrapped for `direction`)."""
    model, reference = make_model(), make_model()
    state, ref_state = opt.setup(rule, model), opt.setup(rule, reference)
    rng = np.random.default_rng(4)
    for step in range(6):
        grads = random_grads(model, rng)
        if step == 2:
            opt.adjust_(state, eta=lambda t: 0.01 / (1 + t))
            ref_state = opt.adjust(ref_state, eta=lambda t: 0.01 / (1 + t))
        if step == 4:
            opt.adjust_(state, eta=0.002)
            ref_state = opt.adjust(ref_state, eta=0.002)
        state, model = opt.update_(state, model, grads)
        ref_state, reference = opt.update(ref_state, reference, grads)
        assert_same(model, reference, state, ref_state)
    assert state["big"].state.count == 4  # (counted since the schedule)
