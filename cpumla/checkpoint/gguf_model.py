"""A GGUF model (gguf.py) as a Hugging Face checkpoint: the config dict its family module takes, built from
the file's metadata, and its tensors under the names that family reads.

What llama.cpp's converter (convert_hf_to_gguf.py, DeepseekV2Model) writes for `deepseek2` and how it maps
back here:
  - sizes: {arch}.block_count, embedding_length, feed_forward_length, context_length, vocab_size,
    attention.head_count, attention.q_lora_rank (absent: no q LoRA, V2-Lite / Moonlight),
    attention.kv_lora_rank, rope.dimension_count (qk_rope_head_dim). qk_nope_head_dim and v_head_dim
    from attention.key_length_mla - rope dims and value_length_mla, or, in files written before those
    keys, from key_length - rope dims and value_length.
  - MoE: expert_count, expert_used_count, expert_shared_count, expert_feed_forward_length,
    leading_dense_block_count (first_k_dense_replace), expert_group_count / expert_group_used_count
    (n_group / topk_group), expert_weights_scale (routed_scaling_factor, 1 when absent),
    expert_weights_norm (norm_topk_prob), expert_gating_func (1 softmax, 2 sigmoid; absent: sigmoid
    when the file has exp_probs_b biases, else softmax). Sigmoid is DeepSeek-V3's noaux_tc routing
    (model_type deepseek_v3); softmax V2's (deepseek_v2: group_limited_greedy with several groups,
    else greedy).
  - rope: rope.freq_base; YaRN from rope.scaling.type "yarn", .factor, .original_context_length,
    .yarn_beta_fast / _slow, and .yarn_log_multiplier, which the converter writes as 0.1 *
    mscale_all_dim: mscale and mscale_all_dim are both taken as log_multiplier / 0.1 (the released
    DeepSeek configs have them equal; the file does not keep mscale).
  - tensors: token_embd, output_norm, output (absent: tied to token_embd), blk.N.attn_norm, ffn_norm,
    attn_q or attn_q_a / attn_q_a_norm / attn_q_b, attn_kv_a_mqa, attn_kv_a_norm, attn_output,
    ffn_gate_inp (router), exp_probs_b.bias, ffn_{gate,up,down} (dense), ffn_{gate,up,down}_shexp,
    and the routed experts stacked as ffn_{gate,up,down}_exps [E, out, in] (expert e is a view).
    kv_b_proj is attn_kv_b in older files; newer ones split it per head into attn_k_b [H, R, dn]
    (W_UK transposed) and attn_v_b [H, dv, R]: then kv_b is rebuilt in memory from the two, in their
    float type (F32 when either is quantized, dequantized by the gguf package): the one tensor not
    read in place, H * (dn + dv) * R values a layer.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from cpumla.checkpoint.gguf import GGUFFile
from cpumla.errors import CpumlaError

INTS = ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64")
KINDS = {"int": INTS, "float": ("FLOAT32", "FLOAT64") + INTS, "bool": ("BOOL",), "str": ("STRING",)}
ARCHES = {"deepseek2": None}
LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
PER_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight", "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight", "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
FLOAT_TYPES = ("F32", "F16", "BF16")


class Metadata:
    """Typed reads of a GGUF file's metadata: one CpumlaError line naming the file and the key."""

    def __init__(self, g: GGUFFile):
        self.g, self.file = g, g.files[0]
        arch = self.get("general.architecture", "str")
        if arch not in ARCHES:
            known = ", ".join(ARCHES)
            raise CpumlaError(f"{self.file}: architecture '{arch}' is not one cpumla reads from GGUF ({known})")
        self.arch = arch

    def get(self, key: str, kind: str, default=KeyError):
        key = key.format(arch=getattr(self, "arch", ""))
        got = self.g.value(key)
        if got is None:
            if default is KeyError:
                raise CpumlaError(f"{self.file}: metadata key '{key}' is missing")
            return default
        t, v = got
        if t not in KINDS[kind]:
            want = {"int": "an integer", "float": "a number", "bool": "a boolean", "str": "a string"}[kind]
            raise CpumlaError(f"{self.file}: metadata key '{key}' is {t}, want {want}")
        return float(v) if kind == "float" else v


