/* gqi_x86.h: the x86 levels' own GGUF products for the 32-column types, the IQ types and MXFP4
 * (gguf_q.h), compiled once per level by avx2_gqi.c and avx512vnni_gqi.c; the level's flags pick the
 * int8 product (vpdpbusd, or vpmaddubsw + vpmaddwd) and the way signs are applied.
 *
 * Each row is taken 256 columns (8 chunks) at a time: a group's blocks are unpacked straight into
 * registers as unsigned operand bytes w per chunk (the codes plus an offset `off`, or their
 * magnitudes) and, where the codes' signs are not in w, a sign mask or signed copy applied to the
 * activation codes. Chunk sums are exact int32: sum(w x) - off * sum(x) (the code sums of gq_quant_x's
 * layout), times the chunk's integer scale; then the spec's fp32 products, 8 chunks at once, added to
 * the row's sum one by one in column order. Four rows are taken at once, their sums the 4 lanes of one
 * vector (each lane's adds in column order); a group is unpacked once and used for every token.
 * IQ2_XXS on avx512vnni looks its grid up in registers (gqi_gemm_iq2_xxs_z). */
#include <immintrin.h>
#include <string.h>
#include "core/gguf_q.h"
#include "core/quant.h"

typedef void (*gqi_gemm_fn)(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,
                            int64_t r1);

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
/* the nibble-table types (IQ4_NL, IQ4_XS, MXFP4): avx512vnni takes value + 128 with off 128; avx2
 * the magnitudes, the signs given to x (vpsignb) */
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
static int gqi_ksigns_ok(void) {
    for (int i = 0; i < 128; i++) {
        const int p = __builtin_parity((unsigned)i);
        if (gq_ksigns[i] != (uint8_t)(i | p << 7)) return 0;
    }
    return 1;
}

/* ---- the product of one unpacked group with one token ------------------------------------------
 * xq, xd, xs: the token's codes, scales and code sums at the group's first chunk */
