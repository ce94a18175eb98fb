/* bench/bench_util.c: see bench_util.h. */
#include "bench/bench_util.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "worker/dist/comm_host.h"
#include "worker/dist/comm_nccl.h"
#include "worker/loader/glm_manifest.h"
#include "worker/model/glm/glm_model.h"

double bench_copy_bandwidth_gbs(void) {
    const size_t bytes = (size_t)4 << 30;
    void *a = NULL, *b = NULL;
    if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) {
        cudaFree(a);
        return 0;
    }
    cudaMemset(a, 1, bytes);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice); /* warm-up */
    const int reps = 10;
    cudaEventRecord(e0, 0);
    for (int i = 0; i < reps; i++) cudaMemcpy(i & 1 ? a : b, i & 1 ? b : a, bytes, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e1, 0);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFree(a);
    cudaFree(b);
    return 2.0 * bytes * reps / (ms * 1e-3) / 1e9; /* read + write */
}

/* The split tensors by a part of their names (glm_weights.c's bind_layer, bind_mlp, bind_all). */
static const char *const g_split_parts[] = {
    ".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj.", /* KDA: its heads */
    "_conv1d.", ".f_b_proj.", ".g_b_proj.", ".self_attn.b_proj.", ".dt_bias", ".A_log",
    ".q_b_proj.", ".kv_b_proj.",                                         /* MLA: its query heads */
    ".self_attn.o_proj.",                                                /* those heads' columns */
    "gate_proj.", "up_proj.", "down_proj.",                              /* every MLP's intermediate */
    "embed_tokens", "lm_head",                                           /* vocab rows */
};

bool bench_tensor_is_split(const char *name) {
    for (size_t i = 0; i < sizeof g_split_parts / sizeof g_split_parts[0]; i++)
        if (strstr(name, g_split_parts[i])) return true;
    return false;
}

/* The tensors an FP8 checkpoint keeps in FP8 on the GPU (worker/model/glm/glm_weights.c): the KDA
 * q, k, v, o and the DSA q_a, q_b, kv_a, o projections, and every MLP's gate, up and down (dense,
 * shared and routed experts). */
static const char *const g_fp8_parts[] = {
    "self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.", "self_attn.o_proj.", "self_attn.q_a_proj.",
    "self_attn.q_b_proj.", "self_attn.kv_a_proj_with_mqa.", "mlp.gate_proj.", "mlp.up_proj.", "mlp.down_proj.",
    "mlp.shared_experts.", "mlp.experts.",
};

bool bench_tensor_is_fp8(const char *name) {
    for (size_t i = 0; i < sizeof g_fp8_parts / sizeof g_fp8_parts[0]; i++)
        if (strstr(name, g_fp8_parts[i])) return true;
    return false;
}

typedef struct count_ctx {
    const glm_config *c;
    bench_weights *w;
    bool fp8;           /* the FP8-kept tensors at one byte a weight and a scale a 128 x 128 block */
} count_ctx;

static void count_tensor(const glm_tensor_spec *s, void *user) {
    count_ctx *x = user;
    double n = 1;
    for (int i = 0; i < s->ndim; i++) n *= (double)s->shape[i];
    double bytes = n * (double)mt_dtype_size(s->dtype);
    if (x->fp8 && s->ndim == 2 && bench_tensor_is_fp8(s->name))
        bytes = n + 4.0 * (double)((s->shape[0] + 127) / 128) * (double)((s->shape[1] + 127) / 128);
    const bool split = bench_tensor_is_split(s->name);
    if (split) x->w->split_bytes += bytes;
    else x->w->replicated_bytes += bytes;
    if (strstr(s->name, ".mlp.experts.")) {
        /* every (layer, expert) is alike: summed here, divided into one expert's bytes below */
        x->w->touched_params += n * x->c->num_experts_per_tok / x->c->n_routed_experts;
        x->w->expert_bytes += bytes;
    } else if (strstr(s->name, "embed_tokens")) {
        x->w->embed_row_bytes = bytes / (double)s->shape[0];
    } else {
        x->w->dense_bytes += bytes;
        if (split) x->w->dense_split_bytes += bytes;
        else x->w->dense_repl_bytes += bytes;
        x->w->touched_params += n;
        if (strstr(s->name, "lm_head")) x->w->head_params += n;
    }
}

