/* kernels/cuda/cuda_step.cu: what the graph form of decode needs from the CUDA backend: stream
 * capture into CUDA graphs, and the ops that read a run-time position or token id from device
 * memory instead of a kernel argument (a captured graph replays its kernel arguments as they
 * were at capture). Three tiers per op (STYLE.md 7). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"

/* ---- graphs ---- */

struct mt_graph {
    cudaGraphExec_t exec;
};

extern "C" mt_status cu_graph_begin(mt_backend *be) {
    MT_CUDA_CHECK(cudaStreamBeginCapture(cu_stream(be), cudaStreamCaptureModeThreadLocal));
    return MT_OK;
}

extern "C" mt_status cu_graph_end(mt_backend *be, mt_graph **out) {
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

extern "C" mt_status cu_graph_launch(mt_backend *be, mt_graph *g) {
    MT_CUDA_CHECK(cudaGraphLaunch(g->exec, cu_stream(be)));
    return MT_OK;
}

extern "C" void cu_graph_free(mt_backend *be, mt_graph *g) {
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
    int n, H, V;
} embed_dev_params;

template <mt_dtype DT>
static __global__ void embed_dev_kernel(embed_dev_params p) {
    const int i = blockIdx.x;
    int id = p.ids[i];
    if (id < 0 || id >= p.V) id = 0; /* validated on the host before the upload; never read out of bounds */
    for (int d = threadIdx.x; d < p.H; d += blockDim.x) {
        const size_t k = (size_t)id * p.H + d;
        float v;
        if (DT == MT_BF16) v = __bfloat162float(((const __nv_bfloat16 *)p.table)[k]);
        else if (DT == MT_F16) v = __half2float(((const __half *)p.table)[k]);
        else v = ((const float *)p.table)[k];
        p.out[(size_t)i * p.H + d] = v;
    }
}

extern "C" void cu_embed_dev(mt_backend *be, float *out, const mt_weight *table, const int32_t *ids, int n) {
    if (n <= 0) return;
    embed_dev_params p = { out, table->data, ids, n, (int)table->cols, (int)table->rows };
    cudaStream_t s = cu_stream(be);
    switch (table->dtype) {
    case MT_F32: embed_dev_kernel<MT_F32><<<n, 256, 0, s>>>(p); break;
    case MT_F16: embed_dev_kernel<MT_F16><<<n, 256, 0, s>>>(p); break;
    default: embed_dev_kernel<MT_BF16><<<n, 256, 0, s>>>(p); break;
    }
    cu_check_launch(be, "embed_dev");
}

/* ---- copy_rows_at ---- */

typedef struct rows_at_params {
    float *base;          /* [>= *pos + n, row] */
    const float *src;     /* [n, row] */
    const int32_t *pos;   /* device */
    int64_t count;        /* n * row */
    int64_t row;
} rows_at_params;

static __global__ void copy_rows_at_kernel(rows_at_params p) {
    const int64_t off = (int64_t)*p.pos * p.row;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < p.count; e += (int64_t)gridDim.x * blockDim.x)
        p.base[off + e] = p.src[e];
}

extern "C" void cu_copy_rows_at(mt_backend *be, float *base, int64_t row, const int32_t *pos, const float *src, int n) {
    const int64_t count = row * n;
    if (count <= 0) return;
    rows_at_params p = { base, src, pos, count, row };
    const int64_t blocks = (count + 255) / 256;
    copy_rows_at_kernel<<<(unsigned)(blocks < 1024 ? blocks : 1024), 256, 0, cu_stream(be)>>>(p);
    cu_check_launch(be, "copy_rows_at");
}
