/* tools/tokenize.c: metrale-tokenize, the tokenizer from the command line.
 *
 *   metrale-tokenize --model DIR --text STR [--no-special] [--show]   ids of STR, comma-separated
 *   metrale-tokenize --model DIR --file PATH [--no-special] [--show]  ids of a file's text
 *   metrale-tokenize --model DIR --ids 1,2,3 [--skip-special]         text of the ids
 *   metrale-tokenize --model DIR --info                               vocabulary and special ids
 *   metrale-tokenize --model DIR --bench PATH [--repeat N]            encode throughput
 *
 * --show prints one line per id with its raw bytes (C-escaped) instead of the id list. --bench
 * reads PATH as documents separated by NUL bytes, encodes each (add_special_tokens off) N times
 * over (default 3) on one thread after one untimed pass, and prints one JSON line: bytes, tokens,
 * seconds (the best of the N passes), MB/s (10^6 bytes), and ids_fnv: FNV-1a 64 over every id of
 * the untimed pass as 4 little-endian bytes, for comparing the ids with another encoder's. Only main exits; errors are a message
 * and status 1, bad usage status 2.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/mt.h"
#include "worker/text/tokenizer.h"

static void usage(FILE *f) {
    fprintf(f, "usage: metrale-tokenize --model DIR (--text STR | --file PATH | --ids 1,2,3 | --info |\n"
               "                        --bench PATH [--repeat N]) [--no-special] [--skip-special] [--show]\n");
}

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, n = 0;
    char *s = malloc(cap);
    while (s) {
        if (n == cap) {
            char *g = realloc(s, cap *= 2);
            if (!g) { free(s); s = NULL; break; }
            s = g;
        }
        size_t got = fread(s + n, 1, cap - n, f);
        if (!got) break;
        n += got;
    }
    fclose(f);
    *len = n;
    return s;
}

static void print_escaped(const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (p[i] == '\\') fputs("\\\\", stdout);
        else if (p[i] >= 0x20 && p[i] < 0x7f) putchar(p[i]);
        else printf("\\x%02x", p[i]);
    }
}

static int print_ids(const tok_tokenizer *t, const tok_ids *ids, bool show) {
    for (size_t i = 0; i < ids->n; i++) {
        if (show) {
            size_t len;
            const uint8_t *p = tok_id_to_bytes(t, ids->ids[i], &len);
            printf("%d\t", ids->ids[i]);
            print_escaped(p, len);
            printf("%s\n", tok_is_special(t, ids->ids[i]) ? "\t(special)" : "");
        } else {
            printf(i ? ",%d" : "%d", ids->ids[i]);
        }
    }
    if (!show) putchar('\n');
    return 0;
}

static int parse_ids(const char *s, tok_ids *out) {
    while (*s) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < INT32_MIN || v > INT32_MAX) return -1;
        if (out->n == out->cap) {
            size_t cap = out->cap ? out->cap * 2 : 64;
            int32_t *p = realloc(out->ids, sizeof *p * cap);
            if (!p) return -1;
            out->ids = p;
            out->cap = cap;
        }
        out->ids[out->n++] = (int32_t)v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return -1;
    }
    return 0;
}

static int bench(tok_encoder *e, const char *path, int repeat) {
    size_t len;
    char *text = read_file(path, &len);
    if (!text) { fprintf(stderr, "error: cannot read %s\n", path); return 1; }
    tok_ids ids = {0};
    mt_error err;
    double best = 1e30;
    size_t tokens = 0;
    uint64_t fnv = 1469598103934665603ull;
    for (int pass = 0; pass <= repeat; pass++) { /* pass 0 warms the cache and the pages */
        double t0 = mt_now();
        tokens = 0;
        for (size_t at = 0; at < len;) {
            const char *end = memchr(text + at, 0, len - at);
            size_t n = end ? (size_t)(end - (text + at)) : len - at;
            ids.n = 0;
            if (tok_encode(e, text + at, n, false, &ids, &err) != MT_OK) {
                fprintf(stderr, "error: %s\n", err.msg);
                free(text);
                tok_ids_free(&ids);
                return 1;
            }
            tokens += ids.n;
            at += n + 1;
            for (size_t i = 0; pass == 0 && i < ids.n; i++)
                for (int b = 0; b < 4; b++)
                    fnv = (fnv ^ (((uint32_t)ids.ids[i] >> (8 * b)) & 0xff)) * 1099511628211ull;
        }
        double dt = mt_now() - t0;
        if (pass > 0 && dt < best) best = dt;
    }
    size_t bytes = 0;
    for (size_t i = 0; i < len; i++) bytes += text[i] != 0;
    printf("{\"bytes\": %zu, \"tokens\": %zu, \"seconds\": %.6f, \"mb_s\": %.3f, \"ids_fnv\": "
           "\"%016llx\"}\n", bytes, tokens, best, (double)bytes / best / 1e6, (unsigned long long)fnv);
    free(text);
    tok_ids_free(&ids);
    return 0;
}