static void count_weights(const glm_config *c, bool fp8, bench_weights *out) {
    memset(out, 0, sizeof *out);
    count_ctx x = { c, out, fp8 };
    glm_manifest_foreach(c, count_tensor, &x);
    int moe_layers = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) moe_layers += c->mlp_layer_types[l] == GLM_MLP_SPARSE;
    if (moe_layers > 0) out->expert_bytes /= (double)moe_layers * c->n_routed_experts;
}

void bench_count_weights(const glm_config *c, bench_weights *out) { count_weights(c, false, out); }

void bench_count_weights_fp8(const glm_config *c, bench_weights *out) { count_weights(c, true, out); }

double bench_kda_state_bytes(const glm_config *c) {
    double b = 0;
    for (int l = 0; l < c->num_hidden_layers; l++)
        if (c->layer_types[l] == GLM_MIXER_KDA) b += 2.0 * c->linear_num_heads * (double)c->linear_head_dim * c->linear_head_dim * 4;
    return b;
}

double bench_dsa_cache_bytes(const glm_config *c, int len) {
    double b = 0;
    const int max_sel = c->index_topk + (c->index_kpool_always_select_tail ? c->index_kpool - 1 : 0);
    for (int l = 0; l < c->num_hidden_layers; l++) {
        if (c->layer_types[l] == GLM_MIXER_KDA) continue;
        const int rows = len + 1 < max_sel ? len + 1 : max_sel;
        b += (double)rows * c->kv_lora_rank * 4;                                 /* attended latent rows */
        if (c->indexer_types[l] == GLM_INDEXER_FULL)
            b += (double)((len + 1) / c->index_kpool) * c->index_head_dim * 4; /* pool keys scored */
    }
    return b;
}

double bench_rank_step_bytes(const bench_weights *w, int tp, int B, double experts_touched, double kda_row,
                             double dsa_row) {
    const double N = tp;
    return w->dense_repl_bytes + w->dense_split_bytes / N + B * w->embed_row_bytes / N +
           experts_touched * w->expert_bytes / N + B * (kda_row / N + dsa_row);
}

double bench_decode_ahead(const bench_rank *r, glm_model *m, glm_seq **s, int32_t *tok, int B, int steps) {
    if (glm_model_ahead_rows(m) < B || steps < 1) return bench_decode_steps(r, m, s, tok, B, steps);
    mt_backend *be = r->be;
    mt_error err = { "" };
    int64_t prev = -1, next = -1;
    bench_sync(r);
    const double a = mt_now();
    mt_status st = glm_decode_greedy(m, s, tok, B, &prev, &err);
    for (int i = 1; i < steps && st == MT_OK; i++) {
        st = glm_decode_greedy(m, s, NULL, B, &next, &err); /* step i on step i - 1's device tokens */
        if (st == MT_OK) st = glm_greedy_tokens(m, prev, tok, B);
        prev = next;
    }
    if (st == MT_OK) st = glm_greedy_tokens(m, prev, tok, B);
    if (st != MT_OK) {
        fprintf(stderr, "bench rank %d: %s\n", r->rank, err.msg[0] ? err.msg : mt_status_str(st));
        exit(1);
    }
    be->ops->sync(be);
    return (mt_now() - a) * 1e3 / steps;
}

double bench_decode_steps(const bench_rank *r, glm_model *m, glm_seq **s, int32_t *tok, int B, int steps) {
    mt_backend *be = r->be;
    mt_error err = { "" };
    bench_sync(r);
    const double a = mt_now();
    for (int i = 0; i < steps; i++)
        if (glm_decode_multi(m, s, tok, B, NULL, &err) != MT_OK || glm_last_argmax(m, B, tok) != MT_OK) {
            fprintf(stderr, "bench rank %d: %s\n", r->rank, err.msg);
            exit(1);
        }
    be->ops->sync(be);
    return (mt_now() - a) * 1e3 / steps;
}

/* ---- the group ---- */

static void group_failed(const bench_rank *r, const char *what, const mt_comm *c) {
    fprintf(stderr, "bench rank %d: %s: %s\n", r->rank, what, c->err.msg[0] ? c->err.msg : "the group failed");
    exit(1);
}

