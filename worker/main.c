/* worker/main.c: metrale-worker, one engine behind a ZeroMQ DEALER talking to the router.
 *
 *   metrale-worker --model DIR --router ipc:///PATH --id N [--backend cpu|cuda|auto] [--device N]
 *                  [--max-sequences N] [--max-context N] [--threads N] [--router-timeout S] [--verbose]
 *                  [--numerics bf16|exact] [--dtype auto|bf16] [--tp N --rank R --group NAME]
 *                  [--curve-server-key FILE --curve-secret-key FILE] [--log-format text|json]
 *                  [scheduler, speculative and warm-up options: usage()]
 *
 * This file parses the options and sets the process up (log level, signals, exit status); the
 * engine side and its loop are worker/loop.h, the router link and the heartbeat thread
 * worker/transport.h, where the protocol is stated.
 *
 * Lifetime: exits 0 on Shutdown, SIGTERM or SIGINT (live sequences end with Finished(CANCELLED)
 * while the router is reachable), 1 when the router has been silent for --router-timeout (default
 * MT_WIRE_ROUTER_SILENCE_S, 10 s: it died) or its tensor-parallel group broke (a rank died),
 * MT_WIRE_EXIT_STARTUP (3) when it cannot start (the model, the backend, the group), 2 on bad
 * options. A rank > 0 of a group exits 0 when rank 0 stops and 1 when the group breaks; signals do
 * not stop it. Only main exits.
 */
#include <errno.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/mt.h"
#include "common/wire.h"
#include "common/wire_limits.h"
#include "worker/engine/engine.h"
#include "worker/loop.h"

static volatile sig_atomic_t g_stop;

