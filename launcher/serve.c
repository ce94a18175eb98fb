/* launcher/serve.c: metrale-serve, the one-line start of the service: the router and N workers.
 *
 *   metrale-serve [--model DIR] [--listen HOST:PORT] [--workers N] [--backend auto|cpu|cuda]
 *                 [--max-sequences N] [--max-context N] [--threads N] [--queue N] [--drain-timeout S]
 *                 [--numerics exact|bf16]
 *
 * With no --model it serves a small random checkpoint made here once (tools/mkckpt with
 * tools/configs/cpu-small.json into .cache/cpu-small, as scripts/run.sh does), so it runs on any
 * machine. --backend auto (the default) gives each worker a GPU when there are any
 * (/dev/nvidia0..), one worker per GPU, and otherwise runs one CPU worker with every core.
 *
 * Processes: the router (bazel-bin/router/metrale-router) binds an ipc:// socket private to this
 * run; workers (bazel-bin/worker/metrale-worker) connect to it. The binaries are found in the
 * bazel-bin tree this one is in (bazel-bin/launcher/metrale-serve), or else in its own folder (a
 * folder of copied binaries); METRALE_ROUTER_BIN, METRALE_WORKER_BIN and METRALE_MKCKPT_BIN name
 * others. Each child runs in its own process group and gets SIGTERM if this process dies.
 *
 * Signals: the first SIGTERM / SIGINT is forwarded to the router, which drains (health
 * NOT_SERVING, running streams finish up to --drain-timeout) and tells the workers to shut down;
 * workers still alive WORKER_EXIT_S after the router are sent SIGTERM, then SIGKILL. A second
 * signal sends SIGTERM to everyone, a third SIGKILL. A worker that dies while serving (killed, or
 * a non-zero exit) is started again after RESTART_DELAY_S (the router counts it as a restart); if
 * the router dies, everything stops. Exit status: the router's (0 after a clean drain), 1 on
 * failure, 2 on bad arguments.
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

#include "common/wire_limits.h"

#define MAX_WORKERS 64
_Static_assert(MAX_WORKERS <= MT_WIRE_WORKERS_MAX, "the router takes fewer workers than the launcher starts");
#define RESTART_DELAY_S 1.0
#define WORKER_EXIT_S 10.0
#define KILL_AFTER_S 5.0

typedef struct child {
    pid_t pid;             /* 0 when not running */
    int worker;            /* worker id, -1 for the router */
    double restart_at;     /* when a dead worker starts again; 0 = not scheduled */
    int exits;
} child;

typedef struct serve_opts {
    const char *model, *listen, *backend, *queue, *drain_timeout;
    int workers, max_sequences, max_context, threads;
    /* scheduler policy, passed to every worker when given (metrale-worker checks them) */
    const char *prefill_budget, *graph_max_batch, *cache_budget_mb;
    const char *numerics;  /* GPU prefill GEMM numerics, passed to every worker when given */
    bool no_preempt;
    bool no_run_ahead;
} serve_opts;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: metrale-serve [--model DIR] [--listen HOST:PORT] [--workers N] [--backend auto|cpu|cuda]\n"
            "                     [--max-sequences N] [--max-context N] [--threads N] [--queue N] [--drain-timeout S]\n"
            "                     [--prefill-budget N] [--graph-max-batch N] [--cache-budget-mb N] [--no-preempt]\n"
            "                     [--no-run-ahead] [--numerics exact|bf16]\n"
            "  Starts the gRPC router on --listen (default 127.0.0.1:50051) and N workers serving DIR\n"
            "  (default: a small random checkpoint made once under .cache/cpu-small). --backend auto uses\n"
            "  one worker per GPU when there are GPUs, else one CPU worker. SIGTERM or Ctrl-C drains and stops.\n"
            "  The scheduler options and --numerics go to every worker (metrale-worker --help says what they do).\n");
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

