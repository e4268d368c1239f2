"""torch's tensor objects read in bulk: where each tensor is in memory, and its `.grad` and
`requires_grad`, for thousands of tensors in one call (`readers_numba.tensor_memory` and
`autograd_fields`, compiled by numba). torch has no call that reads these of many tensors, and
reading them one by one costs about 50 ns each, which is what a step of many small tensors
costs per array.

The fields numba reads are not a public ABI: each reader is trusted only after its fields were
checked on samples against torch's own answers (`_cdata`, `untyped_storage()`,
`storage_offset()`, `.grad`, `requires_grad`), each pointer before it is followed; without
numba, on another layout, or where a check could not run, the callers read each tensor.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch
from torch import nn

from optimisers.backends import numpy_kernels
from optimisers.backends.objects import SameObjects

PLAIN_TYPES = {torch.Tensor, nn.Parameter}  # the types read here (not a DTensor, not a subclass)
_DATA_PTR = torch.Tensor.data_ptr


def addresses(xs) -> list:
    """The data pointer of each tensor, read one by one."""
    return list(map(_DATA_PTR, xs))


def memory(xs):
    """Where the plain tensors `xs` are in memory, as one comparable value."""
    return memory_marker(list(xs))()


def storages(xs) -> list | None:
    """The data pointer of each plain tensor's storage, read in one compiled call; None where
    torch's objects are not read so."""
    read = _memory_reader()
    if read is None:
        return None
    xs = list(xs)  # (a list of its own: no code of the caller's can change it while it is read)
    out = np.empty((len(xs), 2), np.int64)
    read(id(xs), out)
    return out[:, 0].tolist()


def memory_marker(xs):
    """`memory(xs)` as a function of no arguments, for a list of plain tensors that nobody else
    holds. Where numba reads torch's objects (`_memory_reader`): each one's storage data pointer
    and storage offset as bytes, read in one compiled call (an unchanged reading gives the same
    bytes object), about 2 ns a tensor against 47 ns for `data_ptr()`; else their data pointers."""
    read = _memory_reader()
    if read is None:
        return functools.partial(addresses, xs)
    out = np.zeros((len(xs), 2), np.int64)
    last = [None]

    def read_now(xs=xs):
        if read(id(xs), out) != 1 or last[0] is None:
            last[0] = out.tobytes()
        return last[0]

    return read_now


def _checked_once(check):
    """`check()`'s answer, kept after its first call that returns; a call that raises (a torch
    transform or mode that refuses what the check does with its samples) answers None, and the
    next call checks again."""
    answer = []

    def checked():
        if not answer:
            try:
                answer.append(check())
            except Exception:  # noqa: BLE001 - the caller reads each tensor instead, this time
                return None
        return answer[0]

    checked.__wrapped__ = check
    return checked


def _word(address) -> int:
    return ctypes.c_int64.from_address(address).value


def _impls_found(samples) -> bool:
    """Can numba read torch's objects, and does each tensor's PyObject hold its TensorImpl where
    `readers_numba` reads it?"""
    if numpy_kernels.list_reader() is None or torch._C.TensorBase.__basicsize__ < 24:
        return False  # (no numba, or not CPython)
    from optimisers.backends import readers_numba as at

    return all(_word(id(t) + at.TENSOR_IMPL) == t._cdata for t in samples)


@_checked_once
def _memory_reader():
    """`readers_numba.tensor_memory`, where numba compiles it and this torch's objects hold what it
    reads where it reads it: checked on samples field by field against torch's own answers, each
    pointer before it is followed; else None."""
    base = torch.zeros(4096, device="cpu")  # (not a default device that has no memory: "meta")
    param, freed = nn.Parameter(base[:5].clone()), base[:8].clone()
    freed.untyped_storage().resize_(0)  # (as FSDP frees a parameter's memory)
    channels_last = base[:120].view(2, 3, 4, 5).to(memory_format=torch.channels_last)
    samples = [base[777:], base[37:101].view(2, 2, 2, 2, 2, 2)[1], param, freed, channels_last,
               base[:0], base.half()[3:], base[9]]
    if not _impls_found(samples):
        return None
    from optimisers.backends import readers_numba as at

    expected = []
    for t in samples:
        storage = t.untyped_storage()
        if _word(t._cdata + at.IMPL_STORAGE) != storage._cdata:
            return None
        if _word(storage._cdata + at.STORAGE_DATA) != storage.data_ptr():
            return None
        if _word(t._cdata + at.IMPL_OFFSET) != t.storage_offset():
            return None
        expected.append([storage.data_ptr(), t.storage_offset()])
    out = np.zeros((len(samples), 2), np.int64)
    if at.tensor_memory(id(samples), out) != 2 or out.tolist() != expected:
        return None
    param.data = param.data.clone()
    if at.tensor_memory(id(samples), out) != 2 or out[2, 0] != param.data_ptr():
        return None
    return at.tensor_memory


def gradients_held(params, grads):
    """A bulk check for later steps, `check(ps)`: does the list `ps` hold the tensors `params`,
    each still requiring grad with the very tensor `grads[i]` as its `.grad`? One compiled pass
    over torch's autograd metadata (`_autograd_reader`) instead of reading each `.grad` and
    `requires_grad`. The check holds `grads`, so that no other tensor can take one's place in
    memory. None for anything but plain tensors, or where torch's objects are not read so."""
    read = _autograd_reader()
    if read is None or not set(map(type, params)) | set(map(type, grads)) <= PLAIN_TYPES:
        return None
    same = SameObjects(params)
    expected = np.array([[g._cdata, 1] for g in grads], np.int64).reshape(-1, 2)
    out = np.empty_like(expected)

    def check(ps):
        return same(ps) and read(id(same.xs), out) and np.array_equal(out, expected)

    check.grads = list(grads)  # (held: no other tensor can take one's place in memory)
    return check


@_checked_once
def _autograd_reader():
    """`readers_numba.autograd_fields`, where numba reads torch's objects and their autograd
    metadata holds what it reads where it reads it: checked on samples against `.grad` and
    `requires_grad`, and again after each changed; else None."""
    with torch.inference_mode(False), torch.enable_grad():
        leaf = torch.ones(3, device="cpu", requires_grad=True)
        samples = [nn.Parameter(leaf.detach().clone()), nn.Parameter(leaf.detach().clone()),
                   leaf.detach().clone(), leaf * 2, leaf]
        samples[0].grad = leaf.detach().clone()
    if not _impls_found(samples):
        return None
    from optimisers.backends import readers_numba as at

    # (the metadata pointer: null without autograd metadata; with it, where it holds the gradient)
    meta = _word(samples[0]._cdata + at.IMPL_AUTOGRAD)
    if _word(samples[2]._cdata + at.IMPL_AUTOGRAD) != 0 or meta == 0:
        return None
    if _word(meta + at.META_GRAD) != samples[0].grad._cdata:
        return None

    def agrees():
        out = np.zeros((len(samples), 2), np.int64)
        if not at.autograd_fields(id(samples), out):
            return False
        return all(
            requires == t.requires_grad and (not t.is_leaf or t.grad is None or grad == t.grad._cdata)
            for t, (grad, requires) in zip(samples, out.tolist())
        )

    before = agrees()
    samples[0].grad, samples[1].grad = samples[2], samples[0].grad
    samples[0].requires_grad_(False)
    return at.autograd_fields if before and agrees() else None
