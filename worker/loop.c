/* worker/loop.c: see loop.h. Every call into the engine, the model and the backend
 * constructors of the worker process is in this file. */
#include "worker/loop.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/wire_limits.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "worker/dist/comm_host.h"
#include "worker/dist/comm_nccl.h"
#include "worker/dist/tp_model.h"
#include "worker/engine/engine.h"
#include "worker/model/model.h"
#include "worker/seq_text.h"
#include "worker/text/text_model.h"
#include "worker/transport.h"

#define IDLE_WAIT_MS 50 /* longest wait for a message when idle */
#define PREFIX_PAGES_EVERY_S 0.1 /* eng_prefix_pages walks every mapped block: at most this often */

/* The router checks top_logprobs against the wire limit; the engine's results must hold that many. */
_Static_assert(MT_WIRE_TOP_LOGPROBS_MAX <= ENG_TOP_LOGPROBS_MAX, "top_logprobs of the wire exceed the engine's");

struct wkr_loop {
    wkr_params p;
    mt_backend *be;
    mt_comm *ctl, *data;       /* the group's communicators (tp > 0); data may be ctl */
    mt_model *m;
    eng_engine *eng;
    wkr_transport *t;
    const char *backend_name;  /* "cpu" or "cuda" */
    bool gpu;                  /* backend_name is "cuda" */
    Metrale__V1__ModelInfo info; /* the Hello's model; the transport borrows it */
    bool quiet;                /* dropping sequences: their callbacks send nothing */
    txt_model *text;           /* the tokenizer and chat template; NULL: ids only */
    wkr_texts *texts;          /* the live sequences' text state */
    int32_t *eos;              /* [n_eos] every id that ends a sequence unless ignore_eos */
    uint32_t *eos_u32;         /* the same, for ModelInfo */
    size_t n_eos;
    int prefix_pages;          /* the last eng_prefix_pages, and when it was taken */
    double prefix_pages_at;
};

wkr_params wkr_default_params(void) {
    return (wkr_params){ .backend = "cpu", .id = -1, .max_sequences = 16, .max_context = 4096,
                         .router_timeout = MT_WIRE_ROUTER_SILENCE_S, .numerics = MT_NUMERICS_BF16,
                         .mixed_steps = -1, .prefill_layers = -1, .warmup_tokens = -1, .prefill_sites = -1,
                         .prefill_expert_parts = -1, .fine_units_max_rows = -1 };
}

/* ---- start-up ---- */

/* The backend named by the options; "auto" falls back to the CPU when no GPU is usable. */
static mt_backend *open_backend(wkr_loop *l, mt_error *err) {
    const wkr_params *o = &l->p;
    if (strcmp(o->backend, "cpu")) {
        mt_cuda_params cp = mt_cuda_default_params();
        cp.numerics = o->numerics;
        mt_backend *be = mt_cuda_backend_new(o->device, &cp, err);
        if (be) {
            l->backend_name = "cuda";
            l->gpu = true;
            return be;
        }
        if (!strcmp(o->backend, "cuda")) return NULL;
        mt_log(MT_LOG_INFO, "worker %d: no usable GPU (%s); using the CPU backend", o->id, err->msg);
    }
    l->backend_name = "cpu";
    mt_backend *be = mt_cpu_backend_new(o->threads);
    if (!be) mt_errorf(err, MT_ERR_NOMEM, "out of memory for the CPU backend");
    return be;
}

/* The start-up memory plan: what the backend has free after the weights, less a reserve for
 * activations, scratch and graphs, goes to the model's two pools: slots (one per running
 * sequence, per kept prefix, and the graph pad) and pages (the DSA caches), no more pages than every
 * slot at full context could use. --cache-budget-mb gives the pools a fixed size instead. A
 * request waits while the pools are short; a running one that runs out is preempted and resumed,
 * never failed. Logged as one line: the split, and how many tokens and sequences fit. */
static mt_status plan_memory(wkr_loop *l, eng_params *ep, mt_error *err) {
    mt_model *m = l->m;
    mt_backend *be = l->be;
    const mt_model_info mi = mt_model_describe(m);
    const size_t page_b = mi.page_bytes, slot_b = mi.slot_bytes;
    const int page = mi.page_tokens;
    const int prefix_slots = ep->prefix_cache_bytes ? (ep->max_sequences + 1) / 2 : 0;
    const int slots = ep->max_sequences + prefix_slots + 1;
    const int full = (l->p.max_context + page - 1) / page; /* pages of one full-context sequence */
    const long long want_pages = (long long)full * slots + 1;
    size_t free_b = 0, total_b = 0, pools;
    const bool gpu = l->gpu;
    size_t reserve = 0;
    if (l->p.cache_budget_mb > 0) {
        pools = (size_t)l->p.cache_budget_mb << 20;
    } else if (be->ops->mem_info && be->ops->mem_info(be, &free_b, &total_b) == MT_OK) {
        /* GPU: keep a tenth (at least 2 GiB) for activations, scratch and graphs; CPU: half */
        reserve = gpu ? (free_b / 10 > ((size_t)2 << 30) ? free_b / 10 : ((size_t)2 << 30)) : free_b / 2;
        pools = free_b > reserve ? free_b - reserve : 0;
    } else {
        pools = (size_t)want_pages * page_b + (size_t)slots * slot_b;
    }
    if (pools < (size_t)slots * slot_b + (page_b ? page_b * (size_t)(full + 1) : 0))
        return mt_errorf(err, MT_ERR_NOMEM,
                         "memory plan: %zu MiB for the pools cannot hold %d slots of %zu KiB and one %d-token sequence",
                         pools >> 20, slots, slot_b >> 10, l->p.max_context);
    long long pages = page_b ? (long long)((pools - (size_t)slots * slot_b) / page_b) : 1;
    if (pages > want_pages) pages = want_pages;
    if (pages > INT32_MAX / 2) pages = INT32_MAX / 2;
    mt_status st = mt_model_set_pools(m, (int)pages, slots, err);
    if (st != MT_OK) return st;
    ep->cache_budget_bytes = 0; /* the pools are the budget */
    mt_log(MT_LOG_INFO,
           "worker %d: memory plan: %zu MiB free of %zu MiB, %zu MiB kept for activations and graphs; pools: "
           "%lld pages of %d tokens (%zu KiB each, %zu MiB) = %lld tokens of DSA cache, %d slots (%zu KiB each, "
           "%zu MiB) = %d running sequences + %d kept prefixes + 1 graph pad; %lld full %d-token sequences fit",
           l->p.id, free_b >> 20, total_b >> 20, reserve >> 20, pages, page, page_b >> 10,
           (size_t)(pages * (long long)page_b) >> 20, pages * page, slots, slot_b >> 10,
           ((size_t)slots * slot_b) >> 20, ep->max_sequences, prefix_slots, page_b ? pages / full : (long long)slots,
           l->p.max_context);
    return MT_OK;
}

