"""GGUF files of tiny random DeepSeek-V4 models, as llama.cpp's converter writes them (gguf_files.py writes the
other arches). DeepseekV4Model reads the official release (FP8 linears with E8M0 scales, FP4 experts, bf16
and f32 tensors) and writes: the FP8 linears dequantized as Q8_0, bf16 matrices BF16, f32 tensors and every
1-D one F32, the FP4 experts stacked and repacked as MXFP4, tid2eid I32. Here from the folder transformers
saves (its names, fp32 values), in those types (file_types "converter") or in one float type."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from support.gguf_files import write_file

V4_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "head.weight": "output.weight", "model.hc_head.hc_fn": "output_hc_fn.weight",
             "model.hc_head.hc_base": "output_hc_base.weight", "model.hc_head.hc_scale": "output_hc_scale.weight"}
V4_SUB = {"attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
          "hc_attn_fn": "hc_attn_fn.weight", "hc_attn_base": "hc_attn_base.weight", "hc_attn_scale": "hc_attn_scale.weight",
          "hc_ffn_fn": "hc_ffn_fn.weight", "hc_ffn_base": "hc_ffn_base.weight", "hc_ffn_scale": "hc_ffn_scale.weight",
          "attn.attn_sink": "attn_sinks.weight", "attn.wq_a.weight": "attn_q_a.weight",
          "attn.q_norm.weight": "attn_q_a_norm.weight", "attn.wq_b.weight": "attn_q_b.weight",
          "attn.wkv.weight": "attn_kv.weight", "attn.norm.weight": "attn_kv_a_norm.weight",
          "attn.wo_a.weight": "attn_output_a.weight", "attn.wo_b.weight": "attn_output_b.weight",
          "attn.compressor.wkv.weight": "attn_compressor_kv.weight",
          "attn.compressor.wgate.weight": "attn_compressor_gate.weight",
          "attn.compressor.ape": "attn_compressor_ape.weight", "attn.compressor.norm.weight": "attn_compressor_norm.weight",
          "attn.indexer.wq_b.weight": "indexer.attn_q_b.weight", "attn.indexer.weights_proj.weight": "indexer.proj.weight",
          "attn.indexer.compressor.wkv.weight": "indexer_compressor_kv.weight",
          "attn.indexer.compressor.wgate.weight": "indexer_compressor_gate.weight",
          "attn.indexer.compressor.ape": "indexer_compressor_ape.weight",
          "attn.indexer.compressor.norm.weight": "indexer_compressor_norm.weight",
          "ffn.gate.weight": "ffn_gate_inp.weight", "ffn.gate.bias": "exp_probs_b.bias",
          "ffn.gate.tid2eid": "ffn_gate_tid2eid.weight",
          "ffn.shared_experts.w1.weight": "ffn_gate_shexp.weight", "ffn.shared_experts.w2.weight": "ffn_down_shexp.weight",
          "ffn.shared_experts.w3.weight": "ffn_up_shexp.weight"}
V4_EXPERTS = {"w1": "ffn_gate_exps.weight", "w2": "ffn_down_exps.weight", "w3": "ffn_up_exps.weight"}
V4_F32 = ("hc_attn_fn.weight", "hc_ffn_fn.weight", "output_hc_fn.weight")            # f32 in the release
V4_FP8 = ("attn_q_a.weight", "attn_q_b.weight", "attn_kv.weight", "attn_output_a.weight", "attn_output_b.weight",
          "indexer.attn_q_b.weight", "_shexp.weight", "nextn.eh_proj.weight")          # FP8 in the release


def ratios(cfg) -> list[int]:
    """Each layer's compression ratio (0: sliding window) from a transformers V4 config."""
    return [0 if t == "sliding_attention" else cfg.compress_rates[t] for t in cfg.layer_types]


def gguf_tensors(saved: Path) -> dict[str, np.ndarray]:
    """The converter's tensors of a DeepSeek-V4 model saved by transformers (`saved`: its folder; the
    names save_pretrained writes): GGUF name -> array (float32; tid2eid int32)."""
    from safetensors.numpy import load_file

    from transformers import DeepseekV4Config

    cfg = DeepseekV4Config.from_pretrained(saved)
    sd = load_file(saved / "model.safetensors")
    out = {g: sd[hf].astype(np.float32) for hf, g in V4_GLOBAL.items()}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf, g in V4_SUB.items():
            if p + hf in sd:
                out[f"blk.{i}.{g}"] = sd[p + hf].astype(np.int32 if hf.endswith("tid2eid") else np.float32)
        for w, g in V4_EXPERTS.items():
            out[f"blk.{i}.{g}"] = np.stack([sd[f"{p}ffn.experts.{e}.{w}.weight"] for e in range(cfg.n_routed_experts)])
    return out


