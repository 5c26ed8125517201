/* quant_driver.h: the integer (q8 / q4 / e2m1) GEMV and GEMM drivers over a level's row x token tile,
 * compiled once per level (avx2_q.c, avxvnni_q.c over int_avx2.h; avx512vnni_q.c, avx512f_fp4.c over
 * int_avx512.h), whose flags differ, so they cannot share a function. Include it after defining
 *   tile_run(w, r, R, qx, per, T, y, ldy, fmt, prefetch, l2): R rows from r times T tokens of quantized
 *   activations (per bytes apart) into y (T rows ldy apart), fmt F_Q8 / F_Q4 / F_FP4 / F_FP4X, prefetch
 *   the distance of a software prefetch (0: none), l2 its target (common.h cpumla_pf_l2), always inlined so
 *   its constant arguments specialise it,
 *   e8m0_plain(s, n): 1 when every E8M0 byte of s[0..n) is in [2, 254],
 * QDRIVER_GEMM, the name the GEMM entry gets, and QDRIVER_PF_L2, the gemv's l2 (read once a call);
 * optionally QDRIVER_PANEL(w, qx, n, y, ldy, r0, r1), a GEMM of several tokens that returns 1 where it
 * served the call (avx2_q.c: avx2_gqp.c's panels for Q8 / Q4), and QDRIVER_FEW, the most tokens (2 or 3,
 * what tile_run takes) whose GEMM streams the rows one at a time as the gemv does. */
#if !defined(QDRIVER_GEMM) || !defined(QDRIVER_PF_L2)
#error "define QDRIVER_GEMM and QDRIVER_PF_L2 before including quant_driver.h"
#endif

/* tile_run; E2M1 rows with a scale byte 0, 1 or 0xff (never in a released checkpoint) take the full
 * scale conversion (F_FP4X), the others the short one */
INLINE void tile(const cpumla_weight *w, int64_t r, int R, const uint8_t *qx, int64_t per, int T, float *y,
                 int64_t ldy, int fmt, int64_t pf, int l2) {
    if (fmt == F_FP4)
        for (int i = 0; i < R; i++)
            if (!e8m0_plain(q_scale_row(w, r + i), w->cols / QK)) fmt = F_FP4X;
    if (fmt == F_FP4X) tile_run(w, r, R, qx, per, T, y, ldy, F_FP4X, pf, l2);
    else tile_run(w, r, R, qx, per, T, y, ldy, fmt, pf, l2);
}


#define TILE(R, T)                                                                   \
    static void tile_##R##_##T(const cpumla_weight *w, int64_t r, const uint8_t *qx, int64_t per, float *y, \
                               int64_t ldy) {                                        \
        if (w->dtype == CPUMLA_Q4) tile(w, r, R, qx, per, T, y, ldy, F_Q4, 0, 0);    \
        else if (w->dtype == CPUMLA_E2M1) tile(w, r, R, qx, per, T, y, ldy, F_FP4, 0, 0); \
        else tile(w, r, R, qx, per, T, y, ldy, F_Q8, 0, 0);                          \
    }
TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1) TILE(1, 2) TILE(2, 2) TILE(3, 2) TILE(4, 2)
#undef TILE
typedef void (*tile_fn)(const cpumla_weight *, int64_t, const uint8_t *, int64_t, float *, int64_t);
static const tile_fn tiles[2][4] = {{tile_1_1, tile_2_1, tile_3_1, tile_4_1}, {tile_1_2, tile_2_2, tile_3_2, tile_4_2}};

/* T tokens (per bytes apart, results ldy apart): the rows in order, one at a time (one stream), each
 * row's blocks unpacked once for all the tokens, prefetched pf bytes ahead with target l2 (common.h:
 * L1, L2, or L2 and L1). The prefetch runs on past r1 to the weight's last row, as the other GEMVs'
 * does: a span job's thread takes the rows after its task's range next (threadpool.h), so its next
 * task starts on rows already on their way. The last rows of the weight, whose prefetch would land
 * past it, prefetch nothing. T = 1 is the gemv; 2 .. QDRIVER_FEW tokens (a verify forward of drafts)
 * keep each token's sums in its gemv's order (tile_run's per row and token): bit for bit its gemv's. */
