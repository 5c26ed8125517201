"""DeepSeek-V2 / V2-Lite (`deepseek_v2`) and V3 / R1 / V3.1 / Moonlight (`deepseek_v3`): MLA attention over
a latent cache, then a dense MLP or a MoE per layer. The native forward is deepseek_v2.c.

Field names are the Hugging Face config.json names, verbatim; unknown keys are ignored. Derived values
(rope frequencies, softmax scale, router) are computed once here, so the runtime never re-reads the
config. Cross-read with transformers/models/deepseek_v2/modeling_deepseek_v2.py and deepseek_v3.

D=hidden H=heads R=kv_lora_rank P=qk_rope_head_dim dn=qk_nope_head_dim dv=v_head_dim E=experts K=top_k

Attention is absorbed MLA in both phases: q~_h = [q_nope_h @ W_UK[h] | RoPE(q_pe_h)] (R+P) against the
latent cache rows [c_t | RoPE(k_pe_t)] (R+P), output o~_h (R) mapped back by W_UV[h]. Prefill uses the
same kernel with a causal length per query (latent-space prefill: one kernel, exact for any prompt).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from cpumla import native
from cpumla.checkpoint import tensors as W
from cpumla.checkpoint.formats import check_quant_config
from cpumla.errors import CpumlaError
from cpumla.models import deepseek_v2_tensors as tables
from cpumla.models import mtp
from cpumla.models import shard as shards
from cpumla.models.checks import MAX_SIZE, is_int, needer, validate_quantization, validate_rope_scaling
from cpumla.models.native_model import PREFILL_CHUNK, ConfigBase, NativeModel

MODEL_TYPES = ("deepseek_v2", "deepseek_v3")

# the family's tensor table and sizes (deepseek_v2_tensors.py), as the runtime calls them on this module
tensors, weight_groups, memory_bytes, is_mtp = tables.tensors, tables.weight_groups, tables.memory_bytes, tables.is_mtp


@dataclass
class Config(ConfigBase):
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    moe_intermediate_size: int = 0
    n_routed_experts: int | None = None
    n_shared_experts: int | None = None
    num_experts_per_tok: int | None = None
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    scoring_func: str = "softmax"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    tie_word_embeddings: bool = False
    quantization_config: dict | None = None
    num_nextn_predict_layers: int = 0
    extra: dict = field(default_factory=dict, repr=False)

    MODEL_TYPES = MODEL_TYPES

    # ---- derived, set by from_dict once the fields are valid ----
    def derive(self, source: str = "config.json") -> None:
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.inv_freq, self.rope_attn_scale = rope_frequencies(self)
        self.softmax_scale = softmax_scale(self)
        self.block = tuple((self.quantization_config or {}).get("weight_block_size") or (128, 128))

    @classmethod
    def prepare(cls, d: dict) -> dict:
        rp = d.get("rope_parameters")           # transformers 5 folds rope_theta/rope_scaling in here
        if isinstance(rp, dict):
            d.setdefault("rope_theta", rp.get("rope_theta", 10000.0))
            if rp.get("rope_type", rp.get("type", "default")) != "default" and not d.get("rope_scaling"):
                d["rope_scaling"] = rp
        return d

    # the fields' tables (models/checks.py's validate_fields)
    SIZES = {"vocab_size": (1, False), "hidden_size": (1, False), "intermediate_size": (1, False),
             "num_hidden_layers": (1, False), "num_attention_heads": (1, False), "kv_lora_rank": (1, False),
             "qk_nope_head_dim": (0, False), "qk_rope_head_dim": (2, False), "v_head_dim": (1, False),
             "q_lora_rank": (0, True), "moe_intermediate_size": (0, True), "n_routed_experts": (0, True),
             "n_shared_experts": (0, True), "num_experts_per_tok": (0, True), "first_k_dense_replace": (0, True),
             "moe_layer_freq": (0, True), "n_group": (0, True), "topk_group": (0, True),
             "max_position_embeddings": (1, False), "num_nextn_predict_layers": (0, True)}
    REALS = {"routed_scaling_factor": (0.0, False, False), "rope_theta": (0.0, False, False),
             "rms_norm_eps": (0.0, True, False)}
    BOOLS = ("norm_topk_prob", "tie_word_embeddings")
    STRINGS = {"topk_method": False, "scoring_func": False}

    def validate(self, source: str) -> None:
        """The rules across fields: one CpumlaError line naming the field, before anything is derived
        from them or allocated."""
        need = needer(source)
        need(self.qk_rope_head_dim % 2 == 0, "'qk_rope_head_dim' must be even")
        validate_rope_scaling(self, need)
        validate_quantization(self.quantization_config, need)
        if self.has_moe:
            try:
                method = self.router_method
            except CpumlaError as e:
                raise CpumlaError(f"{source}: {str(e).removeprefix('config: ')}") from None
            need(self.num_experts_per_tok and 0 < self.num_experts_per_tok <= self.n_routed_experts,
                 "'num_experts_per_tok' must be between 1 and n_routed_experts")
            need(bool(self.moe_intermediate_size), "'moe_intermediate_size' must be positive")
            if method in ("group_limited", "noaux_tc") and (self.n_group or 1) > 1:
                g = self.n_group
                need(self.n_routed_experts % g == 0, f"n_routed_experts {self.n_routed_experts} is not divisible by n_group {g}")
                if method == "noaux_tc":          # a group's score is the sum of its top two experts
                    need(self.n_routed_experts // g >= 2, f"n_group {g} leaves fewer than two of the "
                         f"{self.n_routed_experts} routed experts a group")
                need(self.topk_group and 1 <= self.topk_group <= g, "'topk_group' must be between 1 and n_group")
        check_quant_config(self.quantization_config, source)

    # ---- structure ----
    @property
    def has_moe(self) -> bool:
        return bool(self.n_routed_experts)

    def is_moe_layer(self, layer: int) -> bool:
        return (self.has_moe and layer >= self.first_k_dense_replace
                and layer % max(1, self.moe_layer_freq or 1) == 0)

    def layer_groups(self) -> list[tuple[int, int]]:
        """[(a layer, how many layers share its tensor shapes)]: one dense and one MoE entry at most,
        counted without walking the layers (a config may claim millions of them)."""
        L = self.num_hidden_layers
        n_moe = 0
        if self.has_moe:
            freq, fk = max(1, self.moe_layer_freq or 1), self.first_k_dense_replace or 0
            first = -(-fk // freq) * freq                   # the first multiple of freq at or after fk
            n_moe = 0 if first >= L else (L - 1 - first) // freq + 1
        groups = [(first, n_moe)] if n_moe else []
        if L - n_moe:
            groups.append((0 if not self.is_moe_layer(0) else 1, L - n_moe))
        return groups

    @property
    def router_method(self) -> str:
        if self.model_type != "deepseek_v2":
            return "noaux_tc"
        if self.topk_method == "group_limited_greedy":
            return "group_limited"
        if self.topk_method == "greedy":
            return "softmax"
        raise CpumlaError(f"config: topk_method '{self.topk_method}' is not supported for {self.model_type}")



def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(cfg: Config) -> tuple[np.ndarray, float]:
    """(inv_freq [P/2] float32, cos/sin multiplier). YaRN as DeepSeek uses it (spec 1.4)."""
    dim, base = cfg.qk_rope_head_dim, float(cfg.rope_theta)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrap = (1.0 / pos_freqs).astype(np.float32)
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if not rs or kind == "default":
        return extrap, 1.0
    if kind != "yarn":
        raise CpumlaError(f"config: rope_scaling type '{kind}' is not supported (yarn only)")
    factor = float(rs.get("factor") or cfg.max_position_embeddings / rs["original_max_position_embeddings"])
    l0 = float(rs["original_max_position_embeddings"])
    beta_fast, beta_slow = float(rs.get("beta_fast") or 32), float(rs.get("beta_slow") or 1)

    def corr(n):
        return dim * math.log(l0 / (n * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    interp = (1.0 / (factor * pos_freqs)).astype(np.float32)
    inv_freq = (interp * ramp + extrap * (1 - ramp)).astype(np.float32)
    mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
    attn = rs.get("attention_factor")
    if attn is None:
        attn = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)) if (mscale and mscale_all) \
            else _yarn_mscale(factor)
    return inv_freq, float(attn)


def softmax_scale(cfg: Config) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (spec 1.5)."""
    scale = cfg.qk_head_dim ** -0.5
    rs = cfg.rope_scaling or {}
    if rs and rs.get("rope_type", rs.get("type", "default")) != "default" and rs.get("mscale_all_dim"):
        m = _yarn_mscale(float(rs["factor"]), float(rs["mscale_all_dim"]))
        scale *= m * m
    return scale