def converter_metadata(cfg) -> dict:
    """The metadata convert_hf_to_gguf.py (DeepseekV4Model) writes for a DeepSeek-V4 config, from a
    transformers config (its nested rope_parameters: main for the sliding layers, compress for the rest)."""
    a = "deepseek4."
    main, comp = cfg.rope_parameters["main"], cfg.rope_parameters["compress"]
    L = cfg.num_hidden_layers
    md = {
        "general.name": "tiny", a + "block_count": L, a + "context_length": cfg.max_position_embeddings,
        a + "embedding_length": cfg.hidden_size, a + "attention.head_count": cfg.num_attention_heads,
        a + "attention.head_count_kv": 1, a + "rope.freq_base": float(main["rope_theta"]),
        a + "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps), a + "expert_count": cfg.n_routed_experts,
        a + "expert_used_count": cfg.num_experts_per_tok, a + "expert_gating_func": 4,
        a + "attention.key_length": cfg.head_dim, a + "attention.value_length": cfg.head_dim,
        a + "rope.dimension_count": cfg.qk_rope_head_dim, a + "attention.q_lora_rank": cfg.q_lora_rank,
        a + "attention.sliding_window": cfg.sliding_window,
        a + "expert_feed_forward_length": cfg.moe_intermediate_size, a + "expert_shared_count": cfg.n_shared_experts,
        a + "expert_weights_scale": float(cfg.routed_scaling_factor), a + "expert_weights_norm": bool(cfg.norm_topk_prob),
        a + "swiglu_clamp_exp": [float(cfg.swiglu_limit)] * L, a + "swiglu_clamp_shexp": [float(cfg.swiglu_limit)] * L,
        a + "attention.indexer.head_count": cfg.index_n_heads, a + "attention.indexer.key_length": cfg.index_head_dim,
        a + "attention.indexer.top_k": cfg.index_topk, a + "attention.output_group_count": cfg.o_groups,
        a + "attention.output_lora_rank": cfg.o_lora_rank, a + "attention.compress_ratios": ratios(cfg),
        a + "attention.compress_rope_freq_base": float(comp["rope_theta"]), a + "hyper_connection.count": cfg.hc_mult,
        a + "hyper_connection.sinkhorn_iterations": cfg.hc_sinkhorn_iters, a + "hyper_connection.epsilon": float(cfg.hc_eps),
        a + "hash_layer_count": sum(t == "hash_moe" for t in cfg.mlp_layer_types),
        a + "embedding_length_out": cfg.hidden_size * cfg.hc_mult,
    }
    if comp.get("rope_type", comp.get("type")) == "yarn":
        md.update({a + "rope.scaling.type": "yarn", a + "rope.scaling.factor": float(comp["factor"]),
                   a + "rope.scaling.original_context_length": comp["original_max_position_embeddings"],
                   a + "rope.scaling.yarn_beta_fast": float(comp.get("beta_fast", 32)),
                   a + "rope.scaling.yarn_beta_slow": float(comp.get("beta_slow", 1))})
    return md


def file_types(tensors: dict[str, np.ndarray], qtype: str) -> dict[str, str]:
    """Each tensor's GGUF type. qtype F32 / F16 / BF16: every matrix but the f32 ones (mHC) in it;
    "converter": what the converter writes from the release (FP8 -> Q8_0, bf16 -> BF16, FP4 experts ->
    MXFP4). 1-D tensors, the mHC and compressor position biases F32; tid2eid I32."""
    out = {}
    for n, a in tensors.items():
        if a.dtype == np.int32:
            out[n] = "I32"
        elif a.ndim == 1 or n.endswith(V4_F32 + ("_ape.weight",)):
            out[n] = "F32"
        elif qtype != "converter":
            out[n] = qtype
        elif n.endswith("_exps.weight"):
            out[n] = "MXFP4"
        else:
            out[n] = "Q8_0" if n.endswith(V4_FP8) else "BF16"
    return out


