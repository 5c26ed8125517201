/* expert_stream.c: routed experts read from disk into slots of memory as cpumla_moe routes to them
 * (cpumla_stream in cpumla.h; moe.c's side in expert_stream.h).
 *
 * An expert is up to six byte ranges of its files (gate, up and down, each with its scale grid), merged
 * into at most six aligned reads when they lie close together; a slot holds one expert, each read at its
 * own aligned offset, so that the weights keep their in-file layout and the kernels read them as they
 * would the mapping. Reads are split into requests of CHUNK bytes, queued (the call's own before any
 * other), and served by io_threads threads doing pread on an O_DIRECT descriptor (expert_reads.c): the
 * page cache is neither filled nor consulted, so the memory budget is the slots plus what stays resident.
 * This file: the registry of streamed tables, the slots and their policy, moe.c's side, the public API.
 *
 * Locking: one mutex per stream guards the slots, the queue and the statistics; moe.c calls in with the
 * library lock held (one forward at a time), the readers take only the stream's mutex. The live table of
 * a registered table is rewritten only by the forward's thread (when it takes an expert into a slot,
 * which may move a slot's previous expert back to its mapped pointers), and a pool job reads it only
 * for experts held in their slots. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include "core/dispatch.h"
#include "core/expert_stream_impl.h"

/* ---- the registry: which tables are streamed ----------------------------------------------------- */
static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;
static stream_table **reg;
static int64_t reg_n, reg_cap;

stream_table *stream_table_of(const cpumla_expert *experts) {
    stream_table *t = NULL;
    pthread_mutex_lock(&reg_mu);
    for (int64_t i = 0; i < reg_n && !t; i++)
        if (reg[i]->key == experts) t = reg[i];
    pthread_mutex_unlock(&reg_mu);
    return t;
}

static int reg_add(stream_table *t) {
    int rc = 0;
    pthread_mutex_lock(&reg_mu);
    for (int64_t i = 0; i < reg_n; i++)
        if (reg[i]->key == t->key) rc = -1;
    if (rc == 0 && reg_n == reg_cap) {
        int64_t cap = reg_cap ? 2 * reg_cap : 64;
        stream_table **r = realloc(reg, sizeof *r * (size_t)cap);
        if (r) { reg = r; reg_cap = cap; } else rc = -2;
    }
    if (rc == 0) reg[reg_n++] = t;
    pthread_mutex_unlock(&reg_mu);
    if (rc == -1) cpumla_set_error("this expert table is streamed already");
    if (rc == -2) cpumla_set_error("out of memory");
    return rc ? -1 : 0;
}

static void reg_remove(stream_table *t) {
    pthread_mutex_lock(&reg_mu);
    for (int64_t i = 0; i < reg_n; i++)
        if (reg[i] == t) { reg[i] = reg[--reg_n]; break; }
    pthread_mutex_unlock(&reg_mu);
}

/* points expert e of t at its slot (mem) or, mem NULL, back at its mapped pointers */
static void relink(stream_table *t, int32_t e, uint8_t *mem) {
    for (int i = 0; i < MAX_GROUPS; i++) {
        if (t->ex[e].at[i] < 0) continue;
        cpumla_expert key = t->key[e];
        *ptr_at(&t->live[e], i) = mem ? (const void *)(mem + t->ex[e].at[i]) : *ptr_at(&key, i);
    }
}

/* ---- moe.c's side ------------------------------------------------------------------------------- */
const cpumla_expert *stream_live(const stream_table *t) { return t->live; }
int64_t stream_size(const stream_table *t) { return t->n; }

static int64_t victim(cpumla_stream *s) {
    int64_t best = -1;
    for (int64_t i = 0; i < s->n_slots; i++) {
        const slot *c = &s->slots[i];
        if (c->held || c->state == SLOT_READING) continue;
        if (!c->t) return i;
        if (best < 0) { best = i; continue; }
        const slot *b = &s->slots[best];
        int better = s->policy == CPUMLA_STREAM_LFU ? (c->uses < b->uses || (c->uses == b->uses && c->last < b->last))
                                                    : c->last < b->last;
        if (better) best = i;
    }
    return best;
}

