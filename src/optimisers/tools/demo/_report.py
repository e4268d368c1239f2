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
