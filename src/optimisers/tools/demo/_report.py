"""What the demo prints: a line about the model before training, and after it the sample, the
final loss and the table comparing the tied run with the naive one."""

from __future__ import annotations

import dataclasses
import textwrap

import numpy as np


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


def intro(n_params: int, vocab: int, width: int, text_chars: int, backend: str, rule, steps: int) -> str:
    return (
        f"optimisers demo: a {n_params:,}-parameter character model whose {vocab}x"
        f"{width} embedding is tied to its output layer,\n"
        f"trained on {text_chars // 1000} kB of the Python standard library's docstrings "
        f"({backend}, {type(rule).__name__}, {steps} steps), next to the same "
        "model with the tie cut."
    )


def _table(r: Result, tail: int) -> list[str]:
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
    lines = []
    for i, row in enumerate(rows):
        lines.append(f"  {row[0]:<{widths[0]}}  {row[1]:>{widths[1]}}  {row[2]:>{widths[2]}}")
        if i == 0:
            lines.append("  " + "-" * (sum(widths) + 4))
    return lines


def report(r: Result, stream) -> None:
    tail = max(1, min(100, len(r.tied_loss) // 10))
    print("\nsample (temperature 0.7):", file=stream)
    for line in textwrap.wrap(r.sample.replace("\n", " / "), 76):
        print("  " + line, file=stream)
    print(
        f"\nfinal loss: {r.tied_val:.3f} nats/char on held-out text "
        f"(training loss {np.mean(r.tied_loss[-tail:]):.3f})\n",
        file=stream,
    )
    print("\n".join(_table(r, tail)), file=stream)
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


@dataclasses.dataclass
class StateRun:
    """One run of `--state`: its training losses, held-out loss and memory."""

    train_loss: list
    held_out: float
    arrays: list  # (elements, parameter bytes, state bytes) of each distinct parameter

    @property
    def state_bytes(self) -> int:
        return sum(state for _, _, state in self.arrays)

    @property
    def parameter_bytes(self) -> int:
        return sum(param for _, param, _ in self.arrays)

    def bytes_per_param(self, min_size: int = 0) -> float:
        """State bytes per parameter over the arrays of at least `min_size` elements."""
        chosen = [(n, state) for n, _, state in self.arrays if n >= min_size]
        return sum(state for _, state in chosen) / max(1, sum(n for n, _ in chosen))


@dataclasses.dataclass
class StatesResult:
    runs: dict  # name -> StateRun, "fp32" first
    min_size: int  # LowBit quantises the state of arrays of at least this many elements
    plot: str
    seconds: float


def states_intro(n_params, vocab, width, text_chars, backend, rule, steps, names) -> str:
    return (
        f"optimisers demo: a {n_params:,}-parameter character model whose {vocab}x{width} "
        f"embedding is tied to its output layer,\ntrained on {text_chars // 1000} kB of the Python "
        f"standard library's docstrings ({backend}, {type(rule).__name__}, {steps} steps),\n"
        f"with its optimiser state kept as {', '.join(names)}, side by side."
    )


def _states_table(r: StatesResult, tail: int) -> list[str]:
    fp32 = r.runs["fp32"]

    def row(label, cell):
        return (label, *(cell(run) for run in r.runs.values()))

    def relative(run):
        return "-" if run is fp32 else f"{(run.held_out - fp32.held_out) / fp32.held_out:+.2%}"

    rows = [
        ("", *r.runs),
        row("optimiser state (bytes)", lambda run: f"{run.state_bytes:,}"),
        row(f"  per parameter, arrays >= {r.min_size}", lambda run: f"{run.bytes_per_param(r.min_size):.3f}"),
        row("  per parameter, whole model", lambda run: f"{run.bytes_per_param():.3f}"),
        row("parameters (bytes)", lambda run: f"{run.parameter_bytes:,}"),
        row("training loss, last steps", lambda run: f"{np.mean(run.train_loss[-tail:]):.3f}"),
        row("held-out loss", lambda run: f"{run.held_out:.4f}"),
        row("held-out loss vs fp32", relative),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for i, cells in enumerate(rows):
        lines.append(
            "  " + f"{cells[0]:<{widths[0]}}" + "".join(f"  {c:>{w}}" for c, w in zip(cells[1:], widths[1:]))
        )
        if i == 0:
            lines.append("  " + "-" * (sum(widths) + 2 * (len(widths) - 1)))
    return lines


def states_report(r: StatesResult, stream) -> None:
    tail = max(1, min(100, len(r.runs["fp32"].train_loss) // 10))
    print("", file=stream)
    print("\n".join(_states_table(r, tail)), file=stream)
    notes = ["fp32: the rule's state in float32, as without --state."]
    bits = {"8bit": "8", "4bit": "4", "fp8": "'fp8'"}
    low_bit = [name for name in r.runs if name in bits]
    if low_bit:
        notes.append(
            f"{', '.join(low_bit)}: LowBit(rule, bits={' or '.join(bits[n] for n in low_bit)}, "
            f"min_size={r.min_size}) keeps the state of the arrays of at least {r.min_size} elements "
            "as codes (a byte a number; 4 bits: half a byte) and a float32 scale a block; the "
            "smaller arrays keep float32."
        )
    if "bf16-sr" in r.runs:
        notes.append("bf16-sr: bfloat16 parameters, StochasticRounding(rule); the state is bfloat16 too.")
    print("\n" + "\n".join(textwrap.fill(note, 96) for note in notes), file=stream)
    print(f"plot of the loss curves: {r.plot}  ({r.seconds:.0f} s)", file=stream)
