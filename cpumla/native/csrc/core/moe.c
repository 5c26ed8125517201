/* moe.c: MoE routing (cpumla_route: scores, the group step, top-k) and cpumla_moe, SwiGLU experts
 * applied to routed tokens (also dense MLPs and shared experts, as a table of one). Portable
 * orchestration over the table's linear algebra (kern_gemv, kern_gemm) and swiglu kernels; scratch
 * from the current context.
 *
 * D=hidden I=expert intermediate K=experts per token (k here) n=tokens */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include "core/common.h"
#include "core/dispatch.h"
#include "core/expert_stream.h"
#include "core/threadpool.h"

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* ---- routing ---------------------------------------------------------------------------------- */
static float sqrt_softplus(float v) {
    float sp = v > 20.0f ? v : log1pf(expf(v));     /* torch's softplus threshold */
    return sqrtf(sp);
}

static int route(const cpumla_router *r, const float *logits, int64_t ld, int64_t n,
                 const int64_t *token_ids, int32_t *idx, float *weights) {
    int64_t E = r->n_experts, K = r->top_k, G = r->n_group > 1 ? r->n_group : 1;
    char msg[200];
    if (E < 1 || K < 1 || K > E || r->method < 0 || r->method > CPUMLA_ROUTE_HASH) {
        snprintf(msg, sizeof msg, "bad router: method %d, %lld experts, top_k %lld", r->method, (long long)E,
                 (long long)K);
        cpumla_set_error(msg);
        return -1;
    }
    int grouped = (r->method == CPUMLA_ROUTE_GROUP_LIMITED || r->method == CPUMLA_ROUTE_NOAUX_TC) && G > 1;
    if (grouped && (E % G != 0 || r->topk_group < 1 || r->topk_group > G ||
                    (r->method == CPUMLA_ROUTE_NOAUX_TC && E / G < 2))) {
        snprintf(msg, sizeof msg, "bad router groups: %lld experts in %lld groups, topk_group %d", (long long)E,
                 (long long)G, r->topk_group);
        cpumla_set_error(msg);
        return -1;
    }
    if (r->method == CPUMLA_ROUTE_HASH && (!r->tid2eid || !token_ids)) {
        cpumla_set_error("hash routing needs tid2eid and token ids");
        return -1;
    }
    float *s = cpumla_scratch(CPUMLA_SCRATCH_ROUTE, sizeof(float) * (size_t)(3 * E + 2 * G + 2 * K));
    if (!s) return -1;
    float *choice = s + E, *gscore = choice + E, *gval = gscore + G, *kval = gval + G;
    int32_t *gidx = (int32_t *)(kval + K);   /* G ints fit in the E floats after kval */
    for (int64_t t = 0; t < n; t++) {
        const float *lg = logits + t * ld;
        int32_t *it = idx + t * K;
        float *wt = weights + t * K;
        switch (r->method) {
        case CPUMLA_ROUTE_SOFTMAX:
        case CPUMLA_ROUTE_GROUP_LIMITED:
            memcpy(s, lg, sizeof(float) * (size_t)E);
            {
                float m = -INFINITY, sum = 0.0f;
                for (int64_t e = 0; e < E; e++) m = s[e] > m ? s[e] : m;
                for (int64_t e = 0; e < E; e++) { s[e] = expf(s[e] - m); sum += s[e]; }
                for (int64_t e = 0; e < E; e++) s[e] /= sum;
            }
            break;
        case CPUMLA_ROUTE_NOAUX_TC:
            for (int64_t e = 0; e < E; e++) s[e] = 1.0f / (1.0f + expf(-lg[e]));
            break;
        default:  /* SQRTSOFTPLUS, HASH */
            for (int64_t e = 0; e < E; e++) s[e] = sqrt_softplus(lg[e]);
            break;
        }
        if (r->method == CPUMLA_ROUTE_HASH) {
            int64_t tok = token_ids[t];
            if (tok < 0 || tok >= r->vocab) {
                snprintf(msg, sizeof msg, "token id %lld outside the hash table's vocabulary of %lld",
                         (long long)tok, (long long)r->vocab);
                cpumla_set_error(msg);
                return -1;
            }
            for (int64_t k = 0; k < K; k++) {
                int64_t e = r->tid2eid_dtype == CPUMLA_I32 ? ((const int32_t *)r->tid2eid)[tok * K + k]
                                                           : ((const int64_t *)r->tid2eid)[tok * K + k];
                if (e < 0 || e >= E) {
                    snprintf(msg, sizeof msg, "tid2eid[%lld] names expert %lld of %lld", (long long)tok,
                             (long long)e, (long long)E);
                    cpumla_set_error(msg);
                    return -1;
                }
                it[k] = (int32_t)e;
            }
        } else {
            int biased = r->bias && (r->method == CPUMLA_ROUTE_NOAUX_TC || r->method == CPUMLA_ROUTE_SQRTSOFTPLUS);
            for (int64_t e = 0; e < E; e++) choice[e] = biased ? s[e] + r->bias[e] : s[e];
            if (grouped) {
                int64_t per = E / G;
                for (int64_t g = 0; g < G; g++) {
                    const float *c = choice + g * per;
                    if (r->method == CPUMLA_ROUTE_GROUP_LIMITED) {
                        float m = -INFINITY;
                        for (int64_t e = 0; e < per; e++) m = c[e] > m ? c[e] : m;
                        gscore[g] = m;
                    } else {
                        int32_t i2[2];
                        float v2[2];
                        cpumla_topk(c, per, 2, i2, v2);
                        gscore[g] = v2[0] + v2[1];
                    }
                }
                cpumla_topk(gscore, G, r->topk_group, gidx, gval);
                for (int64_t g = 0; g < G; g++) {
                    int keep = 0;
                    for (int64_t q = 0; q < r->topk_group; q++) keep |= gidx[q] == g;
                    if (!keep)
                        for (int64_t e = 0; e < per; e++) choice[g * per + e] = -INFINITY;
                }
            }
            cpumla_topk(choice, E, K, it, kval);
        }
        float sum = 0.0f;
        for (int64_t k = 0; k < K; k++) { wt[k] = s[it[k]]; sum += wt[k]; }
        for (int64_t k = 0; k < K; k++) {
            if (r->norm_topk_prob) wt[k] /= sum + 1e-20f;
            wt[k] *= r->routed_scaling_factor;
        }
    }
    return 0;
}

