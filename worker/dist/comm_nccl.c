/* worker/dist/comm_nccl.c: the NCCL communicator (comm_nccl.h): a non-blocking NCCL communicator
 * on the CUDA backend's stream, an event after every collective and a watchdog thread that aborts
 * the communicator when that event or NCCL's asynchronous state says the group is stuck.
 *
 * Locking: `mu` is held by the caller's thread for each call into NCCL and by the watchdog while
 * it looks and, when it must, aborts; so the communicator is never aborted under a call in
 * progress, and a call never uses a communicator the watchdog freed.
 */
#include "worker/dist/comm_nccl.h"

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_check.h"

_Static_assert(NCCL_UNIQUE_ID_BYTES == MT_COMM_NCCL_ID_BYTES, "mt_comm_nccl_id must hold an ncclUniqueId");

enum { NC_MSG = 400 };

typedef struct nc_comm {
    mt_comm base;
    mt_comm_nccl_params p;
    mt_backend *be;
    cudaStream_t stream;        /* the backend's */
    int device;
    pthread_mutex_t mu;
    pthread_cond_t wake;        /* the watchdog's sleep; signalled to stop it */
    ncclComm_t nccl;            /* NULL once aborted (under mu) */
    /* Recorded after every collective (watchdog on): done by eager calls, done_graph by the event
     * nodes of captured ones (an event recorded inside a capture is never recorded eagerly). */
    cudaEvent_t done, done_graph;
    double pending_since[2];    /* watchdog: when done / done_graph was first seen pending; 0: not */
    float *one;                 /* [1] device: the barrier's all-reduce */
    pthread_t dog;
    bool dog_running, stop;     /* stop under mu */
    bool timed_out;             /* the last nc_settle ran out of time */
    _Atomic bool broken;
    char cause[NC_MSG];         /* what broke it (under mu) */
} nc_comm;

static nc_comm *nc_of(mt_comm *c) { return (nc_comm *)c; }

static void nc_sleep(double seconds) {
    struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    (void)nanosleep(&ts, NULL);
}

/* ---- failure (all under mu) ---- */

/* Aborts the NCCL communicator (its kernels exit) and records why, once. Either thread. */
static void nc_abort(nc_comm *c, const char *msg) {
    if (!atomic_load(&c->broken)) {
        snprintf(c->cause, sizeof c->cause, "comm nccl rank %d: %s", c->base.rank, msg);
        mt_log(MT_LOG_ERROR, "%s", c->cause);
        atomic_store(&c->broken, true);
    }
    if (c->nccl) {
        MT_NCCL_WARN(ncclCommAbort(c->nccl));
        c->nccl = NULL;
    }
}

