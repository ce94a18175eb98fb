/* kernels/cpu/cpu_backend.c: the CPU backend's table and memory. Host memory throughout; weights
 * are views of the caller's (memory-mapped) data, so loading copies nothing. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/mt_rand.h"
#include "kernels/cpu/cpu_ops.h"

/* The backend object: mt_backend first, then its table (base.ops points at it) and the tickets'
 * ring (download_begin). */
typedef struct cpu_backend {
    mt_backend base;
    mt_backend_ops ops;
    int64_t next_ticket;
    unsigned char ring[MT_TICKETS][MT_TICKET_BYTES];
} cpu_backend;

static void cpu_destroy(mt_backend *be) { free(be); }

static void *cpu_alloc(mt_backend *be, size_t bytes) {
    (void)be;
    return calloc(1, bytes ? bytes : 1);
}
static void cpu_free(mt_backend *be, void *p) { (void)be; free(p); }
static void cpu_memcpy(mt_backend *be, void *dst, const void *src, size_t bytes) {
    (void)be;
    if (bytes) memcpy(dst, src, bytes);
}
static void cpu_zero(mt_backend *be, void *p, size_t bytes) { (void)be; memset(p, 0, bytes); }

/* Work is done when its call returns, so a ticket is a copy taken at the begin. */
static int64_t cpu_download_begin(mt_backend *be, const void *src, size_t bytes) {
    cpu_backend *cb = (cpu_backend *)be;
    MT_ASSERT(bytes <= MT_TICKET_BYTES);
    const int64_t t = cb->next_ticket++;
    if (bytes) memcpy(cb->ring[t % MT_TICKETS], src, bytes);
    return t;
}

static mt_status cpu_download_end(mt_backend *be, int64_t ticket, void *host_dst, size_t bytes) {
    cpu_backend *cb = (cpu_backend *)be;
    if (!mt_ticket_readable(ticket, cb->next_ticket)) return MT_ERR_STATE;
    MT_ASSERT(bytes <= MT_TICKET_BYTES);
    if (bytes) memcpy(host_dst, cb->ring[ticket % MT_TICKETS], bytes);
    return MT_OK;
}
static void cpu_sync(mt_backend *be) { (void)be; }

static mt_status cpu_weight(mt_backend *be, const void *host, mt_dtype dt, int64_t rows, int64_t cols,
                            mt_weight *out) {
    (void)be;
    MT_ASSERT(dt == MT_F32 || dt == MT_F16 || dt == MT_BF16);
    *out = (mt_weight){ .data = host, .dtype = dt, .rows = rows, .cols = cols };
    return MT_OK;
}
static mt_status cpu_weight_random(mt_backend *be, mt_dtype dt, int64_t rows, int64_t cols, uint64_t key,
                                   float mean, float std, mt_weight *out) {
    const size_t n = (size_t)rows * (size_t)cols, es = mt_dtype_size(dt);
    MT_ASSERT(dt == MT_F32 || dt == MT_F16 || dt == MT_BF16);
    void *p = malloc(n * es > 0 ? n * es : 1);
    if (!p) return MT_ERR_NOMEM;
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if ((int64_t)n > CPU_PAR_MIN_WORK)
    for (size_t i = 0; i < n; i++) {
        const float v = mean + std * mt_rand_normal(key, i);
        if (dt == MT_F32) ((float *)p)[i] = v;
        else if (dt == MT_BF16) ((uint16_t *)p)[i] = mt_f32_to_bf16(v);
        else ((uint16_t *)p)[i] = mt_f32_to_f16(v);
    }
    *out = (mt_weight){ .data = p, .dtype = dt, .rows = rows, .cols = cols, .owned = true };
    return MT_OK;
}

static void cpu_weight_free(mt_backend *be, mt_weight *w) {
    (void)be;
    if (w->owned) free((void *)w->data);
    memset(w, 0, sizeof *w);
}

static mt_status cpu_mem_info(mt_backend *be, size_t *free_bytes, size_t *total_bytes) {
    (void)be;
    const long page = sysconf(_SC_PAGESIZE), avail = sysconf(_SC_AVPHYS_PAGES), all = sysconf(_SC_PHYS_PAGES);
    if (page <= 0 || avail < 0 || all <= 0) return MT_ERR_UNSUPPORTED;
    *free_bytes = (size_t)avail * (size_t)page;
    *total_bytes = (size_t)all * (size_t)page;
    return MT_OK;
}

/* The backend's own slots; the op families' come from their fillers (cpu_ops.h). */
static void cpu_fill(mt_backend_ops *t) {
    *t = (mt_backend_ops){
        .name = "cpu",
        .destroy = cpu_destroy,
        .alloc = cpu_alloc,
        .free = cpu_free,
        .upload = cpu_memcpy,
        .download = cpu_memcpy,
        .download_begin = cpu_download_begin,
        .download_end = cpu_download_end,
        .copy = cpu_memcpy,
        .zero = cpu_zero,
        .weight = cpu_weight,
        .weight_random = cpu_weight_random,
        .weight_free = cpu_weight_free,
        .sync = cpu_sync,
        .mem_info = cpu_mem_info,
    };
    cpu_dense_fill(t);
    cpu_moe_fill(t);
    cpu_kda_fill(t);
    cpu_dsa_fill(t);
    cpu_hc_fill(t);
    cpu_rows_fill(t);
    cpu_ple_fill(t);
}

mt_backend *mt_cpu_backend_new(int n_threads) {
    cpu_backend *cb = calloc(1, sizeof *cb);
    if (!cb) return NULL;
    mt_backend *be = &cb->base;
    cpu_fill(&cb->ops);
    be->ops = &cb->ops;
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)n : 1;
    }
    be->n_threads = n_threads;
    return be;
}
