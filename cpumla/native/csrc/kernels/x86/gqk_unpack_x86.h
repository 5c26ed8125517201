/* gqk_unpack_x86.h: a K-type super-block (Q2_K .. Q6_K, gguf_q.h) unpacked with AVX2 shifts and masks
 * into 8 ymm of unsigned codes u (q = u - off: off 0, 4 or 32 by type) and its scales and mins as
 * int32 lanes (gqk_u), the values of the spec's gq_unpack. Included by gqk_x86.h (the avx2 and
 * avx512vnni gemms) and amx_gq.c (the tiles' panels). */
#ifndef CPUMLA_GQK_UNPACK_X86_H
#define CPUMLA_GQK_UNPACK_X86_H
#include <immintrin.h>
#include <stdint.h>

#define GQK_INLINE static inline __attribute__((always_inline))

enum { GQK_Q2, GQK_Q3, GQK_Q4, GQK_Q5, GQK_Q6 };

/* a super-block unpacked: codes u (chunk c in q[c]); per-32 types (Q4_K, Q5_K) s, m: int32 of chunk
 * 0..7; per-16 types: s0 / s1 (and m0 / m1): [half 0 of chunks 0..3 | half 1 of chunks 0..3] and the
 * same for chunks 4..7 (the order gqk_halves gives) */
typedef struct {
    __m256i q[8];
    __m256i s0, s1, m0, m1;
    float d, dm;
} gqk_u;

/* fp16 -> fp32 with F16C: exact, and f16_to_f32's value for every finite and infinite input (a NaN
 * only ever makes the products NaN) */
static inline float gqk_h16(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | p[1] << 8)); }
static inline uint32_t gqk_le32(const uint8_t *p) { uint32_t v; __builtin_memcpy(&v, p, 4); return v; }
static inline uint64_t gqk_le64(const uint8_t *p) { uint64_t v; __builtin_memcpy(&v, p, 8); return v; }

static inline __m256i gqk_ld(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* bit `from` of each byte of v (masked) moved to bit `to` (16-bit shifts: the masked bit stays in its byte) */
GQK_INLINE __m256i gqk_bit(__m256i v, int from, int to) {
    const __m256i b = _mm256_and_si256(v, _mm256_set1_epi8((char)(1 << from)));
    if (to > from) return _mm256_slli_epi16(b, to - from);
    if (to < from) return _mm256_srli_epi16(b, from - to);
    return b;
}

/* 4 chunks' lane vectors -> [half 0 sums of chunks 0..3 | half 1 sums of chunks 0..3] (lanes 0-3 of a
 * chunk are its first 16 bytes, lanes 4-7 its last 16) */
GQK_INLINE __m256i gqk_halves(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i ab = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
    const __m256i cd = _mm256_add_epi32(_mm256_unpacklo_epi32(c, d), _mm256_unpackhi_epi32(c, d));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
}
/* two gqk_halves vectors -> the 8 chunk sums in chunk order */
GQK_INLINE __m256i gqk_join(__m256i lo, __m256i hi) {
    return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
}

/* 16 per-16 bytes v (t = 2c + half) -> int32 lanes in gqk_halves order, signed or unsigned */
GQK_INLINE void gqk_sc16(__m128i v, int sgn, __m256i *s0, __m256i *s1) {
    const __m128i p = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
    const __m128i h = _mm_unpackhi_epi64(p, p);
    *s0 = sgn ? _mm256_cvtepi8_epi32(p) : _mm256_cvtepu8_epi32(p);
    *s1 = sgn ? _mm256_cvtepi8_epi32(h) : _mm256_cvtepu8_epi32(h);
}

/* Q4_K / Q5_K: the 6-bit scales (sv) and mins (mv) of chunks 0..7 as bytes, from 12 bytes */
GQK_INLINE void gqk_sm6(const uint8_t *sc, __m256i *s, __m256i *m) {
    const uint32_t w0 = gqk_le32(sc), w1 = gqk_le32(sc + 4), w2 = gqk_le32(sc + 8);
    const uint64_t sv = (uint64_t)(w0 & 0x3f3f3f3fu) | (uint64_t)((w2 & 0x0f0f0f0fu) | ((w0 >> 2) & 0x30303030u)) << 32;
    const uint64_t mv = (uint64_t)(w1 & 0x3f3f3f3fu) | (uint64_t)(((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 2) & 0x30303030u)) << 32;
    *s = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sv));
    *m = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mv));
}

