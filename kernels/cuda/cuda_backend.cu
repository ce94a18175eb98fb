/* kernels/cuda/cuda_backend.cu: the CUDA backend's object, memory, weights and op table
 * (kernels/backend.h). One device, one non-blocking stream; every op is enqueued on it, and
 * upload/download/sync wait for it. A failing CUDA call is logged where it happens and recorded
 * in the backend's sticky status (cu_backend.sticky). */
#include <cublas_v2.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"

/* Runs a CUDA call; on failure logs it (call text, error string, file:line) and records it. */
#define CU_RECORD(be, call) MT_CUDA_(call, #call, cu_fail((be), mt_st_))

static cu_backend *cb_of(mt_backend *be) { return (cu_backend *)be; }

extern "C" struct CUstream_st *mt_cuda_backend_stream(mt_backend *be) { return cb_of(be)->stream; }

void cu_fail(mt_backend *be, mt_status st) {
    cu_backend *cb = cb_of(be);
    if (st != MT_OK && cb->sticky == MT_OK) cb->sticky = st;
}

/* ---- op timing (mt_cuda_profile) ---- */

enum { PROF_MAX = 96 };

struct cu_prof {
    double last;                  /* mt_now() at the previous mark */
    int n;
    const char *name[PROF_MAX];
    double sec[PROF_MAX];
    long calls[PROF_MAX];
};

void cu_prof_mark(mt_backend *be, const char *what) {
    cu_backend *cb = cb_of(be);
    struct cu_prof *p = cb->prof;
    if (!p) return;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(cb->stream, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone) {
        (void)cudaGetLastError();
        return;
    }
    MT_CUDA_WARN(cudaStreamSynchronize(cb->stream));
    const double now = mt_now();
    int k = 0;
    while (k < p->n && strcmp(p->name[k], what)) k++;
    if (k == p->n) {
        if (p->n == PROF_MAX) k = PROF_MAX - 1; /* full: lump into the last entry */
        else p->name[p->n++] = what;
    }
    p->sec[k] += now - p->last;
    p->calls[k]++;
    p->last = mt_now();
}

extern "C" int mt_cuda_profile_take(mt_backend *be, mt_cuda_op_time *rows, int max, double *total_ms) {
    cu_backend *cb = cb_of(be);
    struct cu_prof *p = cb->prof;
    if (total_ms) *total_ms = 0;
    if (!p) return 0;
    cu_prof_mark(be, "(after the last op)");
    cb->prof = NULL;
    double total = 0;
    for (int k = 0; k < p->n; k++) total += p->sec[k];
    if (total_ms) *total_ms = total * 1e3;
    bool used[PROF_MAX] = {false};
    for (int r = 0; r < p->n && r < max; r++) { /* selection: PROF_MAX rows at most */
        int best = -1;
        for (int k = 0; k < p->n; k++)
            if (!used[k] && (best < 0 || p->sec[k] > p->sec[best])) best = k;
        used[best] = true;
        rows[r] = mt_cuda_op_time{p->name[best], p->sec[best] * 1e3, p->calls[best]};
    }
    const int n = p->n < max ? p->n : max;
    free(p);
    return n;
}

extern "C" void mt_cuda_profile(mt_backend *be, bool on, const char *title) {
    cu_backend *cb = cb_of(be);
    if (on) {
        if (!cb->prof && !(cb->prof = (struct cu_prof *)calloc(1, sizeof *cb->prof))) return;
        memset(cb->prof, 0, sizeof *cb->prof);
        MT_CUDA_WARN(cudaStreamSynchronize(cb->stream));
        cb->prof->last = mt_now();
        return;
    }
    mt_cuda_op_time rows[PROF_MAX];
    double total = 0;
    const int n = mt_cuda_profile_take(be, rows, PROF_MAX, &total);
    if (n == 0) return;
    printf("op profile: %s: %.2f ms (each op synchronised)\n", title ? title : "", total);
    for (int r = 0; r < n; r++)
        printf("  %9.3f ms %5.1f%% %6ld  %s\n", rows[r].ms, total > 0 ? 100 * rows[r].ms / total : 0., rows[r].calls,
               rows[r].name);
    fflush(stdout);
}

