"""GGUF files of the tiny random models, written with the gguf package's GGUFWriter the way llama.cpp's
converter (convert_hf_to_gguf.py, DeepseekV2Model) writes them: the same metadata keys and tensor names,
experts stacked, kv_b split into attn_k_b (transposed) and attn_v_b (or kept whole, as older files
have it), 1-D tensors, the router and exp_probs_b in F32, and the other matrices in the asked type
(Q8_0 blocks made by gguf.quants.quantize; a matrix whose rows are not whole blocks falls back to F16,
as the converter's does). The converter itself, when llama.cpp is here, is run by convert()."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

F32_ONLY = ("ffn_gate_inp.weight", "exp_probs_b.bias")
SUB = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
       "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_a_proj.weight": "attn_q_a.weight",
       "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight", "self_attn.q_b_proj.weight": "attn_q_b.weight",
       "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
       "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight", "self_attn.o_proj.weight": "attn_output.weight",
       "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
       "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
       "mlp.down_proj.weight": "ffn_down.weight", "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
       "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
       "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight"}


def llama_cpp() -> Path | None:
    """llama.cpp's source folder (holding convert_hf_to_gguf.py) from CPUMLA_LLAMA_CPP, or None."""
    d = os.environ.get("CPUMLA_LLAMA_CPP")
    return Path(d) if d and (Path(d) / "convert_hf_to_gguf.py").is_file() else None


def convert(model_dir: Path, out: Path, outtype: str = "f32", extra=()) -> None:
    """llama.cpp's converter on a saved model (it needs a tokenizer.json in model_dir); extra: more of its
    options (--mtp: the MTP layer alone)."""
    conv = llama_cpp() / "convert_hf_to_gguf.py"
    subprocess.run([sys.executable, str(conv), str(model_dir), "--outtype", outtype, "--outfile", str(out), *extra],
                   check=True, capture_output=True)


def gguf_tensors(model, split_kv_b: bool = True) -> dict[str, np.ndarray]:
    """The converter's tensors of a transformers DeepSeek model: GGUF name -> float32 array (numpy order)."""
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        out.update(layer_tensors(sd, cfg, i, split_kv_b))
    return out


def layer_tensors(sd: dict, cfg, i: int, split_kv_b: bool = True) -> dict[str, np.ndarray]:
    """Layer i's tensors under the converter's names (blk.i.*) from a state dict sd (numpy, the
    checkpoint's names model.layers.i.*)."""
    H, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    out = {}
    p, b = f"model.layers.{i}.", f"blk.{i}."
    for hf, g in SUB.items():
        if p + hf in sd:
            out[b + g] = sd[p + hf]
    kv = sd[p + "self_attn.kv_b_proj.weight"].reshape(H, dn + dv, -1)
    if split_kv_b:
        out[b + "attn_k_b.weight"] = np.ascontiguousarray(kv[:, :dn].transpose(0, 2, 1))
        out[b + "attn_v_b.weight"] = np.ascontiguousarray(kv[:, dn:])
    else:
        out[b + "attn_kv_b.weight"] = sd[p + "self_attn.kv_b_proj.weight"]
    for w in ("gate", "up", "down"):
        names = [f"{p}mlp.experts.{e}.{w}_proj.weight" for e in range(cfg.n_routed_experts or 0)]
        if names and names[0] in sd:
            out[f"{b}ffn_{w}_exps.weight"] = np.stack([sd[n] for n in names])
        elif p + "mlp.experts.gate_up_proj" in sd:            # transformers 5 stacks them itself
            gu = sd[p + "mlp.experts.gate_up_proj"]
            if w == "down":
                out[f"{b}ffn_down_exps.weight"] = sd[p + "mlp.experts.down_proj"]
            else:
                half = gu.shape[1] // 2
                out[f"{b}ffn_{w}_exps.weight"] = gu[:, :half] if w == "gate" else gu[:, half:]
    return out


