/* worker/model/glm/glm_model.h: the GLM-5.3 (glm5_next) model: load a checkpoint onto a backend,
 * keep per-sequence state, prefill a prompt, decode one token at a time, many sequences at once,
 * or k rows of one sequence (a speculative verify). The engine reaches it only through the model
 * interface (worker/model/model.h; glm_model_as_model); this header is for the model's own tests,
 * tools and benchmarks.
 *
 * Ownership: a glm_model owns its weights (views or device copies) and the checkpoint mapping; it
 * must outlive every glm_seq made from it. The backend is borrowed and must outlive the model.
 * Thread-safety: one thread at a time per model (the engine thread).
 */
#ifndef GLM_MODEL_H
#define GLM_MODEL_H

#include <stdbool.h>

#include "common/mt.h"
#include "kernels/backend.h"
#include "worker/loader/glm_config.h"
#include "worker/model/model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct glm_model glm_model;
typedef struct glm_seq glm_seq;

/* The model's options: mt_model_params (worker/model/model.h). */
typedef mt_model_params glm_model_params;

glm_model_params glm_model_default_params(void);

/* Loads dir/config.json and the safetensors checkpoint in dir. Every tensor of the manifest must
 * be present with its exact shape; errors name the file and tensor. On error *out is NULL. */
mt_status glm_model_load(const char *dir, mt_backend *be, const glm_model_params *params,
                         glm_model **out, mt_error *err);
/* A model of the given config whose every weight is random (mean + std * N(0,1) at the
 * manifest's scale, drawn from (seed, tensor name)), made directly in the backend's memory: the
 * same seed gives the same weights on every backend. For benchmarks and tests. */
mt_status glm_model_new_random(const glm_config *cfg, uint64_t seed, mt_backend *be,
                               const glm_model_params *params, glm_model **out, mt_error *err);
void glm_model_free(glm_model *m);

const glm_config *glm_model_config(const glm_model *m);
mt_backend *glm_model_backend(const glm_model *m);

/* ---- pools ----
 * Sequence state lives in two pools the model owns, made once: pages, each holding
 * glm_model_page_tokens positions of every DSA layer's caches (MLA latent, indexer keys, gate
 * scores, pool keys), mapped to a sequence through its block table as it grows, and shared
 * between sequences for a common prefix (glm_seq_copy_prefix); and slots, one per sequence,
 * holding every KDA layer's conv and recurrent state. glm_model_set_pools sizes them (no sequence
 * may be alive); otherwise the first glm_seq_new makes params.pool_pages / pool_slots. */
#define GLM_DEFAULT_POOL_PAGES 1024
#define GLM_DEFAULT_POOL_SLOTS 64
mt_status glm_model_set_pools(glm_model *m, int n_pages, int n_slots, mt_error *err);
/* Makes the default pools when none are made yet (what the first glm_seq_new would do). */
mt_status glm_model_ensure_pools(glm_model *m, mt_error *err);
int glm_model_page_tokens(const glm_model *m);
size_t glm_model_page_bytes(const glm_model *m);   /* one page, all DSA layers */
size_t glm_model_slot_bytes(const glm_model *m);   /* one slot, all KDA layers */
int glm_model_pages_free(const glm_model *m);
int glm_model_pages_total(const glm_model *m);
int glm_model_slots_free(const glm_model *m);
int glm_model_slots_total(const glm_model *m);

/* A sequence of at most max_tokens positions: takes a slot (MT_ERR_FULL when none is free) and no
 * pages yet. */
mt_status glm_seq_new(glm_model *m, int max_tokens, glm_seq **out, mt_error *err);
/* Maps pages for n more positions (prefill and decode do it themselves; the engine asks ahead so it
 * can preempt instead). MT_ERR_FULL, with nothing changed, when the pool or the capacity is short. */
mt_status glm_seq_reserve(glm_seq *s, int n, mt_error *err);
int glm_seq_pages(const glm_seq *s);               /* pages mapped (shared ones included) */
/* The page ids of its blocks, in order (glm_seq_pages of them); valid until s next changes. */
const int32_t *glm_seq_page_ids(const glm_seq *s);
void glm_seq_free(glm_seq *s);
int glm_seq_len(const glm_seq *s);
/* Pool memory the sequence holds now: its slot and its mapped pages (shared ones counted in
 * full); 0 for NULL. */
