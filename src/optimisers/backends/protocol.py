"""The written contract of a backend: what each layer of the library asks of an array library.

A backend is a module of functions, registered with the core in `optimisers/backends/__init__.py`;
each class here is what one layer needs of it (`Backend`: every layer but the engine;
`InPlaceEngine`: NumPy and PyTorch, whose arrays can be written in place; `PytreeState`: JAX).
`tests/test_backend_protocol.py` checks every backend against the classes it serves, names and
parameters. docs/architecture.md, "Adding a backend", says how to add one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol, runtime_checkable

Array = Any


class FastPath(NamedTuple):
    """A backend's own kernel for a rule, as `optimisers.engine.fused` calls it."""

    apply: Callable  # (args, state, x, dx) -> (new state, NewValue), or None: the rule's own maths
    step_many: Callable  # (args, xs, dxs, *state parts, t) -> whether it stepped them


@runtime_checkable
class Maths(Protocol):
    """The array maths that rules use through `optimisers.ops`."""

    def sqrt(self, x: Array) -> Array: ...
    def abs(self, x: Array) -> Array: ...
    def abs2(self, x: Array) -> Array: ...  # |x|², real for complex x
    def sign(self, x: Array) -> Array: ...
    def maximum(self, x: Array, y: Array) -> Array: ...
    def minimum(self, x: Array, y: Array) -> Array: ...
    def clip(self, x: Array, low: Any, high: Any) -> Array: ...
    def where(self, condition: Array, x: Array, y: Array) -> Array: ...
    def isfinite(self, x: Array) -> bool | None: ...  # None: traced, cannot be read
    def cond(self, predicate: Any, if_true: Callable, if_false: Callable) -> Any: ...
    def scalar(self, value: Any, like: Array) -> Any: ...  # a hyperparameter in like's dtype
    def epsilon(self, value: Any, like: Array) -> Any: ...  # the same, real, float16 floor 1e-7


@runtime_checkable
class ArrayMaths(Maths, Protocol):
    """The rest of `optimisers.ops`, for arrays only: the values rules make, and the maths of
    arrays with a shape that rules that are not elementwise use (matrix rules: Muon's
    Newton–Schulz, Adafactor's row and column means, SOAP's eigenbases)."""

    def zeros_like(self, x: Array) -> Array: ...
    def full_like(self, x: Array, value: Any) -> Array: ...
    def norm(self, x: Array, p: Any) -> Any: ...
    # each x's `norm`, bit for bit, as a 1-D array (xs: a list, or a 2-D array's rows)
    def norms(self, xs: list, p: Any) -> Array: ...
    def same_values(self, x: Array, y: Array) -> bool | None: ...
    def all_finite(self, x: Array) -> Any: ...
    def astype(self, x: Any, like: Array) -> Array: ...  # raises ops.GradientError for no gradient
    def cast(self, x: Array, dtype: Any) -> Array: ...
    def copy(self, x: Array) -> Array: ...
    def reshape(self, x: Array, shape: tuple) -> Array: ...
    def matrix_transpose(self, x: Array) -> Array: ...  # swaps the last two axes
    def matmul(self, a: Array, b: Array) -> Array: ...  # batched over leading axes
    def tensordot(self, a: Array, b: Array, axes: Any) -> Array: ...
    def sum(self, x: Array, axis: Any, keepdims: bool) -> Array: ...
    def mean(self, x: Array, axis: Any, keepdims: bool) -> Array: ...
    def eigh(self, x: Array) -> tuple: ...  # (eigenvalues ascending, eigenvectors as columns)
    def qr(self, x: Array) -> tuple: ...  # reduced (q, r)
    def stack(self, xs: list) -> Array: ...  # along a new leading axis
    def dtype_epsilon(self, x: Array) -> float: ...  # machine epsilon of x's real dtype
    def zeros(self, shape: tuple, like: Array) -> Array: ...  # like's dtype and device
    def argsort(self, x: Array, descending: bool) -> Array: ...  # last axis, stable
    def take(self, x: Array, indices: Array, axis: int) -> Array: ...
    # low-precision state (optimisers.core.quantised): a Codebook's codes and float32 scales of
    # x's blocks in row-major order, and float32 values of `shape` back from them
    def quantise_blocks(self, x: Array, book: Any, block: int) -> tuple: ...
    def dequantise_blocks(self, codes: Array, scale: Array, book: Any, block: int, shape: tuple) -> Array: ...
    # float32 values rounded to bfloat16's grid, still float32: to nearest (seed None), or
    # stochastically from (seed, step, each element's row-major index), the same on every backend
    def bfloat16_rounded(self, x: Array, seed: Any, step: Any) -> Array: ...


@runtime_checkable
class ScheduleMaths(Maths, Protocol):
    """What learning-rate schedules (optimisers.schedules) compute with, besides `Maths`' minimum
    and maximum: a step of this library in, a value of this library out, traceable under jit."""

    def is_integer(self, x: Any) -> bool: ...  # holds integers (not bools): a valid step
    def as_integer(self, x: Any) -> Any: ...  # an int64 (JAX: its integer dtype as it is)
    def as_real(self, x: Any) -> Any: ...  # a float64 (JAX: its default float dtype)
    def real_scalar(self, value: Any, like: Any) -> Any: ...  # value in that float, on like's device
    def real_where(self, condition: Any, x: Any, y: Any) -> Any: ...  # where(); the result in that float
    def cos(self, x: Any) -> Any: ...


@runtime_checkable
class TreeWalk(Protocol):
    """What `optimisers.core.tree` asks to see a model as a tree."""

    def is_array(self, x: Any) -> bool: ...
    def is_param(self, x: Any) -> bool: ...  # a trainable array: floating or complex
    def node_kind(self, obj: Any) -> Any: ...  # a core.tree.NodeKind for the library's containers


