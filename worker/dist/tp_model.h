/* worker/dist/tp_model.h: one model replica over the ranks of a tensor-parallel group. Every rank
 * holds its shard of the model (mt_model_params.comm); rank 0 runs the engine on a leader model,
 * which puts every call that changes state (pools, sequences, forward) on the group's control
 * communicator before running it on its own shard; the other ranks run the follower loop, which
 * receives each call and runs it on theirs, so every rank runs the same step: the same sequences,
 * tokens, positions and page tables (pages and slots are handed out alike, since every rank
 * makes the same calls in the same order). After each call the ranks agree on its outcome: a call
 * that failed on some rank and not on another leaves the replica broken, and every later call
 * fails (the worker then exits and its group is restarted). Before any call the ranks check that
 * their models count layered units and pass rows alike (each rank sets them from its own options;
 * a difference would make the ranks run different collectives), and refuse the group otherwise.
 *
 * Only rank 0 reads logits and greedy tokens; the followers compute the same head (its gather is
 * a collective) into scratch, and run greedy steps ahead of the host as rank 0 does, each on its
 * own device tokens. Queries (describe, pool stats, lengths) are answered by rank 0's shard
 * alone.
 *
 * Ownership: the leader borrows the local model and the control communicator (both outlive it);
 * mt_model_free of the leader frees the local model too. One thread at a time.
 */
#ifndef MT_TP_MODEL_H
#define MT_TP_MODEL_H

#include "common/mt.h"
#include "worker/dist/comm.h"
#include "worker/model/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Rank 0: the replica's model, over `local` (rank 0's shard; owned from now on) and ctl (the
 * host communicator of the group). On error *out is NULL and local is freed. */
mt_status mt_tp_leader_new(mt_model *local, mt_comm *ctl, mt_model **out, mt_error *err);

/* Ranks > 0: runs the calls rank 0 makes until the leader is freed (MT_OK) or the group fails
 * (the error: a peer died, a call diverged). Frees nothing: the caller frees local after. */
mt_status mt_tp_follow(mt_model *local, mt_comm *ctl, mt_error *err);

#ifdef __cplusplus
}
#endif
#endif /* MT_TP_MODEL_H */
