"""The classes of `optimisers.torch` with torch.optim's names (`optimisers.torch.AdamW`, ...)
against torch.optim itself: same signatures, group keys and `state[p]` keys, the same numbers on a
tiny model whose LM head weight *is* its embedding weight (torch sees one Parameter there too),
with HF-style decay / no-decay groups, frozen parameters, lazy state, checkpoints written by
torch.optim, and HF Trainer's `optimizer_cls_and_kwargs`.

Equality: Adam and AdamW run torch's fused kernel, so they agree with `fused=True` bit for bit.
The other classes write out torch's single-tensor formula with the library's array operations,
which group the float32 arithmetic a little differently (e.g. `a·g/d` where torch computes
`a·(g/d)`), so they are compared with a tolerance of a few float32 roundings per step."""

from __future__ import annotations

import copy
import inspect
import io

import pytest
import torch

import optimisers
import optimisers.torch as ot
from _torch_models import batch, lm_loss, make_gpt

STEPS = 6

# class name -> keyword arguments for one case; each case is run against torch.optim's class
CASES = {
    "SGD": dict(lr=0.1),
    "SGD-momentum": dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "SGD-nesterov": dict(lr=0.1, momentum=0.9, nesterov=True),
    "Adam": dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6),
    "Adam-l2": dict(lr=1e-2, weight_decay=0.1),
    "Adam-amsgrad": dict(lr=1e-2, amsgrad=True, weight_decay=0.1, decoupled_weight_decay=True),
    "AdamW": dict(lr=1e-2, weight_decay=0.1),
    "AdamW-amsgrad-maximize": dict(lr=1e-2, amsgrad=True, maximize=True),
    "RMSprop": dict(lr=1e-2),
    "RMSprop-centered-momentum": dict(lr=1e-2, centered=True, momentum=0.5, weight_decay=0.1),
    "Adagrad": dict(lr=1e-1, lr_decay=0.01, initial_accumulator_value=0.1, weight_decay=0.01),
    "Adadelta": dict(lr=0.5, weight_decay=0.01),
    "Adamax": dict(lr=1e-2, weight_decay=0.01),
    "NAdam": dict(lr=1e-2, weight_decay=0.01),
    "NAdam-decoupled": dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "RAdam": dict(lr=1e-2, weight_decay=0.01),
    "RAdam-decoupled": dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "Rprop": dict(lr=1e-2, etas=(0.4, 1.3), step_sizes=(1e-5, 1.0)),
    "Rprop-maximize": dict(maximize=True),
}
FUSED = ("Adam", "AdamW")  # torch's fused kernel: equal bit for bit


def _class(case):
    return case.split("-")[0]

pytestmark = pytest.mark.usefixtures("single_thread")


def _groups(model, decay=None):
    """HF Trainer's grouping: weight decay on matrices, none on biases and LayerNorm weights."""
    named = list(model.named_parameters())
    matrices = [p for n, p in named if p.ndim >= 2]
    others = [p for n, p in named if p.ndim < 2]
    if decay is None:
        return [{"params": matrices}, {"params": others, "lr": 5e-3}]
    return [{"params": matrices, "weight_decay": decay}, {"params": others, "weight_decay": 0.0}]


def _train(model, opt, steps=STEPS, seed=1, scheduler=None):
    inputs, targets = batch(seed=seed)
    for _ in range(steps):
        opt.zero_grad()
        lm_loss(model, inputs, targets).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def _assert_same(a, b, exact):
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        if exact:
            assert torch.equal(x, y), name
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)


def _pair(seed=0):
    ours = make_gpt(seed=seed)
    ref = copy.deepcopy(ours)
    return ours, ref


def _reference(cls_name, params, **kw):
    exact = {"fused": True} if cls_name in FUSED and not kw.get("amsgrad") else {"foreach": False}
    return getattr(torch.optim, cls_name)(params, **kw, **exact)


