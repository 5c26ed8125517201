/* gqk_avx512.h: the avx512vnni level's gemv (one token) for the K types, 4 rows at a time in zmm
 * (gqk_x86.h does the rest: its names and types are used here). Include it after gqk_x86.h.
 * Per row a super-block's codes are 4 zmm u (chunks 2k, 2k+1 in zmm k: the activations' own order),
 * unpacked with per-half variable shifts of 32-byte broadcasts; vpdpbusd gives 16 lane sums a zmm.
 * The 4 rows' lane sums are reduced together (unpack across rows, then across 128-bit lanes), which
 * leaves every sum with the row innermost: 128-bit lane = one chunk (or half), dword = row. Scales,
 * mins and d are brought to that layout from the 4 rows' bytes (one 128-bit lane each) with vpshufb,
 * vpermd and vpermw; so the 8 chunk products of the 4 rows are 2 zmm, added to the 4 row sums (one
 * xmm) chunk by chunk in order. The offset types' codes (q = u - off) start each lane at -off times
 * the activations' lane sum. All integer steps are exact; each fp32 operation is the spec's. */

/* 16 bytes of each of 4 rows, row r in 128-bit lane r */
static inline __m512i gqk4_ld16(const uint8_t *b, int64_t stride, int64_t at) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(b + at)));
    v = _mm512_mask_broadcast_i32x4(v, 0x00f0, _mm_loadu_si128((const __m128i *)(b + stride + at)));
    v = _mm512_mask_broadcast_i32x4(v, 0x0f00, _mm_loadu_si128((const __m128i *)(b + 2 * stride + at)));
    return _mm512_mask_broadcast_i32x4(v, 0xf000, _mm_loadu_si128((const __m128i *)(b + 3 * stride + at)));
}

/* v: 4 rows' 16 bytes (lane r) -> out[k], k = 0..3: dwords (q, r) = byte 4k + q of row r, widened */
GQK_INLINE void gqk4_tr(__m512i v, int sgn, __m512i out[4]) {
    const __m512i w = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), v);
    const __m512i t = _mm512_shuffle_epi8(w, _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)));
    for (int k = 0; k < 4; k++) {
        const __m128i b = k == 0 ? _mm512_castsi512_si128(t) : _mm512_extracti32x4_epi32(t, k);
        out[k] = sgn ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
    }
}

/* the fp16 words at word index wd (and wm) of each row's lane -> d (dm) for dwords (c, r): row r's */
GQK_INLINE void gqk4_d(__m512i v, int wd, int wm, __m512 *d, __m512 *dm) {
    const __m512i idx = _mm512_setr_epi32(wd | (8 + wd) << 16, (16 + wd) | (24 + wd) << 16, wd | (8 + wd) << 16,
                                          (16 + wd) | (24 + wd) << 16, wd | (8 + wd) << 16, (16 + wd) | (24 + wd) << 16,
                                          wd | (8 + wd) << 16, (16 + wd) | (24 + wd) << 16, wm | (8 + wm) << 16,
                                          (16 + wm) | (24 + wm) << 16, wm | (8 + wm) << 16, (16 + wm) | (24 + wm) << 16,
                                          wm | (8 + wm) << 16, (16 + wm) | (24 + wm) << 16, wm | (8 + wm) << 16,
                                          (16 + wm) | (24 + wm) << 16);
    const __m512i h = _mm512_permutexvar_epi16(idx, v);
    *d = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    if (dm) *dm = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

/* 32 bytes at p in both 256-bit halves, shifted right by a (low half) and b (high half) bits a qword */
static inline __m512i gqk4_b32(const uint8_t *p) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
}
static inline __m512i gqk4_sh(int a, int b) { return _mm512_setr_epi64(a, a, a, a, b, b, b, b); }

