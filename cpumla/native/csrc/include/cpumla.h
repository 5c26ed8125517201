/* cpumla.h: the public C API of cpumla's kernel library.
 *
 * Dimension legend (MLA):
 *   D=hidden  H=heads  R=kv_lora_rank  P=qk_rope_head_dim  E=experts  K=top_k  T=cached tokens
 *
 * Conventions
 *   - Activations are fp32. Weights are read in place, in the checkpoint's own format
 *     (cpumla_weight describes one matrix as stored: fp32, bf16, fp16, FP8 e4m3 with block scales,
 *     FP4 e2m1 packed two per byte with E8M0 scales).
 *   - A weight is [rows, cols] = [out, in], as torch.nn.Linear stores it: y = W x.
 *   - Every "ld" is a stride in elements (of the buffer it belongs to), so strided views work.
 *   - Public kernels are multi-threaded on the library's own persistent pool; each call returns when
 *     the result is complete. Any thread may call: every call that runs kernels takes the library
 *     lock (cpumla_enter), so calls from different threads run one after the other.
 *   - Scratch belongs to a context (cpumla_ctx), never to the process: a caller that enters its own
 *     context (a model's forward) keeps its buffers warm across calls, and nothing is allocated per
 *     call once they have grown; a standalone call gets a temporary context, freed when it returns.
 *   - Calls that can fail return 0, or -1 with cpumla_last_error() (per thread) saying why; a failed
 *     scratch allocation is such a failure, never a result computed some other way.
 *
 * The latent cache and MLA attention kernels are in mla_attention.h.
 *
 * This header is parsed by cffi (lines starting with '#' are dropped), so keep declarations plain C.
 */
#ifndef CPUMLA_H
#define CPUMLA_H
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

/* ---- element types ---------------------------------------------------------------------------- */
enum cpumla_dtype {
    CPUMLA_F32 = 0,
    CPUMLA_BF16 = 1,
    CPUMLA_F16 = 2,
    CPUMLA_E4M3 = 3,   /* FP8 e4m3fn (max 448, 0x7f/0xff NaN), one byte per element */
    CPUMLA_E2M1 = 4,   /* FP4 e2m1, two per byte: low nibble = even column, high nibble = odd column */
    CPUMLA_E8M0 = 5,   /* scale byte b means 2^(b-127) (0xff is NaN) */
    CPUMLA_I32 = 6,
    CPUMLA_I64 = 7,
    CPUMLA_Q8 = 8,     /* cpumla's 8-bit format: int8 codes, one fp16 scale per 32 (8.5 bits a weight) */
    CPUMLA_Q4 = 9,     /* cpumla's 4-bit format: 4-bit codes, one fp16 scale per 32 (4.5 bits a weight) */
    CPUMLA_Q8_0 = 10,  /* GGUF's Q8_0, read in place: 34-byte blocks of an fp16 scale then 32 int8 codes */
    /* GGUF's other block types, read in place as llama.cpp writes them (ggml's layouts; gguf_q.h) */
    CPUMLA_Q4_0 = 11, CPUMLA_Q4_1 = 12, CPUMLA_Q5_0 = 13, CPUMLA_Q5_1 = 14,
    CPUMLA_Q2_K = 15, CPUMLA_Q3_K = 16, CPUMLA_Q4_K = 17, CPUMLA_Q5_K = 18, CPUMLA_Q6_K = 19,
    CPUMLA_IQ4_NL = 20, CPUMLA_IQ4_XS = 21, CPUMLA_IQ2_XXS = 22, CPUMLA_IQ3_XXS = 23,
    CPUMLA_IQ1_S = 24, CPUMLA_IQ1_M = 25, CPUMLA_MXFP4 = 26,
    CPUMLA_DTYPE_COUNT = 27
};

