"""The zero-copy safetensors reader: bit-exact views, sharding, and a clear error for each bad file."""

import json
import struct
import time

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file as np_save
from safetensors.torch import save_file as torch_save

from cpumla.checkpoint.safetensors import Checkpoint, SafetensorsFile
from cpumla.errors import CpumlaError


def snapshot(directory):
    """File names, sizes and mtimes: the reader must never write into a model directory."""
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir())


def raw_file(path, header, data=b"", hlen=None):
    """Write a safetensors file by hand, so that it can be wrong in exactly one way."""
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if hlen is None else hlen) + blob + data)
    return path


@pytest.fixture
def torch_tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "w.bf16": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "w.f32": torch.randn(3, 4, 2, generator=g),
        "w.fp8": (torch.randn(4, 6, generator=g) * 3).to(torch.float8_e4m3fn),
        "w.scale": torch.tensor([[0.5, 2.0]], dtype=torch.float32),
        "tid2eid": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "empty": torch.zeros(0, 3, dtype=torch.float32),
    }


def test_torch_dtypes_round_trip_bit_exactly(tmp_path, torch_tensors):
    path = tmp_path / "model.safetensors"
    torch_save(torch_tensors, str(path))
    with SafetensorsFile(path) as f:
        assert sorted(f.keys()) == sorted(torch_tensors)
        expect = {
            "w.bf16": ("BF16", np.uint16, torch.int16), "w.f32": ("F32", np.float32, None),
            "w.fp8": ("F8_E4M3", np.uint8, torch.uint8), "w.scale": ("F32", np.float32, None),
            "tid2eid": ("I64", np.int64, None), "empty": ("F32", np.float32, None),
        }
        for name, (st_dtype, np_dtype, bits_as) in expect.items():
            t = torch_tensors[name]
            assert f.info(name) == (st_dtype, tuple(t.shape))
            view = f.tensor(name)
            assert view.dtype == np_dtype and view.shape == tuple(t.shape)
            ref = (t.view(bits_as) if bits_as else t).numpy()
            assert np.array_equal(view.view(ref.dtype), ref)
        assert f.nbytes == sum(t.numel() * t.element_size() for t in torch_tensors.values())
        # bf16 bits widen to the exact float32 values
        bf = f.tensor("w.bf16").astype(np.uint32) << 16
        assert np.array_equal(bf.view(np.float32), torch_tensors["w.bf16"].float().numpy())


def test_numpy_dtypes_round_trip(tmp_path):
    arrays = {
        "f16": np.linspace(-2, 2, 10, dtype=np.float16).reshape(2, 5),
        "f64": np.array([np.pi, -0.0, np.inf]),
        "i32": np.arange(-3, 3, dtype=np.int32),
        "u8": np.arange(250, 256, dtype=np.uint8),
        "b": np.array([True, False, True]),
        "i8": np.array([-1, 0, 7, -128], dtype=np.int8),  # V4 packed FP4: exposed as raw bytes
    }
    path = tmp_path / "x.safetensors"
    np_save(arrays, str(path), metadata={"format": "np"})
    with SafetensorsFile(path) as f:
        assert f.metadata == {"format": "np"}
        for name, a in arrays.items():
            v = f.tensor(name)
            assert v.tobytes() == a.tobytes() and v.shape == a.shape
        assert f.tensor("i8").dtype == np.uint8
        assert f.tensor("b").dtype == np.bool_


def test_views_are_read_only_views_into_the_mapping(tmp_path):
    a = np.arange(64, dtype=np.float32).reshape(8, 8)
    path = tmp_path / "v.safetensors"
    np_save({"a": a, "b": a[:2].copy()}, str(path))
    f = SafetensorsFile(path)
    v = f.tensor("a")
    assert not v.flags.writeable and not v.flags.owndata
    with pytest.raises(ValueError):
        v[0, 0] = 1.0
    base = v
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    assert isinstance(base, memoryview) and base.obj is f._mm  # the mmap itself, not a copy
    whole_file = np.frombuffer(f._mm, dtype=np.uint8)
    assert np.shares_memory(v, whole_file) and np.shares_memory(f.tensor("a"), v)
    start, end = f.span("a")
    assert end - start == a.nbytes and path.read_bytes()[start:end] == a.tobytes()
    f.close()  # views still alive: must not crash, the mapping lives on with them
    assert v[7, 7] == 63.0


def test_open_reads_only_the_header(tmp_path):
    """A 4 GiB sparse file opens instantly: nothing past the header is read or copied."""
    path = raw_file(tmp_path / "big.safetensors",
                    {"x": {"dtype": "BF16", "shape": [1 << 16, 1 << 15], "data_offsets": [0, 1 << 32]}})
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size + (1 << 32))
    start = time.perf_counter()
    with Checkpoint(tmp_path) as ck:
        assert ck.nbytes == 1 << 32 and ck.info("x") == ("BF16", (1 << 16, 1 << 15))
        assert ck.tensor("x").shape == (1 << 16, 1 << 15)
    assert time.perf_counter() - start < 1.0


def test_sharded_checkpoint_via_index(tmp_path):
    shard1 = {"model.embed_tokens.weight": np.ones((4, 2), np.float32)}
    shard2 = {"model.norm.weight": np.full(2, 3.0, np.float32), "lm_head.weight": np.zeros((4, 2), np.float32)}
    np_save(shard1, str(tmp_path / "model-00001-of-00002.safetensors"))
    np_save(shard2, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in shard1}
    weight_map |= {k: "model-00002-of-00002.safetensors" for k in shard2}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    before = snapshot(tmp_path)
    with Checkpoint(tmp_path) as ck:
        assert sorted(ck.keys()) == sorted(weight_map)
        assert ck.has("model.norm.weight") and not ck.has("nope")
        assert ck.info("lm_head.weight") == ("F32", (4, 2))
        assert np.array_equal(ck.tensor("model.norm.weight"), [3.0, 3.0])
        assert ck.file_of("lm_head.weight").name == "model-00002-of-00002.safetensors"
        assert ck.nbytes == 4 * 2 * 4 * 2 + 2 * 4
        with pytest.raises(CpumlaError, match="no tensor 'nope'"):
            ck.tensor("nope")
    assert snapshot(tmp_path) == before