def config_dict(g: GGUFFile) -> dict:
    """The Hugging Face config.json the family module would read for this file."""
    m = Metadata(g)
    a = "{arch}."
    P = m.get(a + "rope.dimension_count", "int")
    mla_k = m.get(a + "attention.key_length_mla", "int", None)
    if mla_k is not None:
        dn, dv = mla_k - P, m.get(a + "attention.value_length_mla", "int")
    else:
        dn, dv = m.get(a + "attention.key_length", "int") - P, m.get(a + "attention.value_length", "int")
    vocab = m.get(a + "vocab_size", "int", None)
    if vocab is None:
        embd = g.entries.get("token_embd.weight")
        if embd is None:
            raise CpumlaError(f"{m.file}: has no tensor 'token_embd.weight' and no metadata key '{m.arch}.vocab_size'")
        vocab = embd.shape[0]
    cfg = {
        "vocab_size": vocab, "hidden_size": m.get(a + "embedding_length", "int"),
        "intermediate_size": m.get(a + "feed_forward_length", "int"),
        "num_hidden_layers": m.get(a + "block_count", "int"),
        "num_attention_heads": m.get(a + "attention.head_count", "int"),
        "q_lora_rank": m.get(a + "attention.q_lora_rank", "int", None),
        "kv_lora_rank": m.get(a + "attention.kv_lora_rank", "int"),
        "qk_rope_head_dim": P, "qk_nope_head_dim": dn, "v_head_dim": dv,
        "max_position_embeddings": m.get(a + "context_length", "int"),
        "rope_theta": m.get(a + "rope.freq_base", "float", 10000.0),
        "rms_norm_eps": m.get(a + "attention.layer_norm_rms_epsilon", "float"),
        "tie_word_embeddings": "output.weight" not in g.entries,
        "bos_token_id": m.get("tokenizer.ggml.bos_token_id", "int", None),
        "eos_token_id": m.get("tokenizer.ggml.eos_token_id", "int", None),
    }
    experts = m.get(a + "expert_count", "int", 0)
    gating = m.get(a + "expert_gating_func", "int", None)
    if gating not in (None, 1, 2):
        raise CpumlaError(f"{m.file}: metadata key '{m.arch}.expert_gating_func' is {gating}; cpumla routes with "
                          f"1 (softmax) or 2 (sigmoid)")
    sigmoid = gating == 2 or (gating is None and any(n.endswith("exp_probs_b.bias") for n in g.entries))
    cfg["model_type"] = "deepseek_v3" if sigmoid else "deepseek_v2"
    if experts:
        n_group = m.get(a + "expert_group_count", "int", None)
        cfg.update({
            "n_routed_experts": experts, "num_experts_per_tok": m.get(a + "expert_used_count", "int"),
            "n_shared_experts": m.get(a + "expert_shared_count", "int", 0),
            "moe_intermediate_size": m.get(a + "expert_feed_forward_length", "int"),
            "first_k_dense_replace": m.get(a + "leading_dense_block_count", "int", 0),
            "n_group": n_group, "topk_group": m.get(a + "expert_group_used_count", "int", None),
            "routed_scaling_factor": m.get(a + "expert_weights_scale", "float", 1.0),
            "norm_topk_prob": bool(m.get(a + "expert_weights_norm", "bool", False)),
            "scoring_func": "sigmoid" if sigmoid else "softmax",
            "topk_method": "noaux_tc" if sigmoid else
            "group_limited_greedy" if (n_group or 1) > 1 else "greedy",
        })
    kind = m.get(a + "rope.scaling.type", "str", "none")
    if kind == "yarn":
        rs = {"type": "yarn", "factor": m.get(a + "rope.scaling.factor", "float"),
              "original_max_position_embeddings": m.get(a + "rope.scaling.original_context_length", "int"),
              "beta_fast": m.get(a + "rope.scaling.yarn_beta_fast", "float", 32.0),
              "beta_slow": m.get(a + "rope.scaling.yarn_beta_slow", "float", 1.0)}
        log_mul = m.get(a + "rope.scaling.yarn_log_multiplier", "float", 0.0)
        if log_mul:
            rs["mscale"] = rs["mscale_all_dim"] = log_mul / 0.1
        cfg["rope_scaling"] = rs
    elif kind != "none":
        raise CpumlaError(f"{m.file}: metadata key '{m.arch}.rope.scaling.type' is '{kind}'; cpumla takes yarn or none")
    return cfg


