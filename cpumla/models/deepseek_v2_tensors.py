"""The tensors a `deepseek_v2` / `deepseek_v3` checkpoint holds and what a model takes in memory, both
from the config alone: checkpoint names and [out, in] shapes per layer, the whole table with each
tensor's kind (what dummy weights and the quantizer go by), the same counted by pattern for configs too
large to list, and the bytes of weights, latent cache and scratch. deepseek_v2.py builds its layers from
these names and serves the rest as the family's interface; deepseek_v32.py extends them with the indexer.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cpumla.models.deepseek_v2 import Config

def checkpoint_name_map(cfg: Config, layer: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What layer `layer` reads from a HF-named checkpoint: {role: (tensor name, [out, in] shape)}.
    Experts are listed by mlp_names()."""
    D, H = cfg.hidden_size, cfg.num_attention_heads
    p = f"model.layers.{layer}."
    a = p + "self_attn."
    m = {
        "input_ln": (p + "input_layernorm.weight", (D,)),
        "post_ln": (p + "post_attention_layernorm.weight", (D,)),
        "kv_a": (a + "kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, D)),
        "kv_a_ln": (a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,)),
        "kv_b": (a + "kv_b_proj.weight", (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)),
        "o_proj": (a + "o_proj.weight", (D, H * cfg.v_head_dim)),
    }
    if cfg.q_lora_rank:
        m["q_a"] = (a + "q_a_proj.weight", (cfg.q_lora_rank, D))
        m["q_a_ln"] = (a + "q_a_layernorm.weight", (cfg.q_lora_rank,))
        m["q_b"] = (a + "q_b_proj.weight", (H * cfg.qk_head_dim, cfg.q_lora_rank))
    else:
        m["q"] = (a + "q_proj.weight", (H * cfg.qk_head_dim, D))
    if cfg.is_moe_layer(layer):
        m["gate"] = (p + "mlp.gate.weight", (cfg.n_routed_experts, D))
        if cfg.router_method == "noaux_tc":
            m["gate_bias"] = (p + "mlp.gate.e_score_correction_bias", (cfg.n_routed_experts,))
    return m


def split_kv_b_names(layer: int) -> tuple[str, str]:
    """W_UK and W_UV of layer `layer` where a GGUF file splits kv_b_proj (checkpoint/gguf_model.py): per
    head W_UK transposed [H * R, dn] and W_UV [H * dv, R]."""
    a = f"model.layers.{layer}.self_attn."
    return a + "k_b_proj.weight", a + "v_b_proj.weight"


def mlp_shapes(cfg: Config, layer: int) -> dict[str, tuple[int, int]]:
    """{group: (intermediate size, number of (gate, up, down) trios)} of a layer's MLPs."""
    if not cfg.is_moe_layer(layer):
        return {"dense": (cfg.intermediate_size, 1)}
    out = {"experts": (cfg.moe_intermediate_size, cfg.n_routed_experts)}
    if cfg.n_shared_experts:
        out["shared"] = (cfg.moe_intermediate_size * cfg.n_shared_experts, 1)
    return out


def mlp_names(cfg: Config, layer: int) -> dict[str, list[tuple[str, str, str]]]:
    """{"experts": [(gate, up, down) names per routed expert], "shared": [...], "dense": [...]}"""
    p = f"model.layers.{layer}.mlp."

    def trio(prefix):
        return (prefix + "gate_proj.weight", prefix + "up_proj.weight", prefix + "down_proj.weight")

    if not cfg.is_moe_layer(layer):
        return {"dense": [trio(p)]}
    out = {"experts": [trio(f"{p}experts.{e}.") for e in range(cfg.n_routed_experts)]}
    if cfg.n_shared_experts:
        out["shared"] = [trio(p + "shared_experts.")]
    return out


def has_mtp(cfg: Config) -> bool:
    """Whether the config names an MTP layer this family reads (V3 / R1 / V3.1 and V3.2:
    model.layers.{L}.*)."""
    return cfg.model_type in ("deepseek_v3", "deepseek_v32") and bool(cfg.num_nextn_predict_layers)


