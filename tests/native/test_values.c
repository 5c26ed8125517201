/* test_values.c: no speed or result that depends on the weights' values, and the dispatch rule.
 *   test_daz_ftz (one group of test_kernels.c's table, every implementation): the linear algebra on
 *     adversarial codes gives the same bits with MXCSR's DAZ/FTZ set as without.
 *   test_values (after the public API): cpumla_decode_operands for every level and format, every code
 *     normal or zero and value * 2^-k exactly; cpumla_isa_for_features over the x86 chain. */
#include <float.h>
#include "core/kernels.h"
#include "ref.h"

/* ---- no subnormal operand or result in the linear algebra --------------------------------------
 * With MXCSR's DAZ and FTZ set, a subnormal operand of any SSE/AVX instruction reads as zero and a
 * subnormal result is flushed: the results change exactly when a kernel meets a subnormal (where
 * Intel cores take a microcode assist). So every entry, on weights holding only e4m3's subnormal codes,
 * all non-NaN codes, or random FP4 codes, must give the same bits with and without DAZ/FTZ. (x86 only:
 * the flags are MXCSR's. vdpbf16ps always reads subnormals as zero, which is why avx512.c decodes
 * to normal bf16.) */
#if defined(__x86_64__)
#include <xmmintrin.h>

static void run_linear(const cpumla_kernels *k, const cpumla_weight *w, const float *x, float *out, int64_t per) {
    kern_gemv(k, &w[0], x, out, 0, w->rows);
    kern_gemm(k, &w[0], x, w->cols, 5, out + per, w->rows, 0, w->rows);
    kern_gemm(k, &w[0], x, w->cols, 2, out + 6 * per, w->rows, 0, w->rows);
    kern_gemv_t(k, &w[0], 0, w->rows, x, out + 8 * per, 0, w->cols);
    for (int64_t r = 0; r < w->rows; r++) kern_dequant(k, &w[0], r, 0, w->cols, out + 9 * per + r * w->cols);
}

void test_daz_ftz(const cpumla_kernels *k) {
    static const struct { int dt, sdt, brows, bcols; int64_t cols; const char *codes; } cs[] = {
        {CPUMLA_E4M3, CPUMLA_F32, 128, 128, 300, "subnormal"}, {CPUMLA_E4M3, CPUMLA_E8M0, 128, 128, 256, "subnormal"},
        {CPUMLA_E4M3, CPUMLA_F32, 128, 128, 300, "all"}, {CPUMLA_E2M1, CPUMLA_E8M0, 1, 32, 320, "all"},
    };
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        case_begin();
        const int64_t rows = 67, cols = cs[ci].cols;
        tweight t = make_weight(rows, cols, cs[ci].dt, cs[ci].sdt, cs[ci].brows, cs[ci].bcols, 0);
        for (int64_t r = 0; r < rows; r++) {
            uint8_t *row = (uint8_t *)t.data + r * t.w.row_bytes;
            for (int64_t c = 0; c < (cs[ci].dt == CPUMLA_E2M1 ? cols / 2 : cols); c++) {
                uint8_t v = (uint8_t)rng_u64();
                if (cs[ci].dt == CPUMLA_E4M3)
                    v = cs[ci].codes[0] == 's' ? (uint8_t)((v & 0x80) | (1 + v % 7)) : ((v & 0x7f) == 0x7f ? 0x7e : v);
                row[c] = v;
            }
        }
        float *x = make_vec(6 * cols + rows, 2.0f);
        const int64_t per = rows > cols ? rows * 8 : cols * 8, n = 9 * per + rows * cols;
        float *a = xalloc(sizeof(float) * (size_t)n), *b = xalloc(sizeof(float) * (size_t)n);
        memset(a, 0, sizeof(float) * (size_t)n);
        memset(b, 0, sizeof(float) * (size_t)n);
        run_linear(k, &t.w, x, a, per);
        const unsigned csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);                      /* FTZ | DAZ */
        run_linear(k, &t.w, x, b, per);
        _mm_setcsr(csr);
        int64_t bad = -1;
        for (int64_t i = 0; i < n && bad < 0; i++)
            if (bitsf(a[i]) != bitsf(b[i])) bad = i;
        check(bad < 0, "%s %s codes: a result changes under DAZ/FTZ (a subnormal reached an instruction) at "
              "output %lld: %g vs %g", dtype_name(cs[ci].dt), cs[ci].codes, (long long)bad, bad < 0 ? 0.0 : (double)a[bad],
              bad < 0 ? 0.0 : (double)b[bad]);
        free(a); free(b); free(x);
        free_weight(&t);
        case_end();
    }
}
#endif

/* ---- operands and the dispatch rule ---------------------------------------------------------- */
#if defined(__x86_64__)
static const char *chain[] = {"scalar", "avx2", "avxvnni", "avx512f", "avx512vnni", "avx512", "amx"};
#elif defined(__aarch64__)
static const char *chain[] = {"scalar", "neon"};
#else
static const char *chain[] = {"scalar"};
#endif
#define N_CHAIN ((int)(sizeof chain / sizeof chain[0]))

