"""`cpumla info FILE.gguf`: the tensor types and bytes by group, from the tensor index, and whether the
model fits this machine's memory (the plan every checkpoint gets). The file is written here tensor by
tensor with types as a Q4_K_M file mixes them (Q4_K, Q6_K, Q5_0, Q4_1, Q8_0, F16, F32), and the expected
numbers are counted from what was written."""

from __future__ import annotations

import json

import numpy as np
import pytest

from support.cli import assert_one_line_error, cli_env, run_cli

gguf = pytest.importorskip("gguf")

# a tiny V3 whose matrices are whole 256-element blocks where a Q4_K_M file has K-quants
WIDE = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, vocab_size=256)

GROUP = {"attn_q": "attention", "attn_q_a": "attention", "attn_q_b": "attention", "attn_kv_a_mqa": "attention",
         "attn_kv_b": "attention", "attn_k_b": "attention", "attn_v_b": "attention", "attn_output": "attention",
         "ffn_gate_shexp": "shared experts", "ffn_up_shexp": "shared experts", "ffn_down_shexp": "shared experts",
         "ffn_gate_exps": "routed experts", "ffn_up_exps": "routed experts", "ffn_down_exps": "routed experts",
         "ffn_gate": "dense MLP", "ffn_up": "dense MLP", "ffn_down": "dense MLP"}


def expected_group(name: str) -> str:
    if name in ("token_embd.weight", "output.weight"):
        return "embedding/head"
    parts = name.split(".")
    return GROUP.get(parts[2], "norms/other") if parts[0] == "blk" else "norms/other"


