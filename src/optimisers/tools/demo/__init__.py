"""`optimisers demo`: train a small character-level language model with a tied embedding.

The model's input embedding and output layer are one array (see `_models`). The demo trains it twice
on the same batches: once as it is, with `optimisers` keeping the tie, and once the naive way, with
the output layer holding its own copy of the embedding, which is what an optimiser that does not see
ties (optax, or a per-array loop) effectively trains. It then reports the loss of both, how far the
naive run's two copies drifted apart, and the optimiser-state memory of both, and draws a plot.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import os
import sys
import textwrap
import time

import numpy as np

import optimisers as opt

from . import _corpus, _models, _plot

BACKENDS = ("numpy", "torch", "jax")
DEFAULT_RULE = "Adam(0.003)"


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


@dataclasses.dataclass
class Result:
    tied_loss: list
    naive_loss: list
    drift: list
    tied_val: float
    naive_val: float
    tied_bytes: int
    naive_bytes: int
    tied_drift: tuple  # (max |embed - unembed|, its norm relative to |embed|) at the end
    naive_drift: tuple
    sample: str
    plot: str
    seconds: float


# --- rules from the command line ---------------------------------------------------------------


def rule_names() -> list[str]:
    """Names of the rule classes `optimisers` exports."""
    return sorted(
        name
        for name in opt.__all__
        if isinstance(getattr(opt, name), type)
        and issubclass(getattr(opt, name), opt.Rule)
        and getattr(opt, name) is not opt.Rule
    )


def parse_rule(text: str, lr: float | None = None):
    """A rule from `Adam`, `Adam(1e-3)` or `OptimiserChain(ClipNorm(1.0), AdamW(3e-3))`.

    Only rule names, numbers, tuples and calls are allowed (the text is parsed, never evaluated as
    Python). A bare name means the rule at its defaults. `lr`, when given, replaces the learning
    rate of every rule inside.
    """
    names = rule_names()
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise DemoError(f"cannot read --rule {text!r}; write e.g. Adam or 'Adam(1e-3)'") from None

    def build(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, bool)):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = build(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, (ast.Tuple, ast.List)):
            return tuple(build(e) for e in node.elts)
        if isinstance(node, ast.Name):
            if node.id not in names:
                raise DemoError(f"unknown rule {node.id!r}; choose one of: {', '.join(names)}")
            return getattr(opt, node.id)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            cls = build(node.func)
            args = [build(a) for a in node.args]
            kwargs = {k.arg: build(k.value) for k in node.keywords if k.arg is not None}
            try:
                return cls(*args, **kwargs)
            except (TypeError, ValueError) as e:
                raise DemoError(f"cannot build {ast.unparse(node)}: {e}") from None
        raise DemoError(f"cannot read --rule {text!r}: {ast.unparse(node)!r} is not allowed here")

    rule = build(tree)
    if isinstance(rule, type):
        try:
            rule = rule()
        except (TypeError, ValueError) as e:
            raise DemoError(
                f"{rule.__name__} needs arguments ({e}); write e.g. --rule '{rule.__name__}(...)'"
            ) from None
    if not isinstance(rule, opt.Rule):
        raise DemoError(f"--rule {text!r} is not a rule")
    if lr is not None:
        probe = opt.setup(rule, {"x": np.zeros(1, np.float32)})
        try:
            rule = opt.adjust(probe, lr)["x"].rule
        except (TypeError, ValueError) as e:
            raise DemoError(f"--lr cannot be applied to {rule!r}: {e}") from None
    return rule


# --- the progress bar --------------------------------------------------------------------------


class Progress:
    """A one-line progress bar on a terminal (redrawn at most ten times a second); elsewhere, e.g.
    in a log file, a line at each quarter."""

    def __init__(self, total: int, stream=None, width: int = 28):
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self.last = 0.0
        self.quarter = 0
        self.drawn = 0

    def line(self, done: int, message: str) -> str:
        filled = int(self.width * done / max(self.total, 1))
        bar = "#" * filled + "." * (self.width - filled)
        rate = done / max(time.perf_counter() - self.start, 1e-9)
        return f"[{bar}] {done:>{len(str(self.total))}}/{self.total} {message} ({rate:,.0f} steps/s)"

    def update(self, done: int, message: str) -> None:
        now = time.perf_counter()
        if self.tty:
            if done == self.total or now - self.last >= 0.1:
                self.last = now
                text = self.line(done, message)
                self.stream.write("\r" + text.ljust(self.drawn))  # cover a longer previous line
                self.drawn = len(text)
                if done == self.total:
                    self.stream.write("\n")
                self.stream.flush()
        elif done * 4 // max(self.total, 1) > self.quarter or done == self.total:
            self.quarter = done * 4 // max(self.total, 1)
            self.stream.write(self.line(done, message) + "\n")
            self.stream.flush()


# --- the run -----------------------------------------------------------------------------------


def _trainer(config: Config, init, tied: bool, rule):
    if config.backend == "numpy":
        return _models.NumpyTrainer(init, tied, rule)
    try:
        __import__(config.backend)
    except ImportError:
        raise DemoError(
            f"--backend {config.backend} needs {config.backend}: pip install 'optimisers[{config.backend}]'"
        ) from None
    return _models.TRAINERS[config.backend](init, tied, rule)


def _openblas_threads():
    """`(get, set)` for the number of threads of the OpenBLAS that NumPy's wheels bundle, or None
    when NumPy uses another BLAS (best effort: only the names OpenBLAS builds export are tried)."""
    import ctypes
    import glob

    base = os.path.dirname(np.__file__)
    for path in glob.glob(base + ".libs/*openblas*") + glob.glob(os.path.join(base, ".dylibs", "*openblas*")):
        try:
            lib = ctypes.CDLL(path)  # the library NumPy already loaded: same file, same handle
        except OSError:
            continue
        for prefix in ("scipy_openblas", "openblas"):
            for suffix in ("64_", "_64_", ""):
                get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                put = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                if get is not None and put is not None:
                    return get, put
    return None


@contextlib.contextmanager
def _single_threaded(backend: str):
    """Run the BLAS and PyTorch on one thread while the demo computes. For matrices this small,
    thread pools cost more than they give, and on a busy machine their spinning threads make the
    demo many times slower. The settings are restored afterwards."""
    restore = []
    try:
        blas = _openblas_threads()
        if blas is not None:
            before = blas[0]()
            blas[1](1)
            restore.append(lambda: blas[1](before))
        if backend == "torch":
            import torch

            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            restore.append(lambda: torch.set_num_threads(threads))
        yield
    finally:
        for undo in reversed(restore):
            undo()


def _windows(data: np.ndarray, starts: np.ndarray, context: int):
    w = data[starts[:, None] + np.arange(context + 1)]
    return w[:, :context], w[:, context]


def _sample(params, chars, prompt: str, n: int, context: int, rng, temperature: float = 0.7) -> str:
    index = {c: i for i, c in enumerate(chars)}
    ids = [index.get(c, index[" "]) for c in prompt]
    ids = [index[" "]] * max(context - len(ids), 0) + ids
    out = []
    for _ in range(n):
        logits = _models.logits_numpy(params, np.array([ids[-context:]]))[0] / temperature
        if not np.isfinite(logits).all():
            return prompt + "... (no sample: the training diverged; try a smaller --lr)"
        p = np.exp(logits - logits.max())
        nxt = int(rng.choice(len(p), p=p / p.sum()))
        ids.append(nxt)
        out.append(chars[nxt])
    return prompt + "".join(out)


def _drift(params) -> tuple[float, float]:
    diff = params["embed"] - params["unembed"]["weight"]
    norm = max(float(np.linalg.norm(params["embed"])), 1e-30)
    return float(np.abs(diff).max()), float(np.linalg.norm(diff)) / norm


def run(config: Config, stdout=None, stderr=None) -> Result:
    """Train the tied and the naive model side by side and report; raises DemoError on bad input."""
    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr
    if config.backend not in BACKENDS:
        raise DemoError(f"unknown backend {config.backend!r}; choose one of: {', '.join(BACKENDS)}")
    if config.steps < 1:
        raise DemoError(f"--steps must be at least 1, got {config.steps}")
    if config.lr is not None and not (config.lr > 0 and np.isfinite(config.lr)):
        raise DemoError(f"--lr must be a positive number, got {config.lr}")
    rule = parse_rule(config.rule, config.lr)
    if os.path.exists(config.out) and not os.path.isdir(config.out):
        raise DemoError(f"--out {config.out!r} exists and is not a folder")
    try:
        os.makedirs(config.out, exist_ok=True)
    except OSError as e:
        raise DemoError(f"cannot create the output folder {config.out!r}: {e.strerror}") from None

    started = time.perf_counter()
    text = _corpus.standard_library_text(200_000)
    chars = sorted(set(text))
    lookup = np.zeros(128, np.int64)
    lookup[[ord(c) for c in chars]] = np.arange(len(chars))
    data = lookup[np.frombuffer(text.encode("ascii"), np.uint8)]
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]

    init = _models.init_params(len(chars), config.width, config.context, config.hidden, config.seed)
    tied = _trainer(config, init, True, rule)
    naive = _trainer(config, init, False, rule)
    n_params = sum(x.size for x in opt.trainables(_models.numpy_model(init, True)))
    print(
        f"optimisers demo: a {n_params:,}-parameter character model whose {len(chars)}x"
        f"{config.width} embedding is tied to its output layer,\n"
        f"trained on {len(text) // 1000} kB of the Python standard library's docstrings "
        f"({config.backend}, {type(rule).__name__}, {config.steps} steps), next to the same "
        "model with the tie cut.",
        file=stdout,
    )
    stdout.flush()

    rng = np.random.default_rng(config.seed)
    progress = Progress(config.steps, stderr)
    tied_loss, naive_loss, drift, tied_drift_curve = [], [], [], []
    running = None
    # a diverging run (too large a --lr) shows up as nan in the report, not as a flood of warnings
    with _single_threaded(config.backend), np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for step in range(1, config.steps + 1):
            ctx, targets = _windows(
                train, rng.integers(0, len(train) - config.context, config.batch), config.context
            )
            tied_loss.append(tied.step(ctx, targets))
            naive_loss.append(naive.step(ctx, targets))
            for trainer, curve in ((tied, tied_drift_curve), (naive, drift)):
                e_in, e_out = trainer.embeddings()
                curve.append(float(np.abs(e_in - e_out).max()))
            running = tied_loss[-1] if running is None else 0.98 * running + 0.02 * tied_loss[-1]
            progress.update(step, f"loss {running:.3f}")

        val_rng = np.random.default_rng(12345)
        vctx, vtargets = _windows(val, val_rng.integers(0, len(val) - config.context, 8192), config.context)
        pt, pn = tied.params(), naive.params()
        tied_val = _models.cross_entropy(_models.logits_numpy(pt, vctx), vtargets)
        naive_val = _models.cross_entropy(_models.logits_numpy(pn, vctx), vtargets)
        tied_drift, naive_drift = _drift(pt), _drift(pn)
        sample = _sample(
            pt, chars, "Return the ", config.sample_chars, config.context, np.random.default_rng(config.seed)
        )

    plot = os.path.join(config.out, f"demo-{config.backend}.png")
    try:
        _plot.training_plot(
            plot,
            tied_loss,
            naive_loss,
            tied_drift_curve,
            drift,
            f"optimisers demo ({config.backend}, {type(rule).__name__}, {config.steps} steps)",
        )
    except OSError as e:
        raise DemoError(f"cannot write the plot to {plot!r}: {e.strerror or e}") from None
    result = Result(
        tied_loss,
        naive_loss,
        drift,
        tied_val,
        naive_val,
        tied.state_bytes(),
        naive.state_bytes(),
        tied_drift,
        naive_drift,
        sample,
        plot,
        time.perf_counter() - started,
    )
    report(result, stdout)
    return result


def report(r: Result, stream) -> None:
    tail = max(1, min(100, len(r.tied_loss) // 10))
    rows = [
        ("", "tied (optimisers)", "naive (two copies)"),
        (
            "training loss, last steps",
            f"{np.mean(r.tied_loss[-tail:]):.3f}",
            f"{np.mean(r.naive_loss[-tail:]):.3f}",
        ),
        ("held-out loss", f"{r.tied_val:.3f}", f"{r.naive_val:.3f}"),
        ("embed vs unembed, max |diff|", f"{r.tied_drift[0]:.3g}", f"{r.naive_drift[0]:.3g}"),
        ("embed vs unembed, relative", f"{r.tied_drift[1]:.1%}", f"{r.naive_drift[1]:.1%}"),
        ("optimiser state (bytes)", f"{r.tied_bytes:,}", f"{r.naive_bytes:,}"),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    print("\nsample (temperature 0.7):", file=stream)
    for line in textwrap.wrap(r.sample.replace("\n", " / "), 76):
        print("  " + line, file=stream)
    print(
        f"\nfinal loss: {r.tied_val:.3f} nats/char on held-out text "
        f"(training loss {np.mean(r.tied_loss[-tail:]):.3f})\n",
        file=stream,
    )
    for i, row in enumerate(rows):
        print(f"  {row[0]:<{widths[0]}}  {row[1]:>{widths[1]}}  {row[2]:>{widths[2]}}", file=stream)
        if i == 0:
            print("  " + "-" * (sum(widths) + 4), file=stream)
    extra = r.naive_bytes - r.tied_bytes
    memory = (
        f" and keep {extra:,} more bytes of optimiser state."
        if extra > 0
        else "; this rule keeps no state per parameter, so both use the same memory."
    )
    print(
        "\nTied: one array at both places, one optimiser state, moved once by the sum of both "
        "gradients.\nNaive: the output layer's copy is trained on its own, so the two places drift "
        f"apart\n(the model is no longer tied){memory}",
        file=stream,
    )
    print(f"plot of both loss curves and the drift: {r.plot}  ({r.seconds:.0f} s)", file=stream)
