/* dispatch.c: detect what the CPU and OS can run, pick a level, fill the kernel table.
 * Compiled at baseline flags: nothing here may use an instruction the oldest target lacks. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "core/common.h"
#include "core/dispatch.h"
#include "core/gguf_q.h"
#include "core/kernels.h"
#include "core/threadpool.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#elif defined(__aarch64__)
#include <sys/auxv.h>
#endif

cpumla_kernels cpumla_k;
static char chosen[16] = "";
static __thread char last_error[640];    /* per thread: one thread's error never hides another's */
static uint64_t features;
static int features_known;
static char cpu_name[128] = "";
static int amd_family;                   /* x86: the family of an AMD CPU (0x19: Zen 3 / Zen 4), else 0 */
static int intel_cpu;                    /* x86: GenuineIntel */
int cpumla_pf_l2, cpumla_pf_l2_plain;
static int pf_forced = -1;               /* cpumla_set_gemv_prefetch: 0 / 1 / 2, or -1: the CPU's own */

void cpumla_set_error(const char *msg) {
    snprintf(last_error, sizeof last_error, "%s", msg);
}
const char *cpumla_last_error(void) { return last_error; }

/* ---- feature detection ------------------------------------------------------------------------ */
#if defined(__x86_64__)
static uint64_t xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ __volatile__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

static uint64_t detect(void) {
    uint32_t a, b, c, d, max_leaf = __get_cpuid_max(0, 0);
    uint64_t f = 0;
    if (max_leaf < 1) return 0;
    char vendor[13];
    __cpuid(0, a, b, c, d);
    memcpy(vendor, &b, 4); memcpy(vendor + 4, &d, 4); memcpy(vendor + 8, &c, 4);
    vendor[12] = 0;
    __cpuid_count(1, 0, a, b, c, d);
    intel_cpu = !strcmp(vendor, "GenuineIntel");
    if (!strcmp(vendor, "AuthenticAMD"))
        amd_family = (int)((a >> 8) & 0xf) + (((a >> 8) & 0xf) == 0xf ? (int)((a >> 20) & 0xff) : 0);
    int osxsave = (c >> 27) & 1;
    if ((c >> 20) & 1) f |= CPUMLA_FEAT_SSE42;
    if ((c >> 28) & 1) f |= CPUMLA_FEAT_AVX;
    if ((c >> 12) & 1) f |= CPUMLA_FEAT_FMA;
    if ((c >> 29) & 1) f |= CPUMLA_FEAT_F16C;
    uint64_t xcr0 = osxsave ? xgetbv0() : 0;
    if ((xcr0 & 0x6) == 0x6) f |= CPUMLA_FEAT_OS_AVX;
    if ((xcr0 & 0xe6) == 0xe6) f |= CPUMLA_FEAT_OS_AVX512;
    if (max_leaf >= 7) {
        __cpuid_count(7, 0, a, b, c, d);
        uint32_t sub_max = a;
        if ((b >> 5) & 1) f |= CPUMLA_FEAT_AVX2;
        if ((b >> 16) & 1) f |= CPUMLA_FEAT_AVX512F;
        if ((b >> 17) & 1) f |= CPUMLA_FEAT_AVX512DQ;
        if ((b >> 30) & 1) f |= CPUMLA_FEAT_AVX512BW;
        if ((b >> 31) & 1) f |= CPUMLA_FEAT_AVX512VL;
        if ((c >> 11) & 1) f |= CPUMLA_FEAT_AVX512VNNI;
        if ((c >> 1) & 1) f |= CPUMLA_FEAT_AVX512VBMI;
        if ((d >> 24) & 1) f |= CPUMLA_FEAT_AMX_TILE;
        if ((d >> 22) & 1) f |= CPUMLA_FEAT_AMX_BF16;
        if ((d >> 25) & 1) f |= CPUMLA_FEAT_AMX_INT8;
        if (sub_max >= 1) {
            __cpuid_count(7, 1, a, b, c, d);
            if ((a >> 4) & 1) f |= CPUMLA_FEAT_AVXVNNI;
            if ((a >> 5) & 1) f |= CPUMLA_FEAT_AVX512BF16;
        }
    }
    /* AMX: the OS must enable tile state in XCR0 (bits 17, 18) and grant this process permission. */
    if ((f & CPUMLA_FEAT_AMX_TILE) && (xcr0 & 0x60000) == 0x60000) {
        const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0) f |= CPUMLA_FEAT_OS_AMX;
    }
    if (__get_cpuid_max(0x80000000, 0) >= 0x80000004) {
        uint32_t *p = (uint32_t *)cpu_name;
        for (uint32_t leaf = 0; leaf < 3; leaf++)
            __cpuid(0x80000002 + leaf, p[leaf * 4], p[leaf * 4 + 1], p[leaf * 4 + 2], p[leaf * 4 + 3]);
        cpu_name[48] = 0;
    }
    return f;
}
#elif defined(__aarch64__)
static uint64_t detect(void) {
    unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    uint64_t f = 0;
    if (hw & (1UL << 1)) f |= CPUMLA_FEAT_NEON;           /* HWCAP_ASIMD */
    if (hw & (1UL << 10)) f |= CPUMLA_FEAT_NEON_FP16;     /* HWCAP_ASIMDHP */
    if (hw & (1UL << 20)) f |= CPUMLA_FEAT_NEON_DOTPROD;  /* HWCAP_ASIMDDP */
    if (hw & (1UL << 22)) f |= CPUMLA_FEAT_SVE;           /* HWCAP_SVE */
    if (hw2 & (1UL << 14)) f |= CPUMLA_FEAT_NEON_BF16;    /* HWCAP2_BF16 */
    if (hw2 & (1UL << 13)) f |= CPUMLA_FEAT_NEON_I8MM;    /* HWCAP2_I8MM */
    FILE *fp = fopen("/proc/cpuinfo", "r");
    if (fp) {
        char line[256];
        while (fgets(line, sizeof line, fp)) {
            if (!strncmp(line, "CPU part", 8) || !strncmp(line, "model name", 10)) {
                char *v = strchr(line, ':');
                if (v) {
                    v += 1 + (v[1] == ' ');
                    v[strcspn(v, "\n")] = 0;
                    snprintf(cpu_name, sizeof cpu_name, "arm64 (%s)", v);
                }
                break;
            }
        }
        fclose(fp);
    }
    if (!cpu_name[0]) snprintf(cpu_name, sizeof cpu_name, "arm64");
    return f;
}
#else
static uint64_t detect(void) { return 0; }
#endif