def _roundtrip(d):
    buffer = io.BytesIO()
    torch.save(d, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# --- the same optimiser as torch.optim --------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_each_class_trains_like_torch_optim_on_a_tied_model_with_groups(case):
    name, kw = _class(case), CASES[case]
    ours, ref = _pair()
    opt = getattr(ot, name)(_groups(ours), **kw)
    torch_opt = _reference(name, _groups(ref), **kw)
    _train(ours, opt)
    _train(ref, torch_opt)
    assert ours.head.weight is ours.embed.weight
    assert not torch.equal(ours.embed.weight, make_gpt().embed.weight)  # it trained
    exact = name in FUSED and not kw.get("amsgrad")
    _assert_same(ours, ref, exact)
    # torch's group keys and state keys, with equal values
    assert [set(g) for g in opt.param_groups] == [set(g) for g in torch_opt.param_groups]
    for g, tg in zip(opt.param_groups, torch_opt.param_groups):
        assert {k: v for k, v in g.items() if k not in ("params", "fused", "foreach")} == {
            k: v for k, v in tg.items() if k not in ("params", "fused", "foreach")
        }
    for p, q in zip(ours.parameters(), ref.parameters()):
        mine, theirs = opt.state[p], torch_opt.state[q]
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            value = value.to(mine[key].device)
            if exact or key == "step":
                assert torch.equal(mine[key], value), key
            else:  # a ratio such as g/√s magnifies roundings where s is tiny: relative to the largest
                scale = value.abs().max().item()
                torch.testing.assert_close(mine[key], value, rtol=1e-5, atol=1e-5 * scale)


def test_signatures_and_defaults_are_torch_optims():
    for name in (
        "SGD",
        "Adam",
        "AdamW",
        "RMSprop",
        "Adagrad",
        "Adadelta",
        "Adamax",
        "NAdam",
        "RAdam",
        "Rprop",
    ):
        ours, theirs = getattr(ot, name), getattr(torch.optim, name)
        assert issubclass(ours, torch.optim.Optimizer)
        mine = inspect.signature(ours.__init__).parameters
        torch_params = inspect.signature(theirs.__init__).parameters
        assert list(mine) == list(torch_params), name
        for key, p in torch_params.items():
            assert mine[key].default == p.default, (name, key)
            assert mine[key].kind == p.kind, (name, key)
        model = make_gpt()
        assert ours(model.parameters()).defaults == theirs(model.parameters()).defaults, name


def test_adam_and_adamw_are_the_librarys_rules_on_torchs_fused_kernel():
    model = make_gpt()
    adamw = ot.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    adam = ot.Adam(model.parameters(), lr=1e-2, weight_decay=0.1)
    assert adamw._groups[0].rule == optimisers.AdamW(1e-2, lambd=0.1)
    assert adam._groups[0].rule == optimisers.Adam(1e-2)  # L2 decay is added to the gradient first


def test_a_scheduler_cycles_lr_and_betas_like_torch():
    ours, ref = _pair()
    opt = ot.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.05)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.05, fused=True)
    sched, torch_sched = (
        torch.optim.lr_scheduler.OneCycleLR(o, max_lr=5e-2, total_steps=STEPS + 1) for o in (opt, torch_opt)
    )
    _train(ours, opt, scheduler=sched)
    _train(ref, torch_opt, scheduler=torch_sched)
    assert opt.param_groups[0]["betas"] == torch_opt.param_groups[0]["betas"] != (0.9, 0.999)
    _assert_same(ours, ref, exact=True)