static void on_signal(int sig) {
    (void)sig;
    g_stop = 1;
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: metrale-worker --model DIR --router ENDPOINT --id N [--backend cpu|cuda|auto]\n"
            "                      [--device N] [--max-sequences N] [--max-context N] [--threads N]\n"
            "                      [--router-timeout S] [--cache-budget-mb N] [--prefill-budget N] [--itl-target-ms MS]\n"
            "                      [--prefill-hold-ms MS]\n"
            "                      [--prefill-pass N] [--prefill-layers N] [--prefill-sites|--no-prefill-sites]\n"
            "                      [--prefill-expert-parts P] [--fine-units-max-rows N] [--layered-max-waiting N]\n"
            "                      [--graph-max-batch N] [--no-preempt] [--no-run-ahead] [--mixed-steps|--separate-steps]\n"
            "                      [--pack-projections] [--verbose]\n"
            "                      [--numerics bf16|exact] [--dtype auto|bf16] [--tp N --rank R --group NAME]\n"
            "                      [--speculative-tokens K] [--speculative-max-batch B] [--warmup-tokens N]\n"
            "                      [--curve-server-key FILE --curve-secret-key FILE] [--log-format text|json]\n"
            "  Serves the checkpoint in DIR to the router at ENDPOINT (ipc://, tcp://127.0.0.1:, or tcp://HOST:PORT\n"
            "  of another host with the CURVE keys) as worker N.\n"
            "  --model: a checkpoint folder, or random:tiny / random:bench-4L (random weights, for benchmarks).\n"
            "  --backend: cpu (default), cuda (GPU --device, default 0), or auto (cuda when a GPU is usable).\n"
            "  --max-sequences: running sequences at once (default 16); --max-context: prompt + new tokens\n"
            "  per request (default 4096); --threads: CPU backend threads (0 = all cores); --router-timeout:\n"
            "  seconds without a message from the router before exiting (default 10); --cache-budget-mb:\n"
            "  the sequence-state pools (default 0: the free memory after the weights, less a reserve for\n"
            "  activations and graphs); --prefill-budget: prompt tokens prefilled per step beside decoding\n"
            "  (the chunk size of a long prompt; default 4096 on a GPU, 2048 on the CPU); --mixed-steps:\n"
            "  send the step's prompt chunks to the model in one call with its decode rows;\n"
            "  --separate-steps: the decode, then the chunks\n"
            "  (default: mixed on a GPU, separate on the CPU);\n"
            "  --itl-target-ms: the step time a step with decode rows aims for: its prompt tokens are as\n"
            "  many as measured step times say fit, at least 64, at most --prefill-budget (default 0: off,\n"
            "  --prefill-budget every step; docs/PERF.md has what targets cost); --prefill-hold-ms: while more\n"
            "  requests wait than there are free places, a step with decode rows holds its prompt work back\n"
            "  until the ready prompt tokens reach half the budget or MS have passed, so the prompts of\n"
            "  freed places share one pass over the weights (default 0: off); --prefill-pass: rows of one\n"
            "  model pass of prefill (default: on cuda the prefill budget, at most 4096, as each pass reads\n"
            "  the experts its rows touch; on cpu 256); --prefill-layers: with mixed steps, a step's prompt\n"
            "  chunks run N layers beside its decode rows and go on N layers a step until they complete,\n"
            "  so the rows beside a prompt wait for a few layers of it, not all (default 1 with mixed steps\n"
            "  on a GPU, 0 (every layer in one step) otherwise); --prefill-sites: --prefill-layers counts\n"
            "  a layer's attention and MLP as two steps' work, so an MoE layer's expert reads and its\n"
            "  attention land in different steps; --prefill-expert-parts: with sites, an MLP site counts\n"
            "  as P steps' work, each through 1/P of the routed experts; --fine-units-max-rows: with\n"
            "  sites, a step runs a layer's worth of those units while more than N rows decode beside the\n"
            "  prompts (and while a request waits; 0: only then). Defaults: on one GPU sites, 2 expert\n"
            "  parts (where the model has the experts) and N = 4; whole layers otherwise;\n"
            "  --layered-max-waiting: from N requests\n"
            "  waiting for a place on, chunks run every layer in their step (throughput over latency\n"
            "  under saturation; default 0: no limit).\n"
            "  A request waits while the pools are short,\n"
            "  and a running one that runs out of cache pages is preempted (its state recomputed later);\n"
            "  --graph-max-batch: decode steps of up to N sequences replay CUDA graphs (buckets 1, 2, 4, ...;\n"
            "  default 64), larger ones run eagerly; --no-preempt: admit a request only when pages for its\n"
            "  whole length are free (nothing is ever preempted; fewer run together); --no-run-ahead: a batch\n"
            "  of greedy requests reads each step's tokens before queuing the next (by default the next step\n"
            "  is queued on the device's own tokens first, so the GPU does not wait for the host; the CPU backend\n"
            "  never runs ahead, as it would only delay each token by a step); --pack-projections (GPU): the\n"
            "  projections that share an input packed at load and run as one product a group (off by default:\n"
            "  a fraction of a percent of a batched decode step, docs/PERF.md); --numerics (GPU): how prefill\n"
            "  GEMMs round their activations: bf16 (default; rounded once, as other engines do) or exact (two\n"
            "  bf16 parts, matching the CPU's fp32 sums; about twice the prefill GEMM work). --dtype: how an FP8\n"
            "  checkpoint's weights are kept: auto (default; on the GPU the dense projections and the routed\n"
            "  experts stay FP8 with their block scales and multiply on the FP8 tensor cores, the rest is\n"
            "  dequantised to bf16; on the CPU all is dequantised) or bf16 (all dequantised to bf16 at load). --tp N --rank R --group NAME: this\n"
            "  process is rank R of a tensor-parallel group of N ranks on this host (metrale-serve --tp\n"
            "  starts them); rank 0 talks to the router, the others follow it. --curve-server-key FILE\n"
            "  --curve-secret-key FILE: encrypt the router link with ZeroMQ CURVE (FILE: a z85 key as\n"
            "  metrale-keygen writes it): the router's public key and this worker's secret key.\n"
            "  --speculative-tokens K: draft K tokens a step with the checkpoint's MTP block and verify them in\n"
            "  one step (0 = off, the default; at most 4; greedy and sampled requests; a checkpoint without\n"
            "  the block serves without); --speculative-max-batch B: only while a decode step has at most B\n"
            "  sequences (default 0: any). --warmup-tokens N: before serving, run one request of N prompt tokens and 4 new\n"
            "  ones, uncounted, so the device's first-use costs (kernel loading, GEMM set-up, graph captures) do\n"
            "  not land in the first requests' steps (default: the prefill budget on a GPU, 0 on the CPU).\n"
            "  --log-format: log lines as text (default) or one JSON object a line\n"
            "  (component \"worker N\"; weight loading progress, sequences refused).\n");
}

/* ---- options ---- */

static int parse_int(const char *flag, const char *v, int lo, int *out) {
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > INT32_MAX) {
        fprintf(stderr, "error: %s must be an integer >= %d, got \"%s\"\n", flag, lo, v);
        return -1;
    }
    *out = (int)x;
    return 0;
}

/* Milliseconds in [0, 60000]. */
static int parse_ms(const char *flag, const char *v, double *out) {
    char *end;
    const double x = strtod(v, &end);
    if (end == v || *end || !(x >= 0 && x <= 60000)) {
        fprintf(stderr, "error: %s must be milliseconds in [0, 60000], got \"%s\"\n", flag, v);
        return -1;
    }
    *out = x;
    return 0;
}

