"""torch.compile of a training step that calls optimisers: compiled once, no recompilation when
the learning rate changes every step (by `adjust_` or a 0-d tensor hyperparameter), and the same
numbers as the eager step and as torch.optim with the same scheduler."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import optimisers as opt
from _torch_models import batch, lm_loss, make_gpt

STEPS = 8


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # each test counts its own compilations
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def schedule(i):
    return 1.0 / (1 + i)  # a different learning rate every step


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(step_fn, model, steps=STEPS, warmup=2, before=None):
    """Run `step_fn(i)` `steps` times; after `warmup` steps any recompilation is an error."""
    for i in range(steps):
        if before is not None:
            before(i)
        if i < warmup:
            step_fn(i)
        else:
            with torch._dynamo.config.patch(error_on_recompile=True):
                step_fn(i)
    return params(model)


def ours(compile_backend, *, lr_inside=False, tensor_lr=False, rule=None):
    model = make_gpt(torch.float64)
    inputs, targets = batch()
    lr = torch.tensor(1e-2, dtype=torch.float64) if tensor_lr else 1e-2
    rule = opt.AdamW(lr, lambd=0.1) if rule is None else rule
    state = opt.setup(rule, model)

    def step(lr_now):
        model.zero_grad()
        # no loss kept across the graph break: dynamo reading a non-leaf's .grad there warns
        lm_loss(model, inputs, targets).backward()
        if lr_inside:
            opt.adjust_(state, lr_now)
        opt.update_(state, model, opt.grads(model))

    compiled = step if compile_backend is None else torch.compile(step, backend=compile_backend)

    def set_lr(i):
        if tensor_lr:
            lr.fill_(1e-2 * schedule(i))  # as torch's schedulers do with a tensor lr
        elif not lr_inside:
            opt.adjust_(state, 1e-2 * schedule(i))

    # the second step recompiles once in any model: `.grad` goes from None to a tensor, which
    # zero_grad's `if p.grad is not None` guards on (the same happens with torch.optim)
    return train(lambda i: compiled(1e-2 * schedule(i)), model, before=set_lr), model


def torch_adamw(tensor_lr=False):
    model = make_gpt(torch.float64)
    inputs, targets = batch()
    lr = torch.tensor(1e-2, dtype=torch.float64) if tensor_lr else 1e-2
    o = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(o, schedule)
    for _ in range(STEPS):
        model.zero_grad()
        lm_loss(model, inputs, targets).backward()
        o.step()
        sched.step()
    return params(model)


def assert_close_to(got, expected):
    for name, p in expected.items():
        torch.testing.assert_close(got[name], p, rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.parametrize("lr_inside", [False, True], ids=["adjust_outside", "adjust_inside"])
def test_compiled_step_with_a_schedule_compiles_once_and_matches_eager(lr_inside):
    counter = CompileCounter()
    compiled, _ = ours(counter, lr_inside=lr_inside)
    eager, _ = ours(None, lr_inside=lr_inside)
    for name in eager:
        assert torch.equal(compiled[name], eager[name]), name  # the optimiser step runs eagerly
    assert_close_to(compiled, torch_adamw())
    # the forward graph and the backward-to-update resume, each compiled for the first step and
    # again once for the second (.grad no longer None; with lr_inside, the float learning rate
    # turns dynamic instead of being guarded); error_on_recompile covers every later step
    assert counter.frame_count <= 4, counter.frame_count


def test_tensor_learning_rate_follows_a_scheduler_like_torch_optim_compiled():
    counter = CompileCounter()
    compiled, _ = ours(counter, tensor_lr=True)
    eager, _ = ours(None, tensor_lr=True)
    reference = torch_adamw(tensor_lr=True)
    for name in eager:
        assert torch.equal(compiled[name], eager[name]), name
    assert_close_to(eager, reference)
    assert counter.frame_count <= 4, counter.frame_count


def test_tensor_hyperparameters_on_the_generic_and_engine_paths():
    """A rule without a torch kernel (chunks of the grouped engine, and a chain on the per-Leaf
    path) gives with 0-d tensor hyperparameters exactly what it gives with Python floats."""
    for make in (
        lambda eta, rho: opt.Momentum(eta, rho),
        lambda eta, rho: opt.OptimiserChain(opt.ClipNorm(0.5), opt.Nesterov(eta, rho)),
    ):
        runs = []
        for as_tensor in (False, True):
            wrap = (lambda v: torch.tensor(v, dtype=torch.float64)) if as_tensor else float
            got, _ = ours(None, rule=make(wrap(1e-2), wrap(0.9)))
            runs.append(got)
        for name in runs[0]:
            torch.testing.assert_close(runs[1][name], runs[0][name], rtol=1e-14, atol=0, msg=name)


# importing inductor runs a deprecated torch.jit call inside torch itself
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_inductor_compiles_around_the_fused_adamw_step():
    model = make_gpt(torch.float32)
    inputs, targets = batch()
    state = opt.setup(opt.AdamW(1e-2, lambd=0.1), model)
    twin = make_gpt(torch.float32)
    twin_state = opt.setup(opt.AdamW(1e-2, lambd=0.1), twin)
    compiled = torch.compile(lambda: opt.update_(state, model, opt.grads(model)), backend="inductor")
    for i in range(3):
        for m in (model, twin):
            m.zero_grad()
            lm_loss(m, inputs, targets).backward()
        opt.adjust_(state, 1e-2 * schedule(i))
        opt.adjust_(twin_state, 1e-2 * schedule(i))
        compiled()
        opt.update_(twin_state, twin, opt.grads(twin))
    for name, p in params(twin).items():
        assert torch.equal(params(model)[name], p), name


def test_errors_under_compile_are_the_eager_errors_and_change_nothing():
    model = make_gpt(torch.float64)
    state = opt.setup(opt.Adam(), model)
    before = params(model)
    bad = {"pos": torch.zeros(2, 2, dtype=torch.float64)}
    compiled = torch.compile(lambda: opt.update_(state, model, bad), backend="eager")
    with pytest.raises(ValueError, match=r"gradient at pos has shape"):
        compiled()
    for name, p in before.items():
        assert torch.equal(params(model)[name], p), name


def adapter_run(compile_mode, counter=None):
    """`optimisers.torch.Optimizer` with a LambdaLR scheduler: eager (`compile_mode` None), the
    whole step compiled ("step_fn"), or only `optimizer.step` compiled ("opt_step")."""
    import optimisers.torch

    model = make_gpt(torch.float64)
    inputs, targets = batch()
    o = optimisers.torch.Optimizer(model, opt.AdamW(1e-2, lambd=0.1))
    sched = torch.optim.lr_scheduler.LambdaLR(o, schedule)
    if compile_mode == "opt_step":
        o.step = torch.compile(o.step, backend=counter)

    def step(i):
        o.zero_grad()
        lm_loss(model, inputs, targets).backward()
        o.step()

    compiled = torch.compile(step, backend=counter) if compile_mode == "step_fn" else step
    return train(compiled, model, before=lambda i: sched.step() if i else None)


@pytest.mark.parametrize("compile_mode", ["step_fn", "opt_step"])
def test_adapter_compiled_with_a_scheduler_does_not_recompile(compile_mode):
    counter = CompileCounter()
    compiled = adapter_run(compile_mode, counter)
    eager = adapter_run(None)
    for name in eager:
        assert torch.equal(compiled[name], eager[name]), name
    assert_close_to(compiled, torch_adamw())
    # the whole step: its forward and backward, compiled once; `optimizer.step` alone: nothing of
    # it is traced (one graph break, see optimisers.core.eager)
    assert counter.frame_count == (1 if compile_mode == "step_fn" else 0), counter.frame_count
