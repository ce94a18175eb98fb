/* worker/loop.h: the worker's engine side. wkr_loop_new makes the backend, loads the model, plans
 * the memory of its state pools and makes the engine; wkr_loop_run then runs the engine thread's
 * loop: receive the router's messages (worker/transport.h), hand Submit and Abort to the engine,
 * step it, and send every token it reports as Tokens and every end as Finished.
 *
 * This is the one file of the worker process that calls the engine (eng_*), the model and its
 * loader (glm_*) and the backend constructors; the transport and main know none of them.
 *
 * Protocol, as the router sees it: a Hello (the model and max_sequences) once linked; one Tokens
 * per sequence per engine step; Finished after a sequence's last Tokens (also after an Abort, so
 * the router knows the state is freed); a Submit the engine refuses is answered at once with
 * Finished(ERROR, why). When the link is lost (transport.h) every live sequence is dropped without
 * a word, since the router's streams are gone.
 *
 * Threads: one loop belongs to the thread that calls wkr_loop_new (the engine thread); the
 * transport adds the heartbeat thread while wkr_loop_run runs.
 */
#ifndef WKR_LOOP_H
#define WKR_LOOP_H

/* The most rows wkr_prefill_pass picks by itself: activations grow with it (the logits alone are
 * rows x vocab x 4 bytes, 2.5 GB at 4096 rows of a 154880 vocabulary). */
#define WKR_PREFILL_PASS_MAX 4096
/* The GPU worker's prompt budget a step without --prefill-budget (the engine's default, 2048, on
 * the CPU): the budget binds only while prompts queue, and there a larger group of prompts reads
 * the experts that the decode rows leave untouched once for more of them (bench-4L at saturation:
 * +5-8% output, and a goodput of at least 29.4 req/s, docs/PERF.md). */
#define WKR_GPU_PREFILL_BUDGET 4096
/* Most verifies one model call takes (speculative decoding; see load_model in loop.c). */
#define WKR_VERIFY_SEQS_MAX 16

#include <signal.h>
#include <stdbool.h>

#include "common/mt.h"
#include "kernels/cuda/cuda_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What metrale-worker's options set (worker/main.c states each one for the user). */
typedef struct wkr_params {
    const char *model;       /* checkpoint folder, or random:PRESET (random weights); borrowed */
    const char *router;      /* ZeroMQ endpoint of the router; borrowed */
    const char *backend;     /* "cpu", "cuda" or "auto" (cuda when a GPU is usable); borrowed */
    int id;                  /* worker id, >= 0 */
    int device;              /* GPU ordinal for cuda */
    int max_sequences;       /* running sequences at once; default 16 */
    int max_context;         /* prompt + new tokens per request; default 4096 */
    int threads;             /* CPU backend threads; 0 = all cores */
    long cache_budget_mb;    /* the state pools; 0: the backend's free memory less a reserve */
    int prefill_budget;      /* prompt tokens prefilled per step; 0: wkr_prefill_budget */
    double itl_target_ms;    /* eng_params.itl_target_ms; 0 (default): off */
    double prefill_hold_ms;  /* eng_params.prefill_hold_ms; 0 (default): off */
    int prefill_pass;        /* rows of one prefill pass (mt_model_params.prefill_chunk); 0: wkr_prefill_pass */
    int layered_max_waiting; /* eng_params.layered_max_waiting: 0 (default) no limit */
    int prefill_sites;       /* mt_model_params.layered_sites: 1 on, 0 off, -1 (default) wkr_layering */
    int prefill_expert_parts; /* mt_model_params.layered_expert_parts (with sites); -1 (default) wkr_layering */
    int fine_units_max_rows; /* eng_params.fine_units_max_rows (0: no limit); -1 (default) wkr_layering */
    int prefill_layers;      /* eng_params.prefill_layers (layered prefill): -1 (default) 1 with
                              * mixed steps where the backend queues its work (the GPU), else 0 */
    int graph_max_batch;     /* largest decode batch replayed as a CUDA graph; 0: the model's default */
    bool no_preempt;         /* admit only with pages for the whole length instead of preempting */
    int mixed_steps;         /* prompt chunks in the decode rows' model call (eng_params.mixed_steps):
                              * 1 on, 0 off, -1 (default) on where the backend queues its work (the GPU) */
    bool no_run_ahead;       /* greedy batches read each step's tokens before the next */
    bool pack_projections;   /* mt_model_params.pack_projections; default false */
    int spec_tokens;         /* speculative decoding with the checkpoint's MTP block: drafts a step
                              * (0 = off, up to ENG_SPEC_MAX) */
    int spec_max_batch;      /* speculate only while a decode step has at most this many sequences
                              * (0 = any) */
    int warmup_tokens;       /* eng_warmup's prompt before the first hello; 0: none; -1 (default):
                              * the prefill budget where the backend queues its work (the GPU) */
    double router_timeout;   /* seconds of router silence before exiting; default MT_WIRE_ROUTER_SILENCE_S */
    mt_numerics numerics;    /* the CUDA backend's prefill GEMMs; default MT_NUMERICS_BF16 */
    bool dequant_fp8;        /* --dtype bf16: FP8 checkpoints dequantised at load (mt_model_params) */
    /* Tensor parallelism: tp > 0 makes this process rank `rank` of a group of tp ranks on this
     * host, named group (a shared-memory communicator for the group's control and, on the CPU,
     * its partial sums; NCCL for those on GPUs, its id handed out by rank 0). Rank 0 talks to
     * the router; the other ranks follow it (wkr_follow). 0: no group. */
    int tp, rank;
    const char *group;       /* borrowed */
    /* CURVE to a router on another host (common/wire.h): z85 keys, both or neither; borrowed */
    const char *curve_server_key; /* the router's public key */
    const char *curve_secret_key; /* this worker's secret key */
} wkr_params;

