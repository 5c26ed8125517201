/* expert_reads.c: reading routed experts for an expert stream (expert_stream.c; the shared structures
 * in expert_stream_impl.h): where an expert lies in its files, the read requests that bring it into a
 * slot and the threads that serve them (pread on an O_DIRECT descriptor, buffered where the file system
 * refuses it; a short read past the file's end is an error naming the file), and the disk probe that
 * their speed is measured against. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "core/dispatch.h"
#include "core/expert_stream_impl.h"
#include "core/gguf_q.h"

/* ---- what an expert occupies in its files ------------------------------------------------------- */
static int64_t row_len(const cpumla_weight *w) {
    int64_t c = w->cols;
    switch (w->dtype) {
    case CPUMLA_F32: case CPUMLA_I32: return 4 * c;
    case CPUMLA_BF16: case CPUMLA_F16: return 2 * c;
    case CPUMLA_E4M3: case CPUMLA_Q8: return c;
    case CPUMLA_E2M1: case CPUMLA_Q4: return (c + 1) / 2;
    default:
        if (w->dtype >= CPUMLA_Q8_0 && w->dtype <= CPUMLA_MXFP4) {
            const gq_type *g = gq_info(w->dtype);
            return (c + g->block - 1) / g->block * g->bytes;
        }
        return 8 * c;
    }
}

static int64_t data_bytes(const cpumla_weight *w) {
    return w->rows > 0 ? (w->rows - 1) * w->row_bytes + row_len(w) : 0;
}

static int64_t scale_bytes(const cpumla_weight *w) {
    if (!w->scale || w->rows <= 0 || w->block_rows <= 0 || w->block_cols <= 0) return 0;
    int64_t el = w->scale_dtype == CPUMLA_F32 ? 4 : w->scale_dtype == CPUMLA_E8M0 ? 1 : 2;
    int64_t gr = (w->rows + w->block_rows - 1) / w->block_rows, gc = (w->cols + w->block_cols - 1) / w->block_cols;
    return ((gr - 1) * w->scale_ld + gc) * el;
}

int stream_describe(cpumla_stream *s, const cpumla_expert *x, int64_t e, expert_desc *d) {
    struct { int32_t file, ptr; int64_t off, len; } r[MAX_GROUPS];
    int n = 0;
    cpumla_expert copy = *x;
    for (int i = 0; i < MAX_GROUPS; i++) {
        d->at[i] = -1;
        const cpumla_weight *w = i < 2 ? &x->gate : i < 4 ? &x->up : &x->down;
        const uint8_t *p = *ptr_at(&copy, i);
        int64_t len = i % 2 ? scale_bytes(w) : data_bytes(w);
        if (!p || len <= 0) continue;
        for (int32_t f = 0; f < s->n_files; f++) {
            if (p < s->base[f] || p >= s->base[f] + s->length[f]) continue;
            int64_t off = p - s->base[f];
            if (len > s->length[f] - off) {
                char msg[400];
                snprintf(msg, sizeof msg, "%s: a weight of expert %lld ends past the file (%lld bytes at %lld of %lld)",
                         s->path[f], (long long)e, (long long)len, (long long)off, (long long)s->length[f]);
                cpumla_set_error(msg);
                return -1;
            }
            int k = n++;   /* insertion by (file, offset) */
            while (k > 0 && (r[k - 1].file > f || (r[k - 1].file == f && r[k - 1].off > off))) { r[k] = r[k - 1]; k--; }
            r[k].file = f; r[k].ptr = i; r[k].off = off; r[k].len = len;
            break;
        }
    }
    d->n_groups = 0;
    d->slot = -1;
    int64_t at = 0;
    for (int i = 0; i < n; i++) {
        group *g = d->n_groups ? &d->g[d->n_groups - 1] : NULL;
        int64_t a0 = align_down(r[i].off), a1 = align_up(r[i].off + r[i].len);
        if (g && g->file == r[i].file && a0 <= g->off + g->len + MERGE_GAP) {
            int64_t end = a1 > g->off + g->len ? a1 : g->off + g->len;
            at += end - (g->off + g->len);
            g->len = end - g->off;
            if (r[i].off + r[i].len > g->end) g->end = r[i].off + r[i].len;
        } else {
            g = &d->g[d->n_groups++];
            g->file = r[i].file; g->off = a0; g->len = a1 - a0; g->end = r[i].off + r[i].len; g->slot_off = at;
            at += g->len;
        }
        d->at[r[i].ptr] = g->slot_off + (r[i].off - g->off);
    }
    if (at > s->slot_bytes) s->slot_bytes = at;
    return 0;
}

/* ---- readers ----------------------------------------------------------------------------------- */
/* one request: 0, or -1 with msg */
static int do_read(cpumla_stream *s, const request *r, char *msg, size_t cap) {
    int fd = s->fd[r->file];
    int64_t got = 0;
    while (got < r->len) {
        ssize_t k = pread(fd, r->dst + got, (size_t)(r->len - got), r->off + got);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && errno == EINVAL && fd != s->fd_buf[r->file]) {
            if (got > 0) break;                          /* a short direct read at the end of the file */
            fd = s->fd_buf[r->file];                     /* this file system refuses O_DIRECT here */
            continue;
        }
        if (k < 0) {
            snprintf(msg, cap, "%s: read error at byte %lld: %s", s->path[r->file], (long long)(r->off + got),
                     strerror(errno));
            return -1;
        }
        if (k == 0) break;
        got += k;
    }
    if (got < r->need) {
        snprintf(msg, cap, "%s: the file ends before byte %lld, which the model reads (was it cut short?)",
                 s->path[r->file], (long long)(r->off + r->need));
        return -1;
    }
    return 0;
}