static int count_gpus(void) {
    glob_t g;
    if (glob("/dev/nvidia[0-9]*", 0, NULL, &g) != 0) return 0;
    int n = (int)g.gl_pathc;
    globfree(&g);
    return n;
}

/* ---- children ---- */

static pid_t spawn(char *const argv[]) {
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        fprintf(stderr, "metrale-serve: fork: %s\n", strerror(errno));
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
        fprintf(stderr, "metrale-serve: cannot run %s: %s\n", argv[0], strerror(errno));
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
        fprintf(stderr, "metrale-serve: no --model and no %s here; run from the repository root or pass --model\n",
                cfg);
        return NULL;
    }
    if (stat(".cache/cpu-small/config.json", &sm) == 0 && sm.st_mtime >= sc.st_mtime) return dir;
    char buf[PATH_MAX + 64];
    const char *mk = bin_path("METRALE_MKCKPT_BIN", "tools/mkckpt", buf, sizeof buf);
    fprintf(stderr, "metrale-serve: making a small random checkpoint in %s (%s)\n", dir, cfg);
    mkdir(".cache", 0755);
    char *argv[] = { (char *)mk, "--config", (char *)cfg, "--out", (char *)dir, "--seed", "1", NULL };
    if (run_wait(argv) != 0) {
        fprintf(stderr, "metrale-serve: %s failed\n", mk);
        return NULL;
    }
    return dir;
}

static serve_opts g_o;
static char g_endpoint[PATH_MAX + 16], g_sock[PATH_MAX];
static int g_ngpu;
static child g_router = { .worker = -1 }, g_workers[MAX_WORKERS];

static pid_t start_router(void) {
    char buf[PATH_MAX + 64];
    const char *bin = bin_path("METRALE_ROUTER_BIN", "router/metrale-router", buf, sizeof buf);
    char *argv[16];
    int k = 0;
    argv[k++] = (char *)bin;
    argv[k++] = "--listen";
    argv[k++] = (char *)g_o.listen;
    argv[k++] = "--workers-endpoint";
    argv[k++] = g_endpoint;
    if (g_o.queue) { argv[k++] = "--queue"; argv[k++] = (char *)g_o.queue; }
    if (g_o.drain_timeout) { argv[k++] = "--drain-timeout"; argv[k++] = (char *)g_o.drain_timeout; }
    argv[k] = NULL;
    return g_router.pid = spawn(argv);
}

static pid_t start_worker(int i) {
    char buf[PATH_MAX + 64], id[16], dev[16], seqs[16], ctx[16], thr[16];
    const char *bin = bin_path("METRALE_WORKER_BIN", "worker/metrale-worker", buf, sizeof buf);
    snprintf(id, sizeof id, "%d", i);
    snprintf(dev, sizeof dev, "%d", g_ngpu > 0 ? i % g_ngpu : 0);
    snprintf(seqs, sizeof seqs, "%d", g_o.max_sequences);
    snprintf(ctx, sizeof ctx, "%d", g_o.max_context);
    snprintf(thr, sizeof thr, "%d", g_o.threads);
    char *argv[32] = { (char *)bin, "--model", (char *)g_o.model, "--router", g_endpoint, "--id", id,
                       "--backend", (char *)g_o.backend, "--device", dev, "--max-sequences", seqs,
                       "--max-context", ctx, "--threads", thr };
    int k = 17;
    if (g_o.prefill_budget) { argv[k++] = "--prefill-budget"; argv[k++] = (char *)g_o.prefill_budget; }
    if (g_o.graph_max_batch) { argv[k++] = "--graph-max-batch"; argv[k++] = (char *)g_o.graph_max_batch; }
    if (g_o.cache_budget_mb) { argv[k++] = "--cache-budget-mb"; argv[k++] = (char *)g_o.cache_budget_mb; }
    if (g_o.no_preempt) argv[k++] = "--no-preempt";
    if (g_o.no_run_ahead) argv[k++] = "--no-run-ahead";
    if (g_o.numerics) { argv[k++] = "--numerics"; argv[k++] = (char *)g_o.numerics; }
    argv[k] = NULL;
    g_workers[i].worker = i;
    g_workers[i].restart_at = 0;
    return g_workers[i].pid = spawn(argv);
}