/* Weight loading as it goes: a "weights_progress" record at each tenth of the bytes or every
 * LOAD_LOG_EVERY_S, whichever comes first, then "weights_loaded" (load_model). */
typedef struct load_log {
    double t0, last_at;
    int last_tenth;
    uint64_t read;             /* bytes this rank read so far */
} load_log;

#define LOAD_LOG_EVERY_S 5.0

static void on_load_progress(void *user, uint64_t done, uint64_t total, uint64_t read) {
    load_log *g = user;
    g->read = read;
    const double now = mt_now(), pct = total ? 100.0 * (double)done / (double)total : 100.0;
    const int tenth = (int)(pct / 10);
    if (tenth <= g->last_tenth && now - g->last_at < LOAD_LOG_EVERY_S) return;
    g->last_tenth = tenth;
    g->last_at = now;
    const double s = now - g->t0;
    const mt_log_field f[] = {
        mt_logf_double("percent", pct < 100 ? pct : 100),
        mt_logf_uint("bytes", read),
        mt_logf_double("bytes_per_s", s > 0 ? (double)read / s : 0),
        mt_logf_double("elapsed_s", s),
    };
    mt_log_event(MT_LOG_INFO, "weights_progress", NULL, f, sizeof f / sizeof f[0]);
}

/* The prompt tokens a step prefills (loop.h). */
int wkr_prefill_budget(const wkr_params *p, bool gpu) {
    if (p->prefill_budget > 0) return p->prefill_budget;
    return gpu ? WKR_GPU_PREFILL_BUDGET : eng_default_params().prefill_budget;
}

/* Rows of one prefill pass: --prefill-pass, else on the GPU the step's whole prompt budget (every
 * pass reads the weights its rows touch, and a few hundred rows already touch most experts of an
 * MoE layer: a 2048-token chunk in 256-row passes reads them eight times), on the CPU the model's
 * default (its passes are compute-bound; larger ones only take memory). A pass is also the most
 * rows of one batched decode pass, so it is never below the default or max_sequences. */
int wkr_prefill_pass(const wkr_params *p, bool gpu) {
    if (p->prefill_pass > 0) return p->prefill_pass;
    const int dflt = mt_model_default_params().prefill_chunk;
    if (!gpu) return dflt;
    int rows = wkr_prefill_budget(p, gpu);
    if (rows < dflt) rows = dflt;
    if (rows < p->max_sequences) rows = p->max_sequences;
    return rows < WKR_PREFILL_PASS_MAX ? rows : WKR_PREFILL_PASS_MAX;
}

/* The layered units (loop.h). A tensor-parallel group keeps whole layers by default: the fine
 * units' figures are of one GPU. */
wkr_layering wkr_layering_of(const wkr_params *p, bool gpu) {
    const bool one_gpu = gpu && p->tp <= 1;
    wkr_layering y = { .sites = p->prefill_sites >= 0 ? p->prefill_sites == 1 : one_gpu };
    if (p->prefill_expert_parts >= 0) {
        y.expert_parts = p->prefill_expert_parts;
    } else if (y.sites && one_gpu) {
        y.expert_parts = WKR_GPU_EXPERT_PARTS;
        y.parts_soft = true;
    }
    y.fine_rows = p->fine_units_max_rows >= 0 ? p->fine_units_max_rows : one_gpu ? WKR_GPU_FINE_ROWS : 0;
    return y;
}

/* --model: a checkpoint folder (the architecture from its config.json), or random:PRESET (tiny,
 * bench-4L): random weights made on the backend from a fixed seed, for benchmarks of the real
 * shapes without a checkpoint file. */
static mt_status load_model(wkr_loop *l, mt_error *err) {
    mt_model_params mp = mt_model_default_params();
    if (l->p.graph_max_batch > 0) mp.graph_max_rows = l->p.graph_max_batch;
    mp.prefill_chunk = wkr_prefill_pass(&l->p, l->gpu);
    mp.mtp = l->p.spec_tokens > 0;
    /* the verifies one model call takes: those of a step of up to --speculative-max-batch
     * sequences, at most WKR_VERIFY_SEQS_MAX (each holds GLM_VERIFY_MAX - 1 more recurrent slots) */
    const int vs = l->p.spec_max_batch > 0 ? l->p.spec_max_batch : l->p.max_sequences;
    mp.verify_seqs = vs < WKR_VERIFY_SEQS_MAX ? vs : WKR_VERIFY_SEQS_MAX;
    mp.dequant_fp8 = l->p.dequant_fp8;
    mp.pack_projections = l->p.pack_projections;
    const wkr_layering ly = wkr_layering_of(&l->p, l->gpu);
    mp.layered_sites = ly.sites;
    mp.layered_expert_parts = ly.expert_parts;
    mp.layered_expert_parts_soft = ly.parts_soft;
    mp.comm = l->data;
    load_log g = { .t0 = mt_now(), .last_at = mt_now(), .last_tenth = -1 };
    mp.on_load_progress = on_load_progress;
    mp.load_progress_user = &g;
    mt_status st = mt_model_load(l->p.model, l->be, &mp, &l->m, err);
    if (st != MT_OK) return st;
    const double s = mt_now() - g.t0;
    const mt_log_field f[] = {
        mt_logf_str("model", l->p.model),
        mt_logf_double("percent", 100),
        mt_logf_uint("bytes", g.read),
        mt_logf_double("bytes_per_s", s > 0 ? (double)g.read / s : 0),
        mt_logf_double("seconds", s),
        mt_logf_str("backend", l->backend_name),
    };
    mt_log_event(MT_LOG_INFO, "weights_loaded", NULL, f, sizeof f / sizeof f[0]);
    return MT_OK;
}