void *stream_reader(void *p) {
    cpumla_stream *s = p;
    char msg[240];
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->stop && s->q_len == 0) pthread_cond_wait(&s->work, &s->mu);
        if (s->stop) break;
        request r = s->q[s->q_head];
        s->q_head = (s->q_head + 1) % s->q_cap;
        s->q_len--;
        if (s->inflight++ == 0) s->busy_t0 = stream_now();
        pthread_mutex_unlock(&s->mu);
        int rc = do_read(s, &r, msg, sizeof msg);
        pthread_mutex_lock(&s->mu);
        if (--s->inflight == 0) s->st.busy_seconds += stream_now() - s->busy_t0;
        slot *sl = &s->slots[r.slot];
        if (rc != 0 && !sl->failed) {
            sl->failed = 1;
            memcpy(sl->msg, msg, sizeof sl->msg);
        }
        if (--sl->pending == 0) {
            sl->state = SLOT_READY;
            pthread_cond_broadcast(&s->done);
        }
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* the ring is sized for every slot's requests at once */
void stream_enqueue(cpumla_stream *s, int64_t si, const expert_desc *d, int urgent) {
    slot *sl = &s->slots[si];
    int64_t n = requests_of(d);
    if (urgent) s->q_head = (s->q_head - n + s->q_cap) % s->q_cap;      /* room at the front, filled in order */
    int64_t at = urgent ? s->q_head : (s->q_head + s->q_len) % s->q_cap;
    for (int g = 0; g < d->n_groups; g++) {
        const group *gr = &d->g[g];
        for (int64_t o = 0; o < gr->len; o += CHUNK) {
            request r = {.slot = (int32_t)si, .file = gr->file, .off = gr->off + o,
                         .len = gr->len - o < CHUNK ? gr->len - o : CHUNK, .dst = sl->mem + gr->slot_off + o};
            int64_t real = gr->end - r.off;
            r.need = real < 0 ? 0 : real < r.len ? real : r.len;
            s->q[at] = r;
            at = (at + 1) % s->q_cap;
            sl->pending++;
        }
        s->st.bytes_read += gr->len;
    }
    s->q_len += n;
    s->st.reads++;
    pthread_cond_broadcast(&s->work);
}

/* ---- the direct-read probe --------------------------------------------------------------------- */
typedef struct {
    int fd;
    int64_t size, next;
    int failed;
    pthread_mutex_t mu;
    char msg[240];
    const char *path;
} probe_job;

static void *probe_reader(void *p) {
    probe_job *j = p;
    uint8_t *buf = NULL;
    if (posix_memalign((void **)&buf, (size_t)ALIGN, (size_t)CHUNK) != 0) {
        pthread_mutex_lock(&j->mu);
        j->failed = 1;
        snprintf(j->msg, sizeof j->msg, "out of memory");
        pthread_mutex_unlock(&j->mu);
        return NULL;
    }
    for (;;) {
        pthread_mutex_lock(&j->mu);
        int64_t off = j->next;
        j->next += CHUNK;
        int stop = j->failed || off >= j->size;
        pthread_mutex_unlock(&j->mu);
        if (stop) break;
        ssize_t k;
        do k = pread(j->fd, buf, (size_t)CHUNK, off); while (k < 0 && errno == EINTR);
        if (k < 0) {
            pthread_mutex_lock(&j->mu);
            j->failed = 1;
            snprintf(j->msg, sizeof j->msg, "%s: read error at byte %lld: %s", j->path, (long long)off, strerror(errno));
            pthread_mutex_unlock(&j->mu);
            break;
        }
    }
    free(buf);
    return NULL;
}

double cpumla_disk_probe(const char *path, int64_t bytes, int32_t threads, int64_t *read_bytes) {
    char msg[400];
    if (read_bytes) *read_bytes = 0;
    if (threads < 1 || threads > 256) threads = 8;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_DIRECT);
    if (fd < 0 && errno == EINVAL) fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        snprintf(msg, sizeof msg, "%s: cannot open: %s", path, strerror(errno));
        if (fd >= 0) close(fd);
        cpumla_set_error(msg);
        return -1;
    }
    probe_job j = {.fd = fd, .size = align_down(bytes < st.st_size ? bytes : st.st_size), .path = path};
    if (j.size <= 0) j.size = align_down(st.st_size);
    pthread_mutex_init(&j.mu, NULL);
    pthread_t th[256];
    double t0 = stream_now();
    int made = 0;
    for (; made < threads; made++)
        if (pthread_create(&th[made], NULL, probe_reader, &j) != 0) break;
    for (int i = 0; i < made; i++) pthread_join(th[i], NULL);
    double dt = stream_now() - t0;
    close(fd);
    pthread_mutex_destroy(&j.mu);
    if (j.failed || made == 0 || j.size <= 0) {
        cpumla_set_error(j.failed ? j.msg : j.size <= 0 ? "the file is too small to probe" : "cannot start readers");
        return -1;
    }
    if (read_bytes) *read_bytes = j.size;
    return (double)j.size / (dt > 0 ? dt : 1e-9);
}
