"""The demo's training: the text it learns, the two trainers stepped on the same batches, and what
is measured at the end (held-out loss, drift, a sample of generated text)."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import numpy as np

from . import _corpus, _models
from ._config import Config, DemoError
from ._progress import training_progress


@dataclasses.dataclass
class Corpus:
    text: str
    chars: list  # the vocabulary: character i has id i
    train: np.ndarray  # character ids
    val: np.ndarray


def load_corpus(size: int = 200_000) -> Corpus:
    """The standard library's docstrings as character ids, 90% for training and 10% held out."""
    text = _corpus.standard_library_text(size)
    chars = sorted(set(text))
    lookup = np.zeros(128, np.int64)
    lookup[[ord(c) for c in chars]] = np.arange(len(chars))
    data = lookup[np.frombuffer(text.encode("ascii"), np.uint8)]
    split = int(0.9 * len(data))
    return Corpus(text, chars, data[:split], data[split:])


def make_trainer(backend: str, init, tied: bool, rule, bfloat16: bool = False):
    if backend == "numpy":
        return _models.NumpyTrainer(init, tied, rule, bfloat16)
    try:
        __import__(backend)
    except ImportError:
        raise DemoError(f"--backend {backend} needs {backend}: pip install 'optimisers[{backend}]'") from None
    return _models.TRAINERS[backend](init, tied, rule, bfloat16)


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
def single_threaded(backend: str):
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


@dataclasses.dataclass
class Curves:
    """Per step: each run's training loss, and the largest |embed - unembed| after the step."""

    tied_loss: list = dataclasses.field(default_factory=list)
    naive_loss: list = dataclasses.field(default_factory=list)
    tied_drift: list = dataclasses.field(default_factory=list)
    naive_drift: list = dataclasses.field(default_factory=list)


def _batches(config: Config, train_ids: np.ndarray):
    """`(step, contexts, targets)` for steps 1 to `config.steps`: random windows, seeded."""
    rng = np.random.default_rng(config.seed)
    for step in range(1, config.steps + 1):
        starts = rng.integers(0, len(train_ids) - config.context, config.batch)
        yield (step, *_windows(train_ids, starts, config.context))


def train(config: Config, tied, naive, train_ids: np.ndarray, stderr) -> Curves:
    """Step both trainers `config.steps` times on the same random batches."""
    curves = Curves()
    running = None
    with training_progress(config.steps, stderr) as progress:
        for step, ctx, targets in _batches(config, train_ids):
            curves.tied_loss.append(tied.step(ctx, targets))
            curves.naive_loss.append(naive.step(ctx, targets))
            for trainer, drift in ((tied, curves.tied_drift), (naive, curves.naive_drift)):
                e_in, e_out = trainer.embeddings()
                drift.append(float(np.abs(e_in - e_out).max()))
            loss = curves.tied_loss[-1]
            running = loss if running is None else 0.98 * running + 0.02 * loss
            progress(step, running)
    return curves


def train_side_by_side(config: Config, trainers: dict, train_ids: np.ndarray, stderr) -> dict:
    """Step every trainer on the same random batches (those `train` uses); each one's losses by
    name. The progress bar shows the first one's."""
    losses = {name: [] for name in trainers}
    first = losses[next(iter(trainers))]
    running = None
    with training_progress(config.steps, stderr) as progress:
        for step, ctx, targets in _batches(config, train_ids):
            for name, trainer in trainers.items():
                losses[name].append(trainer.step(ctx, targets))
            running = first[-1] if running is None else 0.98 * running + 0.02 * first[-1]
            progress(step, running)
    return losses


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


@dataclasses.dataclass
class Outcome:
    tied_val: float
    naive_val: float
    tied_drift: tuple  # (max |embed - unembed|, its norm relative to |embed|) at the end
    naive_drift: tuple
    sample: str


def _held_out_windows(config: Config, corpus: Corpus):
    """The same 8192 held-out windows for every run."""
    val_rng = np.random.default_rng(12345)
    starts = val_rng.integers(0, len(corpus.val) - config.context, 8192)
    return _windows(corpus.val, starts, config.context)


def held_out_loss(config: Config, trainer, corpus: Corpus) -> float:
    """The trainer's loss on the held-out windows, computed in float32."""
    vctx, vtargets = _held_out_windows(config, corpus)
    params = _models.float32_params(trainer.params())
    return _models.cross_entropy(_models.logits_numpy(params, vctx), vtargets)


def evaluate(config: Config, tied, naive, corpus: Corpus) -> Outcome:
    """Held-out loss of both runs (the same 8192 windows), their drift, and a sample of the tied one."""
    vctx, vtargets = _held_out_windows(config, corpus)
    pt, pn = tied.params(), naive.params()
    sample_rng = np.random.default_rng(config.seed)
    return Outcome(
        tied_val=_models.cross_entropy(_models.logits_numpy(pt, vctx), vtargets),
        naive_val=_models.cross_entropy(_models.logits_numpy(pn, vctx), vtargets),
        tied_drift=_drift(pt),
        naive_drift=_drift(pn),
        sample=_sample(pt, corpus.chars, "Return the ", config.sample_chars, config.context, sample_rng),
    )
