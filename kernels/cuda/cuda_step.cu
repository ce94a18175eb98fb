/* kernels/cuda/cuda_step.cu: what the graph form of decode needs from the CUDA backend: stream
 * capture into CUDA graphs, and the ops that read a run-time position or token id from device
 * memory instead of a kernel argument (a captured graph replays its kernel arguments as they
 * were at capture). Three tiers per op: static kernels, a launcher, the op. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"

/* ---- graphs ---- */

struct mt_graph {
    cudaGraphExec_t exec;
};

static mt_status cu_graph_begin(mt_backend *be) {
    MT_CUDA_CHECK(cudaStreamBeginCapture(cu_stream(be), cudaStreamCaptureModeThreadLocal));
    return MT_OK;
}

static mt_status cu_graph_end(mt_backend *be, mt_graph **out) {
    *out = NULL;
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture(cu_stream(be), &g);
    if (e != cudaSuccess || !g) {
        /* An op that cannot be captured invalidated the capture; clear the sticky error so the
         * stream runs eagerly again. */
        mt_log(MT_LOG_WARN, "cuda graph: capture failed: %s", cudaGetErrorString(e));
        (void)cudaGetLastError();
        if (g) cudaGraphDestroy(g);
        return MT_ERR_BACKEND;
    }
    mt_graph *mg = (mt_graph *)calloc(1, sizeof *mg);
    mt_status st = MT_OK;
    if (!mg) { cudaGraphDestroy(g); return MT_ERR_NOMEM; }
    MT_CUDA_CHECK_GOTO(cudaGraphInstantiate(&mg->exec, g, 0), st, fail);
    cudaGraphDestroy(g);
    *out = mg;
    return MT_OK;
fail:
    cudaGraphDestroy(g);
    free(mg);
    return st;
}

static mt_status cu_graph_launch(mt_backend *be, mt_graph *g) {
    MT_CUDA_CHECK(cudaGraphLaunch(g->exec, cu_stream(be)));
    return MT_OK;
}

static void cu_graph_free(mt_backend *be, mt_graph *g) {
    (void)be;
    if (!g) return;
    MT_CUDA_WARN(cudaGraphExecDestroy(g->exec));
    free(g);
}

/* ---- embed_dev ---- */

typedef struct embed_dev_params {
    float *out;          /* [n, H] */
    const void *table;   /* [V, H] of dtype */
    const int32_t *ids;  /* [n] device */
    int n, H, V;         /* V: the table's rows */
    int64_t row0;        /* the table's first id */
} embed_dev_params;

/* Block (column block, row i): thread t copies EMBED_PER consecutive elements of the row, all
 * loaded before the first store (one block looping over a 4096-wide row kept one HBM load in
 * flight a thread: ~8 us a decode step). */
enum { EMBED_THREADS = 128, EMBED_PER = 8 };
template <mt_dtype DT>
static __global__ void embed_dev_kernel(embed_dev_params p) {
    cu_pdl_wait(); /* launched for PDL (cu_launch_pdl_k) */
    cu_pdl_trigger();
    const int i = blockIdx.y, d0 = (blockIdx.x * EMBED_THREADS + threadIdx.x) * EMBED_PER;
    const int64_t id = p.ids[i] - p.row0;
    const bool mine = id >= 0 && id < p.V; /* else another shard's row: zeros */
    float v[EMBED_PER];
#pragma unroll
    for (int u = 0; u < EMBED_PER; u++) {
        const int d = d0 + u;
        const size_t k = (size_t)id * p.H + d;
        v[u] = 0.f;
        if (mine && d < p.H) {
            if (DT == MT_BF16) v[u] = __bfloat162float(((const __nv_bfloat16 *)p.table)[k]);
            else if (DT == MT_F16) v[u] = __half2float(((const __half *)p.table)[k]);
            else v[u] = ((const float *)p.table)[k];
        }
    }
#pragma unroll
    for (int u = 0; u < EMBED_PER; u++)
        if (d0 + u < p.H) p.out[(size_t)i * p.H + d0 + u] = v[u];
}

static void cu_embed_dev(mt_backend *be, float *out, const mt_weight *table, const int32_t *ids, int n) {
    if (n <= 0) return;
    embed_dev_params p = { out, table->data, ids, n, (int)table->cols, (int)table->rows, table->row0 };
    cudaStream_t s = cu_stream(be);
    const dim3 g((unsigned)((p.H + EMBED_THREADS * EMBED_PER - 1) / (EMBED_THREADS * EMBED_PER)), (unsigned)n);
    switch (table->dtype) {
    case MT_F32: cu_launch_pdl_k(embed_dev_kernel<MT_F32>, dim3(g), dim3(EMBED_THREADS), 0, s, p); break;
    case MT_F16: cu_launch_pdl_k(embed_dev_kernel<MT_F16>, dim3(g), dim3(EMBED_THREADS), 0, s, p); break;
    default: cu_launch_pdl_k(embed_dev_kernel<MT_BF16>, dim3(g), dim3(EMBED_THREADS), 0, s, p); break;
    }
    cu_check_launch(be, "embed_dev");
}

/* ---- copy_rows_at: a cache write into a paged cache, at a host or run-time position ---- */

typedef struct rows_at_params {
    mt_paged dst;         /* [n_pages, page, row] */
    const int32_t *bt;    /* block table (device) */
    const float *src;     /* [n, row] */
    const int32_t *pos;   /* device, or NULL: the first position is t0 */
    int t0;               /* position of row 0 when pos is NULL */
    int i0;               /* first row of this launch (grids of at most 65535 rows) */
    bool vec4;            /* row % 4 == 0 and dst.base, src 16-byte aligned: float4 copies */
} rows_at_params;

/* Block = (a stretch of columns, row i): the row's page is looked up once, then the columns are
 * copied (float4 when aligned: a row of row floats starts 16-byte aligned on a page of such rows). */
static __global__ void copy_rows_at_kernel(rows_at_params p) {
    const int i = p.i0 + (int)blockIdx.y;
    const int64_t t = (int64_t)(p.pos ? *p.pos : p.t0) + i;
    cu_copy_row_x(mt_paged_at(p.dst, p.bt, t), p.src + (int64_t)i * p.dst.row, p.dst.row, p.vec4);
}

static void cu_copy_rows_at(mt_backend *be, mt_paged dst, const int32_t *bt, int t0, const int32_t *pos,
                            const float *src, int n) {
    MT_ASSERT(n >= 0 && t0 >= 0 && dst.page > 0 && dst.row > 0 && bt);
    rows_at_params p = { dst, bt, src, pos, t0, 0, false };
    p.vec4 = dst.row % 4 == 0 && cu_aligned16(dst.base) && cu_aligned16(src);
    const int64_t per = p.vec4 ? dst.row / 4 : dst.row, bx = (per + 255) / 256;
    for (p.i0 = 0; p.i0 < n; p.i0 += 65535) {
        const int rows = n - p.i0 < 65535 ? n - p.i0 : 65535;
        copy_rows_at_kernel<<<dim3((unsigned)(bx < 64 ? bx : 64), (unsigned)rows), 256, 0, cu_stream(be)>>>(p);
        cu_check_launch(be, "copy_rows_at");
    }
}

extern "C" void cu_step_fill(mt_backend_ops *t) {
    t->graph_begin = cu_graph_begin;
    t->graph_end = cu_graph_end;
    t->graph_launch = cu_graph_launch;
    t->graph_free = cu_graph_free;
    t->embed_dev = cu_embed_dev;
    t->copy_rows_at = cu_copy_rows_at;
}