/* One weight matrix, as stored in the checkpoint.
 *   element (r, c) of a plain type lives at data + r*row_bytes + c*sizeof(type);
 *   E2M1: byte data + r*row_bytes + c/2, low nibble when c is even.
 *   E4M3 / E2M1 are multiplied by scale[(r/block_rows)*scale_ld + c/block_cols] (integer division:
 *   partial edge blocks, e.g. a [576, 7168] weight with a [5, 56] grid, just work).
 *   FP8 checkpoints: block 128x128, scale F32 (`weight_scale_inv`: multiplied, despite the name) or
 *   E8M0 (V4 `.scale`). FP4 experts: block 1x32, scale E8M0.
 *   Q8 / Q4 (cpumla's own, made by cpumla_quantize): block 1x32, scale F16 [rows, cols/32], cols a
 *   multiple of 32. Q8: data int8 [rows, cols], W[r, c] = d[r, c/32] * q[r, c], q in [-127, 127].
 *   Q4: data [rows, cols/2] bytes; in block b of a row (bytes 16b .. 16b+15) byte i holds column
 *   32b+i in its low nibble and column 32b+16+i in its high nibble; W[r, c] = d[r, c/32] * (nib - 8).
 *   Products with Q8 / Q4 weights, and gemv / gemm with E2M1 weights of 1x32 E8M0 blocks over whole
 *   blocks (FP4 experts), quantize the activations per block of 32 (kernels.h): to int8 for Q8 / Q4,
 *   to int16 for E2M1.
 *   Q8_0 (GGUF's block layout, as llama.cpp writes it): cols a multiple of 32; row r holds cols/32
 *   blocks of 34 bytes, block b = fp16 d then int8 q[32]; W[r, 32b + i] = d * q[i]. scale NULL (the
 *   scales are in the blocks), block 1x32, row_bytes at least cols / 32 * 34. Its products quantize
 *   the activations as Q8's do (kernels.h).
 *   The other GGUF block types (Q4_0 .. MXFP4) are laid out alike: row r holds cols / B blocks of
 *   the type's bytes (B = 32 for Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4; 256 for the K and IQ types
 *   but IQ4_NL), each block as ggml defines it; cols a multiple of B, scale NULL, block 1xB.
 *   The IQ types' codebooks come from the gguf package: cpumla_gguf_tables before any product. */
typedef struct cpumla_weight {
    const void *data;
    const void *scale;      /* NULL unless dtype is E4M3, E2M1, Q8 or Q4 */
    int64_t rows, cols;     /* [out, in] */
    int64_t row_bytes;      /* bytes from one row to the next */
    int64_t scale_ld;       /* elements from one scale-grid row to the next */
    int32_t dtype;          /* CPUMLA_F32 / BF16 / F16 / E4M3 / E2M1 / Q8 / Q4 / a GGUF block type */
    int32_t scale_dtype;    /* CPUMLA_F32 or CPUMLA_E8M0; CPUMLA_F16 for Q8 / Q4 (and Q8_0's in-block scales) */
    int32_t block_rows, block_cols;
} cpumla_weight;

/* ---- library: implementation choice, threads, introspection ----------------------------------- */
/* CPU/OS feature bits reported by cpumla_cpu_features(). OS_* bits mean the OS saves that state. */
enum cpumla_feature {
    CPUMLA_FEAT_SSE42 = 1,
    CPUMLA_FEAT_AVX = 2,
    CPUMLA_FEAT_AVX2 = 4,
    CPUMLA_FEAT_FMA = 8,
    CPUMLA_FEAT_F16C = 16,
    CPUMLA_FEAT_AVX512F = 32,
    CPUMLA_FEAT_AVX512BW = 64,
    CPUMLA_FEAT_AVX512VL = 128,
    CPUMLA_FEAT_AVX512DQ = 256,
    CPUMLA_FEAT_AVX512BF16 = 512,
    CPUMLA_FEAT_AVX512VNNI = 1024,
    CPUMLA_FEAT_AMX_TILE = 2048,
    CPUMLA_FEAT_AMX_BF16 = 4096,
    CPUMLA_FEAT_AMX_INT8 = 8192,
    CPUMLA_FEAT_OS_AVX = 16384,     /* XCR0: xmm + ymm state */
    CPUMLA_FEAT_OS_AVX512 = 32768,  /* XCR0: opmask + zmm state */
    CPUMLA_FEAT_OS_AMX = 65536,     /* XCR0 tile state and arch_prctl(ARCH_REQ_XCOMP_PERM) granted */
    CPUMLA_FEAT_NEON = 131072,      /* aarch64 ASIMD */
    CPUMLA_FEAT_NEON_FP16 = 262144,
    CPUMLA_FEAT_NEON_DOTPROD = 524288,
    CPUMLA_FEAT_NEON_BF16 = 1048576,
    CPUMLA_FEAT_NEON_I8MM = 2097152,
    CPUMLA_FEAT_SVE = 4194304,
    CPUMLA_FEAT_AVX512VBMI = 8388608,
    CPUMLA_FEAT_AVXVNNI = 16777216  /* AVX-VNNI: vpdpbusd on ymm, VEX-encoded (Alder Lake, Sierra Forest, Zen 5) */
};