def test_hf_style_decay_groups_equal_torch_bit_for_bit():
    ours, ref = _pair()
    opt = ot.AdamW(_groups(ours, decay=0.1), lr=1e-2, eps=1e-6)
    torch_opt = torch.optim.AdamW(_groups(ref, decay=0.1), lr=1e-2, eps=1e-6, fused=True)
    _train(ours, opt)
    _train(ref, torch_opt)
    _assert_same(ours, ref, exact=True)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_complex_parameters_are_trained_as_pairs_of_reals_like_torch():
    torch.manual_seed(0)
    z = torch.nn.Parameter(torch.randn(5, dtype=torch.complex64))
    w = torch.nn.Parameter(z.detach().clone())
    target = torch.randn(5, dtype=torch.complex64)
    for name, kw in (("Adam", {"lr": 0.1}), ("RMSprop", {"lr": 0.01}), ("SGD", {"lr": 0.1, "momentum": 0.9})):
        a, b = z.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        opt, torch_opt = getattr(ot, name)([a], **kw), getattr(torch.optim, name)([b], **kw, foreach=False)
        for _ in range(STEPS):
            for p, o in ((a, opt), (b, torch_opt)):
                o.zero_grad()
                (p - target).abs().pow(2).sum().backward()
                o.step()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for key, value in torch_opt.state[b].items():
            assert opt.state[a][key].dtype == value.dtype, key
            torch.testing.assert_close(opt.state[a][key], value, rtol=1e-5, atol=1e-6)


# --- state only for parameters that get gradients -----------------------------------------------


def _with_state(torch_opt):
    """Positions with state (reading `state[p]` leaves an empty entry in torch's defaultdict)."""
    return {k for k, v in torch_opt.state_dict()["state"].items() if v}


def _state_bytes(opt, model):
    return sum(
        v.numel() * v.element_size()
        for p in model.parameters()
        for v in opt.state[p].values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )


def test_frozen_and_gradless_parameters_get_no_state_until_their_first_gradient():
    ours, ref = _pair()
    for model in (ours, ref):  # a frozen "backbone": only the MLP and the LayerNorms train at first
        for n, p in model.named_parameters():
            p.requires_grad_(n.startswith(("mlp", "norm")))
    opt = ot.AdamW(ours.parameters(), lr=1e-2)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    _train(ours, opt, steps=2)
    _train(ref, torch_opt, steps=2)
    assert set(opt.state_dict()["state"]) == _with_state(torch_opt)
    assert _state_bytes(opt, ours) == _state_bytes(torch_opt, ref)
    assert ours.embed.weight not in opt.state and opt.state[ours.embed.weight] == {}
    total = sum(v.numel() for leaf in opt._book.flat.tree.values() for v in leaf.state[:2])
    assert total == 2 * sum(p.numel() for n, p in ours.named_parameters() if n.startswith(("mlp", "norm")))
    # unfrozen: the state appears at the first gradient, exactly as torch's does
    for model in (ours, ref):
        model.embed.weight.requires_grad_(True)
    _train(ours, opt, steps=3)
    _train(ref, torch_opt, steps=3)
    _assert_same(ours, ref, exact=True)
    assert opt.state[ours.embed.weight]["step"] == torch_opt.state[ref.embed.weight]["step"] == 3
    assert set(opt.state_dict()["state"]) == _with_state(torch_opt)


def test_a_generic_optimizer_makes_state_lazily_too():
    model = make_gpt()
    model.qkv.weight.requires_grad_(False)
    opt = ot.Optimizer(model.parameters(), optimisers.Lion(1e-3))
    assert opt.state_dict()["state"] == {} and len(opt.state) == 0
    _train(model, opt, steps=1)
    positions = [i for i, p in enumerate(model.parameters()) if p.requires_grad]
    assert sorted(opt.state_dict()["state"]) == positions


# --- migration: checkpoints of torch.optim --------------------------------------------------------


