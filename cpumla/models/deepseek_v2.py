"""DeepSeek-V2 / V2-Lite config and the MLA model description shared by V3 (deepseek_v3.py).

Field names are the Hugging Face config.json names, verbatim; unknown keys are ignored. Derived values
(rope frequencies, softmax scale, router) are computed once here, so the runtime never re-reads the
config. Cross-read with transformers/models/deepseek_v2/modeling_deepseek_v2.py.

D=hidden H=heads R=kv_lora_rank P=qk_rope_head_dim dn=qk_nope_head_dim dv=v_head_dim E=experts K=top_k
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from cpumla.errors import CpumlaError

SUPPORTED = ("deepseek_v2", "deepseek_v3")
NOT_YET = {"deepseek_v32": "DeepSeek-V3.2", "deepseek_v4": "DeepSeek-V4"}


@dataclass
class MLAConfig:
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

    # ---- derived, set in __post_init__ ----
    def __post_init__(self):
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.inv_freq, self.rope_attn_scale = rope_frequencies(self)
        self.softmax_scale = softmax_scale(self)
        self.block = tuple((self.quantization_config or {}).get("weight_block_size") or (128, 128))

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "MLAConfig":
        if not isinstance(d, dict):
            raise CpumlaError(f"{source}: expected a JSON object")
        mt = d.get("model_type")
        if mt in NOT_YET:
            raise CpumlaError(f"{source}: model_type '{mt}' ({NOT_YET[mt]}) is not supported yet")
        if mt not in SUPPORTED:
            raise CpumlaError(f"{source}: unsupported model_type '{mt}' (supported: {', '.join(SUPPORTED)})")
        d = dict(d)
        rp = d.get("rope_parameters")           # transformers 5 folds rope_theta/rope_scaling in here
        if isinstance(rp, dict):
            d.setdefault("rope_theta", rp.get("rope_theta", 10000.0))
            if rp.get("rope_type", rp.get("type", "default")) != "default" and not d.get("rope_scaling"):
                d["rope_scaling"] = rp
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in d.items() if k in names}
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   and f.name not in kwargs]
        if missing:
            raise CpumlaError(f"{source}: missing field '{missing[0]}'")
        for f in dataclasses.fields(cls):
            if f.name in kwargs and f.type in ("int", "float") and not isinstance(kwargs[f.name], (int, float)):
                raise CpumlaError(f"{source}: field '{f.name}' must be a number, got {kwargs[f.name]!r}")
        cfg = cls(**kwargs, extra={k: v for k, v in d.items() if k not in names})
        cfg.validate(source)
        return cfg

    def validate(self, source: str) -> None:
        def need(ok, msg):
            if not ok:
                raise CpumlaError(f"{source}: {msg}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                     "qk_rope_head_dim", "v_head_dim"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) > 0, f"'{name}' must be a positive integer")
        need(self.qk_rope_head_dim % 2 == 0, "'qk_rope_head_dim' must be even")
        if self.has_moe:
            need(self.num_experts_per_tok and 0 < self.num_experts_per_tok <= self.n_routed_experts,
                 "'num_experts_per_tok' must be between 1 and n_routed_experts")
            need(self.moe_intermediate_size > 0, "'moe_intermediate_size' must be positive")
            if self.router_method in ("group_limited", "noaux_tc") and (self.n_group or 1) > 1:
                g = self.n_group
                need(self.n_routed_experts % g == 0, f"n_routed_experts {self.n_routed_experts} is not divisible by n_group {g}")
                need(self.topk_group and 1 <= self.topk_group <= g, "'topk_group' must be between 1 and n_group")
        qc = self.quantization_config
        if qc and qc.get("quant_method") not in (None, "fp8"):
            raise CpumlaError(f"{source}: quantization '{qc.get('quant_method')}' is not supported (fp8 block only)")

    # ---- structure ----
    @property
    def has_moe(self) -> bool:
        return bool(self.n_routed_experts)

    def is_moe_layer(self, layer: int) -> bool:
        return (self.has_moe and layer >= self.first_k_dense_replace
                and layer % max(1, self.moe_layer_freq or 1) == 0)

    @property
    def router_method(self) -> str:
        if self.model_type == "deepseek_v3":
            return "noaux_tc"
        if self.topk_method == "group_limited_greedy":
            return "group_limited"
        if self.topk_method == "greedy":
            return "softmax"
        raise CpumlaError(f"config: topk_method '{self.topk_method}' is not supported for {self.model_type}")

    @property
    def eos_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else (list(e) if isinstance(e, list) else [e])

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return {**self.extra, **d}


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(cfg: MLAConfig) -> tuple[np.ndarray, float]:
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


def softmax_scale(cfg: MLAConfig) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (spec 1.5)."""
    scale = cfg.qk_head_dim ** -0.5
    rs = cfg.rope_scaling or {}
    if rs and rs.get("rope_type", rs.get("type", "default")) != "default" and rs.get("mscale_all_dim"):
        m = _yarn_mscale(float(rs["factor"]), float(rs["mscale_all_dim"]))
        scale *= m * m
    return scale


def checkpoint_name_map(cfg: MLAConfig, layer: int) -> dict[str, tuple[str, tuple[int, ...]]]:
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
        if cfg.model_type == "deepseek_v3":
            m["gate_bias"] = (p + "mlp.gate.e_score_correction_bias", (cfg.n_routed_experts,))
    return m


def mlp_names(cfg: MLAConfig, layer: int) -> dict[str, list[tuple[str, str, str]]]:
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