int main(int argc, char **argv) {
    const char *dir = NULL, *text = NULL, *file = NULL, *ids_arg = NULL, *bench_path = NULL;
    bool add_special = true, skip_special = false, show = false, info = false;
    int repeat = 3;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); return 0; }
        if (!strcmp(a, "--no-special")) { add_special = false; continue; }
        if (!strcmp(a, "--skip-special")) { skip_special = true; continue; }
        if (!strcmp(a, "--show")) { show = true; continue; }
        if (!strcmp(a, "--info")) { info = true; continue; }
        if (!v) { usage(stderr); return 2; }
        if (!strcmp(a, "--model")) dir = v;
        else if (!strcmp(a, "--text")) text = v;
        else if (!strcmp(a, "--file")) file = v;
        else if (!strcmp(a, "--ids")) ids_arg = v;
        else if (!strcmp(a, "--bench")) bench_path = v;
        else if (!strcmp(a, "--repeat")) repeat = atoi(v);
        else { fprintf(stderr, "error: unknown option %s\n", a); usage(stderr); return 2; }
        i++;
    }
    int modes = !!text + !!file + !!ids_arg + !!bench_path + info;
    if (!dir || modes != 1 || repeat < 1) { usage(stderr); return 2; }

    mt_error err;
    tok_tokenizer *t = NULL;
    if (tok_load(dir, &t, &err) != MT_OK) { fprintf(stderr, "error: %s\n", err.msg); return 1; }
    int rc = 0;
    tok_encoder *e = NULL;
    tok_ids ids = {0};
    tok_text out = {0};
    char *buf = NULL;
    if (info) {
        tok_special_ids sp = tok_special(t);
        printf("vocab_size %d\nbos %d\npad %d\neos", tok_vocab_size(t), sp.bos, sp.pad);
        for (int i = 0; i < sp.n_eos; i++) printf(" %d", sp.eos[i]);
        const char *ct = tok_chat_template(t);
        printf("\nchat_template %zu bytes\n", ct ? strlen(ct) : (size_t)0);
    } else if (ids_arg) {
        if (parse_ids(ids_arg, &ids) != 0) { fprintf(stderr, "error: bad --ids\n"); rc = 2; goto done; }
        if (tok_decode(t, ids.ids, ids.n, skip_special, &out, &err) != MT_OK) {
            fprintf(stderr, "error: %s\n", err.msg);
            rc = 1;
            goto done;
        }
        fwrite(out.s, 1, out.n, stdout);
        putchar('\n');
    } else {
        if (!(e = tok_encoder_new(t))) { fprintf(stderr, "error: out of memory\n"); rc = 1; goto done; }
        if (bench_path) { rc = bench(e, bench_path, repeat); goto done; }
        size_t len = text ? strlen(text) : 0;
        if (file && !(buf = read_file(file, &len))) {
            fprintf(stderr, "error: cannot read %s\n", file);
            rc = 1;
            goto done;
        }
        if (tok_encode(e, file ? buf : text, len, add_special, &ids, &err) != MT_OK) {
            fprintf(stderr, "error: %s\n", err.msg);
            rc = 1;
            goto done;
        }
        print_ids(t, &ids, show);
    }
done:
    free(buf);
    tok_ids_free(&ids);
    tok_text_free(&out);
    tok_encoder_free(e);
    tok_free(t);
    return rc;
}
