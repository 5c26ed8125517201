"""A GGUF file of arch `deepseek4` (DeepSeek-V4 Flash / Pro; llama.cpp's converter, DeepseekV4Model, reads
the official release: FP8 linears, FP4 experts), as gguf_model.py reads it: model_type deepseek_v4 and
the official tensor names (deepseek_v4_tensors.py).
  - sizes: block_count (minus nextn_predict_layers), embedding_length, attention.head_count,
    attention.key_length (head_dim: K and V share it), rope.dimension_count (qk_rope_head_dim),
    attention.q_lora_rank, attention.output_group_count / output_lora_rank (o_groups / o_lora_rank),
    attention.sliding_window, attention.indexer.head_count / key_length / top_k, context_length,
    vocab_size (absent, as the converter leaves it: token_embd's rows).
  - MoE on every layer: expert_count, expert_used_count, expert_shared_count,
    expert_feed_forward_length, expert_weights_scale, expert_weights_norm, expert_gating_func (4,
    sqrtsoftplus: the only routing V4 has), hash_layer_count (num_hash_layers: the first layers
    route by token id through ffn_gate_tid2eid), swiglu_clamp_exp (one value, or one per layer: they
    must agree, cpumla clamps every layer's experts alike) and swiglu_clamp_shexp (absent: the same;
    the shared expert is clamped at the same limit).
  - attention.compress_ratios, one per block: 0 a sliding-window layer, 4 CSA (overlapping windows
    and the indexer), any other ratio HCA (128 in the releases; one HCA ratio per model). Kept as
    transformers' layer_types and compress_rates.
  - mHC: hyper_connection.count / sinkhorn_iterations / epsilon (hc_mult / hc_sinkhorn_iters / hc_eps).
  - rope: rope.freq_base for the sliding-window layers (no scaling), attention.compress_rope_freq_base
    with the YaRN keys (rope.scaling.type / factor / original_context_length / yarn_beta_fast / _slow)
    for the compressed ones. cos/sin are never scaled (llama.cpp's V4 graph cancels YaRN's mscale, as
    transformers does): rope.scaling.yarn_attn_factor and yarn_log_multiplier are not read.
  - tensors: token_embd (embed), output_norm (norm), output (head), output_hc_fn / _base / _scale
    (hc_head_*); per block hc_attn_{fn,base,scale}, hc_ffn_{fn,base,scale}, attn_norm, ffn_norm,
    attn_sinks (attn.attn_sink), attn_q_a / attn_q_a_norm / attn_q_b (wq_a / q_norm / wq_b), attn_kv /
    attn_kv_a_norm (wkv / kv_norm), attn_output_a / _b (wo_a / wo_b), attn_compressor_{kv,gate,ape,norm}
    (compressor.wkv / wgate / ape / norm), indexer.attn_q_b / indexer.proj (indexer.wq_b /
    weights_proj), indexer_compressor_{kv,gate,ape,norm}, ffn_gate_inp (gate), exp_probs_b.bias
    (gate.bias, non-hash layers), ffn_gate_tid2eid (gate.tid2eid: I32 [vocab, top_k]),
    ffn_{gate,up,down}_shexp (shared_experts.w1 / w3 / w2) and the routed experts stacked as
    ffn_{gate,up,down}_exps (experts.e.w1 / w3 / w2). exp_probs_b_vl (image tokens) is not read.
  - the MTP layer: the converter leaves it out of the model's file and writes it on its own with `--mtp`
    (`mtp-` + the file's name): block_count one more, nextn_predict_layers 1, block L = the layer count
    (its decoder layer under the names above), blk.L.nextn.eh_proj (e_proj and h_proj concatenated by
    columns: [D, 2D], read as its two halves in place), nextn.enorm / hnorm / shared_head_norm (norm),
    and the layer's own HyperHead as output_hc_fn / _base / _scale; its token_embd / output /
    output_norm are the model's and not read. gguf_model.py reads that file when it lies beside the
    model's (checkpoint/gguf.py: mtp_sidecar).
  - types: the converter dequantizes the release's FP8 linears and writes them Q8_0, keeps bf16
    tensors BF16 and f32 ones F32, and repacks the FP4 experts losslessly into MXFP4 blocks (a byte
    of E8M0 scale, then 16 bytes whose low nibbles are values 0-15 and high nibbles 16-31). A block
    type the native library reads (checkpoint/tensors.py's GGUF_TYPES) is read in place; MXFP4
    experts otherwise are served as the release's FP4 (e2m1 codes two per byte, low nibble first, and
    an E8M0 `.scale` per 32 values): the same values, the bytes reordered once per expert into memory
    of their own (the routed experts then take RAM, not the file's page cache).
"""

