"""Tiny random DeepSeek models built with transformers' own classes and saved with save_pretrained
(original tensor names), plus an FP8 block-quantised copy: the fixtures of the parity tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

BASE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
            first_k_dense_replace=1, max_position_embeddings=512, tie_word_embeddings=False)
YARN = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 0.707}

VARIANTS = {
    # V2-Lite: no q LoRA, softmax greedy, YaRN, v_head_dim != qk_nope_head_dim
    "v2-lite": ("deepseek_v2", dict(q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0,
                                    rope_scaling=YARN)),
    # V2: q LoRA, group_limited_greedy (groups by max), routed_scaling_factor 16
    "v2": ("deepseek_v2", dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                               routed_scaling_factor=16.0, rope_scaling=YARN)),
    # V3: noaux_tc sigmoid + correction bias, several groups (top-2 sums), renormalised, YaRN
    "v3": ("deepseek_v3", dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
                               routed_scaling_factor=2.5, rope_scaling={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0})),
    # Moonlight: V3 without q LoRA, one group, its own rope theta and eps, no rope scaling
    "moonlight": ("deepseek_v3", dict(q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=True,
                                      routed_scaling_factor=2.446, rope_theta=50000.0, rms_norm_eps=1e-5,
                                      rope_scaling=None)),
}

# V3.2 (DSA): V3 plus the lightning indexer. index_topk 6 is below the 12-token test sequences, so the
# top-k really drops keys; 8 indexer heads of width 20 (rope 8 + nope 12) differ from the 4 MLA heads
# and from 2 * qk_rope_head_dim, so a wrong head count, slice or width shows (and wq_b's 160 rows make a
# partial second 128-row block in the FP8 copy). q LoRA is required. The seeds were picked for top-k
# choices far from ties (fp32, bf16-rounded and FP8-dequantised weights); tests/models/test_parity_v32.py
# asserts the margins on every fixture it builds.
V32 = dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
           rope_scaling={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
           index_n_heads=8, index_head_dim=20, index_topk=6)
V32_SEED = 76          # hidden 64
V32_FP8_SEED = 10      # hidden 160 (two 128-column blocks, the second partial)


def build(variant: str, out: Path, dtype=torch.float32, seed: int = 0):
    """Saves the model to `out` and returns it (fp32, eval mode)."""
    model_type, extra = VARIANTS[variant]
    return build_from_kwargs(model_type, {**BASE, **extra}, out, dtype, seed)


def build_v32(out: Path, dtype=torch.float32, seed: int = V32_SEED, **overrides):
    """The tiny DeepSeek-V3.2 model (V32 on BASE), saved to `out`; returns it (fp32, eval mode)."""
    return build_from_kwargs("deepseek_v32", {**BASE, **V32, **overrides}, out, dtype, seed)


def build_from_kwargs(model_type: str, kw: dict, out: Path, dtype=torch.float32, seed: int = 0):
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        DeepseekV32Config,
        DeepseekV32ForCausalLM,
    )

    if model_type == "deepseek_v2":
        cfg, cls = DeepseekV2Config(**kw), DeepseekV2ForCausalLM
    elif model_type == "deepseek_v32":
        cfg, cls = DeepseekV32Config(**kw), DeepseekV32ForCausalLM
    else:
        cfg, cls = DeepseekV3Config(**kw, num_nextn_predict_layers=0), DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    randomize(model, seed)
    model.to(dtype).save_pretrained(out)
    return model.to(dtype).to(torch.float32) if dtype != torch.float32 else model


def randomize(model, seed: int) -> None:
    """Gives every parameter and buffer of a tiny model a real value (norms around 1, weights ~ 1/sqrt(in))."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():          # give every parameter a real value
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name.endswith("norm.bias"):                # the V3.2 indexer's LayerNorm
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "e_score_correction_bias" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif name.endswith("gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) / max(1, p.shape[-1]) ** 0.5)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)


class Mtp:
    """A V3 (or V3.2) MTP layer for tests, computed as the spec says with transformers' classes: enorm,
    hnorm and eh_proj by hand, the decoder layer (V3.2's with its indexer), shared_head.norm and the main
    lm_head as a one-layer DeepseekV3ForCausalLM (DeepseekV32ForCausalLM) run on inputs_embeds =
    eh_proj(...)."""

    def __init__(self, main, seed: int):
        from transformers import DeepseekV3ForCausalLM, DeepseekV32ForCausalLM
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

        one = {"num_hidden_layers": 1, "first_k_dense_replace": 0}
        for key in ("mlp_layer_types", "layer_types"):          # V3.2's lists, one entry a layer
            types = getattr(main.config, key, None)
            if types is not None:
                one[key] = ["sparse"] if key == "mlp_layer_types" else types[:1]
        cfg = main.config.__class__(**{**main.config.to_dict(), **one})
        torch.manual_seed(seed)
        cls = DeepseekV32ForCausalLM if main.config.model_type == "deepseek_v32" else DeepseekV3ForCausalLM
        self.block = cls(cfg).to(torch.float32).eval()
        randomize(self.block, seed)
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        g = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():
            self.block.lm_head.weight.copy_(main.lm_head.weight)
            self.enorm, self.hnorm = DeepseekV3RMSNorm(D, eps), DeepseekV3RMSNorm(D, eps)
            self.enorm.weight.copy_(0.5 + torch.rand(D, generator=g))
            self.hnorm.weight.copy_(0.5 + torch.rand(D, generator=g))
            self.eh_proj = torch.randn(D, 2 * D, generator=g) / (2 * D) ** 0.5
        self.main = main

    def tensors(self, layer: int) -> dict:
        """The layer's tensors under the names a V3 checkpoint gives them (model.layers.{layer}.*)."""
        import tempfile

        from safetensors.torch import load_file

        with tempfile.TemporaryDirectory() as tmp:       # save_pretrained writes the checkpoint's names
            self.block.save_pretrained(tmp)
            saved = load_file(Path(tmp) / "model.safetensors")
        p = f"model.layers.{layer}."
        out = {p + k.removeprefix("model.layers.0."): v for k, v in saved.items() if k.startswith("model.layers.0.")}
        out.update({p + "enorm.weight": self.enorm.weight, p + "hnorm.weight": self.hnorm.weight,
                    p + "eh_proj.weight": self.eh_proj, p + "shared_head.norm.weight": self.block.model.norm.weight,
                    p + "shared_head.head.weight": self.main.lm_head.weight,
                    p + "embed_tokens.weight": self.main.model.embed_tokens.weight})
        return {k: v.detach().clone().contiguous() for k, v in out.items()}

    def hidden(self, ids) -> torch.Tensor:
        """The main model's final normed hidden states [n, D]."""
        with torch.no_grad():
            return self.main.model(torch.tensor([ids])).last_hidden_state[0]

    def logits(self, hidden: torch.Tensor, next_ids) -> np.ndarray:
        """MTP logits [n, vocab] over the pairs (hidden[t], next_ids[t]) at positions 0..n-1."""
        with torch.no_grad():
            e = self.main.model.embed_tokens(torch.tensor([next_ids]))[0]
            u = torch.cat([self.enorm(e), self.hnorm(hidden)], -1) @ self.eh_proj.T
            return self.block(inputs_embeds=u[None]).logits[0].float().numpy()


def mtp_logits(eng, ref: Mtp) -> tuple[np.ndarray, np.ndarray]:
    """(the engine's MTP logits, the reference's) over IDS, each position with the next token (9 after
    the last), on the hidden states each computes itself."""
    m, V = eng.model, eng.config.vocab_size
    ids = np.asarray(IDS, np.int64)
    nxt = np.asarray(IDS[1:] + [9], np.int64)
    h = np.empty((len(ids), m.mtp_width), np.float32)
    m.forward_hidden(ids, 0, np.empty((len(ids), V), np.float32), False, h)
    got = np.empty((len(ids), V), np.float32)
    m.mtp_forward(nxt, 0, h, got, False)
    return got, ref.logits(ref.hidden(IDS), nxt.tolist())


def same_text_with_drafts(eng, k: int = 2, n: int = 12, ids=None) -> list[int]:
    """n greedy tokens after ids (default IDS) from an empty cache without drafts, checked to be the same
    with MTP drafts of k tokens (p_min 0: a draft every step); returns them. Leaves the engine drafting."""
    ids = IDS if ids is None else ids
    eng.set_draft("none")
    eng.reset()
    plain = list(eng.generate(ids, n, stop_ids=[]))
    eng.set_draft("mtp", k, p_min=0.0)
    eng.reset()
    assert list(eng.generate(ids, n, stop_ids=[])) == plain
    return plain


def build_v3_mtp(out: Path, seed: int = 0, v32: bool = False, **overrides):
    """The tiny V3 of build("v3") (v32: V3.2 of build_v32, with overrides of its config) with an MTP layer
    added to its checkpoint (num_nextn_predict_layers 1); returns its Mtp (main model and reference)."""
    from safetensors.torch import load_file, save_file

    main = build_v32(out, **overrides) if v32 else build("v3", out, seed=seed)
    mtp = Mtp(main, seed + 100)
    sd = load_file(out / "model.safetensors")
    sd.update(mtp.tensors(main.config.num_hidden_layers))
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg))
    return mtp