/* Choose the implementation. isa NULL or "" or "auto": the best this CPU and OS support (the
 * environment variable CPUMLA_ISA, when set, is applied by the caller, not here). Otherwise one of
 * "scalar", "avx2", "avxvnni", "avx512f", "avx512vnni", "avx512", "amx", "neon". Returns 0, or -1 when that implementation was
 * not built into this library or the CPU/OS cannot run it (cpumla_last_error() says which, and lists
 * the implementations this machine runs). Safe to call again. */
int cpumla_init(const char *isa);
const char *cpumla_last_error(void);          /* the calling thread's last error */
const char *cpumla_isa(void);                  /* the implementation in use */
int cpumla_isa_available(const char *isa);     /* 1: built and runnable here; 0: not */
/* What this CPU or OS lacks to run an implementation, by name ("AVX512_BF16, OS support for AVX-512
 * state"): "" when it runs here, NULL when the name is unknown or not built for this architecture.
 * The string lives until the calling thread's next call. */
const char *cpumla_isa_missing(const char *isa);
const char *cpumla_isa_list(void);             /* all implementations built in, space-separated */
/* The implementation cpumla_init("") picks on a CPU with these feature bits (CPUMLA_FEAT_*): the
 * dispatch rule as a pure function, testable for CPUs other than this one. */
const char *cpumla_isa_for_features(uint64_t features);
uint64_t cpumla_cpu_features(void);
const char *cpumla_cpu_name(void);
/* Where the AVX-512 GEMVs that decode the most per weight byte (Q8 / Q4 / E2M1 integer products, E4M3)
 * prefetch their row stream: "l1", "l2", or "l2+l1" (into L2 and again, nearer, into L1), with the
 * reason in parentheses ("l2+l1 (Intel)", "l2 (AMD family 19h; l1 for the
 * plain-weight GEMVs)", "l1 (set)" when cpumla_set_gemv_prefetch chose it). The other GEMV streams
 * (bf16 / f16 / f32, avx2's integer products) take l2+l1 on Intel (l2 in the loops over groups of
 * rows: FP8 below the avx512 level) and l1 elsewhere. Each cpumla_init picks them from the CPU unless
 * cpumla_set_gemv_prefetch chose one target for every stream: where is "l1", "l2", "l2+l1", or NULL /
 * "" / "auto" for the CPU's own again. Returns 0, or -1 for any other string (cpumla_last_error says
 * so). Results are the same either way: only speed differs. */
int cpumla_set_gemv_prefetch(const char *where);
/* The codebooks of GGUF's IQ types and the value tables of IQ4_NL / IQ4_XS / MXFP4, as the gguf package
 * holds them: iq2xxs 256 x 8 grid bytes, iq3xxs 256 x 4 grid bytes, iq1s 2048 x 8 int8 values
 * (-1, 0, 1; IQ1_M shares it), ksigns the 128 sign bytes of IQ2_XXS / IQ3_XXS, iq4nl and mxfp4 16 int8
 * values each. Copied; a value outside its type's range is refused (-1, cpumla_last_error). Until this
 * succeeds those types' codes read as zero (cpumla's Python layer sets them when it loads the library). */
int cpumla_gguf_tables(const uint8_t *iq2xxs, const uint8_t *iq3xxs, const int8_t *iq1s, const uint8_t *ksigns,
                       const int8_t *iq4nl, const int8_t *mxfp4);
const char *cpumla_gemv_prefetch(void);
/* Which level serves a kernel: "gemv" names the level owning the table entry; "gemv:e2m1"
 * (gemv, gemm, head_gemv, head_gemv_t, dequant with f32 / bf16 / f16 / e4m3 / e2m1 / q8 / q4 / a GGUF
 * type: q8_0, q4_k, iq2_xxs ...) the one that
 * really serves that weight format, with any hand-back that depends on the layout named in
 * parentheses. NULL for an unknown name. */