/* the 4 zmm of unsigned codes of one row's super-block b */
GQK_INLINE void gqk4_codes(int T, const uint8_t *b, __m512i q[4]) {
    const __m512i m4 = _mm512_set1_epi8(15), m2 = _mm512_set1_epi8(3);
    if (T == GQK_Q4 || T == GQK_Q5) {
        const uint8_t *qs = b + (T == GQK_Q4 ? 16 : 48);
        for (int k = 0; k < 4; k++) q[k] = _mm512_and_si512(_mm512_srlv_epi64(gqk4_b32(qs + 32 * k), gqk4_sh(0, 4)), m4);
        if (T == GQK_Q5) {
            const __m512i h = gqk4_b32(b + 16);
            for (int k = 0; k < 4; k++) {
                const __m512i hb = _mm512_rorv_epi64(h, gqk4_sh((2 * k - 4) & 63, (2 * k - 3) & 63));
                q[k] = _mm512_ternarylogic_epi32(q[k], hb, _mm512_set1_epi8(0x10), 0xf8);   /* a | (b & c) */
            }
        }
    } else if (T == GQK_Q6) {
        for (int h = 0; h < 2; h++) {
            const __m512i l = _mm512_loadu_si512(b + 64 * h), hb = gqk4_b32(b + 128 + 32 * h);
            const __m512i m30 = _mm512_set1_epi8(0x30);
            q[2 * h] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_sllv_epi64(hb, gqk4_sh(4, 2)), m30), l, m4, 0xf8);
            q[2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srlv_epi64(hb, gqk4_sh(0, 2)), m30),
                                                     _mm512_srli_epi64(l, 4), m4, 0xf8);
        }
    } else {                                  /* Q2_K, Q3_K: 2 bits (Q3_K: + 4 * the hmask bit) */
        const uint8_t *qs = b + (T == GQK_Q2 ? 16 : 32);
        for (int h = 0; h < 2; h++) {
            const __m512i v = gqk4_b32(qs + 32 * h);
            q[2 * h] = _mm512_and_si512(_mm512_srlv_epi64(v, gqk4_sh(0, 2)), m2);
            q[2 * h + 1] = _mm512_and_si512(_mm512_srlv_epi64(v, gqk4_sh(4, 6)), m2);
        }
        if (T == GQK_Q3) {
            const __m512i hm = gqk4_b32(b);
            for (int k = 0; k < 4; k++) {
                const __m512i hb = _mm512_rorv_epi64(hm, gqk4_sh((2 * k - 2) & 63, (2 * k - 1) & 63));
                q[k] = _mm512_ternarylogic_epi32(q[k], hb, _mm512_set1_epi8(4), 0xf8);
            }
        }
    }
}

/* the lane sums of 4 rows' zmm k -> dwords (q, r): 128-bit lane q of zmm k (chunk 2k + q / 2, half q % 2) of row r */
GQK_INLINE __m512i gqk4_red(__m512i a, __m512i b, __m512i c, __m512i d) {
    const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
}
/* halves (gqk4_red of zmm 2f, 2f + 1) -> chunk sums, dwords (c, r) for chunks 4f .. 4f + 3 */
GQK_INLINE __m512i gqk4_join(__m512i b0, __m512i b1) {
    return _mm512_add_epi32(_mm512_shuffle_i64x2(b0, b1, 0x88), _mm512_shuffle_i64x2(b0, b1, 0xdd));
}

/* row sums acc (xmm: 4 rows) plus the chunk products p0 (chunks 0..3) and p1 (4..7), in chunk order */
GQK_INLINE __m128 gqk4_add(__m128 acc, __m512 p0, __m512 p1) {
    acc = _mm_add_ps(acc, _mm512_castps512_ps128(p0));
    acc = _mm_add_ps(acc, _mm512_extractf32x4_ps(p0, 1));
    acc = _mm_add_ps(acc, _mm512_extractf32x4_ps(p0, 2));
    acc = _mm_add_ps(acc, _mm512_extractf32x4_ps(p0, 3));
    acc = _mm_add_ps(acc, _mm512_castps512_ps128(p1));
    acc = _mm_add_ps(acc, _mm512_extractf32x4_ps(p1, 1));
    acc = _mm_add_ps(acc, _mm512_extractf32x4_ps(p1, 2));
    return _mm_add_ps(acc, _mm512_extractf32x4_ps(p1, 3));
}

