/* gq_panel_unpack_x86.h: GGUF weights (gguf_q.h) as panels of 16 rows, unpacked once for the gemms over
 * groups of tokens (amx_gq.c, avx512vnni_gqp.c through gq_panel_x86.h; avx2_gqp.c): the K types by
 * gqk_unpack's SIMD, the others by gqi_unpack's, Q8_0 as stored, into int8 codes in column order,
 * [16][K], each stored as q + bias (a byte: 128 makes the operand vpdpbusd multiplies unsigned, 0 keeps q
 * for the tiles, avx2_gqp.c's per-type bias makes vpmaddubsw's), and each chunk's s, m, d, dm: as fp32
 * vectors over the 16 rows (gqp_chunk), or row by row as int16 pairs (gqp_rows, avx2_gqp.c's). AVX2
 * only: every level that has panels includes it. Include after gqk_unpack_x86.h and gqi_unpack_x86.h. */
#ifndef CPUMLA_GQ_PANEL_UNPACK_X86_H
#define CPUMLA_GQ_PANEL_UNPACK_X86_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include "core/gguf_q.h"

/* per chunk of the panel: the 16 rows' scales, mins and factors as fp32 (lane i: row i; the integer
 * scales and mins are small, so exact) */
typedef struct {
    float s0[16], s1[16], m0[16], m1[16];
    float d[16], dm[16];
} gqp_chunk;

/* what a panel's chunks need: halves (a chunk's halves differ in scale or min: two sums a chunk) and
 * unit (every scale is 1: the sum itself is the product's integer) */
enum { GQP_HALVES = 1, GQP_UNIT = 2 };

/* the same factors as avx2_gqp.c's products read them, a panel's rows one after another: row i's chunk c
 * at [i * ld + c] (ld >= nc + 8: 8 chunks' vectors are stored whole, past a row's last chunk too), int16
 * pairs (low | high << 16) and fp32 */
typedef struct {
    int64_t ld;
    int32_t *s0, *s1;            /* s_h | s_h << 16, half h's scale in both */
    int32_t *sb;                 /* b s0 | b s1 << 16, b the codes' bias */
    int32_t *m;                  /* m0 | m1 << 16 */
    float *d, *dm;
    int32_t bias;
} gqp_rows;

static inline __m256i gqp_pair(__m256i lo, __m256i hi) {
    return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(hi, 16));
}
/* row i's chunks c .. c + 7 from their halves' scales h0 / h1, mins m0 / m1 (int32 lanes) and factors */
static inline void gqp_rows_put8(const gqp_rows *r, int64_t i, int64_t c, __m256i h0, __m256i h1, __m256i m0,
                                 __m256i m1, __m256 d, __m256 dm) {
    const int64_t o = i * r->ld + c;
    const __m256i b = _mm256_set1_epi32(r->bias);
    _mm256_storeu_si256((__m256i *)(r->s0 + o), gqp_pair(h0, h0));
    _mm256_storeu_si256((__m256i *)(r->s1 + o), gqp_pair(h1, h1));
    _mm256_storeu_si256((__m256i *)(r->sb + o), gqp_pair(_mm256_mullo_epi32(h0, b), _mm256_mullo_epi32(h1, b)));
    _mm256_storeu_si256((__m256i *)(r->m + o), gqp_pair(m0, m1));
    _mm256_storeu_ps(r->d + o, d);
    _mm256_storeu_ps(r->dm + o, dm);
}
/* row i's chunk c, one at a time */
static inline void gqp_rows_put1(const gqp_rows *r, int64_t i, int64_t c, int32_t s0, int32_t s1, int32_t m0,
                                 int32_t m1, float d, float dm) {
    const int64_t o = i * r->ld + c;
    r->s0[o] = (int32_t)((uint32_t)(s0 & 0xffff) | (uint32_t)s0 << 16);
    r->s1[o] = (int32_t)((uint32_t)(s1 & 0xffff) | (uint32_t)s1 << 16);
    r->sb[o] = (int32_t)((uint32_t)((r->bias * s0) & 0xffff) | (uint32_t)(r->bias * s1) << 16);
    r->m[o] = (int32_t)((uint32_t)(m0 & 0xffff) | (uint32_t)m1 << 16);
    r->d[o] = d;
    r->dm[o] = dm;
}

/* row i of a panel past the weight's rows: codes that stand for 0 (the bias), and into rw (if any) no
 * scales or factors (ch: gqp_unpack's zeros) */
