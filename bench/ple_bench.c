/* bench/ple_bench.c: what PLE memories (docs/MODEL.md "PLE layer") add to a decode step. In one
 * run on one GPU, bench-4L (real per-layer shapes, random bf16 weights made on the GPU) decodes B
 * sequences at once, greedy and run ahead with the bucket graphs as the engine runs greedy
 * batches (glm_decode_greedy), in these variants of the same model:
 *   - base: no memory;
 *   - ple: memories on --ple-layers (default 0 and 3: a KDA and the DSA layer) whose n-gram
 *     tables, --table-gb in all (default 12), lie in page-locked host memory, hashed and gathered
 *     on the device from the step's ids (the defaults of the runtime);
 *   - with --device-table: the same tables in device memory (the bus's share of the cost);
 *   - with --host-gather: every row hashed on the host and gathered before the step (the
 *     prestage path; greedy decode then does not run ahead of the host).
 * For each batch: ms a step with the graphs (and eagerly), the time the memories add against
 * base, and how much of the gather overlaps other GPU work, measured two ways:
 *   - serial: one more eager step of base and ple with every op synchronised and timed
 *     (mt_cuda_profile): the gather's own time there (ple_gather_rows) and the time every op
 *     the memories add takes (ple's total less base's); what of that serial sum the graph step
 *     does not show, (serial added - graph added) / gather, clamped to [0, 1]. The serial times
 *     carry a synchronisation an op, so this is an upper bound;
 *   - the bus: the gathers of a step alone (ple_gather_rows for B rows, once a memory layer, 200
 *     steps back to back between two events) from a table of one layer's size in page-locked
 *     host memory and in device memory; their difference is what reading over the bus costs
 *     the gather alone, and with --device-table, 1 - (ple - ple with the table on the device) /
 *     that difference is the share of the bus's cost the graph step hides.
 * The gather is a plain launch between the step's kernels, so near 0 is what the design
 * predicts for both. The tables are filled on the host by 16 threads (some seconds for tens of
 * GB) and locked in place (cudaHostRegister) before the first step.
 * Prints two tables and writes them as JSON (--json FILE). Needs host memory for the tables
 * (--table-gb, and one layer's share again for the bus measurement) and, with --device-table,
 * device memory for them beside bench-4L.
 *
 *   ple_bench [--batches 1,64] [--prompt 64] [--steps 32] [--table-gb 12] [--ple-layers 0,3]
 *             [--device-table] [--host-gather] [--numerics exact|bf16|fp32] [--json FILE]
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench_util.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "worker/loader/glm_config.h"
#include "worker/model/glm/glm_model.h"

#define MAX_BATCHES 8
#define MAX_PLE 8

enum { V_BASE, V_PLE, V_DEVICE_TABLE, V_HOST_GATHER, V_N };
static const char *const variant_name[V_N] = { "base", "ple", "ple, table on the device", "ple, host gather" };

typedef struct ple_opts {
    int batches[MAX_BATCHES], nb, prompt, steps;
    int ple_layers[MAX_PLE], nl;
    double table_gb;
    bool device_table, host_gather;
    const char *json;
    mt_cuda_params cp;
} ple_opts;

/* One variant at one batch size. */
typedef struct step_result {
    bool ran;
    double graph_ms, eager_ms;
    int graphed;
    double serial_ms;          /* one eager step, every op synchronised: the sum of the ops */
    double gather_ms;          /* of which ple_gather_rows */
    double inject_ms;          /* of which ple_inject */
} step_result;

/* bench-4L with memories on o's layers, of the default shape (glm_config_default: orders 2..3,
 * 8 heads of 64, conv kernel 4), their tables table_gb in all (each table of a layer's
 * (N-1) x heads the same size, rounded to primes by the model). */
static int ple_config(const ple_opts *o, glm_config *c, mt_error *err) {
    if (glm_config_preset("bench-4L", c, err) != MT_OK) return 1;
    const double per_table = o->table_gb * 1e9 / o->nl / ((c->ple_max_ngram - 1) * c->ple_heads) / (c->ple_head_dim * 2.0);
    for (int k = 0; k < c->ple_max_ngram - 1; k++) c->ple_table_sizes[k] = (int)per_table;
    for (int i = 0; i < o->nl; i++) {
        if (o->ple_layers[i] < 0 || o->ple_layers[i] >= c->num_hidden_layers) {
            fprintf(stderr, "ple_bench: --ple-layers: layer %d of %d\n", o->ple_layers[i], c->num_hidden_layers);
            return 1;
        }
        c->ple_layer[o->ple_layers[i]] = true;
    }
    return glm_config_validate(c, err) == MT_OK ? 0 : 1;
}

