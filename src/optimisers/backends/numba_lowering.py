"""A traced elementwise step (`optimisers.backends.traced.Program`) compiled by numba into one
loop over memory: each element is read once, stepped in registers, and written once, with no
temporaries. Used for NumPy arrays and for torch's CPU tensors (as NumPy views of their memory).

The loop does what the eager step does, operation for operation, in the dtypes the traced
library gave each node (float32 maths stays float32; IEEE's add, multiply, divide and square
root round alike everywhere), so on NumPy the result equals the eager step bit for bit. float16
and bfloat16 arrays are read and written as their 16 bits and converted in the loop (numba has
no such types; the conversions round to nearest even, as NumPy's and torch's casts do).

Each program's source is written once to a file in the kernel cache (`OPTIMISERS_CACHE`, else
`~/.cache/optimisers`), named by its hash, so that numba's own cache keeps the compiled code
between processes. Without numba (or with `OPTIMISERS_NUMBA=0`) there are no kernels.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile

from optimisers.backends import numpy_kernels
from optimisers.backends.traced import compared_in
from optimisers.core.quant_lookup import codebook
from optimisers.core.quantised import SMALLEST_SCALE

_NUMBERS = {"float32", "float64", "bool"}  # dtypes the loop computes in
_HALVES = {"float16", "bfloat16"}  # dtypes stored as 16 bits, computed in float32
_KERNELS: dict = {}  # program -> its compiled loop, or None where it cannot be compiled
_SYMBOLS = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "lt": "<", "le": "<=", "gt": ">",
            "ge": ">=", "eq": "==", "ne": "!=", "and": "&", "or": "|"}
_CALLS = {"sqrt": "np.sqrt", "abs": "abs", "sign": "_sign", "maximum": "_maximum", "minimum": "_minimum"}
_PRELUDE = '''import numba
import numpy as np
from numba import float32, float64, uint16, uint32


@numba.njit(cache=True)
def _maximum(a, b):
    return a if a >= b or a != a else b


@numba.njit(cache=True)
def _minimum(a, b):
    return a if a <= b or a != a else b


@numba.njit(cache=True)
def _sign(a):
    return type(a)(1) if a > 0 else type(a)(-1) if a < 0 else a if a != a else type(a)(0)


@numba.njit(cache=True)
def _from_bfloat16(h):
    return np.uint32(np.uint32(h) << np.uint32(16))


@numba.njit(cache=True)
def _to_bfloat16(bits):
    if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((bits >> np.uint32(16)) | np.uint32(0x40))  # NaN stays a quiet NaN
    bias = np.uint32(np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    return np.uint16(np.uint32(bits + bias) >> np.uint32(16))


@numba.njit(cache=True)
def _from_float16(h):
    h = np.uint32(h)
    sign = np.uint32((h & np.uint32(0x8000)) << np.uint32(16))
    exponent = np.uint32((h >> np.uint32(10)) & np.uint32(0x1F))
    mantissa = np.uint32(h & np.uint32(0x3FF))
    if exponent == np.uint32(31):
        return np.uint32(sign | np.uint32(0x7F800000) | np.uint32(mantissa << np.uint32(13)))
    if exponent == np.uint32(0):
        value = np.float32(mantissa) * np.float32(2.0 ** -24)  # a subnormal: exact in float32
        return np.uint32(sign | np.float32(value).view(np.uint32))
    biased = np.uint32(np.uint32(exponent + np.uint32(112)) << np.uint32(23))
    return np.uint32(sign | biased | np.uint32(mantissa << np.uint32(13)))


@numba.njit(cache=True)
def _to_float16(bits):
    sign = np.uint16((bits >> np.uint32(16)) & np.uint32(0x8000))
    magnitude = np.uint32(bits & np.uint32(0x7FFFFFFF))
    if magnitude > np.uint32(0x7F800000):  # NaN: kept quiet, with its top payload bits
        payload = np.uint16((magnitude >> np.uint32(13)) & np.uint32(0x3FF))
        return np.uint16(sign | np.uint16(0x7E00) | payload)
    if magnitude >= np.uint32(0x477FF000):  # rounds to 65520 or more: infinity
        return np.uint16(sign | np.uint16(0x7C00))
    if magnitude < np.uint32(0x38800000):  # below float16's smallest normal: a subnormal or zero
        # in units of 2^-24 (exact), rounded to an integer, ties to even
        units = np.rint(np.float32(np.uint32(magnitude).view(np.float32) * np.float32(2.0 ** 24)))
        return np.uint16(sign | np.uint16(units))
    bias = np.uint32(np.uint32(0xFFF) + ((magnitude >> np.uint32(13)) & np.uint32(1)))
    return np.uint16(sign | np.uint16(np.uint32(magnitude - np.uint32(0x38000000) + bias) >> np.uint32(13)))
'''


def available() -> bool:
    return numpy_kernels.AVAILABLE


def kernel(program, aliases=(), uniform=()):
    """The loop `kernel(*inputs, *outputs, consts)` of `program` over 1-D NumPy arrays of one
    length (float16 and bfloat16 as views of their bits as uint16), without the outputs that
    `aliases` writes into inputs, and with the inputs `uniform` as one element (`source_of`),
    or None where it cannot compute the program."""
    key = (program, aliases, uniform)
    if key not in _KERNELS:
        source = source_of(program, aliases, uniform)
        _KERNELS[key] = None if source is None or not available() else _load(source)
    return _KERNELS[key]


def _name(dtype) -> str:
    return str(dtype).rpartition(".")[2]


def source_of(program, aliases=(), uniform=()) -> str | None:
    """The loop's Python source, or None. `aliases[m]`: the input that output `m` is written
    into (a step in place), or -1 for an array of its own; the loop then takes only the others,
    so that LLVM, finding no two arguments overlap, runs its vectorised loop. Each input of
    `uniform` is one element that every element shares (a gradient's clipping factor), read once
    before the loop: a view repeating it (stride 0) kept LLVM from vectorising."""
    aliases = aliases or (-1,) * len(program.outputs)
    computes, consts, body = _body(program, {k: f"u{k}" for k in uniform})
    if body is None:
        return None
    arrays = [f"a{k}" for k in range(len(program.inputs))]
    arrays += [f"o{m}" for m, k in enumerate(aliases) if k < 0]
    lines = [f"def kernel({', '.join(arrays)}, c):"]
    lines += [f"    k{k}_{t} = np.{t}(c[{k}])" for k, t in consts]
    stored = {args[0]: _name(dtype) for op, args, dtype in program.nodes if op == "in"}
    lines += [f"    u{k} = " + _line("in", (k,), "float32", [], {}, stored[k]).replace("[i]", "[0]")
              for k in uniform]
    lines.append(f"    for i in range({arrays[0]}.shape[0]):")
    lines += ["        " + line for line in body]
    for m, (n, dtype) in enumerate(program.outputs):  # (every element read before any is written)
        target = f"o{m}" if aliases[m] < 0 else f"a{aliases[m]}"
        lines.append(f"        {target}[i] = {_store(f'v{n}', computes[n], _name(dtype))}")
    return _module(lines)


def _module(lines) -> str:
    decorator = "@numba.njit(cache=True, nogil=True, error_model='numpy')"
    return _PRELUDE + "\n\n" + decorator + "\n" + "\n".join(lines) + "\n"


def _body(program, reads, arrays="a"):
    """`(computes, consts, lines)`: each node's computing dtype, the constant slots used, and
    one line a node (None where one cannot be lowered). `reads[k]`: how input k is read, where
    not from `{arrays}{k}[i]`."""
    names = [_name(dtype) for _, _, dtype in program.nodes]
    if not set(names) | {_name(d) for _, d in program.outputs} <= _NUMBERS | _HALVES:
        return None, None, None
    computes = ["float32" if n in _HALVES else n for n in names]
    consts, body = {}, []
    for n, (op, args, _) in enumerate(program.nodes):
        line = reads[args[0]] if op == "in" and args[0] in reads else (
            _line(op, args, computes[n], computes, consts, names[n], arrays))
        if line is None:
            return None, None, None
        body.append(f"v{n} = {line}")
    return computes, consts, body


def quantised_kernel(program, ins, outs, block: int):
    """The loop of `program` where some state is kept blockwise quantised (`core.quantised`):
    `ins[k]`, `outs[m]` is None for a plain array, or the format `(bits, signed)` of a quantised
    one, read as its codes and scales and written as new ones. Called `kernel(*inputs,
    *outputs, consts, *tables)` with a quantised input or output as two arrays (codes, scales)
    and the tables `quantised_tables` gives; or None where it cannot compute the program."""
    key = (program, ins, outs, block)
    if key not in _KERNELS:
        source = quantised_source_of(program, ins, outs, block)
        _KERNELS[key] = None if source is None or not available() else _load(source)
    return _KERNELS[key]


def quantised_tables(ins, outs) -> list:
    """The arrays a `quantised_kernel` takes after its constants: each quantised input's map
    values, then each quantised output's lookup tables (`core.quant_lookup`)."""
    tables = [codebook(*f).values for f in ins if f is not None]
    for f in outs:
        if f is not None:
            book = codebook(*f)
            tables += [book.threshold, book.pairs]
    return tables


def quantised_source_of(program, ins, outs, block: int) -> str | None:
    """Blocks of `block` elements, each in loops simple enough for LLVM to vectorise most: the
    quantised inputs dequantised into block-long buffers, each element's step (its new quantised
    values into buffers too), then each buffer's scale (the block's absmax) and codes.
    Dequantising and quantising do what `numpy_quant` does, operation for operation, so the
    result equals the eager step's bit for bit."""
    if any(f is not None and f[0] == 4 for f in (*ins, *outs)) and block % 2:
        return None  # (4-bit codes pair up within a block)
    reads = {k: f"d{k}[i]" for k, f in enumerate(ins) if f is not None}
    computes, consts, body = _body(program, reads, "A")
    if body is None:
        return None
    arrays = [f"a{k}" if f is None else f"q{k}, s{k}" for k, f in enumerate(ins)]
    arrays += [f"o{m}" if f is None else f"oq{m}, os{m}" for m, f in enumerate(outs)]
    tables = [f"V{k}" for k, f in enumerate(ins) if f is not None]
    tables += [f"T{m}, P{m}" for m, f in enumerate(outs) if f is not None]
    lines = [f"def kernel({', '.join(arrays)}, c, {', '.join(tables)}):"]
    lines += [f"    k{k}_{t} = np.{t}(c[{k}])" for k, t in consts]
    lines.append("    n = " + (f"a{ins.index(None)}" if None in ins else "q0") + ".shape[0]")
    lines += [f"    d{k} = np.empty({block}, np.float32)" for k, f in enumerate(ins) if f is not None]
    for m, f in enumerate(outs):
        if f is not None:
            lines += [f"    w{m} = np.empty({block}, np.float32)", f"    b{m} = w{m}.view(np.int32)"]
            lines += [f"    e{m} = np.empty({block}, np.uint8)"] * (f[0] == 4)  # (4-bit codes, then packed)
    lines += [f"    for blk in range((n + {block - 1}) // {block}):",
              f"        start = blk * {block}", f"        count = min(n, start + {block}) - start"]
    lines += [f"        A{k} = a{k}[start:start + count]" for k, f in enumerate(ins) if f is None]
    lines += [f"        O{m} = o{m}[start:start + count]" for m, f in enumerate(outs) if f is None]
    for k, f in enumerate(ins):
        if f is not None:
            lines += [f"        sc{k} = s{k}[blk]"]
            lines += ["        " + line for line in _dequantised(k, f[0] == 4)]
    lines.append("        for i in range(count):")
    lines += ["            " + line for line in body]
    for m, (n, dtype) in enumerate(program.outputs):
        target = f"O{m}[i]" if outs[m] is None else f"w{m}[i]"
        stored = _name(dtype) if outs[m] is None else "float32"
        lines.append(f"            {target} = {_store(f'v{n}', computes[n], stored)}")
    for m, f in enumerate(outs):
        if f is not None:
            lines += ["        " + line for line in _requantised(m, codebook(*f))]
    return _module(lines)


def _dequantised(k, nibbles: bool) -> list:
    """Lines that dequantise the block of quantised input `k` into its buffer."""
    if not nibbles:
        return ["for j in range(count):", f"    d{k}[j] = V{k}[q{k}[start + j]] * sc{k}"]
    return [  # (two codes a byte from an even `start`, the first in the high nibble)
        "for j in range(count >> 1):",
        f"    byte = q{k}[(start >> 1) + j]",
        f"    d{k}[2 * j] = V{k}[byte >> 4] * sc{k}",
        f"    d{k}[2 * j + 1] = V{k}[byte & 15] * sc{k}",
        "if count & 1:",
        f"    d{k}[count - 1] = V{k}[q{k}[(start + count) >> 1] >> 4] * sc{k}",
    ]


def _requantised(m, book) -> list:
    """Lines that store the block's scale and codes of quantised output `m` (as
    `numpy_quant_numba.quantise_flat` computes them). The absmax is taken of the bits: those of
    non-negative floats order as the floats do, a NaN's above infinity's."""
    smallest = f"np.float32({SMALLEST_SCALE!r})"
    lines = ["top = 0", "for j in range(count):", f"    top = max(top, b{m}[j] & 0x7FFFFFFF)",
             "t = np.int32(top).view(np.float32) if top <= 0x7F800000 else np.float32(np.nan)",
             f"s = t if not t < {smallest} else {smallest}"]
    if book.divisor != 1:
        lines.append(f"s = s / np.float32({book.divisor!r})")
    lines += [f"os{m}[blk] = s", "for j in range(count):", f"    w{m}[j] = w{m}[j] / s"]
    # each code without branches (a value's sign and bucket are random) or calls, as
    # `core.quant_lookup.Codebook` says: a bucket from the bits, then one comparison (`pairs`)
    code = [f"word = b{m}[j]", "magnitude = word & 0x7FFFFFFF",
            f"k = min(max((magnitude >> {book.shift}) - {book.first - 1}, 0), {book.buckets - 1})",
            f"k += (word >> 31) & {book.buckets}",  # (a negative value's half of the tables)
            f"{f'e{m}[j]' if book.nibbles else f'oq{m}[start + j]'} = "
            f"np.uint8(P{m}[k] >> (np.int32(magnitude >= T{m}[k]) << 3))"]
    lines += ["for j in range(count):", *["    " + line for line in code]]
    if not book.nibbles:
        return lines
    return lines + [  # (two a byte, the first high; an odd count ends with a zero code)
        "for j in range(count >> 1):",
        f"    oq{m}[(start >> 1) + j] = (e{m}[2 * j] << 4) | e{m}[2 * j + 1]",
        "if count & 1:",
        f"    oq{m}[(start + count) >> 1] = e{m}[count - 1] << 4",
    ]


def _operand(arg, to, computes, consts) -> str:
    """Node or constant `arg` as a value of dtype `to`."""
    if arg < 0:
        consts[(~arg, to)] = None
        return f"k{~arg}_{to}"
    return f"v{arg}" if computes[arg] == to else f"np.{to}(v{arg})"


def _line(op, args, t, computes, consts, stored, arrays="a"):
    """The expression of one node of dtype `t` (`stored`: how its inputs are kept, in arrays
    named `arrays` and the input's number)."""
    if op == "in":
        read = f"{arrays}{args[0]}[i]"
        if stored in _HALVES:
            return f"np.uint32(_from_{stored}({read})).view(np.float32)"
        return read
    if op in _SYMBOLS:
        common = compared_in(args, t, computes)
        a, b = (_operand(a, common, computes, consts) for a in args)
        return f"({a} {_SYMBOLS[op]} {b})"
    if op in _CALLS:
        return f"{_CALLS[op]}({', '.join(_operand(a, t, computes, consts) for a in args)})"
    if op == "neg":
        return f"-{_operand(args[0], t, computes, consts)}"
    if op == "cast":
        value = _operand(args[0], t, computes, consts)
        if stored in _HALVES:  # rounded to the narrow dtype, computed on in float32
            rounded = f"_to_{stored}(np.float32({value}).view(np.uint32))"
            return f"np.uint32(_from_{stored}({rounded})).view(np.float32)"
        return value
    if op == "full":
        return _operand(args[1], t, computes, consts)
    if op == "where":
        c = _operand(args[0], "bool", computes, consts)
        a, b = (_operand(a, t, computes, consts) for a in args[1:])
        return f"({a} if {c} else {b})"
    if op.startswith("pow"):
        return _power(op, args, t, computes, consts)
    return None


def _power(op, args, t, computes, consts):
    a = _operand(args[0], t, computes, consts)
    if op == "pow":
        return f"({a} ** {_operand(args[1], t, computes, consts)})"
    p = float(op.split()[1])
    # as NumPy and torch take these exponents: a product, a square root, a reciprocal
    one = f"np.{t}(1)"
    special = {2.0: f"({a} * {a})", 0.5: f"np.sqrt({a})", 1.0: a, -1.0: f"({one} / {a})", 0.0: one}
    return special.get(p, f"({a} ** np.{t}({p!r}))")


def _store(value, computed, stored) -> str:
    if stored == "bfloat16":
        return f"_to_bfloat16(np.float32({value}).view(np.uint32))"
    if stored == "float16":
        return f"_to_float16(np.float32({value}).view(np.uint32))"
    return value if computed == stored else f"np.{stored}({value})"


def _cache_dir() -> str:
    base = os.environ.get("OPTIMISERS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "optimisers")
    path = os.path.join(base, "kernels")
    try:
        os.makedirs(path, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    user = os.getuid() if hasattr(os, "getuid") else 0
    path = os.path.join(tempfile.gettempdir(), f"optimisers-kernels-{user}")
    os.makedirs(path, exist_ok=True)
    return path


def _load(source: str):
    """The `kernel` of `source`, from its file in the cache (written once, atomically)."""
    name = "optimisers_kernel_" + hashlib.sha256(source.encode()).hexdigest()[:24]
    path = os.path.join(_cache_dir(), name + ".py")
    if not os.path.exists(path):
        fd, scratch = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(scratch, path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (numba's cache finds a function by its module)
    spec.loader.exec_module(module)
    return module.kernel
