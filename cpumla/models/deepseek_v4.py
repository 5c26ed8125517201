"""DeepSeek-V4 Flash / Pro (`deepseek_v4`): mHC residual streams, shared-KV attention with sinks over a
sliding window plus compressed entries (CSA: ratio 4 with overlap and a lightning indexer; HCA: ratio
128), MoE on every layer (sqrt-softplus + bias, or token-id hash routing on the first layers). The
native forward is deepseek_v4.c / deepseek_v4_attn.c; deepseek_v4.h has the math.

Cross-read with transformers/models/deepseek_v4 (modeling and configuration).

Checkpoints: the official release names (`layers.N.attn.wq_a.weight`, no `model.` prefix) with FP8
e4m3 linears (E8M0 `.scale` per 128x128 block), FP4 e2m1 routed experts (two per byte, stored as I8,
E8M0 `.scale` per 1x32; the -Base releases ship them as FP8 e4m3 like the other linears, `expert_dtype`
fp8), bf16 compressor / indexer projections, fp32 mHC / sink / `ape` / bias tensors and an I64
`tid2eid`; the MTP layer `mtp.0.*` when the checkpoint has it (deepseek_v4_mtp.py). A checkpoint written
by transformers' save_pretrained uses the same names under `model.` (except `head.weight`),
`model.embed_tokens`, `model.hc_head.hc_*` and `attn.norm` for the attention's `attn.kv_norm`; both
spellings are accepted, tensor by tensor.

Config (deepseek_v4_config.py): the official keys and transformers'. Sliding-window layers use RoPE at
`rope_theta` without scaling; compressed layers use `compress_rope_theta` with YaRN (cos/sin unscaled).

State across calls: the window ring and the compressor input rings keep about one prefill chunk more
than a query needs, so a truncate that rolls back at most that far continues in place (entries whose
window the rollback reopens are emitted again); a deeper truncate replays the kept token ids from
position 0 (cpumla_dsv4_resumable says which).
"""

from __future__ import annotations

import math

import numpy as np

from cpumla import native
from cpumla.checkpoint import tensors as W
from cpumla.errors import CpumlaError
from cpumla.models.deepseek_v4_tensors import (  # noqa: F401  (the family's interface)
    Names,
    has_mtp,
    is_mtp,
    layer_prefix,
    layer_tensors,
    linear,
    memory_bytes,
    stored_name,
    tensors,
    vector,
)
from cpumla.models import deepseek_v4_mtp as v4_mtp
from cpumla.models import shard as shards
from cpumla.models.deepseek_v4_config import (  # noqa: F401  (the family's interface)
    MODEL_TYPES,
    QUANTIZABLE,
    Config,
    fit_overrides,
)
from cpumla.models.native_model import NativeModel