static void signal_all(int sig, bool router) {
    if (router && g_router.pid > 0) kill(g_router.pid, sig);
    for (int i = 0; i < g_o.workers; i++)
        if (g_workers[i].pid > 0) kill(g_workers[i].pid, sig);
}

static int live_children(void) {
    int n = g_router.pid > 0;
    for (int i = 0; i < g_o.workers; i++) n += g_workers[i].pid > 0;
    return n;
}

static void describe_exit(const char *who, int id, int st) {
    char name[32];
    if (id >= 0) snprintf(name, sizeof name, "%s %d", who, id);
    else snprintf(name, sizeof name, "%s", who);
    if (WIFEXITED(st)) fprintf(stderr, "metrale-serve: %s exited with status %d\n", name, WEXITSTATUS(st));
    else if (WIFSIGNALED(st)) fprintf(stderr, "metrale-serve: %s killed by signal %d\n", name, WTERMSIG(st));
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

static int parse_args(int argc, char **argv, serve_opts *o) {
    *o = (serve_opts){ .listen = "127.0.0.1:50051", .backend = "auto", .workers = 0, .max_sequences = 16,
                       .max_context = 4096, .threads = 0 };
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); return 1; }
        if (!strcmp(a, "--no-preempt")) { o->no_preempt = true; continue; }
        if (!strcmp(a, "--no-run-ahead")) { o->no_run_ahead = true; continue; }
        if (!v) { fprintf(stderr, "metrale-serve: %s needs a value\n", a); usage(stderr); return -1; }
        int rc = 0;
        if (!strcmp(a, "--model")) o->model = v;
        else if (!strcmp(a, "--listen")) o->listen = v;
        else if (!strcmp(a, "--backend")) o->backend = v;
        else if (!strcmp(a, "--queue")) o->queue = v;
        else if (!strcmp(a, "--drain-timeout")) o->drain_timeout = v;
        else if (!strcmp(a, "--prefill-budget"))
            rc = parse_int(a, o->prefill_budget = v, 1, MT_WIRE_CONTEXT_MAX, &(int){ 0 });
        else if (!strcmp(a, "--graph-max-batch")) rc = parse_int(a, o->graph_max_batch = v, 1, 4096, &(int){ 0 });
        else if (!strcmp(a, "--cache-budget-mb")) rc = parse_int(a, o->cache_budget_mb = v, 0, 1 << 30, &(int){ 0 });
        else if (!strcmp(a, "--workers")) rc = parse_int(a, v, 1, MAX_WORKERS, &o->workers);
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
        else { fprintf(stderr, "metrale-serve: unknown option %s\n", a); usage(stderr); return -1; }
        if (rc) return -1;
        i++;
    }
    if (strcmp(o->backend, "auto") && strcmp(o->backend, "cpu") && strcmp(o->backend, "cuda")) {
        fprintf(stderr, "metrale-serve: --backend must be auto, cpu or cuda, got %s\n", o->backend);
        return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    int rc = parse_args(argc, argv, &g_o);
    if (rc) return rc > 0 ? 0 : 2;
    find_bindir();
    g_ngpu = strcmp(g_o.backend, "cpu") ? count_gpus() : 0;
    if (!strcmp(g_o.backend, "cuda") && g_ngpu == 0)
        fprintf(stderr, "metrale-serve: --backend cuda but no /dev/nvidia* device; workers will fail to start\n");
    const bool gpu = g_ngpu > 0;
    if (!g_o.workers) g_o.workers = gpu ? g_ngpu : 1;
    if (!gpu) {
        if (g_o.threads == 0) { /* share the cores between CPU workers */
            long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
            g_o.threads = ncpu > g_o.workers ? (int)(ncpu / g_o.workers) : 1;
        }
        /* The CPU kernels' OpenMP regions are short; spinning threads cost more than they save when
         * the router, the client and the workers share the cores (measured 8x slower decode on a
         * busy 2-core host). A value set by the user wins. */
        setenv("OMP_WAIT_POLICY", "passive", 0);
    }

    /* signals are taken synchronously with sigtimedwait; children start with an empty mask */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGCHLD);
    sigprocmask(SIG_BLOCK, &set, NULL);

    if (!g_o.model && !(g_o.model = default_model())) return 1;
    snprintf(g_sock, sizeof g_sock, "/tmp/metrale-serve-%d.sock", (int)getpid());
    snprintf(g_endpoint, sizeof g_endpoint, "ipc://%s", g_sock);
    unlink(g_sock);

    if (start_router() < 0) return 1;
    for (int i = 0; i < g_o.workers; i++)
        if (start_worker(i) < 0) {
            signal_all(SIGKILL, true);
            return 1;
        }
    fprintf(stderr,
            "metrale-serve: gRPC on %s; %d %s worker%s serving %s (workers at %s); Ctrl-C stops\n"
            "metrale-serve: try  tools/metrale_client.py --addr %s --prompt 1,2,3,4 --max-new 16\n",
            g_o.listen, g_o.workers, gpu ? "GPU" : "CPU", g_o.workers > 1 ? "s" : "", g_o.model, g_endpoint,
            g_o.listen);

    int signals = 0, router_status = 1;
    bool stopping = false;
    double router_gone_at = 0, last_escalation = 0;
    while (live_children() > 0) {
        struct timespec ts = { 0, 200 * 1000 * 1000 };
        int sig = sigtimedwait(&set, NULL, &ts);
        const double now = now_s();
        if (sig == SIGTERM || sig == SIGINT) {
            signals++;
            stopping = true;
            last_escalation = now;
            if (signals == 1) {
                fprintf(stderr, "metrale-serve: draining (signal again to stop at once)\n");
                if (g_router.pid > 0) kill(g_router.pid, SIGTERM);
                else signal_all(SIGTERM, false);
            } else {
                signal_all(signals == 2 ? SIGTERM : SIGKILL, true);
            }
        }
        /* reap */
        int st;
        pid_t pid;
        while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
            if (pid == g_router.pid) {
                g_router.pid = 0;
                router_gone_at = now;
                router_status = WIFEXITED(st) ? WEXITSTATUS(st) : 1;
                describe_exit("router", -1, st);
                if (!stopping) {
                    fprintf(stderr, "metrale-serve: the router died; stopping the workers\n");
                    stopping = true;
                    signal_all(SIGTERM, false);
                    router_status = router_status ? router_status : 1;
                }
                continue;
            }
            for (int i = 0; i < g_o.workers; i++) {
                if (g_workers[i].pid != pid) continue;
                g_workers[i].pid = 0;
                g_workers[i].exits++;
                describe_exit("worker", i, st);
                /* exit 0 means told to (Shutdown or a signal): only a crash or a kill restarts */
                if (!stopping && !(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
                    g_workers[i].restart_at = now + RESTART_DELAY_S;
                    fprintf(stderr, "metrale-serve: restarting worker %d in %.0f s\n", i, RESTART_DELAY_S);
                }
            }
        }
        if (!stopping)
            for (int i = 0; i < g_o.workers; i++)
                if (!g_workers[i].pid && g_workers[i].restart_at && now >= g_workers[i].restart_at) start_worker(i);
        /* escalation: workers that outlive the router, and anyone after the signals */
        if (stopping && !g_router.pid && router_gone_at && now - router_gone_at > WORKER_EXIT_S) {
            signal_all(now - router_gone_at > WORKER_EXIT_S + KILL_AFTER_S ? SIGKILL : SIGTERM, false);
        }
        if (signals >= 2 && now - last_escalation > KILL_AFTER_S) signal_all(SIGKILL, true);
    }
    unlink(g_sock);
    fprintf(stderr, "metrale-serve: stopped\n");
    return router_status;
}
