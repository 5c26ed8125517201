"""DeepSeek-V3.2-Exp / V3.2 (`deepseek_v32`): DeepSeek-V3 plus DSA's lightning indexer, which picks for each
query the `index_topk` cached tokens its MLA attention reads. The native forward is deepseek_v32.c.

Cross-read with transformers/models/deepseek_v32/modeling_deepseek_v32.py (DeepseekV32Indexer).

IH=index_n_heads ID=index_head_dim P=qk_rope_head_dim QL=q_lora_rank D=hidden

Per layer: qI = wq_b(q LoRA latent) [IH, ID], kI = LayerNorm(wk(x)) [ID] (weight and bias, eps 1e-6),
half-split RoPE on the first P dims of both at the MLA's frequencies; score(t, s) = sum_h w_h
relu(qI_h(t) . kI(s)), w = weights_proj(x) * IH^-0.5 * ID^-0.5, over s <= t; attention over the top
index_topk (every cached token while there are no more than that). The index keys are cached per layer
next to the latent cache, so decode scores every cached token but reads only index_topk latent rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cpumla import native
from cpumla.checkpoint import tensors as W
from cpumla.models import deepseek_v2 as v2
from cpumla.models import deepseek_v2_tensors as tables
from cpumla.models.checks import needer

MODEL_TYPES = ("deepseek_v32",)
INDEX_NORM_EPS = 1e-6          # DeepseekV32Indexer.k_norm = nn.LayerNorm(index_head_dim, eps=1e-6)

fit_overrides = v2.fit_overrides
is_mtp = tables.is_mtp          # the MTP layer (block num_hidden_layers) as V3's: loaded, not decoded with


@dataclass
class Config(v2.Config):
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    mlp_layer_types: list | None = None     # "dense" / "sparse" per layer (transformers derives it)

    MODEL_TYPES = MODEL_TYPES
    SIZES = {**v2.Config.SIZES, "index_n_heads": (1, False), "index_head_dim": (1, False), "index_topk": (1, False)}

    def validate(self, source: str) -> None:
        super().validate(source)
        need = needer(source)
        need(self.index_head_dim >= self.qk_rope_head_dim,
             f"'index_head_dim' {self.index_head_dim} is smaller than qk_rope_head_dim {self.qk_rope_head_dim}")
        need(bool(self.q_lora_rank), "'q_lora_rank' is required: the indexer reads the q LoRA latent")
        if self.mlp_layer_types is not None:
            t = self.mlp_layer_types
            need(isinstance(t, list) and len(t) >= self.num_hidden_layers and all(x in ("dense", "sparse") for x in t),
                 "'mlp_layer_types' must list 'dense' or 'sparse' for every layer")

    def is_moe_layer(self, layer: int) -> bool:
        if self.mlp_layer_types is not None:       # the MTP layer (index num_hidden_layers) is a MoE layer
            t = self.mlp_layer_types
            return self.has_moe and (t[layer] == "sparse" if layer < min(len(t), self.num_hidden_layers) else True)
        return super().is_moe_layer(layer)

    def layer_groups(self) -> list[tuple[int, int]]:
        if self.mlp_layer_types is None:
            return super().layer_groups()
        types = self.mlp_layer_types[:self.num_hidden_layers]
        kinds = {self.is_moe_layer(i): i for i in reversed(range(len(types)))}
        moe = sum(self.is_moe_layer(i) for i in range(len(types)))
        return [(i, moe if is_moe else len(types) - moe) for is_moe, i in kinds.items()]


def indexer_names(cfg: Config, layer: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The indexer tensors of a layer, as V3.2 checkpoints (and transformers) name them."""
    IH, ID, D = cfg.index_n_heads, cfg.index_head_dim, cfg.hidden_size
    p = f"model.layers.{layer}.self_attn.indexer."
    return {"wq_b": (p + "wq_b.weight", (IH * ID, cfg.q_lora_rank)), "wk": (p + "wk.weight", (ID, D)),
            "k_norm": (p + "k_norm.weight", (ID,)), "k_norm_bias": (p + "k_norm.bias", (ID,)),
            "weights_proj": (p + "weights_proj.weight", (IH, D))}


def tensors(cfg: Config) -> dict[str, tuple[tuple[int, ...], str]]:
    out = tables.tensors(cfg)
    for layer in range(tables.cached_layers(cfg)):         # the MTP layer's indexer included
        for role, (name, shape) in indexer_names(cfg, layer).items():
            out[name] = (shape, INDEXER_KINDS[role])
    return out


INDEXER_KINDS = {"wq_b": "linear", "wk": "linear", "k_norm": "norm", "k_norm_bias": "bias", "weights_proj": "plain"}


