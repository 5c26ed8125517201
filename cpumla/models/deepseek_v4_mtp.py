"""DeepSeek-V4's multi-token-prediction (MTP) layer (`mtp.0.*`), read from the checkpoint when it has one:
from the main model's residual streams H_i (before its HyperHead) and the embedding e of token i+1,
X = h_proj(hnorm(H_i)) + e_proj(enorm(e)) (hnorm per stream, the e term added to each), a V4 decoder
layer (sliding window, biased routing) over X, then its own HyperHead, `norm` and the main head: the
logits of token i+2. Described to the native forward as deepseek_v4.h's cpumla_dsv4_mtp;
runtime/speculative.py drafts with it."""

from __future__ import annotations

from dataclasses import dataclass, field

from cpumla import native
from cpumla.models.deepseek_v4_tensors import MTP, has_mtp, linear, mtp_tensors, stored_name, vector


@dataclass
class Mtp:
    c: object                      # the cpumla_dsv4_mtp * the model's description points at
    layer: dict                    # its decoder layer, as Model.build_layer makes one
    keep: list = field(default_factory=list)   # the rest it points at: e_proj, h_proj, HyperHead, norms, mHC


def build(model, src, names) -> Mtp | None:
    """The checkpoint's MTP layer for `model` (a deepseek_v4.Model whose layers are built), or None when
    the config names none cpumla reads or the checkpoint lacks it. Its weights are kept out of the
    model's own (`model.decode_bytes` counts the main forward alone)."""
    cfg = model.config
    if not has_mtp(cfg) or stored_name(src, MTP + "e_proj.weight") is None:
        return None
    t = mtp_tensors(cfg)
    c = native.ffi.new("cpumla_dsv4_mtp *")
    keep = []

    def vec(slot, role):
        v = vector(src, names, MTP + role, t[MTP + role][0])
        keep.append(v)
        native.set_vec(slot, v)

    def lin(role):
        w = linear(src, names, MTP + role, t[MTP + role][0], cfg.block)
        keep.append(w)
        return w

    for role in ("enorm", "hnorm", "norm"):
        vec(getattr(c, role), role + ".weight")
    e_proj, h_proj, hc_fn = lin("e_proj.weight"), lin("h_proj.weight"), lin("hc_head_fn")
    c.e_proj, c.h_proj, c.hc_head.fn = e_proj.c, h_proj.c, hc_fn.c
    vec(c.hc_head.base, "hc_head_base")
    vec(c.hc_head.scale, "hc_head_scale")
    mark = len(model.keep)
    layer = model.build_layer(c.layer, src, names, cfg.num_hidden_layers)
    keep += model.keep[mark:]             # the layer's mHC and norms: the MTP layer's, not the model's
    del model.keep[mark:]
    return Mtp(c=c, layer=layer, keep=keep)


def draft_bytes(model) -> float:
    """Bytes one draft step reads: e_proj, h_proj, the layer (its mHC, top_k routed experts), its
    HyperHead, the head."""
    t = model.mtp
    if t is None:
        return 0.0
    own = sum(w.nbytes for w in t.keep if isinstance(w, native.Weight))
    return own + model.lm_head.nbytes + model.layer_read_bytes(t.layer)
