/* kernels/cuda/cuda_hc.cu: manifold-constrained hyper-connections, the same functions as
 * kernels/cpu/cpu_hc.c. hc_pre = the (2+S)S projection of the flattened highway (cu_matmul, so it
 * runs at weight bandwidth) + one block per row for the rms factor, sigmoids, softmax, Sinkhorn
 * and the collapse; hc_post and hc_head are one thread per (row, d). */
#include <limits.h>
#include <math.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"

enum { HC_MAX_S = 16, HC_MIX_THREADS = 256, HC_EW_THREADS = 256 };

typedef struct hc_pre_params {
    float *y;              /* [n, H] */
    float *post;           /* [n, S] */
    float *comb;           /* [n, S, S]; comb[r][s] mixes stream r into s */
    const float *X;        /* [n, S, H] highway */
    const float *m;        /* [n, (2+S)S] fn . X rows, before the rms factor */
    const float *base;     /* [(2+S)S] */
    const float *scale;    /* [3] */
    int n, S, H;
    float rms_eps, hc_eps;
    int sinkhorn_iters;
} hc_pre_params;

static __device__ __forceinline__ float hc_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

/* One block per row. The S x S work is spread over the first S*S threads, one matrix element
 * each; every row or column sum is taken by each thread over the same elements in the CPU's
 * order (ascending index), so the result matches kernels/cpu/cpu_hc.c operation for operation.
 * A barrier separates every read-all phase from the write phase after it. */
