/* avx512vnni_gqp.c: the avx512vnni level's gemm_gq from a number of tokens (GQP_MIN), every GGUF type:
 * the panels of gq_panel_x86.h (16 weight rows unpacked once, the tokens' codes gathered once per call in
 * groups of 16) with vpdpbusd in place of amx_gq.c's tiles. Fewer tokens go to the per-type entries
 * (avx512vnni_gq.c, avx512vnni_gqk.c, avx512vnni_gqi.c), which stay the gemv. avx512 and amx keep it
 * (amx below its own tile threshold).
 *
 * Per (row, chunk), the 16 tokens' sums in one zmm, a token a dword: the panel's codes are stored flipped
 * (u = q + 128, unsigned), each dword of 4 broadcast against the tokens' dwords of the same 4 columns,
 * 8 vpdpbusd a chunk (4 a half), starting from -128 times the tokens' code sums (gqp_pack_x's xc); so
 * sum u x - 128 sum x = sum q x, exact (|sum u x| <= 32 * 255 * 127). gqp_take then adds the chunk's
 * product to each (row, token) in column order, as amx_gq.c does: every result is the scalar spec's,
 * bit for bit. This file is compiled without contraction. */
#include <immintrin.h>
#include <string.h>
#include "core/common.h"
#include "core/gguf_q.h"
#include "core/kernels.h"
#include "core/quant.h"
#include "kernels/x86/gqi_unpack_x86.h"
#include "kernels/x86/gqk_unpack_x86.h"
#include "kernels/x86/gq_panel_x86.h"

/* From how many tokens the panels beat the per-type entries: benchmarks/gguf_gemv.py --tokens 8 12 16 24
 * --cols 2048 against the commit before them, AMD EPYC Zen 4, 2 threads: at 12 tokens Q5_0 and MXFP4 are
 * still slower on panels, from 16 every type is faster (Q8_0 2.1x, Q4_K 1.4x, Q6_K 1.7x, MXFP4 1.1x),
 * and at 128 tokens 2.5-5.8x (docs/gguf.md). */
#define GQP_MIN 16

typedef void (*gq_gemm_fn)(const cpumla_weight *, const void *, int64_t, float *, int64_t, int64_t, int64_t);
static gq_gemm_fn prev_gqp[GQ_N];

/* one group of 16 tokens against the panel, chunks in column order into acc (row i: acc[i], a lane per
 * token); bg: the group's operands, xc their start values (gqp_pack_x) */
static inline __attribute__((always_inline)) void gqp_group(const uint8_t *codes, int64_t K, const gqp_chunk *ch,
                                                            const int32_t *bg, const int32_t *xc, const float *xd,
                                                            const float *x0, const float *x1, int flags,
                                                            int has_min, __m512 acc[16]) {
    const int64_t nc = K / 32;
    int32_t cb[2][256] __attribute__((aligned(64)));
    for (int64_t c = 0; c < nc; c++) {
        __m512i xv[8];
        for (int kk = 0; kk < 8; kk++) xv[kk] = _mm512_load_si512(bg + c * 128 + 16 * kk);
        const __m512i h0 = _mm512_load_si512(xc + c * 32), h1 = _mm512_load_si512(xc + c * 32 + 16);
        const uint8_t *cc = codes + 32 * c;
        if (flags & GQP_HALVES) {
            for (int i = 0; i < 16; i++) {
                const uint8_t *q = cc + i * K;
                __m512i a0 = h0, a1 = h1;
                for (int kk = 0; kk < 4; kk++) {
                    int32_t u0, u1;
                    memcpy(&u0, q + 4 * kk, 4);
                    memcpy(&u1, q + 16 + 4 * kk, 4);
                    a0 = _mm512_dpbusd_epi32(a0, _mm512_set1_epi32(u0), xv[kk]);
                    a1 = _mm512_dpbusd_epi32(a1, _mm512_set1_epi32(u1), xv[4 + kk]);
                }
                _mm512_store_si512(cb[0] + 16 * i, a0);
                _mm512_store_si512(cb[1] + 16 * i, a1);
            }
        } else {
            const __m512i h = _mm512_add_epi32(h0, h1);
            for (int i = 0; i < 16; i++) {
                const uint8_t *q = cc + i * K;
                __m512i a = h;
                for (int kk = 0; kk < 8; kk++) {
                    int32_t u;
                    memcpy(&u, q + 4 * kk, 4);
                    a = _mm512_dpbusd_epi32(a, _mm512_set1_epi32(u), xv[kk]);
                }
                _mm512_store_si512(cb[0] + 16 * i, a);
            }
        }
        gqp_take(cb[0], cb[1], &ch[c], xd + 16 * c, x0 + 16 * c, x1 + 16 * c, flags, has_min, acc);
    }
}

