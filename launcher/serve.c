/* launcher/serve.c: metrale-serve, the one-line start of the service: the router and its worker
 * groups.
 *
 *   metrale-serve [--model DIR] [--listen HOST:PORT] [--workers G] [--tp N]
 *                 [--backend auto|cpu|cuda] [--max-sequences N] [--max-context N] [--threads N]
 *                 [--queue N] [--drain-timeout S] [--metrics HOST:PORT] [--numerics bf16|exact]
 *                 [--dtype auto|bf16] [scheduler, speculative and warm-up options: usage()]
 *                 [--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]] [--auth-token-file FILE]
 *                 [--health-listen HOST:PORT]
 *                 [--router ENDPOINT [--first-id K] [--curve-server-key FILE --curve-secret-key FILE]]
 *                 [--log-format text|json] [--log-prompts]
 *
 * With no --model it serves a small random checkpoint made here once (tools/mkckpt with
 * tools/configs/cpu-small.json into .cache/cpu-small), so it runs on any machine (scripts/run.sh
 * passes the demo model). --backend auto (the default) gives each worker a GPU when there are any
 * (/dev/nvidia0..), one worker per GPU, and otherwise runs one CPU worker with every core.
 *
 * Groups: G worker groups of N ranks each (--tp N, default 1: plain single workers). Group g is
 * worker g (--first-id K: K + g); its rank r runs metrale-worker --id g --tp N --rank r --group
 * NAME, NAME unique to this launcher (pid and a random number), the group and the start. GPUs: the
 * devices of CUDA_VISIBLE_DEVICES (all GPUs when unset), in order, cut into G consecutive lists of
 * N; rank r of group g takes the r-th device of list g, passed as --device g*N + r (its index
 * among the visible devices). With --tp 1, worker g takes device g % GPUs (more workers than
 * GPUs share them).
 *
 * Processes: the router (bazel-bin/router/metrale-router) binds an ipc:// socket private to this
 * run, /tmp/metrale-<uid>/serve-<pid>.sock (the folder mode 0700, this user's: common/ipc.h; at
 * start the stale sockets of earlier runs that died there are removed); workers
 * (bazel-bin/worker/metrale-worker) connect to it. The security options (--tls-*,
 * --auth-token-file, --health-listen) go to the router as they are. With --router ENDPOINT no router
 * is started: the groups connect to the router at ENDPOINT (on another host: tcp://HOST:PORT with
 * the CURVE keys, which go to every rank). The binaries are found in the bazel-bin tree this one
 * is in (bazel-bin/launcher/metrale-serve), or else in its own folder (a folder of copied
 * binaries); METRALE_ROUTER_BIN, METRALE_WORKER_BIN and METRALE_MKCKPT_BIN name others. Each child
 * runs in its own process group and gets SIGTERM if this process dies.
 *
 * Signals: SIGHUP is forwarded to the router (it reads its TLS files and token file again). The
 * first SIGTERM / SIGINT is forwarded to the router, which drains (health
 * NOT_SERVING, running streams finish up to --drain-timeout) and tells the workers to shut down
 * (without a router here, the workers get SIGTERM); workers still alive WORKER_EXIT_S after the
 * router are sent SIGTERM, then SIGKILL. A second signal sends SIGTERM to everyone, a third
 * SIGKILL. If the router dies (or exits unasked), the service is gone: the workers get SIGTERM
 * and, ROUTER_DEATH_KILL_S later, SIGKILL, the router's socket file is removed, and this process
 * exits non-zero as soon as they are reaped (well within a second), so that an orchestrator
 * restarts the whole pod.
 *
 * Faults: when any rank of a group exits while serving (killed, or a non-zero exit; rank 0 exiting
 * 0 was told to stop), the group's other ranks get SIGTERM at once and SIGKILL GROUP_KILL_S later,
 * and the whole group starts again, under a new name, RESTART_DELAY_S after its last rank is gone
 * (the router counts it as a restart); the other groups keep serving. A start that fails (a rank
 * exits MT_WIRE_EXIT_STARTUP, e.g. N does not divide the model, or the group dies within
 * QUICK_FAIL_S of starting) counts; after STARTUP_FAILURES_MAX of them in a row the group is given
 * up, and when no group is left the service stops. Exit status: the router's (0 after a clean
 * drain; 0 without a router after a signal), 1 on failure (no group can serve; the router died:
 * its own non-zero status, else 1), 2 on bad arguments.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <glob.h>
#include <libgen.h>
#include <limits.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/mt.h"
#include "common/ipc.h"
#include "common/wire_limits.h"

#define MAX_WORKERS 64     /* groups */
#define MAX_TP 64          /* ranks of a group (worker/dist/comm_host.h: MT_COMM_HOST_MAX_RANKS) */
#define MAX_RANKS 256      /* worker processes in all */
_Static_assert(MAX_WORKERS <= MT_WIRE_WORKERS_MAX, "the router takes fewer workers than the launcher starts");
#define RESTART_DELAY_S 1.0
#define WORKER_EXIT_S 10.0
#define KILL_AFTER_S 5.0
#define GROUP_KILL_S 0.5         /* a group's surviving ranks: SIGTERM, then SIGKILL this much later */
#define QUICK_FAIL_S 5.0         /* a group that dies this soon after starting failed to start */
#define STARTUP_FAILURES_MAX 3   /* start-up failures in a row before a group is given up */
#define ROUTER_DEATH_KILL_S 0.5  /* the router died: the workers' SIGTERM, then SIGKILL this much later */

