"""Checkpoint files against damage and hostile input: the checksum, edited headers, crafted and
deeply nested JSON, zip bombs, unknown entries, v0.1 files without a checksum, and the clean-up
of temporary files that killed saves leave. Both formats (.npz and .safetensors)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import tracemalloc
import zipfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import optimisers as opt
from _checkpoint_helpers import assert_same_snapshot, assert_states_equal, copy_model, snapshot, trained
from optimisers.core.state import leaf_paths

safetensors_numpy = pytest.importorskip("safetensors.numpy")
FORMATS = ["npz", "safetensors"]
META = "__optimisers__"


def fresh_for(model):
    return opt.setup(opt.Adam(0.01), copy_model(model))


def write(path, arrays, meta_text):
    """A file of either format holding `arrays` and the metadata text, as `save` lays it out."""
    if str(path).endswith(".safetensors"):
        path.write_bytes(safetensors_numpy.save(arrays, metadata={META: meta_text}))
    else:
        with open(path, "wb") as f:
            np.savez(f, **arrays, **{META: np.array(meta_text)})


def read_raw(path):
    """(arrays, metadata dict) of a saved file, read without our reader."""
    if str(path).endswith(".safetensors"):
        blob = path.read_bytes()
        n = int.from_bytes(blob[:8], "little")
        meta = json.loads(json.loads(blob[8 : 8 + n])["__metadata__"][META])
        return safetensors_numpy.load(blob), meta
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    return arrays, json.loads(arrays.pop(META).item())


def reference_digest(meta, arrays):
    """The checksum as docs/checkpoints.md describes it, computed here independently."""
    h = hashlib.sha256()
    body = {k: v for k, v in meta.items() if k != "sha256"}
    h.update(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(b"\0" + json.dumps([name, a.dtype.str, list(a.shape)]).encode() + b"\0")
        h.update(a.tobytes())
    return h.hexdigest()


@pytest.fixture(params=FORMATS)
def saved(request, tmp_path):
    state, model = trained()
    path = tmp_path / f"opt.{request.param}"
    opt.save(path, state)
    return path, state, model


def rejected(path, fresh, *fragments):
    before = snapshot(fresh)
    with pytest.raises(opt.CheckpointError) as e:
        opt.load(path, fresh)
    for fragment in fragments:
        assert fragment in str(e.value), (fragment, str(e.value))
    assert_same_snapshot(snapshot(fresh), before)
    return str(e.value)


# --- the checksum ----------------------------------------------------------------------------------


def test_the_file_records_its_format_and_a_checksum_of_everything(saved):
    path, state, model = saved
    arrays, meta = read_raw(path)
    assert meta["file_format"] == 2
    assert set(meta["arrays"]) == set(arrays)
    assert meta["arrays"]["embed/state/0"] == ["<f4", [6, 4]]
    assert meta["sha256"] == reference_digest(meta, arrays)
    assert_states_equal(opt.load(path, fresh_for(model)), state)


@pytest.mark.parametrize(
    "edit",
    [
        ("embed/state/2", 7),  # the step counter: 3 -> 7
        ("embed/frozen", True),
        ("embed/rule", "Adam(eta=0.5, beta=(0.9, 0.999), epsilon=1e-08)"),
    ],
)
def test_an_edited_header_is_refused(saved, edit):
    path, state, model = saved
    arrays, meta = read_raw(path)
    key, value = edit
    assert meta["entries"][key] != value
    meta["entries"][key] = value
    write(path, arrays, json.dumps(meta))
    rejected(path, fresh_for(model), "checksum does not match")


def test_an_edited_safetensors_header_is_refused_in_place(tmp_path):
    """A hand edit of the header: the step counter changed in the bytes of the file, its length
    kept, so that only the checksum can tell."""
    state, model = trained(steps=5)
    path = tmp_path / "opt.safetensors"
    opt.save(path, state)
    blob = path.read_bytes()
    needle = b'\\"embed/state/2\\": 5'
    assert blob.count(needle) == 1
    path.write_bytes(blob.replace(needle, needle[:-1] + b"7"))
    rejected(path, fresh_for(model), "checksum does not match")


def test_edited_array_bytes_are_refused(saved):
    path, state, model = saved
    arrays, meta = read_raw(path)
    arrays["embed/state/1"] = arrays["embed/state/1"].copy()
    arrays["embed/state/1"][0, 0] *= 2
    write(path, arrays, json.dumps(meta))
    rejected(path, fresh_for(model), "checksum does not match")


def test_a_v0_1_file_without_a_checksum_still_loads(saved):
    path, state, model = saved
    arrays, meta = read_raw(path)
    old = {k: meta[k] for k in ("format", "entries", "dtypes")}  # what v0.1 wrote
    write(path, arrays, json.dumps(old))
    assert_states_equal(opt.load(path, fresh_for(model)), state)
    # but a file that claims to be verified must carry its checksum
    write(path, arrays, json.dumps({**old, "file_format": 2, "arrays": meta["arrays"]}))
    rejected(path, fresh_for(model), "not one this version writes")


# --- crafted metadata ----------------------------------------------------------------------------


def resign(meta, arrays):
    if isinstance(meta, dict) and "sha256" in meta:
        meta = {**meta, "sha256": reference_digest(meta, arrays)}
    return meta


@pytest.mark.parametrize(
    "meta",
    [
        [1, 2],
        "text",
        None,
        {"format": "optimisers.state_dict.v1"},
        {"format": 5, "entries": {}, "dtypes": {}},
        {"format": "optimisers.state_dict.v1", "entries": [], "dtypes": {}},
        {"format": "optimisers.state_dict.v1", "entries": {"a": [1]}, "dtypes": {}},
        {"format": "optimisers.state_dict.v1", "entries": {"a": None}, "dtypes": {}},
        {"format": "optimisers.state_dict.v1", "entries": {}, "dtypes": {"embed/state/0": 3}},
        {"format": "optimisers.state_dict.v1", "entries": {}, "dtypes": {"embed/state/0": "float32"}},
        {"format": "optimisers.state_dict.v1", "entries": {}, "dtypes": {"zzz": "bfloat16"}},
    ],
)
def test_crafted_metadata_is_refused(saved, meta):
    path, state, model = saved
    arrays, _ = read_raw(path)
    write(path, arrays, json.dumps(meta))
    rejected(path, fresh_for(model), path.name)


def test_deeply_nested_json_is_refused(saved):
    path, state, model = saved
    arrays, meta = read_raw(path)
    write(path, arrays, "[" * 200_000 + "]" * 200_000)
    rejected(path, fresh_for(model))
    nested = '{"a":' * 100_000 + "1" + "}" * 100_000
    write(path, arrays, nested)
    rejected(path, fresh_for(model))


@pytest.mark.parametrize("rule_text", ["-" * 100_000 + "1", "not " * 20_000 + "1", "~" * 5000 + "1"])
def test_a_deeply_nested_rule_is_refused(saved, rule_text):
    path, state, model = saved
    arrays, meta = read_raw(path)
    meta["entries"]["embed/rule"] = rule_text
    write(path, arrays, json.dumps(resign(meta, arrays)))
    rejected(path, fresh_for(model), "embed/rule: cannot read the rule")


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@pytest.mark.slow
@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data(), fmt=st.sampled_from(FORMATS))
def test_crafted_json_with_a_valid_checksum_gives_checkpoint_error_or_loads(tmp_path_factory, data, fmt):
    """Values anywhere in the metadata replaced by arbitrary JSON, the checksum recomputed so
    that the structure checks are what is tested: a CheckpointError, or a correct load."""
    state, model = trained()
    path = tmp_path_factory.mktemp("crafted") / f"opt.{fmt}"
    opt.save(path, state)
    arrays, meta = read_raw(path)

    def places(node, trail):
        out = [trail]
        if isinstance(node, dict):
            for k, v in node.items():
                out += places(v, trail + (k,))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                out += places(v, trail + (i,))
        return out

    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(places(meta, ())))
        value = data.draw(json_values)
        if not where:
            meta = value
            break
        node = meta
        for k in where[:-1]:
            node = node[k]
        node[where[-1]] = value
    write(path, arrays, json.dumps(resign(meta, arrays)))
    fresh = fresh_for(model)
    try:
        loaded = opt.load(path, fresh)
    except opt.CheckpointError:
        return
    # an edit that changed nothing the loader reads (or one it may accept, such as a rule's
    # hyperparameter): the result is a well-formed state of the same model
    assert [p for p, _ in leaf_paths(loaded.tree)] == [
        p for p, _ in leaf_paths(fresh.tree)
    ]


# --- bombs and unknown entries -------------------------------------------------------------------


def test_a_zip_bomb_is_refused_before_it_is_decompressed(tmp_path):
    state, model = trained()
    path = tmp_path / "opt.npz"
    opt.save(path, state)
    big = 256 << 20  # 256 MiB of zeros: ~250 KiB compressed
    with zipfile.ZipFile(path, "a", compression=zipfile.ZIP_DEFLATED) as z:
        with z.open("embed/state/9.npy", "w", force_zip64=True) as m:
            np.lib.format.write_array_header_1_0(
                m, {"descr": "<f4", "fortran_order": False, "shape": (big // 4,)}
            )
            zeros = bytes(1 << 20)
            for _ in range(big >> 20):
                m.write(zeros)
    assert path.stat().st_size < 2 << 20
    tracemalloc.start()
    try:
        rejected(path, fresh_for(model), "far more than this state holds")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20


def test_unknown_members_are_refused_before_any_array_is_read(saved, monkeypatch):
    path, state, model = saved
    if path.suffix == ".safetensors":
        arrays, meta = read_raw(path)
        arrays["evil"] = np.zeros(3, np.float32)
        write(path, arrays, json.dumps(meta))
        rejected(path, fresh_for(model), "unknown: evil")
        return
    with zipfile.ZipFile(path, "a") as z:
        z.writestr("evil.npy", b"x")
    read = []
    import optimisers.checkpoints.files as _checkpoint_file

    original = _checkpoint_file._read_npy
    monkeypatch.setattr(
        _checkpoint_file, "_read_npy", lambda m, size, key, *a: read.append(key) or original(m, size, key, *a)
    )
    rejected(path, fresh_for(model), "unknown: evil")
    assert read == [META]  # the metadata only
    with zipfile.ZipFile(path, "a") as z:
        z.writestr("notes.txt", b"x")
    rejected(path, fresh_for(model), "notes.txt")


def test_declared_sizes_that_disagree_are_refused(saved):
    path, state, model = saved
    arrays, meta = read_raw(path)
    meta["arrays"]["embed/state/0"] = ["<f4", [600, 400]]
    write(path, arrays, json.dumps(resign(meta, arrays)))
    rejected(path, fresh_for(model))
    meta["arrays"]["embed/state/0"] = ["<f4", [60000, 40000]]  # 9.6 GB declared
    write(path, arrays, json.dumps(resign(meta, arrays)))
    rejected(path, fresh_for(model), "far more array bytes")


def test_a_safetensors_header_that_claims_too_much_is_refused(tmp_path):
    state, model = trained()
    path = tmp_path / "opt.safetensors"
    opt.save(path, state)
    blob = path.read_bytes()
    for n in (2**63, len(blob), 10**9):
        path.write_bytes(n.to_bytes(8, "little") + blob[8:])
        rejected(path, fresh_for(model))
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    header["__metadata__"]["other"] = "x"
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + blob[8 + n :])
    rejected(path, fresh_for(model), "entries this format does not have")


# --- random damage -------------------------------------------------------------------------------


@pytest.mark.slow
@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data(), fmt=st.sampled_from(FORMATS), steps=st.integers(0, 3))
def test_random_byte_flips_give_checkpoint_error_or_the_same_state(tmp_path_factory, data, fmt, steps):
    """Any damage is caught (never another exception), unless it hit bytes the reader ignores
    (a zip timestamp), and then the state loaded is exactly the one saved."""
    state, model = trained(steps=steps)
    path = tmp_path_factory.mktemp("flips") / f"opt.{fmt}"
    opt.save(path, state)
    blob = bytearray(path.read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] ^= data.draw(st.integers(1, 255))
    if data.draw(st.booleans()):
        blob = blob[: data.draw(st.integers(0, len(blob)))]
    path.write_bytes(bytes(blob))
    fresh = fresh_for(model)
    try:
        loaded = opt.load(path, fresh)
    except opt.CheckpointError:
        return
    assert_states_equal(loaded, state)


# --- temporary files -----------------------------------------------------------------------------


def test_stray_temporary_files_of_killed_saves_are_removed(tmp_path):
    state, model = trained(steps=1)
    path = tmp_path / "opt.npz"
    opt.save(path, state)
    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import optimisers as opt
        from _checkpoint_helpers import trained
        state, _ = trained(steps=2)
        os.fsync = lambda fd: os._exit(3)  # killed after writing, before the rename
        opt.save({str(path)!r}, state)
        """
    )
    for _ in range(2):
        assert subprocess.run([sys.executable, "-c", script], timeout=120).returncode == 3
    # the second killed save removed the first one's file, and left its own
    stray = [n for n in os.listdir(tmp_path) if n != "opt.npz"]
    assert len(stray) == 1 and stray[0].startswith(".opt.npz.optimisers-")
    others = [".opt.npz.abcdefgh.tmp", "notes.tmp", ".other.npz.optimisers-abcdefgh.tmp"]
    for name in others:
        (tmp_path / name).write_bytes(b"not ours")
    opt.save(path, state)
    assert sorted(os.listdir(tmp_path)) == sorted(others + ["opt.npz"])
    assert_states_equal(opt.load(path, fresh_for(model)), state)


def test_the_temporary_file_of_a_live_save_is_kept(tmp_path):
    fcntl = pytest.importorskip("fcntl")
    state, _ = trained(steps=1)
    live = tmp_path / ".opt.npz.optimisers-abcdefgh.tmp"
    with open(live, "wb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # as a save in progress holds it
        opt.save(tmp_path / "opt.npz", state)
        assert live.exists()
    opt.save(tmp_path / "opt.npz", state)
    assert not live.exists()