void cu_check_launch(mt_backend *be, const char *op) {
    cu_prof_mark(be, op);
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) return;
    mt_log(MT_LOG_ERROR, "cuda backend: %s: kernel launch failed: %s", op, cudaGetErrorString(e));
    cu_fail(be, MT_ERR_BACKEND);
}

void cu_op_status(mt_backend *be, const char *op, mt_status st) {
    cu_prof_mark(be, op);
    if (st == MT_OK) return;
    mt_log(MT_LOG_ERROR, "cuda backend: %s failed: %s", op, mt_status_str(st));
    cu_fail(be, st);
}

static uint64_t cu_graph_epoch(mt_backend *be) { return cb_of(be)->scratch_epoch; }

void *cu_scratch(mt_backend *be, int slot, size_t bytes) {
    cu_backend *cb = cb_of(be);
    MT_ASSERT(slot >= 0 && slot < CU_SCRATCH_N);
    cu_buf *b = &cb->scratch[slot];
    if (b->bytes >= bytes && b->p) return b->p;
    /* Kernels queued earlier may still use the old buffer. */
    CU_RECORD(be, cudaStreamSynchronize(cb->stream));
    if (b->p) MT_CUDA_WARN(cudaFree(b->p));
    b->p = NULL;
    b->bytes = 0;
    cb->scratch_epoch++; /* graphs recorded over the old buffer are stale (cu_graph_epoch) */
    size_t want = bytes < ((size_t)1 << 20) ? ((size_t)1 << 20) : bytes + bytes / 4;
    void *p = NULL;
    if (cudaMalloc(&p, want) != cudaSuccess) {
        (void)cudaGetLastError();
        mt_log(MT_LOG_ERROR, "cuda backend: out of device memory for %zu bytes of scratch", want);
        cu_fail(be, MT_ERR_NOMEM);
        return NULL;
    }
    b->p = p;
    b->bytes = want;
    return p;
}

/* Forgets the last router output when [p, p + bytes) may have overwritten it (bytes 0: always). */
static void route_forget(cu_backend *cb, const void *p, size_t bytes) {
    if (!cb->route_idx) return;
    const char *a = (const char *)cb->route_idx, *e = a + (size_t)cb->route_len * sizeof(int32_t);
    const char *q = (const char *)p;
    if (bytes == 0 || (q < e && q + bytes > a)) cb->route_idx = NULL;
}

/* ---- lifetime ---- */

static void cu_destroy(mt_backend *be) {
    cu_backend *cb = cb_of(be);
    if (!cb) return;
    MT_CUDA_WARN(cudaStreamSynchronize(cb->stream));
    for (int i = 0; i < CU_SCRATCH_N; i++)
        if (cb->scratch[i].p) MT_CUDA_WARN(cudaFree(cb->scratch[i].p));
    cu_moe_cache_free(cb);
    cu_moe_grouped_free(cb);
    if (cb->blas) MT_CUBLAS_WARN(cublasDestroy(cb->blas));
    if (cb->blas_ws) MT_CUDA_WARN(cudaFree(cb->blas_ws));
    if (cb->counters) MT_CUDA_WARN(cudaFree(cb->counters));
    for (int i = 0; i < MT_TICKETS; i++)
        if (cb->tk_done[i]) MT_CUDA_WARN(cudaEventDestroy(cb->tk_done[i]));
    if (cb->tk_ring) MT_CUDA_WARN(cudaFreeHost(cb->tk_ring));
    MT_CUDA_WARN(cudaStreamDestroy(cb->stream));
    free(cb->prof);
    free(cb);
}