/* Joins the group (tp > 0): the host communicator `group`, and on a GPU an NCCL one whose id rank
 * 0 makes and hands to the others over the host one. */
static mt_status join_group(wkr_loop *l, mt_error *err) {
    const wkr_params *p = &l->p;
    if (p->tp <= 0) return MT_OK;
    if (!p->group) return mt_errorf(err, MT_ERR_INVALID, "a tensor-parallel rank needs its group's name");
    if (!(l->ctl = mt_comm_host_new(p->group, p->rank, p->tp, NULL, err))) return MT_ERR_BACKEND;
    if (!l->gpu) {
        l->data = l->ctl;
        return MT_OK;
    }
    char hex[MT_COMM_NCCL_ID_HEX] = "";
    mt_status st = p->rank == 0 ? mt_comm_nccl_id_new(hex, sizeof hex, err) : MT_OK;
    if (st == MT_OK && mt_comm_broadcast(l->ctl, hex, sizeof hex, 0) != MT_OK)
        st = mt_errorf(err, MT_ERR_BACKEND, "handing out the NCCL id: %s", l->ctl->err.msg);
    mt_comm_nccl_id id;
    if (st == MT_OK) st = mt_comm_nccl_id_parse(hex, &id, err);
    if (st == MT_OK && !(l->data = mt_comm_nccl_new(&id, p->rank, p->tp, l->be, NULL, err))) st = MT_ERR_BACKEND;
    return st;
}

static void group_free(wkr_loop *l) {
    if (l->data != l->ctl) mt_comm_free(l->data);
    mt_comm_free(l->ctl);
    l->data = l->ctl = NULL;
}

mt_status wkr_follow(const wkr_params *p, bool *started, mt_error *err) {
    wkr_loop l = { .p = *p };
    mt_status st;
    mt_error be_err = { "" };
    *started = false;
    if (!(l.be = open_backend(&l, &be_err))) return mt_errorf(err, MT_ERR_BACKEND, "%s backend: %s", p->backend, be_err.msg);
    if ((st = join_group(&l, err)) == MT_OK && (st = load_model(&l, err)) == MT_OK) {
        mt_log(MT_LOG_INFO, "worker %d: rank %d of %d loaded %s on %s; following rank 0", p->id, p->rank, p->tp,
               p->model, l.backend_name);
        *started = true;
        st = mt_tp_follow(l.m, l.ctl, err);
    }
    mt_model_free(l.m);
    group_free(&l);
    mt_backend_free(l.be);
    return st;
}

static void on_tokens(void *user, uint64_t id, const eng_sample_result *toks, int n);
static void on_prompt_logprobs(void *user, uint64_t id, int first, const eng_sample_result *r, int n);
static void on_finished(void *user, uint64_t id, const eng_finish_info *f);

/* The text side of a checkpoint folder (random:PRESET models have none), and the eos list: the
 * tokenizer's (generation_config.json, tokenizer_config.json), then config.json's when not among
 * them; ids outside the vocabulary are dropped. */
static mt_status load_text(wkr_loop *l, const mt_model_info *mi, mt_error *err) {
    mt_status st = strncmp(l->p.model, "random:", 7) ? txt_model_load(l->p.model, &l->text, err) : MT_OK;
    if (st != MT_OK) return st;
    if (!(l->texts = wkr_texts_new(l->text ? txt_model_tokenizer(l->text) : NULL)))
        return mt_errorf(err, MT_ERR_NOMEM, "out of memory for the worker");
    const tok_special_ids sp = l->text ? tok_special(txt_model_tokenizer(l->text)) : (tok_special_ids){ .bos = -1 };
    l->eos = malloc(sizeof *l->eos * (size_t)(sp.n_eos + 1));
    l->eos_u32 = malloc(sizeof *l->eos_u32 * (size_t)(sp.n_eos + 1));
    if (!l->eos || !l->eos_u32) return mt_errorf(err, MT_ERR_NOMEM, "out of memory for the worker");
    for (int i = 0; i <= sp.n_eos; i++) {
        const int32_t id = i < sp.n_eos ? sp.eos[i] : mi->eos_token_id;
        bool seen = id < 0 || id >= mi->vocab_size;
        for (size_t k = 0; k < l->n_eos && !seen; k++) seen = l->eos[k] == id;
        if (seen) continue;
        l->eos_u32[l->n_eos] = (uint32_t)id;
        l->eos[l->n_eos++] = id;
    }
    if (l->text)
        mt_log(MT_LOG_INFO, "worker %d: tokenizer of %d ids, %zu eos ids, chat template: %s", l->p.id,
               tok_vocab_size(txt_model_tokenizer(l->text)), l->n_eos,
               txt_model_has_chat(l->text) ? "yes" : txt_model_chat_error(l->text) ? "refused" : "none");
    return MT_OK;
}

