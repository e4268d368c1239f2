"""Fixtures shared by the test modules. None is autouse: a module opts in with
`pytestmark = pytest.mark.usefixtures("single_thread")`, a test by naming the fixture, so that a
fixture here never changes tests that did not ask for it (nor imports torch for them).

The rules that the generic tests run, with their reference formulas and their counterparts in
torch.optim and optax, are listed once in `rules_registry.py`."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def single_thread():
    """torch single-threaded for the module's tests (see `_torch_models.one_thread`)."""
    from _torch_models import one_thread

    with one_thread():
        yield


@pytest.fixture
def tiny_chunks(monkeypatch):
    """Chunks of the in-place engine a few hundred elements long, so that a test-sized model
    exercises packed runs, arrays split across chunks and the worker threads."""
    import optimisers.engine.chunks as _engine_chunks

    monkeypatch.setattr(_engine_chunks, "CHUNK_SCALE", 1024)


@pytest.fixture
def compiled_kernels():
    """NumPy's compiled kernels (numba, where installed) compiled and loaded before a test
    measures memory: numba's compiler allocates once per process, which is no step's memory."""
    import numpy as np

    import optimisers as opt

    for n in (8, 1 << 17):  # the one-thread kernel and the parallel one
        model = [np.ones(n, np.float32), np.ones(n, np.float32)]
        opt.update_(opt.setup(opt.Adam(1e-3), model), model, [np.ones(n, np.float32)] * 2)


@pytest.fixture(params=["read by numba", "NumPy's attributes"])
def numpy_marks(request, monkeypatch):
    """NumPy's later-step check (`snapshot`/`unchanged`) read from the arrays' headers in compiled
    passes (`optimisers.backends.numpy_kernels`), and from NumPy's attributes without them."""
    from optimisers.backends import numpy_kernels

    if request.param == "read by numba" and numpy_kernels._reader() is None:
        pytest.skip("numba is not installed")
    if request.param != "read by numba":
        monkeypatch.setattr(numpy_kernels, "_reader", lambda: None)
    return request.param


@pytest.fixture
def replays(monkeypatch):
    """The results of every `update_` route replay in the test (True: the step was replayed)."""
    from optimisers.engine import replay

    calls: list[bool] = []
    original = replay.ready

    def spy(*args):
        ready = original(*args)
        calls.append(ready is not None)
        return ready

    monkeypatch.setattr(replay, "ready", spy)
    return calls
