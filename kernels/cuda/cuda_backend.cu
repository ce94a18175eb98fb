/* kernels/cuda/cuda_backend.cu: the CUDA backend's object, memory, weights, params and op table
 * (kernels/backend.h; the op families fill their slots, cuda_ops.h). One device, one non-blocking
 * stream; every op is enqueued on it, and upload/download/sync wait for it. A failing CUDA call is
 * logged where it happens and recorded in the backend's sticky status (cu_backend.sticky). */
#include <cublas_v2.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"

/* Runs a CUDA call; on failure logs it (call text, error string, file:line) and records it. */
#define CU_RECORD(be, call) MT_CUDA_(call, #call, cu_fail((be), mt_st_))

static cu_backend *cb_of(mt_backend *be) { return (cu_backend *)be; }

extern "C" struct CUstream_st *mt_cuda_backend_stream(mt_backend *be) { return cb_of(be)->stream; }

static uint64_t cu_graph_epoch(mt_backend *be) { return cb_of(be)->scratch_epoch; }

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
    MT_CUDA_WARN(cu_wait(&cb->base));
    for (int i = 0; i < CU_SCRATCH_N; i++)
        if (cb->scratch[i].p) MT_CUDA_WARN(cudaFree(cb->scratch[i].p));
    cu_moe_cache_free(cb);
    cu_moe_grouped_free(cb);
    cu_gemm16_free(cb); /* before cu_fp8_free, which destroys the cuBLASLt handle */
    cu_fp8_free(cb);
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
    MT_CUDA_(cu_wait(be), "cudaStreamSynchronize", cu_fail(be, mt_st_));
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
    cu_prof_mark(be, "upload");
}

static void cu_download(mt_backend *be, void *host_dst, const void *src, size_t bytes) {
    cu_backend *cb = cb_of(be);
    if (!bytes) return;
    MT_CUDA_(cu_copy_to_host(be, host_dst, src, bytes), "cudaMemcpyAsync(download)", cu_fail(be, mt_st_));
    cu_prof_mark(be, "download");
    cu_gap_open(be);
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
    const double t0 = mt_now();
    MT_CUDA_(cudaEventSynchronize(cb->tk_done[slot]), "cudaEventSynchronize(ticket)", {
        cu_fail(be, mt_st_);
        return mt_st_;
    });
    cu_waited(be, t0, cudaStreamQuery(cb->stream) == cudaSuccess);
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

/* Whether the page at addr lies in a range cudaHostRegister locked. */
static bool page_locked(uintptr_t addr) {
    unsigned flags = 0;
    if (cudaHostGetFlags(&flags, (void *)addr) == cudaSuccess) return true;
    (void)cudaGetLastError();
    return false;
}

/* Whether [p, p + n) starts or ends on a page that cudaHostRegister locked (a weight_host table's
 * edge pages hold its neighbours' bytes in the checkpoint's mapping). */
static bool touches_locked(const void *p, size_t n) {
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    return page_locked((uintptr_t)p & ~(pg - 1)) || page_locked(((uintptr_t)p + n - 1) & ~(pg - 1));
}

/* A host-to-device copy of a weight's bytes, waited for. A source that is partly inside a locked
 * range is refused by cudaMemcpy (it takes the range for the whole source), so it goes through a
 * pageable bounce buffer. */
static mt_status copy_weight_in(cu_backend *cb, void *dst, const void *host, size_t bytes) {
    mt_status st = MT_OK;
    void *bounce = NULL;
    if (touches_locked(host, bytes)) {
        if (!(bounce = malloc(bytes))) return MT_ERR_NOMEM;
        memcpy(bounce, host, bytes);
        host = bounce;
    }
    MT_CUDA_CHECK_GOTO(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, cb->stream), st, done);
    MT_CUDA_CHECK_GOTO(cu_wait(&cb->base), st, done);
done:
    free(bounce);
    return st;
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
    if (bytes && (st = copy_weight_in(cb, p, host, bytes)) != MT_OK) goto fail;
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

/* Locks the pages of host[bytes] in place, mapped and read-only (a file mapping may be
 * read-only), and reads them at their host address (the device attribute
 * CanUseHostPointerForRegisteredMem, true on x86-64 Linux). Tensors of one file share their
 * boundary pages: a page a neighbour locked already stays its. */
static mt_status cu_weight_host(mt_backend *be, const void *host, mt_dtype dt, int64_t rows, int64_t cols,
                                mt_weight *out) {
    cu_backend *cb = cb_of(be);
    MT_ASSERT(dt == MT_F32 || dt == MT_F16 || dt == MT_BF16);
    MT_ASSERT(rows >= 0 && cols >= 0);
    int same_ptr = 0;
    MT_CUDA_CHECK(cudaDeviceGetAttribute(&same_ptr, cudaDevAttrCanUseHostPointerForRegisteredMem, cb->device));
    if (!same_ptr) {
        mt_log(MT_LOG_ERROR, "cuda backend: this device cannot read locked host memory at its host address");
        return MT_ERR_UNSUPPORTED;
    }
    const size_t bytes = (size_t)rows * (size_t)cols * mt_dtype_size(dt);
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = (uintptr_t)host & ~(pg - 1), hi = ((uintptr_t)host + bytes + pg - 1) & ~(pg - 1);
    if (hi > lo && page_locked(lo)) lo += pg;
    if (hi > lo && page_locked(hi - pg)) hi -= pg;
    const void *locked = NULL;
    if (hi > lo) {
        cudaError_t e = cudaHostRegister((void *)lo, hi - lo, cudaHostRegisterMapped | cudaHostRegisterReadOnly);
        if (e != cudaSuccess) { /* a device without read-only registration still locks writable memory */
            (void)cudaGetLastError();
            e = cudaHostRegister((void *)lo, hi - lo, cudaHostRegisterMapped);
        }
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            mt_log(MT_LOG_ERROR, "cuda backend: cannot lock %zu bytes of host memory for a %lld x %lld %s weight: %s",
                   (size_t)(hi - lo), (long long)rows, (long long)cols, mt_dtype_name(dt), cudaGetErrorString(e));
            return MT_ERR_IO;
        }
        locked = (const void *)lo;
    }
    *out = mt_weight{};
    out->data = host;
    out->dtype = dt;
    out->rows = rows;
    out->cols = cols;
    out->host = true;
    out->locked = locked;
    return MT_OK;
}

