"""The `optimisers` command line: `optimisers demo`, `optimisers bench`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="optimisers", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="train a small language model with tied embeddings")
    args = parser.parse_args(argv)
    if args.command == "demo":
        print("the demo is not written yet", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