mt_status wkr_loop_new(const wkr_params *p, wkr_loop **out, mt_error *err) {
    *out = NULL;
    wkr_loop *l = calloc(1, sizeof *l);
    if (!l) return mt_errorf(err, MT_ERR_NOMEM, "out of memory for the worker");
    l->p = *p;
    mt_status st;
    const double t0 = mt_now();
    mt_error be_err = { "" };
    if (!(l->be = open_backend(l, &be_err))) {
        st = mt_errorf(err, MT_ERR_BACKEND, "%s backend: %s", p->backend, be_err.msg);
        goto fail;
    }
    if ((st = join_group(l, err)) != MT_OK || (st = load_model(l, err)) != MT_OK) goto fail;
    if (l->ctl && (st = mt_tp_leader_new(l->m, l->ctl, &l->m, err)) != MT_OK) goto fail;
    const mt_model_info mi = mt_model_describe(l->m);
    eng_params ep = eng_default_params();
    ep.max_sequences = p->max_sequences;
    ep.max_context = p->max_context;
    ep.prefill_budget = wkr_prefill_budget(p, l->gpu);
    ep.itl_target_ms = p->itl_target_ms;
    ep.prefill_hold_ms = p->prefill_hold_ms;
    ep.preempt = !p->no_preempt;
    /* on bench-4L's GPU figures the mixed step serves the most (docs/PERF.md); on the CPU a pass
     * costs its rows, so the decode rows gain nothing by riding along */
    ep.mixed_steps = p->mixed_steps >= 0 ? p->mixed_steps == 1 : mi.backend_queues;
    /* layered prefill beside mixed steps' decode rows: on bench-4L's GPU figures ITL p99 at 19.4
     * req/s falls from 32 to 22 ms at the same output (docs/PERF.md); nothing to gain on the CPU */
    ep.prefill_layers = p->prefill_layers >= 0 ? p->prefill_layers : ep.mixed_steps && mi.backend_queues ? 1 : 0;
    ep.layered_max_waiting = p->layered_max_waiting;
    ep.fine_units_max_rows = wkr_layering_of(p, l->gpu).fine_rows;
    ep.run_ahead = p->no_run_ahead ? ENG_RUN_AHEAD_OFF : ENG_RUN_AHEAD_AUTO;
    ep.spec_tokens = p->spec_tokens;
    ep.spec_max_batch = p->spec_max_batch;
    if ((st = plan_memory(l, &ep, err)) != MT_OK) goto fail;
    eng_callbacks cb = { .user = l, .on_tokens = on_tokens, .on_prompt_logprobs = on_prompt_logprobs,
                         .on_finished = on_finished };
    if ((st = eng_new(l->m, &ep, &cb, &l->eng, err)) != MT_OK) goto fail;
    /* a GPU's first steps load kernels, set up the GEMM libraries and capture graphs (seconds):
     * paid here, before the router sends work, instead of inside the first requests' steps */
    const int warm = p->warmup_tokens >= 0 ? p->warmup_tokens : mi.backend_queues ? ep.prefill_budget : 0;
    if (warm > 0) {
        const double tw = mt_now();
        mt_error werr = { "" };
        if (eng_warmup(l->eng, warm, 4, &werr) == MT_OK)
            mt_log(MT_LOG_INFO, "worker %d: warmed up on a %d-token request in %.2f s", p->id, warm, mt_now() - tw);
        else /* the first requests pay the set-up instead */
            mt_log(MT_LOG_WARN, "worker %d: warm-up failed (%s); serving without it", p->id, werr.msg);
    }
    if ((st = load_text(l, &mi, err)) != MT_OK) goto fail;
    l->info = (Metrale__V1__ModelInfo)METRALE__V1__MODEL_INFO__INIT;
    l->info.model_type = (char *)mi.arch;
    l->info.vocab_size = (uint32_t)mi.vocab_size;
    l->info.max_context = (uint32_t)p->max_context;
    l->info.num_layers = (uint32_t)mi.n_layers;
    l->info.hidden_size = (uint32_t)mi.hidden_size;
    l->info.eos_token_id = l->n_eos ? l->eos[0] : -1;
    l->info.n_eos_token_ids = l->n_eos;
    l->info.eos_token_ids = l->eos_u32;
    l->info.has_tokenizer = l->text != NULL;
    l->info.has_chat_template = l->text && txt_model_has_chat(l->text);
    l->info.backend = (char *)l->backend_name;
    wkr_transport_params tp = { .router = p->router, .worker_id = (uint32_t)p->id,
                                .max_sequences = (uint32_t)p->max_sequences, .model = &l->info,
                                .curve_server_key = p->curve_server_key, .curve_secret_key = p->curve_secret_key };
    if ((st = wkr_transport_new(&tp, &l->t, err)) != MT_OK) goto fail;
    mt_log(MT_LOG_INFO, "worker %d: loaded %s (%s, %d layers, hidden %d, vocab %d) on %s in %.2f s", p->id, p->model,
           mi.arch, mi.n_layers, mi.hidden_size, mi.vocab_size, l->backend_name, mt_now() - t0);
    *out = l;
    return MT_OK;
fail:
    wkr_loop_free(l);
    return st;
}

/* Whether this is rank 0 of a group that lost a rank. Its sequences died with the group: the
 * router learns it from this worker's exit, not from Finished messages. */
static bool group_broken(wkr_loop *l) { return l->ctl && mt_comm_check(l->ctl) != MT_OK; }

void wkr_loop_free(wkr_loop *l) {
    if (!l) return;
    if (group_broken(l)) l->quiet = true;
    if (l->eng) /* Finished(CANCELLED) for each live sequence while the router is reachable */
        eng_abort_all(l->eng, ENG_FINISH_CANCELLED, "worker shutting down");
    eng_free(l->eng);
    wkr_texts_free(l->texts);
    txt_model_free(l->text);
    free(l->eos);
    free(l->eos_u32);
    wkr_transport_free(l->t);
    mt_model_free(l->m);
    group_free(l);
    mt_backend_free(l->be);
    free(l);
}

/* ---- engine -> router ---- */

/* The bytes of token id (for a logprobs entry), or none. */
static ProtobufCBinaryData token_bytes(const wkr_loop *l, int32_t id) {
    size_t len = 0;
    const uint8_t *b = l->text ? tok_id_to_bytes(txt_model_tokenizer(l->text), id, &len) : NULL;
    return (ProtobufCBinaryData){ .len = b ? len : 0, .data = (uint8_t *)b };
}

