/* worker/dist/comm_host.h: the host communicator (worker/dist/comm.h) of CPU worker processes on
 * one host, over a shared-memory file. Buffers are host memory; calls have done their work when
 * they return (comm->queued is false).
 *
 * Forming the group: the launcher gives every rank the same group name and size. Rank 0 creates
 * <dir>/<name> (made under a temporary name, then renamed into place, so a joiner never sees it
 * half made); the others open it, retrying until it appears, and claim their rank. Creation
 * returns once every rank has joined. Rank 0 then unlinks the file: it exists only while the
 * group forms, so a group that dies later leaves nothing behind. A file left by a group that died
 * while forming is ignored by joiners (its creator is gone) and replaced by the next rank 0 of
 * that name, which also removes temporary files of dead creators. Names must still be unique per
 * group, across containers that share /dev/shm too (a random number in it, not only a pid): two
 * live groups of one name would meet.
 *
 * Waiting blocks the process (a futex on a shared word), so more ranks than cores work. A wait
 * wakes every poll_s to check its peers: a peer that exited or was killed (zombie or reaped), or
 * that destroyed its communicator, fails the call within about poll_s, and a call that waits
 * longer than timeout_s fails naming the ranks it waited for. The rank that finds a failure marks
 * the group failed, which ends the other ranks' waits at once. check looks at the peers too, so a
 * rank between collectives learns of a death without waiting for one.
 *
 * all_reduce_sum is deterministic and bit-identical on every rank: each rank copies its buffer
 * into its own slot, and every rank sums the slots in rank order 0..N-1 in fp32, one element
 * after another (((x0 + x1) + x2) + ...). Buffers larger than a slot go through in chunks of
 * slot_bytes (broadcast in chunks of size * slot_bytes); each chunk costs one round of the group
 * (one wait for every rank), barrier one round.
 */
#ifndef MT_WORKER_DIST_COMM_HOST_H
#define MT_WORKER_DIST_COMM_HOST_H

#include "worker/dist/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Ranks a host group may have. */
enum { MT_COMM_HOST_MAX_RANKS = 64 };

typedef struct mt_comm_host_params {
    const char *dir;       /* folder of the group's file: "/dev/shm" (a tmpfs) */
    double timeout_s;      /* 30: a call, or forming the group, that waits longer fails */
    double poll_s;         /* 0.1: a blocked wait checks its peers this often */
    size_t slot_bytes;     /* 1 MiB: each rank's chunk, a multiple of 64; the file holds
                              2 * size of them (posix_fallocate'd: a full /dev/shm fails creation
                              instead of faulting later) */
} mt_comm_host_params;

mt_comm_host_params mt_comm_host_default_params(void);

/* Forms (rank 0) or joins (rank > 0) the group `name` of `size` ranks and returns this rank's
 * communicator, once every rank has joined. name: 1..100 of [A-Za-z0-9._-], not starting with
 * '.'; p NULL means the defaults; every rank passes the same size and slot_bytes. A size-1 group
 * touches no file and its calls are trivial (all_gather copies). NULL on failure with err set:
 * MT_ERR_INVALID (arguments, a group of that name made for another size or slot), MT_ERR_IO (the
 * file), MT_ERR_NOMEM, MT_ERR_BACKEND (a peer died or the timeout passed while forming). */
mt_comm *mt_comm_host_new(const char *name, int rank, int size, const mt_comm_host_params *p,
                          mt_error *err);

#ifdef __cplusplus
}
#endif
#endif /* MT_WORKER_DIST_COMM_HOST_H */
