/* expert_stream_impl.h: what expert_stream.c (the slots, their policy, moe.c's side, the public API)
 * and expert_reads.c (where an expert lies in its files, the read requests and their threads, the disk
 * probe) share: the stream's structures. */
#ifndef CPUMLA_EXPERT_STREAM_IMPL_H
#define CPUMLA_EXPERT_STREAM_IMPL_H
#include <pthread.h>
#include <time.h>
#include "core/common.h"
#include "core/expert_stream.h"

#define ALIGN ((int64_t)4096)           /* O_DIRECT's offset, length and buffer alignment (any block size up to 4 KiB) */
#define CHUNK ((int64_t)1 << 20)        /* bytes of one read request */
#define MERGE_GAP ((int64_t)256 << 10)  /* ranges this close are read as one (the gap is read too) */
#define MAX_GROUPS 6                    /* data and scale of gate, up and down */

typedef struct {
    int32_t file;
    int64_t off, len, end;      /* aligned file range read; end: where its real bytes end in the file */
    int64_t slot_off;           /* where it lands in the slot */
} group;

typedef struct {
    group g[MAX_GROUPS];
    int32_t n_groups;
    int64_t at[MAX_GROUPS];     /* pointer i (gate data, gate scale, up .., down ..): its slot offset, or -1 in memory */
    int32_t slot;               /* -1: not in a slot */
} expert_desc;

struct stream_table {
    cpumla_stream *s;
    const cpumla_expert *key;   /* the table the model describes (its pointers: into the mappings) */
    cpumla_expert *live;        /* its copy, whose held experts point into their slots */
    expert_desc *ex;
    int64_t n;
};

enum { SLOT_EMPTY, SLOT_READING, SLOT_READY };
typedef struct {
    uint8_t *mem;
    stream_table *t;
    int32_t e;                  /* owner: expert e of t, or t NULL */
    int32_t state, held;
    int64_t last, uses;         /* the lookup clock at its last use; uses (LFU, halved as it ages) */
    int32_t pending;            /* requests not yet done */
    int32_t failed;
    int32_t ahead;              /* read by a prefetch and not asked for since */
    char msg[240];
} slot;

typedef struct {
    int32_t slot, file;
    int64_t off, len, need;     /* read len bytes at off (aligned); at least need of them must exist */
    uint8_t *dst;
} request;

struct cpumla_stream {
    int32_t n_files, direct;
    int *fd, *fd_buf;           /* O_DIRECT descriptor (or the buffered one) and a buffered one */
    char **path;
    const uint8_t **base;
    int64_t *length;
    stream_table **tables;
    int32_t n_tables, cap_tables, policy, io_threads, started, stop;
    slot *slots;
    int64_t n_slots, slot_bytes, arena_bytes, clock;
    uint8_t *arena;
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    request *q;                 /* a ring of q_cap requests */
    int64_t q_head, q_len, q_cap;
    pthread_t *th;
    stream_table *pend_t;       /* a prediction waiting for the current call's own reads (stream_predict) */
    int32_t *pend;
    int64_t n_pend, cap_pend;
    float *logits;              /* stream_predict's router logits and weights */
    int64_t cap_logits;
    int32_t inflight;
    double busy_t0;
    cpumla_stream_stats st;
};

static inline double stream_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline int64_t align_down(int64_t v) { return v / ALIGN * ALIGN; }
static inline int64_t align_up(int64_t v) { return (v + ALIGN - 1) / ALIGN * ALIGN; }

/* pointer i of an expert: gate data, gate scale, up data, up scale, down data, down scale */
static inline const void **ptr_at(cpumla_expert *x, int i) {
    cpumla_weight *w = i < 2 ? &x->gate : i < 4 ? &x->up : &x->down;
    return i % 2 ? &w->scale : &w->data;
}

/* the read requests of an expert: CHUNK bytes each */
static inline int64_t requests_of(const expert_desc *d) {
    int64_t n = 0;
    for (int g = 0; g < d->n_groups; g++) n += (d->g[g].len + CHUNK - 1) / CHUNK;
    return n;
}

/* expert e's reads (its pointers that lie in a file, merged into aligned groups) and each pointer's
 * offset in the slot; grows s->slot_bytes to hold it. 0, or -1 for a weight past its file's end. */
CPUMLA_INTERNAL int stream_describe(cpumla_stream *s, const cpumla_expert *x, int64_t e, expert_desc *d);
/* queues slot si's reads of d (mutex held): urgent ahead of everything queued, else behind */
CPUMLA_INTERNAL void stream_enqueue(cpumla_stream *s, int64_t si, const expert_desc *d, int urgent);
/* a reader thread's body (pthread_create's), until s->stop */
CPUMLA_INTERNAL void *stream_reader(void *p);

#endif
