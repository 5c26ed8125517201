/* gguf_q.c: GGUF's block types (gguf_q.h): their table, the spec of their unpacking, their codebooks
 * (cpumla_gguf_tables), and which level has entries of its own for them: dispatch.c calls
 * cpumla_fill_gq after each fill of a level's chain, so a level without any keeps its parent's. */
#include <stdlib.h>
#include <string.h>
#include "core/dispatch.h"
#include "core/gguf_q.h"
#include "core/kernels.h"

const gq_type gq_types[GQ_N] = {
    [CPUMLA_Q8_0 - CPUMLA_Q8_0] = {"q8_0", 32, 34, 0},       [CPUMLA_Q4_0 - CPUMLA_Q8_0] = {"q4_0", 32, 18, 0},
    [CPUMLA_Q4_1 - CPUMLA_Q8_0] = {"q4_1", 32, 20, 1},       [CPUMLA_Q5_0 - CPUMLA_Q8_0] = {"q5_0", 32, 22, 0},
    [CPUMLA_Q5_1 - CPUMLA_Q8_0] = {"q5_1", 32, 24, 1},       [CPUMLA_Q2_K - CPUMLA_Q8_0] = {"q2_k", 256, 84, 1},
    [CPUMLA_Q3_K - CPUMLA_Q8_0] = {"q3_k", 256, 110, 0},     [CPUMLA_Q4_K - CPUMLA_Q8_0] = {"q4_k", 256, 144, 1},
    [CPUMLA_Q5_K - CPUMLA_Q8_0] = {"q5_k", 256, 176, 1},     [CPUMLA_Q6_K - CPUMLA_Q8_0] = {"q6_k", 256, 210, 0},
    [CPUMLA_IQ4_NL - CPUMLA_Q8_0] = {"iq4_nl", 32, 18, 0},   [CPUMLA_IQ4_XS - CPUMLA_Q8_0] = {"iq4_xs", 256, 136, 0},
    [CPUMLA_IQ2_XXS - CPUMLA_Q8_0] = {"iq2_xxs", 256, 66, 0}, [CPUMLA_IQ3_XXS - CPUMLA_Q8_0] = {"iq3_xxs", 256, 98, 0},
    [CPUMLA_IQ1_S - CPUMLA_Q8_0] = {"iq1_s", 256, 50, 0},    [CPUMLA_IQ1_M - CPUMLA_Q8_0] = {"iq1_m", 256, 56, 0},
    [CPUMLA_MXFP4 - CPUMLA_Q8_0] = {"mxfp4", 32, 17, 0},
};

uint64_t gq_iq2xxs_grid[256];
uint32_t gq_iq3xxs_grid[256];
uint64_t gq_iq1s_grid[2048];
uint8_t gq_ksigns[128];
int8_t gq_kvalues_iq4nl[16], gq_kvalues_mxfp4[16];
int32_t gq_iq2xxs_max, gq_iq3xxs_max, gq_mxfp4_max;

int cpumla_gguf_tables(const uint8_t *iq2xxs, const uint8_t *iq3xxs, const int8_t *iq1s, const uint8_t *ksigns,
                       const int8_t *iq4nl, const int8_t *mxfp4) {
    if (!iq2xxs || !iq3xxs || !iq1s || !ksigns || !iq4nl || !mxfp4) {
        cpumla_set_error("gguf tables: a table is NULL");
        return -1;
    }
    for (int i = 0; i < 256 * 8; i++)
        if (iq2xxs[i] > 127) { cpumla_set_error("gguf tables: an IQ2_XXS grid value is above 127"); return -1; }
    for (int i = 0; i < 256 * 4; i++)
        if (iq3xxs[i] > 127) { cpumla_set_error("gguf tables: an IQ3_XXS grid value is above 127"); return -1; }
    for (int i = 0; i < 2048 * 8; i++)
        if (iq1s[i] < -1 || iq1s[i] > 1) { cpumla_set_error("gguf tables: an IQ1_S grid value is not -1, 0 or 1"); return -1; }
    memcpy(gq_iq2xxs_grid, iq2xxs, sizeof gq_iq2xxs_grid);
    memcpy(gq_iq3xxs_grid, iq3xxs, sizeof gq_iq3xxs_grid);
    memcpy(gq_iq1s_grid, iq1s, sizeof gq_iq1s_grid);
    memcpy(gq_ksigns, ksigns, sizeof gq_ksigns);
    memcpy(gq_kvalues_iq4nl, iq4nl, sizeof gq_kvalues_iq4nl);
    memcpy(gq_kvalues_mxfp4, mxfp4, sizeof gq_kvalues_mxfp4);
    gq_iq2xxs_max = gq_iq3xxs_max = gq_mxfp4_max = 0;
    for (int i = 0; i < 256 * 8; i++) gq_iq2xxs_max = iq2xxs[i] > gq_iq2xxs_max ? iq2xxs[i] : gq_iq2xxs_max;
    for (int i = 0; i < 256 * 4; i++) gq_iq3xxs_max = iq3xxs[i] > gq_iq3xxs_max ? iq3xxs[i] : gq_iq3xxs_max;
    for (int i = 0; i < 16; i++) gq_mxfp4_max = abs(mxfp4[i]) > gq_mxfp4_max ? abs(mxfp4[i]) : gq_mxfp4_max;
    return 0;
}