def quantize_fp8(src_dir: Path, out: Path, block=(128, 128)):
    """An FP8 e4m3 copy of a saved fp32 model, V3-style: every projection weight quantised per block
    with a `weight_scale_inv` (F32) grid; embeddings, norms, router and lm_head stay as they were.
    V3.2's indexer as its checkpoints ship it: wq_b and wk quantised like the projections,
    weights_proj not quantised but stored BF16. Returns the state dict of dequantised weights (the
    reference's weights)."""
    from safetensors.torch import load_file, save_file

    sd = load_file(src_dir / "model.safetensors")
    out.mkdir(parents=True, exist_ok=True)
    new, deq = {}, {}
    for name, t in sd.items():
        if name.endswith("indexer.weights_proj.weight"):
            new[name] = t.to(torch.bfloat16)
            deq[name] = new[name].to(torch.float32)
            continue
        quant = (name.endswith("_proj.weight") or name.endswith("kv_a_proj_with_mqa.weight")
                 or name.endswith(("indexer.wq_b.weight", "indexer.wk.weight")))
        if not quant:
            new[name], deq[name] = t, t
            continue
        r, c = t.shape
        gr, gc = -(-r // block[0]), -(-c // block[1])
        scale = torch.empty(gr, gc)
        q = torch.empty(r, c, dtype=torch.float8_e4m3fn)
        for i in range(gr):
            for j in range(gc):
                blk = t[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
                s = blk.abs().max().clamp(min=1e-12) / 448.0
                scale[i, j] = s
                q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (blk / s).to(torch.float8_e4m3fn)
        full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:r, :c]
        new[name], new[name + "_scale_inv"] = q, scale
        deq[name] = q.to(torch.float32) * full
    save_file(new, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(cfg))
    return deq


def reference_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


# ---- DeepSeek-V4 ------------------------------------------------------------------------------------
# All three layer types and two hash layers; HCA at ratio 8 (transformers' compress_rates) so that a
# few dozen tokens cross several of its windows, as they cross CSA's (4) and the sliding window (8).
V4_BASE = dict(vocab_size=160, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
               head_dim=32, qk_rope_head_dim=8, q_lora_rank=24, o_groups=2, o_lora_rank=16, n_routed_experts=8,
               num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=1.5, swiglu_limit=10.0,
               compress_ratios=[0, 4, 128, 4, 128], num_hash_layers=2, sliding_window=8, index_n_heads=8,
               index_head_dim=16, index_topk=3, hc_mult=4, hc_sinkhorn_iters=20, max_position_embeddings=4096,
               compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
               rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 256,
                             "beta_fast": 32, "beta_slow": 1})