/* Fills gt (and its alternatives lp[ENG_TOP_LOGPROBS_MAX] and their pointers) from r. */
static void fill_token(const wkr_loop *l, const eng_sample_result *r, bool bytes, Metrale__V1__GeneratedToken *gt,
                       Metrale__V1__TokenLogprob *lp, Metrale__V1__TokenLogprob **lpp) {
    *gt = (Metrale__V1__GeneratedToken)METRALE__V1__GENERATED_TOKEN__INIT;
    gt->token_id = (uint32_t)r->token;
    gt->logprob = r->logprob; /* 0 (not serialised) unless asked for */
    if (bytes) gt->bytes = token_bytes(l, r->token);
    for (int k = 0; k < r->n_top; k++) {
        lp[k] = (Metrale__V1__TokenLogprob)METRALE__V1__TOKEN_LOGPROB__INIT;
        lp[k].token_id = (uint32_t)r->top_ids[k];
        lp[k].logprob = r->top_logprobs[k];
        if (bytes) lp[k].bytes = token_bytes(l, r->top_ids[k]);
        lpp[k] = &lp[k];
    }
    gt->n_top_logprobs = (size_t)r->n_top;
    gt->top_logprobs = r->n_top ? lpp : NULL;
}

/* The prompt logprobs s kept, as the first Tokens' prompt_logprobs: *n entries of one
 * allocation (free() it), NULL when none or out of memory (then they are not sent). */
static Metrale__V1__GeneratedToken **echo_tokens(const wkr_loop *l, const wkr_seq_text *s, size_t *n) {
    *n = 0;
    if (!s || !s->n_echo) return NULL;
    const size_t k = (size_t)s->n_echo;
    const size_t one = sizeof(Metrale__V1__GeneratedToken *) + sizeof(Metrale__V1__GeneratedToken) +
                       ENG_TOP_LOGPROBS_MAX * (sizeof(Metrale__V1__TokenLogprob) + sizeof(Metrale__V1__TokenLogprob *));
    uint8_t *mem = malloc(one * k);
    if (!mem) {
        mt_log(MT_LOG_WARN, "worker %d: out of memory for %zu prompt logprobs; not sent", l->p.id, k);
        return NULL;
    }
    Metrale__V1__GeneratedToken **ptr = (Metrale__V1__GeneratedToken **)mem;
    Metrale__V1__GeneratedToken *gt = (Metrale__V1__GeneratedToken *)(ptr + k);
    Metrale__V1__TokenLogprob *lp = (Metrale__V1__TokenLogprob *)(gt + k);
    Metrale__V1__TokenLogprob **lpp = (Metrale__V1__TokenLogprob **)(lp + k * ENG_TOP_LOGPROBS_MAX);
    for (size_t i = 0; i < k; i++) {
        fill_token(l, &s->echo[i], s->bytes, &gt[i], lp + i * ENG_TOP_LOGPROBS_MAX, lpp + i * ENG_TOP_LOGPROBS_MAX);
        ptr[i] = &gt[i];
    }
    *n = k;
    return ptr;
}

static void on_tokens(void *user, uint64_t id, const eng_sample_result *toks, int n) {
    wkr_loop *l = user;
    if (l->quiet || !l->t) return;
    wkr_seq_text *s = wkr_texts_find(l->texts, id);
    if (s && s->stopped) return; /* a stop string ended it: what the step made after goes nowhere */
    Metrale__V1__GeneratedToken gt[n];
    Metrale__V1__GeneratedToken *gtp[n];
    Metrale__V1__TokenLogprob lp[n][ENG_TOP_LOGPROBS_MAX];
    Metrale__V1__TokenLogprob *lpp[n][ENG_TOP_LOGPROBS_MAX];
    tok_text piece = { 0 };
    int sent = 0;
    for (int i = 0; i < n; i++) {
        fill_token(l, &toks[i], s && s->bytes, &gt[i], lp[i], lpp[i]);
        gtp[i] = &gt[i];
        sent++;
        if (!s) continue;
        s->n_sent++;
        s->last_token = toks[i].token;
        int stop = -1;
        mt_error err = { "" };
        if (s->out && txt_out_push(s->out, toks[i].token, &piece, &stop, &err) != MT_OK)
            mt_log(MT_LOG_WARN, "worker %d: sequence %llu: %s", l->p.id, (unsigned long long)id, err.msg);
        if (stop >= 0) {
            wkr_texts_mark_stopped(l->texts, s);
            break;
        }
    }
    size_t n_echo = 0;
    Metrale__V1__GeneratedToken **echo = echo_tokens(l, s, &n_echo);
    if (s) s->n_echo = 0;
    wkr_transport_send_tokens(l->t, id, gtp, (size_t)sent, piece.s, echo, n_echo);
    free(echo);
    tok_text_free(&piece);
}

static void on_prompt_logprobs(void *user, uint64_t id, int first, const eng_sample_result *r, int n) {
    wkr_loop *l = user;
    (void)first; /* reported in order from position 1, once each */
    wkr_seq_text *s = wkr_texts_find(l->texts, id);
    mt_error err = { "" };
    if (s && wkr_seq_text_echo(s, r, n, &err) != MT_OK) mt_log(MT_LOG_WARN, "worker %d: %s", l->p.id, err.msg);
}

/* eng_finish has the values of metrale.v1.FinishReason. A sequence a stop string ended (the loop
 * aborted it after the step, or it ended on its own in the same step) ends STOP with that string. */