void test_values(void) {
    cur_isa = "values";
    int p0 = n_pass, f0 = n_fail;
#if defined(__x86_64__)
    {   /* the dispatch rule over feature bits: each level needs everything its chain needs; avxvnni
         * builds on avx2 beside avx512f, which is preferred to it */
        const uint64_t v2 = CPUMLA_FEAT_AVX | CPUMLA_FEAT_AVX2 | CPUMLA_FEAT_FMA | CPUMLA_FEAT_F16C | CPUMLA_FEAT_OS_AVX;
        const uint64_t f = v2 | CPUMLA_FEAT_AVX512F | CPUMLA_FEAT_AVX512BW | CPUMLA_FEAT_AVX512VL |
                           CPUMLA_FEAT_AVX512DQ | CPUMLA_FEAT_OS_AVX512;
        const uint64_t up = CPUMLA_FEAT_AVX512BF16 | CPUMLA_FEAT_AVX512VNNI | CPUMLA_FEAT_AVX512VBMI;
        const uint64_t amx = CPUMLA_FEAT_AMX_TILE | CPUMLA_FEAT_AMX_BF16 | CPUMLA_FEAT_AMX_INT8 | CPUMLA_FEAT_OS_AMX;
        const struct { uint64_t f; const char *want; } rule[] = {
            {0, "scalar"}, {v2, "avx2"}, {f & ~CPUMLA_FEAT_OS_AVX512, "avx2"}, {f & ~CPUMLA_FEAT_AVX512DQ, "avx2"},
            {v2 | CPUMLA_FEAT_AVXVNNI, "avxvnni"}, {(v2 & ~CPUMLA_FEAT_OS_AVX) | CPUMLA_FEAT_AVXVNNI, "scalar"},
            {(f & ~CPUMLA_FEAT_OS_AVX512) | CPUMLA_FEAT_AVXVNNI, "avxvnni"}, {f | CPUMLA_FEAT_AVXVNNI, "avx512f"},
            {f | up | CPUMLA_FEAT_AVXVNNI, "avx512"},
            {f, "avx512f"}, {f | CPUMLA_FEAT_AVX512VNNI | CPUMLA_FEAT_AVX512VBMI, "avx512vnni"},
            {f | CPUMLA_FEAT_AVX512BF16 | CPUMLA_FEAT_AVX512VNNI, "avx512vnni"}, {f | CPUMLA_FEAT_AVX512BF16, "avx512f"},
            {(f & ~CPUMLA_FEAT_OS_AVX512) | up, "avx2"}, {f | up, "avx512"},
            {f | up | (amx & ~CPUMLA_FEAT_OS_AMX), "avx512"}, {f | up | amx, "amx"},
        };
        for (size_t i = 0; i < sizeof rule / sizeof rule[0]; i++)
            check(!strcmp(cpumla_isa_for_features(rule[i].f), rule[i].want), "cpumla_isa_for_features(%#llx) = %s, want %s",
                  (unsigned long long)rule[i].f, cpumla_isa_for_features(rule[i].f), rule[i].want);
        check(cpumla_init("") == 0 && !strcmp(cpumla_isa_for_features(cpumla_cpu_features()), cpumla_isa()),
              "cpumla_isa_for_features(this CPU) is not what cpumla_init(\"\") picks");
    }
#endif
    {   /* the GEMV loops' weight operands: normal or zero for every code, value * 2^-k exactly */
        for (int i = 0; i < N_CHAIN; i++) {
            float op[256];
            const char *fmts[] = {"e4m3", "e2m1"};
            for (int f = 0; f < 2; f++) {
                char which[32];
                snprintf(which, sizeof which, "%s:%s", chain[i], fmts[f]);
                int k = cpumla_decode_operands(which, op);
                if (f) {      /* E2M1's products multiply integers (kernels.h): no operand to report */
                    check(k == -1, "%s: an FP4 decode probe (its products multiply integers)", which);
                    continue;
                }
                if (k < 0) {
                    check(!cpumla_isa_available(chain[i]), "no decode probe for %s", which);
                    continue;
                }
                for (int c = 0; c < (f ? 16 : 256); c++) {
                    float want = f ? cpumla_e2m1_lut[c] : e4m3_to_f32((uint8_t)c);
                    float got = ldexpf(op[c], k);
                    check(op[c] == 0.0f || isnan(op[c]) || fabsf(op[c]) >= FLT_MIN, "%s: code %#x operand %g is subnormal",
                          which, c, (double)op[c]);
                    check(isnan(want) || (got == want && signbit(got) == signbit(want)), "%s: code %#x decodes to %g, want %g",
                          which, c, (double)got, (double)want);
                }
            }
        }
    }
    printf("%-8s %-12s %4d passed %3d failed   (decode operands, dispatch rule)\n", cur_isa, "values", n_pass - p0,
           n_fail - f0);
}