def fit_overrides(cfg: dict, overrides: dict) -> dict:
    """vLLM-style shrinking (`{"n_routed_experts": 4}` on V2-Lite's top-6) leaves routing settings the
    smaller expert count cannot satisfy; fit them, as vLLM's dummy runs do: top_k <= experts, and groups
    that divide the experts (at least two per group for V3's top-2 group score). Only when the overrides
    changed the expert count: a real config that is inconsistent stays an error. Values that are not
    positive integers are left as they are, for the validator to name."""
    E = cfg.get("n_routed_experts")
    if "n_routed_experts" not in overrides or not (is_int(E) and 0 < E <= MAX_SIZE):
        return cfg
    k = cfg.get("num_experts_per_tok")
    if is_int(k) and k > 0 and "num_experts_per_tok" not in overrides:
        cfg["num_experts_per_tok"] = min(k, E)
    g, tg = cfg.get("n_group") or 1, cfg.get("topk_group") or 1
    if is_int(g) and is_int(tg) and 1 < g <= MAX_SIZE and "n_group" not in overrides:
        min_per = 1 if cfg.get("model_type") == "deepseek_v2" else 2
        g = max([d for d in range(1, g + 1) if E % d == 0 and E // d >= min_per] or [1])
        cfg["n_group"] = g
        cfg["topk_group"] = min(tg, g)
    return cfg


# ---- the model: weights in place, their native description, the native state ----------------------
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
    kv_b: native.Weight | None    # [H*(dn+dv), R]: per head dn rows of W_UK then dv rows of W_UV (or k_b, v_b)
    o_proj: native.Weight         # [D, H*dv]
    mlp: native.Experts | None    # dense layer: a table of one
    gate: native.Weight | None    # [E, D] router, kept as stored (run on fp32 activations)
    router: native.Router | None
    experts: native.Experts | None
    shared: native.Experts | None
    # W_UK and W_UV as a GGUF file splits them, kv_b then None: k_b [H*R, dn] (per head W_UK transposed),
    # v_b [H*dv, R], read in place by both forms of the attention (the un-absorbed one dequantizes a
    # head's rows at a time)
    k_b: native.Weight | None = None
    v_b: native.Weight | None = None


def build_router(cfg: Config, bias: np.ndarray | None) -> native.Router:
    # V3: renormalise (norm_topk_prob) then scale. V2's own code: renormalise *or* scale (the released V2
    # checkpoints scale; transformers' V2 always scales).
    v2 = cfg.model_type == "deepseek_v2"
    v2_norm = v2 and bool(cfg.norm_topk_prob) and cfg.num_experts_per_tok > 1
    return native.Router(cfg.router_method, cfg.n_routed_experts, cfg.num_experts_per_tok,
                         n_group=cfg.n_group or 1, topk_group=cfg.topk_group or 1,
                         norm_topk_prob=v2_norm if v2 else bool(cfg.norm_topk_prob),
                         routed_scaling_factor=1.0 if v2_norm else float(cfg.routed_scaling_factor),
                         bias=bias)


def build_layer(cfg: Config, src, layer: int) -> Layer:
    m = tables.checkpoint_name_map(cfg, layer)

    def lin(role):
        return W.linear(src, m[role][0], m[role][1], cfg.block) if role in m else None

    def vec(role):
        return W.vector(src, m[role][0], m[role][1]) if role in m else None

    def table(trios, inter):
        D = cfg.hidden_size
        return native.Experts([(W.linear(src, g, (inter, D), cfg.block), W.linear(src, u, (inter, D), cfg.block),
                                W.linear(src, d, (D, inter), cfg.block)) for g, u, d in trios])

    names = tables.mlp_names(cfg, layer)
    k_b, v_b = split_kv_b(cfg, src, layer)
    router = None
    if "gate" in m:
        router = build_router(cfg, W.as_f32(vec("gate_bias")) if "gate_bias" in m else None)
    return Layer(
        input_ln=vec("input_ln"), post_ln=vec("post_ln"),
        q=lin("q"), q_a=lin("q_a"), q_a_ln=vec("q_a_ln"), q_b=lin("q_b"),
        kv_a=lin("kv_a"), kv_a_ln=vec("kv_a_ln"), kv_b=lin("kv_b") if k_b is None else None, o_proj=lin("o_proj"),
        mlp=table(names["dense"], cfg.intermediate_size) if "dense" in names else None,
        gate=lin("gate"), router=router,
        experts=table(names["experts"], cfg.moe_intermediate_size) if "experts" in names else None,
        shared=table(names["shared"], cfg.moe_intermediate_size * cfg.n_shared_experts)
        if "shared" in names else None,
        k_b=k_b, v_b=v_b,
    )


def split_kv_b(cfg: Config, src, layer: int) -> tuple:
    """(k_b, v_b) where the source holds W_UK and W_UV apart (a GGUF file's attn_k_b / attn_v_b, each in
    its own type), else (None, None)."""
    H, R = cfg.num_attention_heads, cfg.kv_lora_rank
    names = tables.split_kv_b_names(layer)
    if not src.has(names[0]):
        return None, None
    return (W.linear(src, names[0], (H * R, cfg.qk_nope_head_dim)),
            W.linear(src, names[1], (H * cfg.v_head_dim, R)))


class Model(NativeModel):
    """One model of this family: weights read in place, described once to the native forward, and the
    native state (latent caches and scratch) that lives and dies with it. The runtime's interface:
    forward(ids, pos0, out, last_only) -> status, matmul_format, decode_bytes, prefill_flops,
    cache_bytes_per_token, probe_arrays, close."""

    STATE = ("cpumla_dsv2_new", "cpumla_dsv2_free", "cpumla_dsv2_forward")
    HAS_MTP = True           # reads the checkpoint's MTP layer (runtime/speculative.py drafts with it)
    TENSOR_PARALLEL = True   # runs as a rank of tensor parallel (models/shard.py)
    # the native forward that also returns the final hidden states, and the MTP layer's
    HIDDEN_FN, MTP_FN = "cpumla_dsv2_forward_hidden", "cpumla_dsv2_mtp_forward"

    def __init__(self, cfg: Config, src, ctx: int, max_tokens: int, shard: shards.Shard | None = None):
        self.config = cfg
        self.shard = shard           # this rank's part of the model under tensor parallel, else None
        self._comm = None
        D, V = cfg.hidden_size, cfg.vocab_size
        self._embed_w = W.embedding(src, "model.embed_tokens.weight", (V, D))
        self.embed = self._embed_w.data
        self.norm = W.vector(src, "model.norm.weight", (D,))
        head = "lm_head.weight"
        if not src.has(head) and cfg.tie_word_embeddings:
            head = "model.embed_tokens.weight"
        self.lm_head = W.linear(src, head, (V, D), cfg.block)
        self.head_row0 = 0
        if shard is not None:
            self.head_row0, self.lm_head = shards.vocab_rows(self.lm_head, shard, head)
        self.layers = [self.build_layer(src, i) for i in range(cfg.num_hidden_layers)]
        self.mtp = mtp.build(cfg, src, lambda _cfg, s, i: self.build_layer(s, i)) if self.HAS_MTP else None
        self.ctx = ctx
        self._c = self.describe()
        self.start_state(self._c, ctx, max_tokens)

    def build_layer(self, src, i: int) -> Layer:
        L = build_layer(self.config, src, i)
        return L if self.shard is None else shards.layer(L, self.config, i, self.shard)

    def comm_desc(self):
        return self._c

    # ---- speculative decoding (runtime/speculative.py): NativeModel.forward_hidden / mtp_forward ----
    def mtp_bytes(self) -> float:
        """Bytes one MTP draft step reads (models/mtp.py)."""
        return mtp.draft_bytes(self)

    # ---- what the model is made of ----
    @property
    def matmul_format(self) -> str:
        """The weight format of the linear layers ("bf16", "e4m3", ...): that of kv_a_proj."""
        return self.layers[0].kv_a.dtype

    def routed_tables(self) -> list[native.Experts]:
        """The routed expert tables, one per MoE layer, the MTP layer's last (what an ExpertStream may
        keep on disk)."""
        layers = self.layers + ([self.mtp.layer] if self.mtp is not None else [])
        return [L.experts for L in layers if L.experts is not None]

    def probe_arrays(self) -> list[np.ndarray]:
        """The model's largest resident arrays, for a read-bandwidth probe over the memory decode reads."""
        return [self.lm_head.data, self.embed]

    def cache_bytes_per_token(self) -> int:
        cfg = self.config
        return 4 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * (cfg.num_hidden_layers + (self.mtp is not None))

    def layer_weights(self, L: Layer) -> list:
        """The attention-side weights of a layer a decode token reads (the router included): W_UK and
        W_UV from k_b and v_b where the file splits them, else from kv_b."""
        uk_uv = [L.kv_b] if L.k_b is None else [L.k_b, L.v_b]
        return [L.q, L.q_a, L.q_b, L.kv_a, *uk_uv, L.o_proj, L.gate]

    def attended(self, depth: int) -> int:
        """Cache rows one query at cache depth `depth` attends to."""
        return depth + 1

    def layer_read_bytes(self, L: Layer) -> int:
        """Weight bytes one token reads in layer L: its attention weights and router, its dense MLP or
        shared experts, top_k of its routed experts."""
        total = sum(w.nbytes for w in self.layer_weights(L) if w is not None)
        total += sum(t.expert_bytes * t.n for t in (L.mlp, L.shared) if t is not None)
        if L.experts is not None:
            total += L.experts.expert_bytes * self.config.num_experts_per_tok
        return total

    def decode_bytes(self, depth: int) -> float:
        """Bytes one decode token reads at cache depth `depth`: every attention and dense weight, the
        top_k routed experts plus shared experts and router of MoE layers, one embedding row, the lm_head,
        and the cache rows it attends to."""
        cfg = self.config
        total = self.lm_head.nbytes + self.embed.nbytes / cfg.vocab_size
        total += sum(self.layer_read_bytes(L) for L in self.layers)
        row = 4 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        return total + cfg.num_hidden_layers * row * self.attended(depth)

    @property
    def mha_min_tokens(self) -> int:
        """Chunks of n > 1 tokens with n >= this attend un-absorbed (cpumla_mla_mha); 0: the default."""
        return self._c.mha_min_tokens

    @mha_min_tokens.setter
    def mha_min_tokens(self, k: int) -> None:
        self._c.mha_min_tokens = int(k)

    def unabsorbed(self, n: int) -> bool:
        return bool(native.lib.cpumla_dsv2_unabsorbed(self._c, n))

    def prefill_flops(self, n: int, depth: int) -> float:
        """Multiply-adds x 2 of a prefill of n tokens after `depth` cached ones, in PREFILL_CHUNK chunks:
        the weight products of every token (routed experts at top_k) plus each chunk's attention in its
        form: absorbed (absorb + un-absorb per token, R+P scores and R values per pair) or un-absorbed
        (kv_b over every cached row, dn+P scores and dv values per pair)."""
        cfg = self.config
        macs = self.lm_head.rows * self.lm_head.cols / n       # lm_head on the last token only
        H, dn, dv, R = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        P = cfg.qk_rope_head_dim
        for L in self.layers:
            macs += sum(w.rows * w.cols for w in self.layer_weights(L)
                        if w is not None and all(w is not u for u in (L.kv_b, L.k_b, L.v_b)))
            for t in (L.mlp, L.shared):
                if t is not None:
                    macs += 3 * t.hidden * t.intermediate * t.n
            if L.experts is not None:
                macs += 3 * L.experts.hidden * L.experts.intermediate * cfg.num_experts_per_tok
        attn = 0.0
        for c0 in range(0, n, PREFILL_CHUNK):
            c, d = min(PREFILL_CHUNK, n - c0), depth + c0
            pairs = sum(self.attended(d + i) for i in range(c))   # (query, key) pairs
            if self.unabsorbed(c):
                attn += (d + c) * H * (dn + dv) * R + pairs * H * (dn + P + dv)
            else:
                attn += c * H * (dn + dv) * R + pairs * H * (2 * R + P)
        return 2.0 * macs * n + 2.0 * attn * cfg.num_hidden_layers

    # ---- the native description, built once ----
    def describe_base(self, m) -> None:
        """Fills a cpumla_dsv2_model (m) with pointers to the weights in place (kept alive by self)."""
        ffi, cfg = native.ffi, self.config
        layers = ffi.new("cpumla_dsv2_layer[]", len(self.layers))
        for i, L in enumerate(self.layers):
            self.describe_layer(layers[i], L)
        world = self.shard.world if self.shard is not None else 1
        m.n_layers, m.hidden, m.n_heads = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads // world
        m.head_row0 = self.head_row0
        m.q_lora_rank, m.kv_lora_rank = cfg.q_lora_rank or 0, cfg.kv_lora_rank
        m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        m.vocab = cfg.vocab_size
        m.rms_norm_eps, m.softmax_scale, m.rope_attn_scale = cfg.rms_norm_eps, cfg.softmax_scale, cfg.rope_attn_scale
        self._inv_freq = np.ascontiguousarray(cfg.inv_freq, dtype=np.float32)
        m.inv_freq = native.fptr(self._inv_freq)
        m.embed, m.lm_head = self._embed_w.c, self.lm_head.c
        native.set_vec(m.norm, self.norm)
        m.layers = layers
        self._layers_c = layers
        if self.mtp is not None:
            self._mtp_c = m.mtp = mtp.describe(self.mtp, self.describe_layer)

    @staticmethod
    def describe_layer(c, L: Layer) -> None:
        """Fills a cpumla_dsv2_layer (c) from L."""
        ffi = native.ffi
        for name in ("input_ln", "post_ln", "q_a_ln", "kv_a_ln"):
            v = getattr(L, name)
            if v is not None:
                native.set_vec(getattr(c, name), v)
        for name in ("q", "q_a", "q_b", "kv_a", "kv_b", "k_b", "v_b", "o_proj", "gate"):
            w = getattr(L, name)
            setattr(c, name, w.c if w is not None else ffi.NULL)
        c.router = L.router.c if L.router is not None else ffi.NULL
        c.experts = L.experts.c if L.experts is not None else ffi.NULL
        mlp = L.mlp if L.mlp is not None else L.shared
        c.mlp = mlp.c if mlp is not None else ffi.NULL

    def describe(self):
        m = native.ffi.new("cpumla_dsv2_model *")
        self.describe_base(m)
        return m