def write(model, path: Path, qtype: str = "F32", split_kv_b: bool = True, metadata=None, drop=(),
          transform=None, mtp=None) -> dict[str, np.ndarray]:
    """Writes `model` (a transformers DeepSeek V2 / V3 model) as a GGUF file; tensors in `qtype`
    (F32, F16, BF16, Q8_0) where the converter would. metadata: {key: value or None (left out)} over the
    converter's; drop: tensors left out; transform: {name: f(array) -> the array written}; mtp: a
    models.Mtp of a V3 `model`, written as a NextN block (gguf_files_mtp.py) (block_count one more, nextn_predict_layers 1:
    llama.cpp's converter leaves V3's out, other writers keep it). Returns {GGUF name: the float32 values
    the file holds} (dequantized by the gguf package)."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "deepseek2")
    md = converter_metadata(cfg, model)
    tensors = gguf_tensors(model, split_kv_b)
    if mtp is not None:
        from support.gguf_files_mtp import nextn_tensors

        md.update({"deepseek2.block_count": cfg.num_hidden_layers + 1, "deepseek2.nextn_predict_layers": 1})
        tensors.update(nextn_tensors(mtp, split_kv_b))
    for key, value in md.items():
        override = (metadata or {}).get(key, value)
        if override is None:
            continue
        add(w, key, override)
    held = {}
    T = gguf.GGMLQuantizationType
    for name, a in tensors.items():
        if name in drop:
            continue
        a = np.ascontiguousarray((transform or {}).get(name, lambda x: x)(a), np.float32)
        kind = T[qtype] if a.ndim > 1 and not name.endswith(F32_ONLY) else T.F32
        if kind == T.Q8_0 and a.shape[-1] % 32:
            kind = T.F16
        if kind == T.F32:
            data = a
        elif kind == T.F16:
            data = a.astype(np.float16)
        else:
            data = gguf.quants.quantize(a, kind)
        w.add_tensor(name, data, raw_dtype=kind)
        held[name] = gguf.quants.dequantize(data, kind).reshape(a.shape).astype(np.float32) \
            if kind not in (T.F32, T.F16) else data.astype(np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def converter_metadata(cfg, model) -> dict:
    """The metadata convert_hf_to_gguf.py writes for a DeepSeek V2 / V3 config (llama.cpp's key names)."""
    a = "deepseek2."
    rs = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    md = {
        "general.name": "tiny", a + "block_count": cfg.num_hidden_layers,
        a + "context_length": cfg.max_position_embeddings, a + "embedding_length": cfg.hidden_size,
        a + "feed_forward_length": cfg.intermediate_size, a + "attention.head_count": cfg.num_attention_heads,
        a + "attention.head_count_kv": 1, a + "rope.freq_base": float(rs.get("rope_theta", 10000.0)),
        a + "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        a + "expert_count": cfg.n_routed_experts, a + "expert_used_count": cfg.num_experts_per_tok,
        a + "expert_group_count": cfg.n_group, a + "expert_group_used_count": cfg.topk_group,
        a + "leading_dense_block_count": cfg.first_k_dense_replace, a + "vocab_size": cfg.vocab_size,
        a + "attention.q_lora_rank": cfg.q_lora_rank, a + "attention.kv_lora_rank": cfg.kv_lora_rank,
        a + "attention.key_length": cfg.kv_lora_rank + cfg.qk_rope_head_dim,
        a + "attention.value_length": cfg.kv_lora_rank,
        a + "attention.key_length_mla": cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
        a + "attention.value_length_mla": cfg.v_head_dim,
        a + "expert_feed_forward_length": cfg.moe_intermediate_size,
        a + "expert_shared_count": cfg.n_shared_experts,
        a + "expert_weights_scale": float(cfg.routed_scaling_factor),
        a + "expert_weights_norm": True if cfg.norm_topk_prob else None,
        a + "expert_gating_func": 2 if cfg.model_type == "deepseek_v3" else 1,
        a + "rope.dimension_count": cfg.qk_rope_head_dim,
    }
    if rs.get("rope_type", rs.get("type")) == "yarn":
        md.update({a + "rope.scaling.type": "yarn", a + "rope.scaling.factor": float(rs["factor"]),
                   a + "rope.scaling.original_context_length": rs["original_max_position_embeddings"],
                   a + "rope.scaling.yarn_beta_fast": float(rs.get("beta_fast", 32)),
                   a + "rope.scaling.yarn_beta_slow": float(rs.get("beta_slow", 1))})
        if rs.get("mscale_all_dim"):
            md[a + "rope.scaling.yarn_log_multiplier"] = 0.1 * rs["mscale_all_dim"]
    return md


def add(w, key: str, value) -> None:
    """One metadata key in the type the converter gives it (counts uint32, scales float32)."""
    import gguf

    T = gguf.GGUFValueType
    if isinstance(value, bool):
        w.add_key_value(key, value, T.BOOL)
    elif isinstance(value, int):
        w.add_key_value(key, value, T.UINT32)
    elif isinstance(value, float):
        w.add_key_value(key, value, T.FLOAT32)
    elif isinstance(value, str):
        w.add_key_value(key, value, T.STRING)
    else:
        raise TypeError(f"{key}: {value!r}")


def reference(model, held: dict[str, np.ndarray]):
    """`model` with the values a GGUF file holds (`held`, from write()) loaded back into it: the
    reference of a quantized file."""
    cfg = model.config
    H, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    sd = model.state_dict()
    inverse = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
    for i in range(cfg.num_hidden_layers):
        for hf, g in SUB.items():
            inverse[f"blk.{i}.{g}"] = f"model.layers.{i}.{hf}"

    def put(name, a):
        t = sd[name]
        t.copy_(torch.from_numpy(np.ascontiguousarray(a, np.float32)).reshape(t.shape))

    with torch.no_grad():
        for name, a in held.items():
            if name in inverse:
                put(inverse[name], a)
                continue
            i = int(name.split(".")[1])
            p = f"model.layers.{i}."
            if name.endswith("attn_k_b.weight"):
                v = held[f"blk.{i}.attn_v_b.weight"]
                put(p + "self_attn.kv_b_proj.weight", np.concatenate([a.transpose(0, 2, 1), v], 1).reshape(H * (dn + dv), -1))
            elif name.endswith("attn_kv_b.weight"):
                put(p + "self_attn.kv_b_proj.weight", a)
            elif "_exps" in name:
                w = name.split(".")[2].split("_")[1]
                if p + "mlp.experts.gate_up_proj" in sd:
                    gu = sd[p + "mlp.experts.gate_up_proj"]
                    half = gu.shape[1] // 2
                    if w == "down":
                        put(p + "mlp.experts.down_proj", a)
                    else:
                        (gu[:, :half] if w == "gate" else gu[:, half:]).copy_(torch.from_numpy(a))
                else:
                    for e in range(a.shape[0]):
                        put(f"{p}mlp.experts.{e}.{w}_proj.weight", a[e])
    return model


def with_tokenizer(src: Path, dst: Path, tokenizer_dir: Path, pre: str = "deepseek-v3", metadata=None) -> None:
    """`src` (a GGUF file) written again as `dst` with the tokenizer of `tokenizer_dir` in its metadata
    (tokenizer_metadata()); metadata: {key: value or None (left out)} over those keys."""
    with_metadata(src, dst, {**tokenizer_metadata(tokenizer_dir, pre), **(metadata or {})})


def tokenizer_metadata(tokenizer_dir: Path, pre: str = "deepseek-v3") -> dict:
    """The tokenizer keys the converter's _set_vocab_gpt2 writes for a tokenizer.json / tokenizer_config.json
    folder: every id's token (added tokens as text: CONTROL when special or looking special (<｜...｜>,
    <|...|>), else USER_DEFINED; ids without a token as UNUSED [PADi]), their types, `pre`, and
    gguf.SpecialVocab's merges, special ids, add_bos / add_eos and chat_template."""
    import gguf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    vocab = tok.get_vocab()
    reverse = {i: t for t, i in vocab.items()}
    added, decoder = tok.get_added_vocab(), tok.added_tokens_decoder
    T = gguf.TokenType
    tokens, types = [], []
    for i in range(max(vocab.values()) + 1):
        t = reverse.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(T.UNUSED)
        elif t in added:
            if not decoder[i].normalized:
                t = tok.decode(tok.encode(t, add_special_tokens=False))
            looks = (t.startswith("<|") and t.endswith("|>")) or (t.startswith("<｜") and t.endswith("｜>"))
            if decoder[i].special or looks:
                types.append(T.CONTROL)
            else:
                t = t.replace("\u2581", " ")
                types.append(T.USER_DEFINED)
            tokens.append(t)
        else:
            tokens.append(t)
            types.append(T.NORMAL)
    special = gguf.SpecialVocab(tokenizer_dir, load_merges=True)
    keys = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [int(t) for t in types], "tokenizer.ggml.merges": special.merges}
    for typ, i in special.special_token_ids.items():
        keys[f"tokenizer.ggml.{'padding' if typ == 'pad' else typ}_token_id"] = i
    for typ, on in special.add_special_token.items():
        keys[f"tokenizer.ggml.add_{typ}_token"] = on
    if special.chat_template is not None:
        keys["tokenizer.chat_template"] = special.chat_template
    return keys