static void cu_weight_free(mt_backend *be, mt_weight *w) {
    if (!w) return;
    if (w->host) { /* weight_host: host memory */
        if (w->locked) CU_RECORD(be, cudaHostUnregister((void *)w->locked));
        memset(w, 0, sizeof *w);
        return;
    }
    if (w->owned && w->data) CU_RECORD(be, cudaFree((void *)w->data));
    if (w->owned && w->scale) CU_RECORD(be, cudaFree((void *)w->scale));
    memset(w, 0, sizeof *w);
}

/* One allocation for the group, each weight's rows copied in on the stream; the old allocations
 * are freed once the copies have run. Each weight but the last must end on a 16-byte boundary
 * so every part keeps the alignment the GEMV and cuBLAS paths look for. */
static mt_status cu_weights_pack(mt_backend *be, mt_weight *const *w, int count) {
    cu_backend *cb = cb_of(be);
    MT_ASSERT(count >= 2);
    size_t total = 0, off[CU_PACK_MAX + 1];
    if (count > CU_PACK_MAX) return MT_ERR_UNSUPPORTED;
    for (int j = 0; j < count; j++) {
        const mt_weight *wj = w[j];
        if (!wj->data || !wj->owned || wj->host || wj->scale || wj->dtype != w[0]->dtype ||
            wj->cols != w[0]->cols || (wj->dtype != MT_BF16 && wj->dtype != MT_F16))
            return MT_ERR_UNSUPPORTED;
        off[j] = total;
        total += (size_t)wj->rows * (size_t)wj->cols * mt_dtype_size(wj->dtype);
        if (j + 1 < count && total % 16) return MT_ERR_UNSUPPORTED;
    }
    off[count] = total;
    void *p = NULL;
    if (cudaMalloc(&p, total ? total : 1) != cudaSuccess) {
        (void)cudaGetLastError();
        return MT_ERR_NOMEM;
    }
    cudaError_t e = cudaSuccess;
    for (int j = 0; j < count && e == cudaSuccess; j++)
        if (off[j + 1] > off[j])
            e = cudaMemcpyAsync((char *)p + off[j], w[j]->data, off[j + 1] - off[j], cudaMemcpyDeviceToDevice,
                                cb->stream);
    const cudaError_t es = cudaStreamSynchronize(cb->stream);
    if (e == cudaSuccess) e = es;
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        MT_CUDA_WARN(cudaFree(p));
        mt_log(MT_LOG_ERROR, "cuda backend: packing weights: %s", cudaGetErrorString(e));
        return MT_ERR_BACKEND;
    }
    cb->scratch_epoch++; /* graphs recorded over the old weights are stale (cu_graph_epoch) */
    for (int j = 0; j < count; j++) {
        MT_CUDA_WARN(cudaFree((void *)w[j]->data));
        w[j]->data = (char *)p + off[j];
        w[j]->owned = j == 0;
    }
    return MT_OK;
}

