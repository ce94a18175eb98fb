/* worker/loader/safetensors.c: see safetensors.h.
 *
 * File format: 8-byte little-endian header length N, N bytes of JSON (an object: tensor name ->
 * {"dtype", "shape", "data_offsets": [begin, end]}, plus an optional "__metadata__" object),
 * then the data section; offsets are relative to its start. The writer pads the header with
 * spaces to a multiple of 8 bytes so every tensor starts 8-byte aligned in the file.
 */
#define _GNU_SOURCE /* fstat, mmap, O_CLOEXEC */
#include "worker/loader/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <json-c/json.h>

#include "worker/loader/json_util.h"

#define ST_INDEX_NAME "model.safetensors.index.json"
#define ST_SINGLE_NAME "model.safetensors"
#define ST_MAX_HEADER ((uint64_t)100 << 20) /* the reference implementation's limit */

/* ------------------------------------------------------------------------------------------ */
/* Shared helpers                                                                             */

static const struct { const char *name; mt_dtype dt; } k_dtypes[] = {
    { "F32", MT_F32 }, { "F16", MT_F16 }, { "BF16", MT_BF16 },
    { "I32", MT_I32 }, { "I64", MT_I64 }, { "U8", MT_U8 }, { "F8_E4M3", MT_F8E4M3 },
};

static bool dtype_from_name(const char *s, mt_dtype *out) {
    for (size_t i = 0; i < sizeof k_dtypes / sizeof k_dtypes[0]; i++) {
        if (!strcmp(s, k_dtypes[i].name)) {
            *out = k_dtypes[i].dt;
            return true;
        }
    }
    return false;
}

static bool dtype_valid(mt_dtype t) { return mt_dtype_size(t) != 0; }
static bool dtype_is_float(mt_dtype t) { return t == MT_F32 || t == MT_F16 || t == MT_BF16; }

/* prod(shape) * elem into *out; false on overflow or a negative dim. */
static bool shape_bytes(int ndim, const int64_t *shape, size_t elem, uint64_t *out) {
    uint64_t n = elem;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) return false;
        if (__builtin_mul_overflow(n, (uint64_t)shape[i], &n)) return false;
    }
    *out = n;
    return true;
}

static void shape_str(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < ndim && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

static char *path_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + b + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    size_t n = a;
    if (a && dir[a - 1] != '/') p[n++] = '/';
    memcpy(p + n, name, b + 1);
    return p;
}

/* Parses exactly len bytes of JSON (trailing whitespace allowed). NULL with err set on failure. */
static json_object *parse_json(const char *text, size_t len, const char *where, mt_error *err) {
    if (len > INT_MAX) {
        mt_errorf(err, MT_ERR_INVALID, "%s: JSON of %zu bytes is too large", where, len);
        return NULL;
    }
    json_tokener *tok = json_tokener_new();
    if (!tok) {
        mt_errorf(err, MT_ERR_NOMEM, "%s: out of memory", where);
        return NULL;
    }
    json_object *root = json_tokener_parse_ex(tok, text, (int)len);
    enum json_tokener_error jerr = json_tokener_get_error(tok);
    size_t end = json_tokener_get_parse_end(tok);
    json_tokener_free(tok);
    if (!root || jerr != json_tokener_success) {
        if (root) json_object_put(root);
        mt_errorf(err, MT_ERR_INVALID, "%s: not valid JSON (%s at byte %zu)", where,
                  jerr == json_tokener_continue ? "unexpected end" : json_tokener_error_desc(jerr),
                  end);
        return NULL;
    }
    for (size_t i = end; i < len; i++) {
        if (!strchr(" \t\r\n", text[i]) || text[i] == 0) {
            json_object_put(root);
            mt_errorf(err, MT_ERR_INVALID, "%s: not valid JSON (trailing data at byte %zu)", where, i);
            return NULL;
        }
    }
    return root;
}

/* Reads a whole small file into a NUL-terminated buffer. */
static mt_status read_small_file(const char *path, char **out, size_t *len, mt_error *err) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return mt_errorf(err, MT_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return mt_errorf(err, MT_ERR_IO, "%s: stat failed: %s", path, strerror(e));
    }
    if ((uint64_t)sb.st_size > ST_MAX_HEADER) {
        close(fd);
        return mt_errorf(err, MT_ERR_INVALID, "%s: %lld bytes is too large", path, (long long)sb.st_size);
    }
    size_t n = (size_t)sb.st_size;
    char *buf = malloc(n + 1);
    if (!buf) {
        close(fd);
        return mt_errorf(err, MT_ERR_NOMEM, "%s: out of memory", path);
    }
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            int e = r < 0 ? errno : EIO;
            free(buf);
            close(fd);
            return mt_errorf(err, MT_ERR_IO, "%s: read failed: %s", path, strerror(e));
        }
        got += (size_t)r;
    }
    close(fd);
    buf[n] = 0;
    *out = buf;
    *len = n;
    return MT_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Reader                                                                                     */

typedef struct st_file {
    char *path;
    void *map;   /* whole file, PROT_READ */
    size_t size;
} st_file;

struct st_archive {
    char *where;           /* the directory or file opened, for messages */
    st_file *files;        /* [nfiles] */
    size_t nfiles;
    st_tensor *t;          /* [n], file order; names owned (malloc'd) */
    uint64_t *begin;       /* [n] data_offsets[0], absolute in its file; parse-time only */
    size_t n, cap;
    const st_tensor **by_name; /* [n], sorted by name for st_find */
};

void st_close(st_archive *ar) {
    if (!ar) return;
    for (size_t i = 0; i < ar->nfiles; i++) {
        if (ar->files[i].map) munmap(ar->files[i].map, ar->files[i].size);
        free(ar->files[i].path);
    }
    for (size_t i = 0; i < ar->n; i++) free((char *)ar->t[i].name);
    free(ar->files);
    free(ar->t);
    free(ar->begin);
    free(ar->by_name);
    free(ar->where);
    free(ar);
}

