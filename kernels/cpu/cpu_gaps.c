/* kernels/cpu/cpu_gaps.c: the gap recorder (kernels/backend.h, mt_cpu_gaps_*): the smallest
 * k-th minus (k+1)-th candidate gap per kind of top-k choice, noted by the router and the
 * indexer selection while recording is on. */
#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"

bool cpu_gaps_on;
static mt_cpu_gaps g_gaps = { { INFINITY, INFINITY, INFINITY }, { 0, 0, 0 } };

void mt_cpu_gaps_reset(void) {
    for (int k = 0; k < MT_GAP_N; k++) {
        g_gaps.min[k] = INFINITY;
        g_gaps.count[k] = 0;
    }
}

void mt_cpu_gaps_record(bool on) { cpu_gaps_on = on; }

void mt_cpu_gaps_get(mt_cpu_gaps *out) { *out = g_gaps; }

void mt_cpu_gaps_note(mt_gap_kind kind, double gap) {
    MT_ASSERT(kind >= 0 && kind < MT_GAP_N);
    if (!cpu_gaps_on) return;
#pragma omp critical(mt_cpu_gaps)
    {
        g_gaps.count[kind]++;
        if (!(gap >= g_gaps.min[kind])) g_gaps.min[kind] = gap; /* a NaN gap sticks as the minimum */
    }
}
