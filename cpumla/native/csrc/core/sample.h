/* sample.h: the sampler's row passes as a level provides them (kernels.h's sample_passes), and the
 * helpers sample.c shares with their bodies (kernels/generic/sample_passes.h). */
#ifndef CPUMLA_SAMPLE_H
#define CPUMLA_SAMPLE_H
#include <stdint.h>
#include <string.h>

enum { SAMPLE_ROW_OK = 0, SAMPLE_ROW_NAN = 1, SAMPLE_ROW_INF = 2, SAMPLE_ROW_ALL_NEG_INF = 3 };

typedef struct sample_passes {
    /* max of x into *max; SAMPLE_ROW_OK, or why the row cannot be sampled */
    int (*row_max)(const float *x, int64_t n, float *max);
    /* p_i = the definition's exp of (x_i - m) * s */
    void (*probs)(const float *x, int64_t n, float m, float s, float *p);
    /* the least of bits[0..n) */
    uint32_t (*least)(const uint32_t *bits, int64_t n);
    /* mass[bin] += trunc(p_i * scale) and, when count is not NULL, count[bin] += 1 for each i, where
     * bin = (bits_i - lo) >> shift, or for bits_i < lo (no mass) one of dump .. dump + 15 */
    void (*histogram)(const uint32_t *bits, int64_t n, uint32_t lo, int shift, uint32_t dump, float scale,
                      uint32_t *count, uint64_t *mass);
    /* out = the ids i (ascending) with bits[i] - base < width (unsigned); returns their count, and in
     * *same whether they all have the same bits */
    int64_t (*gather)(const uint32_t *bits, int64_t n, uint32_t base, uint32_t width, uint32_t *out, int *same);
} sample_passes;

static inline uint32_t sample_f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float sample_u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Each level's passes: sample_passes.h compiled with that level's flags (FLAGS) */
extern const sample_passes cpumla_sample_passes_scalar;    /* scalar_sample.c: baseline (SSE2, NEON) */
#if defined(__x86_64__)
extern const sample_passes cpumla_sample_passes_avx2;      /* avx2_sample.c */
extern const sample_passes cpumla_sample_passes_avx512f;   /* avx512f_sample.c: AVX-512 F/BW/VL/DQ */
#endif

#endif