def with_metadata(src: Path, dst: Path, keys: dict) -> None:
    """`src` (a GGUF file) written again as `dst` with `keys` added to its metadata: {key: value or None
    (left out)}; lists of str become string arrays, lists of int INT32 arrays, scalars as add() writes them."""
    import gguf

    V = gguf.GGUFValueType
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), str(r.fields["general.architecture"].contents()))
    for k, f in r.fields.items():
        if k.startswith(("GGUF.", "general.architecture")) or k in keys:
            continue
        w.add_key_value(k, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for k, v in keys.items():
        if v is None:
            continue
        if isinstance(v, list):
            w.add_key_value(k, v, V.ARRAY, V.INT32 if v and isinstance(v[0], int) else V.STRING)
        else:
            add(w, k, v)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---- deepseek32 (DeepSeek-V3.2) ---------------------------------------------------------------------
# DeepseekV32Model: DeepseekV2Model's keys and tensors under arch deepseek32, sigmoid routing, the indexer's
# sizes and its tensors as the checkpoint has them.
INDEXER = {"self_attn.indexer.wq_b.weight": "indexer.attn_q_b.weight",
           "self_attn.indexer.wk.weight": "indexer.attn_k.weight",
           "self_attn.indexer.k_norm.weight": "indexer.k_norm.weight",
           "self_attn.indexer.k_norm.bias": "indexer.k_norm.bias",
           "self_attn.indexer.weights_proj.weight": "indexer.proj.weight"}


def converter_metadata_v32(cfg, model) -> dict:
    """The metadata convert_hf_to_gguf.py writes for a DeepSeek-V3.2 config."""
    a = "deepseek32."
    md = {a + k[len("deepseek2."):] if k.startswith("deepseek2.") else k: v
          for k, v in converter_metadata(cfg, model).items()}
    md.update({a + "expert_gating_func": 2, a + "attention.indexer.head_count": cfg.index_n_heads,
               a + "attention.indexer.key_length": cfg.index_head_dim, a + "attention.indexer.top_k": cfg.index_topk})
    return md


def gguf_tensors_v32(model, split_kv_b: bool = True) -> dict[str, np.ndarray]:
    out = gguf_tensors(model, split_kv_b)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    for i in range(model.config.num_hidden_layers):
        for hf, g in INDEXER.items():
            out[f"blk.{i}.{g}"] = sd[f"model.layers.{i}.{hf}"]
    return out


def write_v32(model, path: Path, qtype: str = "F32", split_kv_b: bool = True, metadata=None, drop=(),
              transform=None, mtp=None) -> dict[str, np.ndarray]:
    """write() for a transformers DeepSeek-V3.2 model (arch deepseek32); returns the values the file holds.
    mtp: a models.Mtp of `model`, written as the converter's NextN block (block_count one more,
    nextn_predict_layers 1)."""
    tensors = gguf_tensors_v32(model, split_kv_b)
    md = converter_metadata_v32(model.config, model)
    if mtp is not None:
        from support.gguf_files_mtp import nextn_tensors

        tensors.update(nextn_tensors(mtp, split_kv_b))
        md.update({"deepseek32.block_count": model.config.num_hidden_layers + 1, "deepseek32.nextn_predict_layers": 1})
    kinds = {n: qtype if a.ndim > 1 and not n.endswith(F32_ONLY) else "F32" for n, a in tensors.items()}
    return write_file(path, "deepseek32", md, tensors, kinds, metadata, drop, transform)


def reference_v32(model, held: dict[str, np.ndarray]):
    """reference() with the indexer's tensors too."""
    reference(model, held)
    sd = model.state_dict()
    with torch.no_grad():
        for i in range(model.config.num_hidden_layers):
            for hf, g in INDEXER.items():
                t = sd[f"model.layers.{i}.{hf}"]
                t.copy_(torch.from_numpy(np.ascontiguousarray(held[f"blk.{i}.{g}"], np.float32)).reshape(t.shape))
    return model


# ---- any arch ---------------------------------------------------------------------------------------
def write_file(path: Path, arch: str, md: dict, tensors: dict[str, np.ndarray], types: dict[str, str],
               metadata=None, drop=(), transform=None) -> dict[str, np.ndarray]:
    """A GGUF file of arch `arch`: metadata md ({key: value or None (left out)} over it: metadata), the
    tensors in their types (F32 / F16 / BF16 / Q8_0 / MXFP4 / I32; a Q8_0 or MXFP4 matrix whose rows are
    not whole blocks falls back to F16), drop: left out, transform: {name: f(array) -> the array written}.
    Returns {GGUF name: the values the file holds} (float32, dequantized by the gguf package; I32 as is)."""
    import gguf

    Q = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {**md, **(metadata or {})}.items():
        if value is not None:
            add_any(w, key, value)
    held = {}
    for name, a in tensors.items():
        if name in drop:
            continue
        a = np.ascontiguousarray((transform or {}).get(name, lambda x: x)(a))
        kind = Q[types[name]]
        if kind in (Q.Q8_0, Q.MXFP4) and a.shape[-1] % 32:
            kind = Q.F16
        if kind == Q.I32:
            data = a.astype(np.int32)
        elif kind == Q.F32:
            data = a.astype(np.float32)
        elif kind == Q.F16:
            data = a.astype(np.float16)
        else:
            data = gguf.quants.quantize(a.astype(np.float32), kind)
        w.add_tensor(name, data, raw_dtype=kind)
        held[name] = data if kind == Q.I32 else data.astype(np.float32) if kind in (Q.F32, Q.F16) else \
            gguf.quants.dequantize(data, kind).reshape(a.shape).astype(np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def add_any(w, key: str, value) -> None:
    """add(), and arrays as the converter writes them (GGUFWriter.add_array: ints INT32, floats FLOAT32)."""
    if isinstance(value, list):
        w.add_array(key, value)
    else:
        add(w, key, value)


# DeepseekV32Model.set_vocab asserts that the tokenizer reports add_bos_token true. transformers 5 drops
# tokenizer_config.json's add_bos_token when a tokenizer.json is there (the tokenizer reports False,
# whatever the file says), so no V3.2 folder converts with it: the converter is run with the tokenizer
# reporting it true, as V3.2's tokenizer_config.json has it.
BOS_DRIVER = """
import os, runpy, sys
import transformers
load = transformers.AutoTokenizer.from_pretrained
def from_pretrained(*a, **k):
    t = load(*a, **k)
    t.add_bos_token = True
    return t
transformers.AutoTokenizer.from_pretrained = from_pretrained
sys.path.insert(0, os.path.dirname(sys.argv[1]))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert_add_bos(model_dir: Path, out: Path, outtype: str = "f32") -> None:
    """convert() with the tokenizer reporting add_bos_token true (BOS_DRIVER)."""
    conv = llama_cpp() / "convert_hf_to_gguf.py"
    subprocess.run([sys.executable, "-c", BOS_DRIVER, str(conv), str(model_dir), "--outtype", outtype, "--outfile",
                    str(out)], check=True, capture_output=True)


def write_split(path: Path, out: Path, stem: str, n: int) -> list[Path]:
    """The GGUF file at `path` rewritten as a split set of n files out/stem-0000i-of-0000n.gguf, as
    llama.cpp's gguf-split writes one: the metadata in the first, the tensors spread over all, split.no
    and split.count in each."""
    import gguf

    r = gguf.GGUFReader(path)
    out.mkdir(parents=True, exist_ok=True)
    arch = r.fields["general.architecture"].contents()
    names = [out / f"{stem}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    per = -(-len(r.tensors) // n)
    for i, name in enumerate(names):
        w = gguf.GGUFWriter(str(name), arch)
        if i == 0:
            for k, f in r.fields.items():
                if not k.startswith(("GGUF.", "general.architecture")):
                    w.add_key_value(k, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
        w.add_uint16("split.no", i)
        w.add_uint16("split.count", n)
        for t in r.tensors[i * per:(i + 1) * per]:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return names


def check_q8_file(eng, ref, ids):
    """A deepseek2 / deepseek32 file with Q8_0 linears against transformers fp32 on its values (ref): max
    error under 8% of the largest logit, 1 - cos under 1e-2 per position; then a prefill of 5 tokens and
    one-token decode steps give the full forward's logits."""
    from support.models import stepwise

    assert eng.matmul_format == "q8_0"
    got = eng.forward(ids)
    assert np.abs(got - ref).max() < 0.08 * np.abs(ref).max()
    cos = (got * ref).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert (1 - cos).max() < 1e-2, 1 - cos
    eng.reset()
    dec = stepwise(eng, ids, 5)
    assert np.abs(dec - got).max() <= 1e-5 * np.abs(got).max()


def check_q8_drift(got, ref, hf_bf16):
    """A V4 file with Q8_0 linears against transformers fp32 on its values (ref) and transformers' own bf16
    forward of them (hf_bf16). Q8_0 products round the activations to 8-bit codes per block of 32
    (kernels.h), coarser than bf16's rounding, and the tiny V4 models (mHC, sinks, five layers, 44 tokens)
    amplify any rounding: transformers' bf16 forward is 3-4% off the fp32 logits (relative norm; 5-8% of
    the largest logit), where the deepseek2 fixtures stay within test_gguf.py's absolute Q8_0 bound. So
    against that forward: the logits' relative error at most twice its (1.2-1.5 times over six seeds),
    per position 1 - cos < 2e-2, the reference's top-1 at 3/4 of the positions or more."""
    err, hf = np.linalg.norm(got - ref), np.linalg.norm(hf_bf16 - ref)
    assert err <= 2 * hf, (err / np.linalg.norm(ref), hf / np.linalg.norm(ref))
    cos = (got * ref).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert (1 - cos).max() < 2e-2, 1 - cos
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.75