@pytest.mark.parametrize(
    "case", ["AdamW", "Adam-l2", "SGD-momentum", "RMSprop-centered-momentum", "NAdam", "Rprop"]
)
def test_resuming_from_a_torch_optim_checkpoint_continues_its_run(case):
    name, kw = _class(case), CASES[case]
    whole = make_gpt()
    torch_opt = _reference(name, _groups(whole), **kw)
    _train(whole, torch_opt, steps=3)
    saved = _roundtrip({"model": whole.state_dict(), "opt": torch_opt.state_dict()})
    _train(whole, torch_opt, steps=3, seed=2)

    resumed = make_gpt(seed=5)
    resumed.load_state_dict(saved["model"])
    opt = getattr(ot, name)(_groups(resumed), **{**kw, "lr": 123.0})  # the checkpoint's lr wins
    opt.load_state_dict(saved["opt"])
    assert opt.param_groups[0]["lr"] == kw.get("lr", torch_opt.defaults["lr"])
    _train(resumed, opt, steps=3, seed=2)
    exact = name in FUSED and not kw.get("amsgrad")
    _assert_same(resumed, whole, exact)
    assert resumed.head.weight is resumed.embed.weight


def test_our_checkpoint_loads_into_torch_optim_and_back():
    ours, ref = _pair()
    # torch.optim takes the checkpoint's "fused" entry too: ours carries it along
    opt = ot.AdamW(_groups(ours, decay=0.1), lr=1e-2, fused=True)
    _train(ours, opt, steps=3)
    ref.load_state_dict(ours.state_dict())
    torch_opt = torch.optim.AdamW(_groups(ref, decay=0.1), lr=1e-2, fused=True)
    torch_opt.load_state_dict(_roundtrip(opt.state_dict()))
    _train(ours, opt, steps=3, seed=2)
    _train(ref, torch_opt, steps=3, seed=2)
    _assert_same(ours, ref, exact=True)


def test_a_checkpoint_that_does_not_fit_is_refused_naming_what_differs_and_changes_nothing():
    model = make_gpt()
    opt = ot.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, steps=1)
    before = {k: v.clone() for k, v in opt.state[model.pos].items()}
    groups_before = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])

    other = make_gpt()
    sgd = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    _train(other, sgd, steps=1)
    with pytest.raises(optimisers.CheckpointError, match=r"'momentum'.*torch.optim.AdamW does not take"):
        opt.load_state_dict(sgd.state_dict())

    amsgrad = torch.optim.AdamW(other.parameters(), lr=1e-2, amsgrad=True)
    _train(other, amsgrad, steps=1)
    d = amsgrad.state_dict()
    d["param_groups"][0]["amsgrad"] = False  # settings and state disagree
    with pytest.raises(optimisers.CheckpointError, match=r"parameter 0: .*unexpected 'max_exp_avg_sq'"):
        opt.load_state_dict(d)

    d = torch.optim.AdamW(other.parameters(), lr=1e-2).state_dict()
    stray = torch.nn.Parameter(torch.zeros(3))  # a checkpoint of another model: parameter 0 differs
    torch_opt = torch.optim.AdamW([stray] + list(other.parameters())[1:])
    lm_loss(other, *batch()).backward()
    stray.grad = torch.ones(3)
    torch_opt.step()
    with pytest.raises(
        optimisers.CheckpointError, match=r"parameter 0: 'exp_avg' has shape \(3,\), the parameter"
    ):
        opt.load_state_dict(torch_opt.state_dict())
    with pytest.raises(optimisers.CheckpointError, match="2 param groups"):
        opt.load_state_dict({"state": {}, "param_groups": [d["param_groups"][0]] * 2})
    for k, v in opt.state[model.pos].items():
        assert torch.equal(v, before[k])
    assert groups_before == [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def test_clearing_or_replacing_the_state_works_as_in_torch():
    ours, ref = _pair()
    opt = ot.Adam(ours.parameters(), lr=1e-2)
    torch_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, fused=True)
    _train(ours, opt, steps=2)
    _train(ref, torch_opt, steps=2)
    opt.state.clear()
    torch_opt.state.clear()
    assert len(opt.state) == 0 and opt.state_dict()["state"] == {}
    _train(ours, opt, steps=2)
    _train(ref, torch_opt, steps=2)
    _assert_same(ours, ref, exact=True)
    assert opt.state[ours.pos]["step"] == 2
    # `del state[p]` and assigning a whole mapping, as torch code does
    entry = {k: v.clone() for k, v in opt.state[ours.pos].items()}
    del opt.state[ours.pos]
    assert ours.pos not in opt.state
    opt.state = {ours.pos: entry}
    assert list(opt.state) == [ours.pos] and torch.equal(opt.state[ours.pos]["exp_avg"], entry["exp_avg"])
    with pytest.raises(optimisers.CheckpointError, match="missing 'exp_avg_sq'"):
        opt.state[ours.pos] = {"step": torch.tensor(1.0), "exp_avg": entry["exp_avg"]}


