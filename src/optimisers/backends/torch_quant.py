"""Blockwise quantisation of torch tensors: the NumPy version's steps (`numpy_quant`) in torch
ops, on the tensor's device, with the format's tables copied there once."""

from __future__ import annotations

import functools
import math
import sys

import torch

from optimisers.core.quantised import SMALLEST_SCALE

_TABLES: dict = {}  # (codebook name, device) -> its tables as tensors there


def _tables(book, device):
    key = (book.name, device)
    found = _TABLES.get(key)
    if found is None:
        found = _TABLES[key] = tuple(
            torch.from_numpy(a.copy()).to(device)
            for a in (book.threshold, book.below, book.above, book.values)
        )
    return found


@torch.no_grad()
def quantise_blocks(x, book, block: int):
    if _is_dtensor(x):
        return _quantise_sharded(x, book, block)
    flat = x.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    blocks = _padded(flat, block).reshape(-1, block)
    scale = blocks.abs().amax(dim=1).clamp_min(SMALLEST_SCALE) if blocks.numel() else blocks.new_zeros(0)
    if book.divisor != 1:
        scale = scale / book.divisor
    scaled = (blocks / scale[:, None]).reshape(-1)[:n]
    codes = codes_of(scaled, book)
    return (pack_nibbles(codes) if book.nibbles else codes.reshape(x.shape)), scale


def codes_of(y, book):
    threshold, below, above, _ = _tables(book, y.device)
    bits = y.contiguous().view(torch.int32)
    magnitude = bits & 0x7FFFFFFF
    i = ((magnitude >> book.shift) - (book.first - 1)).clamp_(0, book.buckets - 1)
    i += (bits >> 31) & book.buckets  # the negative half of the tables
    # (index_select with int32 indices: the fastest gather here)
    take = functools.partial(torch.index_select, dim=0, index=i.reshape(-1))
    return torch.where(magnitude >= take(threshold), take(above), take(below))


@torch.no_grad()
def dequantise_blocks(codes, scale, book, block: int, shape: tuple):
    if _is_dtensor(codes):
        return _dequantise_sharded(codes, scale, book, block, shape)
    values_table = _tables(book, codes.device)[3]
    n = math.prod(shape)
    flat = unpack_nibbles(codes, n) if book.nibbles else codes.reshape(-1)
    values = values_table.index_select(0, flat.reshape(-1).int())
    values = _padded(values, block).reshape(-1, block) * scale[:, None]
    return values.reshape(-1)[:n].reshape(shape)


def pack_nibbles(codes):
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    return (codes[0::2] << 4) | codes[1::2]


def unpack_nibbles(packed, n: int):
    return torch.stack([packed >> 4, packed & 15], dim=-1).reshape(-1)[:n]


def _padded(flat, block: int):
    extra = -flat.numel() % block
    return flat if extra == 0 else torch.cat([flat, flat.new_zeros(extra)])


# --- DTensors (FSDP2's parameters): each process quantises its own shard ---------------------------
# A shard of Shard(0) is a run of whole rows, so its elements are consecutive in the array's
# row-major order: where every shard starts at a multiple of the block, its local blocks are
# blocks of the whole array, and the codes and scales computed on it equal those of the unsharded
# array. The codes and scales are DTensors sharded as the parameter: codes of formats 8 and "fp8"
# have its shape; scales (and 4-bit codes, two a byte) are laid out as `_grid` says.


def _is_dtensor(x) -> bool:
    # (torch.distributed.tensor is imported by whoever made a DTensor: never import it here)
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return cls is not None and isinstance(x, cls)


def _quantise_sharded(x, book, block: int):
    split = _row_split(x)
    scale_shape = _grid(x, block, split, f"a block of {block} elements")
    codes_shape = _grid(x, 2, split, "a byte of two 4-bit codes") if book.nibbles else tuple(x.shape)
    codes, scale = quantise_blocks(x.to_local(), book, block)
    return _sharded_like(codes, x, codes_shape), _sharded_like(scale, x, scale_shape)


def _dequantise_sharded(codes, scale, book, block: int, shape: tuple):
    split = _row_split(codes)
    rows = _chunk_sizes(shape[0], split)[_coordinate(codes)]
    local_shape = (rows, *shape[1:])
    local = dequantise_blocks(codes.to_local(), scale.to_local().reshape(-1), book, block, local_shape)
    return _sharded_like(local, codes, tuple(shape))


