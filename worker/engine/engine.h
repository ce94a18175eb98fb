/* worker/engine/engine.h: the continuous-batching loop of a worker, independent of the transport.
 *
 * Requests wait in a bounded FIFO; each eng_step
 *   1. ends sequences whose deadline has passed,
 *   2. decodes one token for every running sequence whose prompt is complete, in one batched
 *      model call where the backend allows (decode_running()), and samples; with mixed_steps and
 *      prefill work in (3), that call carries (3)'s prompt chunks too, and with spec_tokens the
 *      speculating sequences' verifies,
 *   3. does at most prefill_budget prompt tokens of prefill: first the sequences whose prefill is
 *      under way, then waiting sequences admitted while fewer than max_sequences run (allocating
 *      a model sequence of prompt + max_new_tokens positions); a prompt longer than the budget is
 *      fed in chunks over several steps, so running sequences keep getting a token every step;
 *      a sequence samples its first token from the prompt's last logits when its prompt completes.
 * Sequences join (3) and leave (after any token that ends them) between steps. Each sequence gets
 * at most one token per step (up to spec_tokens + 1 with speculative decoding, each reported by
 * its own on_tokens call); on_tokens reports it, and on_finished follows that sequence's last
 * token in the same step. A finished, aborted or expired sequence's state is freed before the
 * callback returns control to the engine.
 *
 * Stop conditions, checked on every sampled token (which is always emitted): a stop token id or
 * the model's EOS (unless ignore_eos) -> ENG_FINISH_STOP; max_new_tokens generated ->
 * ENG_FINISH_LENGTH. A passed deadline ends the sequence with ENG_FINISH_CANCELLED and the message
 * "deadline exceeded"; so does admission when the request's prefill would end past it at the
 * measured cost of a prompt token (sched_deadline_hopeless; the message then gives both times).
 * A model error ends it with ENG_FINISH_ERROR and the model's message.
 *
 * Thread-safety: an engine and its model belong to one thread. Callbacks run on it, inside
 * eng_step / eng_abort / eng_abort_all, and must not call back into the engine.
 */
#ifndef ENG_ENGINE_H
#define ENG_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/mt.h"
#include "worker/engine/sampler.h"
#include "worker/model/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Why a sequence ended. Same values as metrale.v1.FinishReason. */
typedef enum eng_finish {
    ENG_FINISH_LENGTH = 1,
    ENG_FINISH_STOP = 2,
    ENG_FINISH_CANCELLED = 3,
    ENG_FINISH_ERROR = 4,
} eng_finish;

/* One request as the engine needs it. eng_submit copies everything; pointers are borrowed only
 * for the call. */
typedef struct eng_request {
    const int32_t *prompt;       /* [n_prompt], each in [0, vocab) */
    int n_prompt;                /* >= 1 */
    eng_sample_params sampling;  /* must pass eng_sample_params_check */
    bool has_seed;               /* else seeded from the OS entropy source */
    uint64_t seed;
    int max_new_tokens;          /* >= 1; n_prompt + max_new_tokens <= max_context */
    const int32_t *stop_ids;     /* [n_stop], each in [0, vocab) */
    int n_stop;
    bool ignore_eos;
    bool logprobs;               /* report each token's raw logprob */
    int top_logprobs;            /* [0, ENG_TOP_LOGPROBS_MAX] alternatives per token */
    /* Report the logprob of every prompt token after the first (and top_logprobs alternatives)
     * through on_prompt_logprobs. Such a sequence prefills its whole prompt (no prefix reuse), in
     * chunks of at most ENG_ECHO_CHUNK tokens. */
    bool prompt_logprobs;
    bool no_speculation;         /* decode without drafts even when eng_params.spec_tokens > 0 */
} eng_request;

#define ENG_SPEC_MAX 4
/* Most sequences whose verifies share one model call (the model's verify_seqs, capped). */
#define ENG_SPEC_GROUP_MAX 64

#define ENG_ECHO_CHUNK 128
/* The fewest prompt tokens a paced step takes (eng_params.itl_target_ms) while a prompt waits:
 * a 4096-token prompt still finishes within 64 steps however full the batch. */
#define ENG_PACE_FLOOR 64

