/* tools/dev/precision_probe.c: which projections need the two-part (hi + lo) bf16 split of the
 * activations on tensor cores, and which take a single bf16 rounding. On the CPU backend, for a
 * checkpoint and a token sequence, the logits of every position (one prefill, causal: the same as
 * teacher forcing) are computed exactly, then with the activations rounded to bf16 before the
 * matmuls of chosen weight classes (mt_cpu_set_round_x): each class alone, every class but one,
 * and all. Prints top-1 agreement and the worst logit cosine against the exact run, the bar of the
 * GPU model test being 99% and 0.999.
 *
 *   precision_probe DIR [DIR ...]   (e.g. tests/fixtures/tiny_a tests/fixtures/tiny_b random:test-wide)
 * (random:PRESET: that config preset with random weights, seed 9, as model_cuda_test makes it.)
 *   precision_probe --bits DIR [DIR ...]
 *   precision_probe --fp8lo DIR [DIR ...]
 *   precision_probe --fp8lo-tensor DIR [DIR ...]
 * --bits: every matmul's activations rounded to 8, 9, .. 16 significant bits instead (8 = bf16,
 * 11 = fp16's mantissa; a bf16 high part plus an fp8 e4m3 low part carries about 12): how much
 * precision a single tensor-core pass would need to meet the bar. --fp8lo: every matmul as a bf16
 * high part plus an fp8 e4m3 low part (mt_cpu_set_round_fp8lo), against the exact run, with a
 * scale per row of the weight and of the remainder; --fp8lo-tensor: one scale per matrix.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "worker/model/glm_model.h"

static const char *const k_names[MT_WCLS_N] = { "other", "router", "indexer", "hc", "kda_gate", "attn", "mlp", "head" };

static float *logits_of(glm_model *m, const int32_t *toks, int n, uint32_t mask) {
    const int V = glm_model_config(m)->vocab_size;
    float *l = malloc(sizeof(float) * (size_t)n * V);
    glm_seq *s = NULL;
    mt_error err = { "" };
    mt_cpu_set_round_x(mask);
    if (!l || glm_seq_new(m, n, &s, &err) != MT_OK || glm_prefill(m, s, toks, n, l, true, &err) != MT_OK) {
        fprintf(stderr, "precision_probe: %s\n", err.msg);
        exit(1);
    }
    glm_seq_free(s);
    mt_cpu_set_round_x(0);
    return l;
}

static void compare(const float *ref, const float *got, int n, int V, double *top1, double *worst_cos) {
    int agree = 0;
    double worst = 1;
    for (int i = 0; i < n; i++) {
        const float *a = ref + (size_t)i * V, *b = got + (size_t)i * V;
        agree += glm_argmax(a, V) == glm_argmax(b, V);
        double ab = 0, aa = 0, bb = 0;
        for (int v = 0; v < V; v++) {
            ab += (double)a[v] * b[v];
            aa += (double)a[v] * a[v];
            bb += (double)b[v] * b[v];
        }
        const double c = ab / sqrt(aa * bb + 1e-300);
        if (c < worst) worst = c;
    }
    *top1 = 100.0 * agree / n;
    *worst_cos = worst;
}

int main(int argc, char **argv) {
    /* --fp8lo: scales per row; --fp8lo-tensor: one scale per matrix */
    const int fp8lo = argc > 1 && !strcmp(argv[1], "--fp8lo") ? 1 : argc > 1 && !strcmp(argv[1], "--fp8lo-tensor") ? 2 : 0;
    const bool bits = fp8lo || (argc > 1 && !strcmp(argv[1], "--bits"));
    if (argc < 2 + bits) {
        fprintf(stderr, "usage: precision_probe [--bits | --fp8lo | --fp8lo-tensor] DIR [DIR ...]\n");
        return 2;
    }
    mt_backend *be = mt_cpu_backend_new(0);
    const uint32_t all = (1u << MT_WCLS_N) - 1;
    if (bits)
        printf("| model | every matmul's activations rounded to | top-1 agreement | worst cosine |\n|---|---|---:|---:|\n");
    else
        printf("| model | activations rounded to bf16 before | top-1 agreement | worst cosine |\n|---|---|---:|---:|\n");
    for (int d = 1 + bits; d < argc; d++) {
        glm_model *m = NULL;
        mt_error err = { "" };
        glm_config rc;
        if (!strncmp(argv[d], "random:", 7)) { /* a config preset with random weights (seed 9) */
            if (glm_config_preset(argv[d] + 7, &rc, &err) != MT_OK || glm_model_new_random(&rc, 9, be, NULL, &m, &err) != MT_OK) {
                fprintf(stderr, "precision_probe: %s\n", err.msg);
                return 1;
            }
        } else if (glm_model_load(argv[d], be, NULL, &m, &err) != MT_OK) {
            fprintf(stderr, "precision_probe: %s\n", err.msg);
            return 1;
        }
        /* 70 positions, 300 for a random model (past test-wide's index_topk, as model_cuda_test) */
        const int V = glm_model_config(m)->vocab_size, n = strncmp(argv[d], "random:", 7) ? 70 : 300;
        int32_t toks[300];
        for (int i = 0; i < n; i++) toks[i] = (int32_t)((i * 7919u + 13u) % (unsigned)V);
        float *ref = logits_of(m, toks, n, 0);
        if (fp8lo) {
            mt_cpu_set_round_fp8lo(fp8lo);
            float *got = logits_of(m, toks, n, all);
            mt_cpu_set_round_fp8lo(0);
            double top1, cosw;
            compare(ref, got, n, V, &top1, &cosw);
            printf("| %s | bf16 high + fp8 e4m3 low (weights e4m3 for the low part; scales per %s) | %.2f%% | %.6f |\n",
                   argv[d], fp8lo == 1 ? "row" : "matrix", top1, cosw);
            free(got);
        }
        for (int b = 8; bits && !fp8lo && b <= 16; b++) {
            mt_cpu_set_round_bits(b);
            float *got = logits_of(m, toks, n, all);
            double top1, cosw;
            compare(ref, got, n, V, &top1, &cosw);
            printf("| %s | %d significant bits | %.2f%% | %.6f |\n", argv[d], b, top1, cosw);
            free(got);
        }
        mt_cpu_set_round_bits(8);
        for (int pass = 0; !bits && pass < 2 * MT_WCLS_N + 1; pass++) {
            /* each class alone, then every class but one, then all */
            const int c = pass % MT_WCLS_N;
            const uint32_t mask = pass == 2 * MT_WCLS_N ? all : pass < MT_WCLS_N ? 1u << c : all & ~(1u << c);
            char what[64];
            if (pass == 2 * MT_WCLS_N) snprintf(what, sizeof what, "every matmul");
            else snprintf(what, sizeof what, "%s %s", pass < MT_WCLS_N ? "only" : "all but", k_names[c]);
            float *got = logits_of(m, toks, n, mask);
            double top1, cosw;
            compare(ref, got, n, V, &top1, &cosw);
            printf("| %s | %s | %.2f%% | %.6f |\n", argv[d], what, top1, cosw);
            free(got);
        }
        free(ref);
        glm_model_free(m);
    }
    mt_backend_free(be);
    return 0;
}