GQI_INLINE __m256 gqi_prod(const gqi_grp *u, const int8_t *xq, const float *xd, const int32_t *xs, const int off,
                           const int sg, const int has_s, const int has_min, const int halves) {
    __m256i a[8];
    for (int c = 0; c < 8; c++) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 32 * c));
        if (sg == GQI_SG_MASK) x = gqi_neg(x, u->m[c]);
        else if (sg == GQI_SG_VAL) x = _mm256_sign_epi8(x, u->v[c]);
        a[c] = gqi_dpu(u->w[c], x);
    }
    __m256i isum;
    if (halves) {
        __m256i lo, hi;
        gqi_halves8(a, &lo, &hi);
        isum = _mm256_add_epi32(_mm256_mullo_epi32(u->s, lo), _mm256_mullo_epi32(u->s1, hi));
    } else {
        isum = gqi_sums8(a);
        if (off) isum = _mm256_sub_epi32(isum, _mm256_mullo_epi32(_mm256_set1_epi32(off), _mm256_loadu_si256((const __m256i *)xs)));
        if (has_s) isum = _mm256_mullo_epi32(isum, u->s);
    }
    const __m256 xdv = _mm256_loadu_ps(xd);
    __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(u->d, xdv));
    if (has_min) {
        const __m256 xsf = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)xs));
        p = _mm256_sub_ps(p, _mm256_mul_ps(xsf, _mm256_mul_ps(u->dm, xdv)));
    }
    return p;
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
GQI_INLINE void gqi_un_mxfp4(const uint8_t *rp, int64_t g, int nc, gqi_grp *u, const gqi_ctx *cx) {
    const uint8_t *b = rp + g * 8 * 17;
    uint32_t e[8] = {0};
    for (int c = 0; c < nc; c++) {
        gqi_tab(cx, gqi_nib(b + 17 * c + 1), &u->w[c], &u->v[c]);
        e[c] = b[17 * c];
    }
    for (int c = nc; c < 8; c++) u->w[c] = u->v[c] = _mm256_setzero_si256();
    /* d = 2^(e - 128): (e - 1) << 23, or the subnormal 0x00200000 << e for e < 2 */
    const __m256i ev = _mm256_loadu_si256((const __m256i *)e);
    const __m256i nrm = _mm256_slli_epi32(_mm256_sub_epi32(ev, _mm256_set1_epi32(1)), 23);
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), ev);
    const __m256i big = _mm256_cmpgt_epi32(ev, _mm256_set1_epi32(1));
    __m256i bits = _mm256_blendv_epi8(sub, nrm, big);
    if (nc < 8) bits = _mm256_and_si256(bits, _mm256_cmpgt_epi32(_mm256_set1_epi32(nc), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    u->d = _mm256_castsi256_ps(bits);
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

/* ---- the gemm: rows r0 .. r1 by n tokens, four rows at a time ------------------------------------ */
#define GQI_NR 4

/* group g (nc chunks) of the four rows: unpacked once, then each token's products added in order */
#define GQI_GROUP(UNPACK, OFF, SG, HAS_S, HAS_MIN, HALVES, nc)                                                \
    do {                                                                                                       \
        gqi_grp u[GQI_NR];                                                                                     \
        for (int i = 0; i < GQI_NR; i++) {                                                                     \
            UNPACK(rp[i], g, nc, &u[i], &cx);                                                                  \
            for (int64_t o = 0; o < gbytes; o += 64) __builtin_prefetch(rp[i] + (g + pfg) * gbytes + o, 0, 3); \
        }                                                                                                      \
        for (int64_t t = 0; t < n; t++) {                                                                      \
            const uint8_t *xt = (const uint8_t *)qx + t * per;                                                 \
            __m256 pv[GQI_NR];                                                                                 \
            for (int i = 0; i < GQI_NR; i++)                                                                   \
                pv[i] = gqi_prod(&u[i], (const int8_t *)xt + 256 * g, qx_d(xt, K) + 8 * g, qx_s(xt, K) + 8 * g,  \
                                 OFF, SG, HAS_S, HAS_MIN, HALVES);                                             \
            if (n == 1) acc = gqi_add4(acc, pv, nc);                                                           \
            else {                                                                                             \
                float *yt = y + t * ldy + (r - r0);                                                            \
                gqi_store4(yt, gqi_add4(g == 0 ? _mm_setzero_ps() : gqi_load4(yt, nr), pv, nc), nr);           \
            }                                                                                                  \
        }                                                                                                      \
    } while (0)

#define GQI_DEFINE(NAME, UNPACK, GBYTES, OFF, SG, HAS_S, HAS_MIN, HALVES, TAB)                                 \
    GQI_INLINE void NAME##_n(const cpumla_weight *w, const void *qx, const int64_t n, float *y, int64_t ldy,      \
                             int64_t r0, int64_t r1) {                                                         \
        gqi_ctx cx;                                                                                            \
        const int8_t *tab = TAB;                                                                               \
        if (tab) gqi_ctx_tab(&cx, tab);                                                                        \
        const int64_t K = w->cols, per = QX_BYTES(K), nch = K / 32, nfull = nch / 8, gbytes = GBYTES;          \
        const int ntail = (int)(nch % 8);                                                                      \
        const int64_t pfg = 1024 / gbytes + 1;                                                                 \
        for (int64_t r = r0; r < r1; r += GQI_NR) {                                                            \
            const int nr = r1 - r < GQI_NR ? (int)(r1 - r) : GQI_NR;                                           \
            const uint8_t *rp[GQI_NR];                                                                         \
            for (int i = 0; i < GQI_NR; i++)                                                                   \
                rp[i] = (const uint8_t *)w->data + (r + (i < nr ? i : nr - 1)) * w->row_bytes;                 \
            __m128 acc = _mm_setzero_ps();                                                                     \
            int64_t g = 0;                                                                                     \
            for (; g < nfull; g++) GQI_GROUP(UNPACK, OFF, SG, HAS_S, HAS_MIN, HALVES, 8);                      \
            if (ntail) GQI_GROUP(UNPACK, OFF, SG, HAS_S, HAS_MIN, HALVES, ntail);                              \
            if (n == 1) gqi_store4(y + (r - r0), acc, nr);                                                     \
        }                                                                                                      \
    }                                                                                                          \
    static void NAME(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,     \
                     int64_t r1) {                                                                             \
        if (n == 1) NAME##_n(w, qx, 1, y, ldy, r0, r1);                                                        \
        else NAME##_n(w, qx, n, y, ldy, r0, r1);                                                               \
    }

/* the types: unpacker, group bytes, off, signs, integer scales, mins, per-16 scales, nibble table */
GQI_DEFINE(gqi_gemm_q4_0, gqi_un_q4_0, 144, 8, GQI_SG_NONE, 0, 0, 0, NULL)
GQI_DEFINE(gqi_gemm_q4_1, gqi_un_q4_1, 160, 0, GQI_SG_NONE, 0, 1, 0, NULL)
GQI_DEFINE(gqi_gemm_q5_0, gqi_un_q5_0, 176, 16, GQI_SG_NONE, 0, 0, 0, NULL)
GQI_DEFINE(gqi_gemm_q5_1, gqi_un_q5_1, 192, 0, GQI_SG_NONE, 0, 1, 0, NULL)
GQI_DEFINE(gqi_gemm_iq4_nl, gqi_un_iq4_nl, 144, GQI_TAB_OFF, GQI_TAB_SG, 0, 0, 0, gq_kvalues_iq4nl)
GQI_DEFINE(gqi_gemm_mxfp4, gqi_un_mxfp4, 136, GQI_TAB_OFF, GQI_TAB_SG, 0, 0, 0, gq_kvalues_mxfp4)
GQI_DEFINE(gqi_gemm_iq4_xs, gqi_un_iq4_xs, 136, GQI_TAB_OFF, GQI_TAB_SG, 1, 0, 0, gq_kvalues_iq4nl)
GQI_DEFINE(gqi_gemm_iq2_xxs_, gqi_un_iq2_xxs, 66, 0, GQI_SG_MASK, 1, 0, 0, NULL)
GQI_DEFINE(gqi_gemm_iq3_xxs_, gqi_un_iq3_xxs, 98, 0, GQI_SG_MASK, 1, 0, 0, NULL)
GQI_DEFINE(gqi_gemm_iq1_s, gqi_un_iq1_s, 50, 9, GQI_SG_NONE, 1, 0, 0, NULL)
GQI_DEFINE(gqi_gemm_iq1_m, gqi_un_iq1_m, 56, 0, GQI_SG_VAL, 0, 0, 1, NULL)

#if defined(__AVX512VNNI__)
/* IQ2_XXS on avx512vnni: the grid looked up in registers. Each grid word's 8 bytes take 3 values (8,
 * 25, 43 in ggml's table), so a word is 16 bits of 2-bit codes: 256 of them in 8 zmm, looked up 32 at
 * a time by vpermt2w, expanded to bytes by vpshufb (a word's codes to its 8 bytes, then the value of
 * each code). Kept per thread with the grid it was made from; a grid of more values keeps the
 * lookups of gqi_un_iq2_xxs. */
typedef struct {
    uint64_t src[256];
    uint16_t code[256];
    uint8_t lut[16];
    int made, ok;
} gqi_i2_codes;
static __thread gqi_i2_codes gqi_i2;

static const gqi_i2_codes *gqi_i2_get(void) {
    gqi_i2_codes *c = &gqi_i2;
    if (c->made && !memcmp(c->src, gq_iq2xxs_grid, sizeof c->src)) return c;
    memcpy(c->src, gq_iq2xxs_grid, sizeof c->src);
    int nv = 0, val[3] = {0};
    c->ok = 1;
    for (int e = 0; e < 256 && c->ok; e++) {
        uint16_t code = 0;
        for (int j = 0; j < 8; j++) {
            const int v = (int)((c->src[e] >> (8 * j)) & 255);
            int k = 0;
            while (k < nv && val[k] != v) k++;
            if (k == nv) {
                if (nv == 3) { c->ok = 0; break; }
                val[nv++] = v;
            }
            code |= (uint16_t)(k << (2 * j));
        }
        c->code[e] = code;
    }
    /* a code byte's even-position codes come as 0, 1, 2, its odd-position ones as 0, 4, 8 */
    memset(c->lut, 0, sizeof c->lut);
    for (int k = 0; k < nv; k++) c->lut[k] = c->lut[4 * k] = (uint8_t)val[k];
    c->made = 1;
    return c;
}

typedef struct {
    __m512i w[4];        /* chunks 2j, 2j+1 */
    __mmask64 m[4];
    __m256i s;
    __m256 d;
} gqi_i2_grp;

typedef struct {
    __m512i t[8], lut, rep, shv, msk;
} gqi_i2_ctx;

GQI_INLINE void gqi_i2_unpack(const uint8_t *b, gqi_i2_grp *u, const gqi_i2_ctx *cx) {
    const __m512i qv = _mm512_loadu_si512((const void *)(b + 2));
    const __m512i ix = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(
        _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0), qv)));
    const __m256i a1 = _mm512_castsi512_si256(
        _mm512_permutexvar_epi32(_mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 0, 0, 0, 0, 0, 0, 0, 0), qv));
    const __m512i r0 = _mm512_permutex2var_epi16(cx->t[0], ix, cx->t[1]);
    const __m512i r1 = _mm512_permutex2var_epi16(cx->t[2], ix, cx->t[3]);
    const __m512i r2 = _mm512_permutex2var_epi16(cx->t[4], ix, cx->t[5]);
    const __m512i r3 = _mm512_permutex2var_epi16(cx->t[6], ix, cx->t[7]);
    const __mmask32 m6 = _mm512_test_epi16_mask(ix, _mm512_set1_epi16(64));
    const __mmask32 m7 = _mm512_test_epi16_mask(ix, _mm512_set1_epi16(128));
    const __m512i code = _mm512_mask_blend_epi16(m7, _mm512_mask_blend_epi16(m6, r0, r1), _mm512_mask_blend_epi16(m6, r2, r3));
    /* chunks 2j, 2j+1: the 16 code bytes of lane j, byte i of each lane L from code byte 4L + i / 4,
     * shifted by 0 or 4 per word and masked to the even / odd position's 2 bits */