def mtp_names(cfg: Config) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The MTP layer's own tensors beside its decoder layer's (checkpoint_name_map of layer L): {role:
    (name, shape)}. Its copies of the embedding and the head (`embed_tokens`, `shared_head.head`) equal
    the main model's and are not read."""
    D, p = cfg.hidden_size, f"model.layers.{cfg.num_hidden_layers}."
    return {"enorm": (p + "enorm.weight", (D,)), "hnorm": (p + "hnorm.weight", (D,)),
            "eh_proj": (p + "eh_proj.weight", (D, 2 * D)), "head_norm": (p + "shared_head.norm.weight", (D,))}


def is_mtp(cfg: Config, name: str) -> bool:
    return has_mtp(cfg) and name.startswith(f"model.layers.{cfg.num_hidden_layers}.")


def tensors(cfg: Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor the model reads: name -> (shape, kind), the MTP layer's included (is_mtp: read when
    the checkpoint has them). Kinds guide dummy weights: "linear" (FP8 in an FP8 checkpoint), "plain" (a
    matrix never quantised: the router), "embed", "norm", "bias"."""
    D, V = cfg.hidden_size, cfg.vocab_size
    out = {"model.embed_tokens.weight": ((V, D), "embed"), "model.norm.weight": ((D,), "norm"),
           "lm_head.weight": ((V, D), "plain")}
    if has_mtp(cfg):
        for role, (name, shape) in mtp_names(cfg).items():
            out[name] = (shape, "linear" if role == "eh_proj" else "norm")
    for layer in range(cfg.num_hidden_layers + (1 if has_mtp(cfg) else 0)):
        for role, (name, shape) in checkpoint_name_map(cfg, layer).items():
            out[name] = (shape, role_kind(role))
        shapes = mlp_shapes(cfg, layer)
        for group, trios in mlp_names(cfg, layer).items():
            inter = shapes[group][0]
            for g, u, d in trios:
                out[g] = ((inter, D), "linear")
                out[u] = ((inter, D), "linear")
                out[d] = ((D, inter), "linear")
    return out


def role_kind(role: str) -> str:
    """The kind (as in tensors()) of a checkpoint_name_map role."""
    return "norm" if role.endswith("_ln") else "bias" if role == "gate_bias" else "plain" if role == "gate" else "linear"


def weight_groups(cfg: Config, extra=None) -> list[tuple[str, tuple[int, ...], str, int]]:
    """[(one tensor's name, its shape, kind, how many tensors share name pattern, shape and kind)] over
    the whole model, counted without walking layers or experts (runtime/plan.py sizes a model with it
    before loading; a config may claim millions of either). extra(layer): more (role, (name, shape), kind)."""
    D, V = cfg.hidden_size, cfg.vocab_size
    out = [("model.embed_tokens.weight", (V, D), "embed", 1), ("model.norm.weight", (D,), "norm", 1),
           ("lm_head.weight", (V, D), "plain", 1)]
    out += [(name, shape, kind, 1) for name, shape, kind in _mtp_own(cfg)]
    for layer, count in _layer_groups(cfg):
        out += [(name, shape, role_kind(role), count) for role, (name, shape) in checkpoint_name_map(cfg, layer).items()]
        out += [(name, shape, kind, count) for _, (name, shape), kind in (extra(layer) if extra else [])]
        p = f"model.layers.{layer}.mlp."
        for group, (inter, n) in mlp_shapes(cfg, layer).items():
            prefix = p + {"experts": "experts.0.", "shared": "shared_experts.", "dense": ""}[group]
            out += [(prefix + "gate_proj.weight", (inter, D), "linear", 2 * n * count),
                    (prefix + "down_proj.weight", (D, inter), "linear", n * count)]
    return out


def _mtp_own(cfg: Config) -> list[tuple[str, tuple[int, ...], str]]:
    """The MTP layer's tensors besides its decoder layer's (none without one)."""
    if not has_mtp(cfg):
        return []
    return [(name, shape, "linear" if role == "eh_proj" else "norm") for role, (name, shape) in mtp_names(cfg).items()]


def _layer_groups(cfg: Config) -> list[tuple[int, int]]:
    """cfg.layer_groups(), plus the MTP layer's decoder layer (its index, counted once)."""
    return cfg.layer_groups() + ([(cfg.num_hidden_layers, 1)] if has_mtp(cfg) else [])


def cached_layers(cfg: Config) -> int:
    """Layers with a latent cache: every decoder layer, the MTP layer's included."""
    return cfg.num_hidden_layers + (1 if has_mtp(cfg) else 0)


def layer_shapes(cfg: Config, layer: int) -> list[tuple[tuple[int, ...], str, int]]:
    """[(shape, kind, count)] of the tensors of layer `layer` (kinds as in tensors()), experts counted
    rather than listed."""
    out = []
    for role, (_, shape) in checkpoint_name_map(cfg, layer).items():
        out.append((shape, role_kind(role), 1))
    D = cfg.hidden_size
    for inter, count in mlp_shapes(cfg, layer).values():
        out += [((inter, D), "linear", 2 * count), ((D, inter), "linear", count)]
    return out


def tensor_bytes(shape, kind: str, dtype: str, block=(128, 128)) -> int:
    """Bytes of one tensor as dummy weights of `dtype` (bf16, fp8, f32) store it (weights.DummySource):
    biases f32; FP8 linears one byte per value plus an f32 scale per block; the rest bf16 or f32."""
    n = math.prod(shape)
    if kind == "bias" or dtype == "f32":
        return 4 * n
    if dtype == "fp8" and kind == "linear":
        return n + 4 * -(-shape[0] // block[0]) * -(-shape[1] // block[1])
    return 2 * n


def memory_bytes(cfg: Config, ctx: int, dtype: str, chunk: int = 512, shapes=layer_shapes) -> dict[str, int]:
    """What a model of this config takes, from the config alone (nothing is built): "weights" as dummy
    weights of `dtype` store them (a checkpoint's are its files, mapped), "cache" (the latent cache of
    ctx tokens per layer, fp32) and "scratch" (the state's buffers for a prefill chunk, the kernels'
    attention and expert scratch and one chunk of logits; approximate from above)."""
    D, V = cfg.hidden_size, cfg.vocab_size
    H, R, P = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    weights = tensor_bytes((V, D), "embed", dtype) + tensor_bytes((D,), "norm", dtype) + \
        tensor_bytes((V, D), "plain", dtype, cfg.block)
    weights += sum(tensor_bytes(shape, kind, dtype, cfg.block) for _, shape, kind in _mtp_own(cfg))
    for layer, count in _layer_groups(cfg):
        weights += count * sum(n * tensor_bytes(shape, kind, dtype, cfg.block) for shape, kind, n in shapes(cfg, layer))
    n = min(chunk, ctx)
    E, K = (cfg.n_routed_experts or 0), (cfg.num_experts_per_tok or 0) + 1
    inter = max(cfg.intermediate_size, cfg.moe_intermediate_size * max(1, cfg.n_shared_experts or 1))
    state = n * (3 * D + (cfg.q_lora_rank or 0) + H * cfg.qk_head_dim + (R + P) * (H + 1) + H * R
                 + H * cfg.v_head_dim + E + 2 * K + 8)
    attention = n * H * (R + 2) + H * -(-ctx // 64) * (R + 2)
    # the un-absorbed form (mla_mha.c): softmax state, a span of bf16 latents, a thread's block
    dk, dv = cfg.qk_nope_head_dim + P, cfg.v_head_dim
    attention += 2 * H * n + min(ctx, 4096) * R // 2 + 256 * (R + dk + 2 * dv + 256) + 256 * (dv + 1)
    experts = n * K * (2 * D + 2 * inter)
    return {"weights": weights, "cache": 4 * (R + P) * ctx * cached_layers(cfg),
            "scratch": 4 * (state + attention + experts + n * V)}