def build_v4(out: Path | None, seed: int = 0, **overrides):
    """A tiny DeepseekV4ForCausalLM with every parameter and buffer given a real value (sinks, biases,
    the hash table, mHC and compressor position biases included), saved with save_pretrained when
    `out` is given; returns it (fp32, eval mode)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    kw = {**V4_BASE, **overrides}
    cfg = DeepseekV4Config(**kw)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).to(torch.float32).eval()
    randomize_v4(model, torch.Generator().manual_seed(seed + 1))
    if out is not None:
        model.save_pretrained(out)
    return model


def randomize_v4(model, g) -> None:
    """Every parameter and buffer of a transformers V4 model given a real value."""
    cfg = model.config
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                p.copy_(torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(p.shape[0])]))
            elif name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name.endswith(("hc.scale", "hc_scale")):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name.endswith(("hc.base", "hc_base", "position_bias", "e_score_correction_bias")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif p.dtype.is_floating_point:
                p.copy_(torch.randn(p.shape, generator=g) / max(1, p.shape[-1]) ** 0.5)


class MtpV4:
    """V4's MTP layer for tests, computed as the spec says with transformers' classes: enorm, hnorm,
    e_proj and h_proj by hand over the main model's streams before its HyperHead, then the decoder
    layer, the layer's own HyperHead, its norm and the main head as a one-layer DeepseekV4ForCausalLM
    whose layer takes those streams (a hook swaps them in for the embedding it would stack)."""

    def __init__(self, main, seed: int):
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm

        kw = {k: v for k, v in main.config.to_dict().items() if k not in ("compress_ratios", "num_hash_layers")}
        kw.update(num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"])
        torch.manual_seed(seed)
        self.block = DeepseekV4ForCausalLM(DeepseekV4Config(**kw)).to(torch.float32).eval()
        randomize_v4(self.block, torch.Generator().manual_seed(seed))
        D, eps = main.config.hidden_size, main.config.rms_norm_eps
        g = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():
            self.block.lm_head.weight.copy_(main.lm_head.weight)
            self.enorm, self.hnorm = DeepseekV4RMSNorm(D, eps), DeepseekV4RMSNorm(D, eps)
            self.enorm.weight.copy_(0.5 + torch.rand(D, generator=g))
            self.hnorm.weight.copy_(0.5 + torch.rand(D, generator=g))
            self.e_proj = torch.randn(D, D, generator=g) / D ** 0.5
            self.h_proj = torch.randn(D, D, generator=g) / D ** 0.5
        self.main = main

    def tensors(self) -> dict:
        """The layer's tensors under their official names (mtp.0.*)."""
        import tempfile

        from safetensors.torch import load_file

        with tempfile.TemporaryDirectory() as tmp:       # save_pretrained writes the checkpoint's names
            self.block.save_pretrained(tmp)
            saved = load_file(Path(tmp) / "model.safetensors")
        p = "model.layers.0."
        out = {("mtp.0." + k[len(p):]).replace(".attn.norm.", ".attn.kv_norm."): v for k, v in saved.items()
               if k.startswith(p)}
        out.update({"mtp.0.hc_head_" + k[len("model.hc_head.hc_"):]: v for k, v in saved.items()
                    if k.startswith("model.hc_head.hc_")})
        out.update({"mtp.0.enorm.weight": self.enorm.weight, "mtp.0.hnorm.weight": self.hnorm.weight,
                    "mtp.0.e_proj.weight": self.e_proj, "mtp.0.h_proj.weight": self.h_proj,
                    "mtp.0.norm.weight": self.block.model.norm.weight})
        return {k: v.detach().clone().contiguous() for k, v in out.items()}

    @staticmethod
    def streams(model, run) -> torch.Tensor:
        """The streams [n, N, D] that reach model's HyperHead while run() runs."""
        got = []
        hook = model.model.hc_head.register_forward_pre_hook(lambda mod, args: got.append(args[0][0].clone()))
        try:
            with torch.no_grad():
                run()
        finally:
            hook.remove()
        return got[-1]

    def hidden(self, ids) -> torch.Tensor:
        """The main model's streams after its last layer, [n, N*D]."""
        return self.streams(self.main, lambda: self.main(torch.tensor([ids]))).flatten(1)

    def logits(self, hidden: torch.Tensor, next_ids) -> np.ndarray:
        """MTP logits [n, vocab] over the pairs (hidden[t] [N*D], next_ids[t]) at positions 0..n-1."""
        return self.run(hidden, next_ids)[0]

    def run(self, hidden: torch.Tensor, next_ids) -> tuple[np.ndarray, np.ndarray]:
        """(MTP logits [n, vocab], its output streams [n, N*D]) over the pairs (hidden[t], next_ids[t])."""
        D = self.main.config.hidden_size
        with torch.no_grad():
            e = self.main.model.embed_tokens(torch.tensor([next_ids]))[0]
            x = self.hnorm(hidden.reshape(len(next_ids), -1, D)) @ self.h_proj.T + (self.enorm(e) @ self.e_proj.T)[:, None]
        swap = self.block.model.layers[0].register_forward_pre_hook(lambda mod, args: (x[None],) + args[1:])
        out = []
        try:
            s = self.streams(self.block, lambda: out.append(self.block(inputs_embeds=torch.zeros(1, len(next_ids), D))))
        finally:
            swap.remove()
        return out[0].logits[0].float().numpy(), s.flatten(1).numpy()


