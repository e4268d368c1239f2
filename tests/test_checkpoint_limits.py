"""Loading a checkpoint file allocates only what was declared and checked: every `.npy` header in
the archive is checked against the metadata and the member's size before its data is allocated,
the archive's member count and directory are bounded by the state loaded into, and numbers the
state cannot take (a hyperparameter its rule refuses, a step counter out of range) are a
`CheckpointError` naming the file, with nothing loaded."""

from __future__ import annotations

import io
import json
import struct
import tracemalloc
import zipfile

import numpy as np
import pytest

import optimisers as opt
import optimisers.checkpoints.files as _checkpoint_file

META = "__optimisers__"
HUGE = 5 << 30  # elements: 20 GiB of float32


def model():
    rng = np.random.default_rng(0)
    return {"w": rng.standard_normal((16, 8)).astype(np.float32), "b": np.zeros(8, np.float32)}


def saved(tmp_path):
    m = model()
    state = opt.setup(opt.Adam(0.01), m)
    state, m = opt.update(state, m, {k: np.ones_like(v) for k, v in m.items()})
    path = tmp_path / "opt.npz"
    opt.save(path, state)
    return path, m


def members(path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {info.filename: z.read(info) for info in z.infolist()}


def rewrite(path, contents: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in contents.items():
            z.writestr(name, data)


def npy_header(descr: str, shape: tuple) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def header_length(data: bytes) -> int:
    f = io.BytesIO(data)
    np.lib.format.read_magic(f)
    np.lib.format.read_array_header_1_0(f)
    return f.tell()


def load_refused(path, m, *fragments, most=8 << 20):
    """`load` raises a CheckpointError naming the file and each fragment, allocating at most
    `most` bytes on the way, and leaves the fresh state as it was."""
    fresh = opt.setup(opt.Adam(0.01), m)
    before = [leaf.state[2] for leaf in (fresh["w"], fresh["b"])]
    tracemalloc.start()
    try:
        with pytest.raises(opt.CheckpointError) as e:
            opt.load(path, fresh)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(e.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert peak < most, peak
    assert [leaf.state[2] for leaf in (fresh["w"], fresh["b"])] == before
    return message


def test_an_npy_header_that_claims_more_than_the_member_holds_is_refused_unallocated(tmp_path):
    path, m = saved(tmp_path)
    contents = members(path)
    data = contents["w/state/0.npy"]
    real = data[header_length(data):]
    # a header claiming 20 GiB, padded to the same length, in a member of the declared size
    contents["w/state/0.npy"] = npy_header("<f4", (HUGE,)) + real
    rewrite(path, contents)
    load_refused(path, m, "w/state/0", "header declares")


def test_an_npy_header_that_disagrees_with_the_metadata_is_refused(tmp_path):
    path, m = saved(tmp_path)
    contents = members(path)
    data = contents["w/state/0.npy"]
    real = data[header_length(data):]
    contents["w/state/0.npy"] = npy_header("<f4", (8, 16)) + real  # the same bytes, transposed
    rewrite(path, contents)
    load_refused(path, m, "w/state/0", "(8, 16)", "(16, 8)")


def test_a_metadata_header_that_claims_gigabytes_is_refused_unallocated(tmp_path):
    path, m = saved(tmp_path)
    contents = members(path)
    data = contents[f"{META}.npy"]
    text = data[header_length(data):]
    contents[f"{META}.npy"] = npy_header("<U100000000", ()) + text  # 400 MB of text claimed
    rewrite(path, contents)
    load_refused(path, m, META, "header declares")


def test_an_object_array_is_refused_before_it_is_read(tmp_path):
    path, m = saved(tmp_path)
    contents = members(path)
    contents[f"{META}.npy"] = npy_header("|O", ()) + b"\x80\x04N."  # a pickle
    rewrite(path, contents)
    load_refused(path, m, META, "dtype object")


def test_a_version_one_file_is_bounded_by_its_member_sizes(tmp_path):
    """Files of v0.1 declare no arrays in their metadata: a header must still match its member."""
    path, m = saved(tmp_path)
    contents = members(path)
    data = contents[f"{META}.npy"]
    meta = json.loads(np.load(io.BytesIO(data)).item())
    meta = {k: meta[k] for k in ("format", "entries", "dtypes")}
    contents[f"{META}.npy"] = _npy(np.array(json.dumps(meta)))
    real = contents["w/state/0.npy"][header_length(contents["w/state/0.npy"]):]
    contents["w/state/0.npy"] = npy_header("<f4", (HUGE,)) + real
    rewrite(path, contents)
    load_refused(path, m, "w/state/0", "header declares")


def _npy(a) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def empty_members(n: int, claimed: int | None = None) -> bytes:
    """A zip64 archive of `n` empty stored members `0.npy`, `1.npy`, ... whose end records say
    it holds `claimed` (default `n`), laid out by hand in one buffer rather than written member by
    member through zipfile."""
    local, central = [], []
    offset = 0
    for i in range(n):
        name = f"{i}.npy".encode()
        header = struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 33, 0, 0, 0, len(name), 0) + name
        fields = (45, 20, 0, 0, 0, 33, 0, 0, 0, len(name), 0, 0, 0, 0, 0, offset)
        central.append(struct.pack("<4s6H3L5H2L", b"PK\x01\x02", *fields) + name)
        local.append(header)
        offset += len(header)
    directory = b"".join(central)
    count = n if claimed is None else claimed
    end64_at = offset + len(directory)
    end64 = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, len(directory), offset)
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, end64_at, 1)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    return b"".join(local) + directory + end64 + locator + end