#define GQI_I2_EXPAND(j, imm)                                                                                      u->w[j] = _mm512_shuffle_epi8(                                                                                     cx->lut, _mm512_and_si512(_mm512_srlv_epi16(_mm512_shuffle_epi8(_mm512_shuffle_i32x4(code, code, imm), cx->rep), cx->shv), cx->msk))
    GQI_I2_EXPAND(0, 0x00);
    GQI_I2_EXPAND(1, 0x55);
    GQI_I2_EXPAND(2, 0xaa);
    GQI_I2_EXPAND(3, 0xff);
#undef GQI_I2_EXPAND
    uint64_t sg[4];
    _mm256_storeu_si256((__m256i *)sg, gqi_signs8(a1));
    for (int j = 0; j < 4; j++) u->m[j] = _cvtu64_mask64(sg[j]);
    u->s = gqi_ls(a1);
    u->d = _mm256_set1_ps(gqi_h16(b) * 0.125f);
}

/* the 8 chunk sums of z[0..3] (chunks 2j, 2j+1: the low / high 8 lanes of z[j]), in order */
GQI_INLINE __m256i gqi_sums8z(const __m512i z[4]) {
    const __m512i p = _mm512_add_epi32(_mm512_unpacklo_epi32(z[0], z[1]), _mm512_unpackhi_epi32(z[0], z[1]));
    const __m512i q = _mm512_add_epi32(_mm512_unpacklo_epi32(z[2], z[3]), _mm512_unpackhi_epi32(z[2], z[3]));
    const __m512i r = _mm512_add_epi32(_mm512_unpacklo_epi64(p, q), _mm512_unpackhi_epi64(p, q));
    const __m256i lo = _mm512_castsi512_si256(r), hi = _mm512_extracti64x4_epi64(r, 1);
    const __m256i s = _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
    return _mm256_permutevar8x32_epi32(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

GQI_INLINE __m256 gqi_i2_prod(const gqi_i2_grp *u, const int8_t *xq, const float *xd) {
    __m512i z[4];
    for (int j = 0; j < 4; j++) {
        const __m512i x = _mm512_loadu_si512((const void *)(xq + 64 * j));
        z[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u->w[j], _mm512_mask_sub_epi8(x, u->m[j], _mm512_setzero_si512(), x));
    }
    const __m256i isum = _mm256_mullo_epi32(gqi_sums8z(z), u->s);
    return _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(u->d, _mm256_loadu_ps(xd)));
}

GQI_INLINE void gqi_gemm_iq2_xxs_zn(const cpumla_weight *w, const void *qx, const int64_t n, float *y, int64_t ldy,
                                    int64_t r0, int64_t r1, const gqi_i2_codes *cd) {
    gqi_i2_ctx cx;
    for (int i = 0; i < 8; i++) cx.t[i] = _mm512_loadu_si512((const void *)(cd->code + 32 * i));
    cx.lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)cd->lut));
    cx.rep = _mm512_set_epi64(0x0f0f0f0f0e0e0e0e, 0x0d0d0d0d0c0c0c0c, 0x0b0b0b0b0a0a0a0a, 0x0909090908080808,
                              0x0707070706060606, 0x0505050504040404, 0x0303030302020202, 0x0101010100000000);
    cx.shv = _mm512_set1_epi32(0x00040000);
    cx.msk = _mm512_set1_epi16(0x0c03);
    const int64_t K = w->cols, per = QX_BYTES(K), ng = K / 256;
    for (int64_t r = r0; r < r1; r += GQI_NR) {
        const int nr = r1 - r < GQI_NR ? (int)(r1 - r) : GQI_NR;
        const uint8_t *rp[GQI_NR];
        for (int i = 0; i < GQI_NR; i++) rp[i] = (const uint8_t *)w->data + (r + (i < nr ? i : nr - 1)) * w->row_bytes;
        __m128 acc = _mm_setzero_ps();
        for (int64_t g = 0; g < ng; g++) {
            gqi_i2_grp u[GQI_NR];
            for (int i = 0; i < GQI_NR; i++) {
                gqi_i2_unpack(rp[i] + g * 66, &u[i], &cx);
                __builtin_prefetch(rp[i] + (g + 16) * 66, 0, 3);
                __builtin_prefetch(rp[i] + (g + 16) * 66 + 64, 0, 3);
            }
            for (int64_t t = 0; t < n; t++) {
                const uint8_t *xt = (const uint8_t *)qx + t * per;
                __m256 pv[GQI_NR];
                for (int i = 0; i < GQI_NR; i++) pv[i] = gqi_i2_prod(&u[i], (const int8_t *)xt + 256 * g, qx_d(xt, K) + 8 * g);
                if (n == 1) acc = gqi_add4(acc, pv, 8);
                else {
                    float *yt = y + t * ldy + (r - r0);
                    gqi_store4(yt, gqi_add4(g == 0 ? _mm_setzero_ps() : gqi_load4(yt, nr), pv, 8), nr);
                }
            }
        }
        if (n == 1) gqi_store4(y + (r - r0), acc, nr);
    }
}
static void gqi_gemm_iq2_xxs_z(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,
                               int64_t r1, const gqi_i2_codes *cd) {
    if (n == 1) gqi_gemm_iq2_xxs_zn(w, qx, 1, y, ldy, r0, r1, cd);
    else gqi_gemm_iq2_xxs_zn(w, qx, n, y, ldy, r0, r1, cd);
}
#endif

