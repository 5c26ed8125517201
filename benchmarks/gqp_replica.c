/* gqp_replica.c: a stand-alone copy of the GGUF panels' inner loop (avx512vnni_gqp.c's gqp_group) on
 * synthetic data, to see what bounds it apart from the rest of the kernel: 16 weight rows by 64 chunks
 * of 32 columns against one group of 16 tokens, cycles per row's chunk (the clock measured by a chain
 * of adds). Timing only: the values are random and the results are not checked.
 *
 *   dot      the vpdpbusd loop alone (sums stored, then added to the accumulators)
 *   q4k6     plus Q4_K's chunk product as the spec computes it (6 multiplies a row's chunk)
 *   q4k3     plus a product of 3 multiplies (d * s and dm * m formed per row beforehand; another spec)
 * each with one row's vpdpbusd chain at a time, four rows' chains in flight, and the product fused
 * into each row's loop. Built and run by benchmarks/gqp_replica.py (needs gcc and AVX-512 VNNI). */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NCH 64
#define KC (NCH * 32)
#define NGRP 8          /* token groups' operands rotated through, as a call of 128 tokens does */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static double clock_ghz(void) {
    const long n = 400000000;
    long a = 0;
    const double t = now();
    for (long i = 0; i < n; i++) __asm__ volatile("add $1,%0\n\tadd $1,%0\n\tadd $1,%0\n\tadd $1,%0" : "+r"(a));
    return 4.0 * n / (now() - t) / 1e9;
}

typedef struct { float s[16], m[16], d[16], dm[16]; } chunk;

static inline __attribute__((always_inline)) __m512i bcast4(const uint8_t *p) {
    int32_t u;
    memcpy(&u, p, 4);
    return _mm512_set1_epi32(u);
}

enum { DOT, Q4K6, Q4K3 };

/* the product of one row's chunk added to acc */
static inline __attribute__((always_inline)) __m512 take(int prod, __m512i sums, const chunk *k, int i, __m512 xd,
                                                         __m512 xs, __m512 acc) {
    if (prod == DOT) return _mm512_add_ps(acc, _mm512_castsi512_ps(sums));
    if (prod == Q4K3) {     /* k->s: d * s, k->m: dm * m; xs: x_sum * xd */
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(_mm512_set1_ps(k->s[i]), xd), acc);
        return _mm512_fnmadd_ps(_mm512_set1_ps(k->m[i]), xs, acc);
    }
    const __m512 f = _mm512_mul_ps(_mm512_set1_ps(k->d[i]), xd);
    const __m512 a = _mm512_mul_ps(_mm512_set1_ps(k->s[i]), _mm512_cvtepi32_ps(sums));
    const __m512 fm = _mm512_mul_ps(_mm512_set1_ps(k->dm[i]), xd);
    const __m512 pm = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(k->m[i]), xs), fm);
    return _mm512_add_ps(acc, _mm512_sub_ps(_mm512_mul_ps(a, f), pm));
}

enum { ONE_CHAIN, FOUR_CHAINS, FUSED };

static inline __attribute__((always_inline)) void group(int prod, int shape, const uint8_t *codes, const int32_t *bq,
                                                        const int32_t *xc, const chunk *ch, const float *xd,
                                                        const float *xs, int32_t *cb, __m512 acc[16]) {
    for (int c = 0; c < NCH; c++) {
        __m512i xv[8];
        for (int kk = 0; kk < 8; kk++) xv[kk] = _mm512_load_si512(bq + c * 128 + 16 * kk);
        const __m512i h = _mm512_load_si512(xc + 16 * c);
        const __m512 xdv = _mm512_load_ps(xd + 16 * c), xsv = _mm512_load_ps(xs + 16 * c);
        const uint8_t *cc = codes + 32 * c;
        if (shape == FOUR_CHAINS) {
            for (int i = 0; i < 16; i += 4) {
                __m512i a[4] = {h, h, h, h};
                for (int kk = 0; kk < 8; kk++)
                    for (int j = 0; j < 4; j++) a[j] = _mm512_dpbusd_epi32(a[j], bcast4(cc + (i + j) * KC + 4 * kk), xv[kk]);
                for (int j = 0; j < 4; j++) _mm512_store_si512(cb + 16 * (i + j), a[j]);
            }
        } else {
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) {
                __m512i a = h;
                for (int kk = 0; kk < 8; kk++) a = _mm512_dpbusd_epi32(a, bcast4(cc + i * KC + 4 * kk), xv[kk]);
                if (shape == FUSED) acc[i] = take(prod, a, &ch[c], i, xdv, xsv, acc[i]);
                else _mm512_store_si512(cb + 16 * i, a);
            }
        }
        if (shape != FUSED) {
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) acc[i] = take(prod, _mm512_load_si512(cb + 16 * i), &ch[c], i, xdv, xsv, acc[i]);
        }
    }
}

