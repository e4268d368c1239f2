"""Checkpoint files: `save` / `load`, the entries of `state_dict` in one verified file (an `.npz`
archive or safetensors: the arrays, and the JSON entry `__optimisers__` with the rest and a digest;
the layout and the checks on reading: docs/checkpoints.md). Nothing is read or allocated before
it is checked, and the total is bounded by the state loaded into."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import tempfile
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from optimisers.checkpoints.state_dict import (
    FORMAT,
    META_KEY,
    CheckpointError,
    _is_array,
    _listing,
    _our_places,
    _state_items,
    _tree_of,
    _unheld,
    load_state_dict,
    state_dict,
)
from optimisers.core import dispatch
from optimisers.core.state import State

try:  # only to release a temporary file's lock; without it, stray files are not removed
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

FILE_FORMAT = 2
_META_V1 = {"format", "entries", "dtypes"}  # the metadata of files written by v0.1
_META_V2 = _META_V1 | {"file_format", "arrays", "sha256"}
_NPY_HEADER_MAX = 4096  # an .npy header as NumPy writes it for our arrays is ~128 bytes
_MEMBER_BYTES = 4096  # central-directory bytes per archive member: 46 and its name (a state key)
_TMP_TAG = ".optimisers-"
_STALE_TMP = r"[a-z0-9_]{8}\.tmp"  # tempfile.mkstemp's 8 random characters


# --- writing -------------------------------------------------------------------------------------


def _split(d: dict) -> tuple[dict, dict]:
    """The state dict as `({key: host array}, metadata with its digest)`."""
    arrays, entries, dtypes = {}, {}, {}  # (dtypes: the real dtype of arrays stored as bits)
    for key, value in d.items():
        if isinstance(value, (str, bool, int)) or (isinstance(value, float) and math.isfinite(value)):
            entries[key] = value
            continue
        if _is_array(value):  # the bits of a dtype NumPy lacks (bfloat16...) come with its name
            arrays[key], dtype = dispatch.backend(value).to_host_bits(value)
        else:  # a number JSON does not hold (complex, nan, inf)
            arrays[key], dtype = np.asarray(value), None
        if dtype is not None:
            dtypes[key] = dtype
    meta = {"format": FORMAT, "file_format": FILE_FORMAT, "entries": entries, "dtypes": dtypes}
    meta["arrays"] = {k: [a.dtype.str, list(a.shape)] for k, a in arrays.items()}
    meta["sha256"] = _digest(meta, arrays)
    return arrays, meta


def _digest(meta: dict, arrays: Mapping[str, np.ndarray]) -> str:
    """SHA-256 of the metadata (but its digest) and of each array's name, dtype, shape and bytes."""
    h = hashlib.sha256()
    body = {k: v for k, v in meta.items() if k != "sha256"}
    h.update(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(b"\0" + json.dumps([name, a.dtype.str, list(a.shape)]).encode() + b"\0")
        h.update(a.reshape(-1).view(np.uint8))
    return h.hexdigest()


def _remove_stale_tmp(directory: str, base: str) -> None:
    """Delete the temporary files (ours by name, and unlocked) of saves to `base` that died."""
    if fcntl is None:
        return
    pattern = re.compile(re.escape(f".{base}{_TMP_TAG}") + _STALE_TMP)
    try:
        names = [n for n in os.listdir(directory) if pattern.fullmatch(n)]
    except OSError:
        return
    for name in names:
        tmp = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.unlink(tmp)
            finally:
                os.close(fd)


def _locked_tmp(directory: str, base: str) -> tuple[int, str]:
    """A fresh temporary file beside the target, locked for as long as it is open."""
    while True:
        fd, tmp = tempfile.mkstemp(prefix=f".{base}{_TMP_TAG}", suffix=".tmp", dir=directory)
        if fcntl is None:
            return fd, tmp
        fcntl.flock(fd, fcntl.LOCK_EX)
        # another save's clean-up may have taken it between creation and lock: then start over
        with contextlib.suppress(FileNotFoundError):
            if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                return fd, tmp
        os.close(fd)


def _atomic_write(path: str, write) -> None:
    """`write(file)` to a temporary file beside `path`, flushed to disk, then renamed over `path`."""
    directory = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    try:
        mode = os.stat(path).st_mode & 0o777
    except FileNotFoundError:
        mode = 0o644
    _remove_stale_tmp(directory, base)
    fd, tmp = _locked_tmp(directory, base)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            os.chmod(tmp, mode)
            os.replace(tmp, path)  # before closing: the lock is held until the name is gone
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _safetensors(path: str, doing: str, hint: str = ""):
    """`safetensors.numpy` for a `.safetensors` path, None for any other."""
    if not path.endswith(".safetensors"):
        return None
    try:
        import safetensors.numpy
    except ImportError:
        raise ImportError(f"{doing} needs the safetensors package (pip install safetensors){hint}") from None
    return safetensors.numpy


def save(path, state) -> None:
    """Write the optimiser state (the entries of `state_dict`) to one file at `path`, atomically,
    with a SHA-256 digest that `load` checks: safetensors for a `.safetensors` path, else a NumPy
    `.npz` archive at exactly that name. Arrays are stored on the host (dtypes NumPy lacks, such as
    bfloat16, as their bits), the rest as the JSON text entry `__optimisers__`. The file is written
    beside `path`, flushed and renamed over it (temporary files of killed saves are removed).
    """
    path = os.fspath(path)
    arrays, meta = _split(state_dict(state))
    text = json.dumps(meta)
    st = _safetensors(path, "saving to a .safetensors path", "; or use a .npz path")
    if st is not None:
        blob = st.save(arrays, metadata={META_KEY: text})
        _atomic_write(path, lambda f: f.write(blob))
    else:  # (the arrays are state entries, "P/state...": none is named META_KEY)
        payload = {**arrays, META_KEY: np.array(text)}
        _atomic_write(path, lambda f: np.savez(f, **payload))


# --- reading -------------------------------------------------------------------------------------


def _budget(state) -> tuple[int, int, int]:
    """The most array bytes, metadata bytes and archive members a checkpoint of `state` can
    reasonably hold: about twice the state's, so that one of another dtype or a somewhat different
    model is reported entry by entry, not refused unread."""
    items = []
    ours, leaf_at = _our_places(_tree_of(state, "load"))
    for owner in ours.values():  # (every place, tied ones too)
        _state_items(leaf_at[owner].state, "", items)
    values = [_unheld(v) for _, v in items]  # nnx.Optimizer holds its arrays in Flax Variables
    nbytes = sum(int(getattr(v, "nbytes", 0)) for v in values if _is_array(v))
    meta_budget = 4096 * (len(items) + 16) + (1 << 20)
    return 2 * nbytes + 64 * len(items) + (1 << 20), meta_budget, 2 * len(items) + 64


def _reject(why: str):
    raise CheckpointError(why)


def _json(text) -> Any:
    """Parse JSON text; NaN and infinities are refused (`save` never writes them)."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return json.loads(text, parse_constant=lambda c: _reject(f"{c} is not a JSON value"))
    except ValueError as e:  # (CheckpointError included)
        raise CheckpointError(f"the {META_KEY!r} entry is not valid JSON ({str(e)[:200]})") from None


def _meta_of(text, budget: int, found) -> tuple[dict, dict | None]:
    """The metadata, checked (also against the names of the arrays `found` in the file), and its
    arrays `{key: (dtype, shape, bytes)}` (None for a v0.1 file)."""
    meta = _json(text)
    if not isinstance(meta, dict):
        _reject(f"the {META_KEY!r} entry is {type(meta).__name__} JSON, expected an object")
    if meta.get("format") != FORMAT:
        _reject(f"unknown checkpoint format {str(meta.get('format'))[:80]!r}; this version reads {FORMAT!r}")
    keys = set(meta)
    v2 = keys == _META_V2 and meta["file_format"] == FILE_FORMAT and type(meta["file_format"]) is int
    if keys != _META_V1 and not v2:
        _reject(
            f"the {META_KEY!r} entry is not one this version writes (its keys: "
            f"{_listing(sorted(map(str, keys)), 8)}, file_format {str(meta.get('file_format'))[:20]})"
        )
    entries, dtypes = meta["entries"], meta["dtypes"]
    if not isinstance(entries, dict) or not all(
        isinstance(v, (str, bool, int, float)) for v in entries.values()
    ):
        _reject("the metadata's 'entries' must map names to text, bools and numbers")
    if not isinstance(dtypes, dict) or not all(isinstance(v, str) for v in dtypes.values()):
        _reject("the metadata's 'dtypes' must map names to dtype names")
    declared = None
    if v2:
        arrays = meta["arrays"]
        if not isinstance(arrays, dict):
            _reject("the metadata's 'arrays' must map names to [dtype, shape]")
        declared = {name: _declared_array(name, spec) for name, spec in arrays.items()}
        if not isinstance(meta["sha256"], str):
            _reject("the metadata's 'sha256' must be text")
        bad = [k for k in entries if k in arrays] + [k for k in dtypes if k not in arrays]
        if bad:
            _reject(f"the metadata names these entries both as arrays and otherwise: {_listing(bad)}")
        if sum(d[2] for d in declared.values()) > budget:
            _reject("its metadata declares far more array bytes than this state holds")
    found = set(found)  # the arrays in the file: those declared (a v0.1 file's: state entries)
    expected = set(declared) if declared is not None else {k for k in found if "/state" in k}
    if found != expected:
        extra, missing = sorted(found - expected), sorted(expected - found)
        _reject(
            "its arrays are not those its metadata declares"
            + (f"; unknown: {_listing(extra, 5)}" if extra else "")
            + (f"; missing: {_listing(missing, 5)}" if missing else "")
        )
    return meta, declared


def _declared_array(name, spec) -> tuple[np.dtype, tuple, int]:
    """The dtype, shape and size in bytes that the metadata declares for an array."""
    dtype = None
    shape = spec[1] if isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], str) else None
    if isinstance(shape, list) and len(shape) <= 64 and all(type(n) is int and 0 <= n < 2**62 for n in shape):
        with contextlib.suppress(TypeError, ValueError):
            dtype = np.dtype(spec[0])
    if dtype is None or dtype.kind not in "biufc" or dtype.str != spec[0]:
        _reject(f"{name}: the metadata declares {str(spec)[:80]}, expected [dtype, shape] of a numeric array")
    return dtype, tuple(spec[1]), math.prod(spec[1]) * dtype.itemsize


def _check_directory(f, members: int) -> None:
    """Bound the archive's central directory (`members` members, `_MEMBER_BYTES` each) before
    `zipfile` reads it whole and makes an object per member."""
    end = zipfile._EndRecData(f)  # what ZipFile itself reads first (zip64 included)
    if end is None:
        return  # not a zip archive: ZipFile says so
    count, size = end[zipfile._ECD_ENTRIES_TOTAL], end[zipfile._ECD_SIZE]
    if count > members:
        _reject(f"the archive holds {count} members, far more than a checkpoint of this state ({members})")
    if size > members * _MEMBER_BYTES:
        _reject(f"the archive's directory takes {size} bytes, more than {members} members need")
    f.seek(0)


def _read_npy(m, size: int, key: str, want: tuple | None, kinds: str) -> np.ndarray:
    """The array in the `.npy` member `m` of `size` bytes, its header checked before its data is
    allocated: a dtype of one of `kinds`, `want` (dtype, shape) if declared, and exactly the data
    bytes that the member holds after the header."""
    try:
        version = np.lib.format.read_magic(m)
        if version not in ((1, 0), (2, 0)):
            _reject(f".npy format version {version}, which NumPy does not write for these arrays")
        read_header = getattr(np.lib.format, f"read_array_header_{version[0]}_0")  # _1_0 or _2_0
        shape, fortran, dtype = read_header(m, max_header_size=_NPY_HEADER_MAX)
    except (ValueError, CheckpointError) as e:  # (CheckpointError is a ValueError)
        _reject(f"{key}: not an .npy array of a checkpoint ({str(e)[:160]})")
    if dtype.hasobject or dtype.kind not in kinds:
        _reject(f"{key}: its .npy header declares dtype {str(dtype)[:40]}, not an array of a checkpoint")
    if want is not None and (dtype.str, tuple(shape)) != (want[0].str, want[1]):
        _reject(
            f"{key}: its .npy header declares {dtype.str} {tuple(shape)}, "
            f"the metadata {want[0].str} {want[1]}"
        )
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes != size - m.tell():
        _reject(f"{key}: its .npy header declares {nbytes} bytes of data, the member holds {size - m.tell()}")
    data = bytearray(nbytes)
    view, done = memoryview(data), 0
    while done < nbytes:  # in pieces: one read of the whole would hold it twice
        piece = m.read(min(1 << 20, nbytes - done))
        if not piece:
            _reject(f"{key}: the member ends before its data does")
        view[done : done + len(piece)] = piece
        done += len(piece)
    flat = np.frombuffer(data, dtype=dtype)
    return flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)


def _read_npz(f, budget: int, meta_budget: int, members_max: int) -> tuple[dict, dict, dict | None]:
    """The members' count, names and sizes, then the metadata, are checked before any array is read
    (each checked against its declaration before it is allocated)."""
    _check_directory(f, members_max)
    with zipfile.ZipFile(f) as z:
        infos = z.infolist()
        if len({i.filename for i in infos}) != len(infos):
            _reject("the archive holds two members of the same name")
        members = {}
        for info in infos:
            if not info.filename.endswith(".npy"):
                _reject(f"the archive holds {info.filename[:80]!r}, which is not an array of a checkpoint")
            members[info.filename[: -len(".npy")]] = info
        meta_info = members.pop(META_KEY, None)
        if meta_info is None:
            _not_ours(members)
        if (n := meta_info.file_size) > meta_budget:
            _reject(f"its metadata declares {n} bytes, more than a checkpoint of this holds")
        total = sum(i.file_size for i in members.values())
        if total > budget:
            _reject(f"its arrays declare {total} bytes, far more than this state holds")
        with z.open(meta_info) as m:
            text = _read_npy(m, meta_info.file_size, META_KEY, None, "U")
        if text.shape != ():  # (`_read_npy` read text: kind "U")
            _reject(f"its {META_KEY!r} entry is not text")
        meta, declared = _meta_of(text.item(), budget, members)
        if declared is not None:
            for key, info in members.items():
                nbytes = declared[key][2]
                if not nbytes <= info.file_size <= nbytes + _NPY_HEADER_MAX:
                    _reject(f"{key}: {info.file_size} bytes in the archive, {nbytes} declared")
        arrays = {}
        for key, info in members.items():
            want = declared[key] if declared is not None else None
            with z.open(info) as m:
                arrays[key] = _read_npy(m, info.file_size, key, want, "biufc")
    return meta, declared, arrays


def _read_safetensors(f, budget: int, meta_budget: int, members_max: int) -> tuple[dict, dict | None, dict]:
    """Check the header (sizes, names, metadata) before reading the data."""
    from safetensors.numpy import load as st_load

    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) < 8:
        _reject("the file is shorter than a safetensors header")
    n = int.from_bytes(head, "little")
    if n > size - 8:
        _reject(f"its header declares {n} bytes (the file has {size})")
    if n > meta_budget:
        _reject(
            f"its header declares {n} bytes, more than a checkpoint of this state needs "
            f"({meta_budget} at most): a checkpoint of another model?"
        )
    if size - 8 - n > budget:
        _reject(f"it holds {size - 8 - n} bytes of arrays, far more than this state holds")
    header = _json(f.read(n))
    if not isinstance(header, dict):
        _reject("its header is not a JSON object")
    if len(header) > members_max:
        _reject(f"its header lists {len(header)} entries, far more than a checkpoint of this state")
    extra = header.pop("__metadata__", None)
    if not isinstance(extra, dict) or META_KEY not in extra:
        _not_ours(header)
    if set(extra) != {META_KEY} or not isinstance(extra[META_KEY], str):
        _reject(f"its metadata holds entries this format does not have: {_listing(sorted(extra), 5)}")
    meta, declared = _meta_of(extra[META_KEY], budget, header)
    f.seek(0)
    return meta, declared, st_load(f.read())


def _not_ours(arrays):
    _reject(
        f"not an optimisers checkpoint: it has no {META_KEY!r} entry (its arrays: "
        f"{_listing(sorted(map(str, arrays)), 5) or 'none'})"
    )


def _verify(meta: dict, declared: dict | None, arrays: dict) -> None:
    """Check the arrays against the metadata, then view each array stored as bits as the ml_dtypes
    dtype named for it (bfloat16 from uint16)."""
    if declared is not None:
        for key, a in arrays.items():
            if (a.dtype, a.shape) != declared[key][:2]:
                _reject(f"{key}: {a.dtype} {a.shape} in the file, {declared[key][:2]} declared")
        if _digest(meta, arrays) != meta["sha256"]:
            _reject(
                "its checksum does not match its content: the file was damaged or edited after it was written"
            )
    for key, name in meta["dtypes"].items():
        bits = arrays.get(key)
        if bits is None:
            _reject(f"{key}: the metadata gives a dtype for an array the file does not have")
        try:
            import ml_dtypes  # NumPy's dtypes for bfloat16 & co.: a NumPy matter, like the file

            real = np.dtype(getattr(ml_dtypes, name)) if name.isidentifier() else None
        except (ImportError, AttributeError, TypeError):
            real = None
        if real is None or bits.dtype.kind != "u" or real.itemsize != bits.dtype.itemsize:
            _reject(f"{key}: the metadata says its bits hold {name[:40]!r}, which they cannot")
        arrays[key] = bits.view(real)
    clash = [k for k in meta["entries"] if k in arrays]
    if clash:
        _reject(f"these entries are both arrays and values: {_listing(clash)}")


def _read(path: str, state) -> dict:
    """The state dict stored at `path`, verified; a problem with its content is a `CheckpointError`."""
    budget, meta_budget, members_max = _budget(state)
    read = _read_npz if _safetensors(path, f"reading {path}") is None else _read_safetensors
    with open(path, "rb") as f:
        try:
            meta, declared, arrays = read(f, budget, meta_budget, members_max)
            _verify(meta, declared, arrays)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
        except RecursionError:
            raise CheckpointError(f"{path}: its metadata is nested too deeply to be a checkpoint") from None
        except Exception as e:  # zip, npy and safetensors readers each have their own errors
            raise CheckpointError(
                f"cannot read the checkpoint {path}: {type(e).__name__}: {str(e)[:200]} (a truncated "
                "or damaged file, or not a checkpoint?)"
            ) from e
    return {**arrays, **meta["entries"]}


def load(path, state, *, hyperparameters: str = "checkpoint") -> State:
    """Read a file written by `save` into `state` (a fresh `setup` of the same model); returns a new
    `State` (see `load_state_dict` for the checks and `hyperparameters`). A damaged or edited file,
    or one that declares far more data than `state` holds, raises `CheckpointError` before any
    array is read; files of version 0.1 (no checksum) load unverified."""
    path = os.fspath(path)
    d = _read(path, state)
    try:
        return load_state_dict(state, d, hyperparameters=hyperparameters)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None


__all__ = ["load", "save"]
