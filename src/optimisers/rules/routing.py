"""Ready rule functions for `setup((path, x) -> rule, model)`: one rule for some parameters,
another for the rest."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass

from optimisers.core.rule import Rule
from optimisers.rules.muon import Muon

__all__ = ["muon_or"]

# embeddings (token, position) and output heads: the parameters Muon's authors keep on AdamW
EMBEDDINGS_AND_HEADS = ("*embed*", "wte", "wpe", "*head")


@dataclass(frozen=True)
class MuonOr:
    """The rule function `muon_or` returns: `muon` for matrices, `other` for the rest."""

    other: Rule
    muon: Rule
    exclude: tuple

    def __call__(self, path, x) -> Rule:
        """Muon for a parameter at least 2-D where no part of its path matches an `exclude` pattern."""
        if len(getattr(x, "shape", ())) < 2:
            return self.other
        parts = [str(k).lower() for k in path]
        excluded = any(fnmatch.fnmatchcase(p, pattern.lower()) for p in parts for pattern in self.exclude)
        return self.other if excluded else self.muon


def muon_or(other: Rule, *, muon: Rule | None = None, exclude=EMBEDDINGS_AND_HEADS) -> Callable:
    """A rule function for `setup`: Muon on the hidden matrices, `other` (AdamW, say) on the rest.

        state = opt.setup(opt.muon_or(opt.AdamW(3e-4)), model)

    A parameter gets `muon` (default `Muon()`) when it has at least two dimensions and no part of
    its path matches a pattern of `exclude` (shell-style, case-insensitive, each pattern against
    each part of the path: the default `("*embed*", "wte", "wpe", "*head")` keeps token and
    position embeddings and output heads off Muon, as its authors recommend); every other
    parameter, the 0-D and 1-D ones (biases, norms) included, gets `other`. 3-D and larger
    parameters go to Muon, which flattens them to matrices (see `Muon`).

    Ties: `setup` asks the function at every place of a tied array and refuses a tie whose places
    get different rules, naming both. An embedding tied to the output head is excluded at both
    places by the default patterns; with patterns that exclude only one of its places, `setup`
    raises rather than train one array with two rules.
    """
    if not isinstance(other, Rule):
        raise TypeError(f"muon_or: other must be an optimisers.Rule (e.g. AdamW()), got {other!r}")
    muon = Muon() if muon is None else muon
    if not isinstance(muon, Rule):
        raise TypeError(f"muon_or: muon must be an optimisers.Rule (e.g. Muon()), got {muon!r}")
    if isinstance(exclude, str) or not all(isinstance(p, str) for p in exclude):
        raise TypeError(f"muon_or: exclude must be a tuple of name patterns, got {exclude!r}")
    return MuonOr(other, muon, tuple(exclude))
