/* worker/engine/sched.h: the scheduler's decisions, apart from carrying them out. Each function
 * looks at a small view of the engine's state and answers one question (may this request be
 * admitted now, how many prompt tokens does this prefill take, which sequence gives way); the
 * engine (engine.c) acts on the answer: it allocates, evicts kept prefixes, preempts and calls the
 * model. No function here touches a sequence, a pool or the model.
 */
#ifndef ENG_SCHED_H
#define ENG_SCHED_H

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What admission looks at. */
typedef struct sched_room {
    size_t cache_bytes;        /* charged to the running sequences */
    size_t cache_budget;       /* 0: no byte budget */
    int slots_free, pages_free;
    int page_tokens;           /* positions per page; pages matter only when paged */
    bool paged;
    int n_running;
} sched_room;

/* A waiting request as admission sees it. */
typedef struct sched_req {
    int n_feed;                /* tokens its prefill feeds */
    int n_prompt, max_new_tokens;
    size_t bytes_max;          /* pool memory its whole length holds at most */
} sched_req;

typedef enum sched_verdict {
    SCHED_ADMIT,               /* it may start now */
    SCHED_WAIT,                /* it waits: so does every later one (FIFO) */
    SCHED_EVICT,               /* short of a slot or pages that a kept prefix holds: evict one, ask again */
} sched_verdict;

/* Whether r may start: within the byte budget, with a slot, and with pages for its prefill and
 * first token (preempt) or for its whole length (!preempt). Short of a slot or pages, it asks for
 * a kept prefix to go (can_evict: one is kept) before it waits; a request alone may start short
 * of pages (it can preempt nobody, so it gives way itself if it must). FIFO: the head of the
 * queue waits for room rather than letting later, smaller requests pass it. */
sched_verdict sched_admit(const sched_room *room, const sched_req *r, bool preempt, bool can_evict);

/* Prompt tokens the next prefill chunk of a sequence takes: what remains of it (n_feed -
 * prefilled), at most the step's budget, and stopping at snap_at (a prefix boundary to keep)
 * when it lies inside the chunk. */
int sched_prefill_chunk(int n_feed, int prefilled, int budget, int snap_at);

/* The prompt position to keep as a prefix snapshot: the last multiple of block that leaves at
 * least one prompt token, when it lies past what is already there (prefilled) and the sequence
 * is new (no generated tokens); 0 = none. */
int sched_prefix_boundary(int n_prompt, int block, int prefilled, int n_gen);

/* The running sequence that gives way when sequence `self` (an index into running order) cannot
 * get pages: the newest one admitted after self that still holds state (holds[i]); -1 when none,
 * since an older sequence never gives way for a newer one. */
int sched_victim(const bool *holds, int n_running, int self);

/* Step pacing: the prompt tokens a step may take so that its decode rows get their next token
 * within a latency target. A step is modelled as base + chunk + per_token * prompt tokens: base is
 * what a step without prompt work takes (its decode rows alone); chunk what any prompt work adds
 * whatever its size (on a MoE model a few hundred prompt rows already touch most experts, so the
 * pass reads nearly all the expert weights); per_token what each prompt token adds. base is a
 * running mean of decode-only steps; chunk and per_token the intercept and slope of a line fitted
 * to the steps with prompt work, their points weighted as running means are, so the model follows
 * the batch as it grows and the prompts as their attention lengthens. A model without the chunk
 * term charges the fixed cost to the tokens of the chunk sizes it sees, and so keeps choosing
 * the small chunks that make a token look expensive. */
typedef struct sched_pace {
    double base_ms;            /* a decode-only step; < 0 until one is measured */
    double per_token_ms;       /* each prompt token of a step; < 0 until a step with prompt work is */
    double chunk_ms;           /* any prompt work, beyond base; 0 until the fit can tell it apart */
    /* the fit's weighted sums over steps with prompt work: x = prompt tokens, y = ms beyond base */
    double s0, sx, sy, sxx, sxy;
} sched_pace;

/* Nothing measured yet. */
void sched_pace_init(sched_pace *p);

/* One measured step: ms of wall time, `tokens` prompt tokens in it (0: decode only), `rows`
 * decode rows beside them. A step with prompt work is charged to per_token only once base is
 * known: base is also what a step costs before its first prompt token (the weights its rows
 * read), which would otherwise inflate the cost of the few tokens of a short prompt. */
void sched_pace_note(sched_pace *p, double ms, int tokens, int rows);

/* The prompt tokens of the next step for a target of target_ms: (target - base - chunk) / per_token,
 * within [floor, cap]; cap while nothing is measured, or with no decode rows waiting on the step
 * (rows == 0: nobody's latency is at stake) or no target (target_ms <= 0). floor keeps a long
 * prompt moving when the decode rows alone take the whole target, so it is never starved. */
int sched_pace_budget(const sched_pace *p, double target_ms, int rows, int floor, int cap);

/* Whether a request's prefill of `tokens` prompt tokens cannot finish within remaining_ms at the
 * measured cost of a prompt token (its first token would come after its deadline): then admission
 * ends it at once instead of spending the prefill. False while nothing is measured. */
bool sched_deadline_hopeless(const sched_pace *p, int tokens, double remaining_ms);

/* The prompt tokens of a mixed step of `rows` decode rows, for a budget of `budget`, when the
 * model runs `pass` rows a pass (each pass reads the weights its rows touch): the budget, cut so
 * that rows and prompt tokens end on a pass boundary where that leaves at least `floor` tokens
 * (64 decode rows and a 2048-token budget in 2048-row passes: 1984 tokens, one pass, not two). */
int sched_mixed_budget(int budget, int rows, int pass, int floor);

/* Prefill coalescing under saturation: whether a step with `rows` decode rows holds back the
 * admission of new prompts into its `places` free places (at least one). Only while more requests
 * wait than there are places (admission is limited by places, so every freed place admits one
 * prompt, and each such prompt alone would cost a step that reads most of the experts), while the
 * prompt tokens ready to prefill (`ready`: the waiting ones that fit the places) are under half
 * the step's `budget`, and for at most hold_ms since the hold began (`held_ms`); hold_ms <= 0
 * turns it off. Below saturation nothing waits, so it costs TTFT only where requests queue. */
bool sched_hold_prefill(double hold_ms, double held_ms, int rows, int waiting, int places, int ready, int budget);

#ifdef __cplusplus
}
#endif
#endif /* ENG_SCHED_H */