class GGUFCheckpoint:
    """A GGUF model as a weight source under Hugging Face names (has / info / tensor / file_of, as
    checkpoint/safetensors.py's Checkpoint), with the config dict its metadata gives (`config`)."""

    def __init__(self, path: str | Path):
        self.file = GGUFFile(path)
        self.path = self.file.files[0]
        self.directory = self.path          # where its tensors are, for messages (tensors.where)
        try:
            self.config = config_dict(self.file)
        except BaseException:
            self.file.close()
            raise
        self._rebuilt: dict[str, np.ndarray] = {}

    # ---- names ----
    def _where(self, name: str):
        """(GGUF tensor name, expert index or None), ("kv_b", layer) for a split kv_b, or None."""
        if name in GLOBAL:
            return GLOBAL[name], None
        m = LAYER.match(name)
        if not m:
            return None
        layer, rest = int(m[1]), m[2]
        e = EXPERT.match(rest)
        if e:
            return f"blk.{layer}.ffn_{e[2]}_exps.weight", int(e[1])
        sub = PER_LAYER.get(rest)
        if sub is None:
            return None
        if sub == "attn_kv_b.weight" and f"blk.{layer}.attn_kv_b.weight" not in self.file.entries \
                and f"blk.{layer}.attn_k_b.weight" in self.file.entries:
            return "kv_b", layer
        return f"blk.{layer}.{sub}", None

    def has(self, name: str) -> bool:
        w = self._where(name)
        if w is None:
            return False
        if w[0] == "kv_b":
            return f"blk.{w[1]}.attn_v_b.weight" in self.file.entries
        e = self.file.entries.get(w[0])
        return e is not None and (w[1] is None or (len(e.shape) == 3 and w[1] < e.shape[0]))

    __contains__ = has

    def _entry(self, name: str):
        if not self.has(name):
            raise CpumlaError(f"{self.path}: checkpoint has no tensor '{self.label(name)}'")
        return self._where(name)

    def label(self, name: str) -> str:
        """The file's name of a tensor, present or not (for messages); an expert's with its index."""
        w = self._where(name)
        if w is None:
            return name
        if w[0] == "kv_b":
            return f"blk.{w[1]}.attn_k_b.weight"
        return w[0] if w[1] is None else f"{w[0]}[{w[1]}]"

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(type name: F32 / F16 / BF16 / Q8_0 / another GGUF type, numpy shape) without reading data."""
        w = self._entry(name)
        if w[0] == "kv_b":
            a = self.tensor(name)
            return {np.dtype("<f4"): "F32", np.dtype("<f2"): "F16"}.get(a.dtype, "BF16"), a.shape
        e = self.file.entries[w[0]]
        return e.type, e.shape if w[1] is None else e.shape[1:]

    def tensor(self, name: str) -> np.ndarray:
        """A view of the mapping (an expert: its slice of the stacked tensor); a split kv_b rebuilt once."""
        w = self._entry(name)
        if w[0] == "kv_b":
            if name not in self._rebuilt:
                self._rebuilt[name] = self._kv_b(w[1])
            return self._rebuilt[name]
        a = self.file.array(w[0])
        return a if w[1] is None else a[w[1]]

    def _kv_b(self, layer: int) -> np.ndarray:
        """kv_b_proj [H * (dn + dv), R] from attn_k_b [H, R, dn] and attn_v_b [H, dv, R]."""
        c = self.config
        H, R, dn, dv = c["num_attention_heads"], c["kv_lora_rank"], c["qk_nope_head_dim"], c["v_head_dim"]
        kn, vn = f"blk.{layer}.attn_k_b.weight", f"blk.{layer}.attn_v_b.weight"
        ke, ve = self.file.entries[kn], self.file.entries[vn]
        for n, e, want in ((kn, ke, (H, R, dn)), (vn, ve, (H, dv, R))):
            if int(np.prod(e.shape)) != int(np.prod(want)):
                raise CpumlaError(f"{e.file}: tensor '{n}' has shape {list(e.shape)}, config wants {list(want)}")
        same = ke.type == ve.type and ke.type in FLOAT_TYPES
        k, v = (self.file.array(kn), self.file.array(vn)) if same else (self._f32(kn), self._f32(vn))
        out = np.empty((H, dn + dv, R), k.dtype)
        out[:, :dn, :] = k.reshape(H, R, dn).transpose(0, 2, 1)
        out[:, dn:, :] = v.reshape(H, dv, R)
        return out.reshape(H * (dn + dv), R)

    def _f32(self, name: str) -> np.ndarray:
        from gguf import GGMLQuantizationType, quants

        e = self.file.entries[name]
        if e.type == "BF16":
            return (self.file.array(name).astype(np.uint32) << 16).view(np.float32)
        if e.type in FLOAT_TYPES:
            return self.file.array(name).astype(np.float32)
        raw = self.file.raw(name)
        try:
            return quants.dequantize(raw, GGMLQuantizationType[e.type]).astype(np.float32)
        except NotImplementedError:
            raise CpumlaError(f"{e.file}: tensor '{name}' has type {e.type}, which cpumla cannot read yet") from None

    # ---- the rest of a source's interface ----
    def file_of(self, name: str) -> Path:
        w = self._entry(name)
        return self.file.entries[f"blk.{w[1]}.attn_k_b.weight" if w[0] == "kv_b" else w[0]].file

    def keys(self) -> list[str]:
        return list(self.file.entries)

    def tensor_nbytes(self, name: str) -> int:
        w = self._entry(name)
        if w[0] == "kv_b":
            return self.tensor(name).nbytes
        e = self.file.entries[w[0]]
        return e.nbytes if w[1] is None else e.nbytes // e.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.file.entries.values())

    def close(self) -> None:
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"GGUFCheckpoint({str(self.path)!r}, {len(self.file.files)} files, {len(self.file.entries)} tensors)"