def layer_shapes(cfg: Config, layer: int) -> list[tuple[tuple[int, ...], str, int]]:
    return tables.layer_shapes(cfg, layer) + [(shape, INDEXER_KINDS[role], 1)
                                          for role, (_, shape) in indexer_names(cfg, layer).items()]


def weight_groups(cfg: Config) -> list[tuple[str, tuple[int, ...], str, int]]:
    return tables.weight_groups(cfg, lambda layer: [(role, t, INDEXER_KINDS[role]) for role, t in indexer_names(cfg, layer).items()])


def memory_bytes(cfg: Config, ctx: int, dtype: str, chunk: int = 512) -> dict[str, int]:
    """V3's, plus the index-key cache ([ctx, index_head_dim] fp32 per layer) and the indexer's scratch
    (index queries and keys of a chunk, one query chunk's scores, the selected rows)."""
    b = tables.memory_bytes(cfg, ctx, dtype, chunk, shapes=layer_shapes)
    n, IH, ID = min(chunk, ctx), cfg.index_n_heads, cfg.index_head_dim
    b["cache"] += 4 * ID * ctx * tables.cached_layers(cfg)
    b["scratch"] += 4 * (n * IH * ID + n * ID + n * IH + max(IH * ctx, 8 << 20) + 2 * ctx + n * cfg.index_topk + 3 * n)
    return b


@dataclass
class Indexer:
    wq_b: native.Weight           # [IH*ID, QL]
    wk: native.Weight             # [ID, D]
    k_norm: np.ndarray            # [ID]
    k_norm_bias: np.ndarray       # [ID]
    weights_proj: native.Weight   # [IH, D]


class Model(v2.Model):
    STATE = ("cpumla_dsv32_new", "cpumla_dsv32_free", "cpumla_dsv32_forward")
    HIDDEN_FN, MTP_FN = "cpumla_dsv32_forward_hidden", "cpumla_dsv32_mtp_forward"   # its MTP layer: V3.2's

    def build_layer(self, src, i: int) -> v2.Layer:
        L = super().build_layer(src, i)
        cfg = self.config
        m = indexer_names(cfg, i)
        L.indexer = Indexer(
            wq_b=W.linear(src, *m["wq_b"], cfg.block), wk=W.linear(src, *m["wk"], cfg.block),
            k_norm=W.vector(src, *m["k_norm"]), k_norm_bias=W.vector(src, *m["k_norm_bias"]),
            weights_proj=W.linear(src, *m["weights_proj"], cfg.block))
        return L

    def comm_desc(self):
        return self._c.base

    def cache_bytes_per_token(self) -> int:
        cached = self.config.num_hidden_layers + (self.mtp is not None)
        return super().cache_bytes_per_token() + 4 * self.config.index_head_dim * cached

    def layer_weights(self, L) -> list:
        X = L.indexer
        return super().layer_weights(L) + [X.wq_b, X.wk, X.weights_proj]

    def attended(self, depth: int) -> int:
        return min(depth + 1, self.config.index_topk)

    def decode_bytes(self, depth: int) -> float:
        """As V3's, with latent rows for only index_topk tokens, plus every cached index key."""
        cfg = self.config
        return super().decode_bytes(depth) + 4.0 * cfg.index_head_dim * (depth + 1) * cfg.num_hidden_layers

    def unabsorbed(self, n: int) -> bool:
        """Never: the indexer's selection is attended in the absorbed form."""
        return False

    def prefill_flops(self, n: int, depth: int) -> float:
        """As V3's over the selected pairs, plus the index scores of every causal pair."""
        cfg = self.config
        pairs = n * depth + n * (n + 1) / 2
        return super().prefill_flops(n, depth) + 2.0 * pairs * cfg.index_n_heads * cfg.index_head_dim * cfg.num_hidden_layers

    def describe(self):
        ffi, cfg = native.ffi, self.config
        m = ffi.new("cpumla_dsv32_model *")
        self.describe_base(m.base)
        layers = self.layers + ([self.mtp.layer] if self.mtp is not None else [])
        idx = ffi.new("cpumla_dsv32_indexer[]", len(layers))
        for i, L in enumerate(layers):
            X, c = L.indexer, idx[i]
            c.wq_b, c.wk, c.weights_proj = X.wq_b.c, X.wk.c, X.weights_proj.c
            native.set_vec(c.k_norm, X.k_norm)
            native.set_vec(c.k_norm_bias, X.k_norm_bias)
        m.indexers = idx
        m.index_n_heads, m.index_head_dim, m.index_topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        m.index_norm_eps = INDEX_NORM_EPS
        self._indexers_c = idx
        return m