static void on_finished(void *user, uint64_t id, const eng_finish_info *f) {
    wkr_loop *l = user;
    if (f->reason == ENG_FINISH_ERROR) {
        mt_log(MT_LOG_WARN, "worker %d: sequence %llu failed: %s", l->p.id, (unsigned long long)id, f->message);
        /* a step that failed because a rank died: the group is gone, and so is the sequence */
        if (group_broken(l)) l->quiet = true;
    }
    wkr_seq_text *s = wkr_texts_find(l->texts, id);
    if (l->quiet || !l->t) {
        wkr_texts_remove(l->texts, id);
        return;
    }
    mt_wire_end end = mt_wire_end_of((Metrale__V1__FinishReason)f->reason);
    end.prompt_tokens = (uint32_t)f->prompt_tokens;
    end.completion_tokens = s ? (uint32_t)s->n_sent : (uint32_t)f->completion_tokens;
    end.draft_tokens = (uint32_t)f->draft_tokens;
    end.accepted_tokens = (uint32_t)f->accepted_tokens;
    end.verify_steps = (uint32_t)f->verify_steps;
    end.message = f->message;
    tok_text rest = { 0 };
    if (s && s->out) {
        mt_error err = { "" };
        if (!s->stopped && txt_out_finish(s->out, &rest, &err) != MT_OK)
            mt_log(MT_LOG_WARN, "worker %d: sequence %llu: %s", l->p.id, (unsigned long long)id, err.msg);
        end.text = rest.s;
        if ((end.stop_string = txt_out_stop_string(s->out))) {
            end.reason = METRALE__V1__FINISH_REASON__FINISH_REASON_STOP;
            end.message = NULL;
        }
    }
    if (!end.stop_string && f->reason == ENG_FINISH_STOP && s) end.stop_token_id = s->last_token;
    wkr_transport_send_finished(l->t, id, &end);
    tok_text_free(&rest);
    wkr_texts_remove(l->texts, id);
}

/* Engine thread: publishes the engine's counters for the heartbeats and marks progress. */
static void publish_stats(wkr_loop *l) {
    eng_stats st;
    eng_get_stats(l->eng, &st);
    Metrale__V1__WorkerStats ws = METRALE__V1__WORKER_STATS__INIT;
    ws.live_sequences = (uint32_t)st.live_sequences;
    ws.cache_bytes_in_use = st.cache_bytes_in_use;
    ws.cache_bytes_baseline = 0; /* only per-sequence state is counted; none with no sequence */
    ws.sequences_finished = st.sequences_finished;
    ws.sequences_aborted = st.sequences_aborted;
    ws.prefix_hits = st.prefix_hits;
    ws.prefix_misses = st.prefix_misses;
    ws.prefix_cache_bytes = st.prefix_cache_bytes;
    ws.preemptions = st.preemptions;
    ws.speculative_steps = st.spec_steps;
    ws.draft_tokens = st.draft_tokens;
    ws.accepted_tokens = st.accepted_tokens;
    ws.cache_pages_free = (uint32_t)st.pages_free;
    ws.cache_pages_total = (uint32_t)st.pages_total;
    ws.slots_free = (uint32_t)st.slots_free;
    ws.slots_total = (uint32_t)st.slots_total;
    ws.slots_prefix = (uint32_t)st.prefix_entries;
    const double now = mt_now();
    if (now - l->prefix_pages_at >= PREFIX_PAGES_EVERY_S) {
        const int pages = eng_prefix_pages(l->eng);
        if (pages >= 0) l->prefix_pages = pages;
        l->prefix_pages_at = now;
    }
    ws.pages_prefix = (uint32_t)l->prefix_pages;
    wkr_transport_publish(l->t, &ws);
}

/* After a lost link the router's streams are gone: drop every live sequence without sending. */
static void drop_sequences(wkr_loop *l) {
    eng_stats st;
    eng_get_stats(l->eng, &st);
    if (st.live_sequences) mt_log(MT_LOG_WARN, "worker %d: dropping %d sequences", l->p.id, st.live_sequences);
    l->quiet = true;
    eng_abort_all(l->eng, ENG_FINISH_CANCELLED, "router unreachable");
    l->quiet = false;
}

/* ---- router -> engine ---- */

/* The prompt of a text or chat request (text, or msgs[n]) as ids: at most max_ids of them;
 * rendered (may be NULL) gets the text encoded. MT_ERR_INVALID with the reason when the model has
 * no tokenizer or the prompt cannot be tokenized. */
static mt_status text_prompt_ids(wkr_loop *l, const char *text, Metrale__V1__ChatMessage *const *msgs, size_t n,
                                 const char *kwargs, bool generation_prompt, int add_special, size_t max_ids,
                                 tok_ids *ids, tok_text *rendered, mt_error *err) {
    if (!l->text) return mt_errorf(err, MT_ERR_INVALID, "the model has no tokenizer: send prompt_token_ids");
    chat_message *cm = n ? malloc(sizeof *cm * n) : NULL;
    if (n && !cm) return mt_errorf(err, MT_ERR_NOMEM, "worker: out of memory for %zu messages", n);
    for (size_t i = 0; i < n; i++) cm[i] = (chat_message){ .role = msgs[i]->role, .content = msgs[i]->content };
    const txt_prompt p = { .text = n ? NULL : text, .text_len = n ? 0 : strlen(text), .msgs = cm, .n_msgs = n,
                           .kwargs_json = kwargs, .add_generation_prompt = generation_prompt,
                           .add_special_tokens = add_special };
    mt_status st = txt_model_encode(l->text, &p, max_ids, ids, rendered, err);
    free(cm);
    return st;
}

/* Copies n token ids into out; MT_ERR_INVALID naming what (e.g. "prompt token") for an id the
 * engine's int32 cannot hold, which no vocabulary reaches. */
static mt_status ids_from_proto(const char *what, const uint32_t *ids, size_t n, int32_t *out, mt_error *err) {
    for (size_t i = 0; i < n; i++) {
        if (ids[i] > INT32_MAX)
            return mt_errorf(err, MT_ERR_INVALID, "%s %u at index %zu is outside the vocabulary", what, ids[i], i);
        out[i] = (int32_t)ids[i];
    }
    return MT_OK;
}

/* What a Submit needs besides the engine's request: its prompt and stop ids, owned here. */
typedef struct submit_buf {
    tok_ids prompt;              /* the prompt's ids, from the request or its text */
    int32_t *stops;              /* the request's stop ids, then the eos ids unless ignore_eos */
} submit_buf;

/* Builds the engine's request from a Submit's GenerateRequest into r, its arrays into b (the
 * caller frees them). MT_ERR_INVALID with a message for what the engine cannot take: a text prompt
 * the tokenizer refuses or that is too long once tokenized, ids above INT32_MAX, counts above the
 * wire limits. */
