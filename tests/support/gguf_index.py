"""Indexes of GGUF files as large as the released DeepSeek models: the metadata and tensor index written,
the tensor data a hole (sparse files of hundreds of GiB holding a few KB), for what reads the index alone
(`cpumla info`, the memory plan) or runs on zeros."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from support.gguf_files import add, converter_metadata


# DeepSeek-V3's widths (V3 / R1 / V3.1), for indexes of files as large as the released ones
V3_FULL = dict(model_type="deepseek_v3", num_hidden_layers=61, max_position_embeddings=163840, hidden_size=7168,
               intermediate_size=18432, num_attention_heads=128, rms_norm_eps=1e-6, n_routed_experts=256,
               num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3, vocab_size=129280,
               q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
               moe_intermediate_size=2048, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
               rope_parameters={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "rope_theta": 10000.0})


def write_v3_index(path: Path) -> dict[str, tuple[str, int]]:
    """A deepseek2 GGUF of DeepSeek-V3's shapes with the types of a Q4_K_M file (attn_k_b Q5_0, as
    llama-quantize falls back for its 128 columns; half the routed down projections Q6_K): the metadata
    and tensor index written, the data a hole (a sparse file of ~380 GiB holding a few KB; every tensor
    reads as zeros). Returns {tensor: (type, bytes)}."""
    import types

    import gguf

    T = gguf.GGMLQuantizationType
    cfg = types.SimpleNamespace(**V3_FULL)
    w = gguf.GGUFWriter(str(path), "deepseek2")
    for key, value in converter_metadata(cfg, None).items():
        if value is not None:
            add(w, key, value)
    D, H, R, P, dn, dv = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, \
        cfg.qk_nope_head_dim, cfg.v_head_dim
    E, MI, V = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.vocab_size
    written = {}

    def t(name, shape, kind):
        block, per = gguf.GGML_QUANT_SIZES[kind]
        n = math.prod(shape) // block * per
        byte_shape = shape if kind == T.F32 else tuple(shape[:-1]) + (shape[-1] // block * per,)
        w.add_tensor_info(name, byte_shape, np.dtype(np.float32 if kind == T.F32 else np.uint8), n, raw_dtype=kind)
        written[name] = (kind.name, n)

    t("token_embd.weight", (V, D), T.Q4_K)
    t("output_norm.weight", (D,), T.F32)
    t("output.weight", (V, D), T.Q6_K)
    for layer in range(cfg.num_hidden_layers):
        b = f"blk.{layer}."
        for name, shape, kind in [
                ("attn_norm", (D,), T.F32), ("ffn_norm", (D,), T.F32), ("attn_q_a", (cfg.q_lora_rank, D), T.Q4_K),
                ("attn_q_a_norm", (cfg.q_lora_rank,), T.F32), ("attn_q_b", (H * (dn + P), cfg.q_lora_rank), T.Q4_K),
                ("attn_kv_a_mqa", (R + P, D), T.Q4_K), ("attn_kv_a_norm", (R,), T.F32),
                ("attn_k_b", (H, R, dn), T.Q5_0), ("attn_v_b", (H, dv, R), T.Q4_K),
                ("attn_output", (D, H * dv), T.Q4_K)]:
            t(b + name + ".weight", shape, kind)
        if layer < cfg.first_k_dense_replace:
            I = cfg.intermediate_size
            t(b + "ffn_gate.weight", (I, D), T.Q4_K)
            t(b + "ffn_up.weight", (I, D), T.Q4_K)
            t(b + "ffn_down.weight", (D, I), T.Q6_K)
            continue
        t(b + "ffn_gate_inp.weight", (E, D), T.F32)
        t(b + "exp_probs_b.bias", (E,), T.F32)
        t(b + "ffn_gate_exps.weight", (E, MI, D), T.Q4_K)
        t(b + "ffn_up_exps.weight", (E, MI, D), T.Q4_K)
        t(b + "ffn_down_exps.weight", (E, D, MI), T.Q6_K if layer % 2 else T.Q4_K)
        t(b + "ffn_gate_shexp.weight", (MI, D), T.Q4_K)
        t(b + "ffn_up_shexp.weight", (MI, D), T.Q4_K)
        t(b + "ffn_down_shexp.weight", (D, MI), T.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    align = 32
    start = -(-os.path.getsize(path) // align) * align
    os.truncate(path, start + sum(-(-n // align) * align for _, n in written.values()))
    return written