/* The op time of `name` in a profile's rows (0 when absent). */
static double op_ms(const mt_cuda_op_time *rows, int n, const char *name) {
    for (int i = 0; i < n; i++)
        if (!strcmp(rows[i].name, name)) return rows[i].ms;
    return 0;
}

/* ms of one step's gathers alone: nl calls of ple_gather_rows for B rows (histories advancing,
 * ids drawn anew each step), 200 steps back to back between two events, after 10 unmeasured. The
 * table is one memory's size (c's first PLE layer), in page-locked host memory or on the device. */
static double gather_alone_ms(mt_backend *be, const glm_config *c, int layer, int nl, int B, bool host) {
    mt_ple_hash h;
    memset(&h, 0, sizeof h);
    h.N = c->ple_max_ngram;
    h.heads = c->ple_heads;
    h.pad = 0;
    const int ntab = glm_ple_primes(c, layer, h.prime);
    int64_t rows = 0;
    for (int t = 0; t < ntab; t++) {
        h.off[t] = rows;
        rows += h.prime[t];
    }
    for (int k = 0; k < h.N; k++) h.mult[k] = 0x9e3779b97f4a7c15ull * (uint64_t)(2 * k + 3) | 1u;
    const int d = c->ple_head_dim;
    mt_weight w;
    memset(&w, 0, sizeof w);
    void *mem = NULL;
    const size_t bytes = (size_t)rows * d * 2;
    mt_status st;
    if (host) {
        if (posix_memalign(&mem, 4096, (bytes + 4095) / 4096 * 4096) != 0) return -1;
        memset(mem, 0, bytes); /* resident before it is locked */
        st = be->ops->weight_host(be, mem, MT_BF16, rows, d, &w);
    } else {
        st = be->ops->weight_random(be, MT_BF16, rows, d, 7, 0.f, 0.02f, &w);
    }
    if (st != MT_OK) {
        free(mem);
        return -1;
    }
    mt_ple_hash *dh = be->ops->alloc(be, sizeof h);
    uint32_t *hist = be->ops->alloc(be, sizeof(uint32_t) * MT_PLE_MAX_ORDER * (size_t)B);
    uint32_t **tab = be->ops->alloc(be, sizeof(uint32_t *) * (size_t)B);
    float *emb = be->ops->alloc(be, sizeof(float) * (size_t)B * ntab * d);
    enum { WARM = 10, REPS = 200 };
    int32_t *ids = be->ops->alloc(be, sizeof(int32_t) * (size_t)B * (WARM + REPS));
    uint32_t **htab = malloc(sizeof(uint32_t *) * (size_t)B);
    int32_t *hid = malloc(sizeof(int32_t) * (size_t)B * (WARM + REPS));
    double ms = -1;
    if (dh && hist && tab && emb && ids && htab && hid) {
        be->ops->upload(be, dh, &h, sizeof h);
        for (int b = 0; b < B; b++) htab[b] = hist + (size_t)b * MT_PLE_MAX_ORDER;
        be->ops->upload(be, tab, htab, sizeof(uint32_t *) * (size_t)B);
        uint64_t x = 0x2545f4914f6cdd1dull;
        for (int i = 0; i < B * (WARM + REPS); i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            hid[i] = (int32_t)(x % (uint64_t)c->vocab_size);
        }
        be->ops->upload(be, ids, hid, sizeof(int32_t) * (size_t)B * (WARM + REPS));
        cudaStream_t s = (cudaStream_t)mt_cuda_backend_stream(be);
        cudaEvent_t e0, e1;
        cudaEventCreate(&e0);
        cudaEventCreate(&e1);
        for (int r = 0; r < WARM + REPS; r++) {
            if (r == WARM) cudaEventRecord(e0, s);
            for (int l = 0; l < nl; l++)
                be->ops->ple_gather_rows(be, emb, &w, ids + (size_t)r * B, 1, tab, dh, h.N, ntab, B);
        }
        cudaEventRecord(e1, s);
        cudaEventSynchronize(e1);
        float t = 0;
        cudaEventElapsedTime(&t, e0, e1);
        ms = t / REPS;
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
    }
    be->ops->free(be, dh);
    be->ops->free(be, hist);
    be->ops->free(be, tab);
    be->ops->free(be, emb);
    be->ops->free(be, ids);
    free(htab);
    free(hid);
    be->ops->weight_free(be, &w);
    free(mem);
    return ms;
}