static mt_status request_from_proto(wkr_loop *l, const Metrale__V1__GenerateRequest *g, submit_buf *b,
                                    eng_request *r, mt_error *err) {
    *r = eng_default_request();
    const Metrale__V1__StoppingCriteria *stop = g->stopping;
    r->max_new_tokens = 0; /* required: the engine says so when missing */
    if (stop) r->max_new_tokens = stop->max_new_tokens > INT32_MAX ? INT32_MAX : (int)stop->max_new_tokens;
    mt_status st;
    if ((g->prompt_text && g->prompt_text[0]) || g->n_messages) {
        const long room = (long)l->p.max_context - r->max_new_tokens;
        st = text_prompt_ids(l, g->prompt_text ? g->prompt_text : "", g->messages, g->n_messages,
                             g->chat_template_kwargs, !g->no_generation_prompt,
                             g->has_add_special_tokens ? g->add_special_tokens : -1,
                             room > 0 ? (size_t)room : 1, &b->prompt, NULL, err);
        if (st != MT_OK) return st;
    } else {
        if (g->n_prompt_token_ids > MT_WIRE_CONTEXT_MAX)
            return mt_errorf(err, MT_ERR_INVALID, "prompt of %zu tokens: at most %d", g->n_prompt_token_ids,
                             MT_WIRE_CONTEXT_MAX);
        b->prompt.ids = malloc(sizeof(int32_t) * (g->n_prompt_token_ids + 1));
        if (!b->prompt.ids) return mt_errorf(err, MT_ERR_NOMEM, "worker: out of memory for a request");
        st = ids_from_proto("prompt token", g->prompt_token_ids, g->n_prompt_token_ids, b->prompt.ids, err);
        if (st != MT_OK) return st;
        b->prompt.n = g->n_prompt_token_ids;
    }
    r->prompt = b->prompt.ids;
    r->n_prompt = (int)b->prompt.n;
    if (g->top_logprobs > MT_WIRE_TOP_LOGPROBS_MAX)
        return mt_errorf(err, MT_ERR_INVALID, "top_logprobs must be <= %d, got %u", MT_WIRE_TOP_LOGPROBS_MAX,
                         g->top_logprobs);
    r->logprobs = g->logprobs;
    r->top_logprobs = (int)g->top_logprobs;
    r->prompt_logprobs = g->echo;
    r->no_speculation = g->no_speculation;
    const Metrale__V1__SamplingParams *s = g->sampling;
    if (s) { /* the API's "0 = off" encoding */
        r->sampling.temperature = s->temperature;
        r->sampling.top_k = s->top_k;
        r->sampling.top_p = s->top_p == 0.0f ? 1.0f : s->top_p;
        r->sampling.min_p = s->min_p;
        r->sampling.repetition_penalty = s->repetition_penalty == 0.0f ? 1.0f : s->repetition_penalty;
        r->sampling.presence_penalty = s->presence_penalty;
        r->sampling.frequency_penalty = s->frequency_penalty;
        r->has_seed = s->has_seed;
        r->seed = s->seed;
    }
    const size_t n_user = stop ? stop->n_stop_token_ids : 0;
    if (n_user > MT_WIRE_STOP_TOKENS_MAX)
        return mt_errorf(err, MT_ERR_INVALID, "%zu stop tokens: at most %d", n_user, MT_WIRE_STOP_TOKENS_MAX);
    if (!(b->stops = malloc(sizeof(int32_t) * (n_user + l->n_eos + 1))))
        return mt_errorf(err, MT_ERR_NOMEM, "worker: out of memory for a request");
    if (stop && (st = ids_from_proto("stop token", stop->stop_token_ids, n_user, b->stops, err)) != MT_OK) return st;
    r->ignore_eos = stop && stop->ignore_eos;
    size_t n_stop = n_user;
    if (!r->ignore_eos) { /* the tokenizer's eos ids beside the model's own */
        memcpy(b->stops + n_stop, l->eos, sizeof(int32_t) * l->n_eos);
        n_stop += l->n_eos;
    }
    r->stop_ids = b->stops;
    r->n_stop = (int)n_stop;
    return MT_OK;
}

/* Refuses Submit id before it started: Finished(ERROR, why), INVALID_ARGUMENT for the client when
 * the request itself is at fault. */
static void refuse(wkr_loop *l, uint64_t id, const char *request_id, uint32_t prompt_tokens, mt_status st,
                   const char *why) {
    const mt_log_field f[] = { mt_logf_uint("stream", id), mt_logf_str("why", why) };
    mt_log_event(MT_LOG_WARN, "refused", request_id, f, sizeof f / sizeof f[0]);
    mt_wire_end end = mt_wire_end_of(METRALE__V1__FINISH_REASON__FINISH_REASON_ERROR);
    end.prompt_tokens = prompt_tokens;
    end.message = why;
    end.invalid_argument = st == MT_ERR_INVALID;
    wkr_transport_send_finished(l->t, id, &end);
}

static void on_submit(void *user, uint64_t id, const Metrale__V1__GenerateRequest *g, uint64_t deadline_unix_ms) {
    wkr_loop *l = user;
    if (wkr_texts_find(l->texts, id)) { /* answering would end the live one's stream */
        mt_log(MT_LOG_WARN, "worker %d: submit %llu refused: already live", l->p.id, (unsigned long long)id);
        return;
    }
    mt_error err = { "" };
    submit_buf b = { 0 };
    eng_request r;
    mt_status st = request_from_proto(l, g, &b, &r, &err);
    wkr_seq_text *s = NULL;
    if (st == MT_OK) {
        const Metrale__V1__StoppingCriteria *stop = g->stopping;
        const txt_out_params tp = { .stops = stop ? (const char *const *)stop->stop : NULL,
                                    .n_stops = stop ? stop->n_stop : 0,
                                    .include_stop = stop && stop->include_stop_str,
                                    .skip_special_tokens = g->has_skip_special_tokens ? g->skip_special_tokens : true };
        st = wkr_texts_add(l->texts, id, &tp, g->logprobs || g->top_logprobs || g->echo, &s, &err);
    }
    if (st == MT_OK) st = eng_submit(l->eng, id, &r, deadline_unix_ms, &err);
    const uint32_t n_prompt = (uint32_t)b.prompt.n;
    tok_ids_free(&b.prompt);
    free(b.stops);
    if (st == MT_OK) {
        const mt_log_field f[] = { mt_logf_uint("stream", id), mt_logf_uint("prompt_tokens", n_prompt) };
        mt_log_event(MT_LOG_DEBUG, "submitted", g->request_id, f, sizeof f / sizeof f[0]);
        return;
    }
    if (s) wkr_texts_remove(l->texts, id);
    refuse(l, id, g->request_id, n_prompt, st, err.msg);
}