/* whether a slot that no call holds is being read (a read ahead): it will be free to take (mutex held) */
static int reading_unheld(const cpumla_stream *s) {
    for (int64_t i = 0; i < s->n_slots; i++)
        if (s->slots[i].state == SLOT_READING && !s->slots[i].held) return 1;
    return 0;
}

/* puts expert e of t in a slot and queues its reads (mutex held); held: the caller holds it. The slot,
or -1 when every slot is held or being read. */
static int64_t load(cpumla_stream *s, stream_table *t, int32_t e, int held) {
    int64_t v = victim(s);
    if (v < 0) return -1;
    slot *sl = &s->slots[v];
    if (sl->t) {
        sl->t->ex[sl->e].slot = -1;
        relink(sl->t, sl->e, NULL);
    }
    sl->t = t; sl->e = e; sl->held = held; sl->last = s->clock; sl->uses = held;
    sl->failed = 0; sl->pending = 0; sl->state = SLOT_READING; sl->ahead = !held;
    t->ex[e].slot = (int32_t)v;
    relink(t, e, sl->mem);
    stream_enqueue(s, v, &t->ex[e], held);
    if (sl->pending == 0) sl->state = SLOT_READY;   /* an expert wholly in memory */
    return v;
}

int stream_take(stream_table *t, int32_t e) {
    cpumla_stream *s = t->s;
    expert_desc *d = &t->ex[e];
    if (!s->started) {
        cpumla_set_error("the expert stream has not started");
        return -1;
    }
    pthread_mutex_lock(&s->mu);
    s->clock++;
    s->st.lookups++;
    if (s->policy == CPUMLA_STREAM_LFU && s->clock % (8 * s->n_slots) == 0)
        for (int64_t i = 0; i < s->n_slots; i++) s->slots[i].uses /= 2;
    if (d->slot >= 0) {
        slot *sl = &s->slots[d->slot];
        if (sl->failed && sl->held == 0 && sl->state == SLOT_READY) {   /* a read ahead that failed: again */
            d->slot = -1;
            relink(t, e, NULL);
            sl->t = NULL;
            sl->state = SLOT_EMPTY;
            sl->failed = 0;
        }
    }
    if (d->slot >= 0) {
        slot *sl = &s->slots[d->slot];
        sl->held++;
        sl->last = s->clock;
        sl->uses++;
        s->st.hits++;
        s->st.prefetch_used += sl->ahead;
        sl->ahead = 0;
        int ready = sl->state == SLOT_READY;      /* else a prefetch's read is still in flight */
        pthread_mutex_unlock(&s->mu);
        return ready ? 1 : 2;
    }
    int64_t v;
    while ((v = load(s, t, e, 1)) < 0 && reading_unheld(s))   /* a read ahead still fills the slot it needs */
        pthread_cond_wait(&s->done, &s->mu);
    if (v < 0) s->st.lookups--;
    pthread_mutex_unlock(&s->mu);
    return v < 0 ? 0 : 2;
}

int stream_predict(const cpumla_expert *next, const cpumla_weight *gate, const cpumla_router *r, const float *x,
                   int64_t D, const int64_t *token_id) {
    stream_table *t = stream_table_of(next);
    if (!t || !gate || !r || r->top_k < 1 || r->n_experts > t->n) return 0;
    cpumla_stream *s = t->s;
    int64_t E = r->n_experts, K = r->top_k;
    if (s->cap_logits < E + K) {
        float *p = realloc(s->logits, sizeof(float) * (size_t)(E + K));
        if (!p) return 0;
        s->logits = p; s->cap_logits = E + K;
    }
    if (s->cap_pend < K) {
        int32_t *p = realloc(s->pend, sizeof(int32_t) * (size_t)K);
        if (!p) return 0;
        s->pend = p; s->cap_pend = K;
    }
    if (r->method != CPUMLA_ROUTE_HASH && cpumla_gemm_f32act(gate, x, D, 1, s->logits, E) != 0) return -1;
    if (cpumla_route(r, s->logits, E, 1, token_id, s->pend, s->logits + E) != 0) return -1;
    s->pend_t = t;
    s->n_pend = K;
    return 0;
}

