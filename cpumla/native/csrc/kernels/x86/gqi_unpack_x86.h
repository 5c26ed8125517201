/* gqi_unpack_x86.h: the x86 levels' SIMD unpackers of GGUF's 32-column types, IQ types and MXFP4 (gguf_q.h)
 * and the primitives they share, for gqi_x86.h's products and amx_gq.c's panels. The level's flags pick
 * the int8 product (vpdpbusd, or vpmaddubsw + vpmaddwd) and the way signs are applied.
 *
 * A row's group of 8 chunks (256 columns) is unpacked straight into registers (gqi_grp) as unsigned
 * operand bytes w per chunk (the codes plus an offset `off`, or their magnitudes) and, where the codes'
 * signs are not in w, a sign mask or signed copy; the scales as int32 per chunk, d (and dm) as fp32:
 * the spec's values (gguf_q.c's gq_unpack), bit for bit. */
#ifndef CPUMLA_GQI_UNPACK_X86_H
#define CPUMLA_GQI_UNPACK_X86_H
#include <immintrin.h>
#include <string.h>
#include "core/gguf_q.h"
#include "core/quant.h"


#define GQI_INLINE static inline __attribute__((always_inline))

/* ---- the level's primitives ---------------------------------------------------------------------- */
#if defined(__AVX512VNNI__)
typedef __mmask32 gqi_mask; /* bit j: code j of the chunk is negative */
/* 8 int32 lanes, lane i summing w_j x_j over bytes 4i .. 4i+3 (w unsigned, x signed) */
GQI_INLINE __m256i gqi_dpu(__m256i w, __m256i x) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x); }
GQI_INLINE gqi_mask gqi_mask_of(uint32_t bits) { return (gqi_mask)bits; }
GQI_INLINE __m256i gqi_neg(__m256i x, gqi_mask m) { return _mm256_mask_sub_epi8(x, m, _mm256_setzero_si256(), x); }
/* 32 bytes: v where bit j of bits is set, else 0 */
GQI_INLINE __m256i gqi_bits(uint32_t bits, int8_t v) { return _mm256_maskz_mov_epi8((__mmask32)bits, _mm256_set1_epi8(v)); }
#else
typedef __m256i gqi_mask; /* byte j: -1 where code j is negative, else 1 */
/* exact: each pair w_j x_j + w_j+1 x_j+1 stays within int16 for w <= 128, |x| <= 127 */
GQI_INLINE __m256i gqi_dpu(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}
/* byte j: 0xff where bit j of bits is set */
GQI_INLINE __m256i gqi_expand(uint32_t bits) {
    const __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                          _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                            0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    return _mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit);
}
GQI_INLINE gqi_mask gqi_mask_of(uint32_t bits) { return _mm256_or_si256(gqi_expand(bits), _mm256_set1_epi8(1)); }
GQI_INLINE __m256i gqi_neg(__m256i x, gqi_mask m) { return _mm256_sign_epi8(x, m); }
GQI_INLINE __m256i gqi_bits(uint32_t bits, int8_t v) { return _mm256_and_si256(gqi_expand(bits), _mm256_set1_epi8(v)); }
#endif

/* how the codes' signs reach the product */
enum { GQI_SG_NONE, GQI_SG_MASK, GQI_SG_VAL };
/* the nibble-table types (IQ4_NL, IQ4_XS, and MXFP4 in the panels; gqi_x86.h's gemm takes MXFP4 as
 * gqi_un_mxfp4_u below): avx512vnni takes value + 128 with off 128; avx2 the magnitudes, the signs given
 * to x (vpsignb) */
#if defined(__AVX512VNNI__)
#define GQI_TAB_OFF 128
#define GQI_TAB_SG GQI_SG_NONE
#else
#define GQI_TAB_OFF 0
#define GQI_TAB_SG GQI_SG_VAL
#endif

/* one row's group of 8 chunks, unpacked */
typedef struct {
    __m256i w[8];        /* unsigned operand bytes */
    __m256i v[8];        /* GQI_SG_VAL: signed bytes whose signs x takes */
    gqi_mask m[8];       /* GQI_SG_MASK */
    __m256i s, s1;       /* int32 scale per chunk (s1: second halves, types scaled per 16) */
    __m256 d, dm;
} gqi_grp;

