/* gqi_x86.h: the x86 levels' own GGUF products for the 32-column types, the IQ types and MXFP4
 * (gguf_q.h), compiled once per level by avx2_gqi.c and avx512vnni_gqi.c; the level's flags pick the
 * int8 product (vpdpbusd, or vpmaddubsw + vpmaddwd) and the way signs are applied.
 *
 * Each row is taken 256 columns (8 chunks) at a time: a group's blocks are unpacked straight into
 * registers (gqi_unpack_x86.h) and, where the codes' signs are not in the operand bytes, a sign mask or
 * signed copy applied to the activation codes. Chunk sums are exact int32: sum(w x) - off * sum(x)
 * (the code sums of gq_quant_x's layout), times the chunk's integer scale; then the spec's fp32 products, 8 chunks at once, added to
 * the row's sum one by one in column order. Four rows are taken at once, their sums the 4 lanes of one
 * vector (each lane's adds in column order); a group is unpacked once and used for every token.
 * IQ2_XXS on avx512vnni looks its grid up in registers (gqi_gemm_iq2_xxs_z). */
#include "kernels/x86/gqi_unpack_x86.h"

typedef void (*gqi_gemm_fn)(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,
                            int64_t r1);

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

/* ---- the gemm: rows r0 .. r1 by n tokens, four rows at a time ------------------------------------ */
#define GQI_NR 4
#ifndef GQI_PF_BYTES
#define GQI_PF_BYTES 8192
#endif
/* How far ahead each step prefetches: the 4 rows of a tile are 4 streams the hardware prefetcher alone
 * keeps too short of memory (gq8_rows4 says so for Q8_0), so each group is prefetched for the rows a whole
 * number of tiles ahead, at least GQI_PF_BYTES of rows: with one tile ahead, rows of 1-1.4 KB (MXFP4,
 * Q4_0, Q5_0 over 2048 columns) streamed at 39-55% of the read probe on an AMD EPYC Zen 3, Q8_0's 2.2 KB
 * rows at 73%. */
static inline int64_t gqi_pf_rows(int64_t row_bytes) {
    const int64_t tile = GQI_NR * row_bytes;
    return GQI_NR * (tile >= GQI_PF_BYTES ? 1 : (GQI_PF_BYTES + tile - 1) / tile);
}

/* group g (nc chunks) of the four rows: unpacked once, then each token's products added in order */
#define GQI_GROUP(UNPACK, OFF, SG, HAS_S, HAS_MIN, HALVES, nc)                                                \
    do {                                                                                                       \
        gqi_grp u[GQI_NR];                                                                                     \
        for (int i = 0; i < GQI_NR; i++) {                                                                     \
            UNPACK(rp[i], g, nc, &u[i], &cx);                                                                  \
            if (r + pfr + i < w->rows)     /* the group g of the rows pfr ahead into L2 (gqi_pf_rows) */      \
                for (int64_t o = 0; o < gbytes; o += 64)                                                       \
                    __builtin_prefetch(rp[i] + pfr * w->row_bytes + g * gbytes + o, 0, 2);                      \
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
        const int64_t pfr = gqi_pf_rows(w->row_bytes);                                                         \
        TAB;                                                                                                   \
        const int64_t K = w->cols, per = QX_BYTES(K), nch = K / 32, nfull = nch / 8, gbytes = GBYTES;          \
        const int ntail = (int)(nch % 8);                                                                      \
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

/* the types: unpacker, group bytes, off, signs, integer scales, mins, per-16 scales, nibble table set-up */
#define GQI_NO_TAB (void)cx
GQI_DEFINE(gqi_gemm_q4_0, gqi_un_q4_0, 144, 8, GQI_SG_NONE, 0, 0, 0, GQI_NO_TAB)
GQI_DEFINE(gqi_gemm_q4_1, gqi_un_q4_1, 160, 0, GQI_SG_NONE, 0, 1, 0, GQI_NO_TAB)
GQI_DEFINE(gqi_gemm_q5_0, gqi_un_q5_0, 176, 16, GQI_SG_NONE, 0, 0, 0, GQI_NO_TAB)
GQI_DEFINE(gqi_gemm_q5_1, gqi_un_q5_1, 192, 0, GQI_SG_NONE, 0, 1, 0, GQI_NO_TAB)
GQI_DEFINE(gqi_gemm_iq4_nl, gqi_un_iq4_nl, 144, GQI_TAB_OFF, GQI_TAB_SG, 0, 0, 0, gqi_ctx_tab(&cx, gq_kvalues_iq4nl))
#if defined(__AVX512VNNI__)
GQI_DEFINE(gqi_gemm_mxfp4, gqi_un_mxfp4, 136, GQI_TAB_OFF, GQI_TAB_SG, 0, 0, 0, gqi_ctx_tab(&cx, gq_kvalues_mxfp4))
#else
GQI_DEFINE(gqi_gemm_mxfp4_s, gqi_un_mxfp4, 136, GQI_TAB_OFF, GQI_TAB_SG, 0, 0, 0, gqi_ctx_tab(&cx, gq_kvalues_mxfp4))
GQI_DEFINE(gqi_gemm_mxfp4_u, gqi_un_mxfp4_u, 136, gq_mxfp4_max, GQI_SG_NONE, 0, 0, 0,
           gqi_ctx_off(&cx, gq_kvalues_mxfp4, gq_mxfp4_max))
static void gqi_gemm_mxfp4(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,
                           int64_t r1) {
    if (gq_mxfp4_max <= GQI_MX_MAX) gqi_gemm_mxfp4_u(w, qx, n, y, ldy, r0, r1);
    else gqi_gemm_mxfp4_s(w, qx, n, y, ldy, r0, r1);
}
#endif
GQI_DEFINE(gqi_gemm_iq4_xs, gqi_un_iq4_xs, 136, GQI_TAB_OFF, GQI_TAB_SG, 1, 0, 0, gqi_ctx_tab(&cx, gq_kvalues_iq4nl))
GQI_DEFINE(gqi_gemm_iq2_xxs_, gqi_un_iq2_xxs, 66, 0, GQI_SG_MASK, 1, 0, 0, GQI_NO_TAB)
GQI_DEFINE(gqi_gemm_iq3_xxs_, gqi_un_iq3_xxs, 98, 0, GQI_SG_MASK, 1, 0, 0, GQI_NO_TAB)
GQI_DEFINE(gqi_gemm_iq1_s, gqi_un_iq1_s, 50, 9, GQI_SG_NONE, 1, 0, 0, GQI_NO_TAB)
GQI_DEFINE(gqi_gemm_iq1_m, gqi_un_iq1_m, 56, 0, GQI_SG_VAL, 0, 0, 1, GQI_NO_TAB)

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