/* A request with no prompt, greedy, max_new_tokens 16. */
eng_request eng_default_request(void);

typedef struct eng_finish_info {
    eng_finish reason;
    int prompt_tokens;
    int completion_tokens;       /* tokens reported through on_tokens */
    const char *message;         /* "" unless ERROR or deadline; valid during the callback */
    int draft_tokens;            /* speculative decoding: tokens drafted for the sequence */
    int accepted_tokens;         /* of them, the ones the target agreed with */
    int verify_steps;            /* speculative steps it took */
} eng_finish_info;

typedef struct eng_callbacks {
    void *user;
    /* n tokens of sequence id, in order (n is 1 today). toks valid during the call. */
    void (*on_tokens)(void *user, uint64_t id, const eng_sample_result *toks, int n);
    /* Prompt logprobs (prompt_logprobs): r[i] scores prompt position first + i (token = the prompt's
     * token there, >= 1), in order over one or more calls, all before the sequence's first
     * on_tokens; never repeated after a preemption. r valid during the call. NULL: not reported. */
    void (*on_prompt_logprobs)(void *user, uint64_t id, int first, const eng_sample_result *r, int n);
    /* Sequence id ended; its state is already freed. Called exactly once per submitted id. */
    void (*on_finished)(void *user, uint64_t id, const eng_finish_info *fin);
} eng_callbacks;

typedef enum eng_run_ahead { ENG_RUN_AHEAD_OFF, ENG_RUN_AHEAD_AUTO, ENG_RUN_AHEAD_ALWAYS } eng_run_ahead;

