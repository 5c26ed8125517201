/* tp_shm.c: the shared-memory communicator of tensor-parallel ranks on one machine (cpumla.h's
 * cpumla_shm). The region, mapped by every rank:
 *
 *   world header lines (64 bytes each: seq, pid, failed), then slots [2][world][slot_bytes]
 *
 * Operation k (counted alike on every rank) writes this rank's data into slot [k & 1][rank], stores
 * seq = k (release), waits until every rank's seq >= k (acquire), then reads. Two slot sets are
 * enough: a rank writes set k & 1 again at operation k + 2, after its wait of k + 1 saw every rank
 * arrive there, which each does only once done reading k. An all-reduce sums the slots in rank order,
 * so every rank gets the same bits; data larger than a slot goes in slot-sized pieces, each an
 * operation. Waits are polled, so a rank that dies never leaves the others blocked. */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sched.h>
#include <unistd.h>
#include "core/common.h"
#include "core/dispatch.h"

typedef struct {
    _Atomic int64_t seq;
    _Atomic int64_t pid;
    _Atomic int64_t failed;
    int64_t pad[5];
} shm_line;

struct cpumla_shm {
    uint8_t *base;
    shm_line *lines;
    uint8_t *slots;
    int32_t rank, world;
    int64_t slot_bytes, k;
    double timeout;
    cpumla_comm_stats stats;
};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int64_t header_bytes(int32_t world) { return (int64_t)world * (int64_t)sizeof(shm_line); }

int64_t cpumla_shm_bytes(int32_t world, int64_t slot_bytes) {
    if (world < 1 || slot_bytes < 64) return -1;
    return header_bytes(world) + 2 * (int64_t)world * ((slot_bytes + 63) & ~(int64_t)63);
}

cpumla_shm *cpumla_shm_new(void *base, int32_t rank, int32_t world, int64_t slot_bytes, double timeout_s) {
    if (!base || world < 1 || rank < 0 || rank >= world || slot_bytes < 64 || !(timeout_s > 0)) {
        cpumla_set_error("shm: bad region, rank, world, slot size or timeout");
        return NULL;
    }
    cpumla_shm *s = calloc(1, sizeof *s);
    if (!s) {
        cpumla_set_error("shm: out of memory");
        return NULL;
    }
    s->base = base;
    s->lines = base;
    s->slot_bytes = (slot_bytes + 63) & ~(int64_t)63;
    s->slots = s->base + header_bytes(world);
    s->rank = rank;
    s->world = world;
    s->timeout = timeout_s;
    s->k = atomic_load(&s->lines[rank].seq);
    atomic_store(&s->lines[rank].pid, (int64_t)getpid());
    return s;
}

void cpumla_shm_free(cpumla_shm *s) { free(s); }

static uint8_t *slot(const cpumla_shm *s, int64_t k, int32_t r) {
    return s->slots + ((size_t)(k & 1) * (size_t)s->world + (size_t)r) * (size_t)s->slot_bytes;
}

/* whether process pid has exited (gone, or a zombie its parent has not reaped) */
static int exited(int64_t pid) {
    if (pid <= 0) return 0;
    if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) return 1;
#ifdef __linux__
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t got = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[got] = 0;
    const char *p = strrchr(buf, ')');
    return p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
#else
    return 0;
#endif
}

static void sleep_us(long us) {
    struct timespec t = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&t, NULL);
}

/* A rank's failed word: 0, or 1 + 4 * culprit + why (the rank whose exit, silence or own error ended
 * it), so that every rank names the same cause. */
enum { WHY_OWN = 0, WHY_EXITED = 1, WHY_SILENT = 2 };

static void describe(const cpumla_shm *s, int32_t r, int why, char *msg, size_t size) {
    long long pid = (long long)atomic_load(&s->lines[r].pid);
    if (why == WHY_EXITED) snprintf(msg, size, "tensor-parallel rank %d (pid %lld) exited", r, pid);
    else if (why == WHY_SILENT)
        snprintf(msg, size, "tensor-parallel rank %d (pid %lld) did not answer within %.3g s", r, pid, s->timeout);
    else snprintf(msg, size, "tensor-parallel rank %d (pid %lld) stopped", r, pid);
}

static int fail_with(cpumla_shm *s, int32_t culprit, int why) {
    char msg[200];
    describe(s, culprit, why, msg, sizeof msg);
    atomic_store(&s->lines[s->rank].failed, 1 + 4 * (int64_t)culprit + why);
    cpumla_set_error(msg);
    return -1;
}

/* Fails this rank with the cause in rank q's failed word f (q's own failure when f names no rank). */
static int fail_as(cpumla_shm *s, int32_t q, int64_t f) {
    int32_t culprit = (int32_t)((f - 1) / 4);
    int why = (int)((f - 1) % 4);
    if (culprit < 0 || culprit >= s->world) culprit = q, why = WHY_OWN;
    return fail_with(s, culprit, why);
}

/* -1 (this rank failed with its cause) when another rank has failed, else 0. */
static int others_failed(cpumla_shm *s) {
    for (int32_t q = 0; q < s->world; q++) {
        int64_t f = q == s->rank ? 0 : atomic_load(&s->lines[q].failed);
        if (f) return fail_as(s, q, f);
    }
    return 0;
}

/* Until every rank has published operation s->k; -1 (error set, this rank marked failed) when one
 * has exited, failed or (unless idle) stayed away past the timeout. */