INLINE void gemv_rows(const cpumla_weight *w, const uint8_t *qx, int64_t per, int T, float *y, int64_t ldy,
                      int64_t r0, int64_t r1, int fmt, int64_t pf, int l2) {
    const int64_t ahead = (pf + w->row_bytes - 1) / w->row_bytes;
    const int64_t last = w->rows - ahead < r1 ? w->rows - ahead : r1;
    const int64_t rp = last > r0 ? last : r0;
    for (int64_t r = r0; r < rp; r++) tile(w, r, 1, qx, per, T, y + (r - r0), ldy, fmt, pf, l2);
    for (int64_t r = rp; r < r1; r++) tile(w, r, 1, qx, per, T, y + (r - r0), ldy, fmt, 0, 0);
}
/* QPF_BYTES ahead, or the two-level target's own distance (common.h GEMV_PF_FAR_2L) */
#define GEMV_ROWS(fmt, T)                                                                                  \
    GEMV_PF_CASES(QDRIVER_PF_L2, gemv_rows(w, qx, per, T, y, ldy, r0, r1, fmt, L2 == 2 ? GEMV_PF_FAR_2L : QPF_BYTES, L2))
#define GEMV_FN(name, fmt)                                                                                 \
    static void name(const cpumla_weight *w, const uint8_t *qx, float *y, int64_t r0, int64_t r1) {        \
        const int64_t per = 0, ldy = 0;                                                                    \
        GEMV_ROWS(fmt, 1);                                                                                 \
    }
GEMV_FN(gemv_q8, F_Q8) GEMV_FN(gemv_q4, F_Q4) GEMV_FN(gemv_fp4, F_FP4)
#undef GEMV_FN
#ifdef QDRIVER_FEW
#define FEW_FN(name, fmt)                                                                                  \
    static void name(const cpumla_weight *w, const uint8_t *qx, int64_t per, int64_t n, float *y, int64_t ldy, \
                     int64_t r0, int64_t r1) {                                                             \
        if (n == 3) GEMV_ROWS(fmt, 3);                                                                     \
        else GEMV_ROWS(fmt, 2);                                                                            \
    }
FEW_FN(few_q8, F_Q8) FEW_FN(few_q4, F_Q4) FEW_FN(few_fp4, F_FP4)
#undef FEW_FN
#endif
#undef GEMV_ROWS

/* gemm: rows in groups of 4 (outer: they stay in cache), tokens in pairs */
static void QDRIVER_GEMM(const cpumla_weight *w, const void *qx, int64_t n, float *y, int64_t ldy, int64_t r0,
                         int64_t r1) {
    if (n == 1) {
        if (w->dtype == CPUMLA_Q4) gemv_q4(w, qx, y, r0, r1);
        else if (w->dtype == CPUMLA_E2M1) gemv_fp4(w, qx, y, r0, r1);
        else gemv_q8(w, qx, y, r0, r1);
        return;
    }
#ifdef QDRIVER_PANEL
    if (QDRIVER_PANEL(w, qx, n, y, ldy, r0, r1)) return;       /* the level's panels, where they serve */
#endif
    const int64_t per = QX_BYTES(w->cols);
#ifdef QDRIVER_FEW
    if (n <= QDRIVER_FEW) {
        if (w->dtype == CPUMLA_Q4) few_q4(w, qx, per, n, y, ldy, r0, r1);
        else if (w->dtype == CPUMLA_E2M1) few_fp4(w, qx, per, n, y, ldy, r0, r1);
        else few_q8(w, qx, per, n, y, ldy, r0, r1);
        return;
    }
#endif
    for (int64_t r = r0; r < r1; r += 4) {
        const int R = r1 - r < 4 ? (int)(r1 - r) : 4;
        for (int64_t t = 0; t < n; t += 2) {
            const int T = n - t < 2 ? 1 : 2;
            tiles[T - 1][R - 1](w, r, (const uint8_t *)qx + t * per, per, y + t * ldy + (r - r0), ldy);
        }
    }
}