size_t glm_seq_bytes(const glm_seq *s);
/* Pool memory a sequence of max_tokens positions holds at most (its slot and all its pages). */
size_t glm_model_seq_bytes(const glm_model *m, int max_tokens);

/* Feeds n tokens (ids < vocab, checked) to the sequence. logits (host memory) receives, when not
 * NULL, [n, vocab] fp32 logits of every fed position when all_logits, else [vocab] of the last.
 * On an input error (bad id, no room) the sequence is unchanged. */
mt_status glm_prefill(glm_model *m, glm_seq *s, const int32_t *tokens, int n, float *logits,
                      bool all_logits, mt_error *err);

/* One token: same as glm_prefill with n = 1 but through each layer's decode path. With
 * decode_graphs on a backend that captures, the step is a graph replay: the first decode of a
 * sequence captures it (a failed capture logs one line and runs that step eagerly), later steps
 * replay it, with the layers' graph hooks (prestage, check_replay_room, sync_replayed_step) run
 * around it. A replay that would write past a full cache is refused with MT_ERR_FULL. */
mt_status glm_decode(glm_model *m, glm_seq *s, int32_t token, float *logits, mt_error *err);

/* Turns graph decode on or off for later steps (benchmarks compare the two on one model). */
void glm_model_set_decode_graphs(glm_model *m, bool on);

/* One token for each of n distinct sequences in one pass through the layers (each layer's
 * decode_multi_seq in the rows form: projections, MoE and the head over all rows; cache writes,
 * selection, attention, conv and recurrent state on each row's own memory through pointer tables
 * in backend memory, each row at its own position). logits (host) [n, vocab] when not NULL.
 * Checks every token, that each sequence has room and appears once; on such an input error
 * nothing changes. With decode_graphs on a backend that captures, a step of n rows replays the
 * graph of its bucket (the next power of two; the extra rows run on a pad sequence and are
 * dropped), captured on the bucket's second use; the graph holds the tables' addresses, so it
 * serves any sequences. The layers' graph hooks run per sequence around the step. */
mt_status glm_decode_multi(glm_model *m, glm_seq **seqs, const int32_t *tokens, int n, float *logits,
                           mt_error *err);

/* One part of a mixed step: n tokens of sequence s at its next positions (a prompt chunk, or a
 * decode row when n == 1). logits (host), when not NULL: [n, vocab] when all_logits, else the last
 * row's [vocab]; argmax, when not NULL: the last row's greedy token. */
typedef struct glm_mixed_part {
    glm_seq *s;
    const int32_t *tokens;
    int n;
    float *logits;
    bool all_logits;
    int32_t *argmax;       /* [n] for a verify, else the last row's */
    bool verify;           /* n > 1 decode rows (draft-verify): write-on-accept, glm_seq_keep after */
    /* Layered prefill (a prompt chunk only): the chunk runs this many more layers in this call,
     * from where its sequence's last call left it; 0 or enough to reach the last layer: all that
     * remain. Until its last layer the chunk is in flight: its rows' highway waits in the model
     * between calls, its sequence's length and logits wait for the call that ends it, and every
     * call until then passes the same tokens with layers set. */
    int layers;
} glm_mixed_part;

/* The parts of np distinct sequences in one pass through the layers (each layer's
 * forward_segments: hyper-connections, norms, projections, MoE and the head over all rows, the
 * mixers on each part's rows with its own state), so decode rows ride along prompt chunks'
 * GEMMs. At most glm_model_pass_rows rows in all.
 * The verify parts write their rows' states into the rings ring0, ring0 + 1, ... in order (at
 * most verify_seqs in all): a forward split over several passes numbers its verifies on across
 * them, so that each keeps its own ring until its glm_seq_keep.
 * Checks every token, each sequence's room and that it appears once, and maps the pages of every
 * part before any state changes; on such an input error nothing changes. Eager, but for a step of
 * only decode rows and verifies of one length (a speculative step's verifies), which replays the
 * graph of its bucket of verifies and decode rows where batched drafts replay theirs
 * (glm_model_has_verify_graph). */
/* Layered chunks (glm_mixed_part.layers): one group at a time is in flight; its parts come last
 * in the step and share one range of layers; the layers outside that range run the other parts
 * alone, so a step's decode rows pass one layer of a long prompt instead of all of them (a chunk
 * step that reads every expert once per MoE layer, spread over several steps). A sequence in
 * flight takes no other part until its chunk ends, and freeing it drops it from its group. */