static void cu_sync(mt_backend *be) { MT_CUDA_(cu_wait(be), "cudaStreamSynchronize", cu_fail(be, mt_st_)); }

static mt_status cu_mem_info(mt_backend *be, size_t *free_bytes, size_t *total_bytes) {
    (void)be;
    MT_CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes));
    return MT_OK;
}

/* The backend's own slots; the op families' come from their fillers (cuda_ops.h). */
static void cu_fill(mt_backend_ops *t) {
    *t = mt_backend_ops{};
    t->name = "cuda";
    t->queued = true;
    t->destroy = cu_destroy;
    t->alloc = cu_alloc;
    t->free = cu_free;
    t->upload = cu_upload;
    t->upload_async = cu_upload_async;
    t->weight_host = cu_weight_host;
    t->download = cu_download;
    t->download_begin = cu_download_begin;
    t->download_end = cu_download_end;
    t->copy = cu_copy;
    t->zero = cu_zero;
    t->weight = cu_weight;
    t->weight_free = cu_weight_free;
    t->weights_pack = cu_weights_pack;
    t->sync = cu_sync;
    t->mem_info = cu_mem_info;
    t->graph_epoch = cu_graph_epoch;
    cu_dense_fill(t);
    cu_moe_fill(t);
    cu_kda_fill(t);
    cu_kda_chunk_fill(t);
    cu_dsa_fill(t);
    cu_fp8_fill(t);
    cu_hc_fill(t);
    cu_rows_fill(t);
    cu_step_fill(t);
    cu_random_fill(t);
    cu_ple_fill(t);
}

/* The tickets' completion events (download_begin); cu_destroy frees those made. */
static cudaError_t tk_events_create(cu_backend *cb) {
    cudaError_t e = cudaSuccess;
    for (int i = 0; i < MT_TICKETS && e == cudaSuccess; i++)
        e = cudaEventCreateWithFlags(&cb->tk_done[i], cudaEventDisableTiming);
    return e;
}

extern "C" const char *mt_numerics_name(mt_numerics v) {
    return v == MT_NUMERICS_EXACT ? "exact" : v == MT_NUMERICS_BF16 ? "bf16" : v == MT_NUMERICS_FP32 ? "fp32" : "?";
}

extern "C" bool mt_numerics_parse(const char *name, mt_numerics *out) {
    for (int v = MT_NUMERICS_EXACT; v <= MT_NUMERICS_FP32; v++)
        if (name && !strcmp(name, mt_numerics_name((mt_numerics)v))) {
            *out = (mt_numerics)v;
            return true;
        }
    return false;
}

extern "C" mt_cuda_params mt_cuda_default_params(void) {
    mt_cuda_params p;
    memset(&p, 0, sizeof p);
    p.numerics = MT_NUMERICS_BF16;
    p.exact_classes = MT_CUDA_EXACT_CLASSES;
    p.kda_chunk_exact = true;
    p.narrow = true;
    p.moe_batched = true;
    p.moe_wg = true;
    p.moe_grouped_min_rows = CU_MOE_GROUPED_MIN_ROWS;
    p.moe_grouped_max_rows = CU_MOE_GROUPED_MAX_ROWS;
    p.moe_exact_grouped = true;
    p.mla_attend = MT_CUDA_MLA_ATTEND_AUTO;
    p.mla_attend_rows = 32;
    p.kda_chunk_kernels = MT_CUDA_KDA_CHUNK_BOTH;
    return p;
}