/* The CURVE keys read from the files named by the options; wkr_params points into them. */
static char g_server_key[MT_WIRE_KEY_Z85 + 1], g_secret_key[MT_WIRE_KEY_Z85 + 1];

/* Reads the key file of flag into key; -1 (said on stderr) when it cannot. */
static int read_key(const char *flag, const char *path, char *key) {
    mt_error err = { "" };
    if (mt_wire_key_read(path, key, &err) == MT_OK) return 0;
    fprintf(stderr, "error: %s: %s\n", flag, err.msg);
    return -1;
}

/* Fills o (and *verbose) from argv: 0, 1 after --help, -1 (said on stderr) on bad options. */
static int parse_args(int argc, char **argv, wkr_params *o, bool *verbose) {
    *o = wkr_default_params();
    *verbose = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); return 1; }
        if (!strcmp(a, "--verbose")) { *verbose = true; continue; }
        if (!strcmp(a, "--no-preempt")) { o->no_preempt = true; continue; }
        if (!strcmp(a, "--mixed-steps")) { o->mixed_steps = 1; continue; }
        if (!strcmp(a, "--separate-steps")) { o->mixed_steps = 0; continue; }
        if (!strcmp(a, "--no-run-ahead")) { o->no_run_ahead = true; continue; }
        if (!strcmp(a, "--pack-projections")) { o->pack_projections = true; continue; }
        if (!strcmp(a, "--prefill-sites")) { o->prefill_sites = 1; continue; }
        if (!strcmp(a, "--no-prefill-sites")) { o->prefill_sites = 0; continue; }
        if (!v) { fprintf(stderr, "error: %s needs a value\n", a); usage(stderr); return -1; }
        int rc = 0;
        if (!strcmp(a, "--model")) o->model = v;
        else if (!strcmp(a, "--router")) o->router = v;
        else if (!strcmp(a, "--tp")) rc = parse_int(a, v, 1, &o->tp);
        else if (!strcmp(a, "--rank")) rc = parse_int(a, v, 0, &o->rank);
        else if (!strcmp(a, "--group")) o->group = v;
        else if (!strcmp(a, "--curve-server-key")) rc = read_key(a, v, (char *)(o->curve_server_key = g_server_key));
        else if (!strcmp(a, "--curve-secret-key")) rc = read_key(a, v, (char *)(o->curve_secret_key = g_secret_key));
        else if (!strcmp(a, "--numerics")) {
            if (!mt_numerics_parse(v, &o->numerics) || o->numerics == MT_NUMERICS_FP32) {
                fprintf(stderr, "error: --numerics must be exact or bf16, got \"%s\"\n", v);
                return -1;
            }
        }
        else if (!strcmp(a, "--dtype")) {
            if (strcmp(v, "auto") && strcmp(v, "bf16")) {
                fprintf(stderr, "error: --dtype must be auto or bf16, got \"%s\"\n", v);
                return -1;
            }
            o->dequant_fp8 = !strcmp(v, "bf16");
        }
        else if (!strcmp(a, "--backend")) o->backend = v;
        else if (!strcmp(a, "--log-format")) {
            mt_log_format fmt;
            if (!mt_log_format_parse(v, &fmt)) {
                fprintf(stderr, "error: --log-format must be text or json, got \"%s\"\n", v);
                return -1;
            }
            mt_log_set_format(fmt);
        }
        else if (!strcmp(a, "--id")) rc = parse_int(a, v, 0, &o->id);
        else if (!strcmp(a, "--device")) rc = parse_int(a, v, 0, &o->device);
        else if (!strcmp(a, "--max-sequences")) rc = parse_int(a, v, 1, &o->max_sequences);
        else if (!strcmp(a, "--max-context")) {
            rc = parse_int(a, v, 2, &o->max_context);
            if (!rc && o->max_context > MT_WIRE_CONTEXT_MAX) {
                fprintf(stderr, "error: --max-context must be at most %d, got %d\n", MT_WIRE_CONTEXT_MAX,
                        o->max_context);
                rc = -1;
            }
        }
        else if (!strcmp(a, "--cache-budget-mb")) {
            int mb = 0;
            rc = parse_int(a, v, 0, &mb);
            o->cache_budget_mb = mb;
        }
        else if (!strcmp(a, "--threads")) rc = parse_int(a, v, 0, &o->threads);
        else if (!strcmp(a, "--prefill-budget")) rc = parse_int(a, v, 1, &o->prefill_budget);
        else if (!strcmp(a, "--prefill-pass")) {
            rc = parse_int(a, v, 1, &o->prefill_pass);
            if (!rc && o->prefill_pass > 65536) {
                fprintf(stderr, "error: --prefill-pass must be at most 65536, got %d\n", o->prefill_pass);
                rc = -1;
            }
        }
        else if (!strcmp(a, "--prefill-layers")) rc = parse_int(a, v, 0, &o->prefill_layers);
        else if (!strcmp(a, "--layered-max-waiting")) rc = parse_int(a, v, 0, &o->layered_max_waiting);
        else if (!strcmp(a, "--prefill-expert-parts")) rc = parse_int(a, v, 1, &o->prefill_expert_parts);
        else if (!strcmp(a, "--fine-units-max-rows")) rc = parse_int(a, v, 0, &o->fine_units_max_rows);
        else if (!strcmp(a, "--itl-target-ms")) rc = parse_ms(a, v, &o->itl_target_ms);
        else if (!strcmp(a, "--prefill-hold-ms")) rc = parse_ms(a, v, &o->prefill_hold_ms);
        else if (!strcmp(a, "--graph-max-batch")) rc = parse_int(a, v, 1, &o->graph_max_batch);
        else if (!strcmp(a, "--speculative-tokens")) {
            rc = parse_int(a, v, 0, &o->spec_tokens);
            if (!rc && o->spec_tokens > ENG_SPEC_MAX) {
                fprintf(stderr, "error: --speculative-tokens must be at most %d, got %d\n", ENG_SPEC_MAX, o->spec_tokens);
                rc = -1;
            }
        }
        else if (!strcmp(a, "--speculative-max-batch")) rc = parse_int(a, v, 0, &o->spec_max_batch);
        else if (!strcmp(a, "--warmup-tokens")) rc = parse_int(a, v, 0, &o->warmup_tokens);
        else if (!strcmp(a, "--router-timeout")) {
            char *end;
            o->router_timeout = strtod(v, &end);
            if (end == v || *end || !(o->router_timeout > 0 && o->router_timeout <= 86400)) {
                fprintf(stderr, "error: --router-timeout must be seconds in (0, 86400], got \"%s\"\n", v);
                return -1;
            }
        }
        else { fprintf(stderr, "error: unknown option %s\n", a); usage(stderr); return -1; }
        if (rc) return -1;
        i++;
    }
    if (o->tp > 0 && (o->rank >= o->tp || !o->group)) {
        fprintf(stderr, "error: --tp N needs --rank in [0, N) and --group NAME, got rank %d\n", o->rank);
        return -1;
    }
    if (!o->curve_server_key != !o->curve_secret_key) {
        fprintf(stderr, "error: --curve-server-key and --curve-secret-key go together\n");
        return -1;
    }
    if (!o->model || !o->router || o->id < 0) {
        fprintf(stderr, "error: --model, --router and --id are required\n");
        usage(stderr);
        return -1;
    }
    if (strcmp(o->backend, "cpu") && strcmp(o->backend, "cuda") && strcmp(o->backend, "auto")) {
        fprintf(stderr, "error: --backend must be cpu, cuda or auto, got %s\n", o->backend);
        return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    wkr_params p;
    bool verbose;
    int rc = parse_args(argc, argv, &p, &verbose);
    if (rc) return rc > 0 ? 0 : 2;
    if (verbose) mt_log_set_level(MT_LOG_DEBUG);
    char component[32], prefix[40];
    snprintf(component, sizeof component, "worker %d", p.id);
    snprintf(prefix, sizeof prefix, "worker %d: ", p.id);
    mt_log_set_component(component, prefix);

    struct sigaction sa = { 0 };
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    mt_error err = { "" };
    if (p.tp > 0 && p.rank > 0) { /* a follower of a tensor-parallel group: no router link */
        bool started = false;
        mt_status st = wkr_follow(&p, &started, &err);
        if (st != MT_OK) mt_log(MT_LOG_ERROR, "worker %d rank %d: %s", p.id, p.rank, err.msg);
        return st == MT_OK ? 0 : started ? 1 : MT_WIRE_EXIT_STARTUP;
    }
    wkr_loop *l = NULL;
    mt_status st = wkr_loop_new(&p, &l, &err);
    if (st != MT_OK) {
        mt_log(MT_LOG_ERROR, "worker %d: cannot start: %s", p.id, err.msg);
        return MT_WIRE_EXIT_STARTUP;
    }
    st = wkr_loop_run(l, &g_stop, &err);
    if (st != MT_OK) mt_log(MT_LOG_ERROR, "worker %d: %s", p.id, err.msg);
    wkr_loop_free(l);
    return st == MT_OK ? 0 : 1;
}