static __global__ void __launch_bounds__(HC_MIX_THREADS) hc_pre_mix_kernel(const hc_pre_params p) {
    __shared__ double red[32];
    __shared__ float pre[HC_MAX_S];
    __shared__ float C[HC_MAX_S * HC_MAX_S];
    const int i = blockIdx.x, S = p.S, H = p.H, SH = S * H, tid = threadIdx.x;
    const float *x = p.X + (int64_t)i * SH;
    /* Unrolled so the loads of a thread are in flight together: one row is latency-bound, not
     * bandwidth-bound (the summation order is unchanged). */
    double ss = 0;
#pragma unroll 16
    for (int j = tid; j < SH; j += blockDim.x) ss += (double)x[j] * x[j];
    ss = cu_block_sum(ss, red);
    const float r = 1.f / sqrtf((float)(ss / SH) + p.rms_eps);
    const float *m = p.m + (int64_t)i * (2 + S) * S;
    const float *base = p.base, *scale = p.scale;
    if (S * S <= 32) {
        /* Small S (4 in the real model): warp 0 alone, lane a*S+b holding C[a][b]; a row or
         * column sum gathers its S values by shuffles and adds them in ascending index, the
         * CPU's order, with no block barrier in the 20 Sinkhorn iterations. */
        if (tid < 32) {
            const int lane = tid, a = lane < S * S ? lane / S : 0, b = lane < S * S ? lane % S : 0;
            float c = 0.f;
            if (lane < S) {
                pre[lane] = hc_sigmoid(__fadd_rn(__fmul_rn(__fmul_rn(m[lane], r), scale[0]), base[lane])) + p.hc_eps;
                p.post[(int64_t)i * S + lane] =
                    2.f * hc_sigmoid(__fadd_rn(__fmul_rn(__fmul_rn(m[S + lane], r), scale[1]), base[S + lane]));
            }
            if (lane < S * S) c = __fadd_rn(__fmul_rn(__fmul_rn(m[2 * S + lane], r), scale[2]), base[2 * S + lane]);
            float mx = -INFINITY;
            for (int k = 0; k < S; k++) mx = fmaxf(mx, __shfl_sync(0xffffffffu, c, a * S + k));
            const float e = expf(c - mx);
            float sum = 0.f;
            for (int k = 0; k < S; k++) sum += __shfl_sync(0xffffffffu, e, a * S + k);
            c = e / sum + p.hc_eps;
            for (int it = 0; it < p.sinkhorn_iters; it++) {
                if (it > 0) {
                    float rs = 0.f;
                    for (int k = 0; k < S; k++) rs += __shfl_sync(0xffffffffu, c, a * S + k);
                    c /= rs + p.hc_eps;
                }
                float cs = 0.f;
                for (int k = 0; k < S; k++) cs += __shfl_sync(0xffffffffu, c, k * S + b);
                c /= cs + p.hc_eps;
            }
            if (lane < S * S) p.comb[(int64_t)i * S * S + lane] = c;
        }
        __syncthreads(); /* pre[] for the collapse below */
    } else {
        const bool own = tid < S * S;        /* this thread owns C[a][b] */
        const int a = tid / S, b = tid % S;
        if (tid < S) {
            pre[tid] = hc_sigmoid(__fadd_rn(__fmul_rn(__fmul_rn(m[tid], r), scale[0]), base[tid])) + p.hc_eps;
            p.post[(int64_t)i * S + tid] =
                2.f * hc_sigmoid(__fadd_rn(__fmul_rn(__fmul_rn(m[S + tid], r), scale[1]), base[S + tid]));
        }
        if (own) C[tid] = __fadd_rn(__fmul_rn(__fmul_rn(m[2 * S + tid], r), scale[2]), base[2 * S + tid]);
        __syncthreads();
        /* softmax over each row */
        float v = 0.f;
        if (own) {
            float mx = -INFINITY, sum = 0.f;
            for (int k = 0; k < S; k++) mx = fmaxf(mx, C[a * S + k]);
            for (int k = 0; k < S; k++) sum += expf(C[a * S + k] - mx);
            v = expf(C[tid] - mx) / sum + p.hc_eps;
        }
        __syncthreads();
        if (own) C[tid] = v;
        __syncthreads();
        for (int it = 0; it < p.sinkhorn_iters; it++) {
            if (it > 0) { /* rows */
                float sum = 0.f;
                if (own)
                    for (int k = 0; k < S; k++) sum += C[a * S + k];
                __syncthreads();
                if (own) C[tid] /= sum + p.hc_eps;
                __syncthreads();
            }
            float sum = 0.f; /* columns */
            if (own)
                for (int k = 0; k < S; k++) sum += C[k * S + b];
            __syncthreads();
            if (own) C[tid] /= sum + p.hc_eps;
            __syncthreads();
        }
        if (own) p.comb[(int64_t)i * S * S + tid] = C[tid];
    }
    float *yi = p.y + (int64_t)i * H;
#pragma unroll 4
    for (int d = tid; d < H; d += blockDim.x) {
        float acc = 0;
        for (int s = 0; s < S; s++) acc = __fadd_rn(acc, __fmul_rn(pre[s], x[(int64_t)s * H + d]));
        yi[d] = acc;
    }
}

static mt_status hc_pre_launch(const hc_pre_params *p, cudaStream_t s) {
    hc_pre_mix_kernel<<<(unsigned)p->n, HC_MIX_THREADS, 0, s>>>(*p);
    MT_CUDA_CHECK_LAUNCH();
    return MT_OK;
}

extern "C" void cu_hc_pre(mt_backend *be, float *y, float *post, float *comb, const float *X,
                          const mt_weight *fn, const float *base, const float *scale,
                          const mt_hc_params *p, int n) {
    const int S = p->S, H = p->H, mix = (2 + S) * S;
    MT_ASSERT(S >= 1 && S <= HC_MAX_S && H > 0 && n >= 0);
    MT_ASSERT(fn->rows == mix && fn->cols == (int64_t)S * H);
    if (n == 0) return;
    float *m = (float *)cu_scratch(be, CU_SCRATCH_DENSE, sizeof(float) * (size_t)n * mix);
    if (!m) return;
    cu_matmul(be, m, X, fn, n); /* records its own failure */
    hc_pre_params q = {y, post, comb, X, m, base, scale, n, S, H, p->rms_eps, p->hc_eps,
                       p->sinkhorn_iters};
    cu_op_status(be, "hc_pre", hc_pre_launch(&q, cu_stream(be)));
}