static inline void gqp_blank_row(int8_t *o, int64_t K, int bias, const gqp_rows *rw, int64_t i) {
    memset(o, bias & 0xff, (size_t)K);
    if (rw)
        for (int64_t c = 0; c < K / 32; c++) gqp_rows_put1(rw, i, c, 0, 0, 0, 0, 0.0f, 0.0f);
}

/* row i of a K-type panel (Q2_K .. Q6_K) by gqk_unpack (SIMD; the spec's values): codes q = u - off, and
 * each chunk's scales and mins from the gqk_u lanes (per-16 types: gqk_halves order) */
static void gqp_k_row(int T, const uint8_t *row, int64_t K, int64_t i, int8_t *o, gqp_chunk *ch, int bias,
                      const gqp_rows *rw) {
    const int off = T == GQK_Q6 ? 32 : T == GQK_Q3 ? 4 : 0, per16 = T != GQK_Q4 && T != GQK_Q5;
    const int64_t bytes = gq_types[CPUMLA_Q2_K + T - CPUMLA_Q8_0].bytes;
    const __m256i vb = _mm256_set1_epi8((char)(bias - off));   /* stored: q + bias, q = u - off */
    /* gq_types' has_min, written from T so that the compiler specializes the row loop on it (read from
     * gq_types at run time, Q6_K / Q3_K panels of 16 tokens measured 10% slower) */
    const int has_min = T != GQK_Q3 && T != GQK_Q6;
    gqk_u u;
    float s0[8], s1[8], m0[8], m1[8];
    for (int64_t j = 0; j < K / 256; j++) {
        gqk_unpack(T, row + j * bytes, &u);
        for (int c = 0; c < 8; c++)
            _mm256_storeu_si256((__m256i *)(o + 256 * j + 32 * c), _mm256_add_epi8(u.q[c], vb));
        if (rw) {               /* per 16: s0 / s1 hold chunks 0-3 / 4-7, half 0 in their low lanes */
            const __m256i z = _mm256_setzero_si256();
            const __m256i h0 = per16 ? _mm256_permute2x128_si256(u.s0, u.s1, 0x20) : u.s0;
            const __m256i h1 = per16 ? _mm256_permute2x128_si256(u.s0, u.s1, 0x31) : u.s0;
            const __m256i m0 = !has_min ? z : per16 ? _mm256_permute2x128_si256(u.m0, u.m1, 0x20) : u.m0;
            const __m256i m1 = !has_min ? z : per16 ? _mm256_permute2x128_si256(u.m0, u.m1, 0x31) : u.m0;
            gqp_rows_put8(rw, i, 8 * j, h0, h1, m0, m1, _mm256_set1_ps(u.d), _mm256_set1_ps(has_min ? u.dm : 0.0f));
            continue;
        }
        /* the integer scales and mins are small: exact as fp32. Only what gqp_take reads is stored (s1 and
         * m1 where the halves differ, m and dm where the type has mins); the rest keeps gqp_unpack's zeros */
        _mm256_storeu_ps(s0, _mm256_cvtepi32_ps(u.s0));
        if (has_min) _mm256_storeu_ps(m0, _mm256_cvtepi32_ps(u.m0));
        if (per16) {
            _mm256_storeu_ps(s1, _mm256_cvtepi32_ps(u.s1));
            if (has_min) _mm256_storeu_ps(m1, _mm256_cvtepi32_ps(u.m1));
        }
        for (int c = 0; c < 8; c++) {
            gqp_chunk *k = &ch[8 * j + c];
            if (per16) {            /* s0: half 0 of chunks 0-3 | half 1 of 0-3; s1: the same for 4-7 */
                const float *a = c < 4 ? s0 : s1, *b = c < 4 ? m0 : m1;
                k->s0[i] = a[c % 4];
                k->s1[i] = a[4 + c % 4];
                if (has_min) {
                    k->m0[i] = b[c % 4];
                    k->m1[i] = b[4 + c % 4];
                }
            } else {
                k->s0[i] = s0[c];
                if (has_min) k->m0[i] = m0[c];
            }
            k->d[i] = u.d;
            if (has_min) k->dm[i] = u.dm;
        }
    }
}

/* row i of a panel of the other types by gqi_unpack's SIMD (the spec's values), 256 columns at a time:
 * each chunk's codes from its operand bytes (less the offset, or given their signs) and its scales,
 * mins and factors; Q8_0's codes and scales as stored. Returns the panel's flags (GQP_HALVES where the
 * type scales per 16, GQP_UNIT where it has no scales), or -1 where gqi's unpackers do not apply (a sign
 * table other than ggml's: gqi_ksigns_ok), for gq_unpack to serve instead. */
