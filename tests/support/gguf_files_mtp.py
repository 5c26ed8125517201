"""The MTP layer in GGUF files as llama.cpp's converter writes it: the NextN block appended to a model's
file (gguf_files.write / write_v32 with mtp=), the MTP file of its own (`--mtp`), and the reference of a
quantized one. V4's MTP file: gguf_files_v4.write_mtp."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from support.gguf_files import (F32_ONLY, INDEXER, converter_metadata_v32, gguf_tensors_v32, layer_tensors,
                                reference_v32, write_file)


NEXTN = {"eh_proj.weight": "nextn.eh_proj.weight", "enorm.weight": "nextn.enorm.weight",
         "hnorm.weight": "nextn.hnorm.weight", "shared_head.norm.weight": "nextn.shared_head_norm.weight",
         "shared_head.head.weight": "nextn.shared_head_head.weight",
         "embed_tokens.weight": "nextn.embed_tokens.weight"}


def nextn_tensors(mtp, split_kv_b: bool = True) -> dict[str, np.ndarray]:
    """The NextN block llama.cpp's converter appends for an MTP layer (models.Mtp): blk.L.* with L the
    main model's layer count, its decoder layer under the usual names (V3.2's indexer included) and
    blk.L.nextn.* (eh_proj, enorm, hnorm, shared_head_norm and the copies of the embedding and head)."""
    cfg = mtp.main.config
    L = cfg.num_hidden_layers
    sd = {k: v.float().numpy() for k, v in mtp.tensors(L).items()}
    out = layer_tensors(sd, cfg, L, split_kv_b)
    p, b = f"model.layers.{L}.", f"blk.{L}."
    if cfg.model_type == "deepseek_v32":
        out.update({b + g: sd[p + hf] for hf, g in INDEXER.items()})
    out.update({b + g: sd[p + hf] for hf, g in NEXTN.items()})
    return out


def write_v32_mtp(mtp, path: Path, qtype: str = "F32", metadata=None, drop=()) -> dict[str, np.ndarray]:
    """The MTP file llama.cpp's converter writes for V3.2 with --mtp: the NextN block (nextn_tensors) and
    the model's token_embd / output_norm / output, the model's metadata with block_count one more and
    nextn_predict_layers 1 (the model's own file then written without the block: write_v32)."""
    model = mtp.main
    full = gguf_tensors_v32(model)
    tensors = {n: full[n] for n in ("token_embd.weight", "output_norm.weight", "output.weight") if n in full}
    tensors.update(nextn_tensors(mtp))
    md = {**converter_metadata_v32(model.config, model), "deepseek32.block_count": model.config.num_hidden_layers + 1,
          "deepseek32.nextn_predict_layers": 1}
    kinds = {n: qtype if a.ndim > 1 and not n.endswith(F32_ONLY) else "F32" for n, a in tensors.items()}
    return write_file(path, "deepseek32", md, tensors, kinds, metadata, drop)


def reference_mtp(mtp, held: dict[str, np.ndarray]):
    """mtp (a models.Mtp) with the values a file of write_v32(..., mtp=mtp) holds loaded back into its main
    model and its layer: the reference of a quantized file's MTP layer."""
    b = f"blk.{mtp.main.config.num_hidden_layers}."
    reference_v32(mtp.main, {k: v for k, v in held.items() if not k.startswith(b)})
    block = {"blk.0." + k[len(b):]: v for k, v in held.items() if k.startswith(b) and ".nextn." not in k}
    block.update({"output_norm.weight": held[b + "nextn.shared_head_norm.weight"],
                  "output.weight": held["output.weight"]})
    reference_v32(mtp.block, block)
    with torch.no_grad():
        for t, name in ((mtp.eh_proj, "eh_proj"), (mtp.enorm.weight, "enorm"), (mtp.hnorm.weight, "hnorm")):
            t.copy_(torch.from_numpy(held[f"{b}nextn.{name}.weight"]).reshape(t.shape))
    return mtp