# --- bad input --------------------------------------------------------------------------------------


def test_unknown_or_unsupported_options_are_refused_by_name():
    model = make_gpt()
    with pytest.raises(ValueError, match=r"group 1: unknown key 'lambd'; torch.optim.AdamW takes 'lr'"):
        ot.AdamW([{"params": [model.pos]}, {"params": [model.embed.weight], "lambd": 0.1}])
    with pytest.raises(ValueError, match="capturable=True is not supported"):
        ot.Adam(model.parameters(), capturable=True)
    with pytest.raises(ValueError, match="differentiable=True is not supported"):
        ot.SGD(model.parameters(), differentiable=True)
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum"):
        ot.SGD(model.parameters(), nesterov=True)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        ot.AdamW(model.parameters(), betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="Invalid lr value"):
        ot.RMSprop(model.parameters(), lr=-1.0)
    with pytest.raises(TypeError, match=r"pass model.parameters\(\)"):
        ot.AdamW(model)


def test_a_change_of_state_layout_after_construction_is_refused_and_changes_nothing():
    model = make_gpt()
    opt = ot.SGD(model.parameters(), lr=0.1)
    _train(model, opt, steps=1)
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["momentum"] = 0.9
    lm_loss(model, *batch()).backward()
    with pytest.raises(
        ValueError, match=r"param_groups\[0\]: changing 'momentum' .* changes what state SGD keeps"
    ):
        opt.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    opt.param_groups[0]["momentum"] = 0
    opt.param_groups[0]["lr"] = 0.2  # a plain hyperparameter change applies at the next step
    opt.step()
    assert opt._groups[0].rule == optimisers.Descent(0.2)
    # a key torch.optim does not know is carried, as torch carries it (timm's "lr_scale", a note);
    # the library's own names of hyperparameters, which would set nothing here, are refused
    opt.param_groups[0]["lr_scale"] = 0.5
    opt.step()
    assert opt.state_dict()["param_groups"][0]["lr_scale"] == 0.5
    opt.param_groups[0]["lambd"] = 0.1
    with pytest.raises(ValueError, match=r"param_groups\[0\]: unknown key 'lambd'"):
        opt.step()


# --- Hugging Face Trainer ---------------------------------------------------------------------------


@pytest.mark.slow
def test_hf_trainer_optimizer_cls_and_kwargs_equals_torch_adamw(tmp_path):
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from _hf_models import TokenDataset, tiny_gpt2

    def train(cls, out):
        model = tiny_gpt2()
        args = TrainingArguments(
            output_dir=str(out), report_to=[], use_cpu=True, save_strategy="no", max_steps=4,
            per_device_train_batch_size=4, learning_rate=1e-2, weight_decay=0.1, logging_strategy="no",
            seed=0, disable_tqdm=True, dataloader_num_workers=0,
        )  # fmt: skip
        kwargs = {"lr": 1e-2, "betas": (0.9, 0.99), "fused": True}
        trainer = Trainer(
            model=model, args=args, train_dataset=TokenDataset(), optimizer_cls_and_kwargs=(cls, kwargs)
        )
        trainer.train()
        return model, trainer.optimizer

    model, opt = train(ot.AdamW, tmp_path / "ours")
    reference, torch_opt = train(torch.optim.AdamW, tmp_path / "torch")
    assert model.lm_head.weight is model.transformer.wte.weight
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # HF's decay / no-decay groups
    for (name, x), (_, y) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(x, y), name