/* ---- the unpacking spec: one block into chunks ci .. of u --------------------------------------- */
static inline float h16(const uint8_t *p) { return f16_to_f32((uint16_t)(p[0] | p[1] << 8)); }
static inline uint32_t le32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }
static inline uint16_t le16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

/* one 32-block's scalars: d, s = 1, and (with a min) m = 1, dm */
static inline void one_scale(gq_unpacked *u, int ci, float d, float dm) {
    u->d[ci] = d;
    u->dm[ci] = dm;
    u->s[2 * ci] = u->s[2 * ci + 1] = 1;
    u->m[2 * ci] = u->m[2 * ci + 1] = 1;
}
/* the nibbles of 16 bytes: low ones columns 0..15, high ones 16..31 */
static inline int nib(const uint8_t *qs, int i) { return i < 16 ? (qs[i] & 15) : (qs[i - 16] >> 4); }

static void unpack_q8_0(const uint8_t *b, gq_unpacked *u, int ci) {
    for (int i = 0; i < 32; i++) u->q[32 * ci + i] = (int8_t)b[2 + i];
    one_scale(u, ci, h16(b), 0.0f);
}
static void unpack_q4_0(const uint8_t *b, gq_unpacked *u, int ci) {
    for (int i = 0; i < 32; i++) u->q[32 * ci + i] = (int8_t)(nib(b + 2, i) - 8);
    one_scale(u, ci, h16(b), 0.0f);
}
static void unpack_q4_1(const uint8_t *b, gq_unpacked *u, int ci) {
    for (int i = 0; i < 32; i++) u->q[32 * ci + i] = (int8_t)nib(b + 4, i);
    one_scale(u, ci, h16(b), -h16(b + 2));
}
static void unpack_q5_0(const uint8_t *b, gq_unpacked *u, int ci) {
    const uint32_t qh = le32(b + 2);
    for (int i = 0; i < 32; i++) u->q[32 * ci + i] = (int8_t)((nib(b + 6, i) | (int)((qh >> i) & 1) << 4) - 16);
    one_scale(u, ci, h16(b), 0.0f);
}
static void unpack_q5_1(const uint8_t *b, gq_unpacked *u, int ci) {
    const uint32_t qh = le32(b + 4);
    for (int i = 0; i < 32; i++) u->q[32 * ci + i] = (int8_t)(nib(b + 8, i) | (int)((qh >> i) & 1) << 4);
    one_scale(u, ci, h16(b), -h16(b + 2));
}
static void unpack_iq4_nl(const uint8_t *b, gq_unpacked *u, int ci) {
    for (int i = 0; i < 32; i++) u->q[32 * ci + i] = gq_kvalues_iq4nl[nib(b + 2, i)];
    one_scale(u, ci, h16(b), 0.0f);
}
static void unpack_mxfp4(const uint8_t *b, gq_unpacked *u, int ci) {
    for (int i = 0; i < 32; i++) u->q[32 * ci + i] = gq_kvalues_mxfp4[nib(b + 1, i)];
    const uint32_t e = b[0], bits = e < 2 ? 0x00200000u << e : (e - 1) << 23;
    float d;
    memcpy(&d, &bits, 4);
    one_scale(u, ci, d, 0.0f);
}