from __future__ import annotations

import re

from cpumla.checkpoint import tensors as W
from cpumla.checkpoint.gguf import GGUFFile
from cpumla.checkpoint.gguf_meta import Metadata, common, yarn

GLOBAL = {"embed.weight": "token_embd.weight", "norm.weight": "output_norm.weight", "head.weight": "output.weight",
             "hc_head_fn": "output_hc_fn.weight", "hc_head_base": "output_hc_base.weight",
             "hc_head_scale": "output_hc_scale.weight"}
LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$")
EXPERTS = {"w1": "ffn_gate_exps.weight", "w2": "ffn_down_exps.weight", "w3": "ffn_up_exps.weight"}
PER_LAYER = {
    **{f"hc_{s}_{p}": f"hc_{s}_{p}.weight" for s in ("attn", "ffn") for p in ("fn", "base", "scale")},
    "attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "attn.attn_sink": "attn_sinks.weight", "attn.wq_a.weight": "attn_q_a.weight",
    "attn.q_norm.weight": "attn_q_a_norm.weight", "attn.wq_b.weight": "attn_q_b.weight",
    "attn.wkv.weight": "attn_kv.weight", "attn.kv_norm.weight": "attn_kv_a_norm.weight",
    "attn.wo_a.weight": "attn_output_a.weight", "attn.wo_b.weight": "attn_output_b.weight",
    **{f"attn.{c}compressor.{n}": f"{g}_{m}.weight" for c, g in (("", "attn_compressor"), ("indexer.", "indexer_compressor"))
       for n, m in (("wkv.weight", "kv"), ("wgate.weight", "gate"), ("ape", "ape"), ("norm.weight", "norm"))},
    "attn.indexer.wq_b.weight": "indexer.attn_q_b.weight", "attn.indexer.weights_proj.weight": "indexer.proj.weight",
    "ffn.gate.weight": "ffn_gate_inp.weight", "ffn.gate.bias": "exp_probs_b.bias",
    "ffn.gate.tid2eid": "ffn_gate_tid2eid.weight",
    "ffn.shared_experts.w1.weight": "ffn_gate_shexp.weight", "ffn.shared_experts.w2.weight": "ffn_down_shexp.weight",
    "ffn.shared_experts.w3.weight": "ffn_up_shexp.weight",
}


def config(m: Metadata, g: GGUFFile) -> dict:
    """deepseek4 (V4 Flash / Pro)."""
    a = "{arch}."
    cfg = common(m, g)
    n = cfg["num_hidden_layers"]
    ratios = m.get(a + "attention.compress_ratios", "ints")
    if len(ratios) < n:
        m.fail(a + "attention.compress_ratios", f"lists {len(ratios)} ratios for {n} layers")
    types, hca = [], set()
    for r in ratios[:n]:
        if r < 0:
            m.fail(a + "attention.compress_ratios", f"holds {r}; ratios are 0 (sliding window), 4 (CSA) or above")
        types.append("sliding_attention" if r == 0 else "compressed_sparse_attention" if r == 4 else
                     "heavily_compressed_attention")
        if r not in (0, 4):
            hca.add(r)
    if len(hca) > 1:
        m.fail(a + "attention.compress_ratios", f"has HCA layers at ratios {sorted(hca)}; cpumla takes one HCA ratio")
    gating = m.get(a + "expert_gating_func", "int")
    if gating != 4:
        m.fail(a + "expert_gating_func", f"is {gating}; DeepSeek-V4 routes with 4 (sqrtsoftplus)")
    limit = swiglu_limit(m, n)
    cfg.update({
        "model_type": "deepseek_v4", "head_dim": m.get(a + "attention.key_length", "int"),
        "qk_rope_head_dim": m.get(a + "rope.dimension_count", "int"),
        "q_lora_rank": m.get(a + "attention.q_lora_rank", "int"),
        "o_groups": m.get(a + "attention.output_group_count", "int"),
        "o_lora_rank": m.get(a + "attention.output_lora_rank", "int"),
        "sliding_window": m.get(a + "attention.sliding_window", "int"),
        "index_n_heads": m.get(a + "attention.indexer.head_count", "int"),
        "index_head_dim": m.get(a + "attention.indexer.key_length", "int"),
        "index_topk": m.get(a + "attention.indexer.top_k", "int"),
        "n_routed_experts": m.get(a + "expert_count", "int"),
        "num_experts_per_tok": m.get(a + "expert_used_count", "int"),
        "n_shared_experts": m.get(a + "expert_shared_count", "int"),
        "moe_intermediate_size": m.get(a + "expert_feed_forward_length", "int"),
        "routed_scaling_factor": m.get(a + "expert_weights_scale", "float"),
        "norm_topk_prob": m.get(a + "expert_weights_norm", "bool"),
        "scoring_func": "sqrtsoftplus", "swiglu_limit": limit,
        "num_hash_layers": m.get(a + "hash_layer_count", "int"),
        "layer_types": types,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": hca.pop() if hca else 128},
        "hc_mult": m.get(a + "hyper_connection.count", "int"),
        "hc_sinkhorn_iters": m.get(a + "hyper_connection.sinkhorn_iterations", "int"),
        "hc_eps": m.get(a + "hyper_connection.epsilon", "float"),
        "rope_theta": m.get(a + "rope.freq_base", "float"),
        "compress_rope_theta": m.get(a + "attention.compress_rope_freq_base", "float"),
        "rope_scaling": yarn(m), "tie_word_embeddings": False,
    })
    return cfg