static st_archive *archive_new(const char *where, size_t nfiles) {
    st_archive *ar = calloc(1, sizeof *ar);
    if (!ar) return NULL;
    ar->where = strdup(where);
    ar->files = calloc(nfiles ? nfiles : 1, sizeof *ar->files);
    ar->nfiles = nfiles;
    if (!ar->where || !ar->files) {
        st_close(ar);
        return NULL;
    }
    return ar;
}

static mt_status archive_push(st_archive *ar, const st_tensor *t, uint64_t begin) {
    if (ar->n == ar->cap) {
        size_t cap = ar->cap ? ar->cap * 2 : 256;
        st_tensor *nt = realloc(ar->t, cap * sizeof *nt);
        if (!nt) return MT_ERR_NOMEM;
        ar->t = nt;
        uint64_t *nb = realloc(ar->begin, cap * sizeof *nb);
        if (!nb) return MT_ERR_NOMEM;
        ar->begin = nb;
        ar->cap = cap;
    }
    ar->t[ar->n] = *t;
    ar->begin[ar->n] = begin;
    ar->n++;
    return MT_OK;
}

/* Reads a non-negative JSON integer. */
static bool get_u64(json_object *v, uint64_t *out) {
    if (!json_object_is_type(v, json_type_int)) return false;
    errno = 0;
    int64_t x = json_object_get_int64(v);
    if (errno != 0 || x < 0) return false;
    *out = (uint64_t)x;
    return true;
}

/* Parses one header entry into t (name not yet set). */
static mt_status parse_entry(const char *path, const char *name, json_object *v, st_tensor *t,
                             uint64_t *begin, uint64_t *end, mt_error *err) {
    if (!json_object_is_type(v, json_type_object))
        return mt_errorf(err, MT_ERR_INVALID, "%s: tensor %.160s: header entry is %s, expected an object",
                         path, name, ld_json_kind(v));
    json_object *dt = NULL, *shape = NULL, *offs = NULL;
    json_object_object_get_ex(v, "dtype", &dt);
    json_object_object_get_ex(v, "shape", &shape);
    json_object_object_get_ex(v, "data_offsets", &offs);
    if (!json_object_is_type(dt, json_type_string))
        return mt_errorf(err, MT_ERR_INVALID, "%s: tensor %.160s: dtype is %s, expected a string", path,
                         name, ld_json_kind(dt));
    if (!dtype_from_name(json_object_get_string(dt), &t->dtype))
        return mt_errorf(err, MT_ERR_UNSUPPORTED,
                         "%s: tensor %.160s: dtype %.32s is not supported (F32, F16, BF16, F8_E4M3, I32, I64, U8)",
                         path, name, json_object_get_string(dt));
    if (!json_object_is_type(shape, json_type_array))
        return mt_errorf(err, MT_ERR_INVALID, "%s: tensor %.160s: shape is %s, expected a list", path,
                         name, ld_json_kind(shape));
    size_t nd = json_object_array_length(shape);
    if (nd > ST_MAX_DIMS)
        return mt_errorf(err, MT_ERR_UNSUPPORTED, "%s: tensor %.160s: %zu dims, at most %d supported",
                         path, name, nd, ST_MAX_DIMS);
    t->ndim = (int)nd;
    for (size_t i = 0; i < nd; i++) {
        uint64_t d;
        if (!get_u64(json_object_array_get_idx(shape, i), &d) || d > INT64_MAX)
            return mt_errorf(err, MT_ERR_INVALID,
                             "%s: tensor %.160s: shape[%zu] is not a non-negative integer", path, name, i);
        t->shape[i] = (int64_t)d;
    }
    if (!json_object_is_type(offs, json_type_array) || json_object_array_length(offs) != 2 ||
        !get_u64(json_object_array_get_idx(offs, 0), begin) ||
        !get_u64(json_object_array_get_idx(offs, 1), end))
        return mt_errorf(err, MT_ERR_INVALID,
                         "%s: tensor %.160s: data_offsets must be two non-negative integers", path, name);
    uint64_t want;
    if (!shape_bytes(t->ndim, t->shape, mt_dtype_size(t->dtype), &want))
        return mt_errorf(err, MT_ERR_INVALID, "%s: tensor %.160s: shape is too large", path, name);
    if (*end < *begin)
        return mt_errorf(err, MT_ERR_INVALID, "%s: tensor %.160s: data_offsets [%llu, %llu] end before they begin",
                         path, name, (unsigned long long)*begin, (unsigned long long)*end);
    if (*end - *begin != want) {
        char sb[96];
        shape_str(sb, sizeof sb, t->ndim, t->shape);
        return mt_errorf(err, MT_ERR_INVALID,
                         "%s: tensor %.160s: data_offsets [%llu, %llu] hold %llu bytes but %s %s needs %llu",
                         path, name, (unsigned long long)*begin, (unsigned long long)*end,
                         (unsigned long long)(*end - *begin), mt_dtype_name(t->dtype), sb,
                         (unsigned long long)want);
    }
    return MT_OK;
}

static int cmp_begin(const void *a, const void *b, void *ctx) {
    const uint64_t *begin = ctx;
    uint64_t x = begin[*(const size_t *)a], y = begin[*(const size_t *)b];
    return x < y ? -1 : x > y;
}