int cpumla_route(const cpumla_router *r, const float *logits, int64_t ld, int64_t n,
                 const int64_t *token_ids, int32_t *idx, float *weights) {
    cpumla_enter(NULL);
    return cpumla_leave(route(r, logits, ld, n, token_ids, idx, weights));
}

/* ---- decode: one token, k experts -------------------------------------------------------------- */
typedef struct {
    const cpumla_expert *experts;
    const int32_t *idx;          /* [k] */
    int64_t k, I, D, pieces_in, pieces_out;   /* pieces of each thread's span (cpumla_span_pieces) */
    int threads;
    const float *x;
    float *h;                    /* [k, 2I]: gate rows then up rows of each expert */
    float *o;                    /* [k, D] */
    const uint8_t *qx;           /* quantized x (in) or h rows (out, per_out apart) for all tasks, or NULL */
    int64_t per_out;
} moe1_job;

/* gate and up rows of every chosen expert, as one span of k * 2I rows (matrix 2e: gate of slot e,
 * 2e + 1: its up) */
static void moe1_in_task(void *p, int64_t t, int tid) {
    (void)tid;
    moe1_job *j = p;
    int64_t u0, u1;
    cpumla_span_piece(j->k * 2 * j->I, j->pieces_in, 8, j->threads, t, &u0, &u1);
    for (int64_t m = u0 / j->I; m * j->I < u1; m++) {      /* the matrices the piece touches */
        int64_t e = m / 2, which = m % 2, r0 = max64(u0 - m * j->I, 0), r1 = min64(u1 - m * j->I, j->I);
        if (j->idx[e] < 0 || r0 >= r1) continue;
        const cpumla_expert *ex = &j->experts[j->idx[e]];
        const cpumla_weight *w = which ? &ex->up : &ex->gate;
        float *y = j->h + e * 2 * j->I + which * j->I + r0;
        if (j->qx) kern_gemv_qx(&cpumla_k, w, j->qx, y, r0, r1);
        else kern_gemv(&cpumla_k, w, j->x, y, r0, r1);
    }
}

