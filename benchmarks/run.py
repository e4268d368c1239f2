"""Run the side-by-side benchmark: `python benchmarks/run.py [--quick] [--json PATH] ...`.

A thin wrapper around `optimisers bench` (`optimisers.tools.bench.main`, also
`python -m optimisers.tools.bench`); see README.md here for what each column means.
"""

import pathlib
import sys

try:
    from optimisers.tools.bench import main
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))
    from optimisers.tools.bench import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
