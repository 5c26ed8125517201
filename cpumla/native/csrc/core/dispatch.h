/* dispatch.h: the chosen kernel table and library-internal helpers shared by dispatch.c and ops.c. */
#ifndef CPUMLA_DISPATCH_H
#define CPUMLA_DISPATCH_H
#include <stddef.h>
#include "core/kernels.h"

#ifndef CPUMLA_VERSION
#define CPUMLA_VERSION "0.1.0"
#endif

extern cpumla_kernels cpumla_k;     /* filled by cpumla_init */
void cpumla_ensure_init(void);      /* cpumla_init(NULL) on first use */
void cpumla_set_error(const char *msg);   /* the calling thread's cpumla_last_error */

/* A GEMV job over weights that take quantized activations (Q8 / Q4 / E2M1 products, quant.h): the
 * caller quantizes x once and every task multiplies from that (quant.c), rather than each task
 * quantizing it again (~0.3 us a task at 2048 columns). The results are bit for bit the table's gemv.
 *   cpumla_qx_bytes: bytes of one quantized row for w; 0 when w's gemv takes x as it is.
 *   cpumla_quant_rows: n rows of x (ldx apart) -> qx, cpumla_qx_bytes(w) bytes apart.
 *   cpumla_gemv_qx: y[i] = W[r0 + i, :] . x for rows [r0, r1), from qx. */
int64_t cpumla_qx_bytes(const cpumla_weight *w);
void cpumla_quant_rows(const cpumla_weight *w, const float *x, int64_t ldx, int64_t n, void *qx);
void cpumla_gemv_qx(const cpumla_weight *w, const void *qx, float *y, int64_t r0, int64_t r1);

#endif