/* Variant v at every batch size into res[batch]. */
static int run_variant(bench_rank *r, const ple_opts *o, int v, step_result *res) {
    mt_backend *be = r->be;
    mt_error err = { "" };
    glm_config c;
    if (v == V_BASE ? glm_config_preset("bench-4L", &c, &err) != MT_OK : ple_config(o, &c, &err) != 0) {
        fprintf(stderr, "ple_bench: %s\n", err.msg);
        return 1;
    }
    glm_model_params mp = glm_model_default_params();
    mp.ple_table_device = v == V_DEVICE_TABLE;
    mp.ple_host_gather = v == V_HOST_GATHER;
    glm_model *m = NULL;
    const double t0 = mt_now();
    if (glm_model_new_random(&c, 1, be, &mp, &m, &err) != MT_OK) {
        fprintf(stderr, "ple_bench: %s: %s\n", variant_name[v], err.msg);
        return 1;
    }
    fprintf(stderr, "ple_bench: %s made in %.1f s\n", variant_name[v], mt_now() - t0);
    const int V = c.vocab_size, prompt = o->prompt, steps = o->steps;
    int bmax = 1;
    for (int k = 0; k < o->nb; k++) bmax = o->batches[k] > bmax ? o->batches[k] : bmax;
    const int page = glm_model_page_tokens(m), len = prompt + 4 * steps + 16;
    if (glm_model_set_pools(m, (bmax + 1) * ((len + page - 1) / page) + 1, bmax + 2, &err) != MT_OK) {
        fprintf(stderr, "ple_bench: %s\n", err.msg);
        glm_model_free(m);
        return 1;
    }
    for (int k = 0; k < o->nb; k++) {
        const int B = o->batches[k];
        step_result *q = &res[k];
        glm_seq **s = calloc((size_t)B, sizeof *s);
        int32_t *tok = malloc(sizeof(int32_t) * (size_t)B), *ptoks = malloc(sizeof(int32_t) * (size_t)prompt);
        float *logits = malloc(sizeof(float) * (size_t)V);
        if (!s || !tok || !ptoks || !logits) {
            fprintf(stderr, "ple_bench: out of memory\n");
            return 1;
        }
        for (int b = 0; b < B; b++) { /* distinct prompts: distinct n-grams and routes */
            for (int i = 0; i < prompt; i++)
                ptoks[i] = (int32_t)(((unsigned)(i + 1) * 7919u + (unsigned)b * 104729u) % (unsigned)V);
            if (glm_seq_new(m, len, &s[b], &err) != MT_OK || glm_prefill(m, s[b], ptoks, prompt, logits, false, &err) != MT_OK) {
                fprintf(stderr, "ple_bench: %s\n", err.msg);
                return 1;
            }
            tok[b] = glm_argmax(logits, V);
        }
        glm_model_set_decode_graphs(m, false);
        bench_decode_steps(r, m, s, tok, B, 1);
        q->eager_ms = bench_decode_ahead(r, m, s, tok, B, steps);
        glm_model_set_decode_graphs(m, true);
        bench_decode_steps(r, m, s, tok, B, 2); /* the bucket's eager step, then its capture */
        q->graphed = glm_model_has_bucket_graph(m, B);
        q->graph_ms = bench_decode_ahead(r, m, s, tok, B, steps);
        /* one eager step, every op synchronised and timed */
        glm_model_set_decode_graphs(m, false);
        mt_cuda_profile(be, true, "ple_bench");
        bench_decode_steps(r, m, s, tok, B, 1);
        mt_cuda_op_time rows[256];
        const int n = mt_cuda_profile_take(be, rows, 256, &q->serial_ms);
        q->gather_ms = op_ms(rows, n, "ple_gather_rows");
        q->inject_ms = op_ms(rows, n, "ple_inject");
        q->ran = true;
        for (int b = 0; b < B; b++) glm_seq_free(s[b]);
        free(s);
        free(tok);
        free(ptoks);
        free(logits);
    }
    glm_model_free(m);
    return 0;
}

