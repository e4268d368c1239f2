"""torch's own optimizer tests, run on the drop-in classes of `optimisers.torch`.

The tests are torch's `test/test_optim.py` (the version that goes with the pinned torch, see
`upstream/README.md`), unmodified. Before it is imported, each entry of torch's `optim_db`
(`torch.testing._internal.common_optimizers`, shipped in the torch wheel) whose class has a
drop-in gets the drop-in as its `optim_cls`; the entries without one (ASGD, LBFGS, SparseAdam)
are left out. What torch asks of its classes that the drop-ins refuse by design is left out
too, and listed in docs/torch-optimizer.md:

- inputs with `differentiable=True` (the update runs outside autograd): the tests run with
  every other input;
- `capturable=True` and CUDA-only tests: skipped on a machine without CUDA, as torch skips them.

Nothing is fetched: without the upstream file the module is skipped, saying where to get it.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import sys
import types
import unittest
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("expecttest")  # torch.testing._internal needs it

UPSTREAM = Path(__file__).parent / "upstream" / "test_optim.py"
if not UPSTREAM.exists():
    pytest.skip(f"{UPSTREAM} is missing: see upstream/README.md", allow_module_level=True)

from torch.testing._internal import common_optimizers  # noqa: E402

import optimisers.torch as dropins  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    # torch's tests hand a loss that requires grad to ReduceLROnPlateau, which warns; torch's CI
    # does not make warnings errors, this project does
    pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad=True to a scalar"),
]

# test/test_optim.py imports test classes from torch's test/optim/ package, which only runs them;
# they test torch.optim's own classes, so empty stand-ins take their place
_STAND_INS = {
    "optim.test_lrscheduler": "TestLRScheduler",
    "optim.test_optim": "TestDifferentiableOptimizer",
    "optim.test_swa_utils": "TestSWAUtils",
}


# inputs of torch's `test_errors` for a refusal the drop-ins do not make, by design (the reasons
# are in docs/torch-optimizer.md), by their `desc`
NOT_REFUSED = {
    "lr as Tensor doesn't work with foreach & not capturable": "takes a tensor lr with foreach=True",
    r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True": (
        "takes tensor betas with foreach=True"
    ),
    "only support 2D parameters": "Muon also trains 3-D and 4-D parameters, as matrices",
    "does not support complex parameters": "Muon and Adafactor refuse them when made, not at the step",
}
# OPTIMISERS_PEER_BASELINE=1 runs the same tests on torch.optim's own classes: the harness's check
BASELINE = os.environ.get("OPTIMISERS_PEER_BASELINE") == "1"


def _drop_in_db() -> list:
    """torch's `optim_db` with the drop-in classes, for the classes that have one."""
    out = []
    for info in common_optimizers.optim_db:
        cls = getattr(dropins, info.optim_cls.__name__, None)
        if cls is None:
            continue
        info = copy.copy(info)
        if not BASELINE:
            info.optim_cls = cls
            if info.optim_error_inputs_func is not None:
                info.optim_error_inputs_func = _refused_only(info.optim_error_inputs_func)
        out.append(info)
    return out


def _refused_only(error_inputs_of):
    def error_inputs(device, dtype):
        return [e for e in error_inputs_of(device, dtype) if e.optimizer_error_input.desc not in NOT_REFUSED]

    return error_inputs


def _without_differentiable(inputs_of):
    """`_get_optim_inputs_including_global_cliquey_kwargs` without the `differentiable=True`
    inputs, which the drop-ins refuse (their update runs outside autograd)."""

    def inputs(device, dtype, optim_info, skip=()):
        return inputs_of(device, dtype, optim_info, skip=tuple({*skip, "differentiable"}))

    return inputs


def _import_upstream():
    saved_db = list(common_optimizers.optim_db)
    saved_modules = {name: sys.modules.get(name) for name in ("optim", *_STAND_INS)}
    sys.modules["optim"] = types.ModuleType("optim")
    for name, cls in _STAND_INS.items():
        module = types.ModuleType(name)
        setattr(module, cls, type(cls, (unittest.TestCase,), {"__test__": False}))
        sys.modules[name] = module
    common_optimizers.optim_db[:] = _drop_in_db()
    try:
        spec = importlib.util.spec_from_file_location("_upstream_torch_test_optim", UPSTREAM)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        common_optimizers.optim_db[:] = saved_db
        for name, old in saved_modules.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    if not BASELINE:
        module._get_optim_inputs_including_global_cliquey_kwargs = _without_differentiable(
            module._get_optim_inputs_including_global_cliquey_kwargs
        )
    return module


_upstream = _import_upstream()

# the device-type classes torch instantiates (TestOptimRenewedCPU, ...), collected from here
for _name, _value in vars(_upstream).items():
    if isinstance(_value, type) and issubclass(_value, unittest.TestCase) and _name.startswith("Test"):
        if _value.__module__ == _upstream.__name__:
            globals()[_name] = _value
