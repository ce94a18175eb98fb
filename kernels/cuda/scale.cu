/* kernels/cuda/scale.cu: see scale.h. Three tiers: kernel, launcher, exported op. */
#include "kernels/cuda/scale.h"

#include "kernels/cuda/cuda_check.h"

typedef struct scale_params {
    float *y;       /* [n] fp32, may alias x */
    const float *x; /* [n] fp32 */
    float a;
    size_t n;
} scale_params;

enum { SCALE_BLOCK = 256, SCALE_MAX_GRID = 65536 };

/* Grid-stride loop: each thread handles elements i, i + stride, ... */
static __global__ void scale_f32_kernel(scale_params p) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += stride)
        p.y[i] = p.a * p.x[i];
}

/* One thread per element up to SCALE_MAX_GRID blocks, then threads loop. */
static mt_status scale_f32_launch(const scale_params *p, cudaStream_t s) {
    size_t blocks = (p->n + SCALE_BLOCK - 1) / SCALE_BLOCK;
    unsigned grid = blocks < SCALE_MAX_GRID ? (unsigned)blocks : SCALE_MAX_GRID;
    scale_f32_kernel<<<grid, SCALE_BLOCK, 0, s>>>(*p);
    MT_CUDA_CHECK_LAUNCH();
    return MT_OK;
}

extern "C" mt_status mt_cuda_scale(float *y, const float *x, float a, size_t n, cudaStream_t s) {
    if (n == 0) return MT_OK;
    if (!y || !x) {
        mt_log(MT_LOG_ERROR, "mt_cuda_scale: NULL %s with n = %zu", !y ? "y" : "x", n);
        return MT_ERR_INVALID;
    }
    scale_params p = {y, x, a, n};
    return scale_f32_launch(&p, s);
}