static int ple_rank(bench_rank *r, void *user) {
    const ple_opts *o = user;
    static step_result res[V_N][MAX_BATCHES];
    const bool want[V_N] = { true, true, o->device_table, o->host_gather };
    for (int v = 0; v < V_N; v++)
        if (want[v] && run_variant(r, o, v, res[v]) != 0) return 1;
    glm_config c;
    mt_error err = { "" };
    if (ple_config(o, &c, &err) != 0) return 1;
    double alone_host[MAX_BATCHES], alone_dev[MAX_BATCHES];
    for (int k = 0; k < o->nb; k++) {
        alone_host[k] = gather_alone_ms(r->be, &c, o->ple_layers[0], o->nl, o->batches[k], true);
        alone_dev[k] = gather_alone_ms(r->be, &c, o->ple_layers[0], o->nl, o->batches[k], false);
    }
    printf("metrale ple_bench: bench-4L batched decode (glm_decode_greedy, run ahead where the model can), prompts of %d "
           "tokens, CUDA backend\n", o->prompt);
    printf("memories on %d layer%s, n-grams of orders 2..%d, %d heads an order of %d columns, tables of %d rows: %.2f GB of "
           "bf16 tables in all\n", o->nl, o->nl > 1 ? "s" : "", c.ple_max_ngram, c.ple_heads, c.ple_head_dim,
           c.ple_table_sizes[0], o->table_gb);
    printf("added: ple's graph step less base's; serial: one eager step with every op synchronised (ple's sum of op times "
           "less base's),\ngather: ple_gather_rows's share of it; hidden: (serial added - graph added) / gather, in [0, 1]\n");
    printf("| batch | base ms | ple ms | added ms | added | ple eager ms | gather ms (serial) | inject ms (serial) | "
           "serial added ms | gather hidden | table on device ms | host gather ms |\n");
    printf("|------:|--------:|-------:|---------:|------:|-------------:|-------------------:|-------------------:|"
           "----------------:|--------------:|-------------------:|---------------:|\n");
    for (int k = 0; k < o->nb; k++) {
        const step_result *b = &res[V_BASE][k], *p = &res[V_PLE][k], *d = &res[V_DEVICE_TABLE][k], *h = &res[V_HOST_GATHER][k];
        const double added = p->graph_ms - b->graph_ms, serial_added = p->serial_ms - b->serial_ms;
        double hidden = p->gather_ms > 0 ? (serial_added - added) / p->gather_ms : 0;
        hidden = hidden < 0 ? 0 : hidden > 1 ? 1 : hidden;
        char dt[32] = "n/a", hg[32] = "n/a";
        if (d->ran) snprintf(dt, sizeof dt, "%.3f", d->graph_ms);
        if (h->ran) snprintf(hg, sizeof hg, "%.3f%s", h->graph_ms, h->graphed ? "" : "*");
        printf("| %5d | %7.3f%s | %6.3f%s | %8.3f | %4.1f%% | %12.3f | %18.3f | %18.3f | %16.3f | %12.0f%% | %18s | %14s |\n",
               o->batches[k], b->graph_ms, b->graphed ? "" : "*", p->graph_ms, p->graphed ? "" : "*", added,
               100 * added / b->graph_ms, p->eager_ms, p->gather_ms, p->inject_ms, serial_added, 100 * hidden, dt, hg);
    }
    printf("(* no bucket graph was captured for this batch: that column ran eagerly)\n");
    printf("\nthe gathers of a step alone (%d call%s of ple_gather_rows, 200 steps back to back), and the share of the bus's "
           "cost the graph step hides:\n", o->nl, o->nl > 1 ? "s" : "");
    printf("| batch | host table ms | device table ms | bus cost alone ms | bus cost in the step ms | bus cost hidden |\n");
    printf("|------:|--------------:|----------------:|------------------:|------------------------:|----------------:|\n");
    for (int k = 0; k < o->nb; k++) {
        const step_result *p = &res[V_PLE][k], *d = &res[V_DEVICE_TABLE][k];
        const double alone = alone_host[k] - alone_dev[k];
        char in_step[32] = "n/a", hidden[32] = "n/a";
        if (d->ran) {
            const double cost = p->graph_ms - d->graph_ms;
            double hf = alone > 0 ? 1 - cost / alone : 0;
            hf = hf < 0 ? 0 : hf > 1 ? 1 : hf;
            snprintf(in_step, sizeof in_step, "%.4f", cost);
            snprintf(hidden, sizeof hidden, "%.0f%%", 100 * hf);
        }
        printf("| %5d | %13.4f | %15.4f | %17.4f | %23s | %15s |\n", o->batches[k], alone_host[k], alone_dev[k], alone,
               in_step, hidden);
    }
    if (!o->device_table) printf("(bus cost in the step: n/a without --device-table)\n");
    if (o->json) {
        FILE *f = fopen(o->json, "w");
        if (!f) {
            fprintf(stderr, "ple_bench: cannot write %s\n", o->json);
            return 1;
        }
        fprintf(f, "{\"prompt\": %d, \"steps\": %d, \"table_gb\": %.3f, \"ple_layers\": %d, \"table_rows\": %d, \"batches\": [",
                o->prompt, o->steps, o->table_gb, o->nl, c.ple_table_sizes[0]);
        for (int k = 0; k < o->nb; k++) {
            fprintf(f, "%s{\"batch\": %d, \"gather_alone_host_ms\": %.5f, \"gather_alone_device_ms\": %.5f", k ? ", " : "",
                    o->batches[k], alone_host[k], alone_dev[k]);
            for (int v = 0; v < V_N; v++) {
                const step_result *q = &res[v][k];
                if (!q->ran) continue;
                fprintf(f, ", \"%s\": {\"graph_ms\": %.4f, \"graphed\": %s, \"eager_ms\": %.4f, \"serial_ms\": %.4f, "
                           "\"gather_serial_ms\": %.4f, \"inject_serial_ms\": %.4f}",
                        v == V_BASE ? "base" : v == V_PLE ? "ple" : v == V_DEVICE_TABLE ? "ple_device_table" : "ple_host_gather",
                        q->graph_ms, q->graphed ? "true" : "false", q->eager_ms, q->serial_ms, q->gather_ms, q->inject_ms);
            }
            fprintf(f, "}");
        }
        fprintf(f, "]}\n");
        fclose(f);
    }
    return 0;
}

