"""Blockwise quantisation of torch tensors: the NumPy version's steps (`numpy_quant`) in torch
ops, on the tensor's device, with the format's tables copied there once."""

from __future__ import annotations

import functools
import math

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
