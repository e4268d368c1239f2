"""The demo's options: what `optimisers demo` accepts, checked before anything is trained, and the
rule read from `--rule` (parsed, never evaluated as Python)."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os

import numpy as np

import optimisers as opt

BACKENDS = ("numpy", "torch", "jax")
DEFAULT_RULE = "Adam(0.003)"
# `--state`: how the optimiser state (or, for bf16-sr, the parameters) is kept; "all" compares them
STATES = ("fp32", "8bit", "4bit", "fp8", "bf16-sr")
STATE_CHOICES = (*STATES, "all")


class DemoError(Exception):
    """A problem with the demo's options or environment, reported as one line."""


@dataclasses.dataclass(frozen=True)
class Config:
    backend: str = "numpy"
    steps: int = 4000
    rule: str = DEFAULT_RULE
    lr: float | None = None
    seed: int = 0
    out: str = "out"
    context: int = 8
    width: int = 32
    hidden: int = 128
    batch: int = 128
    sample_chars: int = 240
    state: str = "fp32"


def rule_names() -> list[str]:
    """Names of the rule classes `optimisers` exports."""
    return sorted(
        name
        for name in opt.__all__
        if isinstance(getattr(opt, name), type)
        and issubclass(getattr(opt, name), opt.Rule)
        and getattr(opt, name) is not opt.Rule
    )


def _build(node, text: str, names: list[str]):
    """The value of one node of a `--rule` expression: numbers, tuples, rule names and calls."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, bool)):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _build(node.operand, text, names)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.Tuple, ast.List)):
        return tuple(_build(e, text, names) for e in node.elts)
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise DemoError(f"unknown rule {node.id!r}; choose one of: {', '.join(names)}")
        return getattr(opt, node.id)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        cls = _build(node.func, text, names)
        args = [_build(a, text, names) for a in node.args]
        kwargs = {k.arg: _build(k.value, text, names) for k in node.keywords if k.arg is not None}
        try:
            return cls(*args, **kwargs)
        except (TypeError, ValueError) as e:
            raise DemoError(f"cannot build {ast.unparse(node)}: {e}") from None
    raise DemoError(f"cannot read --rule {text!r}: {ast.unparse(node)!r} is not allowed here")


def _with_lr(rule, lr: float):
    """`rule` with every learning rate inside replaced by `lr` (as `optimisers.adjust` does)."""
    probe = opt.setup(rule, {"x": np.zeros(1, np.float32)})
    try:
        return opt.adjust(probe, lr)["x"].rule
    except (TypeError, ValueError) as e:
        raise DemoError(f"--lr cannot be applied to {rule!r}: {e}") from None


def parse_rule(text: str, lr: float | None = None):
    """A rule from `Adam`, `Adam(1e-3)` or `OptimiserChain(ClipNorm(1.0), AdamW(3e-3))`.

    Only rule names, numbers, tuples and calls are allowed (the text is parsed, never evaluated as
    Python). A bare name means the rule at its defaults. `lr`, when given, replaces the learning
    rate of every rule inside.
    """
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise DemoError(f"cannot read --rule {text!r}; write e.g. Adam or 'Adam(1e-3)'") from None
    rule = _build(tree, text, rule_names())
    if isinstance(rule, type):
        try:
            rule = rule()
        except (TypeError, ValueError) as e:
            raise DemoError(
                f"{rule.__name__} needs arguments ({e}); write e.g. --rule '{rule.__name__}(...)'"
            ) from None
    if not isinstance(rule, opt.Rule):
        raise DemoError(f"--rule {text!r} is not a rule")
    return rule if lr is None else _with_lr(rule, lr)


def checked_rule(config: Config):
    """The rule `config` asks for, after checking every option; raises DemoError."""
    if config.backend not in BACKENDS:
        raise DemoError(f"unknown backend {config.backend!r}; choose one of: {', '.join(BACKENDS)}")
    if config.state not in STATE_CHOICES:
        raise DemoError(f"unknown --state {config.state!r}; choose one of: {', '.join(STATE_CHOICES)}")
    if config.steps < 1:
        raise DemoError(f"--steps must be at least 1, got {config.steps}")
    if config.lr is not None and not (config.lr > 0 and np.isfinite(config.lr)):
        raise DemoError(f"--lr must be a positive number, got {config.lr}")
    return parse_rule(config.rule, config.lr)


def check_extras() -> None:
    """The demo draws with matplotlib and shows its progress with rich (the `demo` extra)."""
    missing = [name for name in ("matplotlib", "rich") if importlib.util.find_spec(name) is None]
    if missing:
        raise DemoError(f"the demo needs {' and '.join(missing)}: pip install 'optimisers[demo]'")


def make_out_folder(out: str) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise DemoError(f"--out {out!r} exists and is not a folder")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise DemoError(f"cannot create the output folder {out!r}: {e.strerror}") from None