/* nc_abort from the caller's thread, which also writes comm->err. Returns st. */
static mt_status nc_break(nc_comm *c, mt_status st, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static mt_status nc_break(nc_comm *c, mt_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char msg[NC_MSG];
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    nc_abort(c, msg);
    mt_errorf(&c->base.err, st, "comm nccl rank %d: %s", c->base.rank, msg);
    return st;
}

/* While NCCL says the last call is still in progress (a non-blocking communicator), polls its
 * state until it settles or timeout_s passes; then ncclInProgress stays and timed_out is set. */
static ncclResult_t nc_settle(nc_comm *c, ncclResult_t r) {
    c->timed_out = false;
    if (r != ncclInProgress) return r;
    const double deadline = mt_now() + c->p.timeout_s;
    double pause = 20e-6;
    while (r == ncclInProgress) {
        if (mt_now() >= deadline) {
            c->timed_out = true;
            return r;
        }
        nc_sleep(pause);
        pause = pause * 2 < 1e-3 ? pause * 2 : 1e-3;
        const ncclResult_t q = ncclCommGetAsyncError(c->nccl, &r);
        if (q != ncclSuccess) return q;
    }
    return r;
}

/* The failure of an NCCL call made by `op` (already logged by the check macro). */
static mt_status nc_call_failed(nc_comm *c, const char *op, const char *call) {
    if (c->timed_out) return nc_break(c, MT_ERR_BACKEND, "%s: %s still in progress after %.1f s", op, call, c->p.timeout_s);
    const char *last = c->nccl ? ncclGetLastError(c->nccl) : NULL;
    return nc_break(c, MT_ERR_BACKEND, "%s: %s failed%s%s", op, call, last && last[0] ? ": " : "", last ? last : "");
}

/* Takes mu for a call; MT_ERR_STATE (mu released) when the communicator broke earlier. */
static mt_status nc_enter(nc_comm *c, const char *op) {
    pthread_mutex_lock(&c->mu);
    if (!atomic_load(&c->broken)) return MT_OK;
    mt_errorf(&c->base.err, MT_ERR_STATE, "comm nccl rank %d: %s: the communicator failed earlier: %s", c->base.rank,
              op, c->cause);
    pthread_mutex_unlock(&c->mu);
    return MT_ERR_STATE;
}

/* After a collective: the event the watchdog reads, recorded on the stream, or inside a capture
 * as an event node of the graph (cudaEventRecordExternal, done_graph), so every replay records it
 * too. */
static mt_status nc_mark(nc_comm *c, const char *op) {
    if (!c->p.watchdog) return MT_OK;
    enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    mt_status st = MT_OK;
    MT_CUDA_CHECK_GOTO(cudaStreamIsCapturing(c->stream, &cs), st, fail);
    if (cs == cudaStreamCaptureStatusActive)
        MT_CUDA_CHECK_GOTO(cudaEventRecordWithFlags(c->done_graph, c->stream, cudaEventRecordExternal), st, fail);
    else
        MT_CUDA_CHECK_GOTO(cudaEventRecord(c->done, c->stream), st, fail);
    return MT_OK;
fail:
    return nc_break(c, st, "%s: recording its completion event failed", op);
}

/* ---- the watchdog ---- */

static void *nc_watchdog(void *arg) {
    nc_comm *c = (nc_comm *)arg;
    MT_CUDA_WARN(cudaSetDevice(c->device));
    pthread_mutex_lock(&c->mu);
    while (!c->stop) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        const double t = (double)until.tv_nsec * 1e-9 + c->p.poll_s;
        until.tv_sec += (time_t)t;
        until.tv_nsec = (long)((t - (double)(time_t)t) * 1e9);
        pthread_cond_timedwait(&c->wake, &c->mu, &until);
        if (c->stop || atomic_load(&c->broken) || !c->nccl) continue;
        ncclResult_t async = ncclSuccess;
        const ncclResult_t q = ncclCommGetAsyncError(c->nccl, &async);
        char msg[NC_MSG];
        if (q != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
            const char *last = ncclGetLastError(c->nccl);
            snprintf(msg, sizeof msg, "watchdog: NCCL reports %s%s%s; communicator aborted",
                     ncclGetErrorString(q != ncclSuccess ? q : async), last && last[0] ? ": " : "", last ? last : "");
            nc_abort(c, msg);
            continue;
        }
        const cudaEvent_t evs[2] = {c->done, c->done_graph};
        for (int k = 0; k < 2 && !atomic_load(&c->broken); k++) {
            const cudaError_t e = cudaEventQuery(evs[k]);
            const double now = mt_now();
            if (e == cudaErrorNotReady) {
                if (c->pending_since[k] == 0) {
                    c->pending_since[k] = now;
                } else if (now - c->pending_since[k] > c->p.timeout_s) {
                    snprintf(msg, sizeof msg,
                             "watchdog: a collective%s has been pending on the device for %.1f s (a peer died or "
                             "stopped calling); communicator aborted",
                             k ? " replayed from a graph" : "", now - c->pending_since[k]);
                    nc_abort(c, msg);
                }
            } else {
                /* Done, never recorded, or unreadable just now (a capture holding it): nothing is
                 * known to wait. */
                if (e != cudaSuccess) (void)cudaGetLastError();
                c->pending_since[k] = 0;
            }
        }
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* ---- collectives ---- */

static mt_status nc_all_reduce_sum(mt_comm *cm, float *buf, size_t count) {
    nc_comm *c = nc_of(cm);
    mt_status st = nc_enter(c, "all_reduce_sum");
    if (st != MT_OK) return st;
    if (count) {
        MT_NCCL_CHECK_GOTO(nc_settle(c, ncclAllReduce(buf, buf, count, ncclFloat32, ncclSum, c->nccl, c->stream)), st,
                           fail);
        st = nc_mark(c, "all_reduce_sum");
    }
    pthread_mutex_unlock(&c->mu);
    return st;
fail:
    st = nc_call_failed(c, "all_reduce_sum", "ncclAllReduce");
    pthread_mutex_unlock(&c->mu);
    return st;
}

static mt_status nc_all_gather(mt_comm *cm, const float *send, float *recv, size_t count) {
    nc_comm *c = nc_of(cm);
    mt_status st = nc_enter(c, "all_gather");
    if (st != MT_OK) return st;
    if (count) {
        MT_NCCL_CHECK_GOTO(nc_settle(c, ncclAllGather(send, recv, count, ncclFloat32, c->nccl, c->stream)), st, fail);
        st = nc_mark(c, "all_gather");
    }
    pthread_mutex_unlock(&c->mu);
    return st;
fail:
    st = nc_call_failed(c, "all_gather", "ncclAllGather");
    pthread_mutex_unlock(&c->mu);
    return st;
}

static mt_status nc_broadcast(mt_comm *cm, void *buf, size_t bytes, int root) {
    nc_comm *c = nc_of(cm);
    if (root < 0 || root >= c->base.size)
        return mt_errorf(&c->base.err, MT_ERR_INVALID, "comm nccl: broadcast: root %d not in [0, %d)", root,
                         c->base.size);
    mt_status st = nc_enter(c, "broadcast");
    if (st != MT_OK) return st;
    if (bytes) {
        MT_NCCL_CHECK_GOTO(nc_settle(c, ncclBroadcast(buf, buf, bytes, ncclUint8, root, c->nccl, c->stream)), st, fail);
        st = nc_mark(c, "broadcast");
    }
    pthread_mutex_unlock(&c->mu);
    return st;
fail:
    st = nc_call_failed(c, "broadcast", "ncclBroadcast");
    pthread_mutex_unlock(&c->mu);
    return st;
}

/* Waits for the stream's work up to the event `ev` recorded after it, at most timeout_s (mu held). */
static mt_status nc_wait_event(nc_comm *c, cudaEvent_t ev, const char *op) {
    const double deadline = mt_now() + c->p.timeout_s;
    double pause = 20e-6;
    for (;;) {
        const cudaError_t e = cudaEventQuery(ev);
        if (e == cudaSuccess) return MT_OK;
        if (e != cudaErrorNotReady) {
            MT_CUDA_WARN(e);
            return nc_break(c, MT_ERR_BACKEND, "%s: waiting for the stream: %s", op, cudaGetErrorString(e));
        }
        if (mt_now() >= deadline)
            return nc_break(c, MT_ERR_BACKEND, "%s: timed out after %.1f s waiting for the group", op, c->p.timeout_s);
        nc_sleep(pause);
        pause = pause * 2 < 1e-3 ? pause * 2 : 1e-3;
    }
}

static mt_status nc_barrier(mt_comm *cm) {
    nc_comm *c = nc_of(cm);
    mt_status st = nc_enter(c, "barrier");
    if (st != MT_OK) return st;
    enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    cudaEvent_t ev = NULL;
    MT_CUDA_CHECK_GOTO(cudaStreamIsCapturing(c->stream, &cs), st, out);
    if (cs != cudaStreamCaptureStatusNone) {
        st = mt_errorf(&c->base.err, MT_ERR_STATE, "comm nccl rank %d: barrier inside a graph capture", c->base.rank);
        goto out;
    }
    MT_NCCL_CHECK_GOTO(nc_settle(c, ncclAllReduce(c->one, c->one, 1, ncclFloat32, ncclSum, c->nccl, c->stream)), st,
                       fail);
    if ((st = nc_mark(c, "barrier")) != MT_OK) goto out;
    MT_CUDA_CHECK_GOTO(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), st, out);
    MT_CUDA_CHECK_GOTO(cudaEventRecord(ev, c->stream), st, out);
    st = nc_wait_event(c, ev, "barrier");
out:
    if (ev) MT_CUDA_WARN(cudaEventDestroy(ev));
    pthread_mutex_unlock(&c->mu);
    return st;
fail:
    st = nc_call_failed(c, "barrier", "ncclAllReduce");
    pthread_mutex_unlock(&c->mu);
    return st;
}

/* The failure the watchdog or an earlier call found; nothing is asked of NCCL. */
static mt_status nc_check(mt_comm *cm) {
    nc_comm *c = nc_of(cm);
    mt_status st = nc_enter(c, "check");
    if (st == MT_OK) pthread_mutex_unlock(&c->mu);
    return st;
}

static void nc_destroy(mt_comm *cm) {
    nc_comm *c = nc_of(cm);
    if (!c) return;
    if (c->dog_running) {
        pthread_mutex_lock(&c->mu);
        c->stop = true;
        pthread_cond_signal(&c->wake);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->dog, NULL);
    }
    pthread_mutex_lock(&c->mu);
    if (c->nccl) {
        /* Let the queued collectives finish (within the timeout), then flush and free; a group
         * that does not get there is aborted instead. */
        mt_status st = MT_OK;
        cudaEvent_t ev = NULL;
        MT_CUDA_CHECK_GOTO(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), st, abort);
        MT_CUDA_CHECK_GOTO(cudaEventRecord(ev, c->stream), st, abort);
        if (nc_wait_event(c, ev, "destroy") != MT_OK) goto abort; /* aborted it */
        MT_NCCL_CHECK_GOTO(nc_settle(c, ncclCommFinalize(c->nccl)), st, abort);
        MT_NCCL_WARN(ncclCommDestroy(c->nccl));
        c->nccl = NULL;
    abort:
        if (c->nccl) MT_NCCL_WARN(ncclCommAbort(c->nccl));
        c->nccl = NULL;
        if (ev) MT_CUDA_WARN(cudaEventDestroy(ev));
        (void)st;
    }
    pthread_mutex_unlock(&c->mu);
    if (c->one) c->be->ops->free(c->be, c->one);
    if (c->done) MT_CUDA_WARN(cudaEventDestroy(c->done));
    if (c->done_graph) MT_CUDA_WARN(cudaEventDestroy(c->done_graph));
    pthread_cond_destroy(&c->wake);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