/* MT_ERR_INVALID, naming the field, for params out of range (cuda_backend.h). */
static mt_status params_check(const mt_cuda_params *p, mt_error *err) {
    if (p->numerics < MT_NUMERICS_EXACT || p->numerics > MT_NUMERICS_FP32)
        return mt_errorf(err, MT_ERR_INVALID, "mt_cuda_params.numerics: %d is not an mt_numerics", (int)p->numerics);
    if (p->exact_classes >> MT_WCLS_N)
        return mt_errorf(err, MT_ERR_INVALID, "mt_cuda_params.exact_classes: 0x%x has bits past the mt_wcls classes",
                         p->exact_classes);
    if (p->moe_grouped_min_rows < 2 || p->moe_grouped_min_rows > CU_MOE_GEMV_MAX_ROWS + 1)
        return mt_errorf(err, MT_ERR_INVALID, "mt_cuda_params.moe_grouped_min_rows: %d is not in 2..%d",
                         p->moe_grouped_min_rows, CU_MOE_GEMV_MAX_ROWS + 1);
    if (p->moe_grouped_max_rows != 0 && p->moe_grouped_max_rows <= CU_MOE_GEMV_MAX_ROWS)
        return mt_errorf(err, MT_ERR_INVALID, "mt_cuda_params.moe_grouped_max_rows: %d is neither 0 nor above %d",
                         p->moe_grouped_max_rows, CU_MOE_GEMV_MAX_ROWS);
    if (p->mla_attend < MT_CUDA_MLA_ATTEND_AUTO || p->mla_attend > MT_CUDA_MLA_ATTEND_WIDE)
        return mt_errorf(err, MT_ERR_INVALID, "mt_cuda_params.mla_attend: %d is not an mt_cuda_mla_attend",
                         (int)p->mla_attend);
    if (p->mla_attend_rows != 32 && p->mla_attend_rows != 64)
        return mt_errorf(err, MT_ERR_INVALID, "mt_cuda_params.mla_attend_rows: %d is neither 32 nor 64",
                         p->mla_attend_rows);
    if (p->kda_chunk_kernels < MT_CUDA_KDA_CHUNK_BOTH || p->kda_chunk_kernels > MT_CUDA_KDA_CHUNK_STATE)
        return mt_errorf(err, MT_ERR_INVALID, "mt_cuda_params.kda_chunk_kernels: %d is not an "
                         "mt_cuda_kda_chunk_kernels", (int)p->kda_chunk_kernels);
    return MT_OK;
}

extern "C" mt_backend *mt_cuda_backend_new(int device, const mt_cuda_params *params, mt_error *err) {
    const mt_cuda_params prm = params ? *params : mt_cuda_default_params();
    if (params_check(&prm, err) != MT_OK) return NULL;
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
    cu_fill(&cb->ops);
    cb->base.ops = &cb->ops;
    cb->base.n_threads = 1;
    cb->device = device;
    cb->sticky = MT_OK;
    cb->n_sm = prop.multiProcessorCount;
    cb->params = prm;
    cb->tc_terms = prm.numerics == MT_NUMERICS_EXACT ? 2 : prm.numerics == MT_NUMERICS_BF16 ? 1 : 0;
    cb->moe_batched = prm.moe_batched;
    if ((e = cudaMalloc(&cb->counters, sizeof(unsigned) * CU_COUNTERS)) != cudaSuccess ||
        (e = cudaMemset(cb->counters, 0, sizeof(unsigned) * CU_COUNTERS)) != cudaSuccess ||
        (e = cudaMallocHost(&cb->tk_ring, (size_t)MT_TICKETS * MT_TICKET_BYTES)) != cudaSuccess ||
        (e = tk_events_create(cb)) != cudaSuccess || (e = cudaDeviceSynchronize()) != cudaSuccess) {
        (void)cudaGetLastError();
        mt_errorf(err, MT_ERR_BACKEND, "CUDA device %d: %s", device, cudaGetErrorString(e));
        cu_destroy(&cb->base);
        return NULL;
    }
    if (cu_blas_init(cb) != MT_OK || cu_fp8_init(cb) != MT_OK) { /* logged at the failing call */
        (void)cudaGetLastError();
        mt_errorf(err, MT_ERR_BACKEND, "CUDA device %d: cuBLAS/cuBLASLt setup failed (see the log)", device);
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