#define VARIANT(P, S)                                                                                        \
    static __attribute__((noinline)) void run_##P##_##S(const uint8_t *codes, const int32_t *bq, const int32_t *xc, \
                                                        const chunk *ch, const float *xd, const float *xs, int32_t *cb, \
                                                        __m512 acc[16]) {                                    \
        group(P, S, codes, bq, xc, ch, xd, xs, cb, acc);                                                     \
    }
VARIANT(DOT, ONE_CHAIN) VARIANT(DOT, FOUR_CHAINS) VARIANT(DOT, FUSED)
VARIANT(Q4K6, ONE_CHAIN) VARIANT(Q4K6, FOUR_CHAINS) VARIANT(Q4K6, FUSED)
VARIANT(Q4K3, ONE_CHAIN) VARIANT(Q4K3, FOUR_CHAINS) VARIANT(Q4K3, FUSED)

typedef void (*run_fn)(const uint8_t *, const int32_t *, const int32_t *, const chunk *, const float *, const float *,
                       int32_t *, __m512 *);

int main(void) {
    const struct { const char *name; run_fn f; } runs[] = {
        {"dot  one chain", run_DOT_ONE_CHAIN},    {"dot  four chains", run_DOT_FOUR_CHAINS},
        {"dot  fused", run_DOT_FUSED},            {"q4k6 one chain", run_Q4K6_ONE_CHAIN},
        {"q4k6 four chains", run_Q4K6_FOUR_CHAINS}, {"q4k6 fused", run_Q4K6_FUSED},
        {"q4k3 one chain", run_Q4K3_ONE_CHAIN},   {"q4k3 four chains", run_Q4K3_FOUR_CHAINS},
        {"q4k3 fused", run_Q4K3_FUSED},
    };
    uint8_t *codes = aligned_alloc(4096, 16 * KC);
    int32_t *bq = aligned_alloc(4096, (size_t)NGRP * NCH * 128 * 4), *xc = aligned_alloc(64, NCH * 16 * 4);
    int32_t *cb = aligned_alloc(64, 256 * 4);
    chunk *ch = aligned_alloc(64, sizeof(chunk) * NCH);
    float *xd = aligned_alloc(64, NCH * 16 * 4), *xs = aligned_alloc(64, NCH * 16 * 4);
    if (!codes || !bq || !xc || !cb || !ch || !xd || !xs) return 1;
    srand(1);
    for (int i = 0; i < 16 * KC; i++) codes[i] = (uint8_t)rand();
    for (int i = 0; i < NGRP * NCH * 128; i++) bq[i] = rand();
    for (int i = 0; i < NCH * 16; i++) {
        xc[i] = -128 * (rand() & 255);
        xd[i] = 1e-3f * (float)(i % 7);
        xs[i] = (float)(i % 13);
    }
    for (int c = 0; c < NCH; c++)
        for (int i = 0; i < 16; i++) {
            ch[c].s[i] = (float)(rand() & 63);
            ch[c].m[i] = (float)(rand() & 63);
            ch[c].d[i] = 1e-2f;
            ch[c].dm[i] = 2e-2f;
        }
    const double ghz = clock_ghz();
    printf("clock %.2f GHz (a chain of adds); cycles per row's chunk of 32 columns, 16 tokens, best of 5\n", ghz);
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    const long n = 20000;
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
        double best = 1e9;
        for (int rep = 0; rep < 5; rep++) {
            const double t = now();
            for (long it = 0; it < n; it++) runs[r].f(codes, bq + (it % NGRP) * NCH * 128, xc, ch, xd, xs, cb, acc);
            const double dt = now() - t;
            if (dt < best) best = dt;
        }
        printf("%-18s %6.2f\n", runs[r].name, best * ghz * 1e9 / n / 16 / NCH);
    }
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += _mm512_reduce_add_ps(acc[i]);
    return s == 1234.5f;     /* keeps the sums live */
}