void bench_sync(const bench_rank *r) {
    r->be->ops->sync(r->be);
    if (r->host && mt_comm_barrier(r->host) != MT_OK) group_failed(r, "barrier", r->host);
}

void bench_agree(const bench_rank *r, void *buf, size_t bytes) {
    if (r->host && mt_comm_broadcast(r->host, buf, bytes, 0) != MT_OK) group_failed(r, "broadcast", r->host);
}

/* One step's collectives, as the model calls them (see the header); the count of calls. */
static int comm_step_calls(mt_comm *comm, float *send, float *recv, const glm_config *c, const int *rows,
                           int n_pass, mt_status *st) {
    const size_t H = (size_t)c->hidden_size, S = (size_t)c->hc_mult, vn = (size_t)c->vocab_size / (size_t)comm->size;
    const bool tp = comm->size > 1;
    int calls = 0;
    *st = MT_OK;
    for (int p = 0; p < n_pass && *st == MT_OK; p++) {
        const size_t B = (size_t)rows[p];
        if (tp) *st = mt_comm_all_reduce_sum(comm, send, B * S * H), calls++;       /* embed_reduce */
        for (int l = 0; l < 2 * c->num_hidden_layers && *st == MT_OK; l++)
            *st = mt_comm_all_reduce_sum(comm, send, B * H), calls++;               /* mixer's, MLP's */
        if (tp && *st == MT_OK) *st = mt_comm_all_gather(comm, send, recv, B * vn), calls++; /* the head */
    }
    return calls;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double bench_comm_step_ms(const bench_rank *r, const glm_config *c, const int *rows, int n_pass, int *calls) {
    enum { ROUNDS = 5, REPLAYS = 20 };
    *calls = 0;
    if (!r->comm || n_pass < 1) return -1;
    mt_backend *be = r->be;
    mt_comm *comm = r->comm;
    size_t send_n = 1, recv_n = 1;
    for (int p = 0; p < n_pass; p++) {
        const size_t B = (size_t)rows[p], a = B * (size_t)c->hc_mult * c->hidden_size;
        const size_t g = B * (size_t)(c->vocab_size / comm->size);
        if (a > send_n) send_n = a;
        if (g > send_n) send_n = g;
        if (g * (size_t)comm->size > recv_n) recv_n = g * (size_t)comm->size;
    }
    float *send = be->ops->alloc(be, sizeof(float) * send_n), *recv = be->ops->alloc(be, sizeof(float) * recv_n);
    /* every rank goes on or none does: a lone rank's collectives would wait for the others */
    float failed = !send || !recv;
    if (r->host && mt_comm_all_reduce_sum(r->host, &failed, 1) != MT_OK) group_failed(r, "all-reduce", r->host);
    mt_status st = MT_OK;
    for (int w = 0; w < 2 && !failed && st == MT_OK; w++) *calls = comm_step_calls(comm, send, recv, c, rows, n_pass, &st);
    if (st != MT_OK) group_failed(r, "collective", comm);
    mt_graph *g = NULL;
    if (!failed && be->ops->graph_begin && be->ops->graph_begin(be) == MT_OK) {
        comm_step_calls(comm, send, recv, c, rows, n_pass, &st);
        if (be->ops->graph_end(be, &g) != MT_OK || st != MT_OK) g = NULL;
    }
    failed = failed || !g;
    if (r->host && mt_comm_all_reduce_sum(r->host, &failed, 1) != MT_OK) group_failed(r, "all-reduce", r->host);
    double ms = -1;
    if (!failed) {
        cudaStream_t stream = (cudaStream_t)mt_cuda_backend_stream(be);
        cudaEvent_t e0 = NULL, e1 = NULL;
        double round_ms[ROUNDS];
        bool ok = cudaEventCreate(&e0) == cudaSuccess && cudaEventCreate(&e1) == cudaSuccess;
        /* the events fail alike on every rank or the replays below go on without them */
        for (int k = -1; k < ROUNDS; k++) {
            if (mt_comm_check(comm) != MT_OK) group_failed(r, "replay", comm);
            bench_sync(r);
            if (ok) ok = cudaEventRecord(e0, stream) == cudaSuccess;
            for (int i = 0; i < REPLAYS; i++)
                if (be->ops->graph_launch(be, g) != MT_OK) group_failed(r, "graph replay", comm);
            if (ok) ok = cudaEventRecord(e1, stream) == cudaSuccess && cudaEventSynchronize(e1) == cudaSuccess;
            float t = 0;
            if (ok) ok = cudaEventElapsedTime(&t, e0, e1) == cudaSuccess;
            if (k >= 0) round_ms[k] = (double)t / REPLAYS;
        }
        be->ops->sync(be);
        if (ok) {
            qsort(round_ms, ROUNDS, sizeof(double), cmp_double);
            ms = round_ms[ROUNDS / 2];
        }
        if (e0) cudaEventDestroy(e0);
        if (e1) cudaEventDestroy(e1);
    }
    if (g) be->ops->graph_free(be, g);
    be->ops->free(be, send);
    be->ops->free(be, recv);
    return ms;
}

/* A group name no other live group has: random bits (runs in other containers may share
 * /dev/shm, but not the pid namespace). */
static void group_name(char *out, size_t n) {
    unsigned long long x = 0;
    if (getrandom(&x, sizeof x, GRND_NONBLOCK) != (ssize_t)sizeof x)
        x = (unsigned long long)(mt_now() * 1e9) ^ ((unsigned long long)getpid() << 32);
    snprintf(out, n, "metrale-bench-%016llx", x);
}

/* One rank's run: the group, fn, and the group's teardown; the exit status. */
static int rank_run(const char *prog, const char *group, int rank, int tp, const mt_cuda_params *cp, bench_rank_fn fn,
                    void *user) {
    bench_rank r = { .rank = rank, .size = tp > 0 ? tp : 1 };
    mt_error err = { "" };
    char hex[MT_COMM_NCCL_ID_HEX] = { 0 };
    mt_comm_nccl_id id;
    int rc = 1;
    if (tp == 0) { /* no group */
        if (!(r.be = mt_cuda_backend_new(0, cp, &err))) {
            fprintf(stderr, "%s: %s\n", prog, err.msg);
            return 1;
        }
        rc = fn(&r, user);
        mt_backend_free(r.be);
        return rc;
    }
    mt_comm_host_params hp = mt_comm_host_default_params();
    hp.timeout_s = 600; /* between barriers the ranks run the same work; a dead peer is seen at once */
    if (!(r.host = mt_comm_host_new(group, rank, tp, &hp, &err))) {
        fprintf(stderr, "%s rank %d: %s\n", prog, rank, err.msg);
        return 1;
    }
    int devices = 0;
    const cudaError_t ce = cudaGetDeviceCount(&devices);
    if (ce != cudaSuccess || devices < tp) {
        if (rank == 0) {
            if (ce != cudaSuccess) fprintf(stderr, "%s: --tp %d: no usable GPU (%s)\n", prog, tp, cudaGetErrorString(ce));
            else fprintf(stderr, "%s: --tp %d needs %d GPUs (one a rank), %d visible\n", prog, tp, tp, devices);
        }
        goto out;
    }
    /* rank 0 makes the NCCL id and hands it out, as a launcher would; an empty id: it failed */
    if (rank == 0 && mt_comm_nccl_id_new(hex, sizeof hex, &err) != MT_OK) {
        fprintf(stderr, "%s: %s\n", prog, err.msg);
        hex[0] = 0;
    }
    if (mt_comm_broadcast(r.host, hex, sizeof hex, 0) != MT_OK) {
        fprintf(stderr, "%s rank %d: handing out the NCCL id: %s\n", prog, rank, r.host->err.msg);
        goto out;
    }
    if (!hex[0] || mt_comm_nccl_id_parse(hex, &id, &err) != MT_OK) {
        if (hex[0]) fprintf(stderr, "%s rank %d: %s\n", prog, rank, err.msg);
        goto out;
    }
    if (!(r.be = mt_cuda_backend_new(rank, cp, &err))) {
        fprintf(stderr, "%s rank %d: %s\n", prog, rank, err.msg);
        goto out;
    }
    if (!(r.comm = mt_comm_nccl_new(&id, rank, tp, r.be, NULL, &err))) {
        fprintf(stderr, "%s rank %d: %s\n", prog, rank, err.msg);
        goto out;
    }
    rc = fn(&r, user);
    if (rc == 0) { /* no rank frees its communicator while a peer may still use it */
        r.be->ops->sync(r.be);
        if (mt_comm_barrier(r.host) != MT_OK) {
            fprintf(stderr, "%s rank %d: the final barrier: %s\n", prog, rank, r.host->err.msg);
            rc = 1;
        }
    }
out:
    mt_comm_free(r.comm);
    mt_backend_free(r.be);
    mt_comm_free(r.host);
    return rc;
}

/* The GPUs a process sees, counted in a child of its own (this process must make no CUDA call
 * before it forks the ranks); -1 when the child could not tell. */
static int visible_gpus(void) {
    fflush(NULL);
    const pid_t p = fork();
    if (p == 0) {
        int n = 0;
        _exit(cudaGetDeviceCount(&n) == cudaSuccess ? (n < 200 ? n : 200) : 255);
    }
    int ws = 0;
    if (p < 0 || waitpid(p, &ws, 0) != p || !WIFEXITED(ws) || WEXITSTATUS(ws) == 255) return -1;
    return WEXITSTATUS(ws);
}

int bench_run_ranks(const char *prog, int tp, const mt_cuda_params *cp, bench_rank_fn fn, void *user) {
    if (tp < 0 || tp > MT_COMM_HOST_MAX_RANKS) {
        fprintf(stderr, "%s: --tp %d: 1 to %d ranks\n", prog, tp, MT_COMM_HOST_MAX_RANKS);
        return 2;
    }
    char group[64];
    group_name(group, sizeof group);
    if (tp <= 1) return rank_run(prog, group, 0, tp, cp, fn, user);
    /* No CUDA call here: the ranks are forked, and a CUDA context does not survive a fork. */
    const int gpus = visible_gpus();
    if (gpus >= 0 && gpus < tp) { /* -1: each rank checks for itself */
        fprintf(stderr, "%s: --tp %d needs %d GPUs (one a rank), %d visible\n", prog, tp, tp, gpus);
        return 2;
    }
    pid_t pids[MT_COMM_HOST_MAX_RANKS];
    int started = 0, worst = 0;
    fflush(NULL);
    for (; started < tp; started++) {
        const pid_t p = fork();
        if (p == 0) {
            if (started > 0) {
                if (!freopen("/dev/null", "w", stdout)) fprintf(stderr, "%s rank %d: stdout stays open\n", prog, started);
                mt_log_set_level(MT_LOG_WARN);
            }
            const int rc = rank_run(prog, group, started, tp, cp, fn, user);
            fflush(NULL);
            _exit(rc);
        }
        if (p < 0) {
            perror("fork");
            worst = 1;
            break;
        }
        pids[started] = p;
    }
    /* Reap the ranks; the first that fails ends the others, which would wait on it, and its exit
     * status is returned. */
    int left = started;
    bool ended = worst != 0;
    if (ended)
        for (int i = 0; i < started; i++) kill(pids[i], SIGTERM);
    while (left > 0) {
        int ws = 0;
        const pid_t p = waitpid(-1, &ws, 0);
        if (p < 0) break;
        int rank = -1;
        for (int i = 0; i < started; i++)
            if (pids[i] == p) rank = i, pids[i] = 0;
        if (rank < 0) continue;
        left--;
        const int code = WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
        if (code && !ended) { /* its status is the run's: the others' are from being ended */
            fprintf(stderr, "%s: rank %d exited with %d; ending the other ranks\n", prog, rank, code);
            for (int i = 0; i < started; i++)
                if (pids[i] > 0) kill(pids[i], SIGTERM);
            ended = true;
            worst = code;
        }
    }
    return worst;
}

bool bench_take_flag(int *argc, char **argv, const char *name) {
    bool found = false;
    int k = 1;
    for (int i = 1; i < *argc; i++) {
        if (!strcmp(argv[i], name)) found = true;
        else argv[k++] = argv[i];
    }
    *argc = k;
    argv[k] = NULL;
    return found;
}

int bench_parse_ints(const char *s, int *out, int max) {
    int n = 0;
    while (*s && n < max) {
        out[n++] = atoi(s);
        const char *c = strchr(s, ',');
        if (!c) break;
        s = c + 1;
    }
    return n;
}

double bench_experts_touched(const glm_config *c, int n) {
    const double E = c->n_routed_experts;
    if (E <= 0) return 0;
    return E * (1.0 - pow(1.0 - c->num_experts_per_tok / E, n));
}

/* ---- cuBLAS on the prefill's GEMM shapes ---- */

enum { GEMM_SHAPES = 64 };

typedef struct gemm_shape {
    int M, N, K;   /* y [M, N] = x [M, K] w[N, K]^T */
    int count;     /* GEMMs of this shape in one prefill */
} gemm_shape;

typedef struct shape_ctx {
    const glm_config *c;
    int n;
    gemm_shape s[GEMM_SHAPES];
    int ns;
    bool overflow;
} shape_ctx;

static void add_shape(shape_ctx *x, int M, int N, int K, int count) {
    for (int i = 0; i < x->ns; i++)
        if (x->s[i].M == M && x->s[i].N == N && x->s[i].K == K) {
            x->s[i].count += count;
            return;
        }
    if (x->ns == GEMM_SHAPES) {
        x->overflow = true;
        return;
    }
    x->s[x->ns++] = (gemm_shape){ M, N, K, count };
}

static void shape_tensor(const glm_tensor_spec *s, void *user) {
    shape_ctx *x = user;
    if (!s->linear || s->ndim != 2 || s->dtype != MT_BF16 || strstr(s->name, "embed_tokens")) return;
    const int N = (int)s->shape[0], K = (int)s->shape[1];
    if (strstr(s->name, ".mlp.experts.")) {
        const int E = x->c->n_routed_experts, rows = (int)(((int64_t)x->n * x->c->num_experts_per_tok + E - 1) / E);
        add_shape(x, rows, N, K, 1);
    } else {
        add_shape(x, strstr(s->name, "lm_head") ? 1 : x->n, N, K, 1);
    }
}

/* Median ms of one GEMM of shape g, the weight cycled through `copies` buffers. */
static double time_shape(cublasHandle_t h, const gemm_shape *g, void *x, void *const *w, int copies, float *y) {
    const float one = 1.f, zero = 0.f;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    enum { REPS = 7 };
    double best[REPS];
    int ok = 0;
    for (int r = 0; r < REPS; r++) {
        const int calls = copies;
        cudaEventRecord(e0, 0);
        for (int i = 0; i < calls; i++)
            if (cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, g->N, g->M, g->K, &one, w[i % copies], CUDA_R_16BF, g->K, x,
                             CUDA_R_16BF, g->K, &zero, y, CUDA_R_32F, g->N, CUBLAS_COMPUTE_32F,
                             CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
                goto out;
        cudaEventRecord(e1, 0);
        cudaEventSynchronize(e1);
        float ms = 0;
        cudaEventElapsedTime(&ms, e0, e1);
        best[ok++] = ms / calls;
    }
out:
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    if (ok < REPS) return -1;
    for (int i = 1; i < REPS; i++) /* insertion sort, for the median */
        for (int j = i; j > 0 && best[j] < best[j - 1]; j--) {
            const double t = best[j];
            best[j] = best[j - 1];
            best[j - 1] = t;
        }
    return best[REPS / 2];
}

enum { COPIES_BYTES = 256 << 20, COPIES_MAX = 64 }; /* well past the 50 MB of L2 */

/* Zeroed copies of a wb-byte weight in w[COPIES_MAX], as many as stream COPIES_BYTES (at least
 * one, at most COPIES_MAX; fewer where device memory runs out), so timed GEMMs that take them in
 * turn read each from memory, not L2. Returns how many were made; free them with free_copies. */
static int weight_copies(size_t wb, void **w) {
    int copies = (int)((COPIES_BYTES + wb - 1) / wb);
    copies = copies < 1 ? 1 : copies > COPIES_MAX ? COPIES_MAX : copies;
    int made = 0;
    while (made < copies && cudaMalloc(&w[made], wb) == cudaSuccess) cudaMemset(w[made++], 0, wb);
    return made;
}

static void free_copies(void **w, int made) {
    for (int j = 0; j < made; j++) cudaFree(w[j]);
}

double bench_cublas_prefill_ms(const glm_config *c, int n, double *flops) {
    shape_ctx x = { .c = c, .n = n };
    glm_manifest_foreach(c, shape_tensor, &x);
    *flops = 0;
    if (x.overflow) return -1;
    size_t xmax = 0, ymax = 0;
    for (int i = 0; i < x.ns; i++) {
        const size_t xs = (size_t)x.s[i].M * x.s[i].K * 2, ys = (size_t)x.s[i].M * x.s[i].N * 4;
        xmax = xs > xmax ? xs : xmax;
        ymax = ys > ymax ? ys : ymax;
    }
    cublasHandle_t h;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) return -1;
    void *xb = NULL, *yb = NULL;
    double total = 0;
    if (cudaMalloc(&xb, xmax) != cudaSuccess || cudaMalloc(&yb, ymax) != cudaSuccess) total = -1;
    if (total == 0) cudaMemset(xb, 0, xmax);
    for (int i = 0; i < x.ns && total >= 0; i++) {
        const gemm_shape *g = &x.s[i];
        void *w[COPIES_MAX] = { 0 };
        const int made = weight_copies((size_t)g->N * g->K * 2, w);
        const double ms = made > 0 ? time_shape(h, g, xb, w, made, yb) : -1;
        free_copies(w, made);
        if (ms < 0) {
            total = -1;
            break;
        }
        total += ms * g->count;
        *flops += 2.0 * g->M * (double)g->N * g->K * g->count;
    }
    cudaFree(xb);
    cudaFree(yb);
    cublasDestroy(h);
    return total;
}

/* ---- cuBLASLt's block-scaled FP8 GEMM on the same shapes ---- */

/* The median ms of one block-scaled FP8 GEMM of shape g as the CUDA backend runs it (TN: the
 * weight [N, K] e4m3 transposed with 128 x 128 block scales, x [M, K] e4m3 with 1 x 128 scales,
 * fp32 accumulation, fp32 output or bf16 where cuBLASLt offers no fp32; M rounded up to 4, N to
 * 128, K to 512 as kernels/cuda/cuda_fp8.cu pads them), the weight cycled through `copies`
 * buffers; -1 when cuBLASLt has no algorithm or fails. */
static double time_shape_fp8(cublasLtHandle_t lt, const gemm_shape *g, void *x, const float *xs, void *const *w,
                             const float *ws, int copies, void *y, void *wsp, size_t wsp_bytes) {
    const int M = (g->M + 3) / 4 * 4, N = (g->N + 127) / 128 * 128, K = (g->K + 511) / 512 * 512;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const int32_t amode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, bmode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    const uint64_t wsb = wsp_bytes;
    double result = -1;
    for (int d = 0; d < 2 && result < 0; d++) {
        const cudaDataType_t dt = d == 0 ? CUDA_R_32F : CUDA_R_16BF;
        cublasLtMatmulDesc_t op = NULL;
        cublasLtMatrixLayout_t la = NULL, lb = NULL, ld = NULL;
        cublasLtMatmulPreference_t pref = NULL;
        cublasLtMatmulHeuristicResult_t res;
        int found = 0;
        bool ok = cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) == CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb) == CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &amode, sizeof amode) ==
                      CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bmode, sizeof bmode) ==
                      CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ws, sizeof ws) ==
                      CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &xs, sizeof xs) ==
                      CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, K, N, K) == CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, K, M, K) == CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatrixLayoutCreate(&ld, dt, N, M, N) == CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb) ==
                      CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, 1, &res, &found) == CUBLAS_STATUS_SUCCESS &&
                  found > 0;
        const float one = 1.f, zero = 0.f;
        enum { REPS = 7 };
        double best[REPS];
        int done = 0;
        cudaEvent_t e0 = NULL, e1 = NULL;
        if (ok && (cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess)) ok = false;
        for (int r = 0; ok && r < REPS; r++) {
            cudaEventRecord(e0, 0);
            for (int i = 0; ok && i < copies; i++)
                ok = cublasLtMatmul(lt, op, &one, w[i], la, x, lb, &zero, y, ld, y, ld, &res.algo, wsp, wsp_bytes, 0) ==
                     CUBLAS_STATUS_SUCCESS;
            cudaEventRecord(e1, 0);
            cudaEventSynchronize(e1);
            float ms = 0;
            cudaEventElapsedTime(&ms, e0, e1);
            if (ok) best[done++] = ms / copies;
        }
        if (e0) cudaEventDestroy(e0);
        if (e1) cudaEventDestroy(e1);
        if (ok && done == REPS) {
            for (int i = 1; i < REPS; i++) /* insertion sort, for the median */
                for (int j = i; j > 0 && best[j] < best[j - 1]; j--) {
                    const double t = best[j];
                    best[j] = best[j - 1];
                    best[j - 1] = t;
                }
            result = best[REPS / 2];
        }
        if (pref) cublasLtMatmulPreferenceDestroy(pref);
        if (ld) cublasLtMatrixLayoutDestroy(ld);
        if (lb) cublasLtMatrixLayoutDestroy(lb);
        if (la) cublasLtMatrixLayoutDestroy(la);
        if (op) cublasLtMatmulDescDestroy(op);
    }
    return result;
}

