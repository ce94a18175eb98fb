/* kernels/cuda/cuda_random.cu: random weights made on the device (backend slot weight_random),
 * bit-identical to the CPU backend's (common/mt_rand.h), so the bench-4L benchmark's ~48 GB of
 * weights need no file and no host copy. Three tiers: kernel, launcher, the op. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/mt_rand.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"

typedef struct rand_params {
    void *dst;          /* [n] of dtype */
    mt_dtype dtype;     /* F32, F16, BF16 */
    uint64_t n, key;
    float mean, std;
} rand_params;

/* Grid-stride: element i = mean + std * N(key, i), rounded to the stored dtype. */
static __global__ void rand_fill_kernel(rand_params p) {
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += stride) {
        const float v = p.mean + p.std * mt_rand_normal(p.key, i);
        if (p.dtype == MT_F32) ((float *)p.dst)[i] = v;
        else if (p.dtype == MT_BF16) ((__nv_bfloat16 *)p.dst)[i] = __float2bfloat16_rn(v);
        else ((__half *)p.dst)[i] = __float2half_rn(v);
    }
}

static void rand_fill_launch(mt_backend *be, const rand_params *p) {
    const uint64_t blocks = (p->n + 255) / 256;
    const unsigned grid = blocks < 65536 ? (unsigned)blocks : 65536u;
    rand_fill_kernel<<<grid ? grid : 1, 256, 0, cu_stream(be)>>>(*p);
    cu_check_launch(be, "weight_random");
}

static mt_status cu_weight_random(mt_backend *be, mt_dtype dt, int64_t rows, int64_t cols,
                                  uint64_t key, float mean, float std, mt_weight *out) {
    MT_ASSERT(dt == MT_F32 || dt == MT_F16 || dt == MT_BF16);
    MT_ASSERT(rows >= 0 && cols >= 0);
    const uint64_t n = (uint64_t)rows * (uint64_t)cols;
    void *p = NULL;
    const size_t bytes = (size_t)n * mt_dtype_size(dt);
    if (cudaMalloc(&p, bytes > 0 ? bytes : 1) != cudaSuccess) {
        (void)cudaGetLastError();
        mt_log(MT_LOG_ERROR, "cuda backend: out of device memory for a %lld x %lld %s random weight",
               (long long)rows, (long long)cols, mt_dtype_name(dt));
        return MT_ERR_NOMEM;
    }
    rand_params rp = { p, dt, n, key, mean, std };
    if (n) rand_fill_launch(be, &rp);
    /* Finished before any use: the GEMVs prefetch weights before their dependent-launch wait
     * (cuda_dense.cu), so a weight must not still be being written when one starts. */
    MT_CUDA_(cudaStreamSynchronize(((cu_backend *)be)->stream), "cudaStreamSynchronize(weight_random)",
             return mt_st_);
    *out = (mt_weight){ p, dt, rows, cols, true };
    return MT_OK;
}

extern "C" void cu_random_fill(mt_backend_ops *t) {
    t->weight_random = cu_weight_random;
}
