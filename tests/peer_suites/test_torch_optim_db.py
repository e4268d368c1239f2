"""The drop-in classes of `optimisers.torch` against torch.optim's, driven by torch's own `optim_db`.

`torch.testing._internal.common_optimizers.optim_db`, which the torch wheel ships, lists for each
torch.optim class the configurations torch tests it with (`optim_inputs_func`, with the
`foreach`/`fused` variants torch's own test_optim adds), and the inputs it must refuse
(`optim_error_inputs_func`). For every class with a drop-in of the same name these tests run the
drop-in beside torch's class: the same parameters after each step, the same `state_dict` (keys
and values), each one's `state_dict` loaded by the other and training on as the original, each
error input refused as torch refuses it (the exception type, and the entry's `error_regex`), and
the hooks, `param_names` and `zero_grad` behaviour torch's test_optim covers. Nothing is copied
from torch's repository.

Left out, by design (docs/torch-optimizer.md says why): inputs with `differentiable=True` and
`capturable=True`, which the drop-ins refuse (a test checks that they do); the classes without a
drop-in (a test lists them, so a new one is noticed); and the error inputs in `NOT_REFUSED`.
"""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("expecttest")  # torch.testing._internal needs it

from torch.optim.optimizer import (  # noqa: E402  (the global hooks)
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.testing._internal import common_optimizers  # noqa: E402
from torch.testing._internal.common_optimizers import (  # noqa: E402
    OptimizerErrorEnum,
    _get_optim_inputs_including_global_cliquey_kwargs,
)

import optimisers.torch as dropins  # noqa: E402

pytestmark = pytest.mark.slow

# the classes of optim_db without a drop-in yet
NO_DROP_IN = {"ASGD", "LBFGS", "SparseAdam"}

# error inputs of optim_db (by `desc`, as optim_db writes it) that a drop-in does not refuse as
# torch does, with why; strict xfails, so one that starts to pass is reported (none, now)
NOT_REFUSED: dict[str, str] = {}

# the drop-ins whose formula differs from torch's class by design (docs/torch-optimizer.md): their
# displacement from the start is compared in norm, to this relative tolerance
DIFFERENT_ROUNDING = {"Muon": 5e-2}  # Newton–Schulz in float32, torch's in bfloat16

INFOS = [info for info in common_optimizers.optim_db if info.optim_cls.__name__ not in NO_DROP_IN]
STEPS = 4


def _name(info) -> str:
    return info.optim_cls.__name__


def _inputs(info) -> list:
    """torch's configurations of `info`, with the foreach/fused variants, less `differentiable`."""
    return _get_optim_inputs_including_global_cliquey_kwargs(
        "cpu", torch.float32, info, skip=("differentiable",)
    )


def _cases():
    for info in INFOS:
        for i, given in enumerate(_inputs(info)):
            yield pytest.param(info, given.kwargs, id=f"{_name(info)}-{i}-{given.desc}")


def _errors():
    for info in INFOS:
        for i, err in enumerate(info.optim_error_inputs_func(device="cpu", dtype=torch.float32)):
            desc = err.optimizer_error_input.desc
            why = NOT_REFUSED.get(desc) or next((w for k, w in NOT_REFUSED.items() if k in desc), None)
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
            yield pytest.param(info, err, id=f"{_name(info)}-{i}-{desc}", marks=marks)


def _params(info, seed=0):
    """A weight and a bias (Muon: two matrices), as leaf tensors."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(4, 3), (3, 2)] if _name(info) == "Muon" else [(4, 3), (3,)]
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


def _clones(params):
    return [p.detach().clone().requires_grad_() for p in params]


def _pair(info, kwargs, params=None):
    """torch's optimizer and the drop-in, on equal parameters."""
    params = _params(info) if params is None else params
    theirs, ours = _clones(params), _clones(params)
    ref = info.optim_cls(theirs, **copy.deepcopy(kwargs))
    mine = getattr(dropins, _name(info))(ours, **copy.deepcopy(kwargs))
    return (ref, theirs), (mine, ours)


def _set_grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _step_both(ref_pair, mine_pair, seed):
    (ref, theirs), (mine, ours) = ref_pair, mine_pair
    before = [p.detach().clone() for p in theirs]
    _set_grads(theirs, seed)
    _set_grads(ours, seed)
    ref.step()
    mine.step()
    rtol = DIFFERENT_ROUNDING.get(type(ref).__name__)
    for a, b, start in zip(ours, theirs, before, strict=True):
        a, b = a.detach(), b.detach()
        if rtol is None:
            torch.testing.assert_close(a, b)
        else:  # this step's displacement, in norm
            assert torch.linalg.norm(a - b) <= rtol * torch.linalg.norm(b - start) + 1e-7
        a.copy_(b)  # (so that a difference by design does not grow over the steps)


def _assert_same_state_dict(ours, theirs, where=""):
    if isinstance(theirs, dict):
        assert isinstance(ours, dict), where
        keys = sorted(map(str, ours)), sorted(map(str, theirs))
        assert set(ours) == set(theirs), f"{where}: keys {keys[0]} != {keys[1]}"
        for k in theirs:
            _assert_same_state_dict(ours[k], theirs[k], f"{where}[{k!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert isinstance(ours, (list, tuple)) and len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _assert_same_state_dict(a, b, f"{where}[{i}]")
    elif isinstance(theirs, torch.Tensor) or isinstance(ours, torch.Tensor):
        torch.testing.assert_close(torch.as_tensor(ours), torch.as_tensor(theirs), msg=where)
    else:
        assert ours == theirs, f"{where}: {ours!r} != {theirs!r}"


def test_every_class_without_a_drop_in_is_listed():
    names = {_name(info) for info in common_optimizers.optim_db}
    assert {n for n in names if not hasattr(dropins, n)} == NO_DROP_IN


@pytest.mark.parametrize(("info", "kwargs"), list(_cases()))
def test_steps_and_state_dict_equal_torch(info, kwargs):
    ref_pair, mine_pair = _pair(info, kwargs)
    for t in range(STEPS):
        _step_both(ref_pair, mine_pair, seed=100 + t)
    _assert_same_state_dict(mine_pair[0].state_dict(), ref_pair[0].state_dict(), _name(info))


@pytest.mark.parametrize(("info", "kwargs"), list(_cases()))
def test_each_loads_the_others_state_dict_and_trains_on(info, kwargs):
    ref_pair, mine_pair = _pair(info, kwargs)
    for t in range(2):
        _step_both(ref_pair, mine_pair, seed=200 + t)
    (ref, theirs), (mine, ours) = ref_pair, mine_pair
    # the drop-in from torch's state dict, torch's class from the drop-in's
    (ref2, theirs2), (mine2, ours2) = _pair(info, kwargs, params=theirs)
    # (copies: torch's load_state_dict keeps the tensors it is given, which the other goes on stepping)
    mine2.load_state_dict(copy.deepcopy(ref.state_dict()))
    ref2.load_state_dict(copy.deepcopy(mine.state_dict()))
    for t in range(2):
        _step_both((ref, theirs), (mine2, ours2), seed=300 + t)
        _step_both((ref2, theirs2), (mine, ours), seed=300 + t)
    _assert_same_state_dict(mine2.state_dict(), ref.state_dict(), _name(info))


@pytest.mark.parametrize(("info", "err"), list(_errors()))
def test_error_inputs_are_refused_as_torch_refuses_them(info, err):
    given = err.optimizer_error_input
    cls = getattr(dropins, _name(info))
    params = _params(info) if given.params is None else given.params  # None: any parameters
    kwargs = copy.deepcopy(given.kwargs)
    expect = pytest.warns if issubclass(err.error_type, Warning) else pytest.raises
    if err.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR:
        with expect(err.error_type, match=err.error_regex):
            cls(params, **kwargs)
    else:
        optimizer = cls(params, **kwargs)
        with expect(err.error_type, match=err.error_regex):
            optimizer.step()


@pytest.mark.parametrize("info", INFOS, ids=_name)
def test_differentiable_and_capturable_are_refused(info):
    cls = getattr(dropins, _name(info))
    flags = [f for f in ("differentiable", "capturable") if f in info.supported_impls or (
        f == "capturable" and info.has_capturable_arg)]
    for flag in flags:
        with pytest.raises((ValueError, TypeError, RuntimeError), match=flag):
            cls(_params(info), **{flag: True})


# --- hooks, param_names, zero_grad (as torch's test_optim checks them) ----------------------------


@pytest.mark.parametrize("info", INFOS, ids=_name)
def test_step_hooks_run_as_torch_runs_them(info):
    kwargs = _inputs(info)[0].kwargs
    calls: dict = {}
    for which, (optimizer, params) in zip(("theirs", "ours"), _pair(info, kwargs)):
        seen: list = []
        optimizer.register_step_pre_hook(lambda o, a, k, seen=seen: seen.append(("pre", type(o).__name__)))
        optimizer.register_step_post_hook(lambda o, a, k, seen=seen: seen.append(("post", type(o).__name__)))
        pre = register_optimizer_step_pre_hook(lambda o, a, k, seen=seen: seen.append("global pre"))
        post = register_optimizer_step_post_hook(
            lambda o, a, k, seen=seen: seen.append("global post")
        )
        try:
            _set_grads(params, 1)
            optimizer.step()
        finally:
            pre.remove()
            post.remove()
        calls[which] = seen
    assert calls["ours"] == calls["theirs"]


@pytest.mark.parametrize("info", INFOS, ids=_name)
def test_state_dict_hooks_run_as_torch_runs_them(info):
    kwargs = _inputs(info)[0].kwargs
    results: dict = {}
    for which, (optimizer, params) in zip(("theirs", "ours"), _pair(info, kwargs)):
        seen: list = []
        _set_grads(params, 2)
        optimizer.step()
        optimizer.register_state_dict_pre_hook(lambda o, seen=seen: seen.append("sd pre"))

        def sd_post(o, sd, seen=seen):
            seen.append("sd post")
            sd["extra"] = 1
            return sd

        optimizer.register_state_dict_post_hook(sd_post)

        def load_pre(o, sd, seen=seen):
            seen.append("load pre")
            sd = dict(sd)
            sd.pop("extra", None)
            return sd

        optimizer.register_load_state_dict_pre_hook(load_pre)
        optimizer.register_load_state_dict_post_hook(lambda o, seen=seen: seen.append("load post"))
        sd = optimizer.state_dict()
        assert sd["extra"] == 1
        optimizer.load_state_dict(sd)
        results[which] = seen
    assert results["ours"] == results["theirs"]


@pytest.mark.parametrize("info", INFOS, ids=_name)
def test_param_names_as_torch_keeps_them(info):
    kwargs = _inputs(info)[0].kwargs
    params = _params(info)
    named_theirs = [(f"p{i}", p) for i, p in enumerate(_clones(params))]
    named_ours = [(f"p{i}", p) for i, p in enumerate(_clones(params))]
    ref = info.optim_cls(named_theirs, **copy.deepcopy(kwargs))
    mine = getattr(dropins, _name(info))(named_ours, **copy.deepcopy(kwargs))
    assert mine.param_groups[0]["param_names"] == ref.param_groups[0]["param_names"] == ["p0", "p1"]
    _step_both((ref, [p for _, p in named_theirs]), (mine, [p for _, p in named_ours]), seed=3)
    _assert_same_state_dict(mine.state_dict(), ref.state_dict(), _name(info))
    # a state dict with names loads only into an optimizer whose parameters have names too
    unnamed = getattr(dropins, _name(info))(_clones(params), **copy.deepcopy(kwargs))
    ref_unnamed = info.optim_cls(_clones(params), **copy.deepcopy(kwargs))
    outcomes = []
    for target in (ref_unnamed, unnamed):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                target.load_state_dict(ref.state_dict())
            outcomes.append(None)
        except Exception as e:  # noqa: BLE001 - compared with torch's below
            outcomes.append(type(e))
    assert outcomes[1] == outcomes[0]


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("info", INFOS, ids=_name)
def test_zero_grad_as_torch(info, set_to_none):
    kwargs = _inputs(info)[0].kwargs
    for optimizer, params in _pair(info, kwargs):
        _set_grads(params, 4)
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        for p in params:
            if set_to_none:
                assert p.grad is None
            else:
                assert p.grad is not None and not p.grad.any()