def test_unindexed_directory_reads_every_safetensors_file(tmp_path):
    np_save({"a": np.zeros(3, np.float32)}, str(tmp_path / "a.safetensors"))
    np_save({"b": np.ones(2, np.int64)}, str(tmp_path / "b.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    with Checkpoint(tmp_path) as ck:
        assert sorted(ck.keys()) == ["a", "b"] and len(ck.files) == 2


def test_duplicate_tensor_across_shards(tmp_path):
    np_save({"a": np.zeros(3, np.float32)}, str(tmp_path / "a.safetensors"))
    np_save({"a": np.ones(3, np.float32)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(CpumlaError, match=r"'a' is in both a.safetensors and b.safetensors"):
        Checkpoint(tmp_path)


# ---- bad files: each is one CpumlaError naming the file, and the directory is untouched ----------

def _good_bytes(tmp_path):
    p = tmp_path / "good.safetensors"
    np_save({"x": np.arange(16, dtype=np.float32)}, str(p))
    data = p.read_bytes()
    p.unlink()
    return data


def _truncated(tmp_path):
    data = _good_bytes(tmp_path)
    return (tmp_path / "model.safetensors").write_bytes(data[:-10]) and tmp_path / "model.safetensors"


def _past_end(tmp_path):
    return raw_file(tmp_path / "model.safetensors",
                    {"x": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}, bytes(16))


def _absurd_header(tmp_path):
    return raw_file(tmp_path / "model.safetensors", b"{}", hlen=1 << 40)


def _header_past_end(tmp_path):
    return raw_file(tmp_path / "model.safetensors", b'{"x": 1}', hlen=500)


def _bad_json(tmp_path):
    return raw_file(tmp_path / "model.safetensors", b'{"x": {"dtype": "F32",', bytes(8))


def _not_object(tmp_path):
    return raw_file(tmp_path / "model.safetensors", b"[1, 2]  ")


def _size_mismatch(tmp_path):
    return raw_file(tmp_path / "model.safetensors",
                    {"x": {"dtype": "BF16", "shape": [3, 4], "data_offsets": [0, 20]}}, bytes(24))


def _unknown_dtype(tmp_path):
    return raw_file(tmp_path / "model.safetensors",
                    {"x": {"dtype": "Q4_K", "shape": [4], "data_offsets": [0, 4]}}, bytes(4))


def _overlap(tmp_path):
    return raw_file(tmp_path / "model.safetensors",
                    {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                     "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12))


def _tiny(tmp_path):
    return (tmp_path / "model.safetensors").write_bytes(b"\x02\x00") and tmp_path / "model.safetensors"


BAD = {
    "truncated": (_truncated, "truncated"),
    "offsets past the end": (_past_end, "truncated"),
    "absurd header length": (_absurd_header, "header length 1099511627776 is absurd"),
    "header past the end": (_header_past_end, "past the end of the file"),
    "bad JSON header": (_bad_json, "not valid JSON"),
    "header not an object": (_not_object, "not an object"),
    "size/shape mismatch": (_size_mismatch, r"needs 24 bytes but data_offsets span 20"),
    "unknown dtype": (_unknown_dtype, "unknown dtype 'Q4_K'"),
    "overlapping tensors": (_overlap, "overlap"),
    "too short": (_tiny, "too short"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_file_is_one_clear_error(tmp_path, case):
    make, message = BAD[case]
    path = make(tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(CpumlaError, match=message) as err:
        SafetensorsFile(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(CpumlaError, match="model.safetensors"):
        Checkpoint(tmp_path)
    assert snapshot(tmp_path) == before


def test_missing_shard_in_index(tmp_path):
    np_save({"a": np.zeros(2, np.float32)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    before = snapshot(tmp_path)
    with pytest.raises(CpumlaError, match="lists shard 'model-00002-of-00002.safetensors', which is missing"):
        Checkpoint(tmp_path)
    assert snapshot(tmp_path) == before


def test_index_names_tensor_its_shard_lacks(tmp_path):
    np_save({"a": np.zeros(2, np.float32)}, str(tmp_path / "s1.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "s1.safetensors",
                                                                                      "b": "s1.safetensors"}}))
    with pytest.raises(CpumlaError, match="tensor 'b' is in 's1.safetensors', but that shard lacks it"):
        Checkpoint(tmp_path)


def test_bad_index_json(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(CpumlaError, match="model.safetensors.index.json"):
        Checkpoint(tmp_path)


def test_pickle_only_directory_is_refused_without_unpickling(tmp_path):
    payload = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.zeros(2)}, str(payload))
    (tmp_path / "config.json").write_text("{}")
    before = snapshot(tmp_path)
    with pytest.raises(CpumlaError, match=r"only a PyTorch pickle checkpoint \(pytorch_model.bin\); "
                                          r"cpumla reads safetensors only and never unpickles") as err:
        Checkpoint(tmp_path)
    assert str(tmp_path) in str(err.value)
    assert snapshot(tmp_path) == before


def test_empty_directory_and_missing_directory(tmp_path):
    with pytest.raises(CpumlaError, match="no \\*.safetensors files"):
        Checkpoint(tmp_path)
    with pytest.raises(CpumlaError, match="not a directory"):
        Checkpoint(tmp_path / "absent")