/* the K types: 256 columns, 8 chunks; all chunks share d (and dm) */
static void k_scales(gq_unpacked *u, float d, float dm) {
    for (int c = 0; c < 8; c++) { u->d[c] = d; u->dm[c] = dm; }
}
static void unpack_q2_k(const uint8_t *b, gq_unpacked *u, int ci) {
    const uint8_t *sc = b, *qs = b + 16;
    for (int j = 0; j < 256; j++) u->q[j] = (int8_t)((qs[(j / 128) * 32 + j % 32] >> (2 * ((j % 128) / 32))) & 3);
    for (int t = 0; t < 16; t++) { u->s[t] = sc[t] & 15; u->m[t] = sc[t] >> 4; }
    k_scales(u, h16(b + 80), h16(b + 82));
}
static void unpack_q3_k(const uint8_t *b, gq_unpacked *u, int ci) {
    const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
    for (int j = 0; j < 256; j++) {
        const int lo = (qs[(j / 128) * 32 + j % 32] >> (2 * ((j % 128) / 32))) & 3;
        u->q[j] = (int8_t)(lo - (((hm[j % 32] >> (j / 32)) & 1) ? 0 : 4));
    }
    for (int t = 0; t < 16; t++) {
        const int l = t < 8 ? (sc[t] & 15) : (sc[t - 8] >> 4), h = (sc[8 + t % 4] >> (2 * (t / 4))) & 3;
        u->s[t] = (int16_t)((l | h << 4) - 32);
    }
    k_scales(u, h16(b + 108), 0.0f);
}
/* Q4_K / Q5_K: the 6-bit scale and min of each of the 8 chunks, from 12 bytes */
static void k_scale_min(const uint8_t *sc, gq_unpacked *u) {
    for (int c = 0; c < 8; c++) {
        int s, m;
        if (c < 4) { s = sc[c] & 63; m = sc[c + 4] & 63; }
        else { s = (sc[c + 4] & 15) | ((sc[c - 4] >> 2) & 0x30); m = (sc[c + 4] >> 4) | ((sc[c] >> 2) & 0x30); }
        u->s[2 * c] = u->s[2 * c + 1] = (int16_t)s;
        u->m[2 * c] = u->m[2 * c + 1] = (int16_t)m;
    }
}
static void unpack_q4_k(const uint8_t *b, gq_unpacked *u, int ci) {
    const uint8_t *qs = b + 16;
    for (int j = 0; j < 256; j++) u->q[j] = (int8_t)((qs[(j / 64) * 32 + j % 32] >> (4 * ((j % 64) / 32))) & 15);
    k_scale_min(b + 4, u);
    k_scales(u, h16(b), h16(b + 2));
}
static void unpack_q5_k(const uint8_t *b, gq_unpacked *u, int ci) {
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int j = 0; j < 256; j++)
        u->q[j] = (int8_t)(((qs[(j / 64) * 32 + j % 32] >> (4 * ((j % 64) / 32))) & 15) | ((qh[j % 32] >> (j / 32)) & 1) << 4);
    k_scale_min(b + 4, u);
    k_scales(u, h16(b), h16(b + 2));
}
static void unpack_q6_k(const uint8_t *b, gq_unpacked *u, int ci) {
    const uint8_t *ql = b, *qh = b + 128;
    for (int j = 0; j < 256; j++) {
        const int h = j / 128, lo = (ql[h * 64 + j % 64] >> (4 * ((j % 128) / 64))) & 15;
        const int hi = (qh[h * 32 + j % 32] >> (2 * ((j % 128) / 32))) & 3;
        u->q[j] = (int8_t)((lo | hi << 4) - 32);
    }
    for (int t = 0; t < 16; t++) u->s[t] = (int8_t)b[192 + t];
    k_scales(u, h16(b + 208), 0.0f);
}
static void unpack_iq4_xs(const uint8_t *b, gq_unpacked *u, int ci) {
    const uint16_t sh = le16(b + 2);
    const uint8_t *sl = b + 4, *qs = b + 8;
    for (int c = 0; c < 8; c++) {
        for (int i = 0; i < 32; i++) u->q[32 * c + i] = gq_kvalues_iq4nl[nib(qs + 16 * c, i)];
        const int ls = ((sl[c / 2] >> (4 * (c % 2))) & 15) | ((sh >> (2 * c)) & 3) << 4;
        u->s[2 * c] = u->s[2 * c + 1] = (int16_t)(ls - 32);
    }
    k_scales(u, h16(b), 0.0f);
}
/* 8 grid bytes g (a word), signed by the bits of sign byte sg */
static inline void signed8(int8_t *q, uint64_t g, uint8_t sg) {
    for (int j = 0; j < 8; j++) {
        const int v = (int)((g >> (8 * j)) & 255);
        q[j] = (int8_t)((sg >> j) & 1 ? -v : v);
    }
}
static void unpack_iq2_xxs(const uint8_t *b, gq_unpacked *u, int ci) {
    for (int c = 0; c < 8; c++) {
        const uint32_t a0 = le32(b + 2 + 8 * c), a1 = le32(b + 6 + 8 * c);
        for (int l = 0; l < 4; l++)
            signed8(u->q + 32 * c + 8 * l, gq_iq2xxs_grid[(a0 >> (8 * l)) & 255], gq_ksigns[(a1 >> (7 * l)) & 127]);
        u->s[2 * c] = u->s[2 * c + 1] = (int16_t)(2 * (a1 >> 28) + 1);
    }
    k_scales(u, h16(b) * 0.125f, 0.0f);
}
static void unpack_iq3_xxs(const uint8_t *b, gq_unpacked *u, int ci) {
    const uint8_t *qs = b + 2;
    for (int c = 0; c < 8; c++) {
        const uint32_t a = le32(b + 66 + 4 * c);
        for (int l = 0; l < 4; l++) {
            const uint64_t g = (uint64_t)gq_iq3xxs_grid[qs[8 * c + 2 * l]] | (uint64_t)gq_iq3xxs_grid[qs[8 * c + 2 * l + 1]] << 32;
            signed8(u->q + 32 * c + 8 * l, g, gq_ksigns[(a >> (7 * l)) & 127]);
        }
        u->s[2 * c] = u->s[2 * c + 1] = (int16_t)(2 * (a >> 28) + 1);
    }
    k_scales(u, h16(b) * 0.25f, 0.0f);
}
/* 8 grid values g in {-1, 0, 1} (int8 in a word) as 8 g + sign */
static inline void delta8(int8_t *q, uint64_t g, int sign) {
    for (int j = 0; j < 8; j++) q[j] = (int8_t)(8 * (int8_t)((g >> (8 * j)) & 255) + sign);
}
static void unpack_iq1_s(const uint8_t *b, gq_unpacked *u, int ci) {
    const uint8_t *qs = b + 2;
    for (int c = 0; c < 8; c++) {
        const uint16_t qh = le16(b + 34 + 2 * c);
        for (int l = 0; l < 4; l++)
            delta8(u->q + 32 * c + 8 * l, gq_iq1s_grid[qs[4 * c + l] | ((qh >> (3 * l)) & 7) << 8], qh & 0x8000 ? -1 : 1);
        u->s[2 * c] = u->s[2 * c + 1] = (int16_t)(2 * ((qh >> 12) & 7) + 1);
    }
    k_scales(u, h16(b) * 0.125f, 0.0f);
}
static void unpack_iq1_m(const uint8_t *b, gq_unpacked *u, int ci) {
    const uint8_t *qs = b, *qh = b + 32;
    uint16_t sc[4];
    for (int i = 0; i < 4; i++) sc[i] = le16(b + 48 + 2 * i);
    const uint16_t dbits = (uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0xf0) | ((sc[2] >> 4) & 0xf00) | (sc[3] & 0xf000));
    for (int g = 0; g < 32; g++) {
        const int n = (qh[g / 2] >> (4 * (g % 2))) & 15;
        delta8(u->q + 8 * g, gq_iq1s_grid[qs[g] | (n & 7) << 8], n & 8 ? -1 : 1);
    }
    for (int t = 0; t < 16; t++) u->s[t] = (int16_t)(2 * ((sc[t / 4] >> (3 * (t % 4))) & 7) + 1);
    k_scales(u, f16_to_f32(dbits) * 0.125f, 0.0f);
}