/* per call: the nibble tables as the level uses them */
typedef struct {
    __m256i tab_w, tab_v;
} gqi_ctx;

GQI_INLINE void gqi_ctx_tab(gqi_ctx *cx, const int8_t *kv) {
    const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kv));
#if defined(__AVX512VNNI__)
    cx->tab_w = _mm256_xor_si256(t, _mm256_set1_epi8((char)0x80));
    cx->tab_v = t;
#else
    cx->tab_w = _mm256_abs_epi8(t);
    cx->tab_v = t;
#endif
}

/* ---- shared pieces ----------------------------------------------------------------------------- */
GQI_INLINE uint32_t gqi_le32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
GQI_INLINE uint16_t gqi_le16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
/* an fp16 as fp32 (vcvtph2ps: exact; a signalling NaN comes out quiet, as the spec's first product
 * with it makes it) */
GQI_INLINE float gqi_h16(const uint8_t *p) { return _cvtsh_ss(gqi_le16(p)); }

/* the 32 nibbles of 16 bytes: low ones (columns 0..15), then high ones (16..31) */
GQI_INLINE __m256i gqi_nib(const uint8_t *p) {
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    return _mm256_and_si256(_mm256_srlv_epi64(b, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(15));
}

/* the fp16 at p + j stride (j < n; 0 past n) as 8 fp32, as gqi_h16 */
GQI_INLINE __m256 gqi_h8(const uint8_t *p, int64_t stride, int n) {
    if (n == 8)
        return _mm256_cvtph_ps(_mm_set_epi16((short)gqi_le16(p + 7 * stride), (short)gqi_le16(p + 6 * stride),
                                             (short)gqi_le16(p + 5 * stride), (short)gqi_le16(p + 4 * stride),
                                             (short)gqi_le16(p + 3 * stride), (short)gqi_le16(p + 2 * stride),
                                             (short)gqi_le16(p + stride), (short)gqi_le16(p)));
    uint16_t h[8] = {0};
    for (int j = 0; j < n; j++) h[j] = gqi_le16(p + j * stride);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* the 8 chunk sums of s[0..7] (8 int32 lanes each), in order */
GQI_INLINE __m256i gqi_sums8(const __m256i s[8]) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}
/* the first-half (bytes 0..15) and second-half sums of 8 chunks */
GQI_INLINE void gqi_halves8(const __m256i s[8], __m256i *lo, __m256i *hi) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
    *lo = _mm256_permute2x128_si256(a, b, 0x20);
    *hi = _mm256_permute2x128_si256(a, b, 0x31);
}

/* acc (4 rows) += p[i][c] for c = 0 .. nc-1 in order: the 4 x 8 products transposed, added as 4 lanes */
GQI_INLINE __m128 gqi_add4(__m128 acc, const __m256 p[4], int nc) {
    const __m256 t0 = _mm256_unpacklo_ps(p[0], p[1]), t1 = _mm256_unpackhi_ps(p[0], p[1]);
    const __m256 t2 = _mm256_unpacklo_ps(p[2], p[3]), t3 = _mm256_unpackhi_ps(p[2], p[3]);
    const __m256 v0 = _mm256_shuffle_ps(t0, t2, 0x44), v1 = _mm256_shuffle_ps(t0, t2, 0xee);
    const __m256 v2 = _mm256_shuffle_ps(t1, t3, 0x44), v3 = _mm256_shuffle_ps(t1, t3, 0xee);
    const __m128 v[8] = {_mm256_castps256_ps128(v0), _mm256_castps256_ps128(v1), _mm256_castps256_ps128(v2),
                         _mm256_castps256_ps128(v3), _mm256_extractf128_ps(v0, 1), _mm256_extractf128_ps(v1, 1),
                         _mm256_extractf128_ps(v2, 1), _mm256_extractf128_ps(v3, 1)};
    for (int c = 0; c < nc; c++) acc = _mm_add_ps(acc, v[c]);
    return acc;
}
/* the running sums of rows r .. r + nr - 1 of token row yt */
GQI_INLINE __m128 gqi_load4(const float *yt, int nr) {
    if (nr == 4) return _mm_loadu_ps(yt);
    float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int i = 0; i < nr; i++) a[i] = yt[i];
    return _mm_loadu_ps(a);
}
GQI_INLINE void gqi_store4(float *yt, __m128 v, int nr) {
    if (nr == 4) { _mm_storeu_ps(yt, v); return; }
    float a[4];
    _mm_storeu_ps(a, v);
    for (int i = 0; i < nr; i++) yt[i] = a[i];
}