@runtime_checkable
class HostTransfer(Protocol):
    """What checkpoints ask: arrays to and from the host, where arrays are NumPy's."""

    def dtype_name(self, x: Any) -> str | None: ...  # "float32" for a dtype of this library, else None
    def is_traced(self, x: Any) -> bool: ...  # a value under jit: no concrete data to save
    def to_host(self, x: Array) -> Any: ...  # a NumPy copy; dtypes NumPy lacks as ml_dtypes'
    # (C-ordered NumPy copy, None); for dtypes NumPy lacks, (their bits as uints, the dtype's name)
    def to_host_bits(self, x: Array) -> tuple: ...
    # value (a NumPy array, or an array of this library) as a new array of like's dtype and
    # device (JAX: sharding, weak type)
    def from_host(self, value: Any, like: Array) -> Array: ...


@runtime_checkable
class Parameters(Protocol):
    """What the verbs ask to write parameters, and how an update treats the library."""

    def writable(self, x: Array) -> bool: ...  # can be written in place
    def memory_span(self, x: Array) -> Any: ...
    def shares_memory(self, x: Array, y: Array) -> bool: ...
    def subtract(self, x: Array, step: Array) -> Array: ...  # pure: a new parameter
    def subtract_(self, x: Array, step: Array) -> Any: ...  # in place
    def assign_(self, x: Array, value: Array) -> Any: ...
    def replaced(self, x: Array, value: Array) -> Array: ...
    def flatten(self, arrays: list) -> Array: ...  # one 1-D array (destructure)
    def unflatten_one(self, flat: Array, start: int, like: Array) -> Array: ...
    def no_grad(self) -> AbstractContextManager: ...  # rules compute data, not autograd graphs

    SHARE_SCALAR_STATE: bool  # one step count per group of leaves (JAX: fewer traced values)
    IN_PLACE_ENGINE: bool  # whether this module is also an InPlaceEngine
    FAST_PATHS: Mapping[str, FastPath]  # own kernels for some rules, by name ("adam"); may be empty


@runtime_checkable
class Backend(ArrayMaths, ScheduleMaths, TreeWalk, HostTransfer, Parameters, Protocol):
    """An array library: what every layer but the engine asks of it."""


@runtime_checkable
class InPlaceEngine(Parameters, Protocol):
    """What the engine (optimisers.engine) needs to step parameters in place, chunk by chunk."""

    ENGINE_CHUNK: int  # elements per chunk
    ENGINE_THREADS: bool  # run chunks on our threads (NumPy's ufuncs release the GIL)

    def engine_start(self) -> None: ...  # called before a group is built (NumPy: malloc settings)
    def engine_ok(self, x: Array) -> bool: ...  # a parameter the engine can step in place
    COMPILE_FROM: int  # elements: smaller steps run eagerly (see engine.compiled)

    def kernel_ok(self, x: Array) -> bool: ...  # a compiled kernel can read its memory (maybe strided)
    def adopt(self, value: Array, like: Array) -> Array: ...  # a new array made a parameter like `like`
    def elementwise_kernel(
        self, program: Any, device: Any, aliases: tuple = (), uniform: tuple = ()
    ) -> Callable | None: ...
    # optional: a traced step whose state is partly blockwise quantised (LowBit), or None
    # def quantised_kernel(self, program, device, ins, outs, block) -> Callable | None
    def fit_as_they_are(self, gs: list, xs: list, dtype: Any, device: Any) -> list | None: ...
    # the one check of a later step: what the kernels rely on for parameters xs and gradients gs,
    # kept (None: cannot), and whether new lists still hold all of it (docs/architecture.md)
    def snapshot(self, xs: list, gs: list) -> Any: ...
    def unchanged(self, token: Any, xs: list, gs: list) -> bool: ...
    def raises_on_values(self) -> bool: ...  # maths raises on bad values (np.seterr(all="raise"))
    def numel(self, x: Array) -> int: ...
    def memory_order(self, x: Array) -> Any: ...
    def flat_in(self, x: Array, order: Any) -> Array: ...  # a 1-D view in memory order
    def shaped_in(self, flat: Array, shape: tuple, order: Any) -> Array: ...
    def laid_out_like(self, t: Array, x: Array) -> Array: ...  # t with x's strides
    def memory_owners(self, xs: list) -> list: ...
    def concat(self, xs: list) -> Array: ...
    def empty_flat(self, n: int, like: Array) -> Array: ...  # 1-D, like's dtype and device
    def join_into(self, out: Array, xs: list, orders: list) -> Any: ...  # xs in memory order, into 1-D out
    def split_into(self, flat: Array, xs: list, orders: list) -> Any: ...  # join_into's inverse
    def copy_into(self, dst: Array, src: Array) -> Any: ...
    def sum_into(self, dst: Array, xs: list) -> Any: ...
    # parameters that are views of one flat buffer (`optimisers.engine.span`)
    def addresses(self, xs: list) -> list: ...  # where each array's first element is
    def flat_span(self, xs: list) -> Array | None: ...  # 1-D view of the memory xs fill in order
    def repeat_each(self, values: list, counts: list) -> Array: ...  # values[k] counts[k] times, 1-D
    def is_buffer(self, value: Any) -> bool: ...


@runtime_checkable
class PytreeState(Protocol):
    """What `setup` asks of a library whose pytrees a State is (JAX: `optimisers.backends.jax_state`)."""

    def plan_flatten(self, state: Any, x: Array) -> None: ...  # flatten the new State once, now