void stream_flush(stream_table *t) {
    cpumla_stream *s = t->s;
    if (s->pend_t) {
        stream_prefetch(s->pend_t, s->pend, s->n_pend);
        s->pend_t = NULL;
    }
}

int stream_prefetch(stream_table *t, const int32_t *ids, int64_t n) {
    cpumla_stream *s = t->s;
    int64_t queued = 0;
    if (!s->started) return 0;
    pthread_mutex_lock(&s->mu);
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->n || t->ex[ids[i]].slot >= 0) continue;
        if (load(s, t, ids[i], 0) < 0) break;
        queued++;
    }
    s->st.prefetches += queued;
    pthread_mutex_unlock(&s->mu);
    return (int)queued;
}

int stream_wait(stream_table *t, int32_t e) {
    cpumla_stream *s = t->s;
    pthread_mutex_lock(&s->mu);
    slot *sl = &s->slots[t->ex[e].slot];
    if (sl->state == SLOT_READING) {
        double t0 = stream_now();
        while (sl->state == SLOT_READING) pthread_cond_wait(&s->done, &s->mu);
        s->st.wait_seconds += stream_now() - t0;
    }
    char msg[240];
    int failed = sl->failed;
    if (failed) memcpy(msg, sl->msg, sizeof msg);
    pthread_mutex_unlock(&s->mu);
    if (failed) cpumla_set_error(msg);
    return failed ? -1 : 0;
}

void stream_drop(stream_table *t, int32_t e) {
    cpumla_stream *s = t->s;
    pthread_mutex_lock(&s->mu);
    int32_t si = t->ex[e].slot;
    if (si >= 0) {
        slot *sl = &s->slots[si];
        if (sl->held > 0) sl->held--;
        if (sl->failed && sl->held == 0 && sl->state == SLOT_READY) {   /* forget what did not read */
            t->ex[e].slot = -1;
            relink(t, e, NULL);
            sl->t = NULL;
            sl->state = SLOT_EMPTY;
            sl->failed = 0;
        }
    }
    pthread_mutex_unlock(&s->mu);
}

/* ---- the public side ---------------------------------------------------------------------------- */
cpumla_stream *cpumla_stream_new(const cpumla_stream_file *files, int32_t n_files, int32_t io_threads, int32_t policy) {
    if (n_files < 1 || io_threads < 1 || io_threads > 256 || (policy != CPUMLA_STREAM_LRU && policy != CPUMLA_STREAM_LFU)) {
        cpumla_set_error("cpumla_stream_new: needs at least one file, 1 to 256 reader threads and a known policy");
        return NULL;
    }
    cpumla_stream *s = calloc(1, sizeof *s);
    if (!s) { cpumla_set_error("out of memory"); return NULL; }
    s->fd = malloc(sizeof(int) * (size_t)n_files);
    s->fd_buf = malloc(sizeof(int) * (size_t)n_files);
    s->path = calloc((size_t)n_files, sizeof(char *));
    s->base = malloc(sizeof(void *) * (size_t)n_files);
    s->length = malloc(sizeof(int64_t) * (size_t)n_files);
    s->policy = policy;
    s->io_threads = io_threads;
    s->direct = 1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->work, NULL);
    pthread_cond_init(&s->done, NULL);
    if (!s->fd || !s->fd_buf || !s->path || !s->base || !s->length) {
        free(s->fd); free(s->fd_buf); free(s->path); free((void *)s->base); free(s->length); free(s);
        cpumla_set_error("out of memory");
        return NULL;
    }
    for (int32_t f = 0; f < n_files; f++) { s->fd[f] = -1; s->fd_buf[f] = -1; }
    s->n_files = n_files;
    for (int32_t f = 0; f < n_files; f++) {
        char msg[400];
        s->base[f] = files[f].base;
        s->length[f] = files[f].length;
        s->path[f] = strdup(files[f].path ? files[f].path : "");
        if (!s->path[f]) { cpumla_stream_free(s); cpumla_set_error("out of memory"); return NULL; }
        s->fd_buf[f] = open(s->path[f], O_RDONLY | O_CLOEXEC);
        if (s->fd_buf[f] < 0) {
            snprintf(msg, sizeof msg, "%s: cannot open: %s", s->path[f], strerror(errno));
            cpumla_stream_free(s);
            cpumla_set_error(msg);
            return NULL;
        }
        s->fd[f] = open(s->path[f], O_RDONLY | O_CLOEXEC | O_DIRECT);
        if (s->fd[f] < 0) { s->fd[f] = s->fd_buf[f]; s->direct = 0; }
    }
    return s;
}