/* A cuBLAS handle on `stream` with a workspace of its own (cublasSetStream resets the workspace,
 * so it comes second), host pointer mode. Partial state is left for the caller to free. */
extern "C" mt_status cu_blas_make(struct cublasContext **blas, void **ws, cudaStream_t stream) {
    MT_CUBLAS_CHECK(cublasCreate(blas));
    MT_CUBLAS_CHECK(cublasSetStream(*blas, stream));
    MT_CUDA_CHECK(cudaMalloc(ws, CU_BLAS_WS_BYTES));
    MT_CUBLAS_CHECK(cublasSetWorkspace(*blas, *ws, CU_BLAS_WS_BYTES));
    MT_CUBLAS_CHECK(cublasSetPointerMode(*blas, CUBLAS_POINTER_MODE_HOST));
    return MT_OK;
}

/* The cuBLAS handle of cu_gemm_tc, on cb's stream. Partial state is freed by cu_destroy. */
static mt_status cu_blas_init(cu_backend *cb) { return cu_blas_make(&cb->blas, &cb->blas_ws, cb->stream); }

/* ---- memory ---- */

static void *cu_alloc(mt_backend *be, size_t bytes) {
    cu_backend *cb = cb_of(be);
    void *p = NULL;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        (void)cudaGetLastError(); /* OOM is the caller's to handle: not sticky */
        return NULL;
    }
    route_forget(cb, NULL, 0);
    if (cudaMemsetAsync(p, 0, bytes, cb->stream) != cudaSuccess) {
        (void)cudaGetLastError();
        MT_CUDA_WARN(cudaFree(p));
        return NULL;
    }
    return p;
}

static void cu_free(mt_backend *be, void *p) {
    if (!p) return;
    route_forget(cb_of(be), NULL, 0);
    CU_RECORD(be, cudaFree(p)); /* synchronises the device: queued kernels may still use p */
}

static void cu_upload(mt_backend *be, void *dst, const void *host_src, size_t bytes) {
    cu_backend *cb = cb_of(be);
    if (!bytes) return;
    route_forget(cb, dst, bytes);
    CU_RECORD(be, cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, cb->stream));
    CU_RECORD(be, cudaStreamSynchronize(cb->stream));
}

/* From pageable memory cudaMemcpyAsync returns once host_src is staged for the DMA, so the
 * buffer may be reused at once; from page-locked memory it would read host_src later, so that
 * case keeps upload's wait. */
static void cu_upload_async(mt_backend *be, void *dst, const void *host_src, size_t bytes) {
    cu_backend *cb = cb_of(be);
    if (!bytes) return;
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, host_src) != cudaSuccess || a.type != cudaMemoryTypeUnregistered) {
        (void)cudaGetLastError();
        cu_upload(be, dst, host_src, bytes);
        return;
    }
    route_forget(cb, dst, bytes);
    CU_RECORD(be, cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, cb->stream));
}

static void cu_download(mt_backend *be, void *host_dst, const void *src, size_t bytes) {
    cu_backend *cb = cb_of(be);
    if (!bytes) return;
    CU_RECORD(be, cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, cb->stream));
    CU_RECORD(be, cudaStreamSynchronize(cb->stream));
}

/* The copy lands in the ticket's page-locked slot (a copy into pageable memory would wait for
 * the whole queue), and the slot's event marks its completion. */
static int64_t cu_download_begin(mt_backend *be, const void *src, size_t bytes) {
    cu_backend *cb = cb_of(be);
    MT_ASSERT(bytes <= MT_TICKET_BYTES);
    const int64_t t = cb->tk_next++;
    const int slot = (int)(t % MT_TICKETS);
    if (bytes)
        CU_RECORD(be, cudaMemcpyAsync(cb->tk_ring + (size_t)slot * MT_TICKET_BYTES, src, bytes,
                                      cudaMemcpyDeviceToHost, cb->stream));
    CU_RECORD(be, cudaEventRecord(cb->tk_done[slot], cb->stream));
    return t;
}

