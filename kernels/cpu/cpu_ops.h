/* kernels/cpu/cpu_ops.h: internal to the CPU backend. The op families live in one file each, their
 * ops static there; each file exports one filler that sets its family's slots of the table
 * (kernels/backend.h, the one place an op's signature is written). cpu_backend.c builds the table
 * from its own slots (memory, lifetime) and the fillers.
 *   cpu_dense.c  embed, cache writes, matmul, norms, swiglu, sigmoid, l2norm, argmax
 *   cpu_moe.c    router, routed experts
 *   cpu_kda.c    conv, decay gate, delta rule (recurrent and chunked), gated norm
 *   cpu_dsa.c    pool keys, indexer selection, sparse MLA
 *   cpu_hc.c     hyper-connections, head mean
 *   cpu_ple.c    the PLE memory's injection (gates, value, dilated conv)
 *   cpu_rows.c   the rows form (batched decode): one single-sequence op per row, through the table
 *   cpu_gaps.c   the gap recorder of the router's and the indexer's top-k choices */
#ifndef MT_CPU_OPS_H
#define MT_CPU_OPS_H

#include <math.h>

#include "kernels/backend.h"

void cpu_dense_fill(mt_backend_ops *t);
void cpu_moe_fill(mt_backend_ops *t);
void cpu_kda_fill(mt_backend_ops *t);
void cpu_dsa_fill(mt_backend_ops *t);
void cpu_hc_fill(mt_backend_ops *t);
void cpu_rows_fill(mt_backend_ops *t);
void cpu_ple_fill(mt_backend_ops *t);

/* The gap recorder is on (cpu_gaps.c): the ops compute and note their gaps only then. */
extern bool cpu_gaps_on;

/* Row r of w as fp32 into dst[w->cols] (cpu_dense.c). */
void cpu_weight_row(const mt_weight *w, int64_t r, float *dst);

/* Work (multiply-adds) below which an op stays on one thread: forking costs more than it saves,
 * and with the cores shared (router, workers, tests) waiting threads can cost far more. */
#define CPU_PAR_MIN_WORK ((int64_t)1 << 18)

static inline float cpu_sigmoidf(float x) { return 1.f / (1.f + expf(-x)); }
static inline float cpu_siluf(float x) { return x / (1.f + expf(-x)); }

#endif /* MT_CPU_OPS_H */
