/* worker/dist/comm_nccl.h: the NCCL communicator (worker/dist/comm.h) of CUDA workers, one GPU
 * per rank. Buffers are device memory of the CUDA backend the communicator was made for. The
 * collectives are queued on that backend's stream (comm->queued is true), so they are ordered
 * with its ops and are recorded into its CUDA graphs (graph_begin .. graph_end) like any op.
 *
 * Forming the group: one process makes an id (mt_comm_nccl_id_new) and the launcher hands its
 * hex form to every rank (argv or environment); each rank parses it and calls mt_comm_nccl_new
 * with its rank. The process that made the id hosts NCCL's bootstrap root (a thread listening on
 * a socket) until every rank has connected, so it must live that long: the launcher, which
 * outlives its workers, or rank 0 before it hands the id on.
 *
 * Numerics: every rank gets the same bits (NCCL's algorithms reduce each element once and copy
 * the result to every rank). The summation order is NCCL's, fixed for a given size, rank count
 * and NCCL configuration, but not rank order: the sums differ in their last bits from the host
 * communicator's.
 *
 * Timeouts and dead peers. The communicator is non-blocking (ncclConfig_t.blocking = 0), so no
 * NCCL call blocks the caller: forming the group and every enqueue that NCCL reports as in
 * progress are polled until they settle, and one that has not settled after timeout_s aborts the
 * communicator (ncclCommAbort) and fails with MT_ERR_BACKEND. Device work is watched too: after
 * every collective the communicator records an event on the stream (eagerly, or as an event node
 * of the graph being captured, so replays record it as well), and a watchdog thread wakes every
 * poll_s to read that event and NCCL's asynchronous error. When NCCL reports an error, or the
 * event has stayed pending for longer than timeout_s (a peer died or stopped calling, so the
 * collective's kernel waits for it), the watchdog aborts the communicator: its kernels exit, so a
 * synchronisation of the stream that waited on them returns, and every later call fails with
 * MT_ERR_STATE naming what happened. What is guaranteed: no call of this communicator blocks past
 * timeout_s; a collective stuck on the device is ended within timeout_s + poll_s of the moment the
 * watchdog first sees it pending. What is not: the results of a collective ended that way (the
 * output buffer is unspecified), and work queued on the stream before the collective counts
 * toward its time, so timeout_s must exceed the longest stretch of work a step queues ahead of a
 * collective (seconds; the default is 30 s).
 *
 * check reports what the watchdog or an earlier call found (it asks nothing of NCCL): the model
 * calls it before replaying a graph that holds collectives.
 *
 * Graphs: run a collective of each size eagerly before capturing it (NCCL sets up a connection
 * the first time an algorithm needs it, which a capture cannot hold; the graph runner's first use
 * of a bucket is eager). A graph that recorded collectives holds this communicator's NCCL
 * resources: free it before the communicator, and never replay it after the communicator broke.
 * barrier drains the stream and fails with MT_ERR_STATE inside a capture.
 */
#ifndef MT_WORKER_DIST_COMM_NCCL_H
#define MT_WORKER_DIST_COMM_NCCL_H

#include <stdbool.h>

#include "kernels/backend.h"
#include "worker/dist/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* An ncclUniqueId's bytes, and the length of its hex form with the terminating NUL. */
enum { MT_COMM_NCCL_ID_BYTES = 128, MT_COMM_NCCL_ID_HEX = 2 * MT_COMM_NCCL_ID_BYTES + 1 };

typedef struct mt_comm_nccl_id {
    unsigned char bytes[MT_COMM_NCCL_ID_BYTES];
} mt_comm_nccl_id;

typedef struct mt_comm_nccl_params {
    double timeout_s;      /* 30: forming the group, an enqueue, or a collective pending on the
                              device longer than this aborts the communicator */
    double poll_s;         /* 0.1: how often the watchdog looks */
    bool watchdog;         /* true: watch the device work as described above; false: no thread,
                              no events (only the host calls are bounded) */
} mt_comm_nccl_params;

mt_comm_nccl_params mt_comm_nccl_default_params(void);

/* Makes a new group id (ncclGetUniqueId) and writes its hex form (MT_COMM_NCCL_ID_HEX - 1 lowercase
 * digits and a NUL) to hex[size]. MT_ERR_INVALID when size < MT_COMM_NCCL_ID_HEX, MT_ERR_BACKEND
 * when NCCL fails (no network interface for its bootstrap, say); err says which. */
mt_status mt_comm_nccl_id_new(char *hex, size_t size, mt_error *err);

/* Parses the hex form made by mt_comm_nccl_id_new into *id (untouched on failure): exactly
 * MT_COMM_NCCL_ID_HEX - 1 hex digits, either case. MT_ERR_INVALID otherwise. */
mt_status mt_comm_nccl_id_parse(const char *hex, mt_comm_nccl_id *id, mt_error *err);

/* Joins the group `id` as rank `rank` of `size` on be's GPU (a CUDA backend,
 * kernels/cuda/cuda_backend.h), once every rank has joined; p NULL means the defaults. be must
 * outlive the communicator, and the calling thread is the one that uses it. NULL on failure with
 * err set: MT_ERR_INVALID (arguments), MT_ERR_BACKEND (CUDA or NCCL failed, or the group did not
 * form within timeout_s), MT_ERR_NOMEM. */
mt_comm *mt_comm_nccl_new(const mt_comm_nccl_id *id, int rank, int size, mt_backend *be,
                          const mt_comm_nccl_params *p, mt_error *err);

#ifdef __cplusplus
}
#endif
#endif /* MT_WORKER_DIST_COMM_NCCL_H */