/* The defaults above; model, router and id (-1) are left for the caller. */
wkr_params wkr_default_params(void);

typedef struct wkr_loop wkr_loop;

/* Makes the backend, the model, its pools and the engine, and connects to the router (not yet
 * linked: wkr_loop_run says Hello). p is copied; the strings it points to must outlive the loop.
 * NULL *out and a message in err on failure, nothing left behind. */
mt_status wkr_loop_new(const wkr_params *p, wkr_loop **out, mt_error *err);

/* Runs until *stop is set (a signal handler sets it), the router says Shutdown, the router is
 * silent for router_timeout, or (rank 0 of a group) a rank of the group died. MT_OK on Shutdown or
 * *stop; MT_ERR_IO when the router fell silent or the heartbeat thread could not start,
 * MT_ERR_BACKEND when the group broke (err says which). Live sequences stay live: wkr_loop_free
 * ends them. */
mt_status wkr_loop_run(wkr_loop *l, const volatile sig_atomic_t *stop, mt_error *err);

/* Ends every live sequence with Finished(CANCELLED) while the router is reachable, then frees the
 * engine, the link, the model and the backend. A rank 0 whose group broke (a rank died) sends
 * nothing for its sequences: they died with the group, and the router, seeing this worker go,
 * gives them to another group or ends them UNAVAILABLE. NULL ok. */
void wkr_loop_free(wkr_loop *l);

/* A rank > 0 of a tensor-parallel group: makes the backend, joins the group, loads its shard and
 * runs every call rank 0 makes (worker/dist/tp_model.h) until rank 0 stops (MT_OK) or the group
 * fails (a rank died: the error). *started says whether it got as far as following (false: a
 * start-up failure). Signals do not stop it: it ends with rank 0. */
mt_status wkr_follow(const wkr_params *p, bool *started, mt_error *err);

/* The prompt tokens a step prefills: --prefill-budget, else WKR_GPU_PREFILL_BUDGET on the GPU and
 * the engine's default on the CPU. */
int wkr_prefill_budget(const wkr_params *p, bool gpu);

/* The rows of one prefill pass the worker gives its model (see loop.c). */
int wkr_prefill_pass(const wkr_params *p, bool gpu);

/* The units a layered prompt goes through (mt_model_params.layered_sites, layered_expert_parts
 * and its soft flag) and the decode rows under which they go one a step
 * (eng_params.fine_units_max_rows). */
typedef struct wkr_layering {
    bool sites;
    int expert_parts;
    bool parts_soft;
    int fine_rows;
} wkr_layering;

/* The expert parts and row limit of a single GPU's defaults (docs/PERF.md): the MLP site in two
 * parts, fine units beside at most 4 decode rows. */
#define WKR_GPU_EXPERT_PARTS 2
#define WKR_GPU_FINE_ROWS 4

/* --prefill-sites, --prefill-expert-parts and --fine-units-max-rows where given; otherwise on one
 * GPU (gpu, no tensor-parallel group) sites with WKR_GPU_EXPERT_PARTS parts (soft: a model that
 * cannot split its experts so keeps its MLP sites whole) beside at most WKR_GPU_FINE_ROWS rows,
 * and whole layers elsewhere. */
wkr_layering wkr_layering_of(const wkr_params *p, bool gpu);

#ifdef __cplusplus
}
#endif

#endif /* WKR_LOOP_H */
