/* worker/loader/safetensors.h: read-only, memory-mapped safetensors checkpoints.
 *
 * Owner: the model loader. st_open_dir opens a checkpoint directory holding either one
 * "model.safetensors" or the shards listed by "model.safetensors.index.json". Every header is
 * parsed with json-c and checked against its file before any tensor is handed out: offsets inside
 * the data section and non-overlapping, byte counts equal to shape x dtype size, a file not
 * shorter than its header says. Errors name the file and the tensor.
 *
 * Lifetime: tensor views (st_tensor) and their data point into the mappings and stay valid until
 * st_close. Thread-safety: an opened archive is immutable; concurrent readers are fine.
 */
#ifndef ST_SAFETENSORS_H
#define ST_SAFETENSORS_H

#include "common/mt.h"

#ifdef __cplusplus
extern "C" {
#endif

#define ST_MAX_DIMS 8 /* vision patch embeddings are 5-D */

typedef struct st_tensor {
    const char *name;             /* owned by the archive */
    const char *file;             /* path of the file holding it, owned by the archive */
    mt_dtype dtype;               /* F32, F16, BF16, F8E4M3, I32, I64, U8 */
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    const void *data;             /* into the mapping; not aligned beyond 1 byte in general */
    size_t nbytes;
} st_tensor;

typedef struct st_archive st_archive;

/* Opens dir/model.safetensors, or the shards of dir/model.safetensors.index.json when present. */
mt_status st_open_dir(const char *dir, st_archive **out, mt_error *err);

/* Opens a single safetensors file. */
mt_status st_open_file(const char *path, st_archive **out, mt_error *err);

/* NULL when absent. */
const st_tensor *st_find(const st_archive *ar, const char *name);

/* Finds name and checks it has exactly the given shape and a float dtype (F32/F16/BF16).
 * Missing tensor -> MT_ERR_NOT_FOUND; wrong shape or dtype -> MT_ERR_INVALID; err names both. */
mt_status st_get(const st_archive *ar, const char *name, int ndim, const int64_t *shape,
                 const st_tensor **out, mt_error *err);

/* A weight matrix that may be stored as block-scaled FP8, as GLM and DeepSeek publish them
 * (docs/MODEL.md, "FP8 checkpoints"): an F8_E4M3 tensor W_q [rows, cols] and, beside it, the F32
 * (or F16/BF16) tensor "<name>_scale_inv" [ceil(rows / bm), ceil(cols / bn)] of one scale a
 * bm x bn block; W[i][j] = fp8(W_q[i][j]) * scale_inv[i / bm][j / bn], the blocks at the right and
 * bottom edges possibly partial.
 *
 * st_get_weight finds name with exactly the given shape. Stored at a float dtype it is st_get,
 * and *scale is set to NULL. Stored as F8_E4M3 it must be a matrix, the block size bm x bn (from
 * config.json's quantization_config.weight_block_size) must be known (> 0), and its scales must
 * be present, of a float dtype, of exactly the shape above and finite; *scale points to them.
 * Errors name the tensor: MT_ERR_NOT_FOUND for a missing tensor or scale, MT_ERR_INVALID for a
 * wrong shape, dtype or scale, or an unknown block size. */
mt_status st_get_weight(const st_archive *ar, const char *name, int ndim, const int64_t *shape, int bm, int bn,
                        const st_tensor **out, const st_tensor **scale, mt_error *err);

/* Dequantises rows [r0, r0 + nr) x columns [c0, c0 + nc) of the F8_E4M3 matrix w with its block
 * scales (as st_get_weight returned them) into dst, [nr, nc] row-major at dtype out (F32, BF16 or
 * F16). Each element is one fp32 product fp8 * scale, then rounded to out to nearest even. The
 * rectangle may cut through blocks (a tensor-parallel shard). An FP8 NaN (0x7f, 0xff) in the
 * rectangle is MT_ERR_INVALID naming its position; dst may then be partly written. */
mt_status st_dequant_fp8(const st_tensor *w, const st_tensor *scale, int bm, int bn, int64_t r0, int64_t nr,
                         int64_t c0, int64_t nc, mt_dtype out, void *dst, mt_error *err);

size_t st_count(const st_archive *ar);
const st_tensor *st_at(const st_archive *ar, size_t i);

/* Unmaps everything. NULL is fine. */
void st_close(st_archive *ar);

/* Writer, for tools and tests: collects tensors, then writes one file (or shards of at most
 * shard_bytes each plus the index when shard_bytes > 0). Data is copied at st_writer_add. A
 * writer belongs to one thread. */
typedef struct st_writer st_writer;
st_writer *st_writer_new(void);
/* Copies the prod(shape) * dtype-size bytes at data. Rejects a duplicate or empty name, ndim
 * outside 0..ST_MAX_DIMS and negative dims; on failure the writer is unchanged. */
mt_status st_writer_add(st_writer *w, const char *name, mt_dtype dtype, int ndim,
                        const int64_t *shape, const void *data, mt_error *err);

/* Streaming: a tensor whose bytes are produced at st_writer_save time, so a checkpoint larger
 * than memory can be written. fill is called with consecutive pieces [offset, offset + nbytes)
 * of the tensor's bytes, in order, from the thread calling st_writer_save; offset and nbytes are
 * multiples of 8 bytes except for the tensor's last piece, and a piece is at most
 * ST_WRITER_CHUNK bytes. index is the tensor's position among the writer's tensors (0-based,
 * in st_writer_add* order). A non-OK return aborts the save with that status and err. */
#define ST_WRITER_CHUNK ((size_t)64 << 20)
typedef mt_status (*st_fill_fn)(void *user, size_t index, uint64_t offset, void *dst,
                                size_t nbytes, mt_error *err);
mt_status st_writer_add_deferred(st_writer *w, const char *name, mt_dtype dtype, int ndim,
                                 const int64_t *shape, st_fill_fn fill, void *user, mt_error *err);
/* Number of tensors added so far. */
size_t st_writer_count(const st_writer *w);

/* Writes into dir (created if missing): model.safetensors, or, when shard_bytes > 0, shards
 * model-0000i-of-0000n.safetensors of at most shard_bytes of tensor data each (a larger tensor
 * gets a shard of its own) plus model.safetensors.index.json. Tensors keep their st_writer_add
 * order. A single-file save removes a stale model.safetensors.index.json, which would shadow
 * it in st_open_dir. On failure the files this call created are removed. The writer can be
 * saved again. */
mt_status st_writer_save(st_writer *w, const char *dir, size_t shard_bytes, mt_error *err);
void st_writer_free(st_writer *w);

#ifdef __cplusplus
}
#endif
#endif /* ST_SAFETENSORS_H */