/* Maps ar->files[fi] (path already set) and appends its tensors. */
static mt_status load_file(st_archive *ar, size_t fi, mt_error *err) {
    st_file *f = &ar->files[fi];
    const char *path = f->path;
    mt_status st = MT_OK;
    json_object *root = NULL;
    size_t *order = NULL;

    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return mt_errorf(err, errno == ENOENT ? MT_ERR_NOT_FOUND : MT_ERR_IO, "%s: cannot open: %s",
                         path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        st = mt_errorf(err, MT_ERR_IO, "%s: stat failed: %s", path, strerror(errno));
        close(fd);
        return st;
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return mt_errorf(err, MT_ERR_IO, "%s: not a regular file", path);
    }
    if (sb.st_size < 8) {
        close(fd);
        return mt_errorf(err, MT_ERR_IO, "%s: file is %lld bytes, too short for a safetensors header",
                         path, (long long)sb.st_size);
    }
    f->size = (size_t)sb.st_size;
    void *map = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
    int map_errno = errno;
    close(fd);
    if (map == MAP_FAILED) return mt_errorf(err, MT_ERR_IO, "%s: mmap failed: %s", path, strerror(map_errno));
    f->map = map;

    const uint8_t *p = map;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | p[i];
    if (hlen > f->size - 8)
        return mt_errorf(err, MT_ERR_IO, "%s: header length %llu exceeds the file (%zu bytes; truncated?)",
                         path, (unsigned long long)hlen, f->size);
    if (hlen > ST_MAX_HEADER)
        return mt_errorf(err, MT_ERR_INVALID, "%s: header length %llu exceeds the 100 MiB limit", path,
                         (unsigned long long)hlen);
    const uint64_t data_start = 8 + hlen, data_size = f->size - data_start;

    char where[4200];
    snprintf(where, sizeof where, "%s: header", path);
    if (!(root = parse_json((const char *)p + 8, (size_t)hlen, where, err))) return MT_ERR_INVALID;
    if (!json_object_is_type(root, json_type_object)) {
        st = mt_errorf(err, MT_ERR_INVALID, "%s: header is %s, expected a JSON object", path,
                       ld_json_kind(root));
        goto done;
    }

    const size_t first = ar->n;
    json_object_object_foreach(root, key, val) {
        if (!strcmp(key, "__metadata__")) {
            if (val && !json_object_is_type(val, json_type_object)) {
                st = mt_errorf(err, MT_ERR_INVALID, "%s: __metadata__ is %s, expected an object", path,
                               ld_json_kind(val));
                goto done;
            }
            continue;
        }
        st_tensor t;
        memset(&t, 0, sizeof t);
        uint64_t b = 0, e = 0;
        if ((st = parse_entry(path, key, val, &t, &b, &e, err)) != MT_OK) goto done;
        if (e > data_size) {
            st = mt_errorf(err, MT_ERR_IO,
                           "%s: tensor %.160s: data_offsets [%llu, %llu] run past the %llu-byte data section (truncated?)",
                           path, key, (unsigned long long)b, (unsigned long long)e,
                           (unsigned long long)data_size);
            goto done;
        }
        t.file = f->path;
        t.data = p + data_start + b;
        t.nbytes = (size_t)(e - b);
        if (!(t.name = strdup(key))) {
            st = mt_errorf(err, MT_ERR_NOMEM, "%s: out of memory", path);
            goto done;
        }
        if (archive_push(ar, &t, b) != MT_OK) {
            free((char *)t.name);
            st = mt_errorf(err, MT_ERR_NOMEM, "%s: out of memory", path);
            goto done;
        }
    }

    /* Regions must not overlap (the header must not lie about where tensors are). */
    const size_t cnt = ar->n - first;
    if (cnt > 1) {
        if (!(order = malloc(cnt * sizeof *order))) {
            st = mt_errorf(err, MT_ERR_NOMEM, "%s: out of memory", path);
            goto done;
        }
        for (size_t i = 0; i < cnt; i++) order[i] = first + i;
        qsort_r(order, cnt, sizeof *order, cmp_begin, ar->begin);
        for (size_t i = 1; i < cnt; i++) {
            const st_tensor *a = &ar->t[order[i - 1]], *b = &ar->t[order[i]];
            if (ar->begin[order[i - 1]] + a->nbytes > ar->begin[order[i]]) {
                st = mt_errorf(err, MT_ERR_INVALID, "%s: tensors %.120s and %.120s overlap in the data section",
                               path, a->name, b->name);
                goto done;
            }
        }
    }
done:
    free(order);
    if (root) json_object_put(root);
    return st;
}

/* The file name of a path (messages already name the directory). */
static const char *base_name(const char *path) {
    const char *slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}

static int cmp_tensor_name(const void *a, const void *b) {
    return strcmp((*(const st_tensor *const *)a)->name, (*(const st_tensor *const *)b)->name);
}

/* Builds the name index; rejects a name held twice (two shards, or a header key twice). */
static mt_status archive_finish(st_archive *ar, mt_error *err) {
    ar->by_name = malloc((ar->n ? ar->n : 1) * sizeof *ar->by_name);
    if (!ar->by_name) return mt_errorf(err, MT_ERR_NOMEM, "%s: out of memory", ar->where);
    for (size_t i = 0; i < ar->n; i++) ar->by_name[i] = &ar->t[i];
    qsort(ar->by_name, ar->n, sizeof *ar->by_name, cmp_tensor_name);
    for (size_t i = 1; i < ar->n; i++) {
        const st_tensor *a = ar->by_name[i - 1], *b = ar->by_name[i];
        if (!strcmp(a->name, b->name))
            return mt_errorf(err, MT_ERR_INVALID, "%s: tensor %.160s appears twice, in %s and %s",
                             ar->where, a->name, base_name(a->file), base_name(b->file));
    }
    free(ar->begin);
    ar->begin = NULL;
    return MT_OK;
}