const char *cpumla_kernel_impl(const char *kernel);
const char *cpumla_kernel_names(void);         /* space-separated kernel names */
const char *cpumla_build_info(void);           /* compiler and flags of each level */
/* The weight operands an implementation's GEMV hot loop multiplies, for every code of a format:
 * which = "<isa>:e4m3" (256 codes), isa one of those built here. Writes out[code] = the operand the
 * loop multiplies for that code and returns k such that operand * 2^k is the code's value (common.h),
 * or -1 when the name is unknown or this CPU cannot run that isa. Used by the tests to check that no
 * operand is subnormal (no microcode assist on any code). FP4 (e2m1) has none to report: its products
 * multiply integers (kernels.h; its other layouts, the spec's fp32 product, the exact values 0.5 .. 6). */
int cpumla_decode_operands(const char *which, float *out);
const char *cpumla_version(void);

int cpumla_set_threads(int n);                 /* n < 1: one per online core. Returns the count. */
int cpumla_get_threads(void);

/* ---- scratch contexts and the library lock ----------------------------------------------------- */
typedef struct cpumla_ctx cpumla_ctx;          /* scratch owned by one model (or one call) */
cpumla_ctx *cpumla_ctx_new(void);              /* NULL when out of memory */
void cpumla_ctx_free(cpumla_ctx *ctx);         /* NULL ok */
/* Takes the library lock (recursive for the calling thread) and makes ctx's scratch current for the
   calls made until the matching leave. ctx NULL: keeps the current one if already inside, else a
   temporary one freed at the outermost leave. Returns 0. */
int cpumla_enter(cpumla_ctx *ctx);
/* Ends the innermost enter; returns rc, or -1 when a scratch allocation failed since the matching
   enter (cpumla_last_error says so). Releases the lock at the outermost level. */
int cpumla_leave(int rc);
/* Test hook: with the environment variable CPUMLA_SCRATCH_LIMIT set to a byte count (read at each
   outermost cpumla_enter), every scratch request above it fails as if out of memory. */

/* ---- linear algebra --------------------------------------------------------------------------- */
/* y[r] = sum_c W[r,c] x[c] for all rows. gemv, gemm, head_gemv, head_gemv_t, mla_attention and
 * cache_store return 0, or -1 (cpumla_last_error: out of memory for scratch, bad arguments). */
int cpumla_gemv(const cpumla_weight *w, const float *x, float *y);

/* Y[i, r] = sum_c X[i,c] W[r,c] for i < n (prefill: n tokens). X is [n, ldx], Y is [n, ldy]. */
int cpumla_gemm(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy);

/* cpumla_gemm with the activations as given, for a BF16 weight whose products must not round them
 * (kernels.h rounds a BF16 weight's activations to bf16): the MoE router, whose logits transformers
 * computes in fp32. Each x is split exactly into three bf16 parts, x = p1 + p2 + p3 (p1 = bf16(x),
 * p2 = bf16(x - p1), p3 = x - p1 - p2), the three products run as bf16 ones (exact products, fp32
 * sums) and are added. Reads the weight 3 times (from cache after the first), and keeps it bf16
 * where widening it to f32 would copy it. Other formats: cpumla_gemm. Returns 0, or -1 (out of
 * memory; cpumla_last_error). */
int cpumla_gemm_f32act(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy);

/* Per-head products over slices of one weight, for MLA's absorb / un-absorb with kv_b_proj
 * ([H*(dn+dv), R]). Head h uses rows W_h = W[row0 + h*head_stride : row0 + h*head_stride + head_rows].
 * Token t's head h input is x + t*ldx_t + h*ldx_h, its output y + t*ldy_t + h*ldy_h.
 *   head_gemv   (un-absorb, o_h = W_UV[h] o_lat_h):   y_h[head_rows] = W_h x_h[cols]
 *   head_gemv_t (absorb, q~_h = q_nope_h @ W_UK[h]):  y_h[cols]      = W_h^T x_h[head_rows] */
int cpumla_head_gemv(const cpumla_weight *w, int64_t row0, int64_t head_stride, int64_t head_rows,
                     int64_t n_heads, int64_t n, const float *x, int64_t ldx_t, int64_t ldx_h,
                     float *y, int64_t ldy_t, int64_t ldy_h);