typedef void (*unpack_fn)(const uint8_t *b, gq_unpacked *u, int ci);
static const unpack_fn unpackers[GQ_N] = {
    [CPUMLA_Q8_0 - CPUMLA_Q8_0] = unpack_q8_0,       [CPUMLA_Q4_0 - CPUMLA_Q8_0] = unpack_q4_0,
    [CPUMLA_Q4_1 - CPUMLA_Q8_0] = unpack_q4_1,       [CPUMLA_Q5_0 - CPUMLA_Q8_0] = unpack_q5_0,
    [CPUMLA_Q5_1 - CPUMLA_Q8_0] = unpack_q5_1,       [CPUMLA_Q2_K - CPUMLA_Q8_0] = unpack_q2_k,
    [CPUMLA_Q3_K - CPUMLA_Q8_0] = unpack_q3_k,       [CPUMLA_Q4_K - CPUMLA_Q8_0] = unpack_q4_k,
    [CPUMLA_Q5_K - CPUMLA_Q8_0] = unpack_q5_k,       [CPUMLA_Q6_K - CPUMLA_Q8_0] = unpack_q6_k,
    [CPUMLA_IQ4_NL - CPUMLA_Q8_0] = unpack_iq4_nl,   [CPUMLA_IQ4_XS - CPUMLA_Q8_0] = unpack_iq4_xs,
    [CPUMLA_IQ2_XXS - CPUMLA_Q8_0] = unpack_iq2_xxs, [CPUMLA_IQ3_XXS - CPUMLA_Q8_0] = unpack_iq3_xxs,
    [CPUMLA_IQ1_S - CPUMLA_Q8_0] = unpack_iq1_s,     [CPUMLA_IQ1_M - CPUMLA_Q8_0] = unpack_iq1_m,
    [CPUMLA_MXFP4 - CPUMLA_Q8_0] = unpack_mxfp4,
};