mt_status st_open_file(const char *path, st_archive **out, mt_error *err) {
    if (!path || !out) return mt_errorf(err, MT_ERR_INVALID, "st_open_file: no path");
    st_archive *ar = archive_new(path, 1);
    if (!ar || !(ar->files[0].path = strdup(path))) {
        st_close(ar);
        return mt_errorf(err, MT_ERR_NOMEM, "%s: out of memory", path);
    }
    mt_status st = load_file(ar, 0, err);
    if (st == MT_OK) st = archive_finish(ar, err);
    if (st != MT_OK) {
        st_close(ar);
        return st;
    }
    *out = ar;
    return MT_OK;
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Opens the shards named by dir/model.safetensors.index.json. */
static mt_status open_index(const char *dir, const char *index_path, st_archive **out, mt_error *err) {
    mt_status st;
    char *text = NULL;
    size_t len = 0;
    json_object *root = NULL;
    const char **names = NULL;
    st_archive *ar = NULL;

    if ((st = read_small_file(index_path, &text, &len, err)) != MT_OK) return st;
    if (!(root = parse_json(text, len, index_path, err))) {
        st = MT_ERR_INVALID;
        goto done;
    }
    json_object *wm = NULL;
    if (!json_object_is_type(root, json_type_object) ||
        !json_object_object_get_ex(root, "weight_map", &wm) ||
        !json_object_is_type(wm, json_type_object)) {
        st = mt_errorf(err, MT_ERR_INVALID, "%s: weight_map is missing or not an object", index_path);
        goto done;
    }
    size_t n = (size_t)json_object_object_length(wm), k = 0;
    if (!(names = malloc((n ? n : 1) * sizeof *names))) {
        st = mt_errorf(err, MT_ERR_NOMEM, "%s: out of memory", index_path);
        goto done;
    }
    json_object_object_foreach(wm, tname, fval) {
        if (!json_object_is_type(fval, json_type_string)) {
            st = mt_errorf(err, MT_ERR_INVALID, "%s: weight_map[\"%.160s\"] is %s, expected a file name",
                           index_path, tname, ld_json_kind(fval));
            goto done;
        }
        const char *fn = json_object_get_string(fval);
        if (!*fn || strchr(fn, '/')) {
            st = mt_errorf(err, MT_ERR_INVALID,
                           "%s: weight_map[\"%.160s\"] = \"%.200s\" is not a file name in the checkpoint directory",
                           index_path, tname, fn);
            goto done;
        }
        names[k++] = fn;
    }
    qsort(names, k, sizeof *names, cmp_str);
    size_t nf = 0;
    for (size_t i = 0; i < k; i++)
        if (i == 0 || strcmp(names[i], names[i - 1])) names[nf++] = names[i];

    if (!(ar = archive_new(dir, nf))) {
        st = mt_errorf(err, MT_ERR_NOMEM, "%s: out of memory", index_path);
        goto done;
    }
    for (size_t i = 0; i < nf; i++) {
        if (!(ar->files[i].path = path_join(dir, names[i]))) {
            st = mt_errorf(err, MT_ERR_NOMEM, "%s: out of memory", index_path);
            goto done;
        }
    }
    for (size_t i = 0; i < nf; i++) {
        if ((st = load_file(ar, i, err)) != MT_OK) {
            if (err) { /* say where the file name came from */
                char tmp[sizeof err->msg];
                snprintf(tmp, sizeof tmp, "%s", err->msg);
                mt_errorf(err, st, "%s (shard listed in %s)", tmp, ST_INDEX_NAME);
            }
            goto done;
        }
    }
    if ((st = archive_finish(ar, err)) != MT_OK) goto done;

    /* Every tensor the index lists must be in the shard it names. */
    json_object_object_foreach(wm, tn, fv) {
        const st_tensor *t = st_find(ar, tn);
        const char *fn = json_object_get_string(fv);
        size_t fl = strlen(fn), tl = t ? strlen(t->file) : 0;
        bool in_file = t && tl >= fl && !strcmp(t->file + tl - fl, fn) &&
                       (tl == fl || t->file[tl - fl - 1] == '/');
        if (!in_file) {
            st = mt_errorf(err, MT_ERR_NOT_FOUND,
                           "%s: tensor %.160s is listed in shard %.200s but that shard does not hold it%s%.200s",
                           index_path, tn, fn, t ? " (found in " : "", t ? base_name(t->file) : "");
            if (t && err) strncat(err->msg, ")", sizeof err->msg - strlen(err->msg) - 1);
            goto done;
        }
    }
    *out = ar;
    ar = NULL;
    st = MT_OK;
done:
    st_close(ar);
    free(names);
    if (root) json_object_put(root);
    free(text);
    return st;
}

mt_status st_open_dir(const char *dir, st_archive **out, mt_error *err) {
    if (!dir || !out) return mt_errorf(err, MT_ERR_INVALID, "st_open_dir: no directory");
    char *index = path_join(dir, ST_INDEX_NAME), *single = path_join(dir, ST_SINGLE_NAME);
    mt_status st;
    if (!index || !single) {
        st = mt_errorf(err, MT_ERR_NOMEM, "%s: out of memory", dir);
    } else if (access(index, F_OK) == 0) {
        st = open_index(dir, index, out, err);
    } else if (access(single, F_OK) == 0) {
        st = st_open_file(single, out, err);
    } else {
        struct stat sb;
        st = mt_errorf(err, MT_ERR_NOT_FOUND, "%s: %s", dir,
                       stat(dir, &sb) != 0 ? "no such directory"
                                           : "holds neither " ST_SINGLE_NAME " nor " ST_INDEX_NAME);
    }
    free(index);
    free(single);
    return st;
}

const st_tensor *st_find(const st_archive *ar, const char *name) {
    if (!ar || !name || !ar->by_name) return NULL;
    size_t lo = 0, hi = ar->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(ar->by_name[mid]->name, name);
        if (c == 0) return ar->by_name[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

/* t has exactly the given shape. */
static mt_status check_shape(const st_tensor *t, int ndim, const int64_t *shape, const st_tensor **out,
                             mt_error *err) {
    bool same = t->ndim == ndim;
    for (int i = 0; same && i < ndim; i++) same = t->shape[i] == shape[i];
    if (!same) {
        char want[96], got[96];
        if (ndim < 0 || ndim > ST_MAX_DIMS) snprintf(want, sizeof want, "(%d dims)", ndim);
        else shape_str(want, sizeof want, ndim, shape);
        shape_str(got, sizeof got, t->ndim, t->shape);
        return mt_errorf(err, MT_ERR_INVALID, "%s: tensor %.200s has shape %s, expected %s", t->file,
                         t->name, got, want);
    }
    if (out) *out = t;
    return MT_OK;
}

mt_status st_get(const st_archive *ar, const char *name, int ndim, const int64_t *shape,
                 const st_tensor **out, mt_error *err) {
    if (!ar || !name) return mt_errorf(err, MT_ERR_INVALID, "st_get: no archive or name");
    const st_tensor *t = st_find(ar, name);
    if (!t) return mt_errorf(err, MT_ERR_NOT_FOUND, "%s: tensor %.200s is missing", ar->where, name);
    if (!dtype_is_float(t->dtype))
        return mt_errorf(err, MT_ERR_INVALID, "%s: tensor %.200s has dtype %s, expected F32, F16 or BF16%s",
                         t->file, name, mt_dtype_name(t->dtype),
                         t->dtype == MT_F8E4M3 ? " (only linear weights may be FP8)" : "");
    return check_shape(t, ndim, shape, out, err);
}

/* ------------------------------------------------------------------------------------------ */
/* Block-scaled FP8                                                                           */

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* The scale at [i][j] of a float scale tensor with ncb columns (the data may be unaligned). */
static float scale_at(const st_tensor *s, int64_t i, int64_t j, int64_t ncb) {
    const size_t k = (size_t)(i * ncb + j), es = mt_dtype_size(s->dtype);
    float v;
    mt_to_f32(&v, (const char *)s->data + k * es, s->dtype, 1);
    return v;
}

mt_status st_get_weight(const st_archive *ar, const char *name, int ndim, const int64_t *shape, int bm, int bn,
                        const st_tensor **out, const st_tensor **scale, mt_error *err) {
    if (!ar || !name) return mt_errorf(err, MT_ERR_INVALID, "st_get_weight: no archive or name");
    const st_tensor *t = st_find(ar, name);
    if (!t || t->dtype != MT_F8E4M3) {
        mt_status st = st_get(ar, name, ndim, shape, out, err);
        if (st == MT_OK && scale) *scale = NULL;
        return st;
    }
    mt_status st = check_shape(t, ndim, shape, NULL, err);
    if (st != MT_OK) return st;
    if (t->ndim != 2)
        return mt_errorf(err, MT_ERR_UNSUPPORTED, "%s: tensor %.200s is F8_E4M3 with %d dims; only matrices may be FP8",
                         t->file, name, t->ndim);
    if (bm <= 0 || bn <= 0)
        return mt_errorf(err, MT_ERR_INVALID,
                         "%s: tensor %.200s is F8_E4M3 but config.json has no FP8 quantization_config "
                         "(its weight_block_size gives the scale blocks)", t->file, name);
    char sname[256];
    if ((size_t)snprintf(sname, sizeof sname, "%s_scale_inv", name) >= sizeof sname)
        return mt_errorf(err, MT_ERR_INVALID, "%s: tensor name %.200s is too long", t->file, name);
    const st_tensor *s = st_find(ar, sname);
    if (!s)
        return mt_errorf(err, MT_ERR_NOT_FOUND, "%s: tensor %.200s is F8_E4M3 but its block scales %.200s are missing",
                         ar->where, name, sname);
    if (!dtype_is_float(s->dtype))
        return mt_errorf(err, MT_ERR_INVALID, "%s: tensor %.200s has dtype %s, expected F32, F16 or BF16", s->file,
                         sname, mt_dtype_name(s->dtype));
    const int64_t rows = t->shape[0], cols = t->shape[1];
    const int64_t want[2] = { ceil_div(rows, bm), ceil_div(cols, bn) };
    if (s->ndim != 2 || s->shape[0] != want[0] || s->shape[1] != want[1]) {
        char got[96];
        shape_str(got, sizeof got, s->ndim, s->shape);
        return mt_errorf(err, MT_ERR_INVALID,
                         "%s: tensor %.200s has shape %s, but %.200s [%lld, %lld] in blocks of %d x %d "
                         "(quantization_config.weight_block_size) needs [%lld, %lld]",
                         s->file, sname, got, name, (long long)rows, (long long)cols, bm, bn,
                         (long long)want[0], (long long)want[1]);
    }
    for (int64_t i = 0; i < want[0]; i++)
        for (int64_t j = 0; j < want[1]; j++) {
            const float v = scale_at(s, i, j, want[1]);
            if (!isfinite(v))
                return mt_errorf(err, MT_ERR_INVALID, "%s: tensor %.200s holds %g at [%lld, %lld]", s->file, sname,
                                 (double)v, (long long)i, (long long)j);
        }
    if (out) *out = t;
    if (scale) *scale = s;
    return MT_OK;
}

mt_status st_dequant_fp8(const st_tensor *w, const st_tensor *scale, int bm, int bn, int64_t r0, int64_t nr,
                         int64_t c0, int64_t nc, mt_dtype out, void *dst, mt_error *err) {
    if (!w || !scale || !dst) return mt_errorf(err, MT_ERR_INVALID, "st_dequant_fp8: no tensor, scale or output");
    if (w->dtype != MT_F8E4M3 || w->ndim != 2)
        return mt_errorf(err, MT_ERR_INVALID, "%s: tensor %.200s is not an F8_E4M3 matrix", w->file, w->name);
    if (out != MT_F32 && out != MT_BF16 && out != MT_F16)
        return mt_errorf(err, MT_ERR_INVALID, "st_dequant_fp8: output dtype %s is not F32, F16 or BF16",
                         mt_dtype_name(out));
    const int64_t rows = w->shape[0], cols = w->shape[1];
    if (bm <= 0 || bn <= 0 || !dtype_is_float(scale->dtype) || scale->ndim != 2 ||
        scale->shape[0] != ceil_div(rows, bm) || scale->shape[1] != ceil_div(cols, bn))
        return mt_errorf(err, MT_ERR_INVALID, "%s: scales %.200s do not fit %.200s in blocks of %d x %d",
                         scale->file, scale->name, w->name, bm, bn);
    if (r0 < 0 || nr < 0 || c0 < 0 || nc < 0 || r0 + nr > rows || c0 + nc > cols)
        return mt_errorf(err, MT_ERR_INVALID,
                         "%s: tensor %.200s: rows [%lld, +%lld) x columns [%lld, +%lld) are outside [%lld, %lld]",
                         w->file, w->name, (long long)r0, (long long)nr, (long long)c0, (long long)nc,
                         (long long)rows, (long long)cols);
    float lut[256];
    for (int b = 0; b < 256; b++) lut[b] = mt_f8e4m3_to_f32((uint8_t)b);
    const int64_t ncb = scale->shape[1];
    const uint8_t *q = w->data;
    for (int64_t i = 0; i < nr; i++) {
        const int64_t r = r0 + i;
        const uint8_t *src = q + (size_t)r * (size_t)cols;
        for (int64_t c = c0; c < c0 + nc;) {
            const int64_t end = c - c % bn + bn < c0 + nc ? c - c % bn + bn : c0 + nc; /* this block's columns */
            const float sc = scale_at(scale, r / bm, c / bn, ncb);
            for (; c < end; c++) {
                const uint8_t b = src[c];
                if ((b & 0x7f) == 0x7f)
                    return mt_errorf(err, MT_ERR_INVALID, "%s: tensor %.200s holds an FP8 NaN (0x%02x) at [%lld, %lld]",
                                     w->file, w->name, b, (long long)r, (long long)c);
                /* one fp32 product, so any other implementation that multiplies in fp32 agrees bitwise */
                const float v = lut[b] * sc;
                const size_t k = (size_t)i * (size_t)nc + (size_t)(c - c0);
                if (out == MT_F32) ((float *)dst)[k] = v;
                else if (out == MT_BF16) ((uint16_t *)dst)[k] = mt_f32_to_bf16(v);
                else ((uint16_t *)dst)[k] = mt_f32_to_f16(v);
            }
        }
    }
    return MT_OK;
}

size_t st_count(const st_archive *ar) { return ar ? ar->n : 0; }

const st_tensor *st_at(const st_archive *ar, size_t i) {
    return ar && i < ar->n ? &ar->t[i] : NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* Writer                                                                                     */

typedef struct st_entry {
    char *name;
    mt_dtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    uint64_t nbytes;
    void *data;        /* owned copy, or NULL when deferred */
    st_fill_fn fill;   /* deferred producer */
    void *user;
} st_entry;

struct st_writer {
    st_entry *e; /* [n] */
    size_t n, cap;
    size_t *slots; /* open-addressing name set: entry index + 1, 0 = empty; [nslots] */
    size_t nslots;
};

static uint64_t hash_name(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

st_writer *st_writer_new(void) { return calloc(1, sizeof(st_writer)); }

size_t st_writer_count(const st_writer *w) { return w ? w->n : 0; }

void st_writer_free(st_writer *w) {
    if (!w) return;
    for (size_t i = 0; i < w->n; i++) {
        free(w->e[i].name);
        free(w->e[i].data);
    }
    free(w->e);
    free(w->slots);
    free(w);
}

/* The slot holding name, or the empty slot where it would go. */
static size_t *slot_for(const st_writer *w, const char *name) {
    size_t mask = w->nslots - 1, i = (size_t)hash_name(name) & mask;
    while (w->slots[i] && strcmp(w->e[w->slots[i] - 1].name, name)) i = (i + 1) & mask;
    return &w->slots[i];
}

static bool grow_slots(st_writer *w) {
    size_t ns = w->nslots ? w->nslots * 2 : 1024;
    size_t *s = calloc(ns, sizeof *s), *old = w->slots;
    if (!s) return false;
    w->slots = s;
    w->nslots = ns;
    for (size_t i = 0; i < w->n; i++) *slot_for(w, w->e[i].name) = i + 1;
    free(old);
    return true;
}

static mt_status writer_push(st_writer *w, const char *name, mt_dtype dtype, int ndim,
                             const int64_t *shape, const void *data, st_fill_fn fill, void *user,
                             mt_error *err) {
    if (!w) return mt_errorf(err, MT_ERR_INVALID, "st_writer: no writer");
    if (!name || !*name || !strcmp(name, "__metadata__"))
        return mt_errorf(err, MT_ERR_INVALID, "st_writer: tensor name \"%.160s\" is not allowed",
                         name ? name : "");
    if (!dtype_valid(dtype))
        return mt_errorf(err, MT_ERR_INVALID, "st_writer: tensor %.160s: unknown dtype %d", name, (int)dtype);
    if (ndim < 0 || ndim > ST_MAX_DIMS || (ndim > 0 && !shape))
        return mt_errorf(err, MT_ERR_INVALID, "st_writer: tensor %.160s: ndim %d outside 0..%d", name,
                         ndim, ST_MAX_DIMS);
    uint64_t nbytes;
    if (!shape_bytes(ndim, shape, mt_dtype_size(dtype), &nbytes) || nbytes > SIZE_MAX / 2)
        return mt_errorf(err, MT_ERR_INVALID, "st_writer: tensor %.160s: bad shape", name);
    if (!fill && !data && nbytes)
        return mt_errorf(err, MT_ERR_INVALID, "st_writer: tensor %.160s: no data", name);
    if ((w->n + 1) * 2 > w->nslots && !grow_slots(w))
        return mt_errorf(err, MT_ERR_NOMEM, "st_writer: out of memory");
    size_t *slot = slot_for(w, name);
    if (*slot) return mt_errorf(err, MT_ERR_INVALID, "st_writer: tensor %.160s added twice", name);
    if (w->n == w->cap) {
        size_t cap = w->cap ? w->cap * 2 : 256;
        st_entry *ne = realloc(w->e, cap * sizeof *ne);
        if (!ne) return mt_errorf(err, MT_ERR_NOMEM, "st_writer: out of memory");
        w->e = ne;
        w->cap = cap;
    }
    st_entry en;
    memset(&en, 0, sizeof en);
    en.name = strdup(name);
    if (!en.name) return mt_errorf(err, MT_ERR_NOMEM, "st_writer: out of memory");
    if (!fill && nbytes) {
        if (!(en.data = malloc((size_t)nbytes))) {
            free(en.name);
            return mt_errorf(err, MT_ERR_NOMEM, "st_writer: tensor %.160s: out of memory", name);
        }
        memcpy(en.data, data, (size_t)nbytes);
    }
    en.dtype = dtype;
    en.ndim = ndim;
    for (int i = 0; i < ndim; i++) en.shape[i] = shape[i];
    en.nbytes = nbytes;
    en.fill = fill;
    en.user = user;
    w->e[w->n++] = en;
    *slot = w->n;
    return MT_OK;
}

mt_status st_writer_add(st_writer *w, const char *name, mt_dtype dtype, int ndim,
                        const int64_t *shape, const void *data, mt_error *err) {
    return writer_push(w, name, dtype, ndim, shape, data, NULL, NULL, err);
}

mt_status st_writer_add_deferred(st_writer *w, const char *name, mt_dtype dtype, int ndim,
                                 const int64_t *shape, st_fill_fn fill, void *user, mt_error *err) {
    if (!fill) return mt_errorf(err, MT_ERR_INVALID, "st_writer: tensor %.160s: no fill function",
                                name ? name : "");
    return writer_push(w, name, dtype, ndim, shape, NULL, fill, user, err);
}

static mt_status write_all(int fd, const void *buf, size_t n, const char *path, mt_error *err) {
    const char *p = buf;
    while (n) {
        ssize_t r = write(fd, p, n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return mt_errorf(err, MT_ERR_IO, "%s: write failed: %s", path, strerror(r < 0 ? errno : EIO));
        p += r;
        n -= (size_t)r;
    }
    return MT_OK;
}

/* Adds v (owned) under k; false when v is NULL (an allocation failed) or the add fails. */
static bool obj_add(json_object *o, const char *k, json_object *v) {
    if (!o || !v) {
        json_object_put(v);
        return false;
    }
    if (json_object_object_add(o, k, v) != 0) {
        json_object_put(v);
        return false;
    }
    return true;
}

/* Appends v (owned) to array a; false on failure. */
static bool arr_add(json_object *a, json_object *v) {
    if (!a || !v || json_object_array_add(a, v) != 0) {
        json_object_put(v);
        return false;
    }
    return true;
}

/* The header JSON of entries [a, b), padded with spaces to a multiple of 8 bytes; NULL when out
 * of memory. */
static char *shard_header(const st_writer *w, size_t a, size_t b, size_t *len) {
    json_object *root = json_object_new_object(), *meta = json_object_new_object();
    bool ok = obj_add(meta, "format", json_object_new_string("pt"));
    ok = obj_add(root, "__metadata__", meta) && ok;
    uint64_t off = 0;
    for (size_t i = a; i < b && ok; i++) {
        const st_entry *e = &w->e[i];
        json_object *o = json_object_new_object(), *shape = json_object_new_array(),
                    *offs = json_object_new_array();
        for (int d = 0; d < e->ndim; d++) ok = arr_add(shape, json_object_new_int64(e->shape[d])) && ok;
        ok = arr_add(offs, json_object_new_int64((int64_t)off)) && ok;
        ok = arr_add(offs, json_object_new_int64((int64_t)(off + e->nbytes))) && ok;
        off += e->nbytes;
        ok = obj_add(o, "dtype", json_object_new_string(mt_dtype_name(e->dtype))) && ok;
        ok = obj_add(o, "shape", shape) && ok;
        ok = obj_add(o, "data_offsets", offs) && ok;
        ok = obj_add(root, e->name, o) && ok;
    }
    char *out = NULL;
    const char *s = ok ? json_object_to_json_string_ext(root, JSON_C_TO_STRING_PLAIN | JSON_C_TO_STRING_NOSLASHESCAPE)
                       : NULL;
    if (s) {
        size_t n = strlen(s), padded = (n + 7) & ~(size_t)7;
        if ((out = malloc(padded + 1))) {
            memcpy(out, s, n);
            memset(out + n, ' ', padded - n);
            out[padded] = 0;
            *len = padded;
        }
    }
    json_object_put(root);
    return out;
}

/* Writes entries [a, b) as one safetensors file at path. */
static mt_status write_shard(st_writer *w, size_t a, size_t b, const char *path, uint8_t **buf,
                             mt_error *err) {
    size_t hlen = 0;
    char *hdr = shard_header(w, a, b, &hlen);
    if (!hdr) return mt_errorf(err, MT_ERR_NOMEM, "%s: out of memory building the header", path);
    mt_status st = MT_OK;
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        st = mt_errorf(err, MT_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
        free(hdr);
        return st;
    }
    uint8_t len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
    if ((st = write_all(fd, len8, 8, path, err)) != MT_OK) goto done;
    if ((st = write_all(fd, hdr, hlen, path, err)) != MT_OK) goto done;
    for (size_t i = a; i < b; i++) {
        st_entry *e = &w->e[i];
        if (!e->fill) {
            if ((st = write_all(fd, e->data, (size_t)e->nbytes, path, err)) != MT_OK) goto done;
            continue;
        }
        if (!*buf && !(*buf = malloc(ST_WRITER_CHUNK))) {
            st = mt_errorf(err, MT_ERR_NOMEM, "%s: out of memory", path);
            goto done;
        }
        for (uint64_t off = 0; off < e->nbytes; off += ST_WRITER_CHUNK) {
            size_t n = (size_t)(e->nbytes - off < ST_WRITER_CHUNK ? e->nbytes - off : ST_WRITER_CHUNK);
            if ((st = e->fill(e->user, i, off, *buf, n, err)) != MT_OK) goto done;
            if ((st = write_all(fd, *buf, n, path, err)) != MT_OK) goto done;
        }
    }
done:
    if (close(fd) != 0 && st == MT_OK)
        st = mt_errorf(err, MT_ERR_IO, "%s: close failed: %s", path, strerror(errno));
    free(hdr);
    return st;
}

static mt_status write_index(const st_writer *w, const size_t *shard_of, size_t nshards,
                             const char *path, mt_error *err) {
    uint64_t total = 0;
    for (size_t i = 0; i < w->n; i++) total += w->e[i].nbytes;
    json_object *root = json_object_new_object(), *meta = json_object_new_object(),
                *wm = json_object_new_object();
    bool ok = obj_add(meta, "total_size", json_object_new_int64((int64_t)total));
    for (size_t i = 0; i < w->n && ok; i++) {
        char fn[64];
        snprintf(fn, sizeof fn, "model-%05zu-of-%05zu.safetensors", shard_of[i] + 1, nshards);
        ok = obj_add(wm, w->e[i].name, json_object_new_string(fn));
    }
    ok = obj_add(root, "metadata", meta) && ok; /* root owns meta and wm from here */
    ok = obj_add(root, "weight_map", wm) && ok;
    const char *s = ok ? json_object_to_json_string_ext(root, JSON_C_TO_STRING_PRETTY | JSON_C_TO_STRING_SPACED |
                                                                  JSON_C_TO_STRING_NOSLASHESCAPE)
                       : NULL;
    mt_status st = MT_OK;
    if (!s) {
        st = mt_errorf(err, MT_ERR_NOMEM, "%s: out of memory", path);
    } else {
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd < 0) {
            st = mt_errorf(err, MT_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
        } else {
            st = write_all(fd, s, strlen(s), path, err);
            if (st == MT_OK) st = write_all(fd, "\n", 1, path, err);
            if (close(fd) != 0 && st == MT_OK)
                st = mt_errorf(err, MT_ERR_IO, "%s: close failed: %s", path, strerror(errno));
        }
    }
    json_object_put(root);
    return st;
}

mt_status st_writer_save(st_writer *w, const char *dir, size_t shard_bytes, mt_error *err) {
    if (!w || !dir) return mt_errorf(err, MT_ERR_INVALID, "st_writer_save: no writer or directory");
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return mt_errorf(err, MT_ERR_IO, "%s: cannot create directory: %s", dir, strerror(errno));

    /* Shard boundaries: greedy, in order. */
    size_t *shard_of = malloc((w->n ? w->n : 1) * sizeof *shard_of);
    size_t *start = malloc((w->n + 2) * sizeof *start);
    char **made = calloc(w->n + 2, sizeof *made); /* paths created so far, removed on failure */
    size_t nmade = 0, nshards = 0;
    uint8_t *buf = NULL;
    mt_status st = MT_OK;
    if (!shard_of || !start || !made) {
        st = mt_errorf(err, MT_ERR_NOMEM, "%s: out of memory", dir);
        goto done;
    }
    start[0] = 0;
    if (shard_bytes == 0 || w->n == 0) {
        for (size_t i = 0; i < w->n; i++) shard_of[i] = 0;
        nshards = 1;
    } else {
        uint64_t used = 0;
        for (size_t i = 0; i < w->n; i++) {
            if (i > start[nshards] && used + w->e[i].nbytes > shard_bytes) {
                start[++nshards] = i;
                used = 0;
            }
            used += w->e[i].nbytes;
            shard_of[i] = nshards;
        }
        nshards++;
    }
    start[nshards] = w->n;

    if (shard_bytes == 0) {
        char *path = path_join(dir, ST_SINGLE_NAME), *index = path_join(dir, ST_INDEX_NAME);
        if (!path || !index) {
            free(path);
            free(index);
            st = mt_errorf(err, MT_ERR_NOMEM, "%s: out of memory", dir);
            goto done;
        }
        made[nmade++] = path;
        st = write_shard(w, 0, w->n, path, &buf, err);
        if (st == MT_OK && unlink(index) != 0 && errno != ENOENT)
            st = mt_errorf(err, MT_ERR_IO, "%s: cannot remove the stale index: %s", index, strerror(errno));
        free(index);
        goto done;
    }
    for (size_t s = 0; s < nshards; s++) {
        char fn[64];
        snprintf(fn, sizeof fn, "model-%05zu-of-%05zu.safetensors", s + 1, nshards);
        if (!(made[nmade] = path_join(dir, fn))) {
            st = mt_errorf(err, MT_ERR_NOMEM, "%s: out of memory", dir);
            goto done;
        }
        if ((st = write_shard(w, start[s], start[s + 1], made[nmade++], &buf, err)) != MT_OK) goto done;
    }
    if (!(made[nmade] = path_join(dir, ST_INDEX_NAME))) {
        st = mt_errorf(err, MT_ERR_NOMEM, "%s: out of memory", dir);
        goto done;
    }
    st = write_index(w, shard_of, nshards, made[nmade++], err);
done:
    for (size_t i = 0; i < nmade; i++) {
        if (st != MT_OK) unlink(made[i]);
        free(made[i]);
    }
    free(made);
    free(buf);
    free(start);
    free(shard_of);
    return st;
}