/* One worker group: N ranks that live and die together. */
typedef struct group {
    int index;             /* 0 .. workers-1 */
    int id;                /* --id of its ranks: --first-id + index */
    pid_t pid[MAX_TP];     /* 0 when not running */
    unsigned gen;          /* starts so far; part of the group's name */
    char name[96];         /* the communicator's name for this start */
    double started_at;
    double restart_at;     /* when it starts again; 0 = not scheduled */
    bool down;             /* a rank exited: the others are being stopped */
    double kill_at;        /* down: SIGKILL for the ranks left then */
    bool failed;           /* down because of a failure (it starts again) */
    bool startup_failed;   /* ... and the failure was at start-up */
    int startup_failures;  /* in a row */
    bool given_up;
    char why[128];         /* the first exit of this start */
} group;

typedef struct serve_opts {
    const char *model, *listen, *backend, *queue, *drain_timeout;
    const char *metrics;   /* the router's --metrics HOST:PORT */
    int workers, tp, first_id, max_sequences, max_context, threads;
    /* scheduler policy, passed to every worker when given (metrale-worker checks them) */
    const char *prefill_budget, *graph_max_batch, *cache_budget_mb, *itl_target_ms, *prefill_pass, *prefill_hold_ms,
        *prefill_layers, *layered_max_waiting, *prefill_expert_parts, *fine_units_max_rows;
    int prefill_sites;     /* 1 --prefill-sites, 0 --no-prefill-sites, -1 neither (the workers' default) */
    const char *numerics;  /* GPU prefill GEMM numerics, passed to every worker when given */
    const char *dtype;     /* FP8 checkpoints' weights (auto|bf16), passed to every worker when given */
    const char *spec_tokens, *spec_max_batch; /* speculative decoding, passed to every worker */
    const char *warmup_tokens; /* the workers' start-up warm-up request, passed when given */
    bool no_preempt, mixed_steps, separate_steps;
    bool no_run_ahead;
    const char *router;    /* a router elsewhere: start none, connect the groups there */
    const char *curve_server_key, *curve_secret_key; /* key files, passed to every worker */
    const char *log_format; /* --log-format, passed to the router and every worker when given */
    bool log_prompts;       /* --log-prompts, passed to the router */
    /* the gRPC port's security, passed to the router */
    const char *tls_cert, *tls_key, *tls_client_ca, *auth_token_file, *health_listen;
} serve_opts;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: metrale-serve [--model DIR] [--listen HOST:PORT] [--workers G] [--tp N] [--backend auto|cpu|cuda]\n"
            "                     [--max-sequences N] [--max-context N] [--threads N] [--queue N] [--drain-timeout S]\n"
            "                     [--prefill-budget N] [--prefill-pass N] [--itl-target-ms MS] [--prefill-hold-ms MS]\n"
            "                     [--prefill-layers N] [--prefill-sites|--no-prefill-sites] [--prefill-expert-parts P]\n"
            "                     [--fine-units-max-rows N] [--layered-max-waiting N]\n"
            "                     [--graph-max-batch N] [--cache-budget-mb N] [--no-preempt]\n"
            "                     [--mixed-steps|--separate-steps] [--no-run-ahead] [--numerics bf16|exact] [--dtype auto|bf16]\n"
            "                     [--metrics HOST:PORT]\n"
            "                     [--speculative-tokens K] [--speculative-max-batch B] [--warmup-tokens N]\n"
            "                     [--log-format text|json] [--log-prompts]\n"
            "                     [--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]] [--auth-token-file FILE]\n"
            "                     [--health-listen HOST:PORT]\n"
            "                     [--router ENDPOINT [--first-id K]\n"
            "                      [--curve-server-key FILE --curve-secret-key FILE]]\n"
            "  Starts the gRPC router on --listen (default 127.0.0.1:50051) and G worker groups serving DIR\n"
            "  (default: a small random checkpoint made once under .cache/cpu-small). --backend auto uses\n"
            "  one worker per GPU when there are GPUs, else one CPU worker. SIGTERM or Ctrl-C drains and stops.\n"
            "  --tp N: each group is N worker processes sharing one model replica (tensor parallel; default 1).\n"
            "  GPUs: the devices of CUDA_VISIBLE_DEVICES (all GPUs when unset) are cut into G consecutive lists\n"
            "  of N; rank r of group g takes the r-th device of list g (--device g*N+r); G defaults to GPUs / N.\n"
            "  A group whose rank dies is stopped whole and started again; one that fails to start 3 times in a\n"
            "  row (e.g. N does not divide the model) is given up.\n"
            "  --metrics HOST:PORT: the router serves Prometheus metrics at http://HOST:PORT/metrics.\n"
            "  --router ENDPOINT: start no router; the groups serve the router at ENDPOINT (another host's\n"
            "  tcp://HOST:PORT needs --curve-server-key (its public key) and --curve-secret-key (this host's\n"
            "  secret key), from metrale-keygen); --first-id K: the groups are workers K, K+1, ... (ids unique\n"
            "  per router).\n"
            "  The scheduler options, --numerics, --dtype, --warmup-tokens and the speculative options go to every worker (metrale-worker\n"
            "  --help says what they do). --log-format text|json: every process's log lines as text (default)\n"
            "  or one JSON object a line; --log-prompts: the router's admitted records carry the prompts.\n"
            "  --tls-cert, --tls-key, --tls-client-ca (mutual TLS), --auth-token-file\n"
            "  (a bearer token) and --health-listen (a plaintext health-only port) go to the router\n"
            "  (metrale-router --help); SIGHUP makes it read the TLS files and the token file again.\n");
}

