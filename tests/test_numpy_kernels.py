"""NumPy's compiled Adam/AdamW kernel (`optimisers.backends.numpy_kernels`, with numba): the engine
steps with it, and it gives the rules' own maths (the pure `update`) bit for bit; without it (numba
missing, or a dtype it does not take) the engine's chunks do."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import optimisers as opt
import optimisers.backends.numpy as numpy_backend
import optimisers.backends.numpy_kernels as kernels


def _model(dtype, seed=0):
    rng = np.random.default_rng(seed)
    shared = rng.standard_normal((9, 4)).astype(dtype)
    return {
        "big": rng.standard_normal((300, 300)).astype(dtype),  # past PARALLEL_FROM: all cores
        "fortran": np.asfortranarray(rng.standard_normal((70, 50)).astype(dtype)),
        "small": [rng.standard_normal(k).astype(dtype) for k in (1, 7, 64, 100) * 10],
        "five": rng.standard_normal((2, 3, 1, 4, 2)).astype(dtype),  # more dimensions than a header row
        "transposed": rng.standard_normal((6, 5)).astype(dtype).T,  # Fortran order, small
        "embed": shared,
        "head": shared,  # tied
    }


def _grads(model, seed):
    rng = np.random.default_rng(seed)

    def g(x):
        out = np.empty_like(x)  # laid out as the parameter
        out[...] = rng.standard_normal(x.shape)
        return out

    return {
        "big": g(model["big"]),
        "fortran": g(model["fortran"]),
        "small": [g(x) for x in model["small"]],
        "five": g(model["five"]),
        "transposed": g(model["transposed"]),
        "embed": g(model["embed"]),
        "head": g(model["head"]),
    }


@pytest.fixture
def kernel_calls(monkeypatch):
    """The arrays each call of the Adam kernel got (its parameters' sizes)."""
    calls: list = []
    if "adam" not in numpy_backend.FAST_PATHS:
        return calls
    path = numpy_backend.FAST_PATHS["adam"]
    step_many = path.step_many

    def spy(args, xs, *rest):
        stepped = step_many(args, xs, *rest)
        calls.append([x.size for x in xs] if stepped else None)
        return stepped

    monkeypatch.setitem(numpy_backend.FAST_PATHS, "adam", path._replace(step_many=spy))
    return calls


def _leaves(model):
    return [model[k] for k in ("big", "fortran", "five", "transposed", "embed")] + model["small"]


def _steps_equal_the_pure_path(rule, dtype, steps=4):
    model = _model(dtype)
    reference = copy.deepcopy(model)
    state, ref_state = opt.setup(rule, model), opt.setup(rule, reference)
    for k in range(steps):
        state, model = opt.update_(state, model, _grads(model, k))
        ref_state, reference = opt.update(ref_state, reference, _grads(reference, k))
        for x, y in zip(_leaves(model), _leaves(reference), strict=True):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(x, y)
    assert model["head"] is model["embed"]


RULES = {
    "adam": lambda: opt.Adam(1e-2),
    "adamw": lambda: opt.AdamW(1e-2, lambd=0.1),  # decay scaled by eta (couple=True)
    "adamw uncoupled": lambda: opt.AdamW(1e-2, lambd=0.1, couple=False),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rule", list(RULES))
def test_kernel_equals_the_rules_maths(rule, dtype, kernel_calls):
    pytest.importorskip("numba")
    _steps_equal_the_pure_path(RULES[rule](), dtype)
    if rule == "adamw uncoupled":  # not the kernel's formula: the chunks step it
        assert kernel_calls == []
        return
    assert len(kernel_calls) == 4 and None not in kernel_calls
    # one call a step, every distinct parameter as itself (nothing joined into staging buffers)
    sizes = sorted(x.size for x in _leaves(_model(dtype)))
    assert all(sorted(call) == sizes for call in kernel_calls)


def test_without_kernels_the_chunks_step(monkeypatch, kernel_calls):
    monkeypatch.setattr(numpy_backend, "FAST_PATHS", {})
    _steps_equal_the_pure_path(opt.Adam(1e-2), np.float32)
    assert kernel_calls == []


def test_float16_takes_the_chunks(kernel_calls):
    _steps_equal_the_pure_path(opt.Adam(1e-2), np.float16)
    assert all(call is None for call in kernel_calls)  # offered, refused: computed in float32


def test_kernel_refuses_what_it_cannot_step():
    pytest.importorskip("numba")
    args = next(iter(kernels.FAST_PATHS.values())), None
    step_many = args[0].step_many
    from optimisers.rules.adam import AdamArgs

    a = AdamArgs(1e-3, 0.9, 0.999, 1e-8, 0.0, False)

    def refused(x, g=None, m=None, v=None) -> bool:
        fresh = [np.zeros_like(x) if y is None else y for y in (g, m, v)]
        before = [y.copy() for y in (x, *fresh)]
        stepped = step_many(a, [np.ones(3, np.float32), x], [np.ones(3, np.float32), fresh[0]],
                            [np.zeros(3, np.float32), fresh[1]], [np.zeros(3, np.float32), fresh[2]], 1)
        return not stepped and all(np.array_equal(y, z) for y, z in zip((x, *fresh), before))

    x = np.ones((4, 6), np.float32)
    fortran = np.asfortranarray(x)
    read_only = x.copy()
    read_only.flags.writeable = False

    class Sub(np.ndarray):
        pass

    assert refused(np.zeros(8, np.float32)[::2])  # not one block of memory
    assert refused(x, g=x.astype(np.float64))  # another dtype
    assert refused(x, g=x.astype(x.dtype.newbyteorder()))  # the same kind, swapped bytes
    assert refused(x, g=fortran.copy(order="F"))  # a gradient not laid out as its parameter
    assert refused(fortran, m=np.zeros_like(x, order="C"))  # nor a moment
    assert refused(read_only)
    assert refused(x.view(Sub))
    # what it takes: any one block (C or Fortran order, n-D), moments alike or 1-D
    five = np.ones((1, 2, 1, 2, 3), np.float32)
    assert step_many(a, [x, fortran, five], [x.copy(), fortran.copy(order="F"), five.copy()],
                     [np.zeros(24, np.float32), np.zeros_like(fortran), np.zeros(12, np.float32)],
                     [np.zeros_like(x), np.zeros(24, np.float32), np.zeros_like(five)], 1)


def test_two_threads_step_at_once():
    """Two States updated from two threads at the same time, each step shared out over the
    kernels' threads."""
    from concurrent.futures import ThreadPoolExecutor

    def train(seed):
        model = {"w": np.random.default_rng(seed).standard_normal(1 << 17).astype(np.float32)}
        reference = copy.deepcopy(model)
        state, ref_state = opt.setup(opt.Adam(1e-2), model), opt.setup(opt.Adam(1e-2), reference)
        for k in range(20):
            g = {"w": np.random.default_rng(k).standard_normal(1 << 17).astype(np.float32)}
            state, model = opt.update_(state, model, g)
            ref_state, reference = opt.update(ref_state, reference, g)
        return np.array_equal(model["w"], reference["w"])

    with ThreadPoolExecutor(2) as pool:
        assert all(pool.map(train, range(4)))


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_shares_cut_anywhere_step_as_one_call(threads, monkeypatch):
    """The step's elements cut into shares at any place (inside an array, at its ends) give one
    call's numbers bit for bit; arrays of no elements among them are fine."""
    pytest.importorskip("numba")
    from optimisers.rules.adam import AdamArgs

    rng = np.random.default_rng(threads)
    sizes = [int(k) for k in rng.integers(0, 3000, 40)] + [0, 70000]
    xs = [rng.standard_normal(k).astype(np.float32) for k in sizes]
    gs = [rng.standard_normal(k).astype(np.float32) for k in sizes]
    state = [[np.full(k, 0.1, np.float32) for k in sizes] for _ in range(2)]
    a = AdamArgs(1e-3, 0.9, 0.999, 1e-8, 0.01, True)
    expected = [copy.deepcopy(v) for v in (xs, state[0], state[1])]
    monkeypatch.setattr(kernels, "_threads", lambda: 1)
    assert kernels._adam_step_many(a, *expected[:1], gs, *expected[1:], 3)
    monkeypatch.setattr(kernels, "_threads", lambda: threads)
    monkeypatch.setattr(kernels, "PARALLEL_FROM", 64)  # (shares as many as threads)
    assert kernels._adam_step_many(a, xs, gs, *state, 3)
    for got, want in zip((xs, *state), expected):
        for x, y in zip(got, want):
            np.testing.assert_array_equal(x, y)


def test_a_share_that_raises_raises_after_every_share_is_done():
    done = []

    def kernel(k, fail):
        done.append(k)
        if k == fail:
            raise ValueError(k)

    for fail in (0, 2):  # this thread's share, a worker's
        done.clear()
        with pytest.raises(ValueError):
            kernels._run(kernel, [(k,) for k in range(4)], (fail,))
        assert sorted(done) == [0, 1, 2, 3]


def test_many_small_arrays_step_together_on_every_core(kernel_calls):
    """Small arrays that add up to more than PARALLEL_FROM elements step in one call over all
    cores (each thread a share of their elements), with the rules' own numbers bit for bit."""
    pytest.importorskip("numba")
    rng = np.random.default_rng(3)
    model = [rng.standard_normal(256).astype(np.float32) for _ in range(kernels.PARALLEL_FROM // 256 + 40)]
    reference = copy.deepcopy(model)
    state, ref_state = opt.setup(opt.Adam(1e-2), model), opt.setup(opt.Adam(1e-2), reference)
    for k in range(3):
        grads = [np.random.default_rng(k).standard_normal(256).astype(np.float32) for _ in model]
        state, model = opt.update_(state, model, grads)
        ref_state, reference = opt.update(ref_state, reference, grads)
        for x, y in zip(model, reference, strict=True):
            np.testing.assert_array_equal(x, y)
    assert kernel_calls == [[256] * len(model)] * 3


# --- the same objects as before, asked of a whole list ------------------------------------------


@pytest.mark.parametrize("compiled", [True, False], ids=["read by numba", "is, item by item"])
def test_same_objects_is_identity_of_every_item_in_order(compiled, monkeypatch):
    """`SameObjects(xs)(ys)` is `len(ys) == len(xs) and all(y is x ...)`: an equal but new array
    (even a 1-element one, which `==` would call equal), a list cut short, grown or reordered, or
    one item swapped all give False, with numba's list reader and without."""
    from optimisers.backends import objects

    if compiled and kernels.list_reader() is None:
        pytest.skip("numba is not installed")
    if not compiled:
        monkeypatch.setattr(kernels, "list_reader", lambda: None)
    xs = [np.ones(1), np.zeros(3), "x", None, np.ones(1)]
    same = objects.SameObjects(xs)
    assert (same._same is not None) == compiled
    swapped = list(xs)
    swapped[4] = np.ones(1)
    cases = {"itself": (xs, True), "a copy": (list(xs), True), "a tuple": (tuple(xs), True),
             "one swapped": (swapped, False), "short": (xs[:4], False), "longer": ([*xs, xs[0]], False),
             "reordered": ([xs[4], *xs[1:4], xs[0]], False), "empty": ([], False)}
    for name, (ys, expected) in cases.items():
        assert same(ys) is expected, name
    xs.append(1)  # (it keeps its own list: the caller's may change)
    assert same(xs[:5]) and not same(xs)


def test_addresses_read_in_one_pass_are_numpys_own():
    """`addresses` (read in one compiled pass where numba reads NumPy's headers) gives each
    array's data pointer as NumPy's attributes give it: views, reversed, empty, 0-d, a subclass."""
    grid = np.arange(60, dtype=np.float32).reshape(3, 4, 5)

    class Sub(np.ndarray):
        pass

    arrays = [grid, grid[1:, ::-1, 2], grid[:, :0], np.ones((), np.float32), grid.T, grid[2].view(Sub)]
    expected = [a.__array_interface__["data"][0] for a in arrays]
    assert numpy_backend.addresses(arrays) == expected
    assert numpy_backend.addresses(arrays[:-1]) == expected[:-1]