int cpumla_head_gemv_t(const cpumla_weight *w, int64_t row0, int64_t head_stride, int64_t head_rows,
                       int64_t n_heads, int64_t n, const float *x, int64_t ldx_t, int64_t ldx_h,
                       float *y, int64_t ldy_t, int64_t ldy_h);

/* out[r - r0, c] = W[r, c] in fp32, rows [r0, r1): for load-time conversions and tests. */
void cpumla_dequant(const cpumla_weight *w, int64_t r0, int64_t r1, float *out, int64_t ldo);

/* Rows [r0, r1) of src (any weight format) quantized to dtype CPUMLA_Q8 or CPUMLA_Q4 into dst (a
 * cpumla_weight of that dtype with its own data and scale buffers, the shape of src, block 1x32;
 * row r of dst is written, r0 <= r < r1). Per block of 32 values v (dequantized to fp32):
 *   Q8: d = fp16(max|v| / 127), q = clamp(nearest_even(v * (1 / d)), -127, 127)  (q = 0 when d = 0)
 *   Q4: m = the v of largest |v| (the first), d = fp16(m / -8), q = clamp(nearest_even(v * (1 / d)), -8, 7) + 8
 *   A block holding a NaN or an infinity: d = NaN (fp16 0x7e00), q = 0 (Q4: nibbles 8), so every
 *   value of it dequantizes, and every product with it comes out, as NaN: a non-finite weight is
 *   never turned into a finite one.
 * Multi-threaded. Returns 0, or -1 (bad dtype or shape; cpumla_last_error() says why). */
int cpumla_quantize(const cpumla_weight *src, const cpumla_weight *dst, int64_t r0, int64_t r1);

/* ---- elementwise and small ops ---------------------------------------------------------------- */
/* y = x / sqrt(mean(x^2) + eps) * weight, per row of dim values. weight: NULL (unweighted, V4's
 * per-head q norm) or [dim] in weight_dtype (F32/BF16/F16). In place (y == x) is allowed. */
void cpumla_rmsnorm(const float *x, int64_t ldx, float *y, int64_t ldy, int64_t n_rows, int64_t dim,
                    const void *weight, int32_t weight_dtype, float eps);

/* RoPE on a slice of every head, in place. Row t (token) has n_heads heads at x + t*ld_row + h*ld_head;
 * the rotated slice is [offset, offset + rope_dim). angle_i = (float)pos[t] * inv_freq[i], i < rope_dim/2,
 * cos and sin multiplied by attn_scale (YaRN's cos/sin mscale; 1.0 for released checkpoints).
 *   CPUMLA_ROPE_INTERLEAVED: pairs (2i, 2i+1)     (MLA, all V4 slices)
 *   CPUMLA_ROPE_HALF:        pairs (i, i + rope_dim/2)  (V3.2 indexer, "rotate_half")
 *   | CPUMLA_ROPE_INVERSE:   rotate by -angle (V4 de-rotates the attention output) */
enum cpumla_rope_mode {
    CPUMLA_ROPE_INTERLEAVED = 0,
    CPUMLA_ROPE_HALF = 1,
    CPUMLA_ROPE_INVERSE = 2
};
void cpumla_rope(float *x, int64_t n_rows, int64_t ld_row, int64_t n_heads, int64_t ld_head,
                 int64_t offset, int64_t rope_dim, const int64_t *pos, const float *inv_freq,
                 float attn_scale, int32_t mode);

/* out = silu(g) * u with g = min(gate, limit), u = clamp(up, -limit, limit) when limit > 0 (V4's
 * swiglu_limit), plain SwiGLU when limit <= 0. Row t: gate + t*ld_in, up + t*ld_in, out + t*ld_out
 * (gate and up may be two halves of one [gate | up] row). */
void cpumla_swiglu(const float *gate, const float *up, int64_t ld_in, float *out, int64_t ld_out,
                   int64_t n_rows, int64_t dim, float limit);

/* In-place softmax over n values of each of n_rows rows. */
void cpumla_softmax(float *x, int64_t n_rows, int64_t ld, int64_t n);

/* The k largest of x[0..n): idx and val in descending order; equal values: lower index first.
 * NaN never wins. */