int cpumla_stream_add(cpumla_stream *s, const cpumla_expert *experts, int64_t n) {
    if (s->started || n < 1) {
        cpumla_set_error(s->started ? "cpumla_stream_add: the stream has started" : "cpumla_stream_add: no experts");
        return -1;
    }
    stream_table *t = calloc(1, sizeof *t);
    if (t) {
        t->live = malloc(sizeof *t->live * (size_t)n);
        t->ex = calloc((size_t)n, sizeof *t->ex);
    }
    if (!t || !t->live || !t->ex) {
        if (t) { free(t->live); free(t->ex); free(t); }
        cpumla_set_error("out of memory");
        return -1;
    }
    t->s = s; t->key = experts; t->n = n;
    memcpy(t->live, experts, sizeof *t->live * (size_t)n);
    int64_t keep = s->slot_bytes;
    for (int64_t e = 0; e < n; e++) {
        if (stream_describe(s, &experts[e], e, &t->ex[e]) != 0) {
            s->slot_bytes = keep;
            free(t->live); free(t->ex); free(t);
            return -1;
        }
    }
    if (s->n_tables == s->cap_tables) {
        int32_t cap = s->cap_tables ? 2 * s->cap_tables : 64;
        stream_table **r = realloc(s->tables, sizeof *r * (size_t)cap);
        if (!r) { free(t->live); free(t->ex); free(t); cpumla_set_error("out of memory"); return -1; }
        s->tables = r; s->cap_tables = cap;
    }
    if (reg_add(t) != 0) { free(t->live); free(t->ex); free(t); return -1; }
    s->tables[s->n_tables++] = t;
    return 0;
}

int64_t cpumla_stream_slot_bytes(const cpumla_stream *s) { return s->slot_bytes; }

/* Backs the slots with memory now. A direct read into a page never touched faults it in first, in the
 * kernel, on the readers' threads and the CPU the forward needs (and on a virtual machine the host backs
 * it on first touch too): measured on a 2-vCPU KVM guest, populating while decoding halved the disk's
 * speed and took a third of the compute time, where populating first takes 0.35 to 2.9 s a GB at load
 * (as the host allows). MADV_POPULATE_WRITE (Linux 5.14) in one call, else a write to each page. */
static void populate(uint8_t *a, int64_t bytes) {
#ifdef MADV_POPULATE_WRITE
    if (madvise(a, (size_t)bytes, MADV_POPULATE_WRITE) == 0) return;
#endif
    long page = sysconf(_SC_PAGESIZE);
    for (int64_t o = 0; o < bytes; o += page > 0 ? page : 4096) ((volatile uint8_t *)a)[o] = 0;
}

