/* amx_common.h: what the amx level's files (amx.c, amx_gq.c) share: the ldtilecfg operand, lane offsets
 * for gathers, and the store of a 16 rows x 16 tokens block of sums into y. */
#ifndef CPUMLA_AMX_COMMON_H
#define CPUMLA_AMX_COMMON_H
#include <immintrin.h>
#include <stdint.h>

typedef struct {                /* the 64-byte operand of ldtilecfg, palette 1 */
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];         /* bytes per row of tile i */
    uint8_t rows[16];           /* rows of tile i */
} __attribute__((packed, aligned(64))) amx_tilecfg;

/* lane i: i * s (gather offsets of 16 rows or tokens s bytes apart) */
static inline __m512i lanes_times(int32_t s) {
    return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(s));
}

/* fb[16 i + t] (row i, token t) -> y[t * ldy + i] for the nt tokens and mp rows there are */
static inline void amx_store_block(const float *fb, float *y, int64_t ldy, int64_t nt, int64_t mp) {
    const __m512i tr = lanes_times(16);
    const __mmask16 mr = (__mmask16)((1u << mp) - 1u);
    for (int64_t t = 0; t < nt; t++)
        _mm512_mask_storeu_ps(y + t * ldy, mr, _mm512_i32gather_ps(_mm512_add_epi32(tr, _mm512_set1_epi32((int)t)), fb, 4));
}
#endif