void cpumla_topk(const float *x, int64_t n, int64_t k, int32_t *idx, float *val);

/* ---- MoE routing ------------------------------------------------------------------------------ */
enum cpumla_route_method {
    CPUMLA_ROUTE_SOFTMAX = 0,        /* s = softmax(logits); top-k (V2-Lite "greedy") */
    CPUMLA_ROUTE_GROUP_LIMITED = 1,  /* softmax; keep topk_group groups ranked by max (V2) */
    CPUMLA_ROUTE_NOAUX_TC = 2,       /* s = sigmoid; choose on s + bias, groups by sum of top-2 (V3) */
    CPUMLA_ROUTE_SQRTSOFTPLUS = 3,   /* s = sqrt(softplus); choose on s + bias, no groups (V4) */
    CPUMLA_ROUTE_HASH = 4            /* s = sqrt(softplus); experts from tid2eid[token] (V4 l < 3) */
};
typedef struct cpumla_router {
    int32_t method;
    int32_t n_experts, top_k;
    int32_t n_group, topk_group;     /* GROUP_LIMITED / NOAUX_TC; n_group <= 1: no group step */
    int32_t norm_topk_prob;          /* 1: w = w / (sum w + 1e-20) */
    float routed_scaling_factor;     /* then w *= routed_scaling_factor */
    const float *bias;               /* [E] e_score_correction_bias, or NULL (selection only) */
    const void *tid2eid;             /* HASH: [vocab, top_k] expert ids */
    int32_t tid2eid_dtype;           /* CPUMLA_I64 or CPUMLA_I32 */
    int64_t vocab;
} cpumla_router;
/* Routes n tokens: logits [n, ld] (x @ gate^T, fp32) -> idx [n, K], weights [n, K] (weights are the
 * un-biased scores). Experts masked by the group step never win: they are chosen on -inf. token_ids
 * are needed by HASH only. Returns 0, or -1 for a bad router or an out-of-range token id / table
 * entry (cpumla_last_error() says which). */
int cpumla_route(const cpumla_router *r, const float *logits, int64_t ld, int64_t n,
                 const int64_t *token_ids, int32_t *idx, float *weights);

/* ---- MoE / MLP ---------------------------------------------------------------------------------- */
/* One SwiGLU MLP: down(silu(gate x) * up x). A dense MLP or a shared expert is a table of one. */
typedef struct cpumla_expert {
    cpumla_weight gate, up, down;   /* [I, D], [I, D], [D, I] */
} cpumla_expert;

/* y[t] += sum_{j < k} w[t*k + j] * Expert_{idx[t*k + j]}(x[t])   for t < n.
 * x [n, ldx] (D = experts[0].gate.cols), y [n, ldy]; idx entries < 0 are skipped; every expert must
 * have the same I and D. limit > 0 clamps as in cpumla_swiglu (V4). Decode (n = 1) runs the gate/up
 * rows of all k experts as one parallel job and the down rows as another; prefill groups tokens by
 * expert and runs one GEMM per expert hit. Returns 0, or -1 for an expert index >= n_experts. */
int cpumla_moe(const cpumla_expert *experts, int64_t n_experts, const float *x, int64_t ldx, int64_t n,
               const int32_t *idx, const float *w, int64_t k, float *y, int64_t ldy, float limit);

/* ---- routed experts streamed from disk (expert_stream.c) ---------------------------------------- */
/* A stream keeps the experts of the tables registered with it on disk and reads those a cpumla_moe
 * call routes to into a fixed number of slots of memory (each holds one expert), with direct I/O
 * (O_DIRECT, aligned; buffered reads where the file system refuses it) on io_threads threads of its
 * own, many reads in flight. A table's weights point into read-only mappings of the files (files[]:
 * base address, bytes mapped from offset 0, path); the stream turns each pointer into a file offset
 * and never touches the mapped pages. A pointer outside every file (a scale grid converted at load)
 * is memory already and used as it is. Expert reads for a call are issued together, the experts
 * already in slots compute while they are read, and the results are the bits of the same call with
 * every expert in memory. A slot to reuse is the least recently used (CPUMLA_STREAM_LRU) or the least
 * used, counts halved every 8 slot-fulls of lookups (CPUMLA_STREAM_LFU), among the slots not held.
 * Read errors (EIO, a file cut short under the model) fail the call with one line naming the file and
 * the offset: nothing reads a mapped page that may be gone. */
