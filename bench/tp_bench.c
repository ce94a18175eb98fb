/* bench/tp_bench.c: all-reduce latency and bus bandwidth of the NCCL communicator
 * (worker/dist/comm_nccl.h) beside a plain ncclAllReduce on a communicator of its own, same
 * sizes, same GPUs, same run.
 *
 *   tp_bench [--tp N] [--iters K] [--min-bytes B] [--max-bytes B] [--json FILE]
 *
 * Forks N processes (ranks), rank r on GPU r (N <= visible GPUs; --tp 1 by default). The ranks
 * form a host communicator (worker/dist/comm_host.h) first, over which rank 0 hands out two NCCL
 * ids, as a launcher would: one for our communicator, one for the reference. Each rank uses a CUDA
 * backend and queues every all-reduce, ours and the reference, on the backend's stream.
 *
 * Per size (fp32, B .. max doubling; 8 KiB .. 64 MiB by default), in place:
 *   eager  one all-reduce between two events, the stream drained after each: the median of K
 *          (after 5 unmeasured), launch included;
 *   graph  a CUDA graph of 16 all-reduces captured on the stream, replayed between two events:
 *          the median of K replays, divided by 16.
 * The figure of a size is the largest median over the ranks (the group goes at its slowest).
 * Bus bandwidth = 2 (N - 1) / N x bytes / time (nccl-tests' convention: what each rank's links
 * carry; 0 for N = 1, where the all-reduce moves nothing); algorithm bandwidth = bytes / time.
 * Prints a table (nan where a graph could not be captured); --json writes {"tp":..,"rows":[..]}
 * (null there). */
#include <cuda_runtime_api.h>
#include <math.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "worker/dist/comm_host.h"
#include "worker/dist/comm_nccl.h"

#define CK(call)                                                                                          \
    do {                                                                                                  \
        cudaError_t e_ = (call);                                                                          \
        if (e_ != cudaSuccess) {                                                                          \
            fprintf(stderr, "tp_bench rank %d: %s:%d: %s: %s\n", g_rank, __FILE__, __LINE__, #call,       \
                    cudaGetErrorString(e_));                                                              \
            return 1;                                                                                     \
        }                                                                                                 \
    } while (0)
#define NK(call)                                                                                          \
    do {                                                                                                  \
        ncclResult_t r_ = (call);                                                                         \
        if (r_ != ncclSuccess) {                                                                          \
            fprintf(stderr, "tp_bench rank %d: %s:%d: %s: %s\n", g_rank, __FILE__, __LINE__, #call,       \
                    ncclGetErrorString(r_));                                                              \
            return 1;                                                                                     \
        }                                                                                                 \
    } while (0)