/* A device buffer of count floats, every one 1 (the scales of zero data); NULL on failure. */
static float *ones_dev(size_t count) {
    float *h = malloc(sizeof(float) * (count ? count : 1)), *d = NULL;
    if (!h) return NULL;
    for (size_t i = 0; i < count; i++) h[i] = 1.f;
    if (cudaMalloc((void **)&d, sizeof(float) * (count ? count : 1)) != cudaSuccess ||
        cudaMemcpy(d, h, sizeof(float) * count, cudaMemcpyHostToDevice) != cudaSuccess) {
        cudaFree(d);
        d = NULL;
    }
    free(h);
    return d;
}

double bench_cublaslt_fp8_prefill_ms(const glm_config *c, int n, double *flops) {
    shape_ctx x = { .c = c, .n = n };
    glm_manifest_foreach(c, shape_tensor, &x);
    *flops = 0;
    if (x.overflow) return -1;
    size_t xmax = 0, ymax = 0, xsmax = 0, wsmax = 0;
    for (int i = 0; i < x.ns; i++) {
        const size_t M = (size_t)(x.s[i].M + 3) / 4 * 4, N = (size_t)(x.s[i].N + 127) / 128 * 128,
                     K = (size_t)(x.s[i].K + 511) / 512 * 512;
        xmax = M * K > xmax ? M * K : xmax;
        ymax = M * N * 4 > ymax ? M * N * 4 : ymax;
        xsmax = K / 128 * M > xsmax ? K / 128 * M : xsmax;
        wsmax = K / 128 * (N / 128) > wsmax ? K / 128 * (N / 128) : wsmax;
    }
    cublasLtHandle_t lt;
    if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) return -1;
    const size_t wsp_bytes = (size_t)32 << 20;
    void *xb = NULL, *yb = NULL, *wsp = NULL;
    float *xs = ones_dev(xsmax), *ws = ones_dev(wsmax);
    double total = 0;
    if (!xs || !ws || cudaMalloc(&xb, xmax) != cudaSuccess || cudaMalloc(&yb, ymax) != cudaSuccess ||
        cudaMalloc(&wsp, wsp_bytes) != cudaSuccess)
        total = -1;
    if (total == 0) cudaMemset(xb, 0, xmax);
    for (int i = 0; i < x.ns && total >= 0; i++) {
        const gemm_shape *g = &x.s[i];
        void *w[COPIES_MAX] = { 0 };
        const int made = weight_copies((size_t)(g->N + 127) / 128 * 128 * ((size_t)(g->K + 511) / 512 * 512), w);
        const double ms = made > 0 ? time_shape_fp8(lt, g, xb, xs, w, ws, made, yb, wsp, wsp_bytes) : -1;
        free_copies(w, made);
        if (ms < 0) {
            total = -1;
            break;
        }
        total += ms * g->count;
        *flops += 2.0 * g->M * (double)g->N * g->K * g->count;
    }
    cudaFree(xb);
    cudaFree(yb);
    cudaFree(wsp);
    cudaFree(xs);
    cudaFree(ws);
    cublasLtDestroy(lt);
    return total;
}
