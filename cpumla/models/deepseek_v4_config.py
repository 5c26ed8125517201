"""DeepSeek-V4's config: both the official keys (`compress_ratios` per layer with 0 / 4 / 128,
`num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`) and transformers' (`layer_types`, `compress_rates`,
`mlp_layer_types`, `partial_rotary_factor`, nested `rope_parameters`), checked, and what is derived from
them: each layer's kind (ratio, CSA, hash routing), the MTP layer's, the two RoPEs."""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, field

import numpy as np

from cpumla.errors import CpumlaError
from cpumla.models import deepseek_v2 as v2
from cpumla.models.checks import is_int, is_real, needer, short, validate_rope_scaling
from cpumla.models.native_model import ConfigBase

MODEL_TYPES = ("deepseek_v4",)
QUANTIZABLE = False      # --quant / `cpumla quantize`: not for V4 yet (its experts ship as FP4 already)
LAYER_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


@dataclass
class Config(ConfigBase):
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    head_dim: int = 512
    qk_rope_head_dim: int | None = None
    partial_rotary_factor: float | None = None
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    num_hash_layers: int | None = None
    mlp_layer_types: list | None = None
    compress_ratios: list | None = None
    layer_types: list | None = None
    compress_rates: dict | None = None
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    sliding_window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-6
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    tie_word_embeddings: bool = False
    quantization_config: dict | None = None
    expert_dtype: str | None = None
    num_nextn_predict_layers: int = 0
    extra: dict = field(default_factory=dict, repr=False)

    MODEL_TYPES = MODEL_TYPES

    # the fields' tables (models/checks.py's validate_fields)
    SIZES = {**{k: (1, False) for k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "moe_intermediate_size",
        "n_routed_experts", "num_experts_per_tok", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "hc_mult",
        "hc_sinkhorn_iters", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
        "max_position_embeddings")},
        "n_shared_experts": (0, False), "qk_rope_head_dim": (2, True), "num_hash_layers": (0, True),
        "num_nextn_predict_layers": (0, True)}
    REALS = {"routed_scaling_factor": (0.0, False, False), "rope_theta": (0.0, False, False),
             "compress_rope_theta": (0.0, False, False), "rms_norm_eps": (0.0, True, False),
             "hc_eps": (0.0, True, False), "swiglu_limit": (0.0, True, True),
             "partial_rotary_factor": (0.0, False, True)}
    BOOLS = ("norm_topk_prob", "tie_word_embeddings")
    STRINGS = {"scoring_func": False, "expert_dtype": True}

    def derive(self, source: str) -> None:
        """The rules across fields, and the per-layer schedule and the two RoPEs."""
        need = needer(source)
        n = self.num_hidden_layers
        need(self.num_experts_per_tok <= self.n_routed_experts, "'num_experts_per_tok' must not exceed n_routed_experts")
        need(self.num_attention_heads % self.o_groups == 0,
             f"'o_groups' {self.o_groups} does not divide num_attention_heads {self.num_attention_heads}")
        need(self.scoring_func == "sqrtsoftplus", f"'scoring_func' {self.scoring_func!r} is not supported (sqrtsoftplus)")
        if self.qk_rope_head_dim is not None:
            self.rope_dim = self.qk_rope_head_dim
        elif self.partial_rotary_factor is not None:
            self.rope_dim = int(self.head_dim * self.partial_rotary_factor)
        else:
            self.rope_dim = self.head_dim * 64 // 512
        need(isinstance(self.rope_dim, int) and 2 <= self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0,
             f"the rope dims ({self.rope_dim!r}) must be even and within head_dim {self.head_dim}")
        need(self.index_head_dim >= self.rope_dim, f"'index_head_dim' {self.index_head_dim} is below the rope dims {self.rope_dim}")
        rates = dict(DEFAULT_RATES)
        if self.compress_rates is not None:
            need(isinstance(self.compress_rates, dict), "'compress_rates' must be an object")
            rates.update(self.compress_rates)
        for k, v in rates.items():
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"'compress_rates' {k!r} must be a positive integer, got {v!r}")
        if self.layer_types is not None:
            lt = self.layer_types
            need(isinstance(lt, list) and len(lt) >= n and all(t in LAYER_TYPES.values() for t in lt[:n]),
                 f"'layer_types' must name one of {', '.join(LAYER_TYPES.values())} for each of the {n} layers")
            # the MTP layer's entry: the list's last beyond the layers' (a shrunk config keeps the list)
            self.mtp_ratio = rates.get(lt[-1], 0) if len(lt) > n and isinstance(lt[-1], str) else 0
            lt = lt[:n]
        elif self.compress_ratios is not None:
            cr = self.compress_ratios
            need(isinstance(cr, list) and len(cr) >= n, f"'compress_ratios' must list a ratio for each of the {n} layers")
            bad = [r for r in cr[:n] if r not in LAYER_TYPES or isinstance(r, bool)]
            need(not bad, f"'compress_ratios' value {bad[0] if bad else None!r} is not 0, 4 or 128")
            lt = [LAYER_TYPES[r] for r in cr[:n]]
            self.mtp_ratio = cr[-1] if len(cr) > n and isinstance(cr[-1], int) else 0
        else:                      # transformers' default: the Pro pattern
            self.mtp_ratio = 0
            lt = (["heavily_compressed_attention"] * min(n, 2) +
                  ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))])
        self.layer_kinds = lt
        self.ratios = [0 if t == "sliding_attention" else rates[t] for t in lt]
        self.csa = [t == "compressed_sparse_attention" for t in lt]
        if self.mlp_layer_types is not None:
            mt = self.mlp_layer_types
            need(isinstance(mt, list) and len(mt) >= n and all(t in ("hash_moe", "moe") for t in mt[:n]),
                 f"'mlp_layer_types' must be 'hash_moe' or 'moe' for each of the {n} layers")
            self.hash = [t == "hash_moe" for t in mt[:n]]
        else:
            nh = 3 if self.num_hash_layers is None else self.num_hash_layers
            self.hash = [i < nh for i in range(n)]
        qc = self.quantization_config
        need(not qc or qc.get("quant_method") in (None, "fp8"), f"quantization '{(qc or {}).get('quant_method')}' is not supported")
        self.block = tuple((qc or {}).get("weight_block_size") or (128, 128))
        # the routed experts' release format: fp4 (V4-Flash / -Pro) or fp8 (the -Base releases); transformers
        # moves the key into quantization_config
        ed = self.expert_dtype if self.expert_dtype is not None else (qc or {}).get("expert_dtype", "fp4")
        need(ed in ("fp4", "fp8"), f"'expert_dtype' {ed!r} is not fp4 or fp8")
        self.expert_kind = "e2m1" if ed == "fp4" else "e4m3"
        self.main_inv_freq, self.main_scale = self._rope(self.rope_theta, None, source)
        rp = self.rope_parameters if isinstance(self.rope_parameters, dict) else {}
        comp = rp.get("compress") if isinstance(rp.get("compress"), dict) else None
        if comp is None:
            comp = self.rope_scaling if isinstance(self.rope_scaling, dict) else (
                {k: v for k, v in rp.items() if k not in ("main", "compress")} or None)
        theta = (comp or {}).get("rope_theta", self.compress_rope_theta)
        self.compress_inv_freq, self.compress_scale = self._rope(theta, comp, source)

    def layer_kind(self, l: int) -> tuple[int, bool, bool]:
        """(compress ratio, CSA, hash-routed) of layer l; l = num_hidden_layers: the MTP layer's (read only
        when it is a sliding-window layer with biased routing, as the releases' is)."""
        if l < self.num_hidden_layers:
            return self.ratios[l], self.csa[l], self.hash[l]
        return 0, False, False

    def _rope(self, theta, scaling, source):
        need = needer(source)
        need(is_real(theta) and math.isfinite(theta) and theta > 0, f"the compressed layers' 'rope_theta' must be a "
             f"finite number > 0, got {short(theta)}")
        validate_rope_scaling(types.SimpleNamespace(rope_scaling=scaling, rope_theta=theta), need)
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        shim = types.SimpleNamespace(qk_rope_head_dim=self.rope_dim, rope_theta=float(theta),
                                     rope_scaling=scaling if kind == "yarn" else None,
                                     max_position_embeddings=self.max_position_embeddings)
        try:
            inv_freq, _ = v2.rope_frequencies(shim)
        except (KeyError, TypeError, ValueError) as e:
            raise CpumlaError(f"{source}: bad rope scaling {scaling!r} ({e})") from None
        # V4 never scales cos/sin by YaRN's mscale (transformers pins attention_factor to 1)
        return np.ascontiguousarray(inv_freq, np.float32), float((scaling or {}).get("attention_factor", 1.0)) \
            if kind == "yarn" else 1.0


def fit_overrides(cfg: dict, overrides: dict) -> dict:
    """Shrinking the experts keeps top-k within them (as the V2/V3 family does)."""
    E, k = cfg.get("n_routed_experts"), cfg.get("num_experts_per_tok")
    if "n_routed_experts" in overrides and "num_experts_per_tok" not in overrides and is_int(E) and is_int(k) and E > 0:
        cfg["num_experts_per_tok"] = min(k, E)
    return cfg
