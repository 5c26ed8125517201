/* sample.c: one token drawn from a logits row, exactly as the docstring of cpumla/sampling.py
 * defines it (that definition is the spec; sampling.py computes the same choices with numpy).
 *
 * Single-threaded and allocation-free: the caller hands in work (cpumla_sample_work_bytes), so any
 * thread may call at any time without the library lock. For a row of n logits:
 *   1. max, with the NaN / inf checks                                    vectorised pass
 *   2. p_i by the defined exp into work; the least p's bits              vectorised passes
 *   3. level-1 histogram: the count (top-k only) and the integer mass of each of at most 4096 bins of
 *      p's bits, spread over the live range (flat rows get fine bins)   bins vectorised, adds scalar
 *   4. each "where does the order cross" query (top-k's k-th token, top-p's crossing, min-p's mass,
 *      the draw) walks the bins from the top, gathers the crossing bin's ids (one vectorised scan,
 *      kept for the next query on the same bin), and refines them on p's next 8 bits until one bit
 *      pattern is left: tokens with identical p, which follow in id order.
 * The passes of 1-4 are the chosen level's (kernels.h's sample_passes: sample_passes.h compiled by
 * scalar_sample.c, avx2_sample.c, avx512f_sample.c), with identical results at every level. Masses
 * are integers (p truncated to a multiple of 2^-S, S = 53 - the bit length of n), so every sum is
 * exact in any order: the histogram finds the same crossings as a full sort. Bits order like
 * non-negative floats, so bins follow the order. FLAGS compiles this file and the passes with
 * -ffp-contract=off (the exp is a fixed sequence of float32 operations that numpy repeats; a fused
 * multiply-add would round differently) and -fno-trapping-math (lets gcc vectorise the exp's selects;
 * no value changes). */
#include <math.h>
#include <string.h>
#include "cpumla.h"
#include "core/dispatch.h"
#include "core/sample.h"

#define MAX_S 52                            /* masses are p in units of 2^-S, S <= MAX_S */
#define L1_BINS 4096                        /* level-1 bins at most */

typedef struct {
    uint32_t count[L1_BINS + 16];      /* + 16 slots for the tokens without mass */
    uint64_t mass[L1_BINS + 16];
} level1;

/* The bytes of work for a row of n logits: the level-1 histogram, p (n floats), the members of one
 * bin (n ids), 64 for alignment. */
int64_t cpumla_sample_work_bytes(int64_t n) {
    if (n < 1) return 0;
    return (int64_t)sizeof(level1) + 8 * n + 64;
}

/* S for a row of n: n tokens of mass up to 2^S add up to less than 2^53 (exact in a double). */
static int mass_shift(int64_t n) {
    int bits = 0;
    while (bits < 63 && (n >> bits) != 0) bits++;
    int s = 53 - bits;
    return s > MAX_S ? MAX_S : s < 1 ? 1 : s;
}

/* float32(1 / temperature), inf clamped to the largest float (a tiny temperature is then greedy
 * with ties kept, rather than 0 * inf = NaN for the top token). */
static float inv_temperature(double temperature) {
    float s = (float)(1.0 / temperature);
    return s > 0x1.fffffep+127f ? 0x1.fffffep+127f : s;
}

static const char *row_error(int status) {
    switch (status) {
    case SAMPLE_ROW_NAN: return "the model's logits contain NaN; no token can be chosen";
    case SAMPLE_ROW_INF: return "the model's logits are infinite";
    default: return "every token's logit is -inf";
    }
}

/* The passes over the row of the level cpumla_init chose (the same values at each). */
static const sample_passes *passes(void) {
    cpumla_ensure_init();
    return cpumla_k.sample_passes;
}

/* the row's max into *m, or -1 with the row's error (NaN, or no finite logit) set */
static int checked_max(const sample_passes *ps, const float *logits, int64_t n, float *m) {
    int st = ps->row_max(logits, n, m);
    if (st != SAMPLE_ROW_OK) {
        cpumla_set_error(row_error(st));
        return -1;
    }
    return 0;
}

int cpumla_sample_probs(const float *logits, int64_t n, double temperature, float *p) {
    if (n < 1 || !(temperature > 0) || !logits || !p) {
        cpumla_set_error("sample_probs: needs n >= 1, temperature > 0 and both buffers");
        return -1;
    }
    const sample_passes *ps = passes();
    float m;
    if (checked_max(ps, logits, n, &m) != 0) return -1;
    ps->probs(logits, n, m, inv_temperature(temperature), p);
    return 0;
}