def test_the_hand_made_archive_is_one_zipfile_reads():
    with zipfile.ZipFile(io.BytesIO(empty_members(70_000))) as z:  # over 65535: zip64 counts
        infos = z.infolist()
        assert len(infos) == 70_000 and infos[-1].filename == "69999.npy"
        assert z.read(infos[-1]) == b""


def test_an_archive_of_many_members_is_refused_before_its_directory_is_read(tmp_path):
    """200,000 empty members: zipfile alone would hold an object per member (about 100 MB)."""
    path, m = tmp_path / "opt.npz", model()
    path.write_bytes(empty_members(200_000))
    message = load_refused(path, m, "200000 members")
    assert "far more than a checkpoint of this state" in message


def test_a_directory_larger_than_its_member_count_says_is_refused(tmp_path):
    """The end record's count is only a claim: zipfile reads the whole directory it points at,
    so its size is bounded as well."""
    path, m = tmp_path / "opt.npz", model()
    path.write_bytes(empty_members(200_000, claimed=3))
    load_refused(path, m, "directory")


def test_a_checkpoint_of_a_larger_model_is_still_reported_entry_by_entry(tmp_path):
    """The member bound leaves room for a model that differs: its entries are listed."""
    big = {f"layer{i}": np.ones(4, np.float32) for i in range(12)}
    path = tmp_path / "big.npz"
    opt.save(path, opt.setup(opt.Adam(0.01), big))
    load_refused(path, model(), "does not match", "layer0")


# --- numbers the state cannot take ----------------------------------------------------------------


def edited(tmp_path, edit):
    """A valid file (checksum recomputed) whose metadata `edit` changed."""
    path, m = saved(tmp_path)
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays.pop(META).item())
    edit(meta["entries"])
    meta["sha256"] = _checkpoint_file._digest(meta, arrays)
    with open(path, "wb") as f:
        np.savez(f, **arrays, **{META: np.array(json.dumps(meta))})
    return path, m


@pytest.mark.parametrize(
    "rule, why",
    [
        ("Adam(eta=-1.0, beta=(0.9, 0.999), epsilon=1e-08)", "cannot be negative"),
        ("Adam(eta=0.01, beta=(0.9, 0.999), epsilon=1e999)", "finite"),
        ("Adam(eta=0.01, beta=(1.5, 0.999), epsilon=1e-08)", "beta"),
    ],
)
def test_a_hyperparameter_the_rule_refuses_is_a_checkpoint_error_naming_the_file(tmp_path, rule, why):
    with pytest.raises((ValueError, TypeError)) as direct:  # the rule's own check, for reference
        eval(f"opt.{rule}", {"opt": opt, "inf": float("inf")})  # noqa: S307 - our own literal
    path, m = edited(tmp_path, lambda e: e.update({"w/rule": rule}))
    message = load_refused(path, m, "w/rule", "hyperparameters are not valid", why)
    assert str(direct.value)[:40] in message


@pytest.mark.parametrize("count", [-1, 2**63, 2**80])
def test_a_step_counter_out_of_range_is_a_checkpoint_error_naming_the_file(tmp_path, count):
    path, m = edited(tmp_path, lambda e: e.update({"w/state/2": count}))
    load_refused(path, m, "w/state/2", str(count))


def test_the_largest_counter_loads(tmp_path):
    path, m = edited(tmp_path, lambda e: e.update({"w/state/2": 2**63 - 1}))
    loaded = opt.load(path, opt.setup(opt.Adam(0.01), m))
    assert loaded["w"].state[2] == 2**63 - 1


def safetensors_saved(tmp_path):
    m = model()
    state = opt.setup(opt.Adam(0.01), m)
    state, m = opt.update(state, m, {k: np.ones_like(v) for k, v in m.items()})
    path = tmp_path / "opt.safetensors"
    opt.save(path, state)
    return path, m


def test_a_safetensors_header_that_claims_gigabytes_is_refused_unallocated(tmp_path):
    path, m = safetensors_saved(tmp_path)
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 20 << 30) + data[8:])
    load_refused(path, m, f"header declares {20 << 30} bytes")


def test_a_safetensors_header_of_200k_tensors_is_refused_as_more_than_this_state_needs(tmp_path):
    path, m = safetensors_saved(tmp_path)
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    header.update({f"x{i}": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]} for i in range(200_000)})
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])
    load_refused(path, m, "more than a checkpoint of this state needs")