static mt_status cu_download_end(mt_backend *be, int64_t ticket, void *host_dst, size_t bytes) {
    cu_backend *cb = cb_of(be);
    if (!mt_ticket_readable(ticket, cb->tk_next)) return MT_ERR_STATE;
    MT_ASSERT(bytes <= MT_TICKET_BYTES);
    const int slot = (int)(ticket % MT_TICKETS);
    MT_CUDA_(cudaEventSynchronize(cb->tk_done[slot]), "cudaEventSynchronize(ticket)", {
        cu_fail(be, mt_st_);
        return mt_st_;
    });
    if (bytes) memcpy(host_dst, cb->tk_ring + (size_t)slot * MT_TICKET_BYTES, bytes);
    return cb->sticky;
}

static void cu_copy(mt_backend *be, void *dst, const void *src, size_t bytes) {
    cu_backend *cb = cb_of(be);
    if (!bytes) return;
    route_forget(cb, dst, bytes);
    CU_RECORD(be, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cb->stream));
    cu_prof_mark(be, "copy");
}

static void cu_zero(mt_backend *be, void *p, size_t bytes) {
    cu_backend *cb = cb_of(be);
    if (!bytes) return;
    route_forget(cb, p, bytes);
    CU_RECORD(be, cudaMemsetAsync(p, 0, bytes, cb->stream));
}

static mt_status cu_weight(mt_backend *be, const void *host, mt_dtype dt, int64_t rows, int64_t cols,
                           mt_weight *out) {
    cu_backend *cb = cb_of(be);
    MT_ASSERT(dt == MT_F32 || dt == MT_F16 || dt == MT_BF16);
    MT_ASSERT(rows >= 0 && cols >= 0);
    const size_t bytes = (size_t)rows * (size_t)cols * mt_dtype_size(dt);
    void *p = NULL;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        (void)cudaGetLastError();
        mt_log(MT_LOG_ERROR, "cuda backend: out of device memory for a %lld x %lld %s weight",
               (long long)rows, (long long)cols, mt_dtype_name(dt));
        return MT_ERR_NOMEM;
    }
    mt_status st = MT_OK;
    if (bytes) {
        MT_CUDA_CHECK_GOTO(cudaMemcpyAsync(p, host, bytes, cudaMemcpyHostToDevice, cb->stream), st,
                           fail);
        MT_CUDA_CHECK_GOTO(cudaStreamSynchronize(cb->stream), st, fail);
    }
    out->data = p;
    out->dtype = dt;
    out->rows = rows;
    out->cols = cols;
    out->owned = true;
    return MT_OK;
fail:
    MT_CUDA_WARN(cudaFree(p));
    return st;
}

static void cu_weight_free(mt_backend *be, mt_weight *w) {
    if (!w) return;
    if (w->data) CU_RECORD(be, cudaFree((void *)w->data));
    memset(w, 0, sizeof *w);
}

static void cu_sync(mt_backend *be) { CU_RECORD(be, cudaStreamSynchronize(cb_of(be)->stream)); }

static mt_status cu_mem_info(mt_backend *be, size_t *free_bytes, size_t *total_bytes) {
    (void)be;
    MT_CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes));
    return MT_OK;
}

