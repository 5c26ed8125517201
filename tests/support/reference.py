"""Independent references for the kernel tests: numpy in float64, torch for FP8 decoding.

Nothing here shares code with the C library: formats are decoded the way torch and the published
format descriptions (FP8 e4m3fn, E8M0, the FP4 e2m1 table) define them.
"""

from __future__ import annotations

import numpy as np
import torch

from cpumla import native

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), rounded to nearest even by torch."""
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16).view(torch.int16) \
        .numpy().view(np.uint16)


def bf16_value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def act(fmt: str, x: np.ndarray) -> np.ndarray:
    """The activation operand of a product with fmt weights, as float64: bf16 weights multiply x
    rounded to bf16 (nearest even, by torch), f32 / f16 / e2m1 multiply x as given. (e4m3 folds the
    block scale into the activation first: see Linear.)"""
    x = np.asarray(x, np.float32)
    return bf16_value(bf16_bits(x)).reshape(x.shape) if fmt == "bf16" else x.astype(np.float64)


class Linear:
    """The products of a weight with activations as kernels.h defines them, in float64: bf16 weights
    multiply x rounded to bf16; e4m3 codes multiply bf16(x * their block's scale), the product x *
    scale taken in float32; e2m1 with 1x32 E8M0 blocks over whole blocks is an integer product (x
    quantized to int16 per block, the codes 2 * value, the scale halved: fp4_terms); the other formats
    (and e2m1's other layouts) multiply their value (scale included) by x. terms() gives per-column
    products, or per-block terms for the integer product (gemv_t stays per column: terms_t)."""

    def __init__(self, fmt: str, data: np.ndarray, scale: np.ndarray | None, block):
        self.fmt = fmt
        self.W = dequant(fmt, data, scale, block)
        self.fp4 = None
        if fmt == "e2m1" and (block or (1, 32))[1] == QK and scale.dtype == np.uint8 and self.W.shape[1] % QK == 0:
            br = (block or (1, 32))[0]
            codes = np.stack([data & 15, data >> 4], -1).reshape(self.W.shape)
            wd = np.repeat(np.ldexp(1.0, scale.astype(np.int64) - 128), br, axis=0)[: self.W.shape[0]]
            wd[np.repeat(scale == 255, br, axis=0)[: self.W.shape[0]]] = np.nan
            self.fp4 = ((2 * E2M1[codes]).astype(np.int64), wd)
        if fmt == "e4m3":
            br, bc = block or (128, 128)
            s = scale_value(scale).astype(np.float32)
            self.Q = e4m3_value(data)
            self.S = np.repeat(np.repeat(s, br, axis=0), bc, axis=1)[: data.shape[0], : data.shape[1]]

    def terms(self, x: np.ndarray, rows=slice(None)) -> np.ndarray:
        """x [..., K] -> the products [..., R, K] of rows `rows` with x ([..., R, K/32] block terms for
        the integer FP4 product)."""
        if self.fp4 is not None:
            return fp4_terms(self.fp4[0][rows], self.fp4[1][rows], x)
        if self.fmt != "e4m3":
            return act(self.fmt, x)[..., None, :] * self.W[rows]
        xs = np.asarray(x, np.float32)[..., None, :] * self.S[rows]          # float32 products
        return self.Q[rows] * bf16_value(bf16_bits(xs)).reshape(xs.shape)

    def terms_t(self, x: np.ndarray, rows=slice(None)) -> np.ndarray:
        """x [..., nr] (one value per row of `rows`) -> the products [..., nr, K] of gemv_t."""
        if self.fmt != "e4m3":
            return act(self.fmt, x)[..., :, None] * self.W[rows]
        xs = np.asarray(x, np.float32)[..., :, None] * self.S[rows]
        return self.Q[rows] * bf16_value(bf16_bits(xs)).reshape(xs.shape)

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(W x, sum of |terms|) for x [..., K]"""
        p = self.terms(x)
        return p.sum(-1), np.abs(p).sum(-1)


def e4m3_value(q: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(q)).view(torch.float8_e4m3fn).to(torch.float64).numpy()


def e8m0_value(b: np.ndarray) -> np.ndarray:
    return np.ldexp(1.0, b.astype(np.int64) - 127)


def scale_value(s: np.ndarray) -> np.ndarray:
    return e8m0_value(s) if s.dtype == np.uint8 else s.astype(np.float64)


def dequant(fmt: str, data: np.ndarray, scale: np.ndarray | None = None,
            block: tuple[int, int] | None = None) -> np.ndarray:
    """The float64 matrix a weight stands for."""
    if fmt == "f32":
        return data.astype(np.float64)
    if fmt == "f16":
        return data.astype(np.float64)
    if fmt == "bf16":
        return bf16_value(data)
    if fmt == "e4m3":
        br, bc = block or (128, 128)
        s = scale_value(scale)
        full = np.repeat(np.repeat(s, br, axis=0), bc, axis=1)[: data.shape[0], : data.shape[1]]
        return e4m3_value(data) * full
    if fmt == "e2m1":
        lo, hi = E2M1[data & 15], E2M1[data >> 4]
        vals = np.stack([lo, hi], axis=-1).reshape(data.shape[0], data.shape[1] * 2)
        br, bc = block or (1, 32)
        s = scale_value(scale)
        full = np.repeat(np.repeat(s, br, axis=0), bc, axis=1)[: vals.shape[0], : vals.shape[1]]
        return vals * full
    raise ValueError(fmt)


def make_weight(fmt: str, rows: int, cols: int, rng: np.random.Generator, scale_kind: str = "f32",
                block: tuple[int, int] | None = None):
    """(data, scale, block) of a random weight in a checkpoint format, values of order 1."""
    if fmt == "f32":
        return rng.standard_normal((rows, cols)).astype(np.float32), None, None
    if fmt == "f16":
        return rng.standard_normal((rows, cols)).astype(np.float16), None, None
    if fmt == "bf16":
        return bf16_bits(rng.standard_normal((rows, cols))), None, None
    if fmt == "e4m3":
        block = block or (128, 128)
        q = torch.from_numpy(rng.standard_normal((rows, cols)) * 100).clamp(-448, 448) \
            .to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        grid = (-(-rows // block[0]), -(-cols // block[1]))
        if scale_kind == "e8m0":
            s = rng.integers(118, 124, size=grid).astype(np.uint8)
        else:
            s = rng.uniform(0.002, 0.02, size=grid).astype(np.float32)
        return q, s, block
    if fmt == "e2m1":
        block = block or (1, 32)
        q = rng.integers(0, 256, size=(rows, cols // 2)).astype(np.uint8)
        s = rng.integers(122, 130, size=(-(-rows // block[0]), -(-cols // block[1]))).astype(np.uint8)
        return q, s, block
    raise ValueError(fmt)


def rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y if w is None else y * w


def rope(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray, offset: int, rope_dim: int,
         half_split: bool, inverse: bool) -> np.ndarray:
    """x [n, H, d] float64; pairs (2i, 2i+1) or (i, i+half) of the slice [offset, offset+rope_dim)."""
    out = x.astype(np.float64).copy()
    half = rope_dim // 2
    ang = pos[:, None].astype(np.float32) * inv_freq[None, :].astype(np.float32)   # fp32 as torch does
    c, s = np.cos(ang.astype(np.float64))[:, None, :], np.sin(ang.astype(np.float64))[:, None, :]
    if inverse:
        s = -s
    sl = out[:, :, offset: offset + rope_dim]
    if half_split:
        a, b = sl[..., :half].copy(), sl[..., half:].copy()
        sl[..., :half], sl[..., half:] = a * c - b * s, b * c + a * s
    else:
        a, b = sl[..., 0::2].copy(), sl[..., 1::2].copy()
        sl[..., 0::2], sl[..., 1::2] = a * c - b * s, b * c + a * s
    return out


def attention(q: np.ndarray, kv: np.ndarray, dk: int, dv: int, scale: float, rows_per_query,
              sinks: np.ndarray | None = None):
    """q [n_q, H, dk], kv [T, >=dk] float64; rows_per_query[i] lists the kv rows query i sees.
    Returns out [n_q, H, dv] and lse [n_q, H]."""
    n_q, H = q.shape[:2]
    out = np.zeros((n_q, H, dv))
    lse = np.full((n_q, H), -np.inf)
    for i in range(n_q):
        rows = np.asarray(rows_per_query[i], dtype=np.int64)
        if rows.size == 0 and sinks is None:
            continue
        k = kv[rows, :dk]
        v = kv[rows, :dv]
        s = q[i] @ k.T * scale                                   # [H, n]
        parts = [s]
        if sinks is not None:
            parts.append(sinks[:, None].astype(np.float64))
        m = np.concatenate(parts, axis=1).max(axis=1, keepdims=True)
        p = np.exp(s - m)
        denom = p.sum(axis=1, keepdims=True)
        if sinks is not None:
            denom = denom + np.exp(sinks[:, None] - m)
        out[i] = (p @ v) / denom
        lse[i] = (m + np.log(denom))[:, 0]
    return out, lse


def yarn_inv_freq(dim: int, base: float, factor: float, original_max: int, beta_fast: float = 32,
                  beta_slow: float = 1) -> np.ndarray:
    """DeepSeek-flavoured YaRN inverse frequencies [dim/2], float64 (factor <= 1: plain RoPE)."""
    i = np.arange(dim // 2, dtype=np.float64)
    plain = base ** (-2 * i / dim)
    if factor <= 1:
        return plain

    def corr(n):
        return dim * np.log(original_max / (n * 2 * np.pi)) / (2 * np.log(base))

    low, high = max(np.floor(corr(beta_fast)), 0), min(np.ceil(corr(beta_slow)), dim - 1)
    if low == high:
        high += 1e-3
    ramp = np.clip((i - low) / (high - low), 0, 1)
    return plain * (ramp / factor + (1 - ramp))


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)                   # biased, as torch's LayerNorm
    return (x - mu) / np.sqrt(var + eps) * w + b


def dsa_index_scores(x: np.ndarray, q_latent: np.ndarray, wq_b: np.ndarray, wk: np.ndarray, k_norm_w: np.ndarray,
                     k_norm_b: np.ndarray, weights_proj: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray,
                     n_heads: int, rope_dim: int, attention_scaling: float = 1.0, eps: float = 1e-6) -> np.ndarray:
    """DeepSeek-V3.2's lightning-indexer scores for one layer, float64, as transformers'
    DeepseekV32Indexer computes them (its bf16/fp32 form: no Hadamard rotation, no FP8 scoring).

    x [n, D]: the layer's attention input (the input_layernorm output) for tokens 0..n-1 of the
    sequence (prefill and decode alike: a decode step is row t of this, its keys those of the
    tokens before it); q_latent [n, q_lora_rank]: q_a_layernorm(q_a_proj(x)), the same latent MLA's
    q_b_proj reads; wq_b [n_heads * d, q_lora_rank], wk [d, D], k_norm_w/k_norm_b [d] (LayerNorm,
    eps 1e-6), weights_proj [n_heads, D]: the indexer's weights (no biases); positions [n]: the
    tokens' absolute positions; inv_freq [rope_dim/2]: the model's rotary frequencies (YaRN
    included: the indexer shares MLA's cos/sin, attention_scaling too).

        q_h(t) = (wq_b q_latent_t)[h*d:(h+1)*d]          k(s) = LayerNorm(wk x_s)
        the first rope_dim dims of q_h and k rotated half-split (pairs (i, i + rope_dim/2), NOT
        MLA's interleaved pairs) by angle pos * inv_freq[i], times attention_scaling; the rest as is
        w_h(t) = (weights_proj x_t)[h] * n_heads^-0.5
        I[t, s] = sum_h w_h(t) * ReLU(q_h(t) . k(s) * d^-0.5)   for s <= t;   -inf for s > t

    Returns I [n, n]."""
    n, d = x.shape[0], wk.shape[0]
    q = (q_latent.astype(np.float64) @ wq_b.astype(np.float64).T).reshape(n, n_heads, d)
    k = layer_norm(x.astype(np.float64) @ wk.astype(np.float64).T, k_norm_w, k_norm_b, eps)[:, None, :]
    q = rope(q, positions, inv_freq, 0, rope_dim, half_split=True, inverse=False)
    k = rope(k, positions, inv_freq, 0, rope_dim, half_split=True, inverse=False)
    if attention_scaling != 1.0:
        q[..., :rope_dim] *= attention_scaling
        k[..., :rope_dim] *= attention_scaling
    w = x.astype(np.float64) @ weights_proj.astype(np.float64).T * n_heads ** -0.5        # [n, H]
    s = np.maximum(np.einsum("thd,sd->ths", q, k[:, 0]) * d ** -0.5, 0)                  # [t, H, s]
    scores = np.einsum("th,ths->ts", w, s)
    scores[np.triu_indices(n, 1)] = -np.inf
    return scores


def dsa_select(scores: np.ndarray, index_topk: int) -> list[np.ndarray]:
    """The keys each query attends to, ascending: all of 0..t when t + 1 <= index_topk, else the
    index_topk largest I[t, :t+1]. (transformers takes topk(min(index_topk, T)) over the causally
    masked row; the masked entries it may pick when t + 1 < index_topk stay masked, so they change
    nothing.) Ties are not resolved here: see dsa_margins."""
    out = []
    for t in range(scores.shape[0]):
        row = scores[t, : t + 1]
        out.append(np.arange(t + 1) if t + 1 <= index_topk else np.sort(np.argsort(-row, kind="stable")[:index_topk]))
    return out


def dsa_margins(scores: np.ndarray, index_topk: int) -> np.ndarray:
    """Per query: the gap between its index_topk-th and (index_topk+1)-th largest score over its
    valid keys, divided by the largest |score| of the row (inf when every key is selected). A
    selection is only a parity target when this is well above the rounding of the scores."""
    out = np.full(scores.shape[0], np.inf)
    for t in range(scores.shape[0]):
        row = np.sort(scores[t, : t + 1])[::-1]
        if row.size > index_topk:
            out[t] = (row[index_topk - 1] - row[index_topk]) / max(np.abs(row).max(), 1e-30)
    return out


# ---- cpumla's own q8 / q4 formats (cpumla.h, kernels.h) -------------------------------------------
QK = 32
FP4_QMAX = 32512          # e2m1 activations: int16 codes, 127 * 256 (kernels.h)


def make_q_weight(fmt: str, rows: int, cols: int, rng: np.random.Generator):
    """(data, scale, codes) of a random q8 / q4 weight laid out as cpumla.h describes: codes [rows, cols]
    the signed code of each element (q8: q; q4: nibble - 8), scale float16 [rows, cols/32]."""
    nb = cols // QK
    scale = (rng.uniform(0.5, 2.0, (rows, nb)) * np.ldexp(1.0, rng.integers(-9, -4, (rows, nb)))).astype(np.float16)
    if fmt == "q8":
        codes = rng.integers(-127, 128, (rows, cols))
        return codes.astype(np.int8), scale, codes
    nib = rng.integers(0, 16, (rows, cols))
    halves = nib.reshape(rows, nb, 2, 16)                        # [block][first 16 | last 16][i]
    data = (halves[:, :, 0, :] | (halves[:, :, 1, :] << 4)).astype(np.uint8).reshape(rows, cols // 2)
    return data, scale, nib - 8


def fp4_terms(w2: np.ndarray, wd: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The block terms of kernels.h's FP4 (e2m1) integer product: w2 [R, K] the codes 2 * value, wd
    [R, K/32] the E8M0 scales halved (2^(e - 128), NaN for 0xff), x [..., K] -> [..., R, K/32], each
    (float)isum * (float)(wd * xd) rounded to float32 as the definition rounds it."""
    q, xd = quant_act(x, FP4_QMAX)
    isum = np.einsum("rbi,...bi->...rb", w2.reshape(w2.shape[0], -1, QK), q)              # exact integers
    with np.errstate(over="ignore", invalid="ignore"):
        f = (wd.astype(np.float32) * xd[..., None, :]).astype(np.float32)
        return (isum.astype(np.float32) * f).astype(np.float64)


QACT_TINY = np.float32(2.0 ** -100)     # kernels.h: activation blocks below it quantize to zero


def quant_act(x: np.ndarray, qmax: int = 127):
    """kernels.h's activation quantization of x [..., K] to codes in [-qmax, qmax] (127: int8 for q8 /
    q4; 32512: int16 for e2m1): (codes int64 [..., K/32, 32], xd float32 [..., K/32]), every operation
    in float32 as specified; a block holding a NaN or an infinity: xd NaN, codes 0."""
    x = np.asarray(x, np.float32)
    xb = x.reshape(x.shape[:-1] + (x.shape[-1] // QK, QK))
    bad = ~np.isfinite(xb).all(-1)
    xb = np.where(bad[..., None], np.float32(0), xb)
    amax = np.abs(xb).max(-1)
    live = amax >= QACT_TINY            # blocks below 2^-100 count as zero
    xd = np.where(amax < QACT_TINY, np.float32(0), amax / np.float32(qmax)).astype(np.float32)
    xd[bad] = np.nan
    safe = np.where(live, amax, np.float32(1)).astype(np.float32)
    inv = np.where(live, np.float32(qmax) / safe, np.float32(0)).astype(np.float32)
    q = np.rint((xb * inv[..., None]).astype(np.float32)).astype(np.int64)     # half to even
    return q, xd


class QLinear:
    """Products with a q8 / q4 weight as kernels.h defines them, in float64: per block the exact
    integer sum of code products, times the weight's scale and the activation block's xd."""

    def __init__(self, codes: np.ndarray, scale: np.ndarray):
        self.codes = codes.reshape(codes.shape[0], -1, QK)       # [R, nb, 32]
        self.d = scale.astype(np.float64)                         # [R, nb]
        self.W = (self.codes * self.d[..., None]).reshape(codes.shape[0], -1)

    def __call__(self, x: np.ndarray, rows=slice(None)):
        """(y, sum of |terms|) for x [..., K] against rows `rows`"""
        q, xd = quant_act(x)
        isum = np.einsum("rbi,...bi->...rb", self.codes[rows], q)          # exact integers
        asum = np.einsum("rbi,...bi->...rb", np.abs(self.codes[rows]), np.abs(q))
        f = self.d[rows] * xd.astype(np.float64)[..., None, :]
        return (isum * f).sum(-1), (asum * f).sum(-1)

    def error_bound(self, x: np.ndarray, rows=slice(None)):
        """A bound on |y - W x| from rounding the activations: sum_c |W_c| xd_b / 2, plus |W_c x_c| over
        the blocks that count as zero (below QACT_TINY), plus rounding slack."""
        _, xd = quant_act(x)
        Wr = np.abs(self.W[rows]).reshape(self.W[rows].shape[0], -1, QK)             # [R, nb, 32]
        aw = Wr.sum(-1)                                                                # [R, nb]
        xa = np.abs(np.asarray(x, np.float64)).reshape(np.shape(x)[:-1] + (-1, QK))   # [..., nb, 32]
        dropped = np.where(xa.max(-1) < QACT_TINY, 1.0, 0.0)                         # [..., nb]
        lost = np.einsum("rbi,...bi->...r", Wr, xa * dropped[..., None])
        return (0.5 * (aw * xd.astype(np.float64)[..., None, :]).sum(-1) + lost) * (1 + 1e-5)


def quantize_ref(fmt: str, values: np.ndarray):
    """cpumla.h's weight quantization of fp32 values [R, K]: (data, scale) as the library stores them;
    a block holding a NaN or an infinity: scale NaN (fp16 0x7e00), codes 0."""
    v = np.asarray(values, np.float32).reshape(values.shape[0], -1, QK)
    bad = ~np.isfinite(v).all(-1)
    v = np.where(bad[..., None], np.float32(0), v)
    if fmt == "q8":
        d16 = (np.abs(v).max(-1) / np.float32(127)).astype(np.float16)
        lo, hi = -127, 127
    else:
        first = np.take_along_axis(v, np.abs(v).argmax(-1)[..., None], -1)[..., 0]     # first largest |v|
        d16 = (first / np.float32(-8)).astype(np.float16)
        lo, hi = -8, 7
    d = d16.astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.clip(np.rint((v * inv[..., None]).astype(np.float32)), lo, hi).astype(np.int64)
    d16.view(np.uint16)[bad] = 0x7E00
    if fmt == "q8":
        return q.astype(np.int8).reshape(values.shape), d16
    n = (q + 8).reshape(v.shape[0], v.shape[1], 2, 16)
    return (n[:, :, 0, :] | (n[:, :, 1, :] << 4)).astype(np.uint8).reshape(values.shape[0], -1), d16


def build(fmt, scale_kind, rows, cols, rng, strided=False):
    """(native.Weight, its float64 reference Linear) of random codes in fmt; strided: rows of a wider
    tensor, as a slice of a checkpoint tensor is."""
    data, scale, block = make_weight(fmt, rows, cols, rng, scale_kind or "f32")
    if strided:        # rows of a bigger tensor, as a slice of a checkpoint tensor is
        big = np.zeros((data.shape[0], data.shape[1] + 24), data.dtype)
        big[:, : data.shape[1]] = data
        data = big[:, : data.shape[1]]
    w = native.Weight(data, fmt, scale, block)
    return w, Linear(fmt, data, scale, block)


def assert_close(got, want, scale, rtol=2e-5, what=""):
    """|got - want| <= rtol * scale elementwise (scale: e.g. sum of |terms|), and no NaN."""
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all(), f"{what}: non-finite values (out-of-bounds read?)"
    err = np.abs(got - want)
    bound = rtol * (np.asarray(scale) + 1e-30)
    bad = err > bound
    assert not bad.any(), f"{what}: max err {err.max():.3g}, worst ratio {(err / bound).max():.3g}"
