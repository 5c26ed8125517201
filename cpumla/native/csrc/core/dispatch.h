/* dispatch.h: the chosen kernel table and the library-internal helpers of dispatch.c. */
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

#endif