uint64_t cpumla_cpu_features(void) {
    if (!features_known) {
        features = detect();
        features_known = 1;
    }
    return features;
}

const char *cpumla_cpu_name(void) {
    cpumla_cpu_features();
    return cpu_name[0] ? cpu_name : "unknown";
}

/* ---- the GEMV stream prefetch (common.h cpumla_pf_l2, cpumla_pf_l2_plain) ----------------------
 * The target follows the CPU: Intel takes the two-level target (prefetcht1 far, a second prefetcht0
 * near: common.h GEMV_PF_NEAR, GEMV_PF_FAR_2L) on every stream, since an L1 hint alone starves the
 * stream there. AMD family 19h (Zen 4; Zen 3, the same family, has no AVX-512 and never runs those
 * loops) prefetches the AVX-512 loops that do the most work per byte (cpumla_pf_l2) into L2, the
 * lighter ones (cpumla_pf_l2_plain) into L1. Other CPUs: L1 with the non-temporal hint (common.h
 * GEMV_PF_HINT). A target set by cpumla_set_gemv_prefetch comes first and applies to every stream. */
static const char *const pf_names[] = {"l1", "l2", "l2+l1"};

static void pf_targets(void) {
    cpumla_cpu_features();
    if (pf_forced >= 0) cpumla_pf_l2 = cpumla_pf_l2_plain = pf_forced;
    else if (intel_cpu) cpumla_pf_l2 = cpumla_pf_l2_plain = 2;
    else { cpumla_pf_l2 = amd_family == 0x19; cpumla_pf_l2_plain = 0; }
}