/* ---- paths ---- */

static char g_exedir[PATH_MAX]; /* this binary's folder: <bazel-bin>/launcher, or a bundle's bin/ */
static char g_bindir[PATH_MAX]; /* the bazel-bin root, the folder above g_exedir */

static void find_bindir(void) {
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) {
        strcpy(g_exedir, ".");
        strcpy(g_bindir, ".");
        return;
    }
    exe[n] = 0;
    snprintf(g_exedir, sizeof g_exedir, "%s", dirname(exe)); /* dirname writes into exe */
    snprintf(g_bindir, sizeof g_bindir, "%s", dirname(exe));
}

/* The binary rel (e.g. "router/metrale-router"): the environment variable env when set, else
 * <bazel-bin>/rel, else the same name in this binary's own folder (a folder of copied binaries);
 * when neither exists, the bazel-bin path, which the failing exec then names. */
static const char *bin_path(const char *env, const char *rel, char *buf, size_t len) {
    const char *e = getenv(env);
    if (e && *e) return e;
    snprintf(buf, len, "%s/%s", g_bindir, rel);
    if (access(buf, X_OK) == 0) return buf;
    const char *name = strrchr(rel, '/');
    char own[PATH_MAX + 64];
    snprintf(own, sizeof own, "%s/%s", g_exedir, name ? name + 1 : rel);
    if (access(own, X_OK) == 0) snprintf(buf, len, "%s", own);
    return buf;
}

/* The GPUs the workers can see: none without /dev/nvidia<N> devices; else the entries of
 * CUDA_VISIBLE_DEVICES when it is set (empty: none), or every device. */
static int count_gpus(void) {
    glob_t g;
    if (glob("/dev/nvidia[0-9]*", 0, NULL, &g) != 0) return 0;
    int n = (int)g.gl_pathc;
    globfree(&g);
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    if (vis) {
        n = 0;
        for (const char *p = vis; *p;) {
            const char *comma = strchr(p, ',');
            const size_t len = comma ? (size_t)(comma - p) : strlen(p);
            n += len > 0;
            p += len + (comma != NULL);
        }
    }
    return n;
}

/* ---- children ---- */

static pid_t spawn(char *const argv[]) {
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        mt_log(MT_LOG_ERROR, "metrale-serve: fork: %s", strerror(errno));
        return -1;
    }
    if (pid == 0) {
        setpgid(0, 0); /* terminal signals go to metrale-serve only; it forwards them */
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent) _exit(1); /* the parent died before prctl */
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        execv(argv[0], argv);
        mt_log(MT_LOG_ERROR, "metrale-serve: cannot run %s: %s", argv[0], strerror(errno));
        _exit(127);
    }
    setpgid(pid, pid);
    return pid;
}

