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
    take = functools.partial(torch.index_select, dim=0, index=i.reshape(-1))  # (int32: the fastest gather)
    return torch.where(magnitude >= take(threshold), take(above), take(below))


@torch.no_grad()
def dequantise_blocks(codes, scale, book, block: int, shape: tuple):
    values_table = _tables(book, codes.device)[3]
    n = math.prod(shape)
    flat = unpack_nibbles(codes, n) if book.nibbles else codes.reshape(-1)
    values = _padded(values_table.index_select(0, flat.reshape(-1).int()), block).reshape(-1, block) * scale[:, None]
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