GQK_INLINE void gqk_unpack(int T, const uint8_t *b, gqk_u *u) {
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
    if (T == GQK_Q4 || T == GQK_Q5) {
        const uint8_t *qs = b + (T == GQK_Q4 ? 16 : 48);
        for (int g = 0; g < 4; g++) {
            const __m256i v = gqk_ld(qs + 32 * g);
            u->q[2 * g] = _mm256_and_si256(v, m4);
            u->q[2 * g + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        }
        if (T == GQK_Q5) {
            const __m256i h = gqk_ld(b + 16);
            for (int c = 0; c < 8; c++) u->q[c] = _mm256_or_si256(u->q[c], gqk_bit(h, c, 4));
        }
        gqk_sm6(b + 4, &u->s0, &u->m0);
        u->d = gqk_h16(b);
        u->dm = gqk_h16(b + 2);
    } else if (T == GQK_Q6) {
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = gqk_ld(b + 64 * h), l1 = gqk_ld(b + 64 * h + 32), hb = gqk_ld(b + 128 + 32 * h);
            u->q[4 * h] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m2), 4));
            u->q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                              _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(0x0c)), 2));
            u->q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                              _mm256_and_si256(hb, _mm256_set1_epi8(0x30)));
            u->q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                              _mm256_srli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8((char)0xc0)), 2));
        }
        gqk_sc16(_mm_loadu_si128((const __m128i *)(b + 192)), 1, &u->s0, &u->s1);
        u->d = gqk_h16(b + 208);
    } else if (T == GQK_Q2) {
        for (int h = 0; h < 2; h++) {
            const __m256i v = gqk_ld(b + 16 + 32 * h);
            u->q[4 * h] = _mm256_and_si256(v, m2);
            u->q[4 * h + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 2), m2);
            u->q[4 * h + 2] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m2);
            u->q[4 * h + 3] = _mm256_and_si256(_mm256_srli_epi16(v, 6), m2);
        }
        const __m128i sc = _mm_loadu_si128((const __m128i *)b);
        gqk_sc16(_mm_and_si128(sc, _mm_set1_epi8(15)), 0, &u->s0, &u->s1);
        gqk_sc16(_mm_and_si128(_mm_srli_epi16(sc, 4), _mm_set1_epi8(15)), 0, &u->m0, &u->m1);
        u->d = gqk_h16(b + 80);
        u->dm = gqk_h16(b + 82);
    } else {                                  /* Q3_K: u = 2 bits + 4 * the hmask bit, q = u - 4 */
        const __m256i hm = gqk_ld(b);
        for (int h = 0; h < 2; h++) {
            const __m256i v = gqk_ld(b + 32 + 32 * h);
            for (int k = 0; k < 4; k++) {
                const __m256i lo = _mm256_and_si256(k ? _mm256_srli_epi16(v, 2 * k) : v, m2);
                u->q[4 * h + k] = _mm256_or_si256(lo, gqk_bit(hm, 4 * h + k, 2));
            }
        }
        const uint64_t a = gqk_le64(b + 96);
        const uint32_t hw = gqk_le32(b + 104);
        const uint64_t hl = (uint64_t)(hw & 0x03030303u) | (uint64_t)((hw >> 2) & 0x03030303u) << 32;
        const uint64_t hh = (uint64_t)((hw >> 4) & 0x03030303u) | (uint64_t)((hw >> 6) & 0x03030303u) << 32;
        const uint64_t lo = (a & 0x0f0f0f0f0f0f0f0full) | hl << 4, hi = ((a >> 4) & 0x0f0f0f0f0f0f0f0full) | hh << 4;
        const __m128i sv = _mm_sub_epi8(_mm_set_epi64x((long long)hi, (long long)lo), _mm_set1_epi8(32));
        gqk_sc16(sv, 1, &u->s0, &u->s1);
        u->d = gqk_h16(b + 108);
    }
}

#endif