mt_status glm_forward_mixed(glm_model *m, const glm_mixed_part *parts, int np, int ring0, mt_error *err);
/* Whether s has a layered chunk in flight. */
bool glm_seq_in_flight(const glm_seq *s);
/* Rows of one pass of glm_prefill or glm_forward_mixed (the model's prefill_chunk). */
int glm_model_pass_rows(const glm_model *m);

/* k rows of one sequence in one step (the speculative verify): tokens[k] at positions len ..
 * len + k - 1, through each layer's decode_batched and the graph runner's hooks; with graphs on,
 * the step replays the sequence's graph of k rows (captured on its second use). logits (host)
 * [k, vocab] when not NULL. k = 1 is glm_decode. 1 <= k <= GLM_VERIFY_MAX. On an input error the
 * sequence is unchanged. */
#define GLM_VERIFY_MAX 8
mt_status glm_decode_verify(glm_model *m, glm_seq *s, const int32_t *tokens, int k, float *logits, mt_error *err);

/* Speculative decoding with the MTP block (glm_mtp.c), when the checkpoint has one and
 * params.mtp is set (glm_model_has_drafter): every sequence's drafter follows its target.
 * glm_model_draft runs the drafter's next row with token (see mt_model_ops.draft) into logits
 * (host) [vocab]. glm_seq_keep, after a glm_decode_verify of k rows, keeps the first keep of
 * them: the state is then as if only those had been decoded. */
/* Tests: the drafter's logits of every row it takes at a position below rows go to logits (host)
 * [rows, vocab] at row (the position) until the next call; NULL turns it off. */
void glm_model_capture_drafter(glm_model *m, float *logits, int rows);

/* Checks of the PLE memory (tests): runs layer's memory alone on n host highway rows X [n, S, H]
 * (updated in place) of s, at its next positions, as the layer's forward would before its mixer.
 * ids NULL: the rows staged by decode_prestage. MT_ERR_INVALID when the layer has no memory or n
 * is more than a pass holds. Moves the memory's state of s on (not s's length). */
mt_status glm_model_ple_apply(glm_model *m, glm_seq *s, int layer, const int32_t *ids, float *X, int n);
bool glm_model_has_mtp(const glm_model *m);     /* the checkpoint's MTP block is loaded */
bool glm_model_has_drafter(const glm_model *m); /* and sequences carry its state */
mt_status glm_model_draft(glm_model *m, glm_seq *s, int32_t token, float *logits, mt_error *err);
/* glm_model_draft for n distinct sequences in one pass of the block (its DSA in the rows form):
 * row i drafts seqs[i] from tokens[i] into logits (host) [n, vocab], or with logits NULL each
 * row's greedy token into argmax (host) [n], taken where the logits are; refused whole, nothing
 * changed, when any row's input would be (a row that fails while drafting, as glm_model_draft,
 * leaves the rows before it drafted). */
mt_status glm_mtp_draft_rows(glm_model *m, glm_seq **seqs, const int32_t *tokens, int n, float *logits,
                             int32_t *argmax, mt_error *err);
mt_status glm_seq_keep(glm_model *m, glm_seq *s, int keep, mt_error *err);
/* glm_seq_keep for n distinct sequences (n <= verify_seqs for one pass of copies), in order,
 * their ring copies batched: *done of them kept; on an error the first *done are kept and
 * sequence *done is unchanged. */
mt_status glm_seq_keep_rows(glm_model *m, glm_seq **seqs, const int *keeps, int n, int *done, mt_error *err);

/* What loading read from the checkpoint, for tensor parallelism's accounting: bytes of the split
 * tensors this rank read and their whole size, and bytes of the replicated ones. */
void glm_model_load_bytes(const glm_model *m, size_t *split_read, size_t *split_total, size_t *replicated);

/* The model interface of m (its first member); the model interface's destroy frees m. */
mt_model *glm_model_as_model(glm_model *m);
/* mt_model_load's entries for glm5_next (worker/model/model.c). */
mt_status glm_model_open(const char *dir, mt_backend *be, const mt_model_params *params, mt_model **out,
                         mt_error *err);
mt_status glm_model_open_random(const char *preset, mt_backend *be, const mt_model_params *params,
                                mt_model **out, mt_error *err);

