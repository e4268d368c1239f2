"""compiles: whether a rule's steps take the compiled way (one pass over memory)."""

from __future__ import annotations

from optimisers.engine import compiled


def compiles(rule) -> bool:
    """Whether the steps of `rule` can run as one compiled pass over memory (docs/backends.md:
    "Every elementwise rule, compiled"): True for an elementwise rule, a rule that steps
    elementwise given one factor per array found first (a `ClipNorm > ...` chain, LAMB, LARS, and
    Adafactor on vectors and scalars; Adafactor's matrices keep row and column factors and run the
    eager maths) and `LowBit` of an elementwise rule, unless its step was found untraceable at a
    step already (it reads an array's values in Python) or compiling is off
    (`OPTIMISERS_COMPILE=0`). Even then, a backend without a compiler (JAX, where XLA fuses the
    step; NumPy without numba) and small steps run the eager maths. False: every step runs the
    eager maths, a pass over memory per operation (Muon, SOAP, a scheduled LAMB, LARS or
    Adafactor, whose factors would need the schedule's value outside its `apply`).
    """
    return compiled.traceable(rule)