static int gqp_i_row(int32_t dtype, const uint8_t *row, int64_t K, int64_t i, int8_t *o, gqp_chunk *ch, int bias,
                     const gqp_rows *rw) {
    const int64_t nch = K / 32;
    const __m256i fl = _mm256_set1_epi8((char)bias);
    if (dtype == CPUMLA_Q8_0) {
        for (int64_t c = 0; c < nch; c++) {
            const uint8_t *b = row + c * GQ8_0_BYTES;
            _mm256_storeu_si256((__m256i *)(o + 32 * c), _mm256_add_epi8(_mm256_loadu_si256((const __m256i *)(b + 2)), fl));
            if (rw) {
                gqp_rows_put1(rw, i, c, 1, 1, 0, 0, gqi_h16(b), 0.0f);
                continue;
            }
            gqp_chunk *k = &ch[c];
            k->s0[i] = k->s1[i] = 1.0f;
            k->d[i] = gqi_h16(b);
        }
        return GQP_UNIT;
    }
    if ((dtype == CPUMLA_IQ2_XXS || dtype == CPUMLA_IQ3_XXS) && !gqi_ksigns_ok()) return -1;
    gqi_ctx cx = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    if (dtype == CPUMLA_IQ4_NL || dtype == CPUMLA_IQ4_XS) gqi_ctx_tab(&cx, gq_kvalues_iq4nl);
    if (dtype == CPUMLA_MXFP4) gqi_ctx_tab(&cx, gq_kvalues_mxfp4);
    /* gqi_x86.h's table of the types: offset, signs, scales, mins, per-16 scales (u.s stays 1 where a type
     * has none) */
    int off = 0, sg = GQI_SG_NONE, has_s = 0, has_min = 0, halves = 0;
    for (int64_t g = 0; g * 8 < nch; g++) {
        const int nc = nch - 8 * g < 8 ? (int)(nch - 8 * g) : 8;
        gqi_grp u;
        u.s = u.s1 = _mm256_set1_epi32(1);     /* what the types without them read */
        u.dm = _mm256_setzero_ps();
        switch (dtype) {
        case CPUMLA_Q4_0: gqi_un_q4_0(row, g, nc, &u, &cx); off = 8; break;
        case CPUMLA_Q4_1: gqi_un_q4_1(row, g, nc, &u, &cx); has_min = 1; break;
        case CPUMLA_Q5_0: gqi_un_q5_0(row, g, nc, &u, &cx); off = 16; break;
        case CPUMLA_Q5_1: gqi_un_q5_1(row, g, nc, &u, &cx); has_min = 1; break;
        case CPUMLA_IQ4_NL: gqi_un_iq4_nl(row, g, nc, &u, &cx); off = GQI_TAB_OFF; sg = GQI_TAB_SG; break;
        case CPUMLA_MXFP4: gqi_un_mxfp4(row, g, nc, &u, &cx); off = GQI_TAB_OFF; sg = GQI_TAB_SG; break;
        case CPUMLA_IQ4_XS: gqi_un_iq4_xs(row, g, nc, &u, &cx); off = GQI_TAB_OFF; sg = GQI_TAB_SG; has_s = 1; break;
        case CPUMLA_IQ2_XXS: gqi_un_iq2_xxs(row, g, nc, &u, &cx); sg = GQI_SG_MASK; has_s = 1; break;
        case CPUMLA_IQ3_XXS: gqi_un_iq3_xxs(row, g, nc, &u, &cx); sg = GQI_SG_MASK; has_s = 1; break;
        case CPUMLA_IQ1_S: gqi_un_iq1_s(row, g, nc, &u, &cx); off = 9; has_s = 1; break;
        case CPUMLA_IQ1_M: gqi_un_iq1_m(row, g, nc, &u, &cx); sg = GQI_SG_VAL; halves = 1; break;
        default: return -1;
        }
        for (int c = 0; c < nc; c++) {
            __m256i q = u.w[c];
            if (sg == GQI_SG_MASK) q = gqi_neg(q, u.m[c]);
            else if (sg == GQI_SG_VAL) q = u.v[c];
            else q = _mm256_sub_epi8(q, _mm256_set1_epi8((char)off));
            _mm256_storeu_si256((__m256i *)(o + 256 * g + 32 * c), _mm256_add_epi8(q, fl));
        }
        if (rw) {
            const __m256i mm = _mm256_set1_epi32(has_min);
            gqp_rows_put8(rw, i, 8 * g, u.s, halves ? u.s1 : u.s, mm, mm, u.d, has_min ? u.dm : _mm256_setzero_ps());
            continue;
        }
        int32_t s0[8], s1[8];
        float d[8], dm[8];
        _mm256_storeu_si256((__m256i *)s0, u.s);
        _mm256_storeu_si256((__m256i *)s1, halves ? u.s1 : u.s);
        _mm256_storeu_ps(d, u.d);
        _mm256_storeu_ps(dm, u.dm);
        for (int c = 0; c < nc; c++) {
            gqp_chunk *k = &ch[8 * g + c];
            k->s0[i] = (float)s0[c];
            k->s1[i] = (float)s1[c];
            k->d[i] = d[c];
            if (has_min) {      /* else the zeros gqp_unpack left */
                k->m0[i] = k->m1[i] = 1.0f;
                k->dm[i] = dm[c];
            }
        }
    }
    return (halves ? GQP_HALVES : 0) | (!has_s && !halves ? GQP_UNIT : 0);
}