static void gemm_gqp_avx512vnni(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,
                                int64_t r1) {
    const int t = w->dtype - CPUMLA_Q8_0;
    if (n < GQP_MIN) { prev_gqp[t](w, qx, n, y, ldy, r0, r1); return; }
    const int has_min = gq_types[t].has_min;
    const int64_t K = w->cols, nc = K / 32, ng = (n + 15) / 16;
    uint8_t *xs = cpumla_scratch(CPUMLA_SCRATCH_GQP_QX, (size_t)(ng * nc * (512 + 5 * 64)));
    uint8_t *ps = cpumla_scratch(CPUMLA_SCRATCH_GQP_PANEL, (size_t)(16 * K) + sizeof(gqp_chunk) * (size_t)nc + 64);
    if (!xs || !ps) return;
    int32_t *bq = (int32_t *)xs;
    float *x0 = (float *)(xs + ng * nc * 512), *x1 = x0 + ng * nc * 16, *xdb = x1 + ng * nc * 16;
    int32_t *xc = (int32_t *)(xdb + ng * nc * 16);
    gqp_chunk *ch = (gqp_chunk *)ps;
    uint8_t *codes = ps + sizeof(gqp_chunk) * (size_t)nc;
    gqp_pack_x(qx, n, K, bq, xdb, has_min ? x0 : NULL, x1, xc);

    float fb[256] __attribute__((aligned(64)));
    for (int64_t p0 = r0; p0 < r1; p0 += 16) {
        const int64_t mp = r1 - p0 < 16 ? r1 - p0 : 16;
        const int flags = gqp_unpack(w, p0, mp, (int8_t *)codes, ch, 128, NULL);
        for (int64_t g = 0; g < ng; g++) {
            __m512 acc[16];
            for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
            const int32_t *bg = bq + g * nc * 128, *xcg = xc + g * nc * 32;
            const float *xg = xdb + g * nc * 16, *x0g = x0 + g * nc * 16, *x1g = x1 + g * nc * 16;
            /* each flag set its own loop (the flags are constants in each call) */
            if (has_min) {
                if (flags & GQP_HALVES) gqp_group(codes, K, ch, bg, xcg, xg, x0g, x1g, GQP_HALVES, 1, acc);
                else gqp_group(codes, K, ch, bg, xcg, xg, x0g, x1g, 0, 1, acc);
            } else if (flags & GQP_HALVES) gqp_group(codes, K, ch, bg, xcg, xg, x0g, x1g, GQP_HALVES, 0, acc);
            else if (flags & GQP_UNIT) gqp_group(codes, K, ch, bg, xcg, xg, x0g, x1g, GQP_UNIT, 0, acc);
            else gqp_group(codes, K, ch, bg, xcg, xg, x0g, x1g, 0, 0, acc);
            /* acc[i]: row p0 + i, a lane per token -> y */
            for (int i = 0; i < 16; i++) _mm512_store_ps(fb + 16 * i, acc[i]);
            amx_store_block(fb, y + 16 * g * ldy + (p0 - r0), ldy, n - 16 * g < 16 ? n - 16 * g : 16, mp);
        }
    }
}

/* the level's gemm_gq of every type (its owner stays "avx512vnni", the level's name) */
void cpumla_fill_avx512vnni_gqp(cpumla_kernels *k) {
    for (int t = 0; t < GQ_N; t++) {
        if (k->gemm_gq[t] != gemm_gqp_avx512vnni) prev_gqp[t] = k->gemm_gq[t];
        k->gemm_gq[t] = gemm_gqp_avx512vnni;
    }
}