/* the sign bytes of 8 chunks of the IQ2_XXS / IQ3_XXS layout: dword c of a holds chunk c's four 7-bit
 * sign fields; each becomes gq_ksigns' byte, the field with its parity in bit 7 (gqi_ksigns_ok checks
 * the table is that), dword c of the result chunk c's 32 sign bits */
GQI_INLINE __m256i gqi_signs8(__m256i a) {
    const __m256i f = _mm256_set1_epi32(0x7f);
    __m256i t = _mm256_or_si256(_mm256_and_si256(a, f), _mm256_and_si256(_mm256_slli_epi32(a, 1), _mm256_slli_epi32(f, 8)));
    t = _mm256_or_si256(t, _mm256_and_si256(_mm256_slli_epi32(a, 2), _mm256_slli_epi32(f, 16)));
    t = _mm256_or_si256(t, _mm256_and_si256(_mm256_slli_epi32(a, 3), _mm256_slli_epi32(f, 24)));
    __m256i p = _mm256_xor_si256(t, _mm256_srli_epi32(t, 4));
    p = _mm256_xor_si256(p, _mm256_srli_epi32(p, 2));
    p = _mm256_xor_si256(p, _mm256_srli_epi32(p, 1));
    return _mm256_or_si256(t, _mm256_slli_epi32(_mm256_and_si256(p, _mm256_set1_epi32(0x01010101)), 7));
}
GQI_INLINE int gqi_ksigns_ok(void) {
    for (int i = 0; i < 128; i++) {
        const int p = __builtin_parity((unsigned)i);
        if (gq_ksigns[i] != (uint8_t)(i | p << 7)) return 0;
    }
    return 1;
}

/* ---- the unpackers: row rp's group g (its chunks 0 .. nc-1; the rest zero) ---------------------- */
#define GQI_ZERO_PAST(nc)                                                                                  \
    for (int c = nc; c < 8; c++) u->w[c] = _mm256_setzero_si256()