/* rows [r, r + 4), one token: y[0..3] */
GQK_INLINE void gqk4_gemv(int T, const cpumla_weight *w, const void *qx, float *y, int64_t r) {
    const int64_t K = w->cols, nsb = K / 256, bytes = gq_info(w->dtype)->bytes, rb = w->row_bytes;
    const uint8_t *row = (const uint8_t *)w->data + r * rb;
    const int8_t *xq = (const int8_t *)qx;
    const float *xdp = qx_d(qx, K);
    const int32_t *xsp = qx_s(qx, K);
    const int per32 = T == GQK_Q4 || T == GQK_Q5, off = T == GQK_Q6 ? 32 : T == GQK_Q3 ? 4 : 0;
    const __m512i lo4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i hi4 = _mm512_add_epi32(lo4, _mm512_set1_epi32(4));
    gqk_pf pf = gqk_pf_init(w, r, 4, bytes);
    __m128 acc = _mm_setzero_ps();
    for (int64_t j = 0; j < nsb; j++) {
        const uint8_t *b = row + j * bytes;
        gqk_pf_step(&pf);
        __m512i x[4], init[4], xh[4];
        for (int k = 0; k < 4; k++) {
            x[k] = _mm512_loadu_si512(xq + 256 * j + 64 * k);
            init[k] = _mm512_setzero_si512();
            if (off)
                init[k] = _mm512_sub_epi32(init[k], _mm512_dpbusd_epi32(init[k], _mm512_set1_epi8((char)off), x[k]));
            if (T == GQK_Q2) {               /* each half's activation sum, in every dword of its lane */
                __m512i e = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), x[k]);
                e = _mm512_add_epi32(e, _mm512_shuffle_epi32(e, 0x4e));
                xh[k] = _mm512_add_epi32(e, _mm512_shuffle_epi32(e, 0xb1));
            }
        }
        const __m512 xd8 = _mm512_castps256_ps512(_mm256_loadu_ps(xdp + 8 * j));
        const __m512 xd0 = _mm512_permutexvar_ps(lo4, xd8), xd1 = _mm512_permutexvar_ps(hi4, xd8);
        /* the 4 rows' lane sums, reduced together */
        __m512i a[4];
        {
            __m512i e[4][4];
            for (int i = 0; i < 4; i++) {
                __m512i q[4];
                gqk4_codes(T, b + i * rb, q);
                for (int k = 0; k < 4; k++) e[i][k] = _mm512_dpbusd_epi32(init[k], q[k], x[k]);
            }
            for (int k = 0; k < 4; k++) a[k] = gqk4_red(e[0][k], e[1][k], e[2][k], e[3][k]);
        }
        __m512i is0, is1, ms0 = _mm512_setzero_si512(), ms1 = ms0;
        __m512 d, dm = _mm512_setzero_ps();
        if (per32) {
            /* the 6-bit scales and mins of each row: bytes [s0..s7 | m0..m7] of its lane */
            const __m512i v = gqk4_ld16(b, rb, 0);
            const __m512i ia = _mm512_broadcast_i32x4(_mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
            const __m512i ib = _mm512_broadcast_i32x4(_mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11));
            const __m512i mk = _mm512_broadcast_i32x4(_mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
            const __m512i av = _mm512_shuffle_epi8(v, ia);
            const __m512i lo = _mm512_and_si512(_mm512_mask_blend_epi8(0xf000f000f000f000ull, av, _mm512_srli_epi16(av, 4)), mk);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(_mm512_shuffle_epi8(v, ib), 2), _mm512_set1_epi8(0x30));
            __m512i sm[4];
            gqk4_tr(_mm512_or_si512(lo, hi), 0, sm);
            is0 = _mm512_mullo_epi32(gqk4_join(a[0], a[1]), sm[0]);
            is1 = _mm512_mullo_epi32(gqk4_join(a[2], a[3]), sm[1]);
            const __m512i xs8 = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(xsp + 8 * j)));
            ms0 = _mm512_mullo_epi32(_mm512_permutexvar_epi32(lo4, xs8), sm[2]);
            ms1 = _mm512_mullo_epi32(_mm512_permutexvar_epi32(hi4, xs8), sm[3]);
            gqk4_d(v, 0, 1, &d, &dm);
        } else {
            __m512i s[4], m[4];
            __m512i dv;
            if (T == GQK_Q6) {
                gqk4_tr(gqk4_ld16(b, rb, 192), 1, s);
                dv = gqk4_ld16(b, rb, 194);      /* word 7: d */
                gqk4_d(dv, 7, 7, &d, NULL);
            } else if (T == GQK_Q3) {
                /* bytes 2..13 of each lane: the 12 scale bytes, word 7: d */
                dv = gqk4_ld16(b, rb, 94);
                const __m512i l = _mm512_shuffle_epi8(dv, _mm512_broadcast_i32x4(_mm_setr_epi8(2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5, 6, 7, 8, 9)));
                const __m512i lv = _mm512_and_si512(_mm512_mask_blend_epi8(0xff00ff00ff00ff00ull, l, _mm512_srli_epi16(l, 4)),
                                                    _mm512_set1_epi8(15));
                const __m512i h = _mm512_shuffle_epi8(dv, _mm512_broadcast_i32x4(_mm_setr_epi8(10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13)));
                const __m512i hv = _mm512_and_si512(_mm512_srlv_epi16(h, _mm512_broadcast_i32x4(_mm_setr_epi16(0, 0, 2, 2, 4, 4, 6, 6))),
                                                    _mm512_set1_epi8(3));
                gqk4_tr(_mm512_sub_epi8(_mm512_or_si512(lv, _mm512_slli_epi16(hv, 4)), _mm512_set1_epi8(32)), 1, s);
                gqk4_d(dv, 7, 7, &d, NULL);
            } else {                          /* Q2_K: scale / min nibbles; d, dmin: words 6, 7 */
                const __m512i v = gqk4_ld16(b, rb, 0);
                gqk4_tr(_mm512_and_si512(v, _mm512_set1_epi8(15)), 0, s);
                gqk4_tr(_mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)), 0, m);
                dv = gqk4_ld16(b, rb, 68);
                gqk4_d(dv, 6, 7, &d, &dm);
                ms0 = gqk4_join(_mm512_mullo_epi32(xh[0], m[0]), _mm512_mullo_epi32(xh[1], m[1]));
                ms1 = gqk4_join(_mm512_mullo_epi32(xh[2], m[2]), _mm512_mullo_epi32(xh[3], m[3]));
            }
            is0 = gqk4_join(_mm512_mullo_epi32(a[0], s[0]), _mm512_mullo_epi32(a[1], s[1]));
            is1 = gqk4_join(_mm512_mullo_epi32(a[2], s[2]), _mm512_mullo_epi32(a[3], s[3]));
        }
        __m512 p0 = _mm512_mul_ps(_mm512_cvtepi32_ps(is0), _mm512_mul_ps(d, xd0));
        __m512 p1 = _mm512_mul_ps(_mm512_cvtepi32_ps(is1), _mm512_mul_ps(d, xd1));
        if (per32 || T == GQK_Q2) {
            p0 = _mm512_sub_ps(p0, _mm512_mul_ps(_mm512_cvtepi32_ps(ms0), _mm512_mul_ps(dm, xd0)));
            p1 = _mm512_sub_ps(p1, _mm512_mul_ps(_mm512_cvtepi32_ps(ms1), _mm512_mul_ps(dm, xd1)));
        }
        acc = gqk4_add(acc, p0, p1);
    }
    _mm_storeu_ps(y, acc);
}