/* ---- the order (p descending, ids ascending) and its crossings --------------------------------- */
/* Level-1 bins split the bits of the live p (those with mass: lo .. the bits of 1.0) into at most
 * L1_BINS ranges of 2^shift bit patterns: fine where p is flat (a narrow range), 64 an octave over the
 * widest range (2^-52 .. 1). Bits order like non-negative floats, so the bins follow the order. */
typedef struct {
    const sample_passes *ps;
    const uint32_t *bits;      /* p's float32 bits, [n] */
    int64_t n;
    float scale;               /* 2^S: the mass of a token is trunc(p * scale) */
    uint32_t lo;               /* level-1 bin 0 starts here; below: no mass, in no bin */
    int shift;                 /* a bin holds 2^shift bit patterns */
    int nbins;                 /* bins in use */
    level1 *h;
    uint32_t *members;         /* the ids of level-1 bin `gathered`, ascending */
    int64_t n_members;
    int members_same;          /* 1: they all have the same p */
    int gathered;              /* -1: none yet */
} order;

static inline uint64_t mass_of(const order *o, uint32_t bits) {
    return (uint64_t)(int64_t)(sample_u2f(bits) * o->scale);
}

/* count (with_counts) and mass of each level-1 bin */
static void histogram(order *o, int with_counts) {
    level1 *h = o->h;
    memset(h->count, 0, sizeof h->count[0] * (size_t)(o->nbins + 16));
    memset(h->mass, 0, sizeof h->mass[0] * (size_t)(o->nbins + 16));
    o->ps->histogram(o->bits, o->n, o->lo, o->shift, (uint32_t)o->nbins, o->scale, with_counts ? h->count : NULL,
                     h->mass);
}

/* members = the ids in level-1 bin `bin`, ascending (kept for the next query that needs the bin). */
static void gather(order *o, int bin) {
    if (o->gathered == bin) return;
    o->gathered = bin;
    if (o->lo == 0x3f800000u) {                /* every p is 1 (equal logits): every id, no scan */
        for (int64_t i = 0; i < o->n; i++) o->members[i] = (uint32_t)i;
        o->n_members = o->n;
        o->members_same = 1;
        return;
    }
    o->n_members = o->ps->gather(o->bits, o->n, o->lo + ((uint32_t)bin << o->shift), 1u << o->shift,
                                 o->members, &o->members_same);
}

/* Running totals along the order up to (not including) a bin. */
typedef struct { uint64_t count, mass; } totals;

/* The first of bins[0..nb) walked from the top at which the running count (by_count) or mass
 * reaches target, given what came before; before is advanced past the bins above it. */
static int walk(const uint32_t *counts, const uint64_t *masses, int nb, int by_count, uint64_t target,
                totals *before) {
    for (int b = nb - 1; b > 0; b--) {
        uint64_t v = by_count ? before->count + counts[b] : before->mass + masses[b];
        if (v >= target) return b;
        before->count += counts[b];
        before->mass += masses[b];
    }
    return 0;
}

/* The first token in the order at which the running count (by_count) or mass reaches target
 * (1 <= target <= the live count or total mass): its id, and the mass through it in *mass_through.
 * The level-1 bin is refined on p's next 8 bits (or fewer) until one bit pattern is left: tokens
 * with identical p, which follow in id order. */
static int64_t crossing(order *o, int by_count, uint64_t target, uint64_t *mass_through) {
    totals before = {0, 0};
    const int c1 = walk(o->h->count, o->h->mass, o->nbins, by_count, target, &before);
    gather(o, c1);
    const uint32_t *bits = o->bits, *mem = o->members;
    const int64_t nm = o->n_members;
    uint32_t base = o->lo + ((uint32_t)c1 << o->shift);
    int64_t in_group = nm;
    int shift = o->shift;
    if (o->members_same) {
        base = bits[mem[0]];
        shift = 0;
    }
    uint32_t cnt[256];
    uint64_t mass[256];
    while (shift > 0) {
        const int digit = shift > 8 ? shift - 8 : 0, nb = 1 << (shift - digit);
        const uint32_t width = 1u << shift;
        memset(cnt, 0, sizeof cnt[0] * (size_t)nb);
        memset(mass, 0, sizeof mass[0] * (size_t)nb);
        for (int64_t j = 0; j < nm; j++) {
            const uint32_t b = bits[mem[j]];
            if (b - base >= width) continue;
            const uint32_t k = (b - base) >> digit;
            cnt[k]++;
            mass[k] += mass_of(o, b);
        }
        const int c = walk(cnt, mass, nb, by_count, target, &before);
        base += (uint32_t)c << digit;
        in_group = cnt[c];
        shift = digit;
    }
    /* the r-th token with p's bits = base crosses */
    const uint64_t w = mass_of(o, base);
    uint64_t r = by_count ? target - before.count : (target - before.mass + w - 1) / w;
    *mass_through = before.mass + r * w;
    if (in_group == nm) return mem[r - 1];
    for (int64_t j = 0; j < nm; j++)
        if (bits[mem[j]] == base && --r == 0) return mem[j];
    return -1;                                  /* unreachable for a target within the total */
}