/* Q4_0 / Q4_1 / Q5_0 / Q5_1: blocks of 32; nibbles (+ the fifth bits as 16) */
GQI_INLINE void gqi_un_q4_0(const uint8_t *rp, int64_t g, int nc, gqi_grp *u, const gqi_ctx *cx) {
    const uint8_t *b = rp + g * 8 * 18;
    for (int c = 0; c < nc; c++) u->w[c] = gqi_nib(b + 18 * c + 2);
    GQI_ZERO_PAST(nc);
    u->d = gqi_h8(b, 18, nc);
}
GQI_INLINE void gqi_un_q4_1(const uint8_t *rp, int64_t g, int nc, gqi_grp *u, const gqi_ctx *cx) {
    const uint8_t *b = rp + g * 8 * 20;
    for (int c = 0; c < nc; c++) u->w[c] = gqi_nib(b + 20 * c + 4);
    GQI_ZERO_PAST(nc);
    u->d = gqi_h8(b, 20, nc);
    u->dm = _mm256_xor_ps(gqi_h8(b + 2, 20, nc), _mm256_set1_ps(-0.0f));
}
GQI_INLINE void gqi_un_q5_0(const uint8_t *rp, int64_t g, int nc, gqi_grp *u, const gqi_ctx *cx) {
    const uint8_t *b = rp + g * 8 * 22;
    for (int c = 0; c < nc; c++) u->w[c] = _mm256_or_si256(gqi_nib(b + 22 * c + 6), gqi_bits(gqi_le32(b + 22 * c + 2), 16));
    GQI_ZERO_PAST(nc);
    u->d = gqi_h8(b, 22, nc);
}
GQI_INLINE void gqi_un_q5_1(const uint8_t *rp, int64_t g, int nc, gqi_grp *u, const gqi_ctx *cx) {
    const uint8_t *b = rp + g * 8 * 24;
    for (int c = 0; c < nc; c++) u->w[c] = _mm256_or_si256(gqi_nib(b + 24 * c + 8), gqi_bits(gqi_le32(b + 24 * c + 4), 16));
    GQI_ZERO_PAST(nc);
    u->d = gqi_h8(b, 24, nc);
    u->dm = _mm256_xor_ps(gqi_h8(b + 2, 24, nc), _mm256_set1_ps(-0.0f));
}
/* nibble-table values */
GQI_INLINE void gqi_tab(const gqi_ctx *cx, __m256i nib, __m256i *w, __m256i *v) {
    *w = _mm256_shuffle_epi8(cx->tab_w, nib);
    if (GQI_TAB_SG == GQI_SG_VAL) *v = _mm256_shuffle_epi8(cx->tab_v, nib);
}
GQI_INLINE void gqi_un_iq4_nl(const uint8_t *rp, int64_t g, int nc, gqi_grp *u, const gqi_ctx *cx) {
    const uint8_t *b = rp + g * 8 * 18;
    for (int c = 0; c < nc; c++) gqi_tab(cx, gqi_nib(b + 18 * c + 2), &u->w[c], &u->v[c]);
    for (int c = nc; c < 8; c++) u->w[c] = u->v[c] = _mm256_setzero_si256();
    u->d = gqi_h8(b, 18, nc);
}
/* the d of the nc MXFP4 blocks at b: 2^(e - 128), (e - 1) << 23, or the subnormal 0x00200000 << e for e < 2 */
GQI_INLINE __m256 gqi_mx_d(const uint8_t *b, int nc) {
    uint32_t e[8] = {0};
    for (int c = 0; c < nc; c++) e[c] = b[17 * c];
    const __m256i ev = _mm256_loadu_si256((const __m256i *)e);
    const __m256i nrm = _mm256_slli_epi32(_mm256_sub_epi32(ev, _mm256_set1_epi32(1)), 23);
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), ev);
    const __m256i big = _mm256_cmpgt_epi32(ev, _mm256_set1_epi32(1));
    __m256i bits = _mm256_blendv_epi8(sub, nrm, big);
    if (nc < 8) bits = _mm256_and_si256(bits, _mm256_cmpgt_epi32(_mm256_set1_epi32(nc), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    return _mm256_castsi256_ps(bits);
}
GQI_INLINE void gqi_un_mxfp4(const uint8_t *rp, int64_t g, int nc, gqi_grp *u, const gqi_ctx *cx) {
    const uint8_t *b = rp + g * 8 * 17;
    for (int c = 0; c < nc; c++) gqi_tab(cx, gqi_nib(b + 17 * c + 1), &u->w[c], &u->v[c]);
    for (int c = nc; c < 8; c++) u->w[c] = u->v[c] = _mm256_setzero_si256();
    u->d = gqi_mx_d(b, nc);
}
/* MXFP4 in avx2's gemm (gqi_x86.h): its codes as the unsigned v + gq_mxfp4_max from a table of their own
 * (gqi_ctx_off), the offset taken out with the activations' code sums, which spares the signs of the
 * other table types (a vpshufb a chunk and row, a vpsignb a chunk and token). vpmaddubsw's pair sums stay
 * below 2^15 while the table's largest |v| is at most GQI_MX_MAX (the format's is 12); a table beyond it
 * (cpumla_gguf_tables takes any int8) takes the signs' path. */
#define GQI_MX_MAX 64
GQI_INLINE void gqi_ctx_off(gqi_ctx *cx, const int8_t *kv, int off) {
    const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kv));
    cx->tab_w = _mm256_add_epi8(t, _mm256_set1_epi8((char)off));
    cx->tab_v = t;
}
GQI_INLINE void gqi_un_mxfp4_u(const uint8_t *rp, int64_t g, int nc, gqi_grp *u, const gqi_ctx *cx) {
    const uint8_t *b = rp + g * 8 * 17;
    for (int c = 0; c < nc; c++) u->w[c] = _mm256_shuffle_epi8(cx->tab_w, gqi_nib(b + 17 * c + 1));
    for (int c = nc; c < 8; c++) u->w[c] = _mm256_setzero_si256();
    u->d = gqi_mx_d(b, nc);
}
GQI_INLINE void gqi_un_iq4_xs(const uint8_t *rp, int64_t g, int nc, gqi_grp *u, const gqi_ctx *cx) {
    const uint8_t *b = rp + g * 136;
    for (int c = 0; c < 8; c++) gqi_tab(cx, gqi_nib(b + 8 + 16 * c), &u->w[c], &u->v[c]);
    /* chunk c: the nibble c of the 4 bytes at 4 (low 4 bits), bits 2c, 2c+1 of the word at 2 (high 2) */
    const __m256i lo = _mm256_srlv_epi32(_mm256_set1_epi32((int)gqi_le32(b + 4)), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    const __m256i hi = _mm256_srlv_epi32(_mm256_set1_epi32(gqi_le16(b + 2)), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    const __m256i ls = _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(15)),
                                       _mm256_slli_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(3)), 4));
    u->s = _mm256_sub_epi32(ls, _mm256_set1_epi32(32));
    u->d = _mm256_set1_ps(gqi_h16(b));
}
/* the grid types' scale 2 ls + 1, ls the top 4 bits of each dword */
GQI_INLINE __m256i gqi_ls(__m256i a) {
    return _mm256_add_epi32(_mm256_slli_epi32(_mm256_srli_epi32(a, 28), 1), _mm256_set1_epi32(1));
}
GQI_INLINE void gqi_masks(gqi_grp *u, __m256i sgn) {
    uint32_t s[8];
    _mm256_storeu_si256((__m256i *)s, sgn);
    for (int c = 0; c < 8; c++) u->m[c] = gqi_mask_of(s[c]);
}
GQI_INLINE void gqi_un_iq2_xxs(const uint8_t *rp, int64_t g, int nc, gqi_grp *u, const gqi_ctx *cx) {
    const uint8_t *b = rp + g * 66, *q = b + 2;
    /* chunk c: grid indices in the 4 bytes at 8c, signs and scale in the dword at 8c + 4 */
    const __m256i q0 = _mm256_loadu_si256((const __m256i *)q), q1 = _mm256_loadu_si256((const __m256i *)(q + 32));
    const __m256i a1 = _mm256_permute4x64_epi64(
        _mm256_castps_si256(_mm256_shuffle_ps(_mm256_castsi256_ps(q0), _mm256_castsi256_ps(q1), 0xdd)), 0xd8);
    for (int c = 0; c < 8; c++) {
        const uint8_t *i = q + 8 * c;
        u->w[c] = _mm256_set_epi64x((long long)gq_iq2xxs_grid[i[3]], (long long)gq_iq2xxs_grid[i[2]],
                                    (long long)gq_iq2xxs_grid[i[1]], (long long)gq_iq2xxs_grid[i[0]]);
    }
    gqi_masks(u, gqi_signs8(a1));
    u->s = gqi_ls(a1);
    u->d = _mm256_set1_ps(gqi_h16(b) * 0.125f);
}
GQI_INLINE void gqi_un_iq3_xxs(const uint8_t *rp, int64_t g, int nc, gqi_grp *u, const gqi_ctx *cx) {
    const uint8_t *b = rp + g * 98, *q = b + 2;
    const __m256i a = _mm256_loadu_si256((const __m256i *)(b + 66));
    for (int c = 0; c < 8; c++) {
        const uint8_t *i = q + 8 * c;
        u->w[c] = _mm256_set_epi32((int)gq_iq3xxs_grid[i[7]], (int)gq_iq3xxs_grid[i[6]], (int)gq_iq3xxs_grid[i[5]],
                                   (int)gq_iq3xxs_grid[i[4]], (int)gq_iq3xxs_grid[i[3]], (int)gq_iq3xxs_grid[i[2]],
                                   (int)gq_iq3xxs_grid[i[1]], (int)gq_iq3xxs_grid[i[0]]);
    }
    gqi_masks(u, gqi_signs8(a));
    u->s = gqi_ls(a);
    u->d = _mm256_set1_ps(gqi_h16(b) * 0.25f);
}
/* IQ1_S: w = 8 (g + 1) + (delta + 1) = q + 9 in 0 .. 18 (off 9); g in {-1, 0, 1}, so 8 g = sign(8, g) */
GQI_INLINE void gqi_un_iq1_s(const uint8_t *rp, int64_t g, int nc, gqi_grp *u, const gqi_ctx *cx) {
    const uint8_t *b = rp + g * 50, *q = b + 2, *h = b + 34;
    for (int c = 0; c < 8; c++) {
        const uint32_t qh = gqi_le16(h + 2 * c);
        const uint8_t *i = q + 4 * c;
        const __m256i gr = _mm256_set_epi64x((long long)gq_iq1s_grid[i[3] | ((qh >> 9) & 7) << 8],
                                             (long long)gq_iq1s_grid[i[2] | ((qh >> 6) & 7) << 8],
                                             (long long)gq_iq1s_grid[i[1] | ((qh >> 3) & 7) << 8],
                                             (long long)gq_iq1s_grid[i[0] | (qh & 7) << 8]);
        u->w[c] = _mm256_add_epi8(_mm256_sign_epi8(_mm256_set1_epi8(8), gr), _mm256_set1_epi8(qh & 0x8000 ? 8 : 10));
    }
    const __m256i qh = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h));
    u->s = _mm256_add_epi32(_mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(qh, 12), _mm256_set1_epi32(7)), 1),
                            _mm256_set1_epi32(1));
    u->d = _mm256_set1_ps(gqi_h16(b) * 0.125f);
}
/* IQ1_M: v = q = 8 g + delta (delta per 8 codes), w = |q|; scales per 16 */
GQI_INLINE void gqi_un_iq1_m(const uint8_t *rp, int64_t g, int nc, gqi_grp *u, const gqi_ctx *cx) {
    const uint8_t *b = rp + g * 56, *q = b, *h = b + 32;
    for (int c = 0; c < 8; c++) {
        const uint32_t n0 = h[2 * c], n1 = h[2 * c + 1];
        const uint8_t *i = q + 4 * c;
        const __m256i gr = _mm256_set_epi64x((long long)gq_iq1s_grid[i[3] | (n1 & 0x70) << 4],
                                             (long long)gq_iq1s_grid[i[2] | (n1 & 7) << 8],
                                             (long long)gq_iq1s_grid[i[1] | (n0 & 0x70) << 4],
                                             (long long)gq_iq1s_grid[i[0] | (n0 & 7) << 8]);
        const long long one = 0x0101010101010101ll, neg = -1ll;
        const __m256i dl = _mm256_set_epi64x(n1 & 0x80 ? neg : one, n1 & 8 ? neg : one, n0 & 0x80 ? neg : one,
                                             n0 & 8 ? neg : one);
        const __m256i v = _mm256_add_epi8(_mm256_sign_epi8(_mm256_set1_epi8(8), gr), dl);
        u->v[c] = v;
        u->w[c] = _mm256_abs_epi8(v);
    }
    /* scale t (half t): 3 bits at 3 (t % 4) of word t / 4 of the 4 at 48; d from the words' top nibbles */
    uint16_t sc[4];
    memcpy(sc, b + 48, 8);
    const __m256i sh = _mm256_setr_epi32(0, 6, 0, 6, 0, 6, 0, 6);
    const __m256i w4 = _mm256_setr_epi32(sc[0], sc[0], sc[1], sc[1], sc[2], sc[2], sc[3], sc[3]);
    const __m256i seven = _mm256_set1_epi32(7), one = _mm256_set1_epi32(1);
    u->s = _mm256_add_epi32(_mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(w4, sh), seven), 1), one);
    u->s1 = _mm256_add_epi32(_mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(w4, _mm256_add_epi32(sh, _mm256_set1_epi32(3))), seven), 1), one);
    const uint16_t dbits = (uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0xf0) | ((sc[2] >> 4) & 0xf00) | (sc[3] & 0xf000));
    u->d = _mm256_set1_ps(f16_to_f32(dbits) * 0.125f);
}

#endif