int cpumla_stream_start(cpumla_stream *s, int64_t n_slots) {
    if (s->started || n_slots < 1 || s->n_tables == 0) {
        cpumla_set_error(s->started ? "cpumla_stream_start: started already"
                                    : "cpumla_stream_start: needs a table and at least one slot");
        return -1;
    }
    int64_t per = s->slot_bytes > 0 ? align_up(s->slot_bytes) : ALIGN;
    s->arena_bytes = per * n_slots;
    void *a = mmap(NULL, (size_t)s->arena_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    s->slots = calloc((size_t)n_slots, sizeof *s->slots);
    int64_t per_slot = 0;
    for (int32_t i = 0; i < s->n_tables; i++)
        for (int64_t e = 0; e < s->tables[i]->n; e++) {
            int64_t r = requests_of(&s->tables[i]->ex[e]);
            per_slot = r > per_slot ? r : per_slot;
        }
    s->q_cap = per_slot * n_slots + 1;
    s->q = malloc(sizeof *s->q * (size_t)s->q_cap);
    s->th = calloc((size_t)s->io_threads, sizeof *s->th);
    if (a == MAP_FAILED || !s->slots || !s->q || !s->th) {
        if (a != MAP_FAILED) munmap(a, (size_t)s->arena_bytes);
        free(s->slots); free(s->q); free(s->th);
        s->slots = NULL; s->q = NULL; s->th = NULL;
        cpumla_set_error("out of memory for the expert slots");
        return -1;
    }
    populate(a, s->arena_bytes);
    s->arena = a;
    s->n_slots = n_slots;
    for (int64_t i = 0; i < n_slots; i++) s->slots[i].mem = s->arena + i * per;
    int made = 0;
    for (; made < s->io_threads; made++)
        if (pthread_create(&s->th[made], NULL, stream_reader, s) != 0) break;
    s->io_threads = made;
    s->started = 1;
    if (made == 0) {
        cpumla_set_error("cannot start the expert readers");
        return -1;
    }
    return 0;
}

void cpumla_stream_free(cpumla_stream *s) {
    if (!s) return;
    for (int32_t i = 0; i < s->n_tables; i++) reg_remove(s->tables[i]);
    if (s->th) {
        pthread_mutex_lock(&s->mu);
        s->stop = 1;
        pthread_cond_broadcast(&s->work);
        pthread_mutex_unlock(&s->mu);
        for (int32_t i = 0; i < s->io_threads; i++) pthread_join(s->th[i], NULL);
    }
    for (int32_t i = 0; i < s->n_tables; i++) { free(s->tables[i]->live); free(s->tables[i]->ex); free(s->tables[i]); }
    for (int32_t f = 0; f < s->n_files; f++) {
        if (s->fd[f] >= 0 && s->fd[f] != s->fd_buf[f]) close(s->fd[f]);
        if (s->fd_buf[f] >= 0) close(s->fd_buf[f]);
        free(s->path[f]);
    }
    if (s->arena) munmap(s->arena, (size_t)s->arena_bytes);
    free(s->tables); free(s->slots); free(s->q); free(s->th); free(s->pend); free(s->logits);
    free(s->fd); free(s->fd_buf); free(s->path); free((void *)s->base); free(s->length);
    pthread_cond_destroy(&s->work);
    pthread_cond_destroy(&s->done);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

void cpumla_stream_get_stats(const cpumla_stream *s, cpumla_stream_stats *out) {
    cpumla_stream *m = (cpumla_stream *)s;
    pthread_mutex_lock(&m->mu);
    *out = m->st;
    if (m->inflight) out->busy_seconds += stream_now() - m->busy_t0;
    out->n_slots = m->n_slots;
    out->slot_bytes = m->n_slots ? m->arena_bytes / m->n_slots : align_up(m->slot_bytes);
    out->direct = m->direct;
    pthread_mutex_unlock(&m->mu);
}

void cpumla_stream_reset_stats(cpumla_stream *s) {
    pthread_mutex_lock(&s->mu);
    memset(&s->st, 0, sizeof s->st);
    if (s->inflight) s->busy_t0 = stream_now();
    pthread_mutex_unlock(&s->mu);
}