int cpumla_set_gemv_prefetch(const char *where) {
    int v;
    if (!where || !where[0] || !strcmp(where, "auto")) v = -1;
    else if (!strcmp(where, "l1")) v = 0;
    else if (!strcmp(where, "l2")) v = 1;
    else if (!strcmp(where, "l2+l1")) v = 2;
    else {
        char msg[160];
        snprintf(msg, sizeof msg, "unknown GEMV prefetch '%.40s' (l1, l2, l2+l1 or auto)", where);
        cpumla_set_error(msg);
        return -1;
    }
    cpumla_enter(NULL);
    pf_forced = v;
    pf_targets();
    return cpumla_leave(0);
}

const char *cpumla_gemv_prefetch(void) {
    cpumla_ensure_init();
    static char buf[64];
    if (pf_forced >= 0) snprintf(buf, sizeof buf, "%s (set)", pf_names[cpumla_pf_l2]);
    else if (intel_cpu) snprintf(buf, sizeof buf, "l2+l1 (Intel)");
    else if (amd_family == 0x19) snprintf(buf, sizeof buf, "l2 (AMD family 19h; l1 for the plain-weight GEMVs)");
    else if (amd_family) snprintf(buf, sizeof buf, "%s (AMD family %xh)", pf_names[cpumla_pf_l2], amd_family);
    else snprintf(buf, sizeof buf, "%s", pf_names[cpumla_pf_l2]);
    return buf;
}

/* ---- levels: what each needs, the level it builds on, its fill ----------------------------------
 * Levels form a tree (a level's table is its parent's with its own entries over it), listed from the
 * least to the most preferred: the dispatcher picks the last one the CPU runs. avxvnni (AVX2 with
 * AVX-VNNI's ymm vpdpbusd: Alder Lake and later clients, Sierra Forest) and avx512vnni (avx512f with
 * AVX512_VNNI: Ice Lake, Cascade and Cooper Lake) replace their parent's integer products only.
 * avx512f builds on avx2, not on avxvnni, because Ice Lake and Zen 4 have AVX-512 without AVX-VNNI (a
 * CPU with both has AVX512_VNNI too, and avx512vnni uses it at twice the width).
 * Adding a level is one line here (and its NEED_ mask), its fill and flags in kernels.h, its files
 * and their FLAGS lines. Levels of the other architecture stay listed, unbuilt (fill NULL), so that
 * CPUMLA_ISA names them with the right error. */
typedef struct {
    const char *name;
    int parent;                               /* index of the level it builds on; -1: none */
    uint64_t needs;                           /* its own features and every ancestor's */
    void (*fill)(cpumla_kernels *);           /* its entries over its parent's; NULL: not built here */
    const char *flags;                        /* its files' compiler flags, for cpumla_build_info */
    int (*decode)(int dtype, float *out);     /* cpumla_decode_operands; NULL: none */
} isa_t;

#define NEED_AVX2 (CPUMLA_FEAT_AVX | CPUMLA_FEAT_AVX2 | CPUMLA_FEAT_FMA | CPUMLA_FEAT_F16C | CPUMLA_FEAT_OS_AVX)
#define NEED_AVXVNNI (NEED_AVX2 | CPUMLA_FEAT_AVXVNNI)
#define NEED_AVX512F (NEED_AVX2 | CPUMLA_FEAT_AVX512F | CPUMLA_FEAT_AVX512BW | CPUMLA_FEAT_AVX512VL | \
                      CPUMLA_FEAT_AVX512DQ | CPUMLA_FEAT_OS_AVX512)
#define NEED_AVX512VNNI (NEED_AVX512F | CPUMLA_FEAT_AVX512VNNI)
#define NEED_AVX512 (NEED_AVX512VNNI | CPUMLA_FEAT_AVX512BF16 | CPUMLA_FEAT_AVX512VBMI)
#define NEED_AMX (NEED_AVX512 | CPUMLA_FEAT_AMX_TILE | CPUMLA_FEAT_AMX_BF16 | CPUMLA_FEAT_AMX_INT8 | CPUMLA_FEAT_OS_AMX)

/* a level's fill, flags and decode where its architecture is this one's, else none */
#if defined(__x86_64__)
#define X86(fill, flags, decode) fill, flags, decode
#else
#define X86(fill, flags, decode) NULL, NULL, NULL
#endif
#if defined(__aarch64__)
#define ARM(fill, flags, decode) fill, flags, decode
#else
#define ARM(fill, flags, decode) NULL, NULL, NULL
#endif

