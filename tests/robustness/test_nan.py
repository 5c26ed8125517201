"""NaN propagates: a NaN query, key, sink or scale gives NaN attention output on every implementation
(never the zeros of a query that sees nothing), and a checkpoint with NaN weights gives NaN logits
that `smoke` reports, as transformers would."""


import numpy as np
import pytest

from cpumla import native

F = np.float32


def _attn(n_q=1, H=6, dk=40, dv=32, T=300, bf16=False, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n_q, H, dk)).astype(F)
    kv = rng.standard_normal((T, max(dk, dv))).astype(F)
    return q, kv


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("where", ["query", "key", "key-late", "scale", "sink"])
@pytest.mark.parametrize("cache", ["f32", "bf16"])
def test_nan_reaches_the_attention_output(isa, threads, where, cache):
    native.set_threads(threads)
    try:
        for H in (1, 2, 5, 6):          # 4-head blocks, pairs and single heads of the vector kernels
            q, kv = _attn(H=H)
            scale, sinks = 0.125, None
            if where == "query":
                q[0, H - 1, 3] = np.nan
            elif where == "key":
                kv[0, 5] = np.nan
            elif where == "key-late":
                kv[-1, 0] = np.nan
            elif where == "scale":
                scale = float("nan")
            else:
                sinks = np.zeros(H, F)
                sinks[0] = np.nan
            kvc = kv if cache == "f32" else (kv.view(np.uint32) >> 16).astype(np.uint16)
            out, lse = native.mla_attention(q, kvc, q.shape[2], 32, scale, sinks=sinks, want_lse=True)
            bad = [H - 1] if where == "query" else [0] if where == "sink" else list(range(H))
            assert np.isnan(out[0, bad]).all(), f"{where}: heads {bad} must be NaN (H={H})"
            assert np.isnan(lse[0, bad]).all()
            good = [h for h in range(H) if h not in bad]
            assert np.isfinite(out[0, good]).all()
    finally:
        native.set_threads(None)


def test_a_query_that_sees_nothing_still_gives_zeros(isa):
    q, kv = _attn(n_q=2, H=3)
    q[1] = np.nan                      # the query that sees nothing has no scores, so no NaN score
    out = native.mla_attention(q, kv, q.shape[2], 32, 0.1, kv_len=np.array([5, 0]))
    assert (out[1] == 0).all() and np.isfinite(out[0]).all()


def _nan_checkpoint(tmp_path, tensor, value=np.nan):
    pytest.importorskip("torch")
    from safetensors.numpy import load_file, save_file

    from support import models

    d = tmp_path / "m"
    models.build("v2-lite", d)
    f = d / "model.safetensors"
    t = load_file(f)
    t[tensor] = t[tensor].copy()
    t[tensor][0, 0] = value
    save_file(t, f, metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("quant", [None, "q8", "q4"])
@pytest.mark.parametrize("tensor", ["model.layers.1.self_attn.q_proj.weight",
                                    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                                    "model.layers.1.mlp.experts.0.down_proj.weight"])
def test_nan_weights_give_nan_logits_and_smoke_says_so(tmp_path, tensor, quant):
    """In the checkpoint's format and quantized on load alike (a NaN weight's block gets a NaN scale)."""
    import cpumla
    from cpumla.cli import smoke

    d = _nan_checkpoint(tmp_path, tensor)
    eng = cpumla.load(str(d), quant=quant)
    logits = eng.forward(list(range(1, 40)))
    assert np.isnan(logits[-1]).any()
    r = smoke.run(str(d), dummy_weights=False, prompt_tokens=4, decode_tokens=2, quant=quant)
    assert r.status != "ok" and "non-finite" in r.status


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_quantize_command_keeps_a_nan(tmp_path, value):
    """`cpumla quantize` of a checkpoint holding a NaN or an infinity writes a checkpoint whose logits are
    NaN, and smoke on it says so (it never says ok on a checkpoint the quantizer made finite)."""
    import cpumla
    from cpumla.cli import smoke
    from cpumla.cli.quantize import quantize_checkpoint

    d = _nan_checkpoint(tmp_path, "model.layers.1.self_attn.q_proj.weight", value)
    for fmt in ("q8", "q4"):
        out = tmp_path / fmt
        quantize_checkpoint(str(d), out, fmt)
        logits = cpumla.load(str(out)).forward([1, 2, 3, 4])
        assert np.isnan(logits[-1]).all(), fmt
        r = smoke.run(str(out), dummy_weights=False, prompt_tokens=4, decode_tokens=2)
        assert r.status != "ok" and "non-finite" in r.status, (fmt, r.status)
