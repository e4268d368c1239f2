"""The fast path of `update_`: elementwise rules run over flat group buffers.

Leafs that share a rule object, backend, dtype, device and scalar state (step counters) form a
group whose state arrays the engine holds as 1-D buffers: a large parameter's own state arrays,
raveled, and one buffer per state position for all its small parameters packed together;
each Leaf's state is a view into them. A step runs the rule's own `apply` on cache-sized chunks of
the buffers (for NumPy in parallel threads, since ufuncs release the GIL), writes the new state
back into the chunk and subtracts the step from the parameter in place. The small parameters and
their gradients are joined into two flat buffers for the step (one call each), stepped in runs
of whole chunks, and copied back with one call, so a model of thousands of tiny arrays costs a
few calls per chunk instead of a dozen per array.

Only rules that declare `elementwise = True` are grouped: their update of each element depends
only on that element and on scalars shared by the group, so a chunk computes exactly what the
whole array would. So are chains whose first member scales the whole gradient by one factor
(`OptimiserChain(ClipNorm(), Adam())`: `scaled_elementwise`): each member's factor is computed
over its whole gradient before any chunk is stepped, and the chunks run `apply_scaled` with it
(a run of packed small members gets an array holding each member's factor at its elements).

Everything else takes the ordinary per-Leaf path, and so does a Leaf whose parameter changed
under the plan (converted, reshaped, no longer writable in place); the engine and the per-Leaf
path give the same numbers bit for bit.
"""

from __future__ import annotations

import functools
import operator
import os
from concurrent.futures import ThreadPoolExecutor
from itertools import repeat

from optimisers import ops
from optimisers.core.rule import NewValue
from optimisers.core.state import Leaf, flatten_state, unflatten_state
from optimisers.engine import fast_paths, precision, ties
from optimisers.engine.layout import GroupLayout, scales_gradient

# What a backend that takes part provides is its `InPlaceEngine` protocol
# (optimisers.backends.protocol). Parameters may have any dense layout (channels_last,
# transposed): the backend's `memory_order(x)` says in which order of dimensions its memory
# holds the elements (None: row major), and every array of a member (parameter, gradient,
# state) is read in that order (`flat_in`; `laid_out_like` lays a gradient out as its parameter
# once per step), so chunks are views of the parameter's memory and the state views
# (`shaped_in`) have the parameter's layout.
_POOL: ThreadPoolExecutor | None = None
_GROUP_OF, _RULE_OF, _FROZEN = (operator.attrgetter(a) for a in ("_group", "rule", "frozen"))


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="optimisers")
    return _POOL