/* The mass of the tokens with p's bits >= floor_bits: the bins above floor_bits' and that bin's
 * members at or above it. */
static uint64_t mass_at_least(order *o, uint32_t floor_bits, uint64_t total) {
    if (floor_bits <= o->lo) return total;
    const int c = (int)((floor_bits - o->lo) >> o->shift);
    uint64_t above = 0;
    for (int b = c + 1; b < o->nbins; b++) above += o->h->mass[b];
    gather(o, c);
    for (int64_t j = 0; j < o->n_members; j++) {
        const uint32_t b = o->bits[o->members[j]];
        if (b >= floor_bits) above += mass_of(o, b);
    }
    return above;
}

/* The smallest float32 >= v (v in [0, 1)): p >= v exactly when p >= this. */
static float f32_at_least(double v) {
    float f = (float)v;
    return (double)f < v ? nextafterf(f, INFINITY) : f;
}

static int64_t first_equal(const float *x, int64_t n, float m) {
    for (int64_t i = 0; i < n; i++)
        if (x[i] == m) return i;
    return 0;
}

int64_t cpumla_sample(const float *logits, int64_t n, double temperature, int64_t top_k, double top_p,
                      double min_p, uint64_t draw, void *work) {
    if (n < 1 || !logits || !(temperature >= 0) || top_k < 0 || !(top_p > 0 && top_p <= 1) ||
        !(min_p >= 0 && min_p < 1) || draw >> 53 || (temperature > 0 && !work)) {
        cpumla_set_error("sample: needs n >= 1, temperature >= 0, top_k >= 0, top_p in (0, 1], "
                         "min_p in [0, 1), draw < 2^53 and (temperature > 0) a work buffer");
        return -1;
    }
    const sample_passes *ps = passes();
    float m;
    if (checked_max(ps, logits, n, &m) != 0) return -1;
    if (temperature == 0) return first_equal(logits, n, m);

    level1 *h = (level1 *)(((uintptr_t)work + 63) & ~(uintptr_t)63);
    float *p = (float *)(h + 1);
    ps->probs(logits, n, m, inv_temperature(temperature), p);
    const int S = mass_shift(n);
    const uint32_t low = ps->least((const uint32_t *)p, n), live = (uint32_t)(127 - S) << 23;
    order o = {.ps = ps, .bits = (const uint32_t *)p, .n = n, .scale = sample_u2f((uint32_t)(127 + S) << 23),
               .lo = low > live ? low : live, .h = h, .members = (uint32_t *)(p + n), .gathered = -1};
    while ((0x3f800000u - o.lo) >> o.shift >= L1_BINS) o.shift++;
    o.nbins = (int)((0x3f800000u - o.lo) >> o.shift) + 1;
    const int by_k = top_k > 0 && top_k < n;
    histogram(&o, by_k);
    uint64_t total = 0, n_live = 0;
    for (int b = 0; b < o.nbins; b++) {
        total += h->mass[b];
        n_live += h->count[b];
    }

    uint64_t kept = total, through;            /* the kept prefix's mass */
    if (by_k && (uint64_t)top_k < n_live) crossing(&o, 1, (uint64_t)top_k, &kept);
    if (top_p < 1) {
        crossing(&o, 0, (uint64_t)ceil(top_p * (double)kept), &through);
        kept = through;
    }
    if (min_p > 0) {
        const uint64_t above = mass_at_least(&o, sample_f2u(f32_at_least(min_p)), total);
        kept = above < kept ? above : kept;
    }
    /* the first token whose running mass exceeds u * kept, u = draw / 2^53: reaches floor(.) + 1 */
    const uint64_t t = (uint64_t)(((unsigned __int128)draw * kept) >> 53);
    return crossing(&o, 0, t + 1, &through);
}