/* Greedy tokens of the last decode step's first n rows (glm_decode: n = 1; glm_decode_multi of at
 * most the scratch rows: its rows), taken where the logits are (on the device for a GPU
 * backend), into out (host) [n]: greedy decoding without moving the logits. */
mt_status glm_last_argmax(glm_model *m, int n, int32_t *out);
/* Greedy decode that runs ahead of the host (the engine's overlap of host and device work).
 * glm_decode_greedy decodes one token for each of n sequences, as glm_decode_multi, and takes each
 * row's argmax where the logits are, leaving it there as the next greedy step's input; *ticket
 * reads them. tokens NULL: this step's inputs are the last greedy step's outputs, which needs the
 * same sequences in the same order with no other batched decode between and none of them
 * prefilled, decoded alone, copied into or freed since (MT_ERR_INVALID otherwise), so the host
 * can queue step k + 1 before it reads token k. glm_greedy_tokens waits for that step only (later
 * steps go on running) and writes its n tokens to out; a ticket stays readable until MT_TICKETS
 * more greedy steps. n: 1 .. glm_model_ahead_rows, which is 0 when the backend cannot leave the
 * argmax on the device or a layer's prestage needs the token. */
int glm_model_ahead_rows(const glm_model *m);
/* Whether the backend queues its work (mt_backend_ops.queued): only then does running ahead let
 * the host work while the device does. */
bool glm_model_backend_queues(const glm_model *m);
mt_status glm_decode_greedy(glm_model *m, glm_seq **seqs, const int32_t *tokens, int n, int64_t *ticket,
                            mt_error *err);
mt_status glm_greedy_tokens(glm_model *m, int64_t ticket, int32_t *out, int n);
/* Rows one pass of glm_decode_multi takes (its scratch rows); more sequences take several passes. */
int glm_model_batch_rows(const glm_model *m);

/* Expert census, for benchmarks: while on, each eager batched step records which routed experts
 * its rows chose; glm_model_expert_census returns how many (layer, expert) pairs the last such
 * step touched (-1 when off), glm_model_expert_census_pairs its (row, slot) pairs per expert,
 * [num_hidden_layers * n_routed_experts] (NULL when off; valid until the next step or change).
 * Reads the routing back, so a replayed graph step records nothing. */
mt_status glm_model_set_expert_census(glm_model *m, bool on);
int glm_model_expert_census(const glm_model *m);
const int32_t *glm_model_expert_census_pairs(const glm_model *m);

/* Whether a batched step of n rows would replay a captured graph now. */
bool glm_model_has_bucket_graph(const glm_model *m, int n);
/* Whether a batched draft of n rows replays a recorded graph (tests). */
bool glm_model_has_draft_graph(const glm_model *m, int n);
/* Whether a mixed step of nv verifies of k rows each and nd decode rows, nothing else, replays a
 * recorded graph of its bucket (tests). */
bool glm_model_has_verify_graph(const glm_model *m, int k, int nv, int nd);

/* Test hook: the next decode-graph capture fails (an uncapturable call is made inside it). */
void glm_model_fail_next_capture(glm_model *m);

/* Whether s decodes through a captured graph now. */
bool glm_seq_has_graph(const glm_seq *s);

/* Makes dst, a fresh sequence (no tokens yet) of capacity >= glm_seq_len(src), continue exactly
 * where src is: its cached positions, recurrent state and indexer cache (the last through each
 * layer's aux snapshot/restore). For prefix reuse: a snapshot sequence kept at a prefix boundary
 * is copied into a new request's sequence instead of prefilling the prefix again. On error dst
 * must be freed (it may be partly written). */
mt_status glm_seq_copy_prefix(glm_model *m, const glm_seq *src, glm_seq *dst, mt_error *err);

/* The model's layers behind the layer contract, and a sequence's state of layer i, for the
 * engine's graph hooks and aux-state calls. Valid while the model / sequence lives. */
int glm_model_n_layers(const glm_model *m);
/* What a layered chunk's layers count through the model: layers, or sites (layered_sites). */
int glm_model_layered_units(const glm_model *m);
const struct mt_layer *glm_model_layer(const glm_model *m, int i);
struct mt_layer_state *glm_seq_state(glm_seq *s, int i);

/* Greedy argmax of logits[vocab] (host). */
int32_t glm_argmax(const float *logits, int vocab);

#ifdef __cplusplus
}
#endif
#endif /* GLM_MODEL_H */