int main(int argc, char **argv) {
    ple_opts o = { .batches = { 1, 64 }, .nb = 2, .prompt = 64, .steps = 32, .ple_layers = { 0, 3 }, .nl = 2,
                   .table_gb = 12 };
    o.cp = mt_cuda_default_params();
    o.device_table = bench_take_flag(&argc, argv, "--device-table");
    o.host_gather = bench_take_flag(&argc, argv, "--host-gather");
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc) {
            fprintf(stderr, "ple_bench: %s needs a value\n", argv[i]);
            return 2;
        }
        if (!strcmp(argv[i], "--batches")) o.nb = bench_parse_ints(argv[++i], o.batches, MAX_BATCHES);
        else if (!strcmp(argv[i], "--prompt")) o.prompt = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--steps")) o.steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--table-gb")) o.table_gb = atof(argv[++i]);
        else if (!strcmp(argv[i], "--ple-layers")) o.nl = bench_parse_ints(argv[++i], o.ple_layers, MAX_PLE);
        else if (!strcmp(argv[i], "--json")) o.json = argv[++i];
        else if (!strcmp(argv[i], "--numerics")) {
            if (!mt_numerics_parse(argv[++i], &o.cp.numerics)) {
                fprintf(stderr, "ple_bench: --numerics must be exact, bf16 or fp32, got %s\n", argv[i]);
                return 2;
            }
        } else {
            fprintf(stderr, "ple_bench: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (o.nb < 1 || o.nl < 1 || o.prompt < 1 || o.steps < 2 || !(o.table_gb > 0)) {
        fprintf(stderr, "ple_bench: bad options\n");
        return 2;
    }
    return bench_run_ranks("ple_bench", 0, &o.cp, ple_rank, &o);
}