static const mt_backend_ops cu_ops = {
    .name = "cuda",
    .queued = true,
    .destroy = cu_destroy,
    .alloc = cu_alloc,
    .free = cu_free,
    .upload = cu_upload,
    .upload_async = cu_upload_async,
    .download = cu_download,
    .download_begin = cu_download_begin,
    .download_end = cu_download_end,
    .copy = cu_copy,
    .zero = cu_zero,
    .weight = cu_weight,
    .weight_random = cu_weight_random,
    .weight_free = cu_weight_free,
    .sync = cu_sync,
    .mem_info = cu_mem_info,
    .graph_begin = cu_graph_begin,
    .graph_end = cu_graph_end,
    .graph_launch = cu_graph_launch,
    .graph_free = cu_graph_free,
    .graph_epoch = cu_graph_epoch,
    .embed_dev = cu_embed_dev,
    .copy_rows_at = cu_copy_rows_at,
    .dsa_pool_keys_at = cu_dsa_pool_keys_at,
    .conv1d_silu_rows = cu_conv1d_silu_rows,
    .kda_conv3_rows = cu_kda_conv3_rows,
    .kda_recurrent_rows = cu_kda_recurrent_rows,
    .copy_rows_to_n = cu_copy_rows_to_n,
    .copy_rows_to = cu_copy_rows_to,
    .dsa_pool_keys_rows = cu_dsa_pool_keys_rows,
    .dsa_select_rows = cu_dsa_select_rows,
    .mla_sparse_rows = cu_mla_sparse_rows,
    .embed = cu_embed,
    .matmul = cu_matmul,
    .matmul_multi = cu_matmul_multi,
    .rmsnorm = cu_rmsnorm,
    .layernorm = cu_layernorm,
    .swiglu = cu_swiglu,
    .sigmoid = cu_sigmoid,
    .l2norm = cu_l2norm,
    .moe_route = cu_moe_route,
    .moe_experts = cu_moe_experts,
    .moe_experts_shared = cu_moe_experts_shared,
    .conv1d_silu = cu_conv1d_silu,
    .conv1d_silu_l2norm = cu_conv1d_silu_l2norm,
    .kda_gates = cu_kda_gates,
    .kda_gate = cu_kda_gate,
    .kda_recurrent = cu_kda_recurrent,
    .kda_chunked = cu_kda_chunked,
    .gated_rmsnorm = cu_gated_rmsnorm,
    .dsa_pool_keys = cu_dsa_pool_keys,
    .dsa_select = cu_dsa_select,
    .mla_sparse = cu_mla_sparse,
    .hc_pre = cu_hc_pre,
    .hc_pre_norm = cu_hc_pre_norm,
    .hc_post_pre_norm = cu_hc_post_pre_norm,
    .hc_post = cu_hc_post,
    .hc_head = cu_hc_head,
    .hc_head_norm = cu_hc_head_norm,
    .argmax = cu_argmax,
    .argmax_dev = cu_argmax_dev,
};

/* The tickets' completion events (download_begin); cu_destroy frees those made. */
static cudaError_t tk_events_create(cu_backend *cb) {
    cudaError_t e = cudaSuccess;
    for (int i = 0; i < MT_TICKETS && e == cudaSuccess; i++)
        e = cudaEventCreateWithFlags(&cb->tk_done[i], cudaEventDisableTiming);
    return e;
}