def type_of(name: str, shape) -> str:
    """The type this test writes a tensor in."""
    if len(shape) == 1 or "ffn_gate_inp" in name or "exp_probs_b" in name:
        return "F32"
    if name == "token_embd.weight":
        return "Q4_K"
    if name == "output.weight" or "ffn_down_exps" in name:
        return "Q6_K"
    if "_exps" in name:
        return "Q4_K"
    if "_shexp" in name:
        return "Q5_0"
    if expected_group(name) == "dense MLP":
        return "Q4_1"
    cols = shape[-1]
    return "Q4_K" if cols % 256 == 0 else "Q8_0" if cols % 32 == 0 else "F16"


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """(path, {name: (type, bytes)}) of a deepseek2 file with mixed tensor types."""
    from support import gguf_files, models

    d = tmp_path_factory.mktemp("mixed")
    kw = {**models.BASE, **models.VARIANTS["v3"][1], **WIDE}
    model = models.build_from_kwargs("deepseek_v3", kw, d / "hf")
    path = d / "tiny-Q4_K_M.gguf"
    w = gguf.GGUFWriter(str(path), "deepseek2")
    for key, value in gguf_files.converter_metadata(model.config, model).items():
        if value is not None:
            gguf_files.add(w, key, value)
    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    written = {}
    for name, a in gguf_files.gguf_tensors(model).items():
        t = type_of(name, a.shape)
        if t == "F32":
            data = np.ascontiguousarray(a, np.float32)
        elif t == "F16":
            data = a.astype(np.float16)
        else:
            block, per = gguf.GGML_QUANT_SIZES[T[t]]
            data = rng.integers(0, 256, a.shape[:-1] + (a.shape[-1] // block * per,), dtype=np.uint8)
        w.add_tensor(name, data, raw_dtype=T[t])
        written[name] = (t, data.nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, written


def info_json(*args, **env):
    p = run_cli("info", *args, "--json", env=cli_env(**env), timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def expected_groups(written):
    out = {}
    for name, (t, n) in written.items():
        g = out.setdefault(expected_group(name), {"tensors": 0, "bytes": 0, "types": {}})
        g["tensors"] += 1
        g["bytes"] += n
        c = g["types"].setdefault(t, {"tensors": 0, "bytes": 0})
        c["tensors"] += 1
        c["bytes"] += n
    return out


def test_info_counts_tensors_and_bytes_by_group(mixed):
    path, written = mixed
    d = info_json(str(path))["gguf"]
    assert d["files"] == [str(path)]
    assert d["groups"] == expected_groups(written)
    counts = {g: v["tensors"] for g, v in d["groups"].items()}
    assert counts == {"attention": 18, "shared experts": 6, "routed experts": 6, "dense MLP": 3,
                      "embedding/head": 2, "norms/other": 17}
    # 2 MoE layers: gate and up [8, 256, 256] in Q4_K (144 bytes a 256-block), down in Q6_K (210)
    assert d["groups"]["routed experts"]["bytes"] == 2 * (2 * 8 * 256 * 144 + 8 * 256 * 210) == 2039808
    assert d["groups"]["routed experts"]["types"] == {"Q4_K": {"tensors": 4, "bytes": 1179648},
                                                      "Q6_K": {"tensors": 2, "bytes": 860160}}
    assert d["total"] == {"tensors": len(written), "bytes": sum(n for _, n in written.values())}
    assert d["total"]["bytes"] < path.stat().st_size


def test_info_table_shows_each_group(mixed):
    path, written = mixed
    p = run_cli("info", str(path), timeout=120)
    assert p.returncode == 0, p.stderr
    rows = {}
    for line in p.stdout.splitlines():
        cells = [c.strip() for c in line.split("\u2502")]
        if len(cells) == 5:
            rows[cells[0]] = cells
    exp = expected_groups(written)
    for g, v in exp.items():
        assert rows[g][1] == str(v["tensors"]) and rows[g][3] == f"{v['bytes']:,}", rows[g]
    assert rows["routed experts"][2] == "Q4_K: 4, Q6_K: 2"
    total = sum(n for _, n in written.values())
    assert rows["total"][1] == str(len(written)) and rows["total"][3] == f"{total:,}"
    assert p.stdout.startswith(f"file: {path}\n") and "tensors by group" in p.stdout and "as stored" in p.stdout


def test_info_fits_as_the_plan_says(mixed):
    """The fit is the plan's: weights as stored (a split kv_b as its attn_k_b and attn_v_b, read in place)
    plus cache and scratch against the memory available."""
    from cpumla.runtime.plan import plan

    path, _ = mixed
    d = info_json(str(path))
    assert d["weights"] == {"stored": plan(str(path)).weights["stored"]}      # the plan that opens the file
    need = d["weights"]["stored"] + d["cache"] + d["scratch"]
    assert info_json(str(path), CPUMLA_MEMORY_AVAILABLE=str(need))["fits"] == {"stored": True}
    assert info_json(str(path), CPUMLA_MEMORY_AVAILABLE=str(need - 1))["fits"] == {"stored": False}
    p = run_cli("info", str(path), env=cli_env(CPUMLA_MEMORY_AVAILABLE=str(need - 1)), timeout=120)
    assert p.returncode == 0 and "as stored it does not fit" in p.stdout


def test_info_of_a_folder_is_that_of_its_file(mixed, tmp_path):
    path, written = mixed
    (tmp_path / path.name).symlink_to(path)
    assert info_json(str(tmp_path))["gguf"]["groups"] == expected_groups(written)


def test_info_of_what_is_not_a_deepseek2_gguf(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a model\n")
    assert_one_line_error(run_cli("info", str(text)), "notes.txt", "is a file", status=2)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + b"\0" * 60)
    assert_one_line_error(run_cli("info", str(bad)), "bad.gguf", "not a readable GGUF file", status=2)
    llama = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(str(llama), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_one_line_error(run_cli("info", str(llama)), "architecture 'llama'", status=2)


def test_architecture_from_the_header(mixed, tmp_path):
    """general.architecture read from the header alone, wherever it is among the keys."""
    from cpumla.checkpoint.gguf_info import architecture

    assert architecture(mixed[0]) == "deepseek2"
    late = tmp_path / "late.gguf"
    w = gguf.GGUFWriter(str(late), "deepseek2")
    w.kv_data[0].pop("general.architecture")
    w.add_token_list(["a", "bc", "def"])
    w.add_array("test.ints", [1, 2, 3])
    w.add_float32("test.f", 1.5)
    w.add_string("general.architecture", "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert architecture(late) == "llama"
    (tmp_path / "text.gguf").write_text("hello")
    assert architecture(tmp_path / "text.gguf") is None
    assert architecture(tmp_path / "absent.gguf") is None


def test_groups_of_names():
    from cpumla.checkpoint.gguf_info import group_of

    assert [group_of(n) for n in ("blk.3.attn_kv_a_norm.weight", "blk.3.attn_kv_b.weight",
                                  "blk.3.ffn_gate_inp.weight", "blk.3.exp_probs_b.bias", "output_norm.weight",
                                  "blk.61.nextn.eh_proj.weight", "blk.0.ffn_down.weight")] == \
        ["norms/other", "attention", "norms/other", "norms/other", "norms/other", "norms/other", "dense MLP"]


def test_info_shows_the_nextn_block_as_the_mtp_layer(tmp_path):
    """A file with a NextN block (V3 with its MTP layer): every tensor of blk.L (L the main model's layer
    count), its decoder layer's included, in the "MTP layer" group, the main layers' groups without them;
    and group_of's names with and without a first NextN block."""
    from cpumla.checkpoint.gguf_info import group_of
    from support import gguf_files, models

    ref = models.build_v3_mtp(tmp_path / "hf")
    L = ref.main.config.num_hidden_layers
    path = tmp_path / "m.gguf"
    gguf_files.write(ref.main, path, "Q8_0", mtp=ref)
    tensors = gguf.GGUFReader(path).tensors
    block = [t for t in tensors if t.name.startswith(f"blk.{L}.")]
    assert len(block) > 10
    groups = info_json(str(path))["gguf"]["groups"]
    assert groups["MTP layer"] == {"tensors": len(block), "bytes": sum(int(t.n_bytes) for t in block),
                                   "types": groups["MTP layer"]["types"]}
    assert sum(v["tensors"] for v in groups.values()) == len(tensors)
    assert groups["routed experts"]["tensors"] == 3 * (L - ref.main.config.first_k_dense_replace)
    assert [group_of(n, L) for n in (f"blk.{L}.nextn.eh_proj.weight", f"blk.{L}.attn_q_a.weight",
                                     f"blk.{L - 1}.attn_q_a.weight", "output.weight")] == \
        ["MTP layer", "MTP layer", "attention", "embedding/head"]


def test_info_counts_an_mtp_file_beside_the_model(tmp_path):
    """A V3.2 model's file without its NextN block and the MTP file beside it (the converter's --no-mtp and
    --mtp): every tensor of the MTP file in the "MTP layer" group, the file named; the text says where
    the MTP layer comes from."""
    from support import gguf_files, gguf_files_mtp, models

    ref = models.build_v3_mtp(tmp_path / "hf", v32=True)
    gguf_files.write_v32(ref.main, tmp_path / "m.gguf")
    gguf_files_mtp.write_v32_mtp(ref, tmp_path / "mtp-m.gguf")
    side = gguf.GGUFReader(tmp_path / "mtp-m.gguf").tensors
    d = info_json(str(tmp_path / "m.gguf"))["gguf"]
    assert d["mtp_file"] == str(tmp_path / "mtp-m.gguf") and d["files"] == [str(tmp_path / "m.gguf")]
    assert {k: d["groups"]["MTP layer"][k] for k in ("tensors", "bytes")} == \
        {"tensors": len(side), "bytes": sum(int(t.n_bytes) for t in side)}
    assert d["total"]["tensors"] == len(gguf.GGUFReader(tmp_path / "m.gguf").tensors) + len(side)
    p = run_cli("info", str(tmp_path / "m.gguf"), env=cli_env(), timeout=120)
    assert p.returncode == 0 and f"MTP layer from: {tmp_path / 'mtp-m.gguf'}" in p.stdout, p.stderr


def test_info_of_a_v3_sized_file(tmp_path):
    """`cpumla info` on a file of DeepSeek-V3's shapes and Q4_K_M's types (~380 GiB as a sparse file: the
    index alone is read). Weights: every tensor at its bytes in the file and nothing more (the split MLA
    pairs read in place, no kv_b rebuilt); the routed experts apart; a token's reads (top 8 of 256
    experts, one embedding row); not fitting 24 GiB, the part held beside the experts read from disk."""
    from support import gguf_index

    path = tmp_path / "v3-q4_k_m.gguf"
    written = gguf_index.write_v3_index(path)
    assert path.stat().st_size > 370 << 30
    d = info_json(str(path), CPUMLA_MEMORY_AVAILABLE=str(24 << 30))
    total = sum(n for _, n in written.values())
    routed = sum(n for name, (_, n) in written.items() if "_exps." in name)
    embed = written["token_embd.weight"][1]
    assert abs(d["params"] - 671.0e9) < 0.1e9
    assert d["weights"] == {"stored": total} and d["routed"] == routed and d["fits"] == {"stored": False}
    assert d["gguf"]["total"]["bytes"] == total and d["gguf"]["groups"]["routed experts"]["bytes"] == routed
    want = total - routed - embed * (1 - 1 / 129280) + routed * 8 / 256
    assert abs(d["token_bytes"]["stored"] - want) <= 1
    s = d["streamed"]
    assert s["resident"] == total - routed + d["cache"] + d["scratch"]
    assert 0 < s["held"] < 0.1 and s["disk_bytes_per_token"] == pytest.approx((1 - s["held"]) * routed * 8 / 256)
