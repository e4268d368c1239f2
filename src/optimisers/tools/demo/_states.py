"""`optimisers demo --state 8bit` (4bit, fp8, bf16-sr, all): the tied model trained with its
optimiser state in low precision, beside the same model with float32 state, from the same initial
weights on the same batches; the report compares their memory and loss."""

from __future__ import annotations

import importlib.util
import os
import time

import numpy as np

import optimisers as opt

from . import _models, _plot, _training
from ._config import STATES, Config, DemoError
from ._report import StateRun, StatesResult, states_intro, states_report

# LowBit's default (4096, bitsandbytes') would leave this small model's 93x32 embedding, the tied
# array, in float32; from 1024 elements it is quantised too, and the biases stay float32.
MIN_SIZE = 1024
LOW_BITS = {"8bit": 8, "4bit": 4, "fp8": "fp8"}


def state_rule(state: str, rule):
    """`rule` with its state kept as `state` says (bf16-sr: for bfloat16 parameters)."""
    if state == "fp32":
        return rule
    if state == "bf16-sr":
        return opt.StochasticRounding(rule)
    return opt.LowBit(rule, bits=LOW_BITS[state], min_size=MIN_SIZE)


def _no_bfloat16(backend: str) -> str | None:
    """Why `backend` cannot hold bfloat16 parameters here, or None."""
    if backend == "numpy" and importlib.util.find_spec("ml_dtypes") is None:
        return "--state bf16-sr needs NumPy's bfloat16: pip install ml_dtypes (or use --backend torch)"
    return None


def compared_states(config: Config) -> tuple[list[str], str | None]:
    """fp32 and the state(s) `--state` asks for, and a note when `all` leaves bf16-sr out."""
    wanted = STATES if config.state == "all" else ("fp32", config.state)
    missing = _no_bfloat16(config.backend) if "bf16-sr" in wanted else None
    if missing is None:
        return list(wanted), None
    if config.state != "all":
        raise DemoError(missing)
    return [s for s in wanted if s != "bf16-sr"], f"(bf16-sr left out: {missing})"


def _draw(config: Config, rule, losses: dict) -> str:
    path = os.path.join(config.out, f"demo-{config.backend}-{config.state}.png")
    title = (
        f"optimisers demo --state {config.state} "
        f"({config.backend}, {type(rule).__name__}, {config.steps} steps)"
    )
    try:
        _plot.states_plot(path, losses, title)
    except OSError as e:
        raise DemoError(f"cannot write the plot to {path!r}: {e.strerror or e}") from None
    return path


def run(config: Config, rule, stdout, stderr) -> StatesResult:
    """Train one tied model per compared state on the same batches, and report."""
    names, note = compared_states(config)
    started = time.perf_counter()
    corpus = _training.load_corpus()
    init = _models.init_params(len(corpus.chars), config.width, config.context, config.hidden, config.seed)
    trainers = {
        name: _training.make_trainer(config.backend, init, True, state_rule(name, rule), name == "bf16-sr")
        for name in names
    }
    n_params = sum(x.size for x in opt.trainables(_models.numpy_model(init, True)))
    intro = states_intro(
        n_params, len(corpus.chars), config.width, len(corpus.text), config.backend, rule, config.steps, names
    )
    print(intro if note is None else f"{intro}\n{note}", file=stdout)
    stdout.flush()

    with (
        _training.single_threaded(config.backend),
        np.errstate(over="ignore", invalid="ignore", divide="ignore"),
    ):
        losses = _training.train_side_by_side(config, trainers, corpus.train, stderr)
        runs = {
            name: StateRun(
                losses[name], _training.held_out_loss(config, trainer, corpus), trainer.memory_per_array()
            )
            for name, trainer in trainers.items()
        }
    result = StatesResult(runs, MIN_SIZE, _draw(config, rule, losses), time.perf_counter() - started)
    states_report(result, stdout)
    return result