# --- the generic adapter takes torch's names where they mean the rule's fields ----------------------


def test_the_generic_optimizer_takes_torchs_names_for_the_same_fields():
    ours, ref = _pair()
    opt = ot.Optimizer(
        _groups(ours, decay=0.1), optimisers.AdamW(), lr=1e-2, eps=1e-6, betas=(0.8, 0.9), maximize=True
    )
    torch_opt = torch.optim.AdamW(
        _groups(ref, decay=0.1), lr=1e-2, eps=1e-6, betas=(0.8, 0.9), maximize=True, fused=True
    )
    assert opt._groups[0].rule == optimisers.AdamW(1e-2, (0.8, 0.9), 0.1, 1e-6)
    first = opt.param_groups[0]
    assert first["weight_decay"] == first["lambd"] == 0.1 and first["eps"] == first["epsilon"] == 1e-6
    _train(ours, opt, steps=3)
    _train(ref, torch_opt, steps=3)
    for o in (opt, torch_opt):  # a change under torch's name reaches the rule, and both names agree
        o.param_groups[0]["weight_decay"] = 0.3
    _train(ours, opt, steps=3)
    _train(ref, torch_opt, steps=3)
    assert opt.param_groups[0]["lambd"] == 0.3 and opt._groups[0].rule.lambd == 0.3
    _assert_same(ours, ref, exact=True)


def test_a_copied_optimizer_finds_its_parameters_state_and_trains_like_the_original():
    ours = make_gpt()
    opt = ot.Adam(ours.parameters(), lr=1e-2)
    _train(ours, opt, steps=2)
    twin = copy.deepcopy({"model": ours, "opt": opt})  # one memo: the copy's groups hold its model's tensors
    twin_model, twin_opt = twin["model"], twin["opt"]
    assert list(twin_opt.param_groups[0]["params"])[0] is list(twin_model.parameters())[0]
    assert torch.equal(twin_opt.state[twin_model.pos]["exp_avg"], opt.state[ours.pos]["exp_avg"])
    _train(ours, opt, steps=2)
    _train(twin_model, twin_opt, steps=2)
    _assert_same(ours, twin_model, exact=True)


@pytest.mark.parametrize("cls", [ot.Adam, ot.AdamW])
def test_tensor_lr_and_betas_with_foreach_are_refused_as_torch_refuses_them(cls):
    w = torch.nn.Parameter(torch.randn(3, 2))
    lr, betas = torch.tensor(1e-2), (torch.tensor(0.9), torch.tensor(0.99))
    refused = "lr as a Tensor is not supported for capturable=False and foreach=True"
    with pytest.raises(ValueError, match=refused):
        cls([w], lr=lr, foreach=True)
    with pytest.raises(ValueError, match=r"betas\[0\] as a Tensor is not supported .* foreach=True"):
        cls([w], betas=betas, foreach=True)
    cls([w], lr=lr, betas=betas)  # without foreach: taken, as torch takes them
    cls([w], lr=lr, betas=betas, foreach=False)
    # a tensor lr given to a foreach group later: torch refuses it at the step, changing nothing
    opt = cls([w], lr=1e-2, foreach=True)
    w.grad = torch.randn_like(w)
    opt.step()
    before = w.detach().clone()
    opt.param_groups[0]["lr"] = lr
    with pytest.raises(RuntimeError, match=refused):
        opt.step()
    assert torch.equal(w.detach(), before)
    opt.param_groups[0]["lr"] = 1e-2
    opt.step()
    assert not torch.equal(w.detach(), before)