/* down rows of every chosen expert, as one span of k * D rows */
static void moe1_out_task(void *p, int64_t t, int tid) {
    (void)tid;
    moe1_job *j = p;
    int64_t u0, u1;
    cpumla_span_piece(j->k * j->D, j->pieces_out, 8, j->threads, t, &u0, &u1);
    for (int64_t e = u0 / j->D; e * j->D < u1; e++) {
        int64_t r0 = max64(u0 - e * j->D, 0), r1 = min64(u1 - e * j->D, j->D);
        if (j->idx[e] < 0 || r0 >= r1) continue;
        const cpumla_weight *w = &j->experts[j->idx[e]].down;
        if (j->qx) kern_gemv_qx(&cpumla_k, w, j->qx + e * j->per_out, j->o + e * j->D + r0, r0, r1);
        else kern_gemv(&cpumla_k, w, j->h + e * 2 * j->I, j->o + e * j->D + r0, r0, r1);
    }
}

/* bytes of the quantized activation row that the chosen experts' gate and up weights (down: their
 * down weights) all take (kern_qx_bytes), when they are of one dtype: the job then quantizes its
 * activations once, not once a task; else 0 */
static int64_t shared_qx_bytes(const cpumla_expert *experts, const int32_t *idx, int64_t k, int down) {
    const cpumla_weight *first = NULL;
    for (int64_t e = 0; e < k; e++) {
        if (idx[e] < 0) continue;
        const cpumla_expert *ex = &experts[idx[e]];
        const cpumla_weight *ws[2] = {down ? &ex->down : &ex->gate, down ? &ex->down : &ex->up};
        for (int i = 0; i < 2; i++) {
            if (!first) first = ws[i];
            if (!kern_qx_bytes(&cpumla_k, ws[i], 1) || ws[i]->dtype != first->dtype || ws[i]->cols != first->cols)
                return 0;
        }
    }
    return first ? kern_qx_bytes(&cpumla_k, first, 1) : 0;
}

/* o[e] = Expert_{idx[e]}(x) for every e < k with idx[e] >= 0 (h, o: moe1_job's) */
static int moe_one_pass(const cpumla_expert *experts, const float *x, const int32_t *idx, int64_t k, float *h,
                        float limit) {
    int64_t I = experts[0].gate.rows, D = experts[0].gate.cols;
    int threads = cpumla_pool_threads();
    moe1_job j = {.experts = experts, .idx = idx, .k = k, .I = I, .D = D, .threads = threads, .x = x, .h = h,
                  .o = h + k * 2 * I};
    j.pieces_in = cpumla_span_pieces(k * 2 * I, experts[0].gate.row_bytes, 8, threads);
    j.pieces_out = cpumla_span_pieces(k * D, experts[0].down.row_bytes, 8, threads);
    /* both jobs in spans (threadpool.h): a thread streams its rows of the experts in order */
    int64_t per_in = shared_qx_bytes(experts, idx, k, 0), per_out = shared_qx_bytes(experts, idx, k, 1);
    uint8_t *qx = NULL;
    if (per_in || per_out) {
        qx = cpumla_scratch(CPUMLA_SCRATCH_QX_JOB, (size_t)(per_in > k * per_out ? per_in : k * per_out));
        if (!qx) return -1;
    }
    if (per_in) {
        const int32_t *first = idx;
        while (*first < 0) first++;           /* per_in > 0: some expert was chosen */
        kern_quant_rows(&cpumla_k, &experts[*first].gate, x, 0, 1, qx);
        j.qx = qx;
    }
    cpumla_pool_run_spans(threads * j.pieces_in, moe1_in_task, &j);
    for (int64_t e = 0; e < k; e++)
        if (idx[e] >= 0) cpumla_k.swiglu_row(h + e * 2 * I, h + e * 2 * I + I, h + e * 2 * I, I, limit);
    j.qx = NULL;
    if (per_out) {
        for (int64_t e = 0; e < k; e++)
            if (idx[e] >= 0) kern_quant_rows(&cpumla_k, &experts[idx[e]].down, h + e * 2 * I, 0, 1, qx + e * per_out);
        j.qx = qx;
        j.per_out = per_out;
    }
    cpumla_pool_run_spans(threads * j.pieces_out, moe1_out_task, &j);
    return 0;
}

