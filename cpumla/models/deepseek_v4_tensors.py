"""DeepSeek-V4's tensors: their official names (and transformers' spelling of them), shapes and kinds,
the memory a model of a config takes, and reading each in its release format (FP8 e4m3 with E8M0
scales, FP4 e2m1 experts, bf16, fp32)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from cpumla import native
from cpumla.checkpoint import tensors as W
from cpumla.checkpoint.formats import FORMAT_OF
from cpumla.errors import CpumlaError

MTP = "mtp.0."        # the MTP layer's tensors: mtp.0.* (its decoder layer's named as a layer's are)

if TYPE_CHECKING:
    from cpumla.models.deepseek_v4_config import Config


def dummy_bytes(shape, kind: str, dtype: str, block=(128, 128)) -> int:
    """Bytes of one tensor as dummy weights of `dtype` store it (checkpoint.dummy.DummySource's V4 kinds)."""
    n = math.prod(shape)
    if kind.startswith("ids:"):
        return 8 * n
    if kind in ("bias", "f32") or dtype == "f32":
        return 4 * n
    if kind == "e4m3":
        return n + -(-shape[0] // block[0]) * -(-shape[1] // block[1])
    if kind == "e2m1":
        return n // 2 + shape[0] * -(-shape[1] // 32)
    return 2 * n


def memory_bytes(cfg: Config, ctx: int, dtype: str, chunk: int = 512) -> dict[str, int]:
    """What a model of this config takes, from the config alone: "weights" as dummy weights of `dtype`
    store them (a checkpoint's are its files, mapped), "cache" (each layer's window ring and compressed
    entries, the compressor rings, CSA's index keys; fp32) and "scratch" (the state's buffers for a
    prefill chunk and one chunk of logits; from above). Layers are grouped by type, not walked."""
    D, V, N, hd = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult, cfg.head_dim
    IH, ID, n = cfg.index_n_heads, cfg.index_head_dim, min(chunk, ctx)
    weights = dummy_bytes((V, D), "embed", dtype) + dummy_bytes((V, D), "plain", dtype) + \
        dummy_bytes((D,), "norm", dtype) + 4 * (N * N * D + N + 1)
    groups: dict[tuple, tuple[int, int]] = {}
    for l in range(cfg.num_hidden_layers + has_mtp(cfg)):          # the MTP layer's included
        key = cfg.layer_kind(l)
        first, count = groups.get(key, (l, 0))
        groups[key] = (first, count + 1)
    if has_mtp(cfg):
        weights += sum(dummy_bytes(shape, kind, dtype, cfg.block) for shape, kind in mtp_tensors(cfg).values())
    cache = 0
    for (r, csa, _), (l, count) in groups.items():
        weights += count * sum(dummy_bytes(shape, kind, dtype, cfg.block) for shape, kind in layer_tensors(cfg, l).values())
        ne, ring = (ctx // r if r else 0), ((2 if csa else 1) * r + n if r else 0)
        per = (cfg.sliding_window + n + ne) * hd + ring * 2 * (2 if csa else 1) * hd
        if csa:
            per += max(ne, 1) * ID + ring * 4 * ID
        cache += 4 * count * per
    E, K, H = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.num_attention_heads
    state = n * (3 * N * D + (2 + N) * N + 3 * N + N * N + 3 * D + cfg.q_lora_rank + 2 * H * hd + hd
                 + cfg.o_groups * cfg.o_lora_rank + 4 * max(hd, ID) + IH * ID + IH + E + 2 * K + 8) + (8 << 20)
    experts = n * (K + 1) * 2 * (D + 2 * cfg.moe_intermediate_size * max(1, cfg.n_shared_experts or 1))
    return {"weights": weights, "cache": cache, "scratch": 4 * (state + experts + n * V)}


# ---- tensor names ---------------------------------------------------------------------------------
def hf_name(name: str) -> str:
    """The name transformers' save_pretrained writes for an official V4 tensor name."""
    if name == "head.weight":
        return name
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    if name.startswith("hc_head_"):
        return "model.hc_head.hc_" + name[len("hc_head_"):]
    return "model." + name.replace(".attn.kv_norm.", ".attn.norm.")


def has_mtp(cfg: Config) -> bool:
    """Whether the config names an MTP layer cpumla reads (`mtp.0.*`: a sliding-window layer, as in
    the releases)."""
    return bool(cfg.num_nextn_predict_layers) and cfg.mtp_ratio == 0


def is_mtp(cfg: Config, name: str) -> bool:
    return has_mtp(cfg) and name.startswith(MTP)


def layer_prefix(cfg: Config, l: int) -> str:
    """`layers.{l}.`, or the MTP layer's `mtp.0.` for l = num_hidden_layers."""
    return f"layers.{l}." if l < cfg.num_hidden_layers else MTP


def mtp_tensors(cfg: Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """The MTP layer's own tensors beside its decoder layer's (layer_tensors(cfg, num_hidden_layers)).
    It has no embedding or head of its own: the main model's serve it."""
    D, N = cfg.hidden_size, cfg.hc_mult
    return {MTP + "e_proj.weight": ((D, D), "e4m3"), MTP + "h_proj.weight": ((D, D), "e4m3"),
            MTP + "enorm.weight": ((D,), "norm"), MTP + "hnorm.weight": ((D,), "norm"),
            MTP + "norm.weight": ((D,), "norm"), MTP + "hc_head_fn": ((N, N * D), "f32"),
            MTP + "hc_head_base": ((N,), "f32"), MTP + "hc_head_scale": ((1,), "f32")}


def layer_tensors(cfg: Config, l: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """The official names of layer l's tensors (l = num_hidden_layers: the MTP layer's decoder layer):
    name -> (shape [out, in], kind for dummy weights)."""
    D, H, hd, QL, N = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank, cfg.hc_mult
    G, OL, E, I = cfg.o_groups, cfg.o_lora_rank, cfg.n_routed_experts, cfg.moe_intermediate_size
    p = layer_prefix(cfg, l)
    a = p + "attn."
    r, csa, hashed = cfg.layer_kind(l)
    NM = (2 + N) * N
    out = {p + "attn_norm.weight": ((D,), "norm"), p + "ffn_norm.weight": ((D,), "norm")}
    for sub in ("attn", "ffn"):
        out[f"{p}hc_{sub}_fn"] = ((NM, N * D), "f32")
        out[f"{p}hc_{sub}_base"] = ((NM,), "f32")
        out[f"{p}hc_{sub}_scale"] = ((3,), "f32")
    out.update({a + "wq_a.weight": ((QL, D), "e4m3"), a + "q_norm.weight": ((QL,), "norm"),
                a + "wq_b.weight": ((H * hd, QL), "e4m3"), a + "wkv.weight": ((hd, D), "e4m3"),
                a + "kv_norm.weight": ((hd,), "norm"), a + "wo_a.weight": ((G * OL, H * hd // G), "e4m3"),
                a + "wo_b.weight": ((D, G * OL), "e4m3"), a + "attn_sink": ((H,), "f32")})
    if r:
        coff = 2 if csa else 1
        c = a + "compressor."
        out.update({c + "wkv.weight": ((coff * hd, D), "plain"), c + "wgate.weight": ((coff * hd, D), "plain"),
                    c + "ape": ((r, coff * hd), "f32"), c + "norm.weight": ((hd,), "norm")})
    if csa:
        IH, ID = cfg.index_n_heads, cfg.index_head_dim
        x = a + "indexer."
        out.update({x + "wq_b.weight": ((IH * ID, QL), "e4m3"), x + "weights_proj.weight": ((IH, D), "plain"),
                    x + "compressor.wkv.weight": ((2 * ID, D), "plain"),
                    x + "compressor.wgate.weight": ((2 * ID, D), "plain"),
                    x + "compressor.ape": ((r, 2 * ID), "f32"), x + "compressor.norm.weight": ((ID,), "norm")})
    f = p + "ffn."
    out[f + "gate.weight"] = ((E, D), "plain")
    if hashed:
        out[f + "gate.tid2eid"] = ((cfg.vocab_size, cfg.num_experts_per_tok), f"ids:{E}")
    else:
        out[f + "gate.bias"] = ((E,), "bias")
    for e in range(E):
        out[f"{f}experts.{e}.w1.weight"] = ((I, D), cfg.expert_kind)
        out[f"{f}experts.{e}.w3.weight"] = ((I, D), cfg.expert_kind)
        out[f"{f}experts.{e}.w2.weight"] = ((D, I), cfg.expert_kind)
    SI = I * cfg.n_shared_experts
    if SI:
        out.update({f + "shared_experts.w1.weight": ((SI, D), "e4m3"), f + "shared_experts.w3.weight": ((SI, D), "e4m3"),
                    f + "shared_experts.w2.weight": ((D, SI), "e4m3")})
    return out


def tensors(cfg: Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor the model reads, by official name: name -> (shape, kind). Kinds for dummy weights:
    "e4m3" (FP8 with E8M0 `.scale`), "e2m1" (FP4 experts, I8 with E8M0 `.scale`), "plain" (bf16),
    "f32", "ids:E" (a token-id hash table over E experts), "embed", "norm", "bias"."""
    D, V, N = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    out = {"embed.weight": ((V, D), "embed"), "head.weight": ((V, D), "plain"), "norm.weight": ((D,), "norm"),
           "hc_head_fn": ((N, N * D), "f32"), "hc_head_base": ((N,), "f32"), "hc_head_scale": ((1,), "f32")}
    for layer in range(cfg.num_hidden_layers + has_mtp(cfg)):
        out.update(layer_tensors(cfg, layer))
    if has_mtp(cfg):
        out.update(mtp_tensors(cfg))
    return out


# ---- reading tensors in their formats --------------------------------------------------------------
class Names:
    """Resolves an official name to the one a checkpoint holds (official or transformers' spelling)."""

    def __init__(self, src):
        self.src = src

    def __call__(self, name: str) -> str:
        if self.src.has(name):
            return name
        alt = hf_name(name)
        if self.src.has(alt):
            return alt
        raise CpumlaError(f"{W.where(self.src, name)}: checkpoint is missing tensor '{W.label(self.src, name)}'")


def stored_name(src, name: str) -> str | None:
    """The name under which src holds the tensor tensors() calls `name` (official or transformers'
    spelling), or None."""
    return name if src.has(name) else hf_name(name) if src.has(hf_name(name)) else None


def scale_of(src, name: str) -> tuple[str | None, np.ndarray | None]:
    """(name, array) of the scale grid stored beside weight `name` (V4's `.scale`, or transformers'
    `weight_scale_inv`), or (None, None)."""
    base = name[:-len(".weight")] if name.endswith(".weight") else name
    for s in (base + ".scale", name + "_scale_inv", base + ".weight_scale_inv"):
        if src.has(s):
            return s, src.tensor(s)
    return None, None


def linear(src, names: Names, name: str, shape: tuple[int, int], block=(128, 128)) -> native.Weight:
    """A [out, in] weight as stored: f32 / bf16 / f16, FP8 e4m3 with a 128x128 `.scale` grid (E8M0 or
    f32), FP4 e2m1 packed two per byte (I8 [out, in/2]) with an E8M0 `.scale` per 1x32, or a GGUF
    block type (tensors.GGUF_TYPES)."""
    real = names(name)
    dtype, got = src.info(real)
    if dtype in W.GGUF_TYPES:          # a GGUF block type (Q8_0 ...), read in place
        return W.gguf_block(src, real, shape)
    if dtype == "I8":
        if tuple(got) != (shape[0], shape[1] // 2) or shape[1] % 2:
            raise CpumlaError(f"{W.where(src, real)}: FP4 tensor '{real}' has shape {list(got)}, config wants "
                              f"{[shape[0], shape[1] // 2]} (two values per byte)")
        sname, scale = scale_of(src, real)
        if scale is None or scale.dtype != np.uint8:
            raise CpumlaError(f"{W.where(src, real)}: FP4 tensor '{real}' has no F8_E8M0 '.scale'")
        try:
            return native.Weight(src.tensor(real).view(np.uint8), "e2m1", scale, (1, 32))
        except CpumlaError as e:
            raise CpumlaError(f"{W.where(src, sname)}: '{sname}': {e}") from None
    if tuple(got) != tuple(shape):
        raise CpumlaError(f"{W.where(src, real)}: tensor '{W.label(src, real)}' has shape {list(got)}, config wants "
                          f"{list(shape)}")
    if dtype == "F8_E4M3":
        sname, scale = scale_of(src, real)
        if scale is None:
            raise CpumlaError(f"{W.where(src, real)}: FP8 tensor '{real}' has no '.scale'")
        try:
            return native.Weight(src.tensor(real), "e4m3", scale, tuple(block))
        except CpumlaError as e:
            raise CpumlaError(f"{W.where(src, sname)}: '{sname}': {e}") from None
    fmt = FORMAT_OF.get(dtype)
    if fmt is None:
        raise CpumlaError(f"{W.where(src, real)}: tensor '{real}' has dtype {dtype}, which cpumla cannot use for a weight")
    return native.Weight(src.tensor(real), fmt)


def vector(src, names: Names, name: str, shape) -> np.ndarray:
    """A norm weight, bias or table by official name, in either spelling (checkpoint.tensors.vector)."""
    return W.vector(src, names(name), shape)
