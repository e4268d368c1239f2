"""The `schedulefree` package's own tests, run on this library's schedule-free drop-ins.

The tests are `schedulefree/test_schedulefree.py`, which the installed `schedulefree` wheel
ships (nothing is copied or fetched), unmodified. They are loaded as a module of their own whose
`AdamWScheduleFree` and `SGDScheduleFree` are `optimisers.torch`'s; the package's other classes
(the closure and reference versions, `ScheduleFreeWrapper`, the RAdam ones) stay the package's,
so that each test compares the drop-in with the package's own implementations.

The tests put their tensors on CUDA; on a machine without it `Tensor.cuda()` returns the tensor
itself while they run, so that they run on the CPU. Each test starts from `torch.manual_seed(1)`,
as the file's own `__main__` does.
"""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("schedulefree")

import optimisers.torch as dropins  # noqa: E402

pytestmark = pytest.mark.slow


def _load_upstream():
    spec = importlib.util.find_spec("schedulefree.test_schedulefree")
    if spec is None or spec.origin is None:
        pytest.skip("this schedulefree wheel ships no test_schedulefree.py", allow_module_level=True)
    # a module of its own, so that swapping its classes leaves `schedulefree.test_schedulefree` alone
    spec = importlib.util.spec_from_file_location("_upstream_schedulefree_tests", spec.origin)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.AdamWScheduleFree = dropins.AdamWScheduleFree
    module.SGDScheduleFree = dropins.SGDScheduleFree
    return module


_upstream = _load_upstream()
for _name, _value in vars(_upstream).items():
    if _name.startswith("test_") and callable(_value):
        globals()[_name] = _value


@pytest.fixture(autouse=True)
def _cpu_for_cuda(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)


@pytest.fixture(autouse=True)
def _seeded():
    # the file's own `__main__` seeds so: its tests draw unseeded random tensors and compare with
    # torch.allclose's default tolerance, which a last-bit difference fails where a value is
    # the small difference of two larger ones (about 1 seed in 9 for test_schedulefree_sgd,
    # which compares the package's three implementations with the drop-in)
    torch.manual_seed(1)


def test_the_tests_run_the_drop_ins():
    assert _upstream.AdamWScheduleFree is dropins.AdamWScheduleFree
    assert _upstream.SGDScheduleFree is dropins.SGDScheduleFree