/* Tokenize: the ids Generate would feed for the same text or messages. */
static void on_tokenize(void *user, uint64_t id, const Metrale__V1__TokenizeRequest *req) {
    wkr_loop *l = user;
    tok_ids ids = { 0 };
    tok_text rendered = { 0 };
    mt_error err = { "" };
    mt_status st = (!req->text || !req->text[0]) && !req->n_messages
                       ? mt_errorf(&err, MT_ERR_INVALID, "nothing to tokenize: give text or messages")
                       : text_prompt_ids(l, req->text ? req->text : "", req->messages, req->n_messages,
                                         req->chat_template_kwargs, !req->no_generation_prompt,
                                         req->has_add_special_tokens ? req->add_special_tokens : -1,
                                         (size_t)MT_WIRE_CONTEXT_MAX, &ids, &rendered, &err);
    uint32_t *u = st == MT_OK ? malloc(sizeof *u * (ids.n + 1)) : NULL;
    if (st == MT_OK && !u) st = mt_errorf(&err, MT_ERR_NOMEM, "worker: out of memory for %zu ids", ids.n);
    if (st == MT_OK) {
        for (size_t i = 0; i < ids.n; i++) u[i] = (uint32_t)ids.ids[i];
        Metrale__V1__TokenizeResponse resp = METRALE__V1__TOKENIZE_RESPONSE__INIT;
        resp.n_token_ids = ids.n;
        resp.token_ids = u;
        resp.prompt_text = rendered.s ? rendered.s : (char *)"";
        wkr_transport_send_tokenized(l->t, id, &resp, NULL);
    } else {
        wkr_transport_send_tokenized(l->t, id, NULL, err.msg);
    }
    free(u);
    tok_ids_free(&ids);
    tok_text_free(&rendered);
}

static eng_finish finish_from_proto(Metrale__V1__FinishReason r) {
    switch (r) {
    case METRALE__V1__FINISH_REASON__FINISH_REASON_LENGTH: return ENG_FINISH_LENGTH;
    case METRALE__V1__FINISH_REASON__FINISH_REASON_STOP: return ENG_FINISH_STOP;
    case METRALE__V1__FINISH_REASON__FINISH_REASON_ERROR: return ENG_FINISH_ERROR;
    default: return ENG_FINISH_CANCELLED;
    }
}

static void on_abort(void *user, uint64_t id, Metrale__V1__FinishReason reason) {
    wkr_loop *l = user;
    if (eng_abort(l->eng, id, finish_from_proto(reason), "aborted by the router") != MT_OK)
        mt_log(MT_LOG_DEBUG, "worker %d: abort of %llu, which is not live", l->p.id, (unsigned long long)id);
}

/* ---- the loop ---- */

/* Ends the sequences a stop string ended during the step (callbacks cannot call the engine). */
static void end_stopped(wkr_loop *l) {
    uint64_t ids[64];
    size_t n;
    while ((n = wkr_texts_take_stopped(l->texts, ids, 64)) > 0)
        for (size_t i = 0; i < n; i++) eng_abort(l->eng, ids[i], ENG_FINISH_STOP, NULL); /* gone already: fine */
}

mt_status wkr_loop_run(wkr_loop *l, const volatile sig_atomic_t *stop, mt_error *err) {
    const wkr_handlers h = { .user = l, .on_submit = on_submit, .on_abort = on_abort, .on_tokenize = on_tokenize };
    publish_stats(l);
    mt_status st = wkr_transport_start_heartbeats(l->t, err);
    if (st != MT_OK) return st;
    bool shutdown = false, silent = false, broken = false;
    while (!*stop && !shutdown) {
        /* a rank of the group that died takes the group out at once, busy or idle */
        if (l->ctl && mt_comm_check(l->ctl) != MT_OK) {
            broken = true;
            break;
        }
        if (wkr_transport_take_link_lost(l->t)) drop_sequences(l);
        wkr_transport_hello_if_due(l->t);
        shutdown = wkr_transport_receive(l->t, eng_has_work(l->eng) ? 0 : IDLE_WAIT_MS, &h);
        if (shutdown || *stop) break;
        /* checked right after draining the socket, so a long step cannot look like silence */
        if (wkr_transport_router_silent(l->t, l->p.router_timeout)) {
            silent = true;
            break;
        }
        if (eng_has_work(l->eng)) {
            const double t0 = mt_now();
            eng_step(l->eng, NULL);
            /* a step that outlasts the router's heartbeats (a first step's graph captures and
             * lazy set-up on a GPU) is time this thread did not listen: the router's silence is
             * judged from the next receive on, or a router that wrote the worker off meanwhile
             * and stopped beating would make it exit just as it answers again */
            if (mt_now() - t0 > MT_WIRE_HEARTBEAT_S) wkr_transport_restart_silence(l->t);
        }
        end_stopped(l);
        publish_stats(l);
    }
    wkr_transport_stop_heartbeats(l->t);
    if (broken)
        return mt_errorf(err, MT_ERR_BACKEND, "tensor-parallel group %s: %s; exiting", l->p.group, l->ctl->err.msg);
    if (silent)
        return mt_errorf(err, MT_ERR_IO, "nothing from the router for %.1f s; exiting", l->p.router_timeout);
    mt_log(MT_LOG_INFO, "worker %d: exiting (%s; %llu malformed or unexpected messages dropped)", l->p.id,
           shutdown ? "shutdown" : "signal", (unsigned long long)wkr_transport_dropped(l->t));
    return MT_OK;
}