/* the level's previous entries, for a sign table other than ggml's (gqi_ksigns_ok) */
static gqi_gemm_fn gqi_prev[GQ_N];
static void gqi_gemm_iq2_xxs(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,
                             int64_t r1) {
    if (!gqi_ksigns_ok()) { gqi_prev[CPUMLA_IQ2_XXS - CPUMLA_Q8_0](w, qx, n, y, ldy, r0, r1); return; }
#if defined(__AVX512VNNI__)
    const gqi_i2_codes *cd = gqi_i2_get();
    if (cd->ok) { gqi_gemm_iq2_xxs_z(w, qx, n, y, ldy, r0, r1, cd); return; }
#endif
    gqi_gemm_iq2_xxs_(w, qx, n, y, ldy, r0, r1);
}
static void gqi_gemm_iq3_xxs(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,
                             int64_t r1) {
    if (gqi_ksigns_ok()) gqi_gemm_iq3_xxs_(w, qx, n, y, ldy, r0, r1);
    else gqi_prev[CPUMLA_IQ3_XXS - CPUMLA_Q8_0](w, qx, n, y, ldy, r0, r1);
}

static void gqi_fill(cpumla_kernels *k, const char *level) {
    static const struct { int32_t dtype; gqi_gemm_fn f; } own[] = {
        {CPUMLA_Q4_0, gqi_gemm_q4_0},       {CPUMLA_Q4_1, gqi_gemm_q4_1},     {CPUMLA_Q5_0, gqi_gemm_q5_0},
        {CPUMLA_Q5_1, gqi_gemm_q5_1},       {CPUMLA_IQ4_NL, gqi_gemm_iq4_nl}, {CPUMLA_MXFP4, gqi_gemm_mxfp4},
        {CPUMLA_IQ4_XS, gqi_gemm_iq4_xs},   {CPUMLA_IQ2_XXS, gqi_gemm_iq2_xxs}, {CPUMLA_IQ3_XXS, gqi_gemm_iq3_xxs},
        {CPUMLA_IQ1_S, gqi_gemm_iq1_s},     {CPUMLA_IQ1_M, gqi_gemm_iq1_m},
    };
    for (size_t j = 0; j < sizeof own / sizeof own[0]; j++) {
        const int t = own[j].dtype - CPUMLA_Q8_0;
        if (k->gemm_gq[t] != own[j].f) gqi_prev[t] = k->gemm_gq[t];
        k->gemm_gq[t] = own[j].f;
        k->who_fmt[K_GEMV][own[j].dtype] = k->who_fmt[K_GEMM][own[j].dtype] = level;
    }
}
