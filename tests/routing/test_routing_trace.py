"""RoutingTrace: validation, save/load round trip, and safe rejection of malformed files."""

import io
import json
import pickle
import zipfile

import numpy as np
import pytest
import torch

from moekit.routing import FORMAT_VERSION, RoutingTrace


def make_trace(weights=True, dtype=np.int64) -> RoutingTrace:
    rng = np.random.default_rng(0)
    ids = rng.integers(-1, 6, size=(3, 2, 8, 2)).astype(dtype)
    w = rng.random(ids.shape, dtype=np.float32) if weights else None
    return RoutingTrace(ids, num_experts=6, topk_weights=w, name="demo", metadata={"world_size": 2, "note": [1, 2]})


def valid_members(trace: RoutingTrace) -> dict:
    """The archive members save() writes, for building broken variants of them."""
    return {
        "format": np.asarray("moekit.routing_trace"),
        "version": np.asarray(FORMAT_VERSION, dtype=np.int64),
        "topk_ids": trace.topk_ids,
        "num_experts": np.asarray(trace.num_experts, dtype=np.int64),
        "topk_weights": trace.topk_weights,
        "name": np.asarray(trace.name),
        "metadata": np.asarray(json.dumps(trace.metadata)),
    }


def test_shape_helpers_and_routing_view():
    t = make_trace()
    assert (t.num_steps, t.num_layers, t.num_tokens, t.top_k) == (3, 2, 8, 2)
    assert t.num_valid_slots() == int((t.topk_ids >= 0).sum())
    ids, w = t.routing(1, 0)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert np.array_equal(ids.numpy(), t.topk_ids[1, 0])
    assert "steps=3" in repr(t)


def test_accepts_torch_tensors_and_casts_float_weights():
    ids = torch.tensor([[[[0, 1], [-1, -1]]]])
    t = RoutingTrace(ids, num_experts=2, topk_weights=torch.ones(1, 1, 2, 2, dtype=torch.float64))
    assert isinstance(t.topk_ids, np.ndarray) and t.topk_weights.dtype == np.float32


@pytest.mark.parametrize("weights", [True, False])
@pytest.mark.parametrize("dtype", [np.int64, np.int16])
def test_save_load_round_trip(tmp_path, weights, dtype):
    t = make_trace(weights, dtype)
    path = tmp_path / "trace.npz"
    t.save(path)
    u = RoutingTrace.load(path)
    assert u.topk_ids.dtype == dtype and np.array_equal(u.topk_ids, t.topk_ids)
    if weights:
        assert torch.equal(torch.from_numpy(u.topk_weights), torch.from_numpy(t.topk_weights))
    else:
        assert u.topk_weights is None
    assert (u.num_experts, u.name, u.metadata) == (t.num_experts, t.name, t.metadata)


