"""The multi-token-prediction (MTP) layer of V3 / R1 / V3.1 / V3.2 (`model.layers.{num_hidden_layers}.*`), read
from the checkpoint when it has one: its norms, eh_proj and a full decoder layer, described to the native
forward as deepseek_v2.h's cpumla_dsv2_mtp. runtime/speculative.py drafts with it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cpumla import native
from cpumla.checkpoint import tensors as W
from cpumla.models import deepseek_v2_tensors as tables


@dataclass
class Mtp:
    enorm: np.ndarray            # [D]
    hnorm: np.ndarray            # [D]
    head_norm: np.ndarray        # [D] shared_head.norm
    eh_proj: native.Weight       # [D, 2D] over [enorm(e) ; hnorm(h)]
    layer: object                # the family's Layer


def build(cfg, src, build_layer) -> Mtp | None:
    """The checkpoint's MTP layer, or None when the config names none or the checkpoint lacks it;
    build_layer(cfg, src, index) makes the family's decoder layer."""
    if not tables.has_mtp(cfg):
        return None
    names = tables.mtp_names(cfg)
    if not src.has(names["eh_proj"][0]):
        return None
    return Mtp(enorm=W.vector(src, *names["enorm"]), hnorm=W.vector(src, *names["hnorm"]),
               head_norm=W.vector(src, *names["head_norm"]),
               eh_proj=W.linear(src, *names["eh_proj"], cfg.block),
               layer=build_layer(cfg, src, cfg.num_hidden_layers))


def describe(t: Mtp, describe_layer):
    """A cpumla_dsv2_mtp pointing at t's weights (t must outlive it); describe_layer fills its layer."""
    c = native.ffi.new("cpumla_dsv2_mtp *")
    native.set_vec(c.enorm, t.enorm)
    native.set_vec(c.hnorm, t.hnorm)
    native.set_vec(c.norm, t.head_norm)
    c.eh_proj = t.eh_proj.c
    describe_layer(c.layer, t.layer)
    return c


def draft_bytes(model) -> float:
    """Bytes one draft step reads: eh_proj, the layer (top_k routed experts), the lm_head."""
    t = model.mtp
    return 0.0 if t is None else t.eh_proj.nbytes + model.lm_head.nbytes + model.layer_read_bytes(t.layer)