enum cpumla_stream_policy { CPUMLA_STREAM_LRU = 0, CPUMLA_STREAM_LFU = 1 };
typedef struct cpumla_stream cpumla_stream;
typedef struct cpumla_stream_file {
    const void *base;
    int64_t length;
    const char *path;
} cpumla_stream_file;
typedef struct cpumla_stream_stats {
    int64_t lookups, hits;       /* experts a call asked for (each once a call), and those found in a slot */
    int64_t reads, bytes_read;   /* experts read from disk, and the bytes (aligned) read for them */
    double busy_seconds;         /* time with at least one read in flight */
    double wait_seconds;         /* time cpumla_moe waited for reads */
    int64_t prefetches;          /* experts read ahead of a call, from the previous layer's hidden state */
    int64_t prefetch_used;       /* of those, the ones a call then asked for */
    int64_t n_slots, slot_bytes, direct;   /* direct: 1 when every file takes O_DIRECT */
} cpumla_stream_stats;
/* NULL on a file that cannot be opened or out of memory (cpumla_last_error says which). */
cpumla_stream *cpumla_stream_new(const cpumla_stream_file *files, int32_t n_files, int32_t io_threads,
                                 int32_t policy);
/* Registers a table of n experts (before cpumla_stream_start): cpumla_moe on `experts` then reads
 * them through the stream. -1 for a weight that lies partly outside its file, a table registered
 * twice, or after start. */
int cpumla_stream_add(cpumla_stream *s, const cpumla_expert *experts, int64_t n);
int64_t cpumla_stream_slot_bytes(const cpumla_stream *s);   /* the bytes a slot takes (the largest expert, aligned) */
/* Allocates n_slots slots (at least 1; a cpumla_moe call needs its tokens' top_k experts held at once)
 * and starts the readers. -1 when out of memory. */
int cpumla_stream_start(cpumla_stream *s, int64_t n_slots);
void cpumla_stream_free(cpumla_stream *s);          /* unregisters its tables; NULL ok */
void cpumla_stream_get_stats(const cpumla_stream *s, cpumla_stream_stats *out);
void cpumla_stream_reset_stats(cpumla_stream *s);
/* The disk probe: reads up to `bytes` of the file at path from offset 0 with direct I/O (as the stream reads: 1 MiB
 * requests, `threads` in flight) and returns the bytes per second, or -1 (cpumla_last_error).
 * *read_bytes receives the bytes read. */
double cpumla_disk_probe(const char *path, int64_t bytes, int32_t threads, int64_t *read_bytes);

/* ---- tensor-parallel ranks (tp_shm.c) ------------------------------------------------------------ */
/* How a sharded model's forward talks to the other ranks (each holds a slice of the heads, of every
 * expert's intermediate dimension and of the vocabulary). all_reduce sums buf [n] over the ranks in
 * place, the same bits on every rank. gather: buf [rows, ld] on every rank holds this rank's columns
 * [col0, col0 + cols); afterwards rank 0's holds every rank's (the others' are left as they were).
 * Both return 0, or -1 (cpumla_last_error names the rank that failed). */
typedef struct cpumla_comm {
    void *ctx;
    int32_t rank, world;
    int (*all_reduce)(void *ctx, float *buf, int64_t n);
    int (*gather)(void *ctx, float *buf, int64_t rows, int64_t ld, int64_t col0, int64_t cols);
} cpumla_comm;

typedef struct cpumla_comm_stats {
    int64_t all_reduces, gathers, broadcasts;
    double seconds;                 /* in all three, waits included */
} cpumla_comm_stats;

/* The shared-memory communicator of the ranks of one machine: a region of cpumla_shm_bytes(world,
 * slot_bytes) bytes mapped by every rank (zero-filled before the first rank attaches), each rank a
 * header line and two slots of slot_bytes for each operation's data. Every operation is a barrier: a
 * rank publishes its data, waits until every rank has published, reads. A wait spins, then yields,
 * then sleeps; it fails with one line when a rank has exited (its pid is gone or a zombie), has
 * failed (cpumla_shm_fail), or has not arrived within timeout_s seconds (idle waits: never). */
