"""The runtime for one conversation: weights in place, a latent KV cache, prefill and decode.

D=hidden H=heads R=kv_lora_rank P=qk_rope_head_dim dn=qk_nope_head_dim dv=v_head_dim
E=experts K=top_k T=cached tokens n=tokens in this forward

Attention is absorbed MLA in both phases: q~_h = [q_nope_h @ W_UK[h] | RoPE(q_pe_h)] (R+P) against the
latent cache rows [c_t | RoPE(k_pe_t)] (R+P), output o~_h (R) mapped back by W_UV[h]. Prefill uses the
same kernel with a causal length per query (latent-space prefill: one kernel, correct for any prompt;
see shared/docs section 6.3). Every op runs in the native library; Python only sequences the calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cpumla import native
from cpumla.errors import CpumlaError
from cpumla.models.deepseek_v2 import MLAConfig, checkpoint_name_map, mlp_names
from cpumla.runtime import weights as W


@dataclass
class Layer:
    input_ln: np.ndarray          # [D]
    post_ln: np.ndarray           # [D]
    q: native.Weight | None       # [H*(dn+P), D]            (no q LoRA: V2-Lite, Moonlight)
    q_a: native.Weight | None     # [q_lora, D]
    q_a_ln: np.ndarray | None     # [q_lora]
    q_b: native.Weight | None     # [H*(dn+P), q_lora]
    kv_a: native.Weight           # [R+P, D]
    kv_a_ln: np.ndarray           # [R]
    kv_b: native.Weight           # [H*(dn+dv), R]: per head dn rows of W_UK then dv rows of W_UV
    o_proj: native.Weight         # [D, H*dv]
    mlp: native.Experts | None    # dense layer: a table of one
    gate: native.Weight | None    # [E, D] router
    router: native.Router | None
    experts: native.Experts | None
    shared: native.Experts | None


def build_layer(cfg: MLAConfig, src, layer: int) -> Layer:
    m = checkpoint_name_map(cfg, layer)

    def lin(role):
        return W.linear(src, m[role][0], m[role][1], cfg) if role in m else None

    def vec(role):
        return W.vector(src, m[role][0], m[role][1]) if role in m else None

    def table(trios, inter):
        D = cfg.hidden_size
        return native.Experts([(W.linear(src, g, (inter, D), cfg), W.linear(src, u, (inter, D), cfg),
                                W.linear(src, d, (D, inter), cfg)) for g, u, d in trios])

    names = mlp_names(cfg, layer)
    router = None
    if "gate" in m:
        bias = W.as_f32(vec("gate_bias")) if "gate_bias" in m else None
        # V3: renormalise (norm_topk_prob) then scale. V2's own code: renormalise *or* scale (the
        # released V2 checkpoints scale; transformers' V2 always scales).
        v2_norm = cfg.model_type == "deepseek_v2" and bool(cfg.norm_topk_prob) and cfg.num_experts_per_tok > 1
        router = native.Router(cfg.router_method, cfg.n_routed_experts, cfg.num_experts_per_tok,
                               n_group=cfg.n_group or 1, topk_group=cfg.topk_group or 1,
                               norm_topk_prob=bool(cfg.norm_topk_prob) if cfg.model_type == "deepseek_v3" else v2_norm,
                               routed_scaling_factor=1.0 if v2_norm else float(cfg.routed_scaling_factor),
                               bias=bias)
    return Layer(
        input_ln=vec("input_ln"), post_ln=vec("post_ln"),
        q=lin("q"), q_a=lin("q_a"), q_a_ln=vec("q_a_ln"), q_b=lin("q_b"),
        kv_a=lin("kv_a"), kv_a_ln=vec("kv_a_ln"), kv_b=lin("kv_b"), o_proj=lin("o_proj"),
        mlp=table(names["dense"], cfg.intermediate_size) if "dense" in names else None,
        gate=lin("gate"), router=router,
        experts=table(names["experts"], cfg.moe_intermediate_size) if "experts" in names else None,
        shared=table(names["shared"], cfg.moe_intermediate_size * cfg.n_shared_experts)
        if "shared" in names else None,
    )


class Engine:
    """One conversation's model state. forward() appends to the cache: decode is a one-token forward."""

    def __init__(self, cfg: MLAConfig, src, max_seq_len: int | None = None, threads: int | None = None):
        native.ensure_init()
        if threads is not None:
            native.set_threads(threads)
        self.config = cfg
        self._src = src
        ctx = max_seq_len or min(cfg.max_position_embeddings, 4096)
        if ctx < 1:
            raise CpumlaError("max_seq_len must be at least 1")
        self.max_seq_len = ctx
        D, V = cfg.hidden_size, cfg.vocab_size
        self.embed = _embedding(src, "model.embed_tokens.weight", (V, D))
        self.norm = W.vector(src, "model.norm.weight", (D,))
        head = "lm_head.weight"
        if not src.has(head) and cfg.tie_word_embeddings:
            head = "model.embed_tokens.weight"
        self.lm_head = W.linear(src, head, (V, D), cfg)
        self.layers = [build_layer(cfg, src, i) for i in range(cfg.num_hidden_layers)]
        R, P = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        # the latent cache: per layer [T, R+P] rows of [c | RoPE(k_pe)]
        self.cache = [np.zeros((ctx, R + P), np.float32) for _ in range(cfg.num_hidden_layers)]
        self.pos = 0
        self.tokens: list[int] = []

    # ---- public ----
    def reset(self) -> None:
        self.pos = 0
        self.tokens = []

    def truncate(self, n: int) -> None:
        """Forget everything after the first n cached tokens (multi-turn reuse, regenerate)."""
        self.pos = min(self.pos, max(0, n))
        del self.tokens[self.pos:]

    def forward(self, token_ids, last_only: bool = False) -> np.ndarray:
        """Logits [n, vocab] (or [1, vocab] for the last position) of token_ids appended to the cache."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        n = ids.size
        if n == 0:
            raise CpumlaError("forward needs at least one token")
        if self.pos + n > self.max_seq_len:
            raise CpumlaError(f"context full: {self.pos} cached + {n} new tokens > max_seq_len {self.max_seq_len}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise CpumlaError(f"token id {int(ids.max() if ids.max() >= 0 else ids.min())} is outside the "
                              f"vocabulary of {self.config.vocab_size}")
        pos = np.arange(self.pos, self.pos + n, dtype=np.int64)
        h = self._embed(ids)
        for i, layer in enumerate(self.layers):
            self._attention(i, layer, h, pos)
            self._ffn(layer, h)
        if last_only:
            h = h[-1:]
        x = native.rmsnorm(h, self.norm, self.config.rms_norm_eps)
        logits = native.gemm(self.lm_head, x)
        self.pos += n
        self.tokens.extend(int(t) for t in ids)
        return logits

    def generate(self, prompt_ids, max_new_tokens: int, stop_ids=None, **sampling):
        """Yields generated token ids; the prompt is appended to the cache first."""
        from cpumla.runtime.sampling import Sampler

        sampler = Sampler(**sampling)
        stops = set(self.config.eos_ids if stop_ids is None else stop_ids)
        logits = self.forward(prompt_ids, last_only=True)
        for _ in range(max_new_tokens):
            tok = sampler(logits[-1])
            yield tok
            if tok in stops or self.pos >= self.max_seq_len:
                return
            logits = self.forward([tok], last_only=True)

    # ---- the layer ----
    def _embed(self, ids: np.ndarray) -> np.ndarray:
        rows = self.embed[ids]
        return W.as_f32(rows) if rows.dtype != np.float32 else rows.copy()

    def _attention(self, i: int, L: Layer, h: np.ndarray, pos: np.ndarray) -> None:
        cfg = self.config
        n, H = h.shape[0], cfg.num_attention_heads
        R, P, dn, dv = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        eps = cfg.rms_norm_eps
        x = native.rmsnorm(h, L.input_ln, eps)
        if L.q is not None:
            q = native.gemm(L.q, x)
        else:
            qa = native.gemm(L.q_a, x)
            native.rmsnorm(qa, L.q_a_ln, eps, out=qa)
            q = native.gemm(L.q_b, qa)
        q3 = q.reshape(n, H, dn + P)
        latent = native.gemm(L.kv_a, x)                                   # [n, R+P] = [c_kv | k_pe]
        native.rmsnorm(latent[:, :R], L.kv_a_ln, eps, out=latent[:, :R])
        native.rope(latent.reshape(n, 1, R + P), pos, cfg.inv_freq, R, P, 0, cfg.rope_attn_scale)
        native.rope(q3, pos, cfg.inv_freq, dn, P, 0, cfg.rope_attn_scale)
        q_abs = np.empty((n, H, R + P), np.float32)
        native.head_gemv_t(L.kv_b, 0, dn + dv, dn, q3[:, :, :dn], out=q_abs[:, :, :R])   # absorb W_UK
        q_abs[:, :, R:] = q3[:, :, dn:]
        cache = self.cache[i]
        native.cache_store(cache, latent, pos)
        o_lat = native.mla_attention(q_abs, cache[: int(pos[-1]) + 1], R + P, R, cfg.softmax_scale,
                                     kv_len=pos + 1)
        o = native.head_gemv(L.kv_b, dn, dn + dv, dv, o_lat)                # un-absorb W_UV: [n, H, dv]
        h += native.gemm(L.o_proj, o.reshape(n, H * dv))

    def _ffn(self, L: Layer, h: np.ndarray) -> None:
        cfg = self.config
        n = h.shape[0]
        x = native.rmsnorm(h, L.post_ln, cfg.rms_norm_eps)
        if L.mlp is not None:
            L.mlp(x, np.zeros((n, 1), np.int32), np.ones((n, 1), np.float32), h)
            return
        logits = native.gemm(L.gate, x)                                   # [n, E] router logits, fp32
        idx, w = L.router(logits)
        L.experts(x, idx, w, h)
        if L.shared is not None:
            L.shared(x, np.zeros((n, 1), np.int32), np.ones((n, 1), np.float32), h)


def _embedding(src, name: str, shape) -> np.ndarray:
    if not src.has(name):
        raise CpumlaError(f"checkpoint is missing tensor '{name}'")
    dtype, got = src.info(name)
    if tuple(got) != tuple(shape):
        raise CpumlaError(f"tensor '{name}' has shape {list(got)}, config wants {list(shape)}")
    if dtype not in ("F32", "BF16", "F16"):
        raise CpumlaError(f"tensor '{name}' has dtype {dtype}; embeddings must be F32, BF16 or F16")
    return src.tensor(name)