static const isa_t isas[] = {
    {"scalar", -1, 0, cpumla_fill_scalar, cpumla_flags_scalar, cpumla_decode_operands_scalar},
    {"avx2", 0, NEED_AVX2, X86(cpumla_fill_avx2, cpumla_flags_avx2, cpumla_decode_operands_avx2)},
    {"avxvnni", 1, NEED_AVXVNNI, X86(cpumla_fill_avxvnni, cpumla_flags_avxvnni, cpumla_decode_operands_avx2)},
    {"avx512f", 1, NEED_AVX512F, X86(cpumla_fill_avx512f, cpumla_flags_avx512f, cpumla_decode_operands_avx512f)},
    {"avx512vnni", 3, NEED_AVX512VNNI,
     X86(cpumla_fill_avx512vnni, cpumla_flags_avx512vnni, cpumla_decode_operands_avx512f)},
    {"avx512", 4, NEED_AVX512, X86(cpumla_fill_avx512, cpumla_flags_avx512, cpumla_decode_operands_avx512)},
    {"amx", 5, NEED_AMX, X86(cpumla_fill_amx, cpumla_flags_amx, cpumla_decode_operands_avx512)},
    {"neon", 0, CPUMLA_FEAT_NEON, ARM(cpumla_fill_neon, cpumla_flags_neon, cpumla_decode_operands_neon)},
};
#define N_ISAS ((int)(sizeof isas / sizeof isas[0]))

static int built(int i) { return isas[i].fill != NULL; }

/* a level built for this architecture, by name; -1: none */
static int isa_index(const char *name) {
    for (int i = 0; i < N_ISAS; i++)
        if (built(i) && !strcmp(isas[i].name, name)) return i;
    return -1;
}

/* level i's chain from the root: n indices into chain[], returns n */
static int chain_of(int i, int chain[N_ISAS]) {
    int n = 0;
    for (int j = i; j >= 0; j = isas[j].parent) n++;
    for (int j = i, at = n; j >= 0; j = isas[j].parent) chain[--at] = j;
    return n;
}

static int runnable_with(int i, uint64_t f) { return built(i) && (f & isas[i].needs) == isas[i].needs; }
static int runnable(int i) { return runnable_with(i, cpumla_cpu_features()); }

/* the most preferred level whose needs (its ancestors' included) the features meet */
static int best_for(uint64_t f) {
    int best = 0;
    for (int i = 0; i < N_ISAS; i++)
        if (runnable_with(i, f)) best = i;
    return best;
}

const char *cpumla_isa_for_features(uint64_t features) { return isas[best_for(features)].name; }

/* the levels this machine runs, space-separated */
static const char *runnable_list(void) {
    static __thread char buf[128];
    buf[0] = 0;
    for (int i = 0; i < N_ISAS; i++)
        if (runnable(i)) {
            if (buf[0]) strcat(buf, " ");
            strcat(buf, isas[i].name);
        }
    return buf;
}

int cpumla_isa_available(const char *isa) {
    int i = isa ? isa_index(isa) : -1;
    return i >= 0 && runnable(i);
}

const char *cpumla_isa_list(void) {
    static char buf[128];
    buf[0] = 0;
    for (int i = 0; i < N_ISAS; i++) {
        if (!built(i)) continue;
        if (buf[0]) strcat(buf, " ");
        strcat(buf, isas[i].name);
    }
    return buf;
}

