"""`optimisers demo`: train a small character-level language model with a tied embedding.

The model's input embedding and output layer are one array (see `_models`). The demo trains it twice
on the same batches: once as it is, with `optimisers` keeping the tie, and once the naive way, with
the output layer holding its own copy of the embedding, which is what an optimiser that does not see
ties (optax, or a per-array loop) effectively trains. It then reports the loss of both, how far the
naive run's two copies drifted apart, and the optimiser-state memory of both, and draws a plot
(matplotlib; the progress bar is rich's: `pip install 'optimisers[demo]'`).

`--state 8bit` (4bit, fp8, bf16-sr, all) trains the tied model instead with its optimiser state in
low precision beside float32 state, and compares memory and loss (`_states`).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import optimisers as opt

from . import _models, _plot, _states, _training
from ._config import (
    BACKENDS,
    DEFAULT_RULE,
    STATE_CHOICES,
    Config,
    DemoError,
    check_extras,
    checked_rule,
    make_out_folder,
    parse_rule,
    rule_names,
)
from ._report import Result, StatesResult, intro, report

__all__ = [
    "BACKENDS",
    "DEFAULT_RULE",
    "STATE_CHOICES",
    "Config",
    "DemoError",
    "Result",
    "StatesResult",
    "parse_rule",
    "report",
    "rule_names",
    "run",
]


def _draw(config: Config, rule, curves: _training.Curves) -> str:
    """Write the plot into `config.out`; returns its path."""
    path = os.path.join(config.out, f"demo-{config.backend}.png")
    title = f"optimisers demo ({config.backend}, {type(rule).__name__}, {config.steps} steps)"
    try:
        _plot.training_plot(
            path, curves.tied_loss, curves.naive_loss, curves.tied_drift, curves.naive_drift, title
        )
    except OSError as e:
        raise DemoError(f"cannot write the plot to {path!r}: {e.strerror or e}") from None
    return path


def run(config: Config, stdout=None, stderr=None) -> Result | StatesResult:
    """Train the tied and the naive model side by side and report; raises DemoError on bad input.
    With `config.state` other than fp32, train the tied model with float32 and low-precision
    state side by side instead (`_states`)."""
    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr
    rule = checked_rule(config)
    check_extras()
    make_out_folder(config.out)
    if config.state != "fp32":
        return _states.run(config, rule, stdout, stderr)

    started = time.perf_counter()
    corpus = _training.load_corpus()
    init = _models.init_params(len(corpus.chars), config.width, config.context, config.hidden, config.seed)
    tied = _training.make_trainer(config.backend, init, True, rule)
    naive = _training.make_trainer(config.backend, init, False, rule)
    n_params = sum(x.size for x in opt.trainables(_models.numpy_model(init, True)))
    print(
        intro(
            n_params, len(corpus.chars), config.width, len(corpus.text), config.backend, rule, config.steps
        ),
        file=stdout,
    )
    stdout.flush()

    # a diverging run (too large a --lr) shows up as nan in the report, not as a flood of warnings
    with (
        _training.single_threaded(config.backend),
        np.errstate(over="ignore", invalid="ignore", divide="ignore"),
    ):
        curves = _training.train(config, tied, naive, corpus.train, stderr)
        outcome = _training.evaluate(config, tied, naive, corpus)
    plot = _draw(config, rule, curves)
    result = Result(
        curves.tied_loss,
        curves.naive_loss,
        curves.naive_drift,
        outcome.tied_val,
        outcome.naive_val,
        tied.state_bytes(),
        naive.state_bytes(),
        outcome.tied_drift,
        outcome.naive_drift,
        outcome.sample,
        plot,
        time.perf_counter() - started,
    )
    report(result, stdout)
    return result