#define MK(call, c)                                                                                       \
    do {                                                                                                  \
        if ((call) != MT_OK) {                                                                            \
            fprintf(stderr, "tp_bench rank %d: %s: %s\n", g_rank, #call, (c)->err.msg);                   \
            return 1;                                                                                     \
        }                                                                                                 \
    } while (0)

enum { WARMUP = 5, GRAPH_OPS = 16, MAX_SIZES = 40 };

typedef struct opts {
    int tp, iters;
    size_t min_bytes, max_bytes;
    const char *json;
} opts;

/* The four medians of one size, in microseconds per all-reduce. */
enum { OURS_EAGER, NCCL_EAGER, OURS_GRAPH, NCCL_GRAPH, N_WAYS };
static const char *const g_way[N_WAYS] = {"ours_eager", "nccl_eager", "ours_graph", "nccl_graph"};

static int g_rank;

typedef struct rank_ctx {
    mt_comm *host;            /* the ranks' host communicator (ids, agreement, results) */
    mt_backend *be;
    cudaStream_t stream;
    mt_comm *ours;
    ncclComm_t ref;
    float *buf;               /* [max_bytes / 4] device */
    cudaEvent_t e0, e1;
    double *ms;               /* [iters] scratch */
} rank_ctx;

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* One all-reduce of count floats on the stream, ours or the reference. */
static int all_reduce(rank_ctx *r, int way, size_t count) {
    if (way == OURS_EAGER || way == OURS_GRAPH) MK(mt_comm_all_reduce_sum(r->ours, r->buf, count), r->ours);
    else NK(ncclAllReduce(r->buf, r->buf, count, ncclFloat32, ncclSum, r->ref, r->stream));
    return 0;
}

/* The median time of one all-reduce of count floats the given way, microseconds (NaN: a graph
 * that could not be captured). */
static int time_way(rank_ctx *r, int way, size_t count, int iters, double *us) {
    const bool graph = way == OURS_GRAPH || way == NCCL_GRAPH;
    mt_graph *g = NULL;
    if (graph) {
        if (r->be->ops->graph_begin(r->be) != MT_OK) return 1;
        for (int k = 0; k < GRAPH_OPS; k++)
            if (all_reduce(r, way, count)) return 1;
        /* Every rank replays, or none does (a lone rank's replay would wait for the others). */
        float failed = r->be->ops->graph_end(r->be, &g) != MT_OK || !g;
        MK(mt_comm_all_reduce_sum(r->host, &failed, 1), r->host);
        if (failed > 0) {
            if (g_rank == 0)
                fprintf(stderr, "tp_bench: capturing %s of %zu floats failed on some rank; reported as n/a\n",
                        g_way[way], count);
            if (g) r->be->ops->graph_free(r->be, g);
            *us = NAN;
            return 0;
        }
    }
    for (int i = -WARMUP; i < iters; i++) {
        CK(cudaEventRecord(r->e0, r->stream));
        if (graph) {
            if (r->be->ops->graph_launch(r->be, g) != MT_OK) return 1;
        } else if (all_reduce(r, way, count)) {
            return 1;
        }
        CK(cudaEventRecord(r->e1, r->stream));
        CK(cudaEventSynchronize(r->e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, r->e0, r->e1));
        if (i >= 0) r->ms[i] = ms * 1e3 / (graph ? GRAPH_OPS : 1);
    }
    if (g) r->be->ops->graph_free(r->be, g);
    qsort(r->ms, (size_t)iters, sizeof(double), cmp_double);
    *us = r->ms[iters / 2];
    return 0;
}

static void print_and_save(const opts *o, int n_sizes, const size_t *bytes, const float (*worst)[N_WAYS]) {
    const double bus = 2.0 * (o->tp - 1) / o->tp;
    printf("all-reduce, fp32 in place, tp %d: median us per op over %d (graphs: %d ops a replay); slowest rank\n",
           o->tp, o->iters, GRAPH_OPS);
    printf("%10s | %10s %10s | %10s %10s | %21s | %21s\n", "bytes", "ours eager", "nccl eager", "ours graph",
           "nccl graph", "busbw GB/s eager o/n", "busbw GB/s graph o/n");
    for (int s = 0; s < n_sizes; s++) {
        const double b = (double)bytes[s];
        printf("%10zu | %10.2f %10.2f | %10.2f %10.2f | %10.1f %10.1f | %10.1f %10.1f\n", bytes[s], worst[s][0],
               worst[s][1], worst[s][2], worst[s][3], bus * b / (worst[s][0] * 1e3), bus * b / (worst[s][1] * 1e3),
               bus * b / (worst[s][2] * 1e3), bus * b / (worst[s][3] * 1e3));
    }
    if (o->tp == 1) printf("(tp 1: the all-reduce moves no data, so bus bandwidth is 0; latency is the call's floor)\n");
    fflush(stdout);
    if (!o->json) return;
    FILE *f = fopen(o->json, "w");
    if (!f) {
        fprintf(stderr, "tp_bench: cannot write %s\n", o->json);
        return;
    }
    int nv = 0;
    ncclGetVersion(&nv);
    fprintf(f, "{\"bench\":\"tp_bench\",\"tp\":%d,\"iters\":%d,\"graph_ops\":%d,\"nccl_version\":%d,\"rows\":[", o->tp,
            o->iters, GRAPH_OPS, nv);
    for (int s = 0; s < n_sizes; s++) {
        fprintf(f, "%s\n {\"bytes\":%zu", s ? "," : "", bytes[s]);
        for (int w = 0; w < N_WAYS; w++) {
            if (isnan(worst[s][w])) {
                fprintf(f, ",\"%s_us\":null,\"%s_busbw_gbs\":null,\"%s_algbw_gbs\":null", g_way[w], g_way[w], g_way[w]);
                continue;
            }
            fprintf(f, ",\"%s_us\":%.3f,\"%s_busbw_gbs\":%.3f,\"%s_algbw_gbs\":%.3f", g_way[w], worst[s][w], g_way[w],
                    bus * (double)bytes[s] / (worst[s][w] * 1e3), g_way[w], (double)bytes[s] / (worst[s][w] * 1e3));
        }
        fprintf(f, "}");
    }
    fprintf(f, "\n]}\n");
    fclose(f);
    printf("wrote %s\n", o->json);
}

/* One rank's whole run; the process's exit status. */
static int rank_main(int rank, const opts *o, const char *group) {
    g_rank = rank;
    mt_error err = {{0}};
    mt_comm *host = mt_comm_host_new(group, rank, o->tp, NULL, &err);
    if (!host) {
        fprintf(stderr, "tp_bench rank %d: %s\n", rank, err.msg);
        return 1;
    }
    /* Rank 0 makes both ids and hands them out, as the launcher would. */
    char hex[2][MT_COMM_NCCL_ID_HEX] = {{0}};
    if (rank == 0)
        for (int i = 0; i < 2; i++)
            if (mt_comm_nccl_id_new(hex[i], sizeof hex[i], &err) != MT_OK) {
                fprintf(stderr, "tp_bench: %s\n", err.msg);
                return 1;
            }
    MK(mt_comm_broadcast(host, hex, sizeof hex, 0), host);
    mt_comm_nccl_id id[2];
    for (int i = 0; i < 2; i++)
        if (mt_comm_nccl_id_parse(hex[i], &id[i], &err) != MT_OK) {
            fprintf(stderr, "tp_bench rank %d: %s\n", rank, err.msg);
            return 1;
        }
    int devices = 0;
    CK(cudaGetDeviceCount(&devices));
    if (devices < o->tp) {
        if (rank == 0) fprintf(stderr, "tp_bench: --tp %d needs %d GPUs, %d visible\n", o->tp, o->tp, devices);
        return 1;
    }

    rank_ctx r = {.host = host};
    if (!(r.be = mt_cuda_backend_new(rank, NULL, &err))) {
        fprintf(stderr, "tp_bench rank %d: %s\n", rank, err.msg);
        return 1;
    }
    r.stream = mt_cuda_backend_stream(r.be);
    if (!(r.ours = mt_comm_nccl_new(&id[0], rank, o->tp, r.be, NULL, &err))) {
        fprintf(stderr, "tp_bench rank %d: %s\n", rank, err.msg);
        return 1;
    }
    ncclUniqueId uid;
    memcpy(uid.internal, id[1].bytes, sizeof uid.internal);
    NK(ncclCommInitRank(&r.ref, o->tp, uid, rank));
    if (!(r.buf = (float *)r.be->ops->alloc(r.be, o->max_bytes))) {
        fprintf(stderr, "tp_bench rank %d: no room for %zu bytes\n", rank, o->max_bytes);
        return 1;
    }
    CK(cudaEventCreate(&r.e0));
    CK(cudaEventCreate(&r.e1));
    if (!(r.ms = (double *)calloc((size_t)o->iters, sizeof(double)))) return 1;

    size_t bytes[MAX_SIZES];
    float worst[MAX_SIZES][N_WAYS];
    int n_sizes = 0;
    for (size_t b = o->min_bytes; b <= o->max_bytes && n_sizes < MAX_SIZES; b *= 2) {
        float mine[N_WAYS], all[MT_COMM_HOST_MAX_RANKS * N_WAYS];
        for (int w = 0; w < N_WAYS; w++) {
            MK(mt_comm_barrier(host), host); /* the ranks start each measurement together */
            double us = 0;
            if (time_way(&r, w, b / sizeof(float), o->iters, &us)) return 1;
            mine[w] = (float)us;
        }
        MK(mt_comm_all_gather(host, mine, all, N_WAYS), host);
        bytes[n_sizes] = b;
        for (int w = 0; w < N_WAYS; w++) {
            worst[n_sizes][w] = 0;
            for (int q = 0; q < o->tp; q++) {
                const float v = all[q * N_WAYS + w];
                if (isnan(v) || v > worst[n_sizes][w]) worst[n_sizes][w] = v;
                if (isnan(v)) break;
            }
        }
        n_sizes++;
    }
    if (rank == 0) print_and_save(o, n_sizes, bytes, (const float (*)[N_WAYS])worst);

    MK(mt_comm_barrier(r.ours), r.ours);
    mt_comm_free(r.ours);
    NK(ncclCommDestroy(r.ref));
    r.be->ops->free(r.be, r.buf);
    CK(cudaEventDestroy(r.e0));
    CK(cudaEventDestroy(r.e1));
    free(r.ms);
    mt_backend_free(r.be);
    mt_comm_free(host);
    return 0;
}

static size_t parse_bytes(const char *s) {
    char *end = NULL;
    double v = strtod(s, &end);
    if (end && (*end == 'k' || *end == 'K')) v *= 1024;
    else if (end && (*end == 'm' || *end == 'M')) v *= 1024 * 1024;
    return (size_t)v;
}

int main(int argc, char **argv) {
    opts o = {.tp = 1, .iters = 50, .min_bytes = 8 << 10, .max_bytes = 64 << 20, .json = NULL};
    for (int i = 1; i < argc; i++) {
        const bool has = i + 1 < argc;
        if (!strcmp(argv[i], "--tp") && has) o.tp = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--iters") && has) o.iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--min-bytes") && has) o.min_bytes = parse_bytes(argv[++i]);
        else if (!strcmp(argv[i], "--max-bytes") && has) o.max_bytes = parse_bytes(argv[++i]);
        else if (!strcmp(argv[i], "--json") && has) o.json = argv[++i];
        else {
            fprintf(stderr, "usage: tp_bench [--tp N] [--iters K] [--min-bytes B] [--max-bytes B] [--json FILE]\n"
                            "  sizes accept a k or m suffix (KiB, MiB)\n");
            return 2;
        }
    }
    if (o.tp < 1 || o.tp > MT_COMM_HOST_MAX_RANKS || o.iters < 1 || o.min_bytes < 4 || o.min_bytes % 4 ||
        o.max_bytes < o.min_bytes) {
        fprintf(stderr, "tp_bench: bad options (tp %d, iters %d, bytes %zu..%zu: multiples of 4)\n", o.tp, o.iters,
                o.min_bytes, o.max_bytes);
        return 2;
    }
    /* No CUDA call here: the ranks are forked, and a CUDA context does not survive a fork. */
    char group[64];
    snprintf(group, sizeof group, "metrale-tp-bench-%d-%llx", (int)getpid(), (unsigned long long)(mt_now() * 1e9));
    pid_t pids[MT_COMM_HOST_MAX_RANKS];
    for (int r = 0; r < o.tp; r++) {
        fflush(stdout);
        if ((pids[r] = fork()) == 0) _exit(rank_main(r, &o, group));
        if (pids[r] < 0) {
            perror("tp_bench: fork");
            return 1;
        }
    }
    int worst = 0;
    for (int r = 0; r < o.tp; r++) {
        int ws = 0;
        waitpid(pids[r], &ws, 0);
        const int code = WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
        if (code) fprintf(stderr, "tp_bench: rank %d exited with %d\n", r, code);
        if (code > worst) worst = code;
    }
    return worst;
}
