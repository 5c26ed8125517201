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
    (W_UK transposed) and attn_v_b [H, dv, R]: the model reads the two in place, served flat as
    self_attn.k_b_proj / v_b_proj (cpumla's names; both forms of the attention take them). kv_b_proj
    is then the pair for the plan (its bytes are the pair's); its data, asked for, is rebuilt in
    their float type (F32 when either is quantized, dequantized by the gguf package).

`deepseek32` (DeepSeek-V3.2, DeepseekV32Model: DeepseekV2Model's keys and tensors, model_type
deepseek_v32) adds the lightning indexer:
  - attention.indexer.head_count / key_length / top_k (index_n_heads / index_head_dim / index_topk),
    all three required. Its routing is V3's sigmoid (expert_gating_func 2 or absent; 1 is refused).
  - block_count counts the NextN (MTP) blocks the converter appends after the main layers;
    nextn_predict_layers says how many: num_hidden_layers is their difference. The same holds for
    deepseek2 when the key is there (llama.cpp's converter leaves V3's out; other writers keep it).
    Block N = num_hidden_layers is the MTP layer (models/mtp.py): a decoder layer under the usual
    names, and blk.N.nextn.eh_proj / enorm / hnorm / shared_head_norm (model.layers.N.eh_proj etc.);
    its copies of the embedding and head (nextn.embed_tokens / shared_head_head) are never read.
  - A model's file without the block (the converter's `--no-mtp`; V4's always) may have it in a file
    of its own beside it (`--mtp`: `mtp-` + the model's file name; checkpoint/gguf.py: mtp_sidecar):
    that file's block N is read as the MTP layer (check_sidecar says what it must agree on).
  - blk.N.indexer.attn_q_b (wq_b), indexer.attn_k (wk), indexer.k_norm weight and bias (its LayerNorm),
    indexer.proj (weights_proj), stored as the checkpoint has them (no permutation).

`deepseek4` (DeepSeek-V4): gguf_model_v4.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from cpumla.checkpoint import gguf_model_v4 as V4
from cpumla.checkpoint.gguf import PLAIN, GGUFFile, mtp_sidecar
from cpumla.checkpoint.gguf_meta import Metadata, common, yarn
from cpumla.errors import CpumlaError

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
# W_UK and W_UV where a file splits them, per head [H, R, dn] and [H, dv, R], served flat: [H * R, dn] and
# [H * dv, R] (the names are cpumla's own: the Hugging Face checkpoints have only kv_b_proj)
SPLIT_KV_B = {"self_attn.k_b_proj.weight": "attn_k_b.weight", "self_attn.v_b_proj.weight": "attn_v_b.weight"}
INDEXER = {   # deepseek32: V3.2's lightning indexer
    "self_attn.indexer.wq_b.weight": "indexer.attn_q_b.weight", "self_attn.indexer.wk.weight": "indexer.attn_k.weight",
    "self_attn.indexer.k_norm.weight": "indexer.k_norm.weight", "self_attn.indexer.k_norm.bias": "indexer.k_norm.bias",
    "self_attn.indexer.weights_proj.weight": "indexer.proj.weight",
}
# the NextN (MTP) block's own tensors (its decoder layer's are named as any layer's): blk.N.nextn.*
NEXTN = {"eh_proj.weight": "nextn.eh_proj.weight", "enorm.weight": "nextn.enorm.weight",
         "hnorm.weight": "nextn.hnorm.weight", "shared_head.norm.weight": "nextn.shared_head_norm.weight",
         "shared_head.head.weight": "nextn.shared_head_head.weight",
         "embed_tokens.weight": "nextn.embed_tokens.weight"}
FLOAT_TYPES = ("F32", "F16", "BF16")
SIDE = "mtp:"      # the names of the MTP file's tensors, as GGUFCheckpoint serves them
INT_TYPES = {"I32": np.dtype("<i4"), "I64": np.dtype("<i8")}     # read as raw bytes (gguf.py maps floats and blocks)


def config_dict(g: GGUFFile) -> dict:
    """The Hugging Face config.json the family module would read for this file."""
    m = Metadata(g)
    return V4.config(m, g) if m.arch == "deepseek4" else mla_config(m, g)


def mla_config(m: Metadata, g: GGUFFile) -> dict:
    """deepseek2 (V2 / V3 and their kin) and deepseek32 (V3.2)."""
    a = "{arch}."
    P = m.get(a + "rope.dimension_count", "int")
    mla_k = m.get(a + "attention.key_length_mla", "int", None)
    if mla_k is not None:
        dn, dv = mla_k - P, m.get(a + "attention.value_length_mla", "int")
    else:
        dn, dv = m.get(a + "attention.key_length", "int") - P, m.get(a + "attention.value_length", "int")
    cfg = common(m, g)
    cfg.update({
        "intermediate_size": m.get(a + "feed_forward_length", "int"),
        "q_lora_rank": m.get(a + "attention.q_lora_rank", "int", None),
        "kv_lora_rank": m.get(a + "attention.kv_lora_rank", "int"),
        "qk_rope_head_dim": P, "qk_nope_head_dim": dn, "v_head_dim": dv,
        "rope_theta": m.get(a + "rope.freq_base", "float", 10000.0),
        "tie_word_embeddings": "output.weight" not in g.entries,
    })
    experts = m.get(a + "expert_count", "int", 0)
    gating = m.get(a + "expert_gating_func", "int", None)
    if gating not in (None, 1, 2):
        m.fail(a + "expert_gating_func", f"is {gating}; cpumla routes with 1 (softmax) or 2 (sigmoid)")
    if m.arch == "deepseek32":
        if gating == 1:
            m.fail(a + "expert_gating_func", "is 1 (softmax); DeepSeek-V3.2 routes with 2 (sigmoid)")
        sigmoid = True
        cfg["model_type"] = "deepseek_v32"
        cfg.update({"index_n_heads": m.get(a + "attention.indexer.head_count", "int"),
                    "index_head_dim": m.get(a + "attention.indexer.key_length", "int"),
                    "index_topk": m.get(a + "attention.indexer.top_k", "int")})
    else:
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
    rs = yarn(m)
    if rs is not None:
        log_mul = m.get(a + "rope.scaling.yarn_log_multiplier", "float", 0.0)
        if log_mul:
            rs["mscale"] = rs["mscale_all_dim"] = log_mul / 0.1
        cfg["rope_scaling"] = rs
    return cfg


def check_sidecar(side: GGUFFile, main: GGUFFile, cfg: dict) -> int:
    """An MTP file (llama.cpp's converter with `--mtp`) for the model `main` of config cfg: the same
    arch and width, one NextN block whose index is the model's layer count, with its eh_proj. Returns
    its nextn_predict_layers (1); CpumlaError naming the MTP file otherwise."""
    m = Metadata(side)
    a, L = "{arch}.", cfg["num_hidden_layers"]
    arch = main.value("general.architecture")[1]
    if m.arch != arch:
        raise CpumlaError(f"{m.file}: an MTP file of arch '{m.arch}' for a model of arch '{arch}' "
                          f"({main.files[0].name})")
    blocks, nextn = m.get(a + "block_count", "int"), m.get(a + "nextn_predict_layers", "int", 0)
    if nextn != 1:
        m.fail(a + "nextn_predict_layers", f"is {nextn}; an MTP file cpumla reads holds one NextN block")
    if blocks - nextn != L:
        m.fail(a + "block_count", f"is {blocks}: an MTP file of a model of {blocks - nextn} layers, not of "
                                  f"{main.files[0].name}'s {L}")
    width = m.get(a + "embedding_length", "int")
    if width != cfg["hidden_size"]:
        m.fail(a + "embedding_length", f"is {width}, not {main.files[0].name}'s {cfg['hidden_size']}")
    if f"blk.{L}.nextn.eh_proj.weight" not in side.entries:
        raise CpumlaError(f"{m.file}: has no tensor 'blk.{L}.nextn.eh_proj.weight'")
    return nextn


class GGUFCheckpoint:
    """A GGUF model as a weight source under Hugging Face names (has / info / tensor, as
    checkpoint/safetensors.py's Checkpoint; V4's official names for deepseek4), with the config dict
    its metadata gives (`config`)."""

    def __init__(self, path: str | Path, mtp: str | Path | bool | None = None):
        """mtp: where the MTP layer comes from when the model's file has no NextN block: None, the MTP file
        beside it (mtp_sidecar) if there is one; a path, that MTP file (`--draft-model`; refused for a
        model whose file holds the block); False, nowhere (no file opened: drafts of ngram or none)."""
        self.file = GGUFFile(path)
        self.path = self.file.files[0]
        self.directory = self.path          # where its tensors are, for messages (tensors.where)
        self.side = None                    # the MTP file (mtp), when it is read
        try:
            self.config = config_dict(self.file)
            self.arch = self.file.value("general.architecture")[1]
            in_file = self.config.get("num_nextn_predict_layers")
            if mtp not in (None, False) and in_file:
                raise CpumlaError(f"{self.path}: holds its MTP layer (blk.{self.config['num_hidden_layers']}.nextn.*); "
                                  f"leave out --draft-model {mtp}")
            side = mtp_sidecar(self.path) if mtp is None else None if mtp is False else Path(mtp).expanduser()
            if side is not None and mtp not in (None, False) and not side.is_file():
                raise CpumlaError(f"--draft-model {side}: no such file")
            if side is not None and not in_file:
                self.side = GGUFFile(side)
                self.config["num_nextn_predict_layers"] = check_sidecar(self.side, self.file, self.config)
        except BaseException:
            self.close()
            raise
        self._rebuilt: dict = {}

    # ---- the two files: a name of the MTP file's is SIDE + its name there ----
    def _file(self, gname: str) -> tuple[GGUFFile, str]:
        if gname.startswith(SIDE):
            return self.side, gname[len(SIDE):]
        return self.file, gname

    def _e(self, gname: str):
        """The entry of a tensor (None where it is not there)."""
        f, n = self._file(gname)
        return f.entries.get(n)

    def _raw(self, gname: str) -> np.ndarray:
        f, n = self._file(gname)
        return f.raw(n)

    def _plain(self, gname: str) -> np.ndarray:
        f, n = self._file(gname)
        return f.array(n)

    def _blk(self, layer: int) -> str:
        """The prefix of block `layer`'s names: the MTP file's for the MTP layer when that file serves it."""
        return (SIDE if self.side is not None and layer >= self.config["num_hidden_layers"] else "") + f"blk.{layer}."

    # ---- names ----
    def _where(self, name: str):
        """(how, GGUF tensor name, expert index or None) for a name the family reads, or None. how: "view"
        (the file's tensor; an expert a slice of its stacked tensor), "flat" (a per-head tensor as one
        [heads * rows, cols] view), "kv_b" (rebuilt from attn_k_b / attn_v_b, named by attn_k_b), "fp4" /
        "fp4_scale" (an MXFP4 expert as e2m1 codes / E8M0 scales), "half0" / "half1" (the first / second
        half of a tensor's columns: V4's e_proj / h_proj in eh_proj). An MTP file's names start SIDE."""
        if self.arch == "deepseek4":
            if name.startswith(V4.MTP):
                if self.side is None:
                    return None
                w = V4.where_mtp(self.side.entries, name, self.config["num_hidden_layers"])
                return None if w is None else (w[0], SIDE + w[1], w[2])
            return V4.where(self.file.entries, name)
        if name in GLOBAL:
            return "view", GLOBAL[name], None
        m = LAYER.match(name)
        if not m:
            return None
        layer, rest = int(m[1]), m[2]
        b = self._blk(layer)
        e = EXPERT.match(rest)
        if e:
            return "view", f"{b}ffn_{e[2]}_exps.weight", int(e[1])
        if rest in SPLIT_KV_B:
            return "flat", b + SPLIT_KV_B[rest], None
        sub = PER_LAYER.get(rest) or (INDEXER.get(rest) if self.arch == "deepseek32" else None) or \
            (NEXTN.get(rest) if layer >= self.config["num_hidden_layers"] else None)
        if sub is None:
            return None
        if sub == "attn_kv_b.weight" and self._e(b + "attn_kv_b.weight") is None \
                and self._e(b + "attn_k_b.weight") is not None:
            return "kv_b", b + "attn_k_b.weight", layer
        return "view", b + sub, None

    def has(self, name: str) -> bool:
        w = self._where(name)
        if w is None:
            return False
        how, gname, index = w
        if how == "kv_b":
            return self._e(self._blk(index) + "attn_v_b.weight") is not None
        e = self._e(gname)
        return e is not None and (index is None or (len(e.shape) == 3 and index < e.shape[0]))

    __contains__ = has

    def _entry(self, name: str):
        if not self.has(name):
            raise CpumlaError(f"{self.home_of(name)}: checkpoint has no tensor '{self.label(name)}'")
        return self._where(name)

    def home_of(self, name: str) -> Path:
        """The file that holds tensor `name`, or would: the MTP file for the MTP layer's when it serves them."""
        w = self._where(name)
        return self.side.files[0] if w is not None and w[1].startswith(SIDE) else self.path

    def label(self, name: str) -> str:
        """The file's name of a tensor, present or not (for messages); an expert's with its index."""
        w = self._where(name)
        if w is None:
            return name
        how, gname, index = w
        gname = self._file(gname)[1]
        return gname if index is None or how == "kv_b" else f"{gname}[{index}]"

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(type name: F32 / F16 / BF16 / Q8_0 / I32 / another GGUF type, numpy shape) without reading
        data; an MXFP4 expert served as FP4: I8 [rows, cols / 2] and its scales F8_E8M0 [rows, cols / 32]."""
        how, gname, index = self._entry(name)
        if how == "kv_b":               # as tensor() would rebuild it
            return self._kv_b_form(index)
        e = self._e(gname)
        if how in ("half0", "half1"):
            return e.type, (e.shape[0], self._half_cols(gname))
        if how == "fp4":
            return "I8", (e.shape[1], e.shape[2] // 2)
        if how == "fp4_scale":
            return "F8_E8M0", (e.shape[1], e.shape[2] // 32)
        if how == "flat":
            return e.type, (int(np.prod(e.shape[:-1])), e.shape[-1])
        return e.type, e.shape if index is None else e.shape[1:]

    def tensor(self, name: str) -> np.ndarray:
        """A view of the mapping (an expert: its slice of the stacked tensor); a split kv_b (never read by
        the model) or an MXFP4 expert's FP4 codes and scales rebuilt once."""
        how, gname, index = self._entry(name)
        if how == "kv_b":
            if name not in self._rebuilt:
                self._rebuilt[name] = self._kv_b(index)
            return self._rebuilt[name]
        if how in ("fp4", "fp4_scale"):
            key = (gname, index)
            if key not in self._rebuilt:
                self._rebuilt[key] = self._fp4(gname, index)
            return self._rebuilt[key][how == "fp4_scale"]
        a = self._array(gname)
        if how == "flat":
            return a.reshape(-1, a.shape[-1])
        if how in ("half0", "half1"):          # a view of strided rows: its columns stay contiguous
            n = a.shape[1] // 2
            return a[:, :n] if how == "half0" else a[:, n:]
        return a if index is None else a[index]

    def _half_cols(self, gname: str) -> int:
        """The columns of each half of a [rows, 2 * cols] tensor served as two (V4's eh_proj); CpumlaError
        where the halves would cut a block of its type."""
        e = self._e(gname)
        cols = e.shape[1] // 2
        block = PLAIN[e.type][1] if e.type in PLAIN else 1
        if e.shape[1] % 2 or cols % block:
            raise CpumlaError(f"{e.file}: tensor '{self._file(gname)[1]}' has {e.shape[1]} columns, not two halves "
                              f"of whole {e.type} blocks")
        return cols

    def _array(self, gname: str) -> np.ndarray:
        e = self._e(gname)
        if e.type in INT_TYPES:
            return self._raw(gname).view(INT_TYPES[e.type]).reshape(e.shape)
        return self._plain(gname)

    def _kv_b_form(self, layer: int) -> tuple[str, tuple[int, int]]:
        """(type, shape) of layer `layer`'s kv_b rebuilt from its pair: the pair's float type where they
        share one, else F32; [H * (dn + dv), R]."""
        c = self.config
        k, v = (self._e(f"{self._blk(layer)}attn_{s}_b.weight") for s in "kv")
        shape = (c["num_attention_heads"] * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])
        return (k.type if k.type == v.type and k.type in FLOAT_TYPES else "F32"), shape

    def _kv_b(self, layer: int) -> np.ndarray:
        """kv_b_proj [H * (dn + dv), R] from attn_k_b [H, R, dn] and attn_v_b [H, dv, R]."""
        c = self.config
        H, R, dn, dv = c["num_attention_heads"], c["kv_lora_rank"], c["qk_nope_head_dim"], c["v_head_dim"]
        kn, vn = self._blk(layer) + "attn_k_b.weight", self._blk(layer) + "attn_v_b.weight"
        ke, ve = self._e(kn), self._e(vn)
        for n, e, want in ((kn, ke, (H, R, dn)), (vn, ve, (H, dv, R))):
            if int(np.prod(e.shape)) != int(np.prod(want)):
                raise CpumlaError(f"{e.file}: tensor '{self._file(n)[1]}' has shape {list(e.shape)}, "
                                  f"config wants {list(want)}")
        same = ke.type == ve.type == self._kv_b_form(layer)[0]       # both of the float type it keeps
        k, v = (self._plain(kn), self._plain(vn)) if same else (self._f32(kn), self._f32(vn))
        out = np.empty((H, dn + dv, R), k.dtype)
        out[:, :dn, :] = k.reshape(H, R, dn).transpose(0, 2, 1)
        out[:, dn:, :] = v.reshape(H, dv, R)
        return out.reshape(H * (dn + dv), R)

    def _fp4(self, gname: str, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Expert `index` of a stacked MXFP4 tensor as (e2m1 codes I8 [rows, cols / 2], value 2i in the low
        nibble of byte i and 2i + 1 in the high one; E8M0 scales uint8 [rows, cols / 32])."""
        e = self._e(gname)
        rows, cols = e.shape[-2:]
        blocks = self._raw(gname).reshape(e.shape[0], rows, cols // 32, 17)[index]
        scale = np.ascontiguousarray(blocks[..., 0])
        qs = blocks[..., 1:]
        values = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)          # [rows, blocks, 32], in order
        codes = values[..., 0::2] | (values[..., 1::2] << 4)
        return np.ascontiguousarray(codes.reshape(rows, cols // 2)).view(np.int8), scale

    def _f32(self, name: str) -> np.ndarray:
        from gguf import GGMLQuantizationType, quants

        e = self._e(name)
        if e.type == "BF16":
            return (self._plain(name).astype(np.uint32) << 16).view(np.float32)
        if e.type in FLOAT_TYPES:
            return self._plain(name).astype(np.float32)
        raw = self._raw(name)
        try:
            return quants.dequantize(raw, GGMLQuantizationType[e.type]).astype(np.float32)
        except NotImplementedError:
            raise CpumlaError(f"{e.file}: tensor '{self._file(name)[1]}' has type {e.type}, which cpumla cannot "
                              f"read yet") from None

    # ---- the rest of a source's interface ----
    def file_of(self, name: str) -> Path:
        return self._e(self._entry(name)[1]).file

    def keys(self) -> list[str]:
        return list(self.file.entries)

    def tensor_nbytes(self, name: str) -> int:
        """Bytes a model holds of tensor `name`: a split kv_b's are its pair's (read in place)."""
        how, gname, index = self._entry(name)
        if how == "kv_b":
            return sum(self._e(f"{self._blk(index)}attn_{s}_b.weight").nbytes for s in "kv")
        e = self._e(gname)
        if how in ("half0", "half1"):
            return e.nbytes // 2
        if how == "fp4":                   # an MXFP4 block's 16 code bytes and 1 scale byte, without rebuilding
            return e.nbytes // e.shape[0] * 16 // 17
        if how == "fp4_scale":
            return e.nbytes // e.shape[0] // 17
        return e.nbytes if index is None else e.nbytes // e.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for f in (self.file, self.side) if f is not None for e in f.entries.values())

    def mappings(self) -> list[tuple[int, int, str]]:
        return self.file.mappings() + (self.side.mappings() if self.side is not None else [])

    def close(self) -> None:
        self.file.close()
        if self.side is not None:
            self.side.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"GGUFCheckpoint({str(self.path)!r}, {len(self.file.files)} files, {len(self.file.entries)} tensors)"