def _row_split(x) -> int:
    """Into how many runs of rows `x`'s placements cut it: Replicate, and Shard(0) on at most one
    mesh dimension (FSDP2's and HSDP's), keep each shard a run of whole rows; others do not."""
    sharded = [d for d, p in enumerate(x.placements) if not p.is_replicate()]
    if x.dim() == 0 or len(sharded) > 1 or any(not x.placements[d].is_shard(0) for d in sharded):
        raise ValueError(
            f"quantised state of a DTensor of shape {tuple(x.shape)} needs placements that keep "
            "each shard a run of whole rows (Replicate, and Shard(0) on at most one mesh "
            f"dimension, as FSDP2's), got {tuple(x.placements)}"
        )
    return x.device_mesh.size(sharded[0]) if sharded else 1


def _coordinate(x) -> int:
    """This process's position along the mesh dimension that shards `x` (0 if none does)."""
    for d, p in enumerate(x.placements):
        if p.is_shard(0):
            return x.device_mesh.get_local_rank(d)
    return 0


def _chunk_sizes(n: int, parts: int) -> list:
    """How DTensor's Shard cuts `n` rows into `parts` (torch.chunk's sizes, empty ones last)."""
    chunk = -(-n // parts)
    return [max(0, min(n, (i + 1) * chunk) - i * chunk) for i in range(parts)]


def _grid(x, unit: int, split: int, what: str) -> tuple:
    """The global shape of an array holding one entry per `unit` consecutive elements of `x`
    (a block's scale, a byte of two 4-bit codes), sharded along its first dimension exactly as
    `x` is: 1-D, as for an unsharded array, where every shard starts at a unit's boundary and
    torch cuts the 1-D array as `x`'s shards need; else `(rows, row // unit)` where a row holds
    whole units (uneven rows: torch then cuts both alike). A unit that would straddle two shards
    is refused: its scale would need both processes' elements."""
    rows, row = int(x.shape[0]), math.prod(int(n) for n in x.shape[1:])
    count = -(-(rows * row) // unit)
    starts, fits = 0, True
    for have, want in zip(_chunk_sizes(rows, split), _chunk_sizes(count, split)):
        fits &= not (starts * row % unit and have) and -(-(have * row) // unit) == want
        starts += have
    if fits:
        return (count,)
    if row % unit == 0:
        return (rows, row // unit)
    raise ValueError(
        f"a DTensor of shape {tuple(x.shape)} sharded {tuple(x.placements)} over {split} "
        f"processes cannot keep its quantised state sharded alike: {what} would straddle two "
        f"shards. Expected shards that start at multiples of {unit} elements (choose a block "
        "that divides the elements of a row, or of each shard) or a min_size above "
        f"{rows * row} to keep this parameter's state in float32"
    )


def _sharded_like(local, x, shape: tuple):
    """`local` (this process's part, any shape) as a DTensor of global `shape`, placed as `x`."""
    from torch.distributed.tensor import DTensor

    local = local.reshape(-1, *shape[1:])
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensor.from_local(
        local, x.device_mesh, x.placements, run_check=False, shape=torch.Size(shape), stride=stride
    )


# --- rounding float32 values to bfloat16's grid (numpy_quant.bfloat16_rounded says how) ------------
# torch has no shifts of uint32: 32-bit words live in int64, products taken 16 bits at a time
# so that nothing overflows

_M32 = 0xFFFFFFFF


def _times(h, c: int):
    """`h · c mod 2^32` for int64 `h` in [0, 2^32)."""
    low = h * (c & 0xFFFF)
    high = ((h * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & _M32


def fmix32(h):
    h = h ^ (h >> 16)
    h = _times(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _times(h, 0xC2B2AE35)
    return h ^ (h >> 16)


@torch.no_grad()
def bfloat16_rounded(x, seed, step):
    x = x.detach().to(torch.float32).contiguous()
    bits = x.view(torch.int32).to(torch.int64) & _M32
    if seed is None:
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    else:
        key = fmix32(torch.tensor([(int(seed) * 0x9E3779B9 + int(step)) & _M32], dtype=torch.int64))
        h = torch.arange(x.numel(), dtype=torch.int64, device=x.device).reshape(x.shape)
        h = (_times(h, 0x9E3779B1) + key.to(x.device)) & _M32
        up = (fmix32(h) >> 16) < (bits & 0xFFFF)
        rounded = (bits & 0xFFFF0000) + (up.to(torch.int64) << 16)
    out = (rounded & _M32).to(torch.int64)
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32).view(torch.float32)
    return torch.where(torch.isnan(x), x, out)