def build_v4_mtp(out: Path, seed: int = 0):
    """The tiny V4 of build_v4 with an MTP layer added to its checkpoint (num_nextn_predict_layers 1);
    returns its MtpV4 (main model and reference)."""
    from safetensors.torch import load_file, save_file

    main = build_v4(out, seed=seed)
    mtp = MtpV4(main, seed + 100)
    sd = load_file(out / "model.safetensors")
    sd.update(mtp.tensors())
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg))
    return mtp


E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6])


def _e8m0(amax: torch.Tensor, top: float) -> torch.Tensor:
    """Power-of-two exponents e (scale 2^e) that bring amax within the format's largest value `top`."""
    return torch.ceil(torch.log2(amax.clamp(min=1e-30) / top)).clamp(-127, 127)


def quantize_v4(saved: Path, out: Path, cfg_extra: dict | None = None):
    """The official release format of a V4 model saved by save_pretrained: official names, FP8 e4m3
    linears with E8M0 `.scale` per 128x128 block, FP4 e2m1 experts (two per byte, low nibble first,
    I8 on disk) with E8M0 `.scale` per 1x32 (FP8 like the linears with cfg_extra expert_dtype fp8), bf16 compressor / indexer / router projections, embeddings
    and norms, fp32 mHC / sink / ape / bias, I64 tid2eid. Writes it to `out` and returns the dequantised
    weights under the saved names (the reference's weights)."""
    from safetensors.torch import load_file, save_file

    from cpumla.models import deepseek_v4 as v4
    from cpumla.models.deepseek_v4_tensors import hf_name

    sd = load_file(saved / "model.safetensors")
    cfg_json = json.loads((saved / "config.json").read_text())
    cfg_json.update({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                             "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
                     "expert_dtype": "fp4", **(cfg_extra or {})})
    kinds = v4.tensors(v4.Config.from_dict(cfg_json))
    new, deq = {}, {}
    for name, (shape, kind) in kinds.items():
        hf = hf_name(name) if hf_name(name) in sd else name       # an MTP layer is saved by official names
        if hf not in sd and name.startswith("mtp."):
            continue                                              # the config names one the model lacks
        t = sd[hf]
        if kind == "e4m3":
            r, c = t.shape
            gr, gc = -(-r // 128), -(-c // 128)
            e = torch.empty(gr, gc)
            for i in range(gr):
                for j in range(gc):
                    e[i, j] = _e8m0(t[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max(), 448.0)
            full = torch.exp2(e).repeat_interleave(128, 0).repeat_interleave(128, 1)[:r, :c]
            q = (t / full).to(torch.float8_e4m3fn)
            new[name] = q
            new[name[:-len("weight")] + "scale"] = (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
            deq[hf] = q.to(torch.float32) * full
        elif kind == "e2m1":
            r, c = t.shape
            e = _e8m0(t.view(r, c // 32, 32).abs().amax(-1), 6.0)                      # [r, c/32]
            v = t / torch.exp2(e).repeat_interleave(32, 1)
            mag = (v.abs().unsqueeze(-1) - E2M1).abs().argmin(-1)                     # nearest magnitude
            nib = (mag | ((v < 0) & (mag > 0)).to(torch.long) << 3).to(torch.uint8)
            new[name] = (nib[:, 0::2] | (nib[:, 1::2] << 4)).view(torch.int8)
            new[name[:-len("weight")] + "scale"] = (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
            deq[hf] = E2M1[mag] * torch.where(v < 0, -1.0, 1.0) * torch.exp2(e).repeat_interleave(32, 1)
        elif kind in ("plain", "norm", "embed"):
            new[name] = t.to(torch.bfloat16)
            deq[hf] = new[name].to(torch.float32)
        else:
            new[name], deq[hf] = t, t
    out.mkdir(parents=True, exist_ok=True)
    save_file(new, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg_json))
    return deq


IDS = [3, 17, 99, 5, 150, 42, 7, 7, 120, 64, 1, 33]


def stepwise(eng, ids, first: int):
    """The logits of a prefill of ids[:first], then of ids[first:] decoded one token at a time."""
    return np.concatenate([eng.forward(ids[:first])] + [eng.forward([t]) for t in ids[first:]])


def check_fp32(got, ref):
    """fp32 parity: got within 1e-4 of max |logit| of the reference logits ref."""
    err = np.abs(got - ref).max()
    assert err <= 1e-4 * np.abs(ref).max(), f"max abs err {err:.3g} vs max |logit| {np.abs(ref).max():.3g}"


def check_bf16_drift(got, ref, hf_bf16):
    """got drifts from the fp32 reference ref (1 - cosine, per position) by no more than transformers'
    own bf16 forward hf_bf16 does, and its top-1 token is the reference's, or one within twice
    transformers' bf16 error of it (a near-tie that bf16 rounding may flip either way)."""
    def drift(x):
        return 1 - (x * ref).sum(-1) / np.linalg.norm(x, axis=-1) / np.linalg.norm(ref, axis=-1)

    pick = ref[np.arange(len(ref)), got.argmax(-1)]
    assert (pick >= ref.max(-1) - 2 * np.abs(hf_bf16 - ref).max(-1)).all()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.75
    assert drift(got).max() <= max(drift(hf_bf16).max(), 1e-5), (drift(got), drift(hf_bf16))
    assert drift(got).max() < 2e-3