def swiglu_limit(m: Metadata, n: int) -> float:
    """The experts' SwiGLU clamp: swiglu_clamp_exp, a number or one per block (alike over the layers),
    and swiglu_clamp_shexp (absent, or the same value)."""
    got = {}
    for key in ("{arch}.swiglu_clamp_exp", "{arch}.swiglu_clamp_shexp"):
        t = m.g.value(m.key(key))
        if t is None and key.endswith("shexp"):
            continue
        values = m.get(key, "floats") if t is not None and t[0].startswith("ARRAY") else [m.get(key, "float")]
        if len(set(values[:n])) != 1:
            m.fail(key, f"holds {sorted(set(values[:n]))} over the layers; cpumla clamps every layer alike"
                   if values else "is empty")
        got[key] = values[0]
    exp, shexp = got["{arch}.swiglu_clamp_exp"], got.get("{arch}.swiglu_clamp_shexp")
    if shexp is not None and shexp != exp:
        m.fail("{arch}.swiglu_clamp_shexp", f"is {shexp:g}, swiglu_clamp_exp {exp:g}; cpumla clamps routed and "
               f"shared experts alike")
    return exp


# the MTP layer's own tensors in an MTP file (llama.cpp's converter with --mtp): its block L = the layer
# count, e_proj and h_proj concatenated by columns as nextn.eh_proj [D, 2D], its HyperHead at the root
MTP = "mtp.0."
MTP_OWN = {"enorm.weight": "nextn.enorm.weight", "hnorm.weight": "nextn.hnorm.weight",
           "norm.weight": "nextn.shared_head_norm.weight"}
MTP_ROOT = {k: v for k, v in GLOBAL.items() if k.startswith("hc_head_")}     # the model file's names


def where_mtp(entries: dict, name: str, L: int):
    """where() for the MTP layer's official names (mtp.0.*) in an MTP file whose NextN block is L; e_proj
    and h_proj are the column halves ("half0", "half1") of eh_proj."""
    rest = name[len(MTP):]
    if rest in ("e_proj.weight", "h_proj.weight"):
        return ("half0" if rest[0] == "e" else "half1"), f"blk.{L}.nextn.eh_proj.weight", None
    if rest in MTP_OWN:
        return "view", f"blk.{L}.{MTP_OWN[rest]}", None
    if rest in MTP_ROOT:
        return "view", MTP_ROOT[rest], None
    return where(entries, f"layers.{L}.{rest}")


def where(entries: dict, name: str):
    """(how, GGUF tensor name, expert index or None) for an official V4 name (gguf_model.py's _where)."""
    if name in GLOBAL:
        return "view", GLOBAL[name], None
    m = LAYER.match(name)
    if not m:
        return None
    layer, rest = int(m[1]), m[2]
    e = EXPERT.match(rest)
    if e:
        stacked = f"blk.{layer}.{EXPERTS[e[2]]}"
        entry = entries.get(stacked)
        if entry is not None and entry.type == "MXFP4" and entry.type not in W.GGUF_TYPES:
            return ("fp4" if e[3] == "weight" else "fp4_scale"), stacked, int(e[1])
        return ("view", stacked, int(e[1])) if e[3] == "weight" else None
    sub = PER_LAYER.get(rest)
    return None if sub is None else ("view", f"blk.{layer}.{sub}", None)