/* ---- hc_post, hc_head ---- */

typedef struct hc_post_params {
    float *X;              /* [n, S, H] updated in place */
    const float *a;        /* [n, H] sublayer output */
    const float *post;     /* [n, S] */
    const float *comb;     /* [n, S, S] */
    int64_t n;
    int S, H;
} hc_post_params;

/* One thread per (row, d): reads the S values of column d, then writes them, so no other thread
 * touches them. */
static __global__ void hc_post_kernel(const hc_post_params p) {
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= p.n * p.H) return;
    const int64_t i = t / p.H;
    const int d = (int)(t % p.H), S = p.S, H = p.H;
    float *x = p.X + i * S * H;
    const float *C = p.comb + i * S * S, *po = p.post + i * S;
    const float ad = p.a[i * H + d];
    float col[HC_MAX_S];
#pragma unroll
    for (int r = 0; r < HC_MAX_S; r++)
        if (r < S) col[r] = x[(int64_t)r * H + d];
#pragma unroll
    for (int s = 0; s < HC_MAX_S; s++) {
        if (s >= S) break;
        float v = __fmul_rn(po[s], ad);
#pragma unroll
        for (int r = 0; r < HC_MAX_S; r++)
            if (r < S) v = __fadd_rn(v, __fmul_rn(C[r * S + s], col[r]));
        x[(int64_t)s * H + d] = v;
    }
}

typedef struct hc_head_params {
    float *z;              /* [n, H] */
    const float *X;        /* [n, S, H] */
    int64_t n;
    int S, H;
} hc_head_params;

static __global__ void hc_head_kernel(const hc_head_params p) {
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= p.n * p.H) return;
    const int64_t i = t / p.H;
    const int d = (int)(t % p.H);
    float a = 0;
    for (int s = 0; s < p.S; s++) a += p.X[(i * p.S + s) * p.H + d];
    p.z[t] = a / (float)p.S;
}

static unsigned hc_grid(int64_t count) { return (unsigned)((count + HC_EW_THREADS - 1) / HC_EW_THREADS); }

static mt_status hc_post_launch(const hc_post_params *p, cudaStream_t s) {
    hc_post_kernel<<<hc_grid(p->n * p->H), HC_EW_THREADS, 0, s>>>(*p);
    MT_CUDA_CHECK_LAUNCH();
    return MT_OK;
}

static mt_status hc_head_launch(const hc_head_params *p, cudaStream_t s) {
    hc_head_kernel<<<hc_grid(p->n * p->H), HC_EW_THREADS, 0, s>>>(*p);
    MT_CUDA_CHECK_LAUNCH();
    return MT_OK;
}

extern "C" void cu_hc_post(mt_backend *be, float *X, const float *a, const float *post,
                           const float *comb, const mt_hc_params *p, int n) {
    MT_ASSERT(p->S >= 1 && p->S <= HC_MAX_S && p->H > 0 && n >= 0);
    MT_ASSERT((int64_t)n * p->H / HC_EW_THREADS < INT_MAX);
    if (n == 0) return;
    hc_post_params q = {X, a, post, comb, n, p->S, p->H};
    cu_op_status(be, "hc_post", hc_post_launch(&q, cu_stream(be)));
}

extern "C" void cu_hc_head(mt_backend *be, float *z, const float *X, int n, int S, int H) {
    MT_ASSERT(S >= 1 && H > 0 && n >= 0);
    MT_ASSERT((int64_t)n * H / HC_EW_THREADS < INT_MAX);
    if (n == 0) return;
    hc_head_params q = {z, X, n, S, H};
    cu_op_status(be, "hc_head", hc_head_launch(&q, cu_stream(be)));
}