/* rows [p0, p0 + mp) (missing rows zero) unpacked: codes [16][K], chunks [K / 32]; returns the panel's
 * GQP_HALVES / GQP_UNIT flags */
/* rw NULL: the factors into ch (chunk-major fp32); else into rw (row-major pairs), ch unused */
static int gqp_unpack(const cpumla_weight *w, int64_t p0, int64_t mp, int8_t *codes, gqp_chunk *ch, int bias,
                      const gqp_rows *rw) {
    const int64_t K = w->cols, nc = K / 32;
    gq_unpacked u;
    if (!rw) memset(ch, 0, sizeof *ch * (size_t)nc);
    const int32_t t = w->dtype;
    const int T = t >= CPUMLA_Q2_K && t <= CPUMLA_Q6_K ? t - CPUMLA_Q2_K : -1;
    /* the flags by type where the SIMD unpackers serve it (the K types: halves where they scale per 16;
     * gqp_i_row says the others'), else from the chunks' own scales. Where every chunk of a type happens
     * to qualify for the other path too, both paths' results are the same. */
    int flags = T >= 0 ? (T == GQK_Q4 || T == GQK_Q5 ? 0 : GQP_HALVES) : -1, same = 1, unit = 1;
    for (int64_t i = 0; i < 16; i++) {
        int8_t *o = codes + i * K;
        if (i >= mp) {
            gqp_blank_row(o, K, bias, rw, i);
            continue;
        }
        const uint8_t *row = (const uint8_t *)w->data + (p0 + i) * w->row_bytes;
        if (T >= 0) {
            gqp_k_row(T, row, K, i, o, ch, bias, rw);
            continue;
        }
        const int f = gqp_i_row(t, row, K, i, o, ch, bias, rw);
        if (f >= 0) {
            flags = f;
            continue;
        }
        for (int64_t c0 = 0; c0 < K; c0 += 256) {
            const int n = K - c0 >= 256 ? 8 : (int)((K - c0) / 32);
            gq_unpack(t, row, c0, n, &u);
            for (int j = 0; j < 32 * n; j++) o[c0 + j] = (int8_t)(uint8_t)(u.q[j] + bias);
            for (int c = 0; c < n; c++) {
                same &= u.s[2 * c] == u.s[2 * c + 1] && u.m[2 * c] == u.m[2 * c + 1];
                unit &= u.s[2 * c] == 1 && u.s[2 * c + 1] == 1;
                if (rw) {
                    gqp_rows_put1(rw, i, c0 / 32 + c, u.s[2 * c], u.s[2 * c + 1], u.m[2 * c], u.m[2 * c + 1], u.d[c], u.dm[c]);
                    continue;
                }
                gqp_chunk *k = &ch[c0 / 32 + c];
                k->s0[i] = (float)u.s[2 * c];
                k->s1[i] = (float)u.s[2 * c + 1];
                k->m0[i] = (float)u.m[2 * c];
                k->m1[i] = (float)u.m[2 * c + 1];
                k->d[i] = u.d[c];
                k->dm[i] = u.dm[c];
            }
        }
    }
    return flags >= 0 ? flags : (same ? 0 : GQP_HALVES) | (unit ? GQP_UNIT : 0);
}

#endif