typedef struct eng_params {
    int max_sequences;           /* running at once (model sequences allocated), default 16 */
    int max_waiting;             /* submitted but not admitted, default 1024 */
    int max_context;             /* n_prompt + max_new_tokens bound, default 4096 */
    int prefill_budget;          /* prompt tokens prefilled per step, in chunks: a longer prompt is
                                  * spread over steps between decode steps; default 2048 */
    /* The latency a step's decode rows should see: when > 0, each step with decode rows takes as
     * many prompt tokens as the measured step times say fit in it (sched_pace), at least
     * ENG_PACE_FLOOR (a long prompt always advances) and at most prefill_budget. 0 (the
     * default here; the worker sets its own): prefill_budget alone, every step. */
    double itl_target_ms;
    /* A step's prompt chunks, its decode rows and (spec_tokens) its speculating sequences'
     * verifies go to the model as one batch (one pass over the weights: the decode and verify
     * rows ride along the chunks' GEMMs instead of waiting for them; the verifies of at most the
     * model's verify_seqs sequences, the others in calls of their own); false: the decode, the
     * verifies, then the chunks, each in calls of their own (the default here; the GPU worker
     * turns it on, docs/PERF.md). */
    bool mixed_steps;
    /* Layered prefill (with mixed_steps, on a model with layered_prefill): a step whose decode or
     * verify rows ride with its prompt chunks runs the chunks through prefill_layers layers only,
     * and the next steps carry them on, prefill_layers layers a step, until the last layer
     * completes them (no other chunk starts meanwhile; a step with no rows beside them runs every
     * remaining layer). A step then reads the experts of one MoE layer for the prompts, not of
     * all, so the rows beside a prompt wait less; the chunks of a step fit one model pass. It
     * counts the model's layered units (mt_model_info.layered_units: sites where the model was
     * loaded with layered_sites), except while a request waits for admission: then a step runs
     * prefill_layers layers' worth of units (a waiting request waits for the group in flight, or
     * for a place that the group's sequences hold without decoding); and likewise while more than
     * fine_units_max_rows rows ride beside the group.
     * 0 (default): every layer in the chunk's step. */
    int prefill_layers;
    /* With prefill_layers on a model in finer units than layers: the fine units (a unit a step)
     * only while at most this many decode and verify rows ride beside the group. With few rows a
     * step costs little but what the group's unit adds, so the finer units lower the rows'
     * longest gaps; with many, a group of fine units holds its places and delays the next prompts
     * over more steps, and each extra step reads the weights again for all the rows.
     * 0 (default): no limit. */
    int fine_units_max_rows;
    /* With prefill_layers: chunks run layered only while fewer than layered_max_waiting requests
     * wait for a place; from that backlog on, a step runs its chunks (and a group in flight) through
     * every remaining layer, as with prefill_layers 0. Under saturation a layered prompt holds its
     * place for L / prefill_layers steps without decoding and nothing else is admitted meanwhile,
     * while inter-token latency no longer decides anything. 0 (default): no limit. */
    int layered_max_waiting;
    /* Prefill coalescing under saturation (sched_hold_prefill): while more requests wait than
     * there are free places and no prompt is under way, a step with decode rows admits nobody
     * until the waiting prompts that fit the places reach half of prefill_budget tokens or
     * prefill_hold_ms have passed since the hold began, so that the prompts admitted into freed
     * places share one pass over the experts instead of paying one each. 0 (default): off. */
    double prefill_hold_ms;
    /* Prefix reuse: while a prompt is prefilled, the state at its last multiple of prefix_block
     * (leaving at least one prompt token) is kept as a snapshot sequence, within
     * prefix_cache_bytes (least recently used first out); a later prompt that starts with a kept
     * prefix copies that state instead of prefilling it. 0 bytes turns it off. */
    size_t prefix_cache_bytes;   /* default 256 MiB */
    /* Per-sequence state memory the running sequences may hold together (0 = no limit). A
     * waiting sequence is admitted only when its state fits beside the running ones, so running
     * out of memory queues a request instead of failing it or a running one; one that could
     * never fit is refused at submit (MT_ERR_FULL, message gives both sizes). */
    size_t cache_budget_bytes;
    int prefix_block;            /* default 64 tokens */
    /* When the cache pages run short. true (default): a sequence is admitted with pages for its
     * prefill and maps more as it grows; one that cannot get a page preempts the newest running
     * sequences (recomputed later). false: a sequence is admitted only with pages for its whole
     * length (prompt + max_new_tokens) mapped at once, so nothing is ever preempted, at the price
     * of fewer sequences running together. */
    bool preempt;
    /* A batch of plain greedy sequences may run ahead of the host where the model can
     * (mt_model_info.ahead_rows): step k + 1 is queued on the device's own tokens of step k before the
     * host reads them, so the device does not wait for the host between steps. A row whose
     * sequence ended at token k drops its token k + 1. ENG_RUN_AHEAD_AUTO (default): where the
     * backend queues its work (mt_model_info.backend_queues: the GPU; on the CPU it would only delay
     * each token by a step); ALWAYS: on any backend (tests); OFF: never. */
    eng_run_ahead run_ahead;
    /* Speculative decoding with the model's drafter (mt_model_info.has_drafter): each decode
     * step of a sequence drafts spec_tokens tokens (0 = off, at most ENG_SPEC_MAX), verifies them
     * and its pending token in one step of spec_tokens + 1 rows, and emits the longest prefix the
     * target agrees with plus the target's own next token; the rejected rows leave no trace
     * (mt_seq_keep). Greedy output is the one without speculation; sampled output (speculative
     * sampling, engine.c spec_group) is distributed as without it, though a seed gives other
     * tokens. Only while a decode step has at most spec_max_batch sequences (0 = any): above it
     * batched decode gives more tokens a second. */
    int spec_tokens;
    int spec_max_batch;
    /* Test hook: when set, each drafted token is replaced by what it returns; gen_index is the
     * index among the sequence's generated tokens that the draft proposes. */
    int32_t (*spec_draft_hook)(void *user, uint64_t id, int gen_index, int32_t drafted);
    void *spec_hook_user;
    /* Wall clock in Unix milliseconds, for deadlines. NULL: CLOCK_REALTIME. */
    uint64_t (*now_ms)(void *user);
    void *clock_user;
} eng_params;

eng_params eng_default_params(void);

