/* kernels/cuda/cuda_core.cu: what every op family of the CUDA backend calls on the backend object
 * (cuda_launch.h, cuda_ops.h): failure recording and launch checks, op timing (mt_cuda_profile),
 * programmatic dependent launch, scratch buffers and cuBLAS handles. The object itself, its
 * memory slots and its table are cuda_backend.cu's. */
#include <cublas_v2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_launch.h"
#include "kernels/cuda/cuda_lt.h"
#include "kernels/cuda/cuda_ops.h"

/* Runs a CUDA call; on failure logs it (call text, error string, file:line) and records it. */
#define CU_RECORD(be, call) MT_CUDA_(call, #call, cu_fail((be), mt_st_))

static cu_backend *cb_of(mt_backend *be) { return (cu_backend *)be; }

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
    double host[PROF_MAX];        /* of sec: the host's own time (not its waits for the device) */
    double wait_last;             /* the backend's wait_s at the previous mark */
    long calls[PROF_MAX];
};

void cu_waited(mt_backend *be, double t0, bool empty) {
    cu_backend *cb = cb_of(be);
    const double now = mt_now();
    cb->wait_s += now - t0;
    if (empty && !cb->drained) cb->drained = true, cb->drained_at = now;
}

void cu_gap_open(mt_backend *be) {
    cu_backend *cb = cb_of(be);
    cb->drained = true;
    cb->drained_at = mt_now();
}

cudaError_t cu_wait(mt_backend *be) {
    const double t0 = mt_now();
    const cudaError_t e = cudaStreamSynchronize(cb_of(be)->stream);
    cu_waited(be, t0, true);
    return e;
}

cudaError_t cu_copy_to_host(mt_backend *be, void *dst, const void *src, size_t bytes) {
    cu_backend *cb = cb_of(be);
    const double t0 = mt_now();
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cb->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(cb->stream);
    cu_waited(be, t0, true);
    return e;
}

extern "C" double mt_cuda_wait_seconds(mt_backend *be) { return cb_of(be)->wait_s; }

extern "C" double mt_cuda_gap_seconds(mt_backend *be) { return cb_of(be)->gap_s; }

void cu_prof_mark(mt_backend *be, const char *what) {
    cu_backend *cb = cb_of(be);
    if (cb->drained) {
        cb->gap_s += mt_now() - cb->drained_at;
        cb->drained = false;
    }
    struct cu_prof *p = cb->prof;
    if (!p) return;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(cb->stream, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone) {
        (void)cudaGetLastError();
        return;
    }
    const double issued = mt_now();
    MT_CUDA_WARN(cudaStreamSynchronize(cb->stream));
    const double now = mt_now();
    int k = 0;
    while (k < p->n && strcmp(p->name[k], what)) k++;
    if (k == p->n) {
        if (p->n == PROF_MAX) k = PROF_MAX - 1; /* full: lump into the last entry */
        else p->name[p->n++] = what;
    }
    p->sec[k] += now - p->last;
    p->host[k] += issued - p->last - (cb->wait_s - p->wait_last); /* less the op's own waits (read-backs) */
    p->calls[k]++;
    p->wait_last = cb->wait_s;
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
        rows[r] = mt_cuda_op_time{p->name[best], p->sec[best] * 1e3, p->calls[best], p->host[best] * 1e3};
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
        cb->prof->wait_last = cb->wait_s;
        cb->prof->last = mt_now();
        return;
    }
    mt_cuda_op_time rows[PROF_MAX];
    double total = 0;
    const int n = mt_cuda_profile_take(be, rows, PROF_MAX, &total);
    if (n == 0) return;
    double host = 0;
    for (int r = 0; r < n; r++) host += rows[r].host_ms;
    printf("op profile: %s: %.2f ms (each op synchronised), of it %.2f ms the host's own work\n",
           title ? title : "", total, host);
    printf("  %9s    %6s %6s  %9s\n", "ms", "share", "calls", "host ms");
    for (int r = 0; r < n; r++)
        printf("  %9.3f ms %5.1f%% %6ld  %9.3f  %s\n", rows[r].ms, total > 0 ? 100 * rows[r].ms / total : 0.,
               rows[r].calls, rows[r].host_ms, rows[r].name);
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

/* ---- programmatic dependent launch (cuda_launch.h) ---- */

/* kernel(*params): one kernel taking one parameter struct by value. Returns the launch's error. */
extern "C" cudaError_t cu_launch_pdl(const void *kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                                     void *params) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    void *args[1] = {params};
    return cudaLaunchKernelExC(&cfg, kernel, args);
}

/* ---- scratch and cuBLAS handles ---- */

void *cu_scratch(mt_backend *be, int slot, size_t bytes) {
    cu_backend *cb = cb_of(be);
    MT_ASSERT(slot >= 0 && slot < CU_SCRATCH_N);
    cu_buf *b = &cb->scratch[slot];
    if (b->bytes >= bytes && b->p) return b->p;
    /* Kernels queued earlier may still use the old buffer. */
    MT_CUDA_(cu_wait(be), "cudaStreamSynchronize(scratch)", cu_fail(be, mt_st_));
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

mt_status cu_lt_algo(cu_backend *cb, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                     cublasLtMatrixLayout_t c, const uint32_t *align, cublasLtMatmulAlgo_t *algo, bool *found) {
    static const cublasLtMatmulPreferenceAttributes_t at[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
    };
    const uint64_t ws = CU_BLAS_WS_BYTES;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t res;
    int n = 0;
    mt_status st = MT_OK;
    *found = false;
    MT_CUBLAS_CHECK_GOTO(cublasLtMatmulPreferenceCreate(&pref), st, done);
    MT_CUBLAS_CHECK_GOTO(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                              sizeof ws), st, done);
    for (int i = 0; i < 4 && align; i++)
        MT_CUBLAS_CHECK_GOTO(cublasLtMatmulPreferenceSetAttribute(pref, at[i], &align[i], sizeof align[i]), st, done);
    /* NOT_SUPPORTED here is an answer (no kernel for this shape or layout), not a failure */
    if (cublasLtMatmulAlgoGetHeuristic((cublasLtHandle_t)cb->lt, op, a, b, c, c, pref, 1, &res, &n) ==
            CUBLAS_STATUS_SUCCESS && n > 0) {
        *algo = res.algo;
        *found = true;
    }
done:
    if (pref) MT_CUBLAS_WARN(cublasLtMatmulPreferenceDestroy(pref));
    return st;
}