/* lets go of the experts a streamed call holds: those idx[e] >= 0 whose first occurrence is e */
static void drop_held(stream_table *st, const int32_t *idx, const uint8_t *held, int64_t k) {
    for (int64_t e = 0; e < k; e++)
        if (held[e]) stream_drop(st, idx[e]);
}

static int no_slot(int64_t k) {
    char msg[160];
    snprintf(msg, sizeof msg, "MoE: the expert stream's slots cannot hold the %lld experts of one token at once",
             (long long)k);
    cpumla_set_error(msg);
    return -1;
}

/* One token. A streamed table (st): the experts already in slots compute while the others are read,
 * then those; every expert's output has its own row, summed into y in slot order at the end, so the
 * result is the same bits either way. */
static int moe_one_token(const cpumla_expert *experts, stream_table *st, const float *x, const int32_t *idx,
                         const float *w, int64_t k, float *y, float limit) {
    int64_t I = experts[0].gate.rows, D = experts[0].gate.cols;
    float *h = cpumla_scratch(CPUMLA_SCRATCH_MOE1, sizeof(float) * (size_t)(k * 2 * I + k * D) + (size_t)(9 * k));
    if (!h) return -1;
    const float *o = h + k * 2 * I;
    if (!st) {
        if (moe_one_pass(experts, x, idx, k, h, limit) != 0) return -1;
    } else {
        int32_t *now = (int32_t *)(h + k * 2 * I + k * D), *later = now + k;
        uint8_t *held = (uint8_t *)(later + k);
        int any_now = 0, any_later = 0;
        for (int64_t e = 0; e < k; e++) {
            now[e] = later[e] = -1;
            held[e] = 0;
            if (idx[e] < 0) continue;
            int64_t f = 0;
            while (idx[f] != idx[e]) f++;      /* its first occurrence */
            int r = f < e ? (now[f] >= 0 ? 1 : 2) : stream_take(st, idx[e]);
            if (r <= 0) {
                drop_held(st, idx, held, e);
                return r == 0 ? no_slot(k) : -1;
            }
            held[e] = f == e;
            if (r == 1) { now[e] = idx[e]; any_now = 1; } else { later[e] = idx[e]; any_later = 1; }
        }
        stream_flush(st);                      /* the next layer's predicted experts, behind these */
        experts = stream_live(st);
        int rc = any_now ? moe_one_pass(experts, x, now, k, h, limit) : 0;
        for (int64_t e = 0; e < k && rc == 0; e++)
            if (held[e] && later[e] >= 0) rc = stream_wait(st, idx[e]);
        if (rc == 0 && any_later) rc = moe_one_pass(experts, x, later, k, h, limit);
        drop_held(st, idx, held, k);
        if (rc != 0) return -1;
    }
    for (int64_t e = 0; e < k; e++) {
        if (idx[e] < 0) continue;
        const float *oe = o + e * D;
        float we = w[e];
        for (int64_t d = 0; d < D; d++) y[d] += we * oe[d];
    }
    return 0;
}