void gq_unpack(int32_t dtype, const uint8_t *row, int64_t c0, int n, gq_unpacked *u) {
    const gq_type *t = gq_info(dtype);
    const unpack_fn f = unpackers[dtype - CPUMLA_Q8_0];
    if (t->block == 256) { f(row + (c0 / 256) * t->bytes, u, 0); return; }
    for (int i = 0; i < n; i++) f(row + (c0 / 32 + i) * t->bytes, u, i);
}

float gq_value(const cpumla_weight *w, int64_t r, int64_t c) {
    const gq_type *t = gq_info(w->dtype);
    gq_unpacked u;
    const int64_t c0 = c / t->block * t->block;
    gq_unpack(w->dtype, (const uint8_t *)w->data + r * w->row_bytes, c0, 1, &u);
    const int j = (int)(c - c0), ch = j / 32;
    const float v = (u.d[ch] * (float)u.s[j / 16]) * (float)u.q[j];
    return t->has_min ? v - u.dm[ch] * (float)u.m[j / 16] : v;
}

void cpumla_fill_gq(cpumla_kernels *k, const char *level) {
    if (!strcmp(level, "scalar")) cpumla_fill_scalar_gq(k);
#if defined(__x86_64__) || defined(_M_X64)
    else if (!strcmp(level, "avx2")) {
        cpumla_fill_avx2_gq(k);
        cpumla_fill_avx2_gqk(k);
        cpumla_fill_avx2_gqi(k);
        cpumla_fill_avx2_gqp(k);
    }
    else if (!strcmp(level, "avx512vnni")) {
        cpumla_fill_avx512vnni_gq(k);
        cpumla_fill_avx512vnni_gqk(k);
        cpumla_fill_avx512vnni_gqi(k);
        cpumla_fill_avx512vnni_gqp(k);
    }
    else if (!strcmp(level, "amx")) cpumla_fill_amx_gq(k);
#elif defined(__aarch64__)
    else if (!strcmp(level, "neon")) cpumla_fill_neon_gq(k);
#endif
}
