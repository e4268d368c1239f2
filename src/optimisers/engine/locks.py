"""One update at a time per State: a lock per State object, held weakly."""

from __future__ import annotations

import threading
import weakref

from optimisers.core.state import State

_LOCKS: dict[int, tuple] = {}  # id(State) -> (weak reference to it, its RLock)
_LOCKS_MADE = threading.Lock()


def lock(state: State):
    """The lock that `update_` holds while it changes `state` and `update` while it reads it: two
    threads stepping one State in place take turns, so neither step is lost. (A State made by
    indexing, `state["encoder"]`, is another State with its own lock.) Kept beside the State,
    not in it, so that States still copy and pickle; found by id, checked by a weak reference,
    and dropped with the State."""
    found = _LOCKS.get(id(state))
    if found is not None and found[0]() is state:
        return found[1]
    with _LOCKS_MADE:
        found = _LOCKS.get(id(state))
        if found is None or found[0]() is not state:
            key = id(state)
            gone = weakref.ref(state, lambda _: _LOCKS.pop(key, None))
            found = _LOCKS[key] = (gone, threading.RLock())
        return found[1]