/* Runs argv to completion; its exit status, or -1. */
static int run_wait(char *const argv[]) {
    pid_t pid = spawn(argv);
    if (pid < 0) return -1;
    int st;
    while (waitpid(pid, &st, 0) < 0)
        if (errno != EINTR) return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Makes the default model once: .cache/cpu-small from tools/configs/cpu-small.json (remade when
 * the config is newer, as scripts/run.sh does). */
static const char *default_model(void) {
    static const char *dir = ".cache/cpu-small", *cfg = "tools/configs/cpu-small.json";
    struct stat sc, sm;
    if (stat(cfg, &sc) != 0) {
        if (stat(".cache/cpu-small/config.json", &sm) == 0) return dir;
        mt_log(MT_LOG_ERROR, "metrale-serve: no --model and no %s here; run from the repository root or pass --model",
                cfg);
        return NULL;
    }
    if (stat(".cache/cpu-small/config.json", &sm) == 0 && sm.st_mtime >= sc.st_mtime) return dir;
    char buf[PATH_MAX + 64];
    const char *mk = bin_path("METRALE_MKCKPT_BIN", "tools/mkckpt", buf, sizeof buf);
    mt_log(MT_LOG_INFO, "metrale-serve: making a small random checkpoint in %s (%s)", dir, cfg);
    mkdir(".cache", 0755);
    char *argv[] = { (char *)mk, "--config", (char *)cfg, "--out", (char *)dir, "--seed", "1", NULL };
    if (run_wait(argv) != 0) {
        mt_log(MT_LOG_ERROR, "metrale-serve: %s failed", mk);
        return NULL;
    }
    return dir;
}

static serve_opts g_o;
static char g_endpoint[PATH_MAX + 16], g_sock[PATH_MAX], g_sockdir[64];
static int g_ngpu;
static unsigned g_nonce; /* random, in every group's name: names unique across hosts sharing /dev/shm */
static pid_t g_router;   /* 0 when not running (or never: --router) */
static group g_groups[MAX_WORKERS];

static pid_t start_router(void) {
    char buf[PATH_MAX + 64];
    const char *bin = bin_path("METRALE_ROUTER_BIN", "router/metrale-router", buf, sizeof buf);
    char *argv[32];
    int k = 0;
    argv[k++] = (char *)bin;
    argv[k++] = "--listen";
    argv[k++] = (char *)g_o.listen;
    argv[k++] = "--workers-endpoint";
    argv[k++] = g_endpoint;
    if (g_o.queue) { argv[k++] = "--queue"; argv[k++] = (char *)g_o.queue; }
    if (g_o.drain_timeout) { argv[k++] = "--drain-timeout"; argv[k++] = (char *)g_o.drain_timeout; }
    if (g_o.log_format) { argv[k++] = "--log-format"; argv[k++] = (char *)g_o.log_format; }
    if (g_o.log_prompts) argv[k++] = "--log-prompts";
    if (g_o.metrics) { argv[k++] = "--metrics"; argv[k++] = (char *)g_o.metrics; }
    if (g_o.tls_cert) { argv[k++] = "--tls-cert"; argv[k++] = (char *)g_o.tls_cert; }
    if (g_o.tls_key) { argv[k++] = "--tls-key"; argv[k++] = (char *)g_o.tls_key; }
    if (g_o.tls_client_ca) { argv[k++] = "--tls-client-ca"; argv[k++] = (char *)g_o.tls_client_ca; }
    if (g_o.auth_token_file) { argv[k++] = "--auth-token-file"; argv[k++] = (char *)g_o.auth_token_file; }
    if (g_o.health_listen) { argv[k++] = "--health-listen"; argv[k++] = (char *)g_o.health_listen; }
    argv[k] = NULL;
    return g_router = spawn(argv);
}

/* The --device of rank r of group g (see the top of this file). */
static int device_of(int g, int r) {
    if (g_ngpu <= 0) return 0;
    return g_o.tp == 1 ? g % g_ngpu : g * g_o.tp + r;
}

static pid_t start_rank(group *gr, int r) {
    char buf[PATH_MAX + 64], id[16], dev[16], seqs[16], ctx[16], thr[16], tp[16], rank[16];
    const char *bin = bin_path("METRALE_WORKER_BIN", "worker/metrale-worker", buf, sizeof buf);
    snprintf(id, sizeof id, "%d", gr->id);
    snprintf(dev, sizeof dev, "%d", device_of(gr->index, r));
    snprintf(seqs, sizeof seqs, "%d", g_o.max_sequences);
    snprintf(ctx, sizeof ctx, "%d", g_o.max_context);
    snprintf(thr, sizeof thr, "%d", g_o.threads);
    snprintf(tp, sizeof tp, "%d", g_o.tp);
    snprintf(rank, sizeof rank, "%d", r);
    const char *router = g_o.router ? g_o.router : g_endpoint;
    char *argv[80] = { (char *)bin, "--model", (char *)g_o.model, "--router", (char *)router, "--id", id,
                       "--backend", (char *)g_o.backend, "--device", dev, "--max-sequences", seqs,
                       "--max-context", ctx, "--threads", thr };
    int k = 17;
    if (g_o.tp > 1) {
        argv[k++] = "--tp"; argv[k++] = tp;
        argv[k++] = "--rank"; argv[k++] = rank;
        argv[k++] = "--group"; argv[k++] = gr->name;
    }
    if (g_o.prefill_budget) { argv[k++] = "--prefill-budget"; argv[k++] = (char *)g_o.prefill_budget; }
    if (g_o.itl_target_ms) { argv[k++] = "--itl-target-ms"; argv[k++] = (char *)g_o.itl_target_ms; }
    if (g_o.prefill_hold_ms) { argv[k++] = "--prefill-hold-ms"; argv[k++] = (char *)g_o.prefill_hold_ms; }
    if (g_o.prefill_pass) { argv[k++] = "--prefill-pass"; argv[k++] = (char *)g_o.prefill_pass; }
    if (g_o.prefill_layers) { argv[k++] = "--prefill-layers"; argv[k++] = (char *)g_o.prefill_layers; }
    if (g_o.prefill_sites >= 0) argv[k++] = g_o.prefill_sites ? "--prefill-sites" : "--no-prefill-sites";
    if (g_o.prefill_expert_parts) { argv[k++] = "--prefill-expert-parts"; argv[k++] = (char *)g_o.prefill_expert_parts; }
    if (g_o.fine_units_max_rows) { argv[k++] = "--fine-units-max-rows"; argv[k++] = (char *)g_o.fine_units_max_rows; }
    if (g_o.layered_max_waiting) { argv[k++] = "--layered-max-waiting"; argv[k++] = (char *)g_o.layered_max_waiting; }
    if (g_o.graph_max_batch) { argv[k++] = "--graph-max-batch"; argv[k++] = (char *)g_o.graph_max_batch; }
    if (g_o.cache_budget_mb) { argv[k++] = "--cache-budget-mb"; argv[k++] = (char *)g_o.cache_budget_mb; }
    if (g_o.no_preempt) argv[k++] = "--no-preempt";
    if (g_o.mixed_steps) argv[k++] = "--mixed-steps";
    if (g_o.separate_steps) argv[k++] = "--separate-steps";
    if (g_o.no_run_ahead) argv[k++] = "--no-run-ahead";
    if (g_o.numerics) { argv[k++] = "--numerics"; argv[k++] = (char *)g_o.numerics; }
    if (g_o.dtype) { argv[k++] = "--dtype"; argv[k++] = (char *)g_o.dtype; }
    if (g_o.spec_tokens) { argv[k++] = "--speculative-tokens"; argv[k++] = (char *)g_o.spec_tokens; }
    if (g_o.spec_max_batch) { argv[k++] = "--speculative-max-batch"; argv[k++] = (char *)g_o.spec_max_batch; }
    if (g_o.warmup_tokens) { argv[k++] = "--warmup-tokens"; argv[k++] = (char *)g_o.warmup_tokens; }
    if (g_o.curve_server_key) {
        argv[k++] = "--curve-server-key"; argv[k++] = (char *)g_o.curve_server_key;
        argv[k++] = "--curve-secret-key"; argv[k++] = (char *)g_o.curve_secret_key;
    }
    if (g_o.log_format) { argv[k++] = "--log-format"; argv[k++] = (char *)g_o.log_format; }
    argv[k] = NULL;
    return gr->pid[r] = spawn(argv);
}

static void signal_group(group *gr, int sig) {
    for (int r = 0; r < g_o.tp; r++)
        if (gr->pid[r] > 0) kill(gr->pid[r], sig);
}

static int live_ranks(const group *gr) {
    int n = 0;
    for (int r = 0; r < g_o.tp; r++) n += gr->pid[r] > 0;
    return n;
}

/* Starts every rank of the group under a fresh name. -1 when a fork failed (the ranks started
 * are stopped again, as after any failure). */
static int start_group(group *gr, double now) {
    gr->gen++;
    snprintf(gr->name, sizeof gr->name, "metrale-%d-%08x-g%d-%u", (int)getpid(), g_nonce, gr->index, gr->gen);
    gr->started_at = now;
    gr->restart_at = 0;
    gr->down = gr->failed = gr->startup_failed = false;
    gr->why[0] = 0;
    for (int r = 0; r < g_o.tp; r++) {
        if (start_rank(gr, r) < 0) {
            gr->pid[r] = 0;
            gr->down = gr->failed = true;
            gr->kill_at = now;
            snprintf(gr->why, sizeof gr->why, "rank %d could not be started", r);
            signal_group(gr, SIGKILL);
            return -1;
        }
    }
    return 0;
}

static void signal_all(int sig, bool router) {
    if (router && g_router > 0) kill(g_router, sig);
    for (int g = 0; g < g_o.workers; g++) signal_group(&g_groups[g], sig);
}

static int live_children(void) {
    int n = g_router > 0;
    for (int g = 0; g < g_o.workers; g++) n += live_ranks(&g_groups[g]);
    return n;
}

/* "exited with status 3", "killed by signal 9" */
static void describe_status(int st, char *out, size_t len) {
    if (WIFEXITED(st)) snprintf(out, len, "exited with status %d", WEXITSTATUS(st));
    else if (WIFSIGNALED(st)) snprintf(out, len, "killed by signal %d", WTERMSIG(st));
    else snprintf(out, len, "ended (status 0x%x)", st);
}

/* Rank r of gr ended with status st. */
static void on_rank_exit(group *gr, int r, int st, bool stopping, double now) {
    gr->pid[r] = 0;
    char what[64], who[64];
    describe_status(st, what, sizeof what);
    if (g_o.tp > 1) snprintf(who, sizeof who, "worker %d rank %d", gr->id, r);
    else snprintf(who, sizeof who, "worker %d", gr->id);
    mt_log(stopping ? MT_LOG_INFO : MT_LOG_WARN, "metrale-serve: %s %s", who, what);
    if (WIFEXITED(st) && WEXITSTATUS(st) == MT_WIRE_EXIT_STARTUP) gr->startup_failed = true;
    if (gr->down || stopping) return;
    /* The first rank of this start to end: the group cannot serve without it. Rank 0 exiting 0
     * was told to stop (Shutdown, a signal); anything else is a failure. */
    gr->down = true;
    gr->failed = !(r == 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    gr->kill_at = now + GROUP_KILL_S;
    snprintf(gr->why, sizeof gr->why, "%s %s", who, what);
    if (now - gr->started_at < QUICK_FAIL_S) gr->startup_failed = true;
    if (live_ranks(gr) > 0) {
        mt_log(MT_LOG_WARN, "metrale-serve: stopping the rest of worker group %d", gr->id);
        signal_group(gr, SIGTERM);
    }
}

/* A group that is down and has no rank left: schedules its restart, or gives it up. */
static void settle_group(group *gr, bool stopping, double now) {
    if (!gr->down || live_ranks(gr) > 0) return;
    gr->down = false;
    if (!gr->failed || stopping) return;
    gr->startup_failures = gr->startup_failed ? gr->startup_failures + 1 : 0;
    if (gr->startup_failures >= STARTUP_FAILURES_MAX) {
        gr->given_up = true;
        mt_log(MT_LOG_ERROR,
               "metrale-serve: worker group %d failed to start %d times in a row (last: %s); giving up on it "
               "(the worker's own message above says why)",
               gr->id, gr->startup_failures, gr->why);
        return;
    }
    gr->restart_at = now + RESTART_DELAY_S;
    mt_log(MT_LOG_WARN, "metrale-serve: restarting worker group %d in %.0f s (%s)", gr->id, RESTART_DELAY_S, gr->why);
}

/* ---- main ---- */

static int parse_int(const char *flag, const char *v, int lo, int hi, int *out) {
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi) {
        fprintf(stderr, "metrale-serve: %s must be an integer in [%d, %d], got \"%s\"\n", flag, lo, hi, v);
        return -1;
    }
    *out = (int)x;
    return 0;
}

/* Milliseconds in [0, 60000], kept as the text the workers get. */
static int parse_ms(const char *flag, const char *v) {
    char *end;
    const double x = strtod(v, &end);
    if (end == v || *end || !(x >= 0 && x <= 60000)) {
        fprintf(stderr, "metrale-serve: %s must be milliseconds in [0, 60000], got \"%s\"\n", flag, v);
        return -1;
    }
    return 0;
}

static int parse_args(int argc, char **argv, serve_opts *o) {
    *o = (serve_opts){ .listen = "127.0.0.1:50051", .backend = "auto", .workers = 0, .tp = 1, .max_sequences = 16,
                       .max_context = 4096, .threads = 0, .prefill_sites = -1 };
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); return 1; }
        if (!strcmp(a, "--no-preempt")) { o->no_preempt = true; continue; }
        if (!strcmp(a, "--mixed-steps")) { o->mixed_steps = true; continue; }
        if (!strcmp(a, "--separate-steps")) { o->separate_steps = true; continue; }
        if (!strcmp(a, "--no-run-ahead")) { o->no_run_ahead = true; continue; }
        if (!strcmp(a, "--log-prompts")) { o->log_prompts = true; continue; }
        if (!strcmp(a, "--prefill-sites")) { o->prefill_sites = 1; continue; }
        if (!strcmp(a, "--no-prefill-sites")) { o->prefill_sites = 0; continue; }
        if (!v) { fprintf(stderr, "metrale-serve: %s needs a value\n", a); usage(stderr); return -1; }
        int rc = 0;
        if (!strcmp(a, "--model")) o->model = v;
        else if (!strcmp(a, "--listen")) o->listen = v;
        else if (!strcmp(a, "--backend")) o->backend = v;
        else if (!strcmp(a, "--queue")) o->queue = v;
        else if (!strcmp(a, "--drain-timeout")) o->drain_timeout = v;
        else if (!strcmp(a, "--metrics")) o->metrics = v;
        else if (!strcmp(a, "--prefill-budget"))
            rc = parse_int(a, o->prefill_budget = v, 1, MT_WIRE_CONTEXT_MAX, &(int){ 0 });
        else if (!strcmp(a, "--prefill-pass"))
            rc = parse_int(a, o->prefill_pass = v, 1, 65536, &(int){ 0 });
        else if (!strcmp(a, "--itl-target-ms")) rc = parse_ms(a, o->itl_target_ms = v);
        else if (!strcmp(a, "--prefill-hold-ms")) rc = parse_ms(a, o->prefill_hold_ms = v);
        else if (!strcmp(a, "--prefill-layers")) rc = parse_int(a, o->prefill_layers = v, 0, 1024, &(int){ 0 });
        else if (!strcmp(a, "--prefill-expert-parts"))
            rc = parse_int(a, o->prefill_expert_parts = v, 1, 1 << 20, &(int){ 0 });
        else if (!strcmp(a, "--fine-units-max-rows"))
            rc = parse_int(a, o->fine_units_max_rows = v, 0, 1 << 20, &(int){ 0 });
        else if (!strcmp(a, "--layered-max-waiting"))
            rc = parse_int(a, o->layered_max_waiting = v, 0, 1 << 20, &(int){ 0 });
        else if (!strcmp(a, "--graph-max-batch")) rc = parse_int(a, o->graph_max_batch = v, 1, 4096, &(int){ 0 });
        else if (!strcmp(a, "--speculative-tokens")) rc = parse_int(a, o->spec_tokens = v, 0, 4, &(int){ 0 });
        else if (!strcmp(a, "--warmup-tokens")) rc = parse_int(a, o->warmup_tokens = v, 0, MT_WIRE_CONTEXT_MAX, &(int){ 0 });
        else if (!strcmp(a, "--speculative-max-batch"))
            rc = parse_int(a, o->spec_max_batch = v, 0, 4096, &(int){ 0 });
        else if (!strcmp(a, "--cache-budget-mb")) rc = parse_int(a, o->cache_budget_mb = v, 0, 1 << 30, &(int){ 0 });
        else if (!strcmp(a, "--workers")) rc = parse_int(a, v, 1, MAX_WORKERS, &o->workers);
        else if (!strcmp(a, "--tp")) rc = parse_int(a, v, 1, MAX_TP, &o->tp);
        else if (!strcmp(a, "--first-id")) rc = parse_int(a, v, 0, INT_MAX - MAX_WORKERS, &o->first_id);
        else if (!strcmp(a, "--router")) o->router = v;
        else if (!strcmp(a, "--log-format")) {
            mt_log_format fmt;
            o->log_format = v;
            if (mt_log_format_parse(v, &fmt)) {
                mt_log_set_format(fmt);
            } else {
                fprintf(stderr, "metrale-serve: --log-format must be text or json, got %s\n", v);
                rc = -1;
            }
        }
        else if (!strcmp(a, "--curve-server-key")) o->curve_server_key = v;
        else if (!strcmp(a, "--curve-secret-key")) o->curve_secret_key = v;
        else if (!strcmp(a, "--tls-cert")) o->tls_cert = v;
        else if (!strcmp(a, "--tls-key")) o->tls_key = v;
        else if (!strcmp(a, "--tls-client-ca")) o->tls_client_ca = v;
        else if (!strcmp(a, "--auth-token-file")) o->auth_token_file = v;
        else if (!strcmp(a, "--health-listen")) o->health_listen = v;
        else if (!strcmp(a, "--max-sequences")) rc = parse_int(a, v, 1, 4096, &o->max_sequences);
        else if (!strcmp(a, "--max-context")) rc = parse_int(a, v, 2, MT_WIRE_CONTEXT_MAX, &o->max_context);
        else if (!strcmp(a, "--threads")) rc = parse_int(a, v, 0, 4096, &o->threads);
        else if (!strcmp(a, "--numerics")) {
            o->numerics = v;
            if (strcmp(v, "exact") && strcmp(v, "bf16")) {
                fprintf(stderr, "metrale-serve: --numerics must be exact or bf16, got %s\n", v);
                rc = -1;
            }
        }
        else if (!strcmp(a, "--dtype")) {
            o->dtype = v;
            if (strcmp(v, "auto") && strcmp(v, "bf16")) {
                fprintf(stderr, "metrale-serve: --dtype must be auto or bf16, got %s\n", v);
                rc = -1;
            }
        }
        else { fprintf(stderr, "metrale-serve: unknown option %s\n", a); usage(stderr); return -1; }
        if (rc) return -1;
        i++;
    }
    if (strcmp(o->backend, "auto") && strcmp(o->backend, "cpu") && strcmp(o->backend, "cuda")) {
        fprintf(stderr, "metrale-serve: --backend must be auto, cpu or cuda, got %s\n", o->backend);
        return -1;
    }
    if (!o->curve_server_key != !o->curve_secret_key) {
        fprintf(stderr, "metrale-serve: --curve-server-key and --curve-secret-key go together\n");
        return -1;
    }
    /* sites are the workers' default only on one GPU (metrale-worker's wkr_layering_of): with
     * --backend auto a worker may find none */
    const bool sites = o->prefill_sites == 1 || (o->prefill_sites < 0 && !strcmp(o->backend, "cuda") && o->tp <= 1);
    if (o->prefill_expert_parts && atoi(o->prefill_expert_parts) > 1 && !sites) {
        fprintf(stderr, "metrale-serve: --prefill-expert-parts needs --prefill-sites\n");
        return -1;
    }
    if (o->metrics && o->router) {
        fprintf(stderr, "metrale-serve: --metrics is the router's, and --router starts none here; give it to the "
                        "router at %s\n", o->router);
        return -1;
    }
    if (!o->tls_cert != !o->tls_key) {
        fprintf(stderr, "metrale-serve: --tls-cert and --tls-key go together\n");
        return -1;
    }
    if (o->tls_client_ca && !o->tls_cert) {
        fprintf(stderr, "metrale-serve: --tls-client-ca needs --tls-cert and --tls-key\n");
        return -1;
    }
    if (o->router && (o->tls_cert || o->auth_token_file || o->health_listen)) {
        fprintf(stderr, "metrale-serve: --tls-*, --auth-token-file and --health-listen configure the router started "
                        "here; with --router ENDPOINT give them to that router\n");
        return -1;
    }
    if (o->curve_server_key && !o->router) {
        fprintf(stderr, "metrale-serve: the CURVE keys are for a router elsewhere (--router ENDPOINT); the router "
                        "started here listens on a private ipc:// socket\n");
        return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    mt_log_set_component("serve", "metrale-serve: ");
    int rc = parse_args(argc, argv, &g_o);
    if (rc) return rc > 0 ? 0 : 2;
    find_bindir();
    g_ngpu = strcmp(g_o.backend, "cpu") ? count_gpus() : 0;
    if (!strcmp(g_o.backend, "cuda") && g_ngpu == 0)
        mt_log(MT_LOG_WARN, "metrale-serve: --backend cuda but no visible GPU; workers will fail to start");
    const bool gpu = g_ngpu > 0;
    if (!g_o.workers) g_o.workers = gpu && g_ngpu >= g_o.tp ? g_ngpu / g_o.tp : 1;
    if (g_o.workers * g_o.tp > MAX_RANKS) {
        fprintf(stderr, "metrale-serve: --workers %d --tp %d makes %d worker processes; at most %d\n", g_o.workers,
                g_o.tp, g_o.workers * g_o.tp, MAX_RANKS);
        return 2;
    }
    if (gpu && g_o.tp > 1 && g_o.workers * g_o.tp > g_ngpu) {
        fprintf(stderr, "metrale-serve: %d groups of %d ranks need %d GPUs, and %d are visible\n", g_o.workers,
                g_o.tp, g_o.workers * g_o.tp, g_ngpu);
        return 2;
    }
    if (!gpu) {
        const int procs = g_o.workers * g_o.tp;
        if (g_o.threads == 0) { /* share the cores between CPU worker processes */
            long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
            g_o.threads = ncpu > procs ? (int)(ncpu / procs) : 1;
        }
        /* The CPU kernels' OpenMP regions are short; spinning threads cost more than they save when
         * the router, the client and the workers share the cores (measured 8x slower decode on a
         * busy 2-core host). A value set by the user wins. */
        setenv("OMP_WAIT_POLICY", "passive", 0);
    }
    unsigned seed = (unsigned)getpid() ^ (unsigned)(now_s() * 1e9);
    FILE *ur = fopen("/dev/urandom", "rb");
    if (ur) {
        if (fread(&seed, sizeof seed, 1, ur) != 1) seed ^= (unsigned)clock();
        fclose(ur);
    }
    g_nonce = seed;

    /* signals are taken synchronously with sigtimedwait; children start with an empty mask */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGCHLD);
    sigaddset(&set, SIGHUP);
    sigprocmask(SIG_BLOCK, &set, NULL);

    if (!g_o.model && !(g_o.model = default_model())) return 1;
    if (!g_o.router) {
        /* One private folder per user (a unix socket path has at most 107 bytes: /tmp, not
         * $TMPDIR); the router checks it again and binds only there (common/wire.h). */
        snprintf(g_sockdir, sizeof g_sockdir, "/tmp/metrale-%u", (unsigned)geteuid());
        mt_error err;
        if (mt_ipc_dir_private(g_sockdir, &err)) {
            fprintf(stderr, "metrale-serve: %s\n", err.msg);
            return 1;
        }
        const int stale = mt_ipc_clear_stale_dir(g_sockdir, "serve-");
        if (stale) fprintf(stderr, "metrale-serve: removed %d stale socket%s from %s\n", stale, stale > 1 ? "s" : "",
                           g_sockdir);
        /* The pid alone is not unique: in a PID namespace (a container, Bazel's sandbox) every
         * launcher may be pid 21, and /tmp may be shared. */
        snprintf(g_sock, sizeof g_sock, "%s/serve-%d-%08x.sock", g_sockdir, (int)getpid(), g_nonce);
        snprintf(g_endpoint, sizeof g_endpoint, "ipc://%s", g_sock);
        if (start_router() < 0) return 1;
    }
    const double t0 = now_s();
    for (int g = 0; g < g_o.workers; g++) {
        g_groups[g] = (group){ .index = g, .id = g_o.first_id + g };
        if (start_group(&g_groups[g], t0) < 0) {
            signal_all(SIGKILL, true);
            return 1;
        }
    }
    mt_log(MT_LOG_INFO, "metrale-serve: %s%s; %d %s worker%s%s serving %s; Ctrl-C stops",
            g_o.router ? "workers for the router at " : "gRPC on ", g_o.router ? g_o.router : g_o.listen,
            g_o.workers, gpu ? "GPU" : "CPU", g_o.tp > 1 ? " group" : "", g_o.workers > 1 ? "s" : "", g_o.model);
    if (g_o.tp > 1) mt_log(MT_LOG_INFO, "metrale-serve: each group has %d ranks", g_o.tp);
    if (!g_o.router)
        mt_log(MT_LOG_INFO, "metrale-serve: try  tools/metrale_client.py --addr %s --prompt 1,2,3,4 --max-new 16",
                g_o.listen);

    int signals = 0, status = 1;
    bool stopping = false;
    double router_gone_at = 0, last_escalation = 0;
    bool router_died = false; /* it ended without being asked to: stop everything now */
    while (live_children() > 0 || (!stopping && !g_router && g_o.router)) {
        struct timespec ts = { 0, 100 * 1000 * 1000 };
        int sig = sigtimedwait(&set, NULL, &ts);
        const double now = now_s();
        if (sig == SIGHUP) {
            if (g_router > 0) {
                fprintf(stderr, "metrale-serve: SIGHUP: the router reads its TLS files and token again\n");
                kill(g_router, SIGHUP);
            } else {
                fprintf(stderr, "metrale-serve: SIGHUP ignored: no router runs here\n");
            }
        }
        if (sig == SIGTERM || sig == SIGINT) {
            signals++;
            stopping = true;
            last_escalation = now;
            if (signals == 1) {
                mt_log(MT_LOG_INFO, "metrale-serve: draining (signal again to stop at once)");
                if (g_router > 0) {
                    kill(g_router, SIGTERM);
                } else {
                    signal_all(SIGTERM, false);
                    router_gone_at = now; /* no router to wait for: the workers' exit is timed from now */
                    status = 0;
                }
            } else {
                signal_all(signals == 2 ? SIGTERM : SIGKILL, true);
            }
        }
        /* reap */
        int st;
        pid_t pid;
        while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
            if (pid == g_router) {
                g_router = 0;
                router_gone_at = now;
                status = WIFEXITED(st) ? WEXITSTATUS(st) : 1;
                char what[64];
                describe_status(st, what, sizeof what);
                mt_log(MT_LOG_INFO, "metrale-serve: router %s", what);
                if (!stopping) {
                    mt_log(MT_LOG_ERROR, "metrale-serve: the router died; stopping the workers and exiting");
                    stopping = true;
                    router_died = true;
                    signal_all(SIGTERM, false);
                    if (g_sock[0]) unlink(g_sock); /* its socket file: the router had no chance to */
                    status = status ? status : 1;
                }
                continue;
            }
            for (int g = 0; g < g_o.workers; g++)
                for (int r = 0; r < g_o.tp; r++)
                    if (g_groups[g].pid[r] == pid) on_rank_exit(&g_groups[g], r, st, stopping, now);
        }
        int serving = 0;
        for (int g = 0; g < g_o.workers; g++) {
            group *gr = &g_groups[g];
            if (gr->down && now >= gr->kill_at) signal_group(gr, SIGKILL);
            settle_group(gr, stopping, now);
            if (!stopping && !gr->given_up && !gr->down && !live_ranks(gr) && gr->restart_at && now >= gr->restart_at)
                start_group(gr, now);
            serving += !gr->given_up;
        }
        if (!stopping && serving == 0) {
            mt_log(MT_LOG_ERROR, "metrale-serve: no worker group can serve; stopping");
            stopping = true;
            last_escalation = now;
            if (g_router > 0) kill(g_router, SIGTERM);
            else router_gone_at = now;
            status = 1;
            signals = 1; /* a signal from here on escalates */
        }
        /* escalation: workers that outlive the router, and anyone after the signals */
        if (router_died && now - router_gone_at > ROUTER_DEATH_KILL_S) signal_all(SIGKILL, false);
        if (stopping && !g_router && router_gone_at && now - router_gone_at > WORKER_EXIT_S) {
            signal_all(now - router_gone_at > WORKER_EXIT_S + KILL_AFTER_S ? SIGKILL : SIGTERM, false);
        }
        if (signals >= 2 && now - last_escalation > KILL_AFTER_S) signal_all(SIGKILL, true);
    }
    int given_up = 0;
    for (int g = 0; g < g_o.workers; g++) given_up += g_groups[g].given_up;
    if (given_up == g_o.workers) status = 1;
    if (g_sock[0]) unlink(g_sock);
    mt_log(MT_LOG_INFO, "metrale-serve: stopped");
    return status;
}
