/* worker/dist/comm.h: the communicator of a tensor-parallel worker group, a table of collective
 * operations (STYLE.md 3) over the N ranks of one host (ranks 0..N-1, one process each).
 *
 * Two implementations, each with its own constructor header:
 *   worker/dist/comm_host.h  CPU worker processes, over shared memory; host buffers.
 *   worker/dist/comm_nccl.h  CUDA workers, over NCCL on the CUDA backend's stream; device buffers.
 *
 * Memory: every buffer argument lives in the memory of the backend the communicator was made for
 * (host memory for the host communicator, device memory for the NCCL one). Sizes are element
 * counts of fp32 except broadcast's, which is bytes.
 *
 * Completion: the host communicator's calls have done their work when they return. The NCCL
 * communicator's collectives are queued on the backend's stream (like the backend's ops when
 * its `queued` is true): they run after the work queued before them, and the buffers must stay
 * valid until the stream reaches them. comm->queued says which.
 *
 * Failure: every call returns mt_status. A peer that died, or a call that waited longer than the
 * communicator's timeout (its params), fails with MT_ERR_BACKEND; from then on the communicator is
 * broken and every call fails at once with MT_ERR_STATE (a failed collective leaves the ranks at
 * different points of the group's sequence, so no later call could match up). A broken group is
 * destroyed and made again. comm->err holds the message of the most recent failure, naming the
 * operation and the peer; it is also logged. Unlike most calls (common/mt.h), a failed collective
 * leaves its output buffer unspecified.
 *
 * Collective contract: every rank of the group makes the same calls in the same order with the
 * same counts (and the same root); a mismatch is a bug of the caller and is not detected.
 *
 * Ownership and threads: one thread at a time per communicator object (the worker's engine
 * thread). The caller owns the object and frees it with mt_comm_free, which does not wait for the
 * peers.
 */
#ifndef MT_WORKER_DIST_COMM_H
#define MT_WORKER_DIST_COMM_H

#include <stdbool.h>
#include <stddef.h>

#include "common/mt.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mt_comm mt_comm;

/* Every slot is set by both implementations. */
typedef struct mt_comm_ops {
    const char *name;  /* "host", "nccl" */
    /* Frees the object and what it holds; does not wait for peers. */
    void (*destroy)(mt_comm *c);
    /* buf[count] fp32, in place: every rank ends with the sum over ranks of its buf. */
    mt_status (*all_reduce_sum)(mt_comm *c, float *buf, size_t count);
    /* recv[size, count] = every rank's send[count], in rank order. send may be recv + rank * count
     * (in place); otherwise the two do not overlap. */
    mt_status (*all_gather)(mt_comm *c, const float *send, float *recv, size_t count);
    /* buf[bytes] of rank root is copied to buf on every rank; 0 <= root < size. */
    mt_status (*broadcast)(mt_comm *c, void *buf, size_t bytes, int root);
    /* Returns once every rank has entered its barrier. NCCL: also drains the backend's stream, so
     * it cannot be used inside a CUDA graph capture. */
    mt_status (*barrier)(mt_comm *c);
    /* Whether the group is whole, without communicating: MT_OK, or the failure as a collective
     * would report it (err set). Cheap; for work that must not start on a broken group, such as
     * replaying a CUDA graph that holds the communicator's collectives. */
    mt_status (*check)(mt_comm *c);
} mt_comm_ops;

struct mt_comm {
    const mt_comm_ops *ops;
    int rank;          /* this process, 0 .. size-1 */
    int size;          /* ranks in the group */
    bool queued;       /* collectives return once queued on the backend's stream (NCCL) */
    mt_error err;      /* the most recent failure's message; empty while none */
};

/* Frees any communicator; NULL is fine. */
static inline void mt_comm_free(mt_comm *c) {
    if (c) c->ops->destroy(c);
}

static inline mt_status mt_comm_all_reduce_sum(mt_comm *c, float *buf, size_t count) {
    return c->ops->all_reduce_sum(c, buf, count);
}
static inline mt_status mt_comm_all_gather(mt_comm *c, const float *send, float *recv, size_t count) {
    return c->ops->all_gather(c, send, recv, count);
}
static inline mt_status mt_comm_broadcast(mt_comm *c, void *buf, size_t bytes, int root) {
    return c->ops->broadcast(c, buf, bytes, root);
}
static inline mt_status mt_comm_barrier(mt_comm *c) { return c->ops->barrier(c); }
static inline mt_status mt_comm_check(mt_comm *c) { return c->ops->check(c); }

#ifdef __cplusplus
}
#endif
#endif /* MT_WORKER_DIST_COMM_H */
