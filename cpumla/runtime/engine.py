"""The runtime for one conversation: weights in place, a latent KV cache, prefill and decode.

D=hidden H=heads R=kv_lora_rank P=qk_rope_head_dim dn=qk_nope_head_dim dv=v_head_dim
E=experts K=top_k T=cached tokens n=tokens in this forward

Attention is absorbed MLA in both phases: q~_h = [q_nope_h @ W_UK[h] | RoPE(q_pe_h)] (R+P) against the
latent cache rows [c_t | RoPE(k_pe_t)] (R+P), output o~_h (R) mapped back by W_UV[h]. Prefill uses the
same kernel with a causal length per query (latent-space prefill: one kernel, correct for any prompt;
see shared/docs section 6.3). The whole forward is one native call (cpumla_mla_forward, mla_model.c);
this module only describes the model to it once, at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cpumla import native
from cpumla.errors import CpumlaError
from cpumla.models.deepseek_v2 import MLAConfig, checkpoint_name_map, mlp_names
from cpumla.runtime import weights as W


PREFILL_CHUNK = 512     # tokens per native forward call


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
        gate=lin("gate"), router=router,    # kept as stored: mla_model.c runs it on fp32 activations
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
        self.embed = W.vector(src, "model.embed_tokens.weight", (V, D))
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
        self._c = self._describe()

    # ---- public ----
    @property
    def matmul_format(self) -> str:
        """The weight format of the linear layers ("bf16", "e4m3", ...): that of kv_a_proj. bf16 means
        the products run on bf16-rounded activations (kernels.h)."""
        return self.layers[0].kv_a.dtype

    @property
    def bf16_activations(self) -> bool:
        """Whether the linear layers multiply bf16-rounded activations (kernels.h): bf16 weights, and
        FP8 (e4m3) weights, whose block scale is folded into the activation before the rounding."""
        return self.matmul_format in ("bf16", "e4m3")

    def reset(self) -> None:
        self.pos = 0
        self.tokens = []

    def truncate(self, n: int) -> None:
        """Forget everything after the first n cached tokens (multi-turn reuse, regenerate)."""
        self.pos = min(self.pos, max(0, n))
        del self.tokens[self.pos:]

    def forward(self, token_ids, last_only: bool = False) -> np.ndarray:
        """Logits [n, vocab] (or [1, vocab] for the last position) of token_ids appended to the cache."""
        ids = np.ascontiguousarray(np.asarray(token_ids, dtype=np.int64).reshape(-1))
        n = ids.size
        if n == 0:
            raise CpumlaError("forward needs at least one token")
        if self.pos + n > self.max_seq_len:
            raise CpumlaError(f"context full: {self.pos} cached + {n} new tokens > max_seq_len {self.max_seq_len}")
        logits = np.empty((1 if last_only else n, self.config.vocab_size), np.float32)
        # long prompts go in chunks, so the forward's scratch (~n * 30 KB for V2-Lite) stays bounded
        for c0 in range(0, n, PREFILL_CHUNK):
            c1 = min(n, c0 + PREFILL_CHUNK)
            out = logits if last_only else logits[c0:]
            rc = native.lib.cpumla_mla_forward(self._c, native.vptr(ids[c0:], "int64_t *"), c1 - c0,
                                               self.pos + c0, native.fptr(out), int(last_only))
            if rc != 0:                      # rows of earlier chunks are not counted: pos is unchanged
                raise CpumlaError(native.last_error())
        self.pos += n
        self.tokens.extend(int(t) for t in ids)
        return logits

    def generate(self, prompt_ids, max_new_tokens: int, stop_ids=None, **sampling):
        """Yields generated token ids; the prompt is appended to the cache first."""
        from cpumla.chat.sampling import Sampler

        sampler = Sampler(**sampling)
        stops = set(self.config.eos_ids if stop_ids is None else stop_ids)
        logits = self.forward(prompt_ids, last_only=True)
        for _ in range(max_new_tokens):
            tok = sampler(logits[-1])
            yield tok
            if tok in stops or self.pos >= self.max_seq_len:
                return
            logits = self.forward([tok], last_only=True)

    # ---- the native model description, built once ----
    def _describe(self):
        """cffi structs pointing at the weights in place and the caches (kept alive by self)."""
        ffi, lib, cfg = native.ffi, native.lib, self.config
        layers = ffi.new("cpumla_mla_layer[]", len(self.layers))
        for i, L in enumerate(self.layers):
            c = layers[i]
            for field in ("input_ln", "post_ln", "q_a_ln", "kv_a_ln"):
                v = getattr(L, field)
                if v is not None:
                    getattr(c, field).data = native.vptr(v)
                    getattr(c, field).dtype = _VEC_DTYPE[v.dtype.str]
            for field in ("q", "q_a", "q_b", "kv_a", "kv_b", "o_proj", "gate"):
                w = getattr(L, field)
                setattr(c, field, w.c if w is not None else ffi.NULL)
            c.router = L.router.c if L.router is not None else ffi.NULL
            c.experts = L.experts.c if L.experts is not None else ffi.NULL
            mlp = L.mlp if L.mlp is not None else L.shared
            c.mlp = mlp.c if mlp is not None else ffi.NULL
            c.cache = native.vptr(self.cache[i])
        m = ffi.new("cpumla_mla_model *")
        m.n_layers, m.hidden, m.n_heads = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads
        m.q_lora_rank, m.kv_lora_rank = cfg.q_lora_rank or 0, cfg.kv_lora_rank
        m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        m.vocab, m.cache_rows, m.cache_dtype = cfg.vocab_size, self.max_seq_len, lib.CPUMLA_F32
        m.rms_norm_eps, m.softmax_scale, m.rope_attn_scale = cfg.rms_norm_eps, cfg.softmax_scale, cfg.rope_attn_scale
        self._inv_freq = np.ascontiguousarray(cfg.inv_freq, dtype=np.float32)
        m.inv_freq = native.fptr(self._inv_freq)
        self._embed_w = native.Weight(self.embed, _WEIGHT_FMT[self.embed.dtype.str])
        m.embed, m.lm_head = self._embed_w.c, self.lm_head.c
        m.norm.data, m.norm.dtype = native.vptr(self.norm), _VEC_DTYPE[self.norm.dtype.str]
        m.layers = layers
        self._layers_c = layers
        return m


_VEC_DTYPE = {np.dtype(np.float32).str: native.lib.CPUMLA_F32, np.dtype(np.uint16).str: native.lib.CPUMLA_BF16,
              np.dtype(np.float16).str: native.lib.CPUMLA_F16}
_WEIGHT_FMT = {np.dtype(np.float32).str: "f32", np.dtype(np.uint16).str: "bf16", np.dtype(np.float16).str: "f16"}