static int wait_all(cpumla_shm *s, int idle) {
    double t0 = 0;
    for (int32_t r = 0; r < s->world; r++) {
        int64_t spins = 0;
        double last_check = 0;
        while (atomic_load_explicit(&s->lines[r].seq, memory_order_acquire) < s->k) {
            if (++spins < 4096) {
#if defined(__x86_64__) || defined(__i386__)
                __builtin_ia32_pause();
#endif
                continue;
            }
            double t = now();
            if (t0 == 0) t0 = t;
            if (t - last_check > 0.02) {
                last_check = t;
                if (others_failed(s) != 0) return -1;
                for (int32_t q = 0; q < s->world; q++)
                    if (q != s->rank && exited(atomic_load(&s->lines[q].pid))) return fail_with(s, q, WHY_EXITED);
                if (!idle && t - t0 > s->timeout) return fail_with(s, r, WHY_SILENT);
            }
            /* a few ms of yields, then sleeps that grow with the wait (an idle rank costs ~nothing) */
            double waited = t - t0;
            if (waited < 0.002) sched_yield();
            else sleep_us(waited < 0.1 ? 50 : waited < 1.0 ? 200 : 1000);
        }
    }
    return 0;
}

static int publish_wait(cpumla_shm *s, int idle) {
    int64_t f = atomic_load(&s->lines[s->rank].failed);
    if (f) return fail_as(s, s->rank, f);          /* after a failure nothing more is exchanged */
    atomic_store_explicit(&s->lines[s->rank].seq, s->k, memory_order_release);
    if (wait_all(s, idle) != 0) return -1;
    return others_failed(s);                       /* a rank that arrived, then gave up on another */
}

int cpumla_shm_all_reduce(void *p, float *buf, int64_t n) {
    cpumla_shm *s = p;
    double t = now();
    int64_t per = s->slot_bytes / (int64_t)sizeof(float);
    for (int64_t i0 = 0; i0 < n; i0 += per) {
        int64_t m = n - i0 < per ? n - i0 : per;
        s->k++;
        memcpy(slot(s, s->k, s->rank), buf + i0, sizeof(float) * (size_t)m);
        if (publish_wait(s, 0) != 0) return -1;
        float *out = buf + i0;
        memcpy(out, slot(s, s->k, 0), sizeof(float) * (size_t)m);
        for (int32_t r = 1; r < s->world; r++) {
            const float *x = (const float *)slot(s, s->k, r);
            for (int64_t i = 0; i < m; i++) out[i] += x[i];
        }
    }
    s->stats.all_reduces++;
    s->stats.seconds += now() - t;
    return 0;
}

int cpumla_shm_gather(void *p, float *buf, int64_t rows, int64_t ld, int64_t col0, int64_t cols) {
    cpumla_shm *s = p;
    double t = now();
    int64_t head = 2 * (int64_t)sizeof(int64_t), fit = (s->slot_bytes - head) / (int64_t)sizeof(float);
    if (cols > fit) {
        cpumla_set_error("shm gather: a row is wider than a slot");
        return -1;
    }
    int64_t per = cols > 0 ? fit / cols : rows;
    for (int64_t r0 = 0; r0 < rows; r0 += per) {
        int64_t m = rows - r0 < per ? rows - r0 : per;
        s->k++;
        int64_t *h = (int64_t *)slot(s, s->k, s->rank);
        h[0] = col0;
        h[1] = cols;
        float *d = (float *)(h + 2);
        for (int64_t i = 0; i < m; i++)
            memcpy(d + i * cols, buf + (r0 + i) * ld + col0, sizeof(float) * (size_t)cols);
        if (publish_wait(s, 0) != 0) return -1;
        if (s->rank != 0) continue;
        for (int32_t r = 1; r < s->world; r++) {
            const int64_t *hr = (const int64_t *)slot(s, s->k, r);
            const float *dr = (const float *)(hr + 2);
            for (int64_t i = 0; i < m; i++)
                memcpy(buf + (r0 + i) * ld + hr[0], dr + i * hr[1], sizeof(float) * (size_t)hr[1]);
        }
    }
    s->stats.gathers++;
    s->stats.seconds += now() - t;
    return 0;
}

int cpumla_shm_broadcast(cpumla_shm *s, void *buf, int64_t bytes, int32_t idle) {
    double t = now();
    for (int64_t b0 = 0; b0 < bytes || (bytes == 0 && b0 == 0); b0 += s->slot_bytes) {
        int64_t m = bytes - b0 < s->slot_bytes ? bytes - b0 : s->slot_bytes;
        s->k++;
        if (s->rank == 0 && m > 0) memcpy(slot(s, s->k, 0), (uint8_t *)buf + b0, (size_t)m);
        if (publish_wait(s, idle) != 0) return -1;
        if (s->rank != 0 && m > 0) memcpy((uint8_t *)buf + b0, slot(s, s->k, 0), (size_t)m);
        if (bytes == 0) break;
    }
    s->stats.broadcasts++;
    s->stats.seconds += now() - t;
    return 0;
}

void cpumla_shm_fail(cpumla_shm *s) {
    if (!atomic_load(&s->lines[s->rank].failed)) atomic_store(&s->lines[s->rank].failed, 1 + 4 * (int64_t)s->rank + WHY_OWN);
}

void cpumla_shm_comm(cpumla_shm *s, cpumla_comm *out) {
    memset(out, 0, sizeof *out);
    out->ctx = s;
    out->rank = s->rank;
    out->world = s->world;
    out->all_reduce = cpumla_shm_all_reduce;
    out->gather = cpumla_shm_gather;
}

void cpumla_shm_get_stats(const cpumla_shm *s, cpumla_comm_stats *out) { *out = s->stats; }

void cpumla_shm_reset_stats(cpumla_shm *s) { memset(&s->stats, 0, sizeof s->stats); }