# ---- the model ---------------------------------------------------------------------------------------
class Model(NativeModel):
    """A V4 model: weights in place, their native description, and the native state (window rings,
    compressed caches, compressor rings, scratch). The runtime's interface is deepseek_v2.Model's."""

    STATE = ("cpumla_dsv4_new", "cpumla_dsv4_free", "cpumla_dsv4_forward")
    HIDDEN_FN, MTP_FN = "cpumla_dsv4_forward_hidden", "cpumla_dsv4_mtp_forward"   # its MTP layer (`mtp.0.*`)
    TENSOR_PARALLEL = True   # runs as a rank of tensor parallel: whole output groups, experts' slices

    def __init__(self, cfg: Config, src, ctx: int, max_tokens: int, shard: shards.Shard | None = None):
        self.config = cfg
        self.shard = shard
        self._comm = None
        names = Names(src)
        D, V, N = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
        self.keep: list = []
        self._embed_w = W.embedding(src, names("embed.weight"), (V, D))   # a GGUF file's may be K-quant
        self.embed = self._embed_w.data
        self.lm_head = linear(src, names, "head.weight", (V, D), cfg.block)
        self.head_row0 = 0
        if shard is not None:
            self.head_row0, self.lm_head = shards.vocab_rows(self.lm_head, shard, "head.weight")
        self.norm = vector(src, names, "norm.weight", (D,))
        ffi = native.ffi
        m = ffi.new("cpumla_dsv4_model *")
        self._m = m
        m.embed, m.lm_head = self._embed_w.c, self.lm_head.c
        native.set_vec(m.norm, self.norm)
        self._hc(m.hc_head, src, names, "hc_head_fn", "hc_head_base", "hc_head_scale", N, 1)
        self.layers = []
        layers = ffi.new("cpumla_dsv4_layer[]", cfg.num_hidden_layers)
        for i in range(cfg.num_hidden_layers):
            self.layers.append(self.build_layer(layers[i], src, names, i))
        self._layers_c = layers
        m.layers = layers
        self.mtp = v4_mtp.build(self, src, names)
        m.mtp = self.mtp.c if self.mtp is not None else ffi.NULL
        m.n_layers, m.hidden, m.vocab, m.hc_mult = cfg.num_hidden_layers, D, V, N
        world = shard.world if shard is not None else 1
        m.hc_sinkhorn_iters, m.n_heads, m.head_dim, m.rope_dim = cfg.hc_sinkhorn_iters, \
            cfg.num_attention_heads // world, cfg.head_dim, cfg.rope_dim
        m.q_lora_rank, m.o_groups, m.o_lora_rank = cfg.q_lora_rank, cfg.o_groups // world, cfg.o_lora_rank
        m.head_row0 = self.head_row0
        m.sliding_window, m.index_n_heads, m.index_head_dim = cfg.sliding_window, cfg.index_n_heads, cfg.index_head_dim
        m.index_topk = cfg.index_topk
        m.rms_norm_eps, m.hc_eps, m.swiglu_limit = cfg.rms_norm_eps, cfg.hc_eps, float(cfg.swiglu_limit or 0.0)
        self.ctx, self.max_tokens = ctx, max_tokens
        self._hist = np.zeros(ctx, np.int64)          # token ids by position, for replays after a deep truncate
        self.start_state(m, ctx, max_tokens)

    # ---- building ----
    def _hc(self, c, src, names, fn, base, scale, rows, n_scale):
        cfg = self.config
        N, D = cfg.hc_mult, cfg.hidden_size
        w = linear(src, names, fn, (rows, N * D), cfg.block)
        b, s = vector(src, names, base, (rows,)), vector(src, names, scale, (n_scale,))
        self.keep += [w, b, s]
        c.fn = w.c
        native.set_vec(c.base, b)
        native.set_vec(c.scale, s)
        return w

    def _vec(self, c, src, names, name, shape):
        v = vector(src, names, name, shape)
        self.keep.append(v)
        native.set_vec(c, v)
        return v

    def build_layer(self, c, src, names, l: int) -> dict:
        cfg = self.config
        t = layer_tensors(cfg, l)
        N = cfg.hc_mult
        p = layer_prefix(cfg, l)
        a, f = p + "attn.", p + "ffn."
        ratio, csa, hashed = cfg.layer_kind(l)

        def lin(name):
            w = linear(src, names, name, t[name][0], cfg.block)
            return w if self.shard is None else self._part(w, name)

        L: dict = {}
        c.ratio, c.csa = ratio, int(csa)
        L["hc"] = [self._hc(c.hc_attn, src, names, p + "hc_attn_fn", p + "hc_attn_base", p + "hc_attn_scale", (2 + N) * N, 3),
                   self._hc(c.hc_ffn, src, names, p + "hc_ffn_fn", p + "hc_ffn_base", p + "hc_ffn_scale", (2 + N) * N, 3)]
        self._vec(c.attn_norm, src, names, p + "attn_norm.weight", t[p + "attn_norm.weight"][0])
        self._vec(c.ffn_norm, src, names, p + "ffn_norm.weight", t[p + "ffn_norm.weight"][0])
        for role in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b"):
            L[role] = lin(a + role + ".weight")
            setattr(c, role, L[role].c)
        for role in ("q_norm", "kv_norm"):
            self._vec(getattr(c, role), src, names, a + role + ".weight", t[a + role + ".weight"][0])
        sinks = W.as_f32(vector(src, names, a + "attn_sink", t[a + "attn_sink"][0]))
        if self.shard is not None:
            h0, h1 = self._heads
            sinks = np.ascontiguousarray(sinks[h0:h1])
        self.keep.append(sinks)
        native.set_vec(c.sinks, np.ascontiguousarray(sinks))
        freq = cfg.compress_inv_freq if ratio else cfg.main_inv_freq
        self.keep.append(freq)
        c.inv_freq, c.rope_scale = native.fptr(freq), cfg.compress_scale if ratio else cfg.main_scale
        L["attn"] = [L[r] for r in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")]
        if ratio:
            L["attn"] += self._comp(c.comp, src, names, a + "compressor.", t, lin)
        if csa:
            L["attn"] += self._comp(c.icomp, src, names, a + "indexer.compressor.", t, lin)
            iq, ip = lin(a + "indexer.wq_b.weight"), lin(a + "indexer.weights_proj.weight")
            c.index_wq_b, c.index_proj = iq.c, ip.c
            L["attn"] += [iq, ip]
        gate = lin(f + "gate.weight")
        E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
        if hashed:
            name = names(f + "gate.tid2eid")
            dtype, shape = src.info(name)
            if dtype not in ("I64", "I32") or tuple(shape) != (cfg.vocab_size, K):
                raise CpumlaError(f"{W.where(src, name)}: tensor '{name}' must be I64 [{cfg.vocab_size}, {K}], "
                                  f"got {dtype} {list(shape)}")
            table = src.tensor(name)
            lo, hi = int(table.min()), int(table.max())
            if lo < 0 or hi >= E:
                raise CpumlaError(f"{W.where(src, name)}: tensor '{name}' names expert {lo if lo < 0 else hi}, "
                                  f"outside the {E} routed experts")
            router = native.Router("hash", E, K, norm_topk_prob=bool(cfg.norm_topk_prob),
                                   routed_scaling_factor=float(cfg.routed_scaling_factor), tid2eid=table)
        else:
            bias = W.as_f32(vector(src, names, f + "gate.bias", (E,)))
            router = native.Router("sqrtsoftplus", E, K, norm_topk_prob=bool(cfg.norm_topk_prob),
                                   routed_scaling_factor=float(cfg.routed_scaling_factor), bias=bias)
        experts = native.Experts([(lin(f"{f}experts.{e}.w1.weight"), lin(f"{f}experts.{e}.w3.weight"),
                                   lin(f"{f}experts.{e}.w2.weight")) for e in range(E)])
        shared = None
        if cfg.n_shared_experts:
            shared = native.Experts([(lin(f + "shared_experts.w1.weight"), lin(f + "shared_experts.w3.weight"),
                                      lin(f + "shared_experts.w2.weight"))])
        c.gate, c.router, c.experts = gate.c, router.c, experts.c
        c.shared = shared.c if shared is not None else native.ffi.NULL
        L.update(gate=gate, router=router, experts=experts, shared=shared)
        return L

    def comm_desc(self):
        return self._m

    @property
    def _heads(self) -> tuple[int, int]:
        """This rank's heads [h0, h1): those of its whole output groups."""
        cfg = self.config
        g0, g1 = self.shard.part(cfg.o_groups, "output groups (o_groups)")
        per = cfg.num_attention_heads // cfg.o_groups
        return g0 * per, g1 * per

    def _part(self, w, name: str):
        """This rank's slice of the tensor `name` (official name; models/shard.py says what is split)."""
        cfg, shard = self.config, self.shard
        try:
            if ".attn.wq_b." in name:
                h0, h1 = self._heads
                return w.part(0, h0 * cfg.head_dim, h1 * cfg.head_dim, name)
            if ".attn.wo_a." in name or ".attn.wo_b." in name:       # a group's OL rows / columns
                g0, g1 = shard.part(cfg.o_groups, "output groups (o_groups)")
                return w.part(0 if ".wo_a." in name else 1, g0 * cfg.o_lora_rank, g1 * cfg.o_lora_rank, name)
            if ".experts." in name or ".shared_experts." in name:
                a, b = shard.part(w.cols if name.endswith("w2.weight") else w.rows,
                                  f"the intermediate size of {name.rsplit('.', 2)[0]}")
                return w.part(1 if name.endswith("w2.weight") else 0, a, b, name)
        except CpumlaError as e:
            raise shard.error(e) from None
        return w

    def _comp(self, c, src, names, prefix, t, lin):
        wkv, wgate = lin(prefix + "wkv.weight"), lin(prefix + "wgate.weight")
        c.wkv, c.wgate = wkv.c, wgate.c
        ape = W.table(src, names(prefix + "ape"), t[prefix + "ape"][0])
        self.keep.append(ape)
        native.set_vec(c.ape, ape)
        self._vec(c.norm, src, names, prefix + "norm.weight", t[prefix + "norm.weight"][0])
        return [wkv, wgate]

    # ---- running ----
    def forward(self, ids: np.ndarray, pos0: int, out: np.ndarray, last_only: bool) -> None:
        """Appends ids at pos0 and writes their logits into out. A pos0 the state cannot continue from
        (a truncate deeper than its rings) first replays the kept token ids before pos0."""
        self._resume(pos0)
        self.call_state(ids, pos0, out, last_only)
        self._hist[pos0:pos0 + ids.size] = ids

    def forward_hidden(self, ids: np.ndarray, pos0: int, out: np.ndarray, last_only: bool, hidden: np.ndarray) -> None:
        """forward() that also writes every token's residual streams after the last layer into hidden
        [n, N*D] (what the MTP layer takes)."""
        self._resume(pos0)
        super().forward_hidden(ids, pos0, out, last_only, hidden)
        self._hist[pos0:pos0 + ids.size] = ids

    def _resume(self, pos0: int) -> None:
        if self._state is None:
            raise CpumlaError("this model has been closed")
        if not native.lib.cpumla_dsv4_resumable(self._state, pos0):
            scratch = np.empty((1, self.config.vocab_size), np.float32)
            for c0 in range(0, pos0, self.max_tokens):
                part = np.ascontiguousarray(self._hist[c0:min(pos0, c0 + self.max_tokens)])
                self.call_state(part, c0, scratch, True)

    @property
    def mtp_width(self) -> int:
        """Floats of one position's hidden input to the MTP layer: its N residual streams."""
        return self.config.hc_mult * self.config.hidden_size

    def mtp_bytes(self) -> float:
        """Bytes one MTP draft step reads (models/deepseek_v4_mtp.py)."""
        return v4_mtp.draft_bytes(self)

    # ---- what the model is made of (cpumla bench) ----
    @property
    def matmul_format(self) -> str:
        """The format of the attention's linears (e4m3 in the official release)."""
        return self.layers[0]["wq_a"].dtype

    def routed_tables(self) -> list[native.Experts]:
        """The routed expert tables, one per layer, the MTP layer's last (what an ExpertStream may keep
        on disk)."""
        return [L["experts"] for L in self.layers + ([self.mtp.layer] if self.mtp is not None else [])]

    def probe_arrays(self) -> list[np.ndarray]:
        return [self.lm_head.data, self.embed]

    def _cache_rows(self, l: int, depth: int) -> tuple[int, int]:
        """(compressed KV rows, index-key rows) that a query at cache depth `depth` reads in layer l."""
        cfg = self.config
        r = cfg.ratios[l]
        if not r:
            return 0, 0
        vis = (depth + 1) // r
        return (min(vis, cfg.index_topk), vis) if cfg.csa[l] else (vis, 0)

    def cache_bytes_per_token(self) -> int:
        """Compressed cache bytes per token (fp32 rows), amortised: hd per r tokens, plus ID per 4 for CSA.
        The window rings and compressor rings are a fixed cost on top (state_bytes)."""
        cfg = self.config
        total = 0.0
        for l, r in enumerate(cfg.ratios):
            if r:
                total += 4.0 * (cfg.head_dim + (cfg.index_head_dim if cfg.csa[l] else 0)) / r
        return int(math.ceil(total))

    def decode_bytes(self, depth: int) -> float:
        """Bytes one decode token reads at depth `depth`: every attention-side weight (compressors,
        indexer, mHC included), the router, top_k routed and the shared experts of every layer, one
        embedding row, the head, the window rows, the compressed rows attended and every visible index key."""
        cfg = self.config
        total = self.lm_head.nbytes + self.embed.nbytes / cfg.vocab_size + sum(w.nbytes for w in self.keep
                                                                               if isinstance(w, native.Weight))
        hd, ID = cfg.head_dim, cfg.index_head_dim
        for l, L in enumerate(self.layers):
            total += self.layer_read_bytes(L)
            rows, keys = self._cache_rows(l, depth)
            total += 4.0 * hd * (min(depth + 1, cfg.sliding_window) + rows) + 4.0 * ID * keys
        return total

    def layer_read_bytes(self, L: dict) -> float:
        """Weight bytes one token reads in layer L besides its mHC: the attention side, the router, top_k
        routed experts and the shared expert."""
        total = sum(w.nbytes for w in L["attn"]) + L["gate"].nbytes
        total += L["experts"].expert_bytes * self.config.num_experts_per_tok
        return total + (L["shared"].expert_bytes if L["shared"] is not None else 0)

    def prefill_flops(self, n: int, depth: int) -> float:
        """2 x multiply-adds of a prefill of n tokens after `depth`: every weight product per token
        (routed experts at top_k, the head on the last token), attention over the window and the
        attended compressed rows (2*hd per head and row), index scores over the visible keys."""
        cfg = self.config
        macs = self.lm_head.rows * self.lm_head.cols / n
        macs += sum(w.rows * w.cols for w in self.keep if isinstance(w, native.Weight))
        H, hd, IH, ID = cfg.num_attention_heads, cfg.head_dim, cfg.index_n_heads, cfg.index_head_dim
        attn = 0.0
        for l, L in enumerate(self.layers):
            macs += sum(w.rows * w.cols for w in L["attn"]) + L["gate"].rows * L["gate"].cols
            ex = L["experts"]
            macs += 3 * ex.hidden * ex.intermediate * cfg.num_experts_per_tok
            if L["shared"] is not None:
                macs += 3 * L["shared"].hidden * L["shared"].intermediate
            for i in range(n):
                rows, keys = self._cache_rows(l, depth + i)
                attn += 2.0 * H * 2 * hd * (min(depth + i + 1, cfg.sliding_window) + rows) + 2.0 * IH * ID * keys
        return 2.0 * macs * n + attn
