/* worker/cli/generate.c: metrale-generate, the command-line runner of the model: load a
 * checkpoint directory, prefill the given token ids, greedily generate N tokens, print the ids and
 * the speed. Only main exits; every failure is a message and a non-zero status.
 *
 *   metrale-generate --model DIR --prompt 1,2,3 [--max-new 32] [--threads N] [--backend cpu|cuda]
 *                    [--dtype auto|bf16]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "worker/model/glm/glm_model.h"

static void usage(FILE *f) {
    fprintf(f, "usage: metrale-generate --model DIR --prompt ID,ID,... [--max-new N] [--threads N]\n"
               "                        [--backend cpu|cuda] [--dtype auto|bf16]\n"
               "  Prefills the prompt and greedily generates N tokens (default 16) on the CPU backend\n"
               "  (default) or the first GPU. --dtype: an FP8 checkpoint's dense projections and routed\n"
               "  experts stay FP8 on the GPU (auto, the default) or every weight is dequantised to bf16 at\n"
               "  load (bf16).\n");
}

/* Parses "1,2,3" into a malloc'ed array; NULL with a message on bad input. */
static int32_t *parse_ids(const char *s, int *n) {
    int cap = 16, k = 0;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)cap);
    while (ids && *s) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 0 || v > 0x7fffffff || (*end && *end != ',')) {
            fprintf(stderr, "error: --prompt must be comma-separated non-negative token ids, at \"%s\"\n", s);
            free(ids);
            return NULL;
        }
        if (k == cap) {
            int32_t *g = realloc(ids, sizeof(int32_t) * (size_t)(cap *= 2));
            if (!g) { free(ids); return NULL; }
            ids = g;
        }
        ids[k++] = (int32_t)v;
        s = *end ? end + 1 : end;
    }
    if (ids && k == 0) {
        fprintf(stderr, "error: --prompt is empty\n");
        free(ids);
        return NULL;
    }
    *n = k;
    return ids;
}

int main(int argc, char **argv) {
    const char *dir = NULL, *prompt = NULL, *backend = "cpu", *dtype = "auto";
    int max_new = 16, threads = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); return 0; }
        if (!v) { usage(stderr); return 2; }
        if (!strcmp(a, "--model")) dir = v;
        else if (!strcmp(a, "--prompt")) prompt = v;
        else if (!strcmp(a, "--max-new")) max_new = atoi(v);
        else if (!strcmp(a, "--threads")) threads = atoi(v);
        else if (!strcmp(a, "--backend")) backend = v;
        else if (!strcmp(a, "--dtype")) dtype = v;
        else { fprintf(stderr, "error: unknown option %s\n", a); usage(stderr); return 2; }
        i++;
    }
    if (!dir || !prompt || max_new < 0) { usage(stderr); return 2; }
    if (strcmp(backend, "cpu") && strcmp(backend, "cuda")) {
        fprintf(stderr, "error: --backend must be cpu or cuda, got %s\n", backend);
        return 2;
    }
    if (strcmp(dtype, "auto") && strcmp(dtype, "bf16")) {
        fprintf(stderr, "error: --dtype must be auto or bf16, got %s\n", dtype);
        return 2;
    }
    glm_model_params mp = glm_model_default_params();
    mp.dequant_fp8 = !strcmp(dtype, "bf16");
    int n = 0;
    int32_t *ids = parse_ids(prompt, &n);
    if (!ids) return 2;

    mt_error err = { "" };
    mt_backend *be = !strcmp(backend, "cuda") ? mt_cuda_backend_new(0, NULL, &err) : mt_cpu_backend_new(threads);
    glm_model *m = NULL;
    glm_seq *seq = NULL;
    float *logits = NULL;
    int rc = 1;
    double t0 = mt_now();
    if (!be) { fprintf(stderr, "error: %s backend: %s\n", backend, err.msg[0] ? err.msg : "out of memory"); goto done; }
    if (glm_model_load(dir, be, &mp, &m, &err) != MT_OK) { fprintf(stderr, "error: %s\n", err.msg); goto done; }
    const glm_config *c = glm_model_config(m);
    double t1 = mt_now();
    fprintf(stderr, "loaded %s: %d layers, hidden %d, vocab %d in %.2f s (%s backend)\n", dir,
            c->num_hidden_layers, c->hidden_size, c->vocab_size, t1 - t0, be->ops->name);
    if (glm_seq_new(m, n + max_new, &seq, &err) != MT_OK) { fprintf(stderr, "error: %s\n", err.msg); goto done; }
    logits = malloc(sizeof(float) * (size_t)c->vocab_size);
    if (!logits) { fprintf(stderr, "error: out of memory\n"); goto done; }
    if (glm_prefill(m, seq, ids, n, logits, false, &err) != MT_OK) { fprintf(stderr, "error: %s\n", err.msg); goto done; }
    double t2 = mt_now();
    printf("prompt:");
    for (int i = 0; i < n; i++) printf(" %d", ids[i]);
    printf("\ngenerated:");
    fflush(stdout);
    int produced = 0;
    for (; produced < max_new; produced++) {
        int32_t tok = glm_argmax(logits, c->vocab_size);
        printf(" %d", tok);
        fflush(stdout);
        if (produced + 1 == max_new) { produced++; break; }
        if (glm_decode(m, seq, tok, logits, &err) != MT_OK) { fprintf(stderr, "\nerror: %s\n", err.msg); goto done; }
    }
    double t3 = mt_now();
    printf("\n");
    fflush(stdout);
    fprintf(stderr, "prefill: %d tokens in %.3f s (%.1f tok/s); decode: %d tokens in %.3f s (%.1f tok/s)\n", n,
            t2 - t1, n / (t2 - t1), produced, t3 - t2, produced > 1 ? (produced - 1) / (t3 - t2) : 0.0);
    rc = 0;
done:
    free(logits);
    glm_seq_free(seq);
    glm_model_free(m);
    mt_backend_free(be);
    free(ids);
    return rc;
}