def test_save_writes_exactly_the_given_path(tmp_path):
    path = tmp_path / "routing.trace"
    make_trace().save(path)
    assert path.exists() and not (tmp_path / "routing.trace.npz").exists()
    assert RoutingTrace.load(str(path)).num_steps == 3


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: RoutingTrace(np.zeros((2, 3, 2), np.int64), 4), "4 dims"),
        (lambda: RoutingTrace(np.full((1, 1, 2, 2), 4), 4), r"\[-1, 3\]"),
        (lambda: RoutingTrace(np.full((1, 1, 2, 2), -2), 4), r"\[-1, 3\]"),
        (lambda: RoutingTrace(np.zeros((1, 1, 2, 2), np.float32), 4), "signed integer"),
        (lambda: RoutingTrace(np.zeros((1, 1, 2, 2), np.uint8), 4), "signed integer"),
        (lambda: RoutingTrace(np.zeros((1, 1, 2, 0), np.int64), 4), "K >= 1"),
        (lambda: RoutingTrace(np.zeros((1, 1, 2, 2), np.int64), 0), "num_experts"),
        (lambda: RoutingTrace(np.zeros((1, 1, 2, 2), np.int64), 4, np.zeros((1, 1, 2, 1), np.float32)), "shape"),
        (lambda: RoutingTrace(np.zeros((1, 1, 2, 2), np.int64), 4, np.zeros((1, 1, 2, 2), np.int32)), "float32"),
        (lambda: RoutingTrace(np.zeros((1, 1, 2, 2), np.int64), 4, metadata={"x": object()}), "JSON"),
    ],
)
def test_construction_validates(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def _write_npz(path, members):
    with open(path, "wb") as f:
        np.savez(f, **{k: v for k, v in members.items() if v is not None})


def _npy_bytes(array):
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _broken(change):
    def write(path):
        members = valid_members(make_trace())
        change(members)
        _write_npz(path, members)

    return write


def _drop(key):
    return lambda m: m.pop(key)


def _set(key, value):
    return lambda m: m.__setitem__(key, value)


def _member_data_offset(data: bytes, name: str) -> int:
    """Where member ``name``'s (possibly compressed) bytes start in a zip archive."""
    info = zipfile.ZipFile(io.BytesIO(data)).getinfo(name)
    local = info.header_offset
    name_len = int.from_bytes(data[local + 26:local + 28], "little")
    extra_len = int.from_bytes(data[local + 28:local + 30], "little")
    return local + 30 + name_len + extra_len


def _corrupt_compressed_member(path):
    """A trace as save() writes it (deflated) with bytes inside the topk_ids stream flipped:
    the member no longer decompresses (zlib.error)."""
    rng = np.random.default_rng(1)
    RoutingTrace(rng.integers(-1, 6, size=(30, 2, 64, 2)), num_experts=6).save(path)
    data = bytearray(path.read_bytes())
    start = _member_data_offset(bytes(data), "topk_ids.npy")
    for i in range(8):
        data[start + 200 + i] ^= 0xFF
    path.write_bytes(bytes(data))


def _flipped_stored_byte(path):
    """An uncompressed archive with one bit of topk_ids' data flipped: every read succeeds,
    only the member's CRC tells (numpy alone would load the wrong id)."""
    _write_npz(path, valid_members(make_trace()))
    data = bytearray(path.read_bytes())
    start = _member_data_offset(bytes(data), "topk_ids.npy")
    header_len = int.from_bytes(data[start + 8:start + 10], "little")
    data[start + 10 + header_len + 3] ^= 0x01
    path.write_bytes(bytes(data))


def _member_not_npy(path):
    members = valid_members(make_trace())
    _write_npz(path, {k: v for k, v in members.items() if k != "topk_ids"})
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr("topk_ids.npy", b"this is not an array")


MALFORMED = {
    "directory": (lambda p: p.mkdir(), "is a directory"),
    "corrupt compressed member": (_corrupt_compressed_member, r"corrupt or unreadable \(zlib.error"),
    "flipped byte of a stored member": (_flipped_stored_byte, "do not match the archive's CRC"),
    "member is not an npy": (_member_not_npy, "is not a .npy array"),
    "num_experts not scalar": (_broken(_set("num_experts", np.asarray([6, 6]))), "scalar"),
    "int32 weights": (_broken(_set("topk_weights", np.zeros((3, 2, 8, 2), np.int32))), "float32"),
    "text file": (lambda p: p.write_text("not a trace"), "not a readable"),
    "empty file": (lambda p: p.write_bytes(b""), "not a readable"),
    "single npy": (lambda p: p.write_bytes(_npy_bytes(np.zeros(3))), "single .npy"),
    "pickle file": (lambda p: p.write_bytes(pickle.dumps({"topk_ids": [1, 2]})), "no zip signature"),
    "truncated zip": (lambda p: p.write_bytes(b"PK\x03\x04" + b"\x00" * 20), "not a readable"),
    "missing topk_ids": (_broken(_drop("topk_ids")), "missing key"),
    "missing version": (_broken(_drop("version")), "missing key"),
    "bad version": (_broken(_set("version", np.asarray(99, np.int64))), "version 99"),
    "version not scalar": (_broken(_set("version", np.asarray([1, 1]))), "scalar"),
    "wrong format name": (_broken(_set("format", np.asarray("something.else"))), "format"),
    "3-d ids": (_broken(_set("topk_ids", np.zeros((2, 3, 4), np.int64))), "4 dims"),
    "ids out of range": (_broken(_set("topk_ids", np.full((3, 2, 8, 2), 6, np.int64))), "range"),
    "float ids": (_broken(_set("topk_ids", np.zeros((3, 2, 8, 2), np.float64))), "signed integer"),
    "float64 weights": (_broken(_set("topk_weights", np.zeros((3, 2, 8, 2)))), "float32"),
    "weights wrong shape": (_broken(_set("topk_weights", np.zeros((3, 2, 8, 1), np.float32))), "shape"),
    "num_experts is text": (_broken(_set("num_experts", np.asarray("six"))), "num_experts"),
    "metadata not JSON": (_broken(_set("metadata", np.asarray("{oops"))), "JSON"),
    "metadata not a dict": (_broken(_set("metadata", np.asarray("[1, 2]"))), "dict"),
    "object array": (_broken(_set("topk_ids", np.array([{"a": 1}, None], dtype=object))), "object array"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_file_raises_value_error_naming_the_file(tmp_path, case):
    write, message = MALFORMED[case]
    path = tmp_path / f"{case.replace(' ', '_')}.npz"
    write(path)
    with pytest.raises(ValueError, match=message) as info:
        RoutingTrace.load(path)
    assert str(path) in str(info.value)
    assert "allow_pickle" not in str(info.value)  # never suggest loading unsafely


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        RoutingTrace.load(tmp_path / "nope.npz")