typedef struct eng_stats {
    int running;                 /* sequences holding model state */
    int waiting;
    int live_sequences;          /* running + waiting */
    size_t cache_bytes_in_use;   /* pool memory the running sequences hold (mt_seq_bytes: slot and
                                  * mapped pages) */
    uint64_t sequences_finished; /* ended by LENGTH or STOP */
    uint64_t sequences_aborted;  /* ended by eng_abort, a deadline or an error */
    uint64_t preemptions;        /* running sequences sent back to wait for pool room (recompute) */
    int pages_free, pages_total; /* the model's cache page pool */
    int slots_free, slots_total; /* the model's state slot pool */
    uint64_t tokens_generated;
    uint64_t steps;              /* eng_step calls that did work */
    uint64_t ahead_steps;        /* decode steps queued on the device's tokens (run_ahead) */
    uint64_t mixed_steps;        /* steps whose decode rows and prompt chunks were one model call */
    uint64_t layered_steps;      /* of them, steps that ran their chunks through some layers only */
    uint64_t spec_mixed_steps;   /* steps whose verifies were in one model call with the step's
                                  * decode rows or prompt chunks (mixed_steps and spec_tokens) */
    uint64_t prefill_tokens;     /* prompt tokens run through the model (a kept prefix's are not) */
    uint64_t held_steps;         /* steps that held their prompt work back (prefill_hold_ms) */
    uint64_t prefix_hits;        /* admissions that reused a kept prefix */
    uint64_t prefix_misses;      /* admissions (prefix reuse on) that found none */
    size_t prefix_cache_bytes;   /* held by kept prefixes (not in cache_bytes_in_use) */
    int prefix_entries;          /* kept prefixes; each holds one slot of the pool */
    uint64_t spec_steps;         /* speculative decode steps (one verify each) */
    uint64_t draft_tokens, accepted_tokens;
} eng_stats;

typedef struct eng_engine eng_engine;

/* The engine borrows the model (which must outlive it) and copies params and callbacks.
 * On error *out is NULL. */
mt_status eng_new(mt_model *m, const eng_params *params, const eng_callbacks *cb, eng_engine **out,
                  mt_error *err);
/* Frees every sequence without callbacks. NULL ok. */
void eng_free(eng_engine *e);

/* Queues a request under id (unique among live sequences). deadline_unix_ms 0 = none.
 * MT_ERR_INVALID (message names the field) for a malformed request or a duplicate live id,
 * MT_ERR_FULL when the waiting queue is full. On error nothing is queued and no callback runs. */
mt_status eng_submit(eng_engine *e, uint64_t id, const eng_request *req, uint64_t deadline_unix_ms,
                     mt_error *err);

/* Ends a live sequence now: frees its state, then on_finished with reason (CANCELLED normally)
 * and message (NULL = ""). MT_ERR_NOT_FOUND when id is not live (e.g. it already finished). */
mt_status eng_abort(eng_engine *e, uint64_t id, eng_finish reason, const char *message);

/* eng_abort on every live sequence (shutdown). */
void eng_abort_all(eng_engine *e, eng_finish reason, const char *message);

/* One scheduling step (see the top). *n_tokens (may be NULL) receives the tokens emitted. Errors
 * of one sequence end that sequence; the step itself returns MT_OK unless out of memory for the
 * step's own buffers. */
mt_status eng_step(eng_engine *e, int *n_tokens);

/* True while a sequence waits or runs (eng_step has something to do). */
/* Runs one request of n_prompt tokens (ids 0, 1, ...; at most the prompt budget the engine
 * accepts) that decodes n_new tokens, with no callbacks, no prefix kept and nothing counted: the
 * device's first-use costs (kernel loading, library set-up, the first graph captures) are paid
 * before the first real request instead of inside its step. Call it on an idle engine. */
mt_status eng_warmup(eng_engine *e, int n_prompt, int n_new, mt_error *err);
bool eng_has_work(const eng_engine *e);

void eng_get_stats(const eng_engine *e, eng_stats *out);

/* The cache pages only kept prefixes hold (dropping every kept prefix would free them; a page a
 * prefix shares with a live sequence counts as the sequence's), for stats that account for every
 * page. -1 when out of memory for its scratch. It walks every mapped block: call it seldom (the
 * worker does at most every PREFIX_PAGES_EVERY_S, worker/loop.c), not every step. Each kept
 * prefix also holds one slot: eng_stats.prefix_entries. */
int eng_prefix_pages(eng_engine *e);

#ifdef __cplusplus
}
#endif
#endif /* ENG_ENGINE_H */
