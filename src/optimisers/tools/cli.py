"""The `optimisers` command line (also `python -m optimisers`).

    optimisers demo [--backend numpy|torch|jax] [--steps N] [--rule RULE] [--lr LR] [--seed S]
                    [--out DIR] [--state fp32|8bit|4bit|fp8|bf16-sr|all]
    optimisers bench [--quick] [--json PATH] [--backends ...] [--shapes ...] [--rules ...] ...
    optimisers --version

Bad options end with one line on stderr and exit status 2; `--help` lists everything.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block, no traceback)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _whole_number(low: int, expected: str):
    """An argparse type for a whole number of at least `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    return parse


_positive_int = _whole_number(1, "at least 1")
_seed = _whole_number(0, "0 or more")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def installed_version() -> str:
    """The version of the installed distribution (what pip installed), else the package's own."""
    try:
        return importlib.metadata.version("optimisers")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        import optimisers

        return optimisers.__version__


def build_parser() -> argparse.ArgumentParser:
    from .demo import BACKENDS, DEFAULT_RULE, STATE_CHOICES, Config

    parser = _Parser(
        prog="optimisers",
        description="Composable optimisation rules for whole models, with tied weights handled.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {installed_version()}")
    sub = parser.add_subparsers(dest="command", metavar="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train a small language model with a tied embedding, and compare with untied training",
        description=(
            "Train a character-level language model whose input embedding and output layer are "
            "one tied array, on the Python standard library's docstrings; train the same model "
            "with the tie cut (as optax would), and compare loss, drift and optimiser memory."
        ),
    )
    defaults = Config()
    demo.add_argument(
        "--backend",
        choices=BACKENDS,
        default=defaults.backend,
        help="numpy (hand-written gradients, the default), torch or jax (autograd)",
    )
    demo.add_argument(
        "--steps",
        type=_positive_int,
        default=defaults.steps,
        help=f"training steps (default {defaults.steps})",
    )
    demo.add_argument(
        "--rule",
        default=DEFAULT_RULE,
        help="a rule name or call, e.g. Lion, 'AdamW(3e-3)' or "
        "'OptimiserChain(ClipNorm(1.0), Adam(3e-3))' (default %(default)s)",
    )
    demo.add_argument(
        "--lr",
        type=_positive_float,
        default=None,
        help="learning rate, replacing the rule's (default: the rule's own)",
    )
    demo.add_argument(
        "--seed",
        type=_seed,
        default=defaults.seed,
        help="seed of the initial weights, the batches and the sample (default 0)",
    )
    demo.add_argument("--out", default=defaults.out, help="folder for the plot (default ./%(default)s)")
    demo.add_argument(
        "--state",
        choices=STATE_CHOICES,
        default=defaults.state,
        help="other than fp32 (the default): train the tied model with the rule's state in 8 bits, "
        "4 bits or FP8 (LowBit), or with bfloat16 parameters (StochasticRounding), beside the "
        "fp32 run, and compare memory and loss; 'all' compares every one",
    )
    sub.add_parser(
        "bench",
        add_help=False,  # its own parser (optimisers.tools.bench) reads the rest of the command line
        help="time one optimiser step against torch.optim and optax; see `optimisers bench --help`",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        from .bench import main as bench_main

        return bench_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import Config, DemoError, run

        config = Config(
            backend=args.backend,
            steps=args.steps,
            rule=args.rule,
            lr=args.lr,
            seed=args.seed,
            out=args.out,
            state=args.state,
        )
        try:
            run(config)
        except DemoError as e:
            print(f"optimisers demo: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("\noptimisers demo: interrupted", file=sys.stderr)
            return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
