/* expert_stream.h: what moe.c asks of a streamed expert table (expert_stream.c; the public side is
 * cpumla_stream in cpumla.h).
 *
 * A table registered with a stream keeps its experts on disk; moe.c asks for the ones its tokens chose
 * before computing with them. An expert it holds (stream_take returned 1, or a later stream_wait
 * returned 0) stays in its slot, at the pointers the live table gives, until stream_drop. */
#ifndef CPUMLA_EXPERT_STREAM_H
#define CPUMLA_EXPERT_STREAM_H
#include <stdint.h>
#include "core/common.h"

typedef struct stream_table stream_table;

/* the stream table registered for `experts` (the table the model describes), or NULL: a table in memory */
CPUMLA_INTERNAL stream_table *stream_table_of(const cpumla_expert *experts);
/* the experts it has */
CPUMLA_INTERNAL int64_t stream_size(const stream_table *t);
/* the table whose held experts point into their slots */
CPUMLA_INTERNAL const cpumla_expert *stream_live(const stream_table *t);
/* Holds expert e: 1 when it is read into its slot already, 2 when it is being read (queued now, or by a
 * prefetch: stream_wait before using it), 0 when every slot is held (nothing done), -1 on error. A slot
 * found (1, or 2 from a prefetch) counts as a hit. */
CPUMLA_INTERNAL int stream_take(stream_table *t, int32_t e);
/* Queues the reads of those of experts ids[0 .. n) not in a slot, behind every read a call asked for,
 * into slots no call holds: the experts a later call will likely ask for. Returns how many. */
CPUMLA_INTERNAL int stream_prefetch(stream_table *t, const int32_t *ids, int64_t n);
/* The experts the next MoE layer (its routed table `next`, router gate and r) will likely route one
 * token to: its router applied early to this layer's FFN input x [D] (hash routing: from the token id).
 * Nothing when `next` is not streamed. Their reads are queued (stream_prefetch) by stream_flush, which
 * the current call runs once it holds its own experts, so that none of those is the slot a prediction
 * takes. 0, or -1 (cpumla_last_error). */
CPUMLA_INTERNAL int stream_predict(const cpumla_expert *next, const cpumla_weight *gate, const cpumla_router *r,
                                   const float *x, int64_t D, const int64_t *token_id);
CPUMLA_INTERNAL void stream_flush(stream_table *t);
/* waits until held expert e is read: 0, or -1 (cpumla_last_error: the file and the read that failed) */
CPUMLA_INTERNAL int stream_wait(stream_table *t, int32_t e);
/* lets held expert e go (its slot may then be reused) */
CPUMLA_INTERNAL void stream_drop(stream_table *t, int32_t e);

#endif