/* Feature bits by the names Intel and Arm document them under; OS-state bits said in words. */
static const struct { uint64_t bit; const char *name; } feature_names[] = {
    {CPUMLA_FEAT_SSE42, "SSE4_2"}, {CPUMLA_FEAT_AVX, "AVX"}, {CPUMLA_FEAT_AVX2, "AVX2"}, {CPUMLA_FEAT_FMA, "FMA"},
    {CPUMLA_FEAT_F16C, "F16C"}, {CPUMLA_FEAT_AVX512F, "AVX512F"}, {CPUMLA_FEAT_AVX512BW, "AVX512BW"},
    {CPUMLA_FEAT_AVX512VL, "AVX512VL"}, {CPUMLA_FEAT_AVX512DQ, "AVX512DQ"},
    {CPUMLA_FEAT_AVX512BF16, "AVX512_BF16"}, {CPUMLA_FEAT_AVX512VNNI, "AVX512_VNNI"},
    {CPUMLA_FEAT_AVX512VBMI, "AVX512_VBMI"}, {CPUMLA_FEAT_AVXVNNI, "AVX_VNNI"}, {CPUMLA_FEAT_AMX_TILE, "AMX_TILE"},
    {CPUMLA_FEAT_AMX_BF16, "AMX_BF16"}, {CPUMLA_FEAT_AMX_INT8, "AMX_INT8"},
    {CPUMLA_FEAT_OS_AVX, "OS support for AVX state"}, {CPUMLA_FEAT_OS_AVX512, "OS support for AVX-512 state"},
    {CPUMLA_FEAT_OS_AMX, "OS support for AMX tile state (XCR0 and arch_prctl permission)"},
    {CPUMLA_FEAT_NEON, "ASIMD (NEON)"},
};

const char *cpumla_isa_missing(const char *isa) {
    static __thread char buf[512];
    int i = isa ? isa_index(isa) : -1;
    if (i < 0) return NULL;
    const uint64_t lack = isas[i].needs & ~cpumla_cpu_features();     /* its needs hold its chain's */
    buf[0] = 0;
    size_t n = 0;
    for (size_t f = 0; f < sizeof feature_names / sizeof feature_names[0]; f++) {
        if (!(lack & feature_names[f].bit)) continue;
        n += (size_t)snprintf(buf + n, n < sizeof buf ? sizeof buf - n : 0, "%s%s", n ? ", " : "", feature_names[f].name);
        if (n >= sizeof buf) break;
    }
    return buf;
}

/* a level of either architecture, built here or not */
static int is_known_isa(const char *name) {
    for (int i = 0; i < N_ISAS; i++)
        if (!strcmp(isas[i].name, name)) return 1;
    return 0;
}

/* level i's table: every fill of its chain, from the root */
static void fill_level(cpumla_kernels *k, int i) {
    int chain[N_ISAS];
    const int n = chain_of(i, chain);
    memset(k, 0, sizeof *k);
    for (int j = 0; j < n; j++) {
        isas[chain[j]].fill(k);
        cpumla_fill_gq(k, isas[chain[j]].name);   /* gguf_q.c: the GGUF block formats' entries */
    }
}

int cpumla_fill_level(cpumla_kernels *k, const char *isa) {
    const int i = isa ? isa_index(isa) : -1;
    if (i < 0) return -1;
    fill_level(k, i);
    return 0;
}

static int init(const char *isa) {
    int target;
    if (!isa || !isa[0] || !strcmp(isa, "auto")) {
        target = best_for(cpumla_cpu_features());
    } else {
        target = isa_index(isa);
        if (target < 0) {
            char msg[256];
            if (is_known_isa(isa))
                snprintf(msg, sizeof msg, "implementation '%s' is not built for this architecture (this machine runs: %s)",
                         isa, runnable_list());
            else
                snprintf(msg, sizeof msg, "unknown implementation '%.40s' (this machine runs: %s)", isa, runnable_list());
            cpumla_set_error(msg);
            return -1;
        }
        if (!runnable(target)) {   /* needs are cumulative: the whole chain up to the target runs */
            char msg[640];
            snprintf(msg, sizeof msg, "this CPU or OS cannot run the '%s' implementation (this machine runs: %s; missing: %s)",
                     isa, runnable_list(), cpumla_isa_missing(isa));
            cpumla_set_error(msg);
            return -1;
        }
    }
    cpumla_kernels k;
    fill_level(&k, target);
    cpumla_k = k;
    pf_targets();
    snprintf(chosen, sizeof chosen, "%s", isas[target].name);
    cpumla_pool_threads();
    return 0;
}

/* under the library lock: never while another thread's call uses the table or the pool */
int cpumla_init(const char *isa) {
    cpumla_enter(NULL);
    return cpumla_leave(init(isa));
}