typedef struct cpumla_shm cpumla_shm;
int64_t cpumla_shm_bytes(int32_t world, int64_t slot_bytes);
/* NULL for bad sizes or out of memory. Writes this rank's pid into its header line. */
cpumla_shm *cpumla_shm_new(void *base, int32_t rank, int32_t world, int64_t slot_bytes, double timeout_s);
void cpumla_shm_free(cpumla_shm *s);
/* A cpumla_comm over s, for a model's description (valid while s lives). */
void cpumla_shm_comm(cpumla_shm *s, cpumla_comm *out);
int cpumla_shm_all_reduce(void *s, float *buf, int64_t n);
int cpumla_shm_gather(void *s, float *buf, int64_t rows, int64_t ld, int64_t col0, int64_t cols);
/* bytes of buf from rank 0 to every rank. idle: the wait has no time limit (a rank waiting for the
 * next command), though a rank that exits or fails still ends it. */
int cpumla_shm_broadcast(cpumla_shm *s, void *buf, int64_t bytes, int32_t idle);
/* Marks this rank failed: every rank's next wait ends with an error naming it. */
void cpumla_shm_fail(cpumla_shm *s);
void cpumla_shm_get_stats(const cpumla_shm *s, cpumla_comm_stats *out);
void cpumla_shm_reset_stats(cpumla_shm *s);

/* ---- model descriptions ------------------------------------------------------------------------ */
/* A vector as stored (norm weights, biases): F32, BF16 or F16. Each model family's forward, its
 * structs and its state live in a header of its own (deepseek_v2.h, deepseek_v32.h). */
typedef struct cpumla_vec {
    const void *data;
    int32_t dtype;
} cpumla_vec;

/* ---- token sampling ---------------------------------------------------------------------------- */
/* One token drawn from a logits row [n], exactly as the docstring of cpumla/sampling.py defines
 * it (temperature, top-k, top-p, min-p; the penalties are applied to the row before). temperature 0
 * is greedy (the first maximal logit); otherwise draw (< 2^53) is the uniform u = draw / 2^53.
 * top_k 0 and top_p 1 are off, min_p 0 is off. work: cpumla_sample_work_bytes(n) bytes, any
 * alignment, owned by the caller (nothing is allocated; no library lock is taken: any thread may
 * call with its own work). Returns the token id, or -1 (cpumla_last_error: NaN in the row, +inf,
 * every logit -inf, an argument out of range). */
int64_t cpumla_sample_work_bytes(int64_t n);
int64_t cpumla_sample(const float *logits, int64_t n, double temperature, int64_t top_k, double top_p,
                      double min_p, uint64_t draw, void *work);

/* The definition's p_i (float32: exp((x_i - max x) / temperature) by its fixed float32 steps, 0 below
 * -87, at most 1) for temperature > 0. Returns 0, or -1 as cpumla_sample does for a bad row. */
int cpumla_sample_probs(const float *logits, int64_t n, double temperature, float *p);

/* ---- probes for benchmarks -------------------------------------------------------------------- */
/* Reads bytes of buf (any alignment; the tail past a multiple of 64 is ignored) with every thread:
 * a read-bandwidth probe. Returns the sum of the data read as doubles, so the reads cannot be
 * optimised away and the result can be checked. */
double cpumla_read_probe(const void *buf, int64_t bytes);

/* Runs iters rounds of register-only fp32 FMAs on every thread: an FMA-peak probe. Returns the
 * floating-point operations done in total (divide by the elapsed time for FLOP/s). */
double cpumla_fma_probe(int64_t iters);

/* The same for the multiply-adds of a gemm with BF16 weights (bf16 dot products where the CPU has
 * them, fp32 FMAs otherwise): the peak that prefill of a bf16 checkpoint is measured against. */
double cpumla_bf16_probe(int64_t iters);

/* The same for the AMX tiles (kind 0: bf16 tdpbf16ps; kind 1: int8 tdpbusd) on every thread: the peak
 * of the products that run on tiles. Returns the operations done, or 0 where the kernels' level has no
 * tiles (below amx, or CPUMLA_ISA forcing a lower level). */
double cpumla_tile_probe(int32_t kind, int64_t iters);

#ifdef __cplusplus
}
#endif
#endif