static const mt_comm_ops nc_ops = {
    .name = "nccl",
    .destroy = nc_destroy,
    .all_reduce_sum = nc_all_reduce_sum,
    .all_gather = nc_all_gather,
    .broadcast = nc_broadcast,
    .barrier = nc_barrier,
    .check = nc_check,
};

/* ---- ids and forming the group ---- */

mt_comm_nccl_params mt_comm_nccl_default_params(void) {
    return (mt_comm_nccl_params){.timeout_s = 30.0, .poll_s = 0.1, .watchdog = true};
}

mt_status mt_comm_nccl_id_new(char *hex, size_t size, mt_error *err) {
    if (!hex || size < MT_COMM_NCCL_ID_HEX)
        return mt_errorf(err, MT_ERR_INVALID, "comm nccl: id: a buffer of %d bytes is needed, got %zu",
                         (int)MT_COMM_NCCL_ID_HEX, size);
    ncclUniqueId id;
    mt_status st = MT_OK;
    MT_NCCL_CHECK_GOTO(ncclGetUniqueId(&id), st, fail);
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < MT_COMM_NCCL_ID_BYTES; i++) {
        const unsigned char b = (unsigned char)id.internal[i];
        hex[2 * i] = digits[b >> 4];
        hex[2 * i + 1] = digits[b & 15];
    }
    hex[2 * MT_COMM_NCCL_ID_BYTES] = 0;
    return MT_OK;