void cpumla_ensure_init(void) {
    if (!chosen[0]) cpumla_init(NULL);
}

const char *cpumla_isa(void) {
    cpumla_ensure_init();
    return chosen;
}

/* Public kernel names and the table entry that does their work ("portable": code in ops.c, moe.c). */
static const struct { const char *name; int id; } kernel_names[] = {
    {"gemv", K_GEMV}, {"gemm", K_GEMM}, {"head_gemv", K_GEMM}, {"head_gemv_t", K_GEMV_T},
    {"dequant", K_DEQUANT}, {"rmsnorm", K_RMSNORM}, {"swiglu", K_SWIGLU}, {"softmax", K_SOFTMAX},
    {"mla_attention", K_ATTN}, {"mla_mha", K_SOFTMAX_BLOCK}, {"cache_store", K_CACHE_ROW}, {"read_probe", K_READ},
    {"fma_probe", K_FMA}, {"bf16_probe", K_DOT}, {"moe", -1},
    {"rope", -1}, {"topk", -1}, {"route", -1},
};

const char *cpumla_kernel_names(void) {
    static char buf[256];
    buf[0] = 0;
    for (size_t i = 0; i < sizeof kernel_names / sizeof kernel_names[0]; i++) {
        if (i) strcat(buf, " ");
        strcat(buf, kernel_names[i].name);
    }
    return buf;
}

static const char *fmt_names[CPUMLA_Q8 + 2] = {"f32", "bf16", "f16", "e4m3", "e2m1", [CPUMLA_Q8] = "q8", "q4"};
static const char *fmt_name(int f) { return f < CPUMLA_Q8_0 ? fmt_names[f] : gq_info(f)->name; }

/* "name" -> who[entry]; "name:fmt" -> who_fmt[entry][fmt] for the linear-algebra kernels */
const char *cpumla_kernel_impl(const char *kernel) {
    if (!kernel) return NULL;
    cpumla_ensure_init();
    const char *colon = strchr(kernel, ':');
    size_t len = colon ? (size_t)(colon - kernel) : strlen(kernel);
    for (size_t i = 0; i < sizeof kernel_names / sizeof kernel_names[0]; i++) {
        if (strlen(kernel_names[i].name) != len || strncmp(kernel_names[i].name, kernel, len)) continue;
        int id = kernel_names[i].id;
        if (!colon) return id < 0 ? "portable" : cpumla_k.who[id];
        if (id < K_GEMV || id > K_DEQUANT) return NULL;
        for (int f = 0; f < CPUMLA_DTYPE_COUNT; f++)
            if (fmt_name(f) && !strcmp(colon + 1, fmt_name(f))) return cpumla_k.who_fmt[id][f];
        return NULL;
    }
    return NULL;
}

const char *cpumla_build_info(void) {
    static char buf[2048];
    int n = snprintf(buf, sizeof buf, "compiler: %s", __VERSION__);
    for (int i = 0; i < N_ISAS && n < (int)sizeof buf; i++)
        if (built(i)) n += snprintf(buf + n, sizeof buf - n, "\n%s: %s", isas[i].name, isas[i].flags);
    return buf;
}

const char *cpumla_version(void) { return CPUMLA_VERSION; }

int cpumla_decode_operands(const char *which, float *out) {
    const char *colon = which ? strchr(which, ':') : NULL;
    if (!colon || !out) return -1;
    int dt = !strcmp(colon + 1, "e4m3") ? CPUMLA_E4M3 : -1;     /* E2M1's products multiply integers */
    for (int i = 0; i < N_ISAS && dt >= 0; i++)
        if (strlen(isas[i].name) == (size_t)(colon - which) && !strncmp(isas[i].name, which, (size_t)(colon - which)))
            return runnable(i) && isas[i].decode ? isas[i].decode(dt, out) : -1;
    return -1;
}

int cpumla_set_threads(int n) {
    cpumla_enter(NULL);
    return cpumla_leave(cpumla_pool_resize(n));
}

int cpumla_get_threads(void) {
    cpumla_enter(NULL);
    return cpumla_leave(cpumla_pool_threads());
}