def write(saved: Path, path: Path, qtype: str = "F32", metadata=None, drop=(), transform=None,
          types=None) -> dict[str, np.ndarray]:
    """Writes a DeepSeek-V4 model saved by transformers (`saved`) as a GGUF file (arch deepseek4), tensors
    typed by file_types(qtype) (types: {name: type} over those). Returns {GGUF name: the values the file holds}."""
    from transformers import DeepseekV4Config

    tensors = gguf_tensors(saved)
    return write_file(path, "deepseek4", converter_metadata(DeepseekV4Config.from_pretrained(saved)), tensors,
                      {**file_types(tensors, qtype), **(types or {})}, metadata, drop, transform)


def mtp_tensors(mtp) -> dict[str, np.ndarray]:
    """The MTP file llama.cpp's converter writes with --mtp for a V4 model's MTP layer (models.MtpV4): block
    L (the layer count) under the layers' names, blk.L.nextn.eh_proj = [e_proj | h_proj] (columns),
    nextn.enorm / hnorm / shared_head_norm, the layer's HyperHead as output_hc_*, and the model's
    token_embd / output / output_norm."""
    main, L = mtp.main, mtp.main.config.num_hidden_layers
    t = {k: v.float().numpy() for k, v in mtp.tensors().items()}
    sd = {k: v.detach().float().numpy() for k, v in main.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output.weight": sd["lm_head.weight"],
           "output_norm.weight": sd["model.norm.weight"]}
    b = f"blk.{L}."
    for name, a in t.items():
        rest = name[len("mtp.0."):]
        sub = V4_SUB.get(rest.replace("attn.kv_norm.", "attn.norm."))
        if sub is not None:
            out[b + sub] = a.astype(np.int32) if rest.endswith("tid2eid") else a
    for w, g in V4_EXPERTS.items():
        out[b + g] = np.stack([t[f"mtp.0.ffn.experts.{e}.{w}.weight"] for e in range(main.config.n_routed_experts)])
    out.update({b + "nextn.eh_proj.weight": np.concatenate([t["mtp.0.e_proj.weight"], t["mtp.0.h_proj.weight"]], 1),
                b + "nextn.enorm.weight": t["mtp.0.enorm.weight"], b + "nextn.hnorm.weight": t["mtp.0.hnorm.weight"],
                b + "nextn.shared_head_norm.weight": t["mtp.0.norm.weight"]})
    out.update({f"output_hc_{k}.weight": t[f"mtp.0.hc_head_{k}"] for k in ("fn", "base", "scale")})
    return out


def write_mtp(mtp, path: Path, qtype: str = "F32", metadata=None, drop=()) -> dict[str, np.ndarray]:
    """Writes a V4 model's MTP layer (models.MtpV4) as the converter's MTP file: mtp_tensors, the model's
    metadata with block_count one more and nextn_predict_layers 1. Returns the values the file holds."""
    cfg = mtp.main.config
    tensors = mtp_tensors(mtp)
    md = {**converter_metadata(cfg), "deepseek4.block_count": cfg.num_hidden_layers + 1,
          "deepseek4.nextn_predict_layers": 1}
    return write_file(path, "deepseek4", md, tensors, file_types(tensors, qtype), metadata, drop)


def reference(saved: Path, held: dict[str, np.ndarray], out: Path):
    """transformers' DeepSeek-V4 model of `saved` with the values a GGUF file holds (`held`, GGUF names)
    instead of its own, saved to `out` and loaded from there (fp32, eval mode)."""
    import shutil

    from safetensors.numpy import load_file, save_file
    from transformers import DeepseekV4ForCausalLM

    inverse = {g: hf for hf, g in V4_GLOBAL.items()}
    sd = load_file(saved / "model.safetensors")
    n = len({k.split(".")[2] for k in sd if k.startswith("model.layers.")})
    for i in range(n):
        inverse.update({f"blk.{i}.{g}": f"model.layers.{i}.{hf}" for hf, g in V4_SUB.items()})
    experts = {g: w for w, g in V4_EXPERTS.items()}
    for name, a in held.items():
        if name in inverse:
            sd[inverse[name]] = np.ascontiguousarray(a).astype(sd[inverse[name]].dtype)
            continue
        i, g = int(name.split(".")[1]), name.split(".", 2)[2]
        for e in range(a.shape[0]):
            sd[f"model.layers.{i}.ffn.experts.{e}.{experts[g]}.weight"] = np.ascontiguousarray(a[e], np.float32)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(saved / "config.json", out / "config.json")
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    return DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