extern "C" mt_backend *mt_cuda_backend_new(int device, mt_error *err) {
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        mt_errorf(err, MT_ERR_UNSUPPORTED, "no usable CUDA device: cudaGetDeviceCount: %s",
                  cudaGetErrorString(e));
        return NULL;
    }
    if (device < 0 || device >= count) {
        mt_errorf(err, MT_ERR_UNSUPPORTED, "CUDA device %d requested, %d present", device, count);
        return NULL;
    }
    cu_backend *cb = (cu_backend *)calloc(1, sizeof *cb);
    if (!cb) {
        mt_errorf(err, MT_ERR_NOMEM, "out of memory for the CUDA backend");
        return NULL;
    }
    cudaDeviceProp prop;
    if ((e = cudaSetDevice(device)) != cudaSuccess ||
        (e = cudaGetDeviceProperties(&prop, device)) != cudaSuccess ||
        (e = cudaStreamCreateWithFlags(&cb->stream, cudaStreamNonBlocking)) != cudaSuccess)
        goto fail;
    cb->base.ops = &cu_ops;
    cb->base.n_threads = 1;
    cb->device = device;
    cb->sticky = MT_OK;
    cb->n_sm = prop.multiProcessorCount;
    /* Tensor-core matmul precision (cuda_dense.cu): 16-bit parts of x, 0 = fp32 kernels only. */
    cb->tc_terms = 2;
    if (const char *env = getenv("MT_CUDA_TC_TERMS")) {
        if (strcmp(env, "0") && strcmp(env, "1") && strcmp(env, "2")) {
            mt_errorf(err, MT_ERR_INVALID, "MT_CUDA_TC_TERMS=%s: expected 0, 1 or 2", env);
            cu_destroy(&cb->base);
            return NULL;
        }
        cb->tc_terms = env[0] - '0';
    }
    /* Prefill switches (cuda_ops.h): on unless the variable is "0". */
    cb->moe_batched = !(getenv("MT_CUDA_MOE_BATCHED") && !strcmp(getenv("MT_CUDA_MOE_BATCHED"), "0"));
    cb->narrow = !(getenv("MT_CUDA_NARROW") && !strcmp(getenv("MT_CUDA_NARROW"), "0"));
    cb->moe_grouped = !(getenv("MT_CUDA_MOE_GROUPED") && !strcmp(getenv("MT_CUDA_MOE_GROUPED"), "0"));
    cb->moe_side = !(getenv("MT_CUDA_MOE_SIDE") && !strcmp(getenv("MT_CUDA_MOE_SIDE"), "0"));
    cb->moe_wg = !(getenv("MT_CUDA_MOE_WG") && !strcmp(getenv("MT_CUDA_MOE_WG"), "0"));
    /* Every matmul of more than GEMV_MAX_N rows goes to the tensor cores (two-part split, ~3e-6
     * relative): the fp32 narrow/tiled kernels took 40% of a batch-64 decode step (batch_bench:
     * 66% of the floor with tensor cores, 40% without). MT_CUDA_TC_MIN_ROWS=512 keeps outputs
     * narrower than 512 (router, mHC mix, gates) on the fp32 kernels, as before. */
    cb->tc_min_rows = 1;
    if (const char *env = getenv("MT_CUDA_TC_MIN_ROWS")) {
        char *end = NULL;
        const long v = strtol(env, &end, 10);
        if (end == env || *end || v < 1 || v > INT_MAX) {
            mt_errorf(err, MT_ERR_INVALID, "MT_CUDA_TC_MIN_ROWS=%s: expected a positive integer", env);
            cu_destroy(&cb->base);
            return NULL;
        }
        cb->tc_min_rows = (int)v;
    }
    if ((e = cudaMalloc(&cb->counters, sizeof(unsigned) * CU_COUNTERS)) != cudaSuccess ||
        (e = cudaMemset(cb->counters, 0, sizeof(unsigned) * CU_COUNTERS)) != cudaSuccess ||
        (e = cudaMallocHost(&cb->tk_ring, (size_t)MT_TICKETS * MT_TICKET_BYTES)) != cudaSuccess ||
        (e = tk_events_create(cb)) != cudaSuccess || (e = cudaDeviceSynchronize()) != cudaSuccess) {
        (void)cudaGetLastError();
        mt_errorf(err, MT_ERR_BACKEND, "CUDA device %d: %s", device, cudaGetErrorString(e));
        cu_destroy(&cb->base);
        return NULL;
    }
    if (cu_blas_init(cb) != MT_OK) { /* logged at the failing call */
        (void)cudaGetLastError();
        mt_errorf(err, MT_ERR_BACKEND, "CUDA device %d: cuBLAS setup failed (see the log)", device);
        cu_destroy(&cb->base);
        return NULL;
    }
    return &cb->base;
fail:
    (void)cudaGetLastError();
    mt_errorf(err, MT_ERR_BACKEND, "CUDA device %d: %s", device, cudaGetErrorString(e));
    free(cb);
    return NULL;
}