/* ---- prefill: group tokens by expert, one GEMM per expert hit ----------------------------------- */
enum { STREAM_AHEAD = 4 };     /* streamed experts held (read or being read) at once in a prefill */
static int moe(const cpumla_expert *experts, int64_t n_experts, const float *x, int64_t ldx, int64_t n,
               const int32_t *idx, const float *w, int64_t k, float *y, int64_t ldy, float limit) {
    if (n <= 0 || k <= 0) return 0;
    for (int64_t i = 0; i < n * k; i++) {
        if (idx[i] >= n_experts) {
            char msg[120];
            snprintf(msg, sizeof msg, "MoE: expert index %d is out of range (%lld experts)", idx[i],
                     (long long)n_experts);
            cpumla_set_error(msg);
            return -1;
        }
    }
    stream_table *st = stream_table_of(experts);
    if (st && n_experts > stream_size(st)) {
        cpumla_set_error("MoE: more experts than the streamed table holds");
        return -1;
    }
    if (n == 1) return moe_one_token(experts, st, x, idx, w, k, y, limit);
    if (st) experts = stream_live(st);

    int64_t I = experts[0].gate.rows, D = experts[0].gate.cols;
    /* counting sort of the (token, slot) pairs by expert */
    int64_t *list = cpumla_scratch(CPUMLA_SCRATCH_MOE_LIST, sizeof(int64_t) * (size_t)(n * k + n_experts + 1));
    if (!list) return -1;
    int64_t *start = list + n * k;
    memset(start, 0, sizeof(int64_t) * (size_t)(n_experts + 1));
    for (int64_t i = 0; i < n * k; i++)
        if (idx[i] >= 0) start[idx[i] + 1]++;
    int64_t most = 0;
    for (int64_t e = 0; e < n_experts; e++) {
        most = start[e + 1] > most ? start[e + 1] : most;
        start[e + 1] += start[e];
    }
    int64_t total = start[n_experts];
    /* fill: list[pos] = token*k + slot, in token order within each expert */
    for (int64_t e = n_experts; e > 0; e--) start[e] = start[e - 1];
    start[0] = 0;
    for (int64_t i = 0; i < n * k; i++)
        if (idx[i] >= 0) list[start[idx[i] + 1]++] = i;
    /* now start[e+1] is the end of expert e's run and start[e] its beginning (start[0] = 0) */
    (void)total;
    float *xs = cpumla_scratch(CPUMLA_SCRATCH_MOE, sizeof(float) * (size_t)(most * (D + 2 * I + D)));
    if (!xs) return -1;
    float *g = xs + most * D, *u = g + most * I, *o = u + most * I;
    /* a streamed table: experts are held from when their read is queued, up to STREAM_AHEAD of them
     * ahead of the one computing, and let go once computed; the order of the sums is the same */
    int64_t ahead = 0, held = 0;
    for (int64_t e = 0; e < n_experts; e++) {
        int64_t b = start[e], cnt = start[e + 1] - b;
        if (cnt == 0) continue;
        if (st) {
            for (ahead = ahead > e ? ahead : e; ahead < n_experts && held < STREAM_AHEAD; ahead++) {
                if (start[ahead + 1] == start[ahead]) continue;
                int r = stream_take(st, (int32_t)ahead);
                if (r < 0) break;
                if (r == 0) { if (ahead == e) r = -1; break; }
                held++;
            }
            if (ahead <= e || stream_wait(st, (int32_t)e) != 0) {
                if (ahead <= e && held == 0) no_slot(1);
                for (int64_t f = e; f < ahead; f++)
                    if (start[f + 1] > start[f]) stream_drop(st, (int32_t)f);
                return -1;
            }
        }
        for (int64_t r = 0; r < cnt; r++) memcpy(xs + r * D, x + (list[b + r] / k) * ldx, sizeof(float) * (size_t)D);
        int rc = cpumla_gemm(&experts[e].gate, xs, D, cnt, g, I) != 0 || cpumla_gemm(&experts[e].up, xs, D, cnt, u, I) != 0;
        if (!rc) {
            cpumla_swiglu(g, u, I, g, I, cnt, I, limit);
            rc = cpumla_gemm(&experts[e].down, g, I, cnt, o, D) != 0;
        }
        if (st) { stream_drop(st, (int32_t)e); held--; }
        if (rc) {
            for (int64_t f = e + 1; st && f < ahead; f++)
                if (start[f + 1] > start[f]) stream_drop(st, (int32_t)f);
            return -1;
        }
        for (int64_t r = 0; r < cnt; r++) {
            int64_t pair = list[b + r];
            float we = w[pair];
            float *yt = y + (pair / k) * ldy;
            const float *orow = o + r * D;
            for (int64_t d = 0; d < D; d++) yt[d] += we * orow[d];
        }
    }
    return 0;
}

int cpumla_moe(const cpumla_expert *experts, int64_t n_experts, const float *x, int64_t ldx, int64_t n,
               const int32_t *idx, const float *w, int64_t k, float *y, int64_t ldy, float limit) {
    cpumla_enter(NULL);
    cpumla_ensure_init();
    return cpumla_leave(moe(experts, n_experts, x, ldx, n, idx, w, k, y, ldy, limit));
}