def _map(fn, chunks, threads: bool) -> list:
    """`[fn(c) for c in chunks]`, on the pool if `threads`: each worker takes one contiguous
    share of the chunks as one task, so that a step pays one hand-over per worker rather than
    one per chunk (chunks can then be small, and their temporaries few, at little cost)."""
    workers = os.cpu_count() or 1
    if not threads or len(chunks) < 2 or workers < 2:
        return [fn(c) for c in chunks]
    n = len(chunks)
    shares = [chunks[k * n // workers : (k + 1) * n // workers] for k in range(workers)]
    done = _pool().map(lambda share: [fn(c) for c in share], [s for s in shares if s])
    return [result for results in done for result in results]


def eligible(leaf, x) -> bool:
    """Can this Leaf's parameter be stepped by the engine?"""
    rule = leaf.rule
    if not (rule.elementwise or scales_gradient(rule)) or leaf.frozen:
        return False
    b = ops.backend(x)
    return b.IN_PLACE_ENGINE and b.engine_ok(x)


class Group(GroupLayout):
    """Leafs stepped together: one rule, one dtype, one set of scalar state values. Their state
    lives in the flat buffers of `GroupLayout`; this class steps it."""

    def __init__(self, leaves, xs):
        super().__init__(leaves, xs)
        self._sums: dict[int, object] = {}  # member -> its summed-gradient buffer (tied members)
        self._marks = None  # the members' `engine_marks` at their last full check
        self._owners = None  # (marks, parameters, their memory owners): see `param_owners`
        self._staged = None  # `(xs, dxs)` whose packed members are in `_staging` this step
        self._staging = None  # this step's `staging()` buffers
        # a span's checks: its parameters' `span_marks`, and the gradients last found to be
        # views of one flat buffer as `(dxs, their span_marks, the buffer's view)`
        self._span_marks = None if self.span is None else self.b.span_marks(self._span_xs)
        self._span_list = None  # a list of the parameters `_in_span` found to be `_span_xs`
        self._grad_span = None
        self._grad_pieces = None  # the same for `_gradient_pieces`: (dxs, their marks, pieces)
        self._checked = None  # the gradients `span_ready` found in `_grad_span` this step
        self._steppable_at = None  # `Leaf.edits` when `steppable` last found every member ready

    def ready_members(self, found):
        """Every member's contribution to this update, or None if some member cannot step in
        the group now (no gradient, frozen, reshaped, converted (a torch module's `.double()` or
        `.to(device)` swaps its parameters' data in place), not writable in place)."""
        members = []
        for leaf in self.leaves:
            c = found.get(id(leaf))
            if c is None or not c.grads or c.copies or leaf.frozen:
                return None
            members.append(c)
        # the parameters as they were at the last full check (the usual step): nothing that
        # check read has changed, so it is not redone per parameter
        xs = [c.x for c in members]
        now = self.b.engine_marks(xs)
        if now is None:
            return members if self._fit(xs) and self._respan(xs) else None
        if now == self._marks and self._in_span(xs):
            return members
        if not self._fit(xs) or not self._respan(xs):
            return None
        self._marks = now
        return members

    def _in_span(self, xs) -> bool:
        """Are `xs` the parameters that a span group's span holds, as they were? (A list found to
        hold them is remembered: a replay passes the same list, which nothing changes, each step.)"""
        if self.span is None:
            return True
        if not (xs is self._span_list or all(map(operator.is_, xs, self._span_xs))):
            return False
        if self.b.span_marks(xs) != self._span_marks:
            return False
        self._span_list = xs
        return True

    def _respan(self, xs) -> bool:
        """Does a span group's span hold `xs`? (Its view is made anew where they fill one flat
        buffer in order again, as after `flatten_` was called once more.)"""
        if self._in_span(xs):
            return True
        span = self.b.flat_span(xs)
        if span is None:
            return False
        self.span, self._span_xs, self._span_marks = span, list(xs), self.b.span_marks(xs)
        self._span_list = None
        self._grad_span = self._grad_pieces = None
        return True

    def span_ready(self, xs, dxs) -> bool:
        """Can this step run on a span group's flat buffers as they were last step: the same
        parameters (`xs`, the caller has compared them) where they were, and the same gradients
        (`dxs`), still views of one flat buffer? Two bulk reads, instead of every check of
        `ready_members` and `gradients`."""
        kept = self._grad_span
        if (
            kept is None
            or not self.steppable()
            or len(dxs) != len(kept[0])
            or not all(map(operator.is_, dxs, kept[0]))
            or not self._in_span(xs)
            or self.b.span_marks(dxs) != kept[1]
        ):
            return False
        self._checked = dxs
        return True

    def gradient_owner(self, dxs):
        """The one memory owner of the gradients `dxs`, where `span_ready` found them in the
        flat gradient buffer this step; else None."""
        if self._checked is not dxs:
            return None
        return self.b.memory_owners([self._grad_span[2]])[0]

    def unchanged(self, xs) -> bool:
        """Are `xs` (the members' parameters, as planned) unchanged since their last full check,
        by their engine marks?"""
        marks = self.b.engine_marks(xs)
        return marks is not None and self._marks is not None and marks == self._marks

    def param_owners(self, xs) -> set:
        """The memory owners of the members' parameters `xs` (checked against the marks this
        step), kept while they are the same objects with the same marks."""
        kept = self._owners
        if (
            kept is not None
            and self._marks is not None
            and kept[0] is self._marks
            and len(xs) == len(kept[1])
            and all(map(operator.is_, xs, kept[1]))
        ):
            return kept[2]
        owners = set(self.b.memory_owners(xs))
        self._owners = (self._marks, list(xs), owners)
        return owners

    def _fit(self, xs) -> bool:
        """Is each parameter still as planned: its shape, dtype, device and memory order, and
        fit for the engine (a `.data` swap or `.to()` may have changed any of them)?"""
        engine_ok, dtype, device = self.b.engine_ok, self.dtype, self.device
        memory_order = self.b.memory_order
        for x, shape, order in zip(xs, self.shapes, self.orders):
            if x.shape != shape or x.dtype != dtype or not engine_ok(x) or memory_order(x) != order:
                return False
            if device is not None and x.device != device:
                return False
        return True

    def gradients(self, members) -> tuple[list, list]:
        """Each member's summed gradient, laid out as its parameter (what the chunks read), and
        as it was given (what a scaled group's factor is computed on, as the per-Leaf and pure
        paths compute it: a norm's rounding depends on the order it sums in). A member at several
        places (tied) sums its gradients into a buffer kept between steps: a fresh
        parameter-sized array every step is memory the kernel has to fault in again."""
        out, given = [], []
        xs = [c.x for c in members]
        # one pass over the usual case, where the backend has one
        fit = self.b.fit_as_they_are([c.grads[0] for c in members], xs, self.dtype, self.device)
        for i, c in enumerate(members):
            grads, x = c.grads, c.x
            if fit is not None and fit[i] and len(grads) == 1:
                out.append(grads[0])
                given.append(grads[0])
                continue
            # summed in place only when each gradient fits the parameter as it is (what the
            # backend's astype hands back unchanged), so that the sum equals `dx()` bit for bit
            if len(grads) == 1 or not all(c.fitted(g) is g for g in grads):
                dx = c.dx()
                out.append(self.b.laid_out_like(dx, x))  # chunks read it in x's memory order
                given.append(dx)
                continue
            buf = self.summed(i, x, grads)
            out.append(buf)
            given.append(buf)
        return out, given

    def summed(self, i, x, grads):
        """Member `i`'s gradients (each fit for its parameter `x` as it is), summed into the
        buffer the member keeps for that."""
        buf = self._sums.get(i)
        if buf is None:
            buf = self._sums[i] = ops.zeros_like(x)
        return ties.summed(grads, out=buf)

    def intact(self) -> bool:
        rule = self.leaves[0].rule
        return all(leaf._group is self and leaf.rule is rule for leaf in self.leaves)

    def steppable(self) -> bool:
        """Intact, and no member frozen: checked again only after some Leaf was edited."""
        if self._steppable_at == Leaf.edits:
            return True
        leaves, rule = self.leaves, self.leaves[0].rule
        ok = (
            all(map(operator.is_, map(_GROUP_OF, leaves), repeat(self)))
            and all(map(operator.is_, map(_RULE_OF, leaves), repeat(rule)))
            and not any(map(_FROZEN, leaves))
        )
        if ok:
            self._steppable_at = Leaf.edits
        return ok

    # --- one step ---------------------------------------------------------------------------

    def factors(self, dxs):
        """For a scaled group, each member's factor over its whole gradient, indexed by member (a
        list, or a 1-D array); else None. This may raise: ClipNorm of a non-finite gradient."""
        if not self.scaled:
            return None
        with self.b.no_grad():
            return self.leaves[0].rule.gradient_factors([precision.widened(dx) for dx in dxs])

    def step(self, xs, dxs, factors=None):
        """Update every member in place: `xs`, `dxs` are the parameters and summed gradients.

        Big chunks are views of one parameter and are written where they are computed. The
        packed members are joined into the staging buffers once (one call each for parameters and
        gradients), their runs' chunks step those buffers, and the result is copied back into the
        parameters at the end: no Python work per parameter inside the chunks."""
        rule = self.leaves[0].rule
        if factors is None and self._step_fast(rule, xs, dxs):
            return
        chunks = self.chunks
        with self.b.no_grad():  # PyTorch: the step is data, not a graph
            self._stage(xs, dxs)
            compute = functools.partial(self._chunk, rule, xs=xs, dxs=dxs, factors=factors)
            done = _map(compute, chunks, self.threads)
            if self.has_runs:  # (a span's chunks wrote the parameters themselves)
                p0 = self.packed_from
                self.b.split_into(self._staging[0], xs[p0:], self.orders[p0:])
        self.unstage()
        self.scalars = done[0]

    def unstage(self) -> None:
        """Let go of what `_stage` made and refers to (after a step, or a failed rehearsal)."""
        self._staged = self._staging = self._checked = None

    def _stage(self, xs, dxs) -> None:
        """Join the packed members' parameters and gradients into the staging buffers (once per
        step: a rehearsal does it before the step). A span is its own staging buffer for the
        parameters, and so are the gradients where they are views of one flat buffer too."""
        staged = self._staged
        if staged is not None and staged[0] is xs and staged[1] is dxs:
            return
        if self.span is not None:
            self._staging = self.span, self._gradient_span(dxs)
            self._staged = xs, dxs
            return
        if not self.has_runs:
            return
        p0 = self.packed_from
        self._staging = flat_x, flat_g = self.staging(xs[p0])
        orders = self.orders[p0:]
        self.b.join_into(flat_x, xs[p0:], orders)
        self.b.join_into(flat_g, dxs[p0:], orders)
        self._staged = xs, dxs

    def _gradient_span(self, dxs):
        """The members' gradients `dxs` as one 1-D array in the span's order: a view of the flat
        buffer they are views of, laid out as the parameters (kept to compare with the next
        step's), else joined into a new one."""
        b, kept = self.b, self._grad_span
        if self._checked is dxs:
            return kept[2]
        if (
            kept is not None
            and len(dxs) == len(kept[0])
            and all(map(operator.is_, dxs, kept[0]))
            and b.span_marks(dxs) == kept[1]
        ):
            return kept[2]
        flat = b.flat_span(dxs) if dxs[0].dtype == self.dtype else None
        if flat is not None and [g.shape for g in dxs] == self.shapes:
            self._grad_span = list(dxs), b.span_marks(dxs), flat
            return flat
        flat = b.empty_flat(self.offsets[-1], self.span)
        b.join_into(flat, dxs, self.orders)
        return flat

    def _gradient_pieces(self, dxs):
        """For a span whose tied members' gradients are sums of their own (`summed`) while the
        others' are views of one flat buffer: `[(lo, hi, gradient)]`, the span cut around each
        summed member, each gradient 1-D, so that a kernel steps the pieces in one call and no
        gradient is copied; else None (the gradients are joined into a new buffer instead)."""
        own = sorted(i for i, buf in self._sums.items() if dxs[i] is buf)
        if not own:
            return None
        kept = self._grad_pieces
        if kept is not None and all(map(operator.is_, dxs, kept[0])) and self.b.span_marks(dxs) == kept[1]:
            return kept[2]
        b, offsets, pieces, i = self.b, self.offsets, [], 0
        for j in [*own, len(dxs)]:
            if i < j:  # members i..j-1: views of one buffer, back to back?
                flat = b.flat_span(dxs[i:j]) if dxs[i].dtype == self.dtype else None
                if flat is None or [g.shape for g in dxs[i:j]] != self.shapes[i:j]:
                    return None
                pieces.append((offsets[i], offsets[j], flat))
            if j < len(dxs):
                pieces.append((offsets[j], offsets[j + 1], b.flat_in(dxs[j], self.orders[j])))
            i = j + 1
        self._grad_pieces = list(dxs), b.span_marks(dxs), pieces
        return pieces

    def _step_fast(self, rule, xs, dxs) -> bool:
        """Step every member with the backend's own kernel for `rule`, if it has one that takes
        them; whether it did. A span steps as one array: one kernel call."""
        found = fast_paths.find(self.b, rule)
        if found is None or self.array_at != fast_paths.STATE_ARRAYS[found[0]]:
            return False
        _, kernel, args = found
        joined = self.span is not None or kernel.joined
        if joined:
            parts = self._flat_parts(xs, dxs)
        else:
            parts = (xs, dxs, *[self.member_parts(k) for k, a in enumerate(self.array_at) if a])
        t = self.scalars[-1] + 1
        if not kernel.step_many(args, *parts, t):
            return False
        if joined and self.has_runs:
            p0 = self.packed_from
            self.b.split_into(self._staging[0], xs[p0:], self.orders[p0:])
        self.scalars = [None] * (len(self.scalars) - 1) + [t]
        return True

    def _flat_parts(self, xs, dxs):
        """`(parameters, gradients, *state arrays)` as lists of 1-D arrays for a kernel that takes
        them joined: one entry per big member (views of it), one for the packed members (the
        staging buffers and the packed state), or one for a span."""
        b, arrays = self.b, [k for k, a in enumerate(self.array_at) if a]
        pieces = self._gradient_pieces(dxs) if self.span is not None else None
        if pieces is not None:  # the span cut where a tied member's gradient is its own array
            cuts = [slice(lo, hi) for lo, hi, _ in pieces]
            state = [[self.buffers[k][0][cut] for cut in cuts] for k in arrays]
            return [self.span[cut] for cut in cuts], [g for _, _, g in pieces], *state
        with b.no_grad():
            self._stage(xs, dxs)
        if self.span is not None:
            return [self._staging[0]], [self._staging[1]], *[[self.buffers[k][0]] for k in arrays]
        p0, orders = self.packed_from, self.orders
        flat_xs = [b.flat_in(xs[i], orders[i]) for i in range(p0)]
        flat_dxs = [b.flat_in(dxs[i], orders[i]) for i in range(p0)]
        state = [[self.buffers[k][i] for i in range(p0)] for k in arrays]
        if self.has_runs:
            flat_xs.append(self._staging[0])
            flat_dxs.append(self._staging[1])
            for k, parts in zip(arrays, state):
                parts.append(self.packed[k])
        return flat_xs, flat_dxs, *state

    def rehearse(self, xs, dxs, factors=None) -> None:
        """Run the rule on every chunk without writing anything, checking what it returns: a
        rule that raises (or returns arrays that do not fit) on some chunk does so here, before
        `step` has written any chunk, so that a failed `update_` changes nothing."""
        rule = self.leaves[0].rule
        with self.b.no_grad():
            self._stage(xs, dxs)
            check = functools.partial(self._chunk, rule, xs=xs, dxs=dxs, factors=factors, write=False)
            _map(check, self.chunks, self.threads)

    def trusted(self) -> bool:
        """Can this step run without a rehearsal: does the rule promise not to raise?"""
        if not self.leaves[0].rule.never_raises:
            return False
        return not self.b.raises_on_values()  # NumPy under np.seterr(all="raise")

    def _chunk(self, rule, chunk, *, xs, dxs, factors=None, write=True):
        """Compute and write one chunk (of a parameter, or of the staging buffers for a run):
        the new scalars. With `write=False` only compute and check."""
        b = self.b
        if chunk[0] == "big":
            _, i, start, stop = chunk
            x = b.flat_in(xs[i], self.orders[i])[start:stop]  # a view: parameters here are dense
            dx = b.flat_in(dxs[i], self.orders[i])[start:stop]
        elif chunk[0] == "flat":  # a range of the span and of the packed buffers
            _, i, start, stop = chunk
            flat_x, flat_g = self._staging
            x, dx = flat_x[start:stop], flat_g[start:stop]
        else:  # a run: its range of the staging buffers, and its buffer slices, whole
            _, i, j, _ = chunk
            start, stop = 0, self.offsets[j] - self.offsets[i]
            lo = self.offsets[i] - self.offsets[self.packed_from]
            flat_x, flat_g = self._staging
            x, dx = flat_x[lo : lo + stop], flat_g[lo : lo + stop]
        parts = [
            buf[i][start:stop] if a else s for a, buf, s in zip(self.array_at, self.buffers, self.scalars)
        ]
        state = unflatten_state(self.spec, iter(parts))
        if factors is None:
            new_state, step = precision.run(rule.apply, state, x, dx)
        else:  # a scaled group: the member's factor, or each packed member's over its elements
            factor = factors[i] if chunk[0] == "big" else self._run_factors(factors, chunk)
            new_state, step = precision.run(rule.apply_scaled, state, x, dx, factor)
        new_parts: list = []
        flatten_state(new_state, new_parts)
        if not write:
            _check_chunk(rule, x, parts, new_parts, step)
            return None
        for a, old, new in zip(self.array_at, parts, new_parts):
            if a and new is not old:
                b.copy_into(old, new)
        if step is not None:
            if isinstance(step, NewValue):
                b.assign_(x, step.value)
            else:
                b.subtract_(x, step)
        return [None if a else p for a, p in zip(self.array_at, new_parts)]


    def _run_factors(self, factors, chunk):
        """A packed run's factors, one per element (each member's over its elements): the
        products `factor · dx` are those of each member's own factor, element by element."""
        _, i, j, bounds = chunk
        return self.b.repeat_each(factors[i:j], [hi - lo for lo, hi in bounds])


def _check_chunk(rule, x, parts, new_parts, step) -> None:
    """What a rehearsed chunk returned must fit where `step` would write it."""
    name = type(rule).__name__
    if len(new_parts) != len(parts):
        raise ValueError(f"{name}.apply returned a state of another structure than it was given")
    for old, new in zip(parts, new_parts):
        shape = getattr(old, "shape", None)
        if shape is not None and len(shape) > 0 and getattr(new, "shape", None) != shape:
            raise ValueError(
                f"{name}.apply returned a state array of shape {tuple(getattr(new, 'shape', ()))} "
                f"for a state array of shape {tuple(shape)}"
            )
    value = step.value if isinstance(step, NewValue) else step
    shape = getattr(value, "shape", ())
    if value is not None and tuple(shape) not in ((), tuple(x.shape)):
        raise ValueError(f"{name}.apply returned a step of shape {tuple(shape)} for {tuple(x.shape)}")