fail:
    return mt_errorf(err, st, "comm nccl: ncclGetUniqueId failed: %s", ncclGetLastError(NULL));
}

static int nc_hex_digit(char ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

mt_status mt_comm_nccl_id_parse(const char *hex, mt_comm_nccl_id *id, mt_error *err) {
    mt_comm_nccl_id v;
    if (!hex || strlen(hex) != 2 * MT_COMM_NCCL_ID_BYTES)
        return mt_errorf(err, MT_ERR_INVALID, "comm nccl: id: expected %d hex digits, got %zu",
                         2 * MT_COMM_NCCL_ID_BYTES, hex ? strlen(hex) : 0);
    for (int i = 0; i < MT_COMM_NCCL_ID_BYTES; i++) {
        const int hi = nc_hex_digit(hex[2 * i]), lo = nc_hex_digit(hex[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return mt_errorf(err, MT_ERR_INVALID, "comm nccl: id: '%c%c' at %d is not hex", hex[2 * i],
                             hex[2 * i + 1], 2 * i);
        v.bytes[i] = (unsigned char)(hi << 4 | lo);
    }
    *id = v;
    return MT_OK;
}

mt_comm *mt_comm_nccl_new(const mt_comm_nccl_id *id, int rank, int size, mt_backend *be,
                          const mt_comm_nccl_params *params, mt_error *err) {
    const mt_comm_nccl_params p = params ? *params : mt_comm_nccl_default_params();
    if (!id || !be || size < 1 || rank < 0 || rank >= size || !(p.timeout_s > 0) || !(p.poll_s > 0)) {
        mt_errorf(err, MT_ERR_INVALID, "comm nccl: rank %d of %d (id %s, backend %s), timeout_s %g, poll_s %g: expected "
                  "0 <= rank < size, an id and a backend, times > 0", rank, size, id ? "set" : "NULL",
                  be ? "set" : "NULL", p.timeout_s, p.poll_s);
        return NULL;
    }
    if (strcmp(be->ops->name, "cuda") != 0) {
        mt_errorf(err, MT_ERR_INVALID, "comm nccl: the backend is \"%s\", a CUDA backend is needed", be->ops->name);
        return NULL;
    }
    nc_comm *c = (nc_comm *)calloc(1, sizeof *c);
    if (!c) {
        mt_errorf(err, MT_ERR_NOMEM, "comm nccl: out of memory");
        return NULL;
    }
    c->base.ops = &nc_ops;
    c->base.rank = rank;
    c->base.size = size;
    c->base.queued = true;
    c->p = p;
    c->be = be;
    c->stream = mt_cuda_backend_stream(be);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->wake, NULL);
    mt_status st = MT_OK;
    const char *what = "";
    MT_CUDA_CHECK_GOTO(cudaStreamGetDevice(c->stream, &c->device), st, cuda_fail);
    MT_CUDA_CHECK_GOTO(cudaSetDevice(c->device), st, cuda_fail);
    MT_CUDA_CHECK_GOTO(cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming), st, cuda_fail);
    MT_CUDA_CHECK_GOTO(cudaEventCreateWithFlags(&c->done_graph, cudaEventDisableTiming), st, cuda_fail);
    if (!(c->one = (float *)be->ops->alloc(be, sizeof(float)))) {
        mt_errorf(err, MT_ERR_NOMEM, "comm nccl: out of device memory");
        goto fail;
    }

    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclUniqueId uid;
    memcpy(uid.internal, id->bytes, sizeof uid.internal);
    pthread_mutex_lock(&c->mu);
    what = "ncclCommInitRankConfig";
    /* Non-blocking: the call returns ncclInProgress and the joining runs on until it settles. */
    MT_NCCL_CHECK_GOTO(nc_settle(c, ncclCommInitRankConfig(&c->nccl, size, uid, rank, &cfg)), st, nccl_fail);
    pthread_mutex_unlock(&c->mu);

    if (p.watchdog) {
        if (pthread_create(&c->dog, NULL, nc_watchdog, c) != 0) {
            mt_errorf(err, MT_ERR_NOMEM, "comm nccl: cannot start the watchdog thread");
            goto fail;
        }
        c->dog_running = true;
    }
    return &c->base;

nccl_fail:
    if (c->timed_out)
        nc_break(c, MT_ERR_BACKEND, "forming the group of %d: %s still in progress after %.1f s (a rank missing?)",
                 size, what, p.timeout_s);
    else
        nc_call_failed(c, "forming the group", what);
    pthread_mutex_unlock(&c->mu);
    mt_errorf(err, MT_ERR_BACKEND, "%s", c->base.err.msg);
    goto fail;
cuda_fail:
    mt_errorf(err, st, "comm nccl: CUDA setup failed (logged above)");
fail:
    nc_destroy(&c->base);
    return NULL;
}
