/* kernels/cuda/cuda_hc.cu: manifold-constrained hyper-connections, the same functions as
 * kernels/cpu/cpu_hc.c.
 *
 * hc_pre for few rows (decode: n <= HC_DEC_MAX_N, S <= 4): hc_pre_split_kernel (below: the dot
 * products over the whole GPU, the last block to arrive finishing) where the shape takes it, with
 * the input RMSNorm fused for cu_hc_pre_norm; otherwise (S*H a multiple of 8 load vectors) one
 * kernel on a cluster of HC_CL blocks. Each block takes an eighth of the S*H columns: its 16
 * warps dot that slice of the (2+S)S rows of fn with the rows of X (two warps also sum X^2), the
 * blocks exchange their partial sums through distributed shared memory, and every block adds the
 * eight in rank order (so all hold the same m and rms factor); then each block collapses its
 * eighth of H, and block 0 writes post and, last, comb (hc_comb_thread: the Sinkhorn in one
 * thread's registers). Launched for PDL (cu_launch_pdl, cuda_launch.h), as is hc_post's float4 form.
 * Otherwise (prefill): the (2+S)S projection (hcm_kernel, tensor cores with X split in registers,
 * for a bf16 fn and the shapes it takes; else cu_matmul) and one block per row for the rms
 * factor, sigmoids and the collapse (hc_pre_rows_kernel, the row held in registers, where S <= 4
 * and the shapes allow; comb's softmax and Sinkhorn then a thread a row, hc_comb_rows_kernel;
 * else hc_pre_mix_kernel, all of it).
 * hc_post: one thread per (row, 4 consecutive d) when S <= 4 and H % 4 == 0 (float4 accesses),
 * else one thread per (row, d); hc_head one thread per (row, d). */
#include <cooperative_groups.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"

namespace cg = cooperative_groups;


enum { HC_MAX_S = 16, HC_MIX_THREADS = 256, HC_EW_THREADS = 256 };

typedef struct hc_pre_params {
    float *y;              /* [n, H] */
    float *post;           /* [n, S] */
    float *comb;           /* [n, S, S]; comb[r][s] mixes stream r into s */
    const float *X;        /* [n, S, H] highway */
    const float *m;        /* [n, (2+S)S] fn . X rows, before the rms factor (prefill form) */
    const void *fn;        /* [(2+S)S, S*H] dtype (decode form) */
    const float *base;     /* [(2+S)S] */
    const float *scale;    /* [3] */
    int n, S, H;
    float rms_eps, hc_eps;
    int sinkhorn_iters;
    /* decode form with the input norm fused (cu_hc_pre_norm): h[n, H] = rmsnorm(y) * norm_w, and
     * y is not written; NULL otherwise */
    float *h;
    const float *norm_w;
    /* prefill with the mix on hcm_kernel: m is the sum of mk k-slice partials [mk][n][HCM_LD]
     * (added in slice order by hc_pre_rows_kernel); 0: m as above */
    int mk;
} hc_pre_params;

/* The mHC's three mixes from a row's fn . X entry m and rms factor r, as cpu_hc.c computes them
 * (each product and sum rounded in that order): pre = sigmoid(m r scale0 + base) + hc_eps,
 * post = 2 sigmoid(m r scale1 + base), and comb's logits m r scale2 + base before its softmax. */
static __device__ __forceinline__ float hc_logit(float m, float r, float scale, float base) {
    return __fadd_rn(__fmul_rn(__fmul_rn(m, r), scale), base);
}
static __device__ __forceinline__ float hc_pre_of(float m, float r, float scale0, float base, float hc_eps) {
    return cu_sigmoidf(hc_logit(m, r, scale0, base)) + hc_eps;
}
static __device__ __forceinline__ float hc_post_of(float m, float r, float scale1, float base) {
    return 2.f * cu_sigmoidf(hc_logit(m, r, scale1, base));
}

/* comb of one row on one warp (S*S <= 32; 4 x 4 in the real model): lane a*S+b holds C[a][b];
 * softmax over each row, then the Sinkhorn iterations, every row or column sum gathering its S
 * values by shuffles and adding them in ascending index (the CPU's order), with no block barrier.
 * mc: the row's S*S comb entries of fn . X before the rms factor r; base2 = base + 2S, scale2 =
 * scale[2]. Every lane of the warp must call it. Writes comb[S*S]. */
static __device__ void hc_comb_warp(float *comb, const float *mc, float r, const float *base2, float scale2,
                                    int S, float hc_eps, int iters) {
    const int lane = threadIdx.x & 31, a = lane < S * S ? lane / S : 0, b = lane < S * S ? lane % S : 0;
    float c = 0.f;
    if (lane < S * S) c = hc_logit(mc[lane], r, scale2, base2[lane]);
    float mx = -INFINITY;
    for (int k = 0; k < S; k++) mx = fmaxf(mx, __shfl_sync(0xffffffffu, c, a * S + k));
    const float e = expf(c - mx);
    float sum = 0.f;
    for (int k = 0; k < S; k++) sum += __shfl_sync(0xffffffffu, e, a * S + k);
    c = e / sum + hc_eps;
    for (int it = 0; it < iters; it++) {
        if (it > 0) {
            float rs = 0.f;
            for (int k = 0; k < S; k++) rs += __shfl_sync(0xffffffffu, c, a * S + k);
            c /= rs + hc_eps;
        }
        float cs = 0.f;
        for (int k = 0; k < S; k++) cs += __shfl_sync(0xffffffffu, c, k * S + b);
        c /= cs + hc_eps;
    }
    if (lane < S * S) comb[lane] = c;
}

/* The same comb for S <= HC_REG_S on one thread, the S x S matrix in registers: no shuffles, the
 * row and column sums in ascending index as the CPU; each normalisation multiplies by the
 * hardware's approximate reciprocal of (sum + hc_eps) (__fdividef: ~2 ulp, against the CPU's
 * division; 8 an iteration instead of 32 divisions). IEEE reciprocals (__frcp_rn) kept the
 * 20-iteration chain at several microseconds on one thread. */
enum { HC_REG_S = 4 };
/* From the S x S logits (row-major, logit(a * S + b), all read before comb is written, so comb
 * may be where they come from): softmax over each row, then the Sinkhorn. */
template <typename F>
static __device__ __forceinline__ void hc_comb_thread_f(float *comb, F logit, int S, float hc_eps, int iters) {
    float C[HC_REG_S][HC_REG_S];
#pragma unroll
    for (int a = 0; a < HC_REG_S; a++) {
        float mx = -INFINITY;
#pragma unroll
        for (int b = 0; b < HC_REG_S; b++) {
            C[a][b] = 0.f;
            if (a < S && b < S) {
                C[a][b] = logit(a * S + b);
                mx = fmaxf(mx, C[a][b]);
            }
        }
        float e[HC_REG_S], sum = 0.f;
#pragma unroll
        for (int b = 0; b < HC_REG_S; b++) {
            e[b] = b < S ? expf(C[a][b] - mx) : 0.f;
            sum += e[b];
        }
#pragma unroll
        for (int b = 0; b < HC_REG_S; b++) C[a][b] = a < S && b < S ? e[b] / sum + hc_eps : 0.f; /* padding: 0 */
    }
    /* each row (cols false) or each column of C over (its sum + hc_eps), summed in index order */
    auto scale_lines = [&](bool cols) {
#pragma unroll
        for (int u = 0; u < HC_REG_S; u++) {
            float t = 0.f;
#pragma unroll
            for (int v = 0; v < HC_REG_S; v++) t += cols ? C[v][u] : C[u][v];
            const float inv = __fdividef(1.f, t + hc_eps);
#pragma unroll
            for (int v = 0; v < HC_REG_S; v++) (cols ? C[v][u] : C[u][v]) *= inv;
        }
    };
    for (int it = 0; it < iters; it++) {
        if (it > 0) scale_lines(false);
        scale_lines(true);
    }
#pragma unroll
    for (int a = 0; a < HC_REG_S; a++)
#pragma unroll
        for (int b = 0; b < HC_REG_S; b++)
            if (a < S && b < S) comb[a * S + b] = C[a][b];
}

/* comb of one row from its fn . X entries mc before the rms factor r (base2 = base + 2S). */
static __device__ void hc_comb_thread(float *comb, const float *mc, float r, const float *base2, float scale2,
                                      int S, float hc_eps, int iters) {
    hc_comb_thread_f(comb, [&](int e) { return hc_logit(mc[e], r, scale2, base2[e]); }, S, hc_eps, iters);
}

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
    if (tid < S) {
        pre[tid] = hc_pre_of(m[tid], r, scale[0], base[tid], p.hc_eps);
        p.post[(int64_t)i * S + tid] = hc_post_of(m[S + tid], r, scale[1], base[S + tid]);
    }
    if (S * S <= 32) {
        if (tid < 32) hc_comb_warp(p.comb + (int64_t)i * S * S, m + 2 * S, r, base + 2 * S, scale[2], S, p.hc_eps,
                                   p.sinkhorn_iters);
        __syncthreads(); /* pre[] for the collapse below */
    } else {
        const bool own = tid < S * S;        /* this thread owns C[a][b] */
        const int a = tid / S, b = tid % S;
        if (own) C[tid] = hc_logit(m[2 * S + tid], r, scale[2], base[2 * S + tid]);
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

/* The prefill mix m = X fn^T on the tensor cores, without a pass that splits X first: warp =
 * (2 x 16 rows, one k-slice of the S*H columns); per 16 columns and row tile each lane loads its A
 * fragment's eight fp32 values of X straight from memory (float2 pairs), splits them into bf16 hi + lo
 * (the bf16 fn is exact: two mma terms, ~1e-5 relative, as the backend's two-part GEMMs) and
 * multiplies by fn's rows from L2 (786 KB at the real shapes). k-slices give the GPU enough warps
 * (4096 rows: 256 row tiles, 128 warps, x 8 slices); their partials [mk][n][HCM_LD] are added in slice order
 * by hc_pre_rows_kernel. Replaces cu_matmul's split + two cuBLAS GEMMs, which moved ~800 MB a call
 * for a 24 x 16384 weight at 4096 rows: on the H200, 8 calls of a 4096-token prefill 2.08 ->
 * 1.20 ms with 8 k-slices (150 us a call; X alone is 268 MB, 63 us at the copy rate), ~1.1 ms
 * with 16. A warp takes two 16-row tiles (HCM_TILES), so each fn fragment it loads (for NT = 3,
 * six 4-byte loads a lane and k step, more requests than X's four) serves 32 rows: 1.08-1.12 -> 0.79-0.80
 * ms at 16 slices (H200; see hcm_slices). */
enum { HCM_LD = 32 /* mix outputs, padded: four n8 tiles */, HCM_WARPS = 4,
       HCM_TILES = 2 /* m16 row tiles a warp: each fn fragment it loads serves both */,
       HCM_UNROLL = 2 /* k steps a load batch (4 was slower with two tiles) */ };

struct hcm_params {
    float *mp;              /* [mk][n][HCM_LD] */
    const float *X;         /* [n, K] */
    const __nv_bfloat16 *fn; /* [mix, K] */
    int n, K, mix, kc;      /* kc: columns a slice (a multiple of 16) */
};

template <int NT> /* n8 tiles of outputs: ceil(mix / 8) */
static __global__ void __launch_bounds__(HCM_WARPS * 32) hcm_kernel(const hcm_params p) {
    constexpr int MT = HCM_TILES, UN = HCM_UNROLL;
    const int lane = threadIdx.x & 31, g = lane >> 2, q4 = lane & 3;
    const int64_t r0 = ((int64_t)blockIdx.x * HCM_WARPS + (threadIdx.x >> 5)) * 16 * MT;
    const int slice = blockIdx.y, kb = slice * p.kc, ke = kb + p.kc < p.K ? kb + p.kc : p.K;
    if (r0 >= p.n) return; /* no barrier in this kernel */
    const float *xr[MT][2]; /* rows r0 + 16 m + g (+ 8), clamped to the last row */
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int64_t r = r0 + 16 * m + 8 * h + g;
            xr[m][h] = p.X + (r < p.n ? r : p.n - 1) * p.K + 2 * q4;
        }
    const uint32_t *w[NT]; /* fn row 8t + g at column 2 q4, as bf16 pairs; rows past mix read row 0 */
#pragma unroll
    for (int t = 0; t < NT; t++)
        w[t] = reinterpret_cast<const uint32_t *>(p.fn + (int64_t)(8 * t + g < p.mix ? 8 * t + g : 0) * p.K + 2 * q4);
    float acc[MT][NT][4];
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[m][t][0] = acc[m][t][1] = acc[m][t][2] = acc[m][t][3] = 0.f;
    for (int k = kb; k < ke; k += 16 * UN) {
        float2 xv[UN][MT][4];
        uint32_t bv[UN][NT][2];
#pragma unroll
        for (int u = 0; u < UN; u++) {
            const int kk = k + 16 * u;
            const bool in = kk < ke;
#pragma unroll
            for (int m = 0; m < MT; m++) {
                xv[u][m][0] = in ? *reinterpret_cast<const float2 *>(xr[m][0] + kk) : make_float2(0.f, 0.f);
                xv[u][m][1] = in ? *reinterpret_cast<const float2 *>(xr[m][1] + kk) : make_float2(0.f, 0.f);
                xv[u][m][2] = in ? *reinterpret_cast<const float2 *>(xr[m][0] + kk + 8) : make_float2(0.f, 0.f);
                xv[u][m][3] = in ? *reinterpret_cast<const float2 *>(xr[m][1] + kk + 8) : make_float2(0.f, 0.f);
            }
#pragma unroll
            for (int t = 0; t < NT; t++) {
                bv[u][t][0] = in ? __ldg(w[t] + kk / 2) : 0u;
                bv[u][t][1] = in ? __ldg(w[t] + kk / 2 + 4) : 0u;
            }
        }
#pragma unroll
        for (int u = 0; u < UN; u++)
#pragma unroll
            for (int m = 0; m < MT; m++) {
                uint32_t ah[4], al[4];
#pragma unroll
                for (int j = 0; j < 4; j++) cu_split_bf16x2(xv[u][m][j].x, xv[u][m][j].y, &ah[j], &al[j]);
#pragma unroll
                for (int t = 0; t < NT; t++) cu_mma_bf16(acc[m][t], al, bv[u][t][0], bv[u][t][1]);
#pragma unroll
                for (int t = 0; t < NT; t++) cu_mma_bf16(acc[m][t], ah, bv[u][t][0], bv[u][t][1]);
            }
    }
#pragma unroll
    for (int m = 0; m < MT; m++) {
        const int64_t rm = r0 + 16 * m;
        float *mp = p.mp + ((int64_t)slice * p.n + rm) * HCM_LD;
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const int c = 8 * t + 2 * q4;
            if (rm + g < p.n) *reinterpret_cast<float2 *>(mp + (int64_t)g * HCM_LD + c) = make_float2(acc[m][t][0], acc[m][t][1]);
            if (rm + g + 8 < p.n)
                *reinterpret_cast<float2 *>(mp + (int64_t)(g + 8) * HCM_LD + c) = make_float2(acc[m][t][2], acc[m][t][3]);
        }
    }
}

/* The prefill form for S <= HC_REG_S, H % 4 == 0, S*H <= 16384 (the real model: 4 x 4096) and a
 * 16-byte aligned X, y: one block per row that holds the row in registers, so X is read from
 * memory once (hc_pre_mix_kernel reads it twice and waits on its Sinkhorn: 0.29 ms a call at
 * 4096 x 4 x 4096 on the H200, ~0.9 TB/s). Thread t holds, for its column groups d4 = t + k * 256,
 * the float4 X[s][4 d4 ..] of every stream s; the sum of squares (double) goes over the block,
 * then every thread computes pre itself (it needs only m, r and base) and collapses its columns;
 * the first S*S threads write comb's logits, whose softmax and Sinkhorn hc_comb_rows_kernel runs. */
enum { HCR_THREADS = 256, HCR_KPT = 4 /* column groups a thread: S*H <= 256 * 4 * 4 * 4 */ };
static __global__ void __launch_bounds__(HCR_THREADS) hc_pre_rows_kernel(const hc_pre_params p) {
    __shared__ double red[32];
    __shared__ float msum[HCM_LD];
    const int i = blockIdx.x, S = p.S, H4 = p.H / 4, tid = threadIdx.x;
    const float4 *x = reinterpret_cast<const float4 *>(p.X + (int64_t)i * S * p.H);
    float4 v[HCR_KPT][HC_REG_S];
    double ss = 0;
#pragma unroll
    for (int k = 0; k < HCR_KPT; k++)
#pragma unroll
        for (int s = 0; s < HC_REG_S; s++)
            if (s < S && tid + k * HCR_THREADS < H4) v[k][s] = x[(int64_t)s * H4 + tid + k * HCR_THREADS];
    if (p.mk > 0 && tid < (2 + S) * S) { /* the mix's k-slice partials, in slice order (after the
                                            row's loads are out: their latencies overlap) */
        float a = 0.f;
        for (int k = 0; k < p.mk; k++) a += p.m[((int64_t)k * p.n + i) * HCM_LD + tid];
        msum[tid] = a;
    }
#pragma unroll
    for (int k = 0; k < HCR_KPT; k++)
#pragma unroll
        for (int s = 0; s < HC_REG_S; s++)
            if (s < S && tid + k * HCR_THREADS < H4)
                ss += (double)v[k][s].x * v[k][s].x + (double)v[k][s].y * v[k][s].y +
                      ((double)v[k][s].z * v[k][s].z + (double)v[k][s].w * v[k][s].w);
    ss = cu_block_sum(ss, red); /* its barriers also publish msum */
    const float r = 1.f / sqrtf((float)(ss / (S * p.H)) + p.rms_eps);
    const float *m = p.mk > 0 ? msum : p.m + (int64_t)i * (2 + S) * S;
    float pre[HC_REG_S];
#pragma unroll
    for (int s = 0; s < HC_REG_S; s++)
        pre[s] = s < S ? hc_pre_of(m[s], r, p.scale[0], p.base[s], p.hc_eps) : 0.f;
    if (tid < S)
        p.post[(int64_t)i * S + tid] = hc_post_of(m[S + tid], r, p.scale[1], p.base[S + tid]);
    if (tid < S * S) /* comb's logits; hc_comb_rows_kernel finishes comb */
        p.comb[(int64_t)i * S * S + tid] = hc_logit(m[2 * S + tid], r, p.scale[2], p.base[2 * S + tid]);
    float4 *y = reinterpret_cast<float4 *>(p.y + (int64_t)i * p.H);
#pragma unroll
    for (int k = 0; k < HCR_KPT; k++) {
        if (tid + k * HCR_THREADS >= H4) break;
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f); /* streams in order, as the CPU */
#pragma unroll
        for (int s = 0; s < HC_REG_S; s++)
            if (s < S) {
                a.x = __fadd_rn(a.x, __fmul_rn(pre[s], v[k][s].x));
                a.y = __fadd_rn(a.y, __fmul_rn(pre[s], v[k][s].y));
                a.z = __fadd_rn(a.z, __fmul_rn(pre[s], v[k][s].z));
                a.w = __fadd_rn(a.w, __fmul_rn(pre[s], v[k][s].w));
            }
        y[tid + k * HCR_THREADS] = a;
    }
}

/* comb of every row from the logits hc_pre_rows_kernel left in it, in place: a thread a row. Apart
 * from the rows kernel, whose blocks would otherwise each hold their multiprocessor slot through
 * one thread's serial Sinkhorn: H200, the 8 calls of a 4096-token prefill, hc_pre 1.27-1.30 ms
 * with the Sinkhorn in the rows kernel, 0.94 with none at all (timing only), 1.01-1.05 with this
 * kernel after it. */
enum { HCC_THREADS = 128 };
static __global__ void __launch_bounds__(HCC_THREADS) hc_comb_rows_kernel(const hc_pre_params p) {
    const int64_t i = (int64_t)blockIdx.x * HCC_THREADS + threadIdx.x;
    if (i >= p.n) return;
    float *c = p.comb + i * p.S * p.S;
    hc_comb_thread_f(c, [&](int e) { return c[e]; }, p.S, p.hc_eps, p.sinkhorn_iters);
}

/* hcm_kernel takes a bf16 fn of at most 32 rows and S*H a multiple of 16 (whole k steps; rows of
 * X and fn 8-byte aligned) over many rows (fewer take the GEMV-style paths anyway). */
static bool hcm_ok(const mt_weight *fn, const float *X, int S, int H) {
    return fn->dtype == MT_BF16 && (2 + S) * S <= HCM_LD && (S * H) % 16 == 0 && ((uintptr_t)X & 7u) == 0 &&
           ((uintptr_t)fn->data & 3u) == 0;
}

/* k-slices: ~16 16-row tiles a multiprocessor (~8 warps of HCM_TILES), at most 32 slices of >= 512
 * columns. The count is a trade: more slices feed the mix more warps, and hc_pre_rows_kernel sums
 * each row's slices in order before it can finish the row. H200, the 8 calls of a 4096-token
 * prefill, mix + rows kernel: 4 / 8 / 16 slices 2.19-2.28 / 1.75-1.78 / 1.90-1.95 ms. With a tile
 * a warp, the mix alone: 4 / 8 / 16 / 32 slices 1.78 / 1.21 / 1.10 / 1.17 ms; 512 rows with 16 /
 * 32 slices 0.47 / 0.28 ms (512 rows still take 32). */
static int hcm_slices(int n, int K, int n_sm) {
    const int64_t tiles = (n + 15) / 16;
    int64_t mk = (int64_t)n_sm * 16 / tiles;
    if (mk > 32) mk = 32;
    if (mk > K / 512) mk = K / 512;
    return mk < 1 ? 1 : (int)mk;
}

static bool hc_pre_rows_ok(const hc_pre_params *p) {
    return p->S <= HC_REG_S && p->H % 4 == 0 && p->H / 4 <= HCR_KPT * HCR_THREADS && cu_aligned16(p->X) &&
           cu_aligned16(p->y);
}

static mt_status hc_pre_launch(const hc_pre_params *p, cudaStream_t s) {
    if (hc_pre_rows_ok(p)) {
        hc_pre_rows_kernel<<<(unsigned)p->n, HCR_THREADS, 0, s>>>(*p);
        MT_CUDA_CHECK_LAUNCH();
        hc_comb_rows_kernel<<<(unsigned)((p->n + HCC_THREADS - 1) / HCC_THREADS), HCC_THREADS, 0, s>>>(*p);
    } else hc_pre_mix_kernel<<<(unsigned)p->n, HC_MIX_THREADS, 0, s>>>(*p);
    MT_CUDA_CHECK_LAUNCH();
    return MT_OK;
}

/* ---- hc_pre for few rows: one cluster ---- */

enum {
    HC_CL = 8,                               /* blocks in the cluster (the portable maximum) */
    HC_DEC_THREADS = 512,
    HC_DEC_WARPS = HC_DEC_THREADS / 32,
    HC_DEC_HALVES = 2,                       /* warps w and w + 8 share fn rows, split columns */
    HC_DEC_MAX_N = 4,                        /* rows */
    HC_DEC_MAX_S = 4,
    HC_DEC_MIX = (2 + HC_DEC_MAX_S) * HC_DEC_MAX_S,  /* fn rows, 24 */
    HC_DEC_KPW = HC_DEC_MIX * HC_DEC_HALVES / HC_DEC_WARPS,  /* fn rows per warp, 3 */
    HC_DEC_MAX_YLEN = 1024,                  /* NORM: y columns a block keeps, H <= 8 x this */
};

/* Cluster of HC_CL blocks (see the file comment). Block `rank` owns columns [rank * cw, +cw) of
 * the flattened highway, cw = S*H / HC_CL, a whole number of 16-byte weight vectors: nvc of
 * them, in chunks of 32. Warp w dots fn rows w % 8, + 8, + 16 with the NB rows of X over the
 * chunks h, h + 2, ... of the block's columns (h = w / 8), lane l taking vector l of a chunk
 * (512 contiguous bytes of a bf16 row per warp load); each step issues JU chunks x 3 rows of fn
 * loads, then the matching X loads, before the first use; warps 0 and 8 also sum X^2 (double).
 * Real shapes (S 4, H 4096, bf16, one row): 96 KB of fn and 8 KB of X per block, one step.
 * Each sum is a per-lane running sum, a butterfly over the lanes, the two halves, then the
 * HC_CL blocks in rank order: every block computes the same m and rms factor. Block 0's first
 * NB warps then run the softmax/Sinkhorn of one row each while every other warp collapses y over
 * its block's eighth of H. Launched for PDL: the first fn loads go out before the wait. */
template <mt_dtype DT, int NB, bool NORM>
static __global__ void __cluster_dims__(HC_CL, 1, 1) __launch_bounds__(HC_DEC_THREADS)
hc_pre_dec_kernel(const hc_pre_params p) {
    constexpr int V = cu_wvec<DT>::n, KPW = HC_DEC_KPW, JU = NB == 1 ? 4 : NB == 2 ? 2 : 1;
    constexpr int ES = DT == MT_F32 ? 4 : 2; /* bytes per weight element */
    __shared__ float part[HC_DEC_HALVES][NB * HC_DEC_MIX]; /* this block's fn . X, per half, [i][k] */
    __shared__ double part_ss[HC_DEC_HALVES][NB];          /* and its sum of X^2 per row */
    __shared__ float m_s[NB * HC_DEC_MIX];                 /* the whole sums, [i][k] */
    __shared__ float r_s[NB];                              /* rms factor per row */
    __shared__ float pre_s[NB * HC_DEC_MAX_S];
    __shared__ float y_s[NORM ? NB : 1][NORM ? HC_DEC_MAX_YLEN : 1]; /* NORM: this block's y */
    __shared__ double yss[NB];                             /* NORM: its sum of y^2 per row */
    __shared__ float r_y[NB];                              /* NORM: the norm's factor per row */
    cg::cluster_group cl = cg::this_cluster();
    const int rank = (int)cl.block_rank();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tid = threadIdx.x;
    const int kw = warp % (HC_DEC_WARPS / HC_DEC_HALVES), h = warp / (HC_DEC_WARPS / HC_DEC_HALVES);
    const int S = p.S, H = p.H, SH = S * H, mix = (2 + S) * S;
    const int cw = SH / HC_CL, nvc = cw / V, nch = (nvc + 31) / 32;
    const int64_t c0 = (int64_t)rank * cw;
    const char *fn = (const char *)p.fn;

    uint4 wr[JU][KPW];
    auto load = [&](int ch0) {
#pragma unroll
        for (int u = 0; u < JU; u++) {
            const int v = (ch0 + HC_DEC_HALVES * u) * 32 + lane;
#pragma unroll
            for (int q = 0; q < KPW; q++) {
                const int k = kw + (HC_DEC_WARPS / HC_DEC_HALVES) * q;
                if (v < nvc && k < mix) {
                    const char *a = fn + ((int64_t)k * SH + c0 + (int64_t)v * V) * ES;
                    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                                 : "=r"(wr[u][q].x), "=r"(wr[u][q].y), "=r"(wr[u][q].z), "=r"(wr[u][q].w)
                                 : "l"(a));
                } else {
                    wr[u][q] = make_uint4(0u, 0u, 0u, 0u);
                }
            }
        }
    };
    float acc[KPW][NB];
    double ss[NB];
#pragma unroll
    for (int i = 0; i < NB; i++) {
        ss[i] = 0;
#pragma unroll
        for (int q = 0; q < KPW; q++) acc[q][i] = 0.f;
    }

    load(h);
    cu_pdl_wait(); /* X is the previous kernel's output */
    cu_pdl_trigger();
    for (int ch0 = h; ch0 < nch; ch0 += HC_DEC_HALVES * JU) {
        if (ch0 != h) load(ch0);
        float xv[JU][NB][V]; /* zero past the block's columns, like the weights */
#pragma unroll
        for (int u = 0; u < JU; u++) {
            const int v = (ch0 + HC_DEC_HALVES * u) * 32 + lane;
#pragma unroll
            for (int i = 0; i < NB; i++)
#pragma unroll
                for (int j = 0; j < V; j += 4) {
                    float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
                    if (v < nvc && i < p.n) f = __ldg((const float4 *)(p.X + (int64_t)i * SH + c0 + (int64_t)v * V + j));
                    xv[u][i][j] = f.x; xv[u][i][j + 1] = f.y; xv[u][i][j + 2] = f.z; xv[u][i][j + 3] = f.w;
                }
        }
#pragma unroll
        for (int u = 0; u < JU; u++) {
            float wf[KPW][V];
#pragma unroll
            for (int q = 0; q < KPW; q++) {
                const uint32_t w4[4] = {wr[u][q].x, wr[u][q].y, wr[u][q].z, wr[u][q].w};
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    if constexpr (DT == MT_F32) {
                        wf[q][j] = __uint_as_float(w4[j]);
                    } else if constexpr (DT == MT_BF16) {
                        wf[q][2 * j] = __uint_as_float(w4[j] << 16);
                        wf[q][2 * j + 1] = __uint_as_float(w4[j] & 0xffff0000u);
                    } else {
                        wf[q][2 * j] = __half2float(__ushort_as_half((unsigned short)(w4[j] & 0xffffu)));
                        wf[q][2 * j + 1] = __half2float(__ushort_as_half((unsigned short)(w4[j] >> 16)));
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < NB; i++) {
                if (kw == 0)
#pragma unroll
                    for (int j = 0; j < V; j++) ss[i] += (double)xv[u][i][j] * xv[u][i][j];
#pragma unroll
                for (int q = 0; q < KPW; q++)
#pragma unroll
                    for (int j = 0; j < V; j++) acc[q][i] = fmaf(wf[q][j], xv[u][i][j], acc[q][i]);
            }
        }
    }
#pragma unroll
    for (int q = 0; q < KPW; q++)
#pragma unroll
        for (int i = 0; i < NB; i++) {
            const float v = cu_warp_sum(acc[q][i]);
            const int k = kw + (HC_DEC_WARPS / HC_DEC_HALVES) * q;
            if (lane == 0 && k < mix) part[h][i * HC_DEC_MIX + k] = v;
        }
    if (kw == 0)
#pragma unroll
        for (int i = 0; i < NB; i++) {
            const double v = cu_warp_sum(ss[i]);
            if (lane == 0) part_ss[h][i] = v;
        }
    cl.sync(); /* every block's parts are written */
    if (tid < NB * mix) { /* the 8 blocks' parts in rank order, their loads all in flight */
        const int i = tid / mix, k = tid % mix;
        float v[HC_CL][2];
#pragma unroll
        for (int r = 0; r < HC_CL; r++) {
            const float *rp = cl.map_shared_rank(&part[0][0], r);
            v[r][0] = rp[i * HC_DEC_MIX + k];
            v[r][1] = rp[NB * HC_DEC_MIX + i * HC_DEC_MIX + k];
        }
        float a = 0.f;
#pragma unroll
        for (int r = 0; r < HC_CL; r++) a += v[r][0] + v[r][1];
        m_s[i * HC_DEC_MIX + k] = a;
    }
    if (tid >= 32 * (HC_DEC_WARPS - 1) && tid - 32 * (HC_DEC_WARPS - 1) < NB) { /* the last warp: X^2 sums */
        const int i = tid - 32 * (HC_DEC_WARPS - 1);
        double v[HC_CL][2];
#pragma unroll
        for (int r = 0; r < HC_CL; r++) {
            const double *rp = cl.map_shared_rank(&part_ss[0][0], r);
            v[r][0] = rp[i];
            v[r][1] = rp[NB + i];
        }
        double a = 0;
#pragma unroll
        for (int r = 0; r < HC_CL; r++) a += v[r][0] + v[r][1];
        r_s[i] = 1.f / sqrtf((float)(a / SH) + p.rms_eps);
    }
    __syncthreads();
    if (tid < NB * S) {
        const int i = tid / S, s = tid % S;
        const float *m = m_s + i * HC_DEC_MIX;
        const float r = r_s[i];
        pre_s[i * HC_DEC_MAX_S + s] = hc_pre_of(m[s], r, p.scale[0], p.base[s], p.hc_eps);
        if (rank == 0 && i < p.n)
            p.post[(int64_t)i * S + s] = hc_post_of(m[S + s], r, p.scale[1], p.base[S + s]);
    }
    __syncthreads();
    /* y[i][d] = sum_s pre[i][s] X[i][s][d] over this block's d, in the CPU's order; with NORM the
     * y values stay in shared memory for the norm below. */
    const int d0 = (int)((int64_t)rank * H / HC_CL), len = (int)((int64_t)(rank + 1) * H / HC_CL) - d0;
    for (int e = tid; e < p.n * len; e += HC_DEC_THREADS) {
        const int i = e / len, d = d0 + e % len;
        const float *x = p.X + (int64_t)i * SH + d;
        float a = 0.f;
        for (int s = 0; s < S; s++) a = __fadd_rn(a, __fmul_rn(pre_s[i * HC_DEC_MAX_S + s], __ldg(x + (int64_t)s * H)));
        if constexpr (NORM) y_s[i][e % len] = a;
        else p.y[(int64_t)i * H + d] = a;
    }
    if constexpr (NORM) {
        /* h = y * rms(y) * w: each block's sum of y^2 (double, as the CPU's rmsnorm), the 8 in
         * rank order through distributed shared memory, then its own d. */
        __syncthreads();
        if (warp < NB) {
            double a = 0;
            for (int d = lane; d < len; d += 32) a += (double)y_s[warp][d] * y_s[warp][d];
            a = cu_warp_sum(a);
            if (lane == 0) yss[warp] = a;
        }
        cl.sync(); /* every block's yss is written (and every block is done with the parts) */
        if (tid < NB) {
            double v[HC_CL];
#pragma unroll
            for (int r = 0; r < HC_CL; r++) v[r] = cl.map_shared_rank(&yss[0], r)[tid];
            double a = 0;
#pragma unroll
            for (int r = 0; r < HC_CL; r++) a += v[r];
            r_y[tid] = 1.f / sqrtf((float)(a / H) + p.rms_eps);
        }
        cl.barrier_arrive(); /* done with the other blocks' shared memory; waited for before exit */
        __syncthreads();
        for (int e = tid; e < p.n * len; e += HC_DEC_THREADS) {
            const int i = e / len, d = d0 + e % len;
            p.h[(int64_t)i * H + d] = __fmul_rn(__fmul_rn(y_s[i][e % len], r_y[i]), __ldg(p.norm_w + d));
        }
    } else {
        cl.barrier_arrive(); /* done with the other blocks' shared memory; waited for before exit */
    }
    /* comb last, by block 0's thread 32 i for row i (registers; see hc_comb_thread): only the post
     * sublayer's hc_post reads it, so nothing above waits for it */
    if (rank == 0 && (tid & 31) == 0 && tid / 32 < p.n)
        hc_comb_thread(p.comb + (int64_t)(tid / 32) * S * S, m_s + (tid / 32) * HC_DEC_MIX + 2 * S, r_s[tid / 32],
                       p.base + 2 * S, p.scale[2], S, p.hc_eps, p.sinkhorn_iters);
    cl.barrier_wait();
}

/* ---- hc_pre for few rows, spread over the GPU (hc_pre_split_kernel) ----
 * The cluster kernel above keeps the whole op on 8 multiprocessors and crosses the cluster 2-3
 * times: ~13 us a call (18 with the norm) on the H200, 8 calls a bench-4L step. Here block b of
 * S*H / (32 V) (64 at the real shape) dots its 32 V columns of fn's (2+S)S rows with X (warp w:
 * rows w, w + 8, w + 16; lane l one 16-byte vector) and writes the partial sums; then one block
 * (a second launch of the kernel, phase 2 after a programmatic boundary; with HCS_FIRST_PHASE 0
 * the last block to arrive, by an arrival counter it resets for the next call)
 * adds the partials in block order (deterministic), makes pre and post, collapses y over all of
 * H with float4 loads, and with NORM writes h = rmsnorm(y) * norm_w instead of y; its ninth warp
 * runs each row's Sinkhorn (hc_comb_thread, one lane a row) meanwhile, so the norm never waits
 * for it. */
enum { HCS_WARPS = 8, HCS_THREADS = 32 * (HCS_WARPS + 1), HCS_KPW = 3, HCS_MAX_BLOCKS = 64,
       HCS_MAX_H4 = 2048 /* H <= 8192 */, HCS_PER = HCS_MAX_H4 / (32 * HCS_WARPS) /* float4 a thread */ };

typedef struct hc_split_params {
    hc_pre_params p;
    float *part;          /* [blocks, NB, HC_DEC_MIX] partial fn . X */
    double *part_ss;      /* [blocks, NB] partial X^2 */
    unsigned *count;      /* arrival counter, 0 between calls */
    const float *a;       /* POST (cu_hc_post_pre_norm): [n, H] the sublayer output; p.post and
                             p.comb hold the previous hc_pre's on entry */
    int phase;            /* 0: the whole op, the last block to arrive finishing; 1: the dot
                             products only; 2: the finish only, one block over nblk blocks'
                             partials (HCS_FIRST_PHASE 1: two launches, so a programmatic
                             boundary replaces the fences and the arrival) */
    int nblk;
} hc_split_params;

/* POST: hc_post first, in the same kernel (cu_hc_post_pre_norm). A block then takes the same 32 V
 * columns of X's S*H but as 32 V / S consecutive d of every stream (lane l: stream l / (32 / S)),
 * so that it holds whole columns (r = 0..S-1) of the highway: it makes X'[s][d] = post[s] a[d] +
 * sum_r comb[r][s] X[r][d] (hc_post_vec_kernel's operations, in its order) from the old post and
 * comb, dots X' instead of X, and its first warp writes X' back once the block's eight dot warps
 * have read X (a named barrier); no other block touches those columns. The finishing block's
 * collapse reads X' from L2 (written by phase 1's kernel, which has ended; in the fused form each
 * writer fences before the arrival). */
template <mt_dtype DT, int NB, bool NORM, bool POST>
static __global__ void __launch_bounds__(HCS_THREADS) hc_pre_split_kernel(const hc_split_params q) {
    constexpr int V = cu_wvec<DT>::n, ES = DT == MT_F32 ? 4 : 2;
    const hc_pre_params &p = q.p;
    __shared__ float m_s[NB * HC_DEC_MIX];
    __shared__ float r_s[NB], pre_s[NB * HC_DEC_MAX_S], r_y[NB];
    __shared__ double red[HCS_WARPS][NB];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tid = threadIdx.x;
    const int S = p.S, H = p.H, SH = S * H, mix = (2 + S) * S, b = blockIdx.x;
    /* this lane's first column of S*H; POST: stream sl, d = dl */
    const int lps = POST ? 32 / S : 32, sl = POST ? lane / lps : 0, dl = POST ? (b * lps + lane % lps) * V : 0;
    const int64_t c = POST ? (int64_t)sl * H + dl : (int64_t)b * 32 * V + (int64_t)lane * V;
    const char *fn = (const char *)p.fn;

    /* fn does not depend on the previous kernel: its lines into L2 before the PDL wait; norm_w for
     * the finishing block, by phase 2 itself or, fused, a share by each block's ninth warp */
    if (q.phase == 2) { /* the finish alone: all of norm_w */
        if (NORM)
            for (int d = tid * 32; d < H; d += HCS_THREADS * 32)
                asm volatile("prefetch.global.L2 [%0];" ::"l"(p.norm_w + d));
    } else if (warp < HCS_WARPS) {
#pragma unroll
        for (int j = 0; j < HCS_KPW; j++) {
            const int k = warp + HCS_WARPS * j;
            if (k < mix) asm volatile("prefetch.global.L2 [%0];" ::"l"(fn + ((int64_t)k * SH + c) * ES));
        }
    } else if (NORM && q.phase == 0) {
        const int per = (H + gridDim.x - 1) / gridDim.x, d = b * per + lane * 32;
        if (lane * 32 < per && d < H) asm volatile("prefetch.global.L2 [%0];" ::"l"(p.norm_w + d));
    }
    cu_pdl_wait(); /* X is the previous kernel's output */
    cu_pdl_trigger();
    if (warp < HCS_WARPS && q.phase != 2) {
        float wf[HCS_KPW][V];
#pragma unroll
        for (int j = 0; j < HCS_KPW; j++) {
            const int k = warp + HCS_WARPS * j;
            if (k < mix) cu_wload<DT, V>(p.fn, (int64_t)k * SH + c, wf[j]);
        }
        float xv[NB][V];
        if constexpr (POST) {
#pragma unroll
            for (int i = 0; i < NB; i++) {
                float col[HC_DEC_MAX_S][V], ad[V];
#pragma unroll
                for (int v = 0; v < V; v += 4) {
                    float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
                    if (i < p.n) f = __ldg((const float4 *)(q.a + (int64_t)i * H + dl + v));
                    ad[v] = f.x; ad[v + 1] = f.y; ad[v + 2] = f.z; ad[v + 3] = f.w;
#pragma unroll
                    for (int r = 0; r < HC_DEC_MAX_S; r++) {
                        f = make_float4(0.f, 0.f, 0.f, 0.f);
                        /* coherent loads: this kernel writes X (ld.global.nc is for data read-only
                         * for the whole kernel) */
                        if (i < p.n && r < S) f = __ldcg((const float4 *)(p.X + (int64_t)i * SH + (int64_t)r * H + dl + v));
                        col[r][v] = f.x; col[r][v + 1] = f.y; col[r][v + 2] = f.z; col[r][v + 3] = f.w;
                    }
                }
                const float po = i < p.n ? p.post[i * S + sl] : 0.f;
                float cm[HC_DEC_MAX_S];
#pragma unroll
                for (int r = 0; r < HC_DEC_MAX_S; r++) cm[r] = i < p.n && r < S ? p.comb[(i * S + r) * S + sl] : 0.f;
#pragma unroll
                for (int v = 0; v < V; v++) {
                    float x = __fmul_rn(po, ad[v]);
#pragma unroll
                    for (int r = 0; r < HC_DEC_MAX_S; r++)
                        if (r < S) x = __fadd_rn(x, __fmul_rn(cm[r], col[r][v]));
                    xv[i][v] = x;
                }
            }
            /* every dot warp has read X (and the old post, comb): the first writes X' */
            asm volatile("bar.sync 1, %0;" ::"r"(32 * HCS_WARPS) : "memory");
            if (warp == 0) {
#pragma unroll
                for (int i = 0; i < NB; i++)
#pragma unroll
                    for (int v = 0; v < V; v += 4)
                        if (i < p.n)
                            *(float4 *)(p.X + (int64_t)i * SH + c + v) =
                                make_float4(xv[i][v], xv[i][v + 1], xv[i][v + 2], xv[i][v + 3]);
                if (q.phase == 0) __threadfence(); /* X' before the arrival */
            }
        } else {
#pragma unroll
            for (int i = 0; i < NB; i++)
#pragma unroll
                for (int v = 0; v < V; v += 4) {
                    float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
                    if (i < p.n) f = __ldg((const float4 *)(p.X + (int64_t)i * SH + c + v));
                    xv[i][v] = f.x; xv[i][v + 1] = f.y; xv[i][v + 2] = f.z; xv[i][v + 3] = f.w;
                }
        }
#pragma unroll
        for (int j = 0; j < HCS_KPW; j++) {
            const int k = warp + HCS_WARPS * j;
#pragma unroll
            for (int i = 0; i < NB; i++) {
                float a = 0.f;
#pragma unroll
                for (int v = 0; v < V; v++) a = fmaf(wf[j][v], xv[i][v], a);
                a = cu_warp_sum(a);
                if (lane == 0 && k < mix) q.part[((int64_t)b * NB + i) * HC_DEC_MIX + k] = a;
            }
        }
        if (warp == 0)
#pragma unroll
            for (int i = 0; i < NB; i++) {
                double ss = 0;
#pragma unroll
                for (int v = 0; v < V; v++) ss += (double)xv[i][v] * xv[i][v];
                ss = cu_warp_sum(ss);
                if (lane == 0) q.part_ss[(int64_t)b * NB + i] = ss;
            }
        if (lane == 0 && q.phase == 0) __threadfence(); /* the partials before the arrival */
    }
    if (q.phase == 1) return; /* the finish kernel reads the partials after this kernel ends */
    if (q.phase == 0 && !cu_arrives_last(q.count, gridDim.x)) return;

    /* ---- the finishing block (phase 2, or the last to arrive) ---- */
    /* One row of H <= 4096: the highway columns the collapse needs are loaded now, beside the
     * partials' loads below, instead of one more L2 round trip after them. */
    constexpr int XE = NB == 1 ? 4 : 1; /* float4 a thread and stream */
    const int H4 = H / 4;
    const bool xe_on = NB == 1 && H4 <= XE * 32 * HCS_WARPS;
    float4 xe[HC_DEC_MAX_S][XE];
    if (NB == 1 && xe_on && warp < HCS_WARPS) {
#pragma unroll
        for (int s = 0; s < HC_DEC_MAX_S; s++)
#pragma unroll
            for (int u = 0; u < XE; u++) {
                const int d4 = tid + u * 32 * HCS_WARPS;
                xe[s][u] = s < S && d4 < H4 ? __ldcg((const float4 *)(p.X + (int64_t)s * H) + d4)
                                            : make_float4(0.f, 0.f, 0.f, 0.f);
            }
    }
    /* norm_w now, beside the partials' loads below, rather than one more round trip at the end
     * (up to 2 rows: at 4 the registers would spill) */
    constexpr bool EARLY_W = NORM && NB <= 2;
    float4 nw[EARLY_W ? HCS_PER : 1];
    if constexpr (EARLY_W) {
#pragma unroll
        for (int u = 0; u < HCS_PER; u++) {
            const int d4 = tid + u * 32 * HCS_WARPS;
            nw[u] = warp < HCS_WARPS && d4 < H / 4 ? __ldg((const float4 *)p.norm_w + d4) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    /* The NB * mix sums and NB X^2 sums of the partials: pair t on warp t % 9, lanes over the
     * blocks (all of a warp's loads issued first), a butterfly each: one L2 round trip, not one
     * per block. */
    {
        constexpr int PPW = (NB * HC_DEC_MIX + NB + HCS_WARPS) / (HCS_WARPS + 1), BPL = HCS_MAX_BLOCKS / 32;
        const int npair = NB * mix + NB, nblk = q.phase == 2 ? q.nblk : (int)gridDim.x;
        float v[PPW][BPL];
        double vd[BPL];
        const int dpair = npair - NB; /* pairs >= dpair are X^2 sums */
#pragma unroll
        for (int j = 0; j < PPW; j++) {
            const int t = warp + (HCS_WARPS + 1) * j, i = t / mix, k = t % mix;
#pragma unroll
            for (int u = 0; u < BPL; u++) {
                const int b0 = lane + 32 * u;
                v[j][u] = t < dpair && b0 < nblk ? __ldcg(q.part + ((int64_t)b0 * NB + i) * HC_DEC_MIX + k) : 0.f;
            }
        }
#pragma unroll
        for (int j = 0; j < PPW; j++) {
            const int t = warp + (HCS_WARPS + 1) * j;
            if (t >= npair) break;
            if (t < dpair) {
                float a = 0.f;
#pragma unroll
                for (int u = 0; u < BPL; u++) a += v[j][u];
                a = cu_warp_sum(a);
                if (lane == 0) m_s[(t / mix) * HC_DEC_MIX + t % mix] = a;
            } else {
                const int i = t - dpair;
#pragma unroll
                for (int u = 0; u < BPL; u++) {
                    const int b0 = lane + 32 * u;
                    vd[u] = b0 < nblk ? __ldcg(q.part_ss + (int64_t)b0 * NB + i) : 0.0;
                }
                double a = 0;
#pragma unroll
                for (int u = 0; u < BPL; u++) a += vd[u];
                a = cu_warp_sum(a);
                if (lane == 0) r_s[i] = 1.f / sqrtf((float)(a / SH) + p.rms_eps);
            }
        }
    }
    __syncthreads();
    if (tid == 0 && q.phase == 0) *q.count = 0u; /* every block has arrived: ready for the next call */
    if (tid < NB * S) {
        const int i = tid / S, s = tid % S;
        const float *m = m_s + i * HC_DEC_MIX;
        const float r = r_s[i];
        pre_s[i * HC_DEC_MAX_S + s] = hc_pre_of(m[s], r, p.scale[0], p.base[s], p.hc_eps);
        if (i < p.n)
            p.post[(int64_t)i * S + s] = hc_post_of(m[S + s], r, p.scale[1], p.base[S + s]);
    }
    __syncthreads();
    if (warp == HCS_WARPS) { /* the Sinkhorn of row `lane`, beside the collapse */
        if (lane < p.n)
            hc_comb_thread(p.comb + (int64_t)lane * S * S, m_s + lane * HC_DEC_MIX + 2 * S, r_s[lane], p.base + 2 * S,
                           p.scale[2], S, p.hc_eps, p.sinkhorn_iters);
        return;
    }
    /* y[i][d] = sum_s pre[i][s] X[i][s][d] (the CPU's order), 4 d a thread per step */
    float4 y[NB][HCS_PER];
#pragma unroll
    for (int i = 0; i < NB; i++)
#pragma unroll
        for (int u = 0; u < HCS_PER; u++) {
            const int d4 = tid + u * 32 * HCS_WARPS;
            float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
            if (i < p.n && d4 < H4) {
                float4 xs[HC_DEC_MAX_S];
#pragma unroll
                for (int s = 0; s < HC_DEC_MAX_S; s++)
                    if (s < S) {
                        if (xe_on && u < XE) xs[s] = xe[s][u < XE ? u : 0];
                        else xs[s] = __ldcg((const float4 *)(p.X + (int64_t)i * SH + (int64_t)s * H) + d4);
                    }
#pragma unroll
                for (int s = 0; s < HC_DEC_MAX_S; s++)
                    if (s < S) {
                        const float w = pre_s[i * HC_DEC_MAX_S + s];
                        a.x = __fadd_rn(a.x, __fmul_rn(w, xs[s].x));
                        a.y = __fadd_rn(a.y, __fmul_rn(w, xs[s].y));
                        a.z = __fadd_rn(a.z, __fmul_rn(w, xs[s].z));
                        a.w = __fadd_rn(a.w, __fmul_rn(w, xs[s].w));
                    }
            }
            y[i][u] = a;
        }
    if constexpr (!NORM) {
#pragma unroll
        for (int i = 0; i < NB; i++)
#pragma unroll
            for (int u = 0; u < HCS_PER; u++) {
                const int d4 = tid + u * 32 * HCS_WARPS;
                if (i < p.n && d4 < H4) ((float4 *)(p.y + (int64_t)i * H))[d4] = y[i][u];
            }
    } else { /* NORM */
        /* h = y * rms(y) * w: a double sum over the first 8 warps (a named barrier: the ninth is in
         * its Sinkhorn) */
#pragma unroll
        for (int i = 0; i < NB; i++) {
            double ss = 0;
#pragma unroll
            for (int u = 0; u < HCS_PER; u++)
                ss += (double)y[i][u].x * y[i][u].x + (double)y[i][u].y * y[i][u].y + (double)y[i][u].z * y[i][u].z +
                      (double)y[i][u].w * y[i][u].w;
            ss = cu_warp_sum(ss);
            if (lane == 0) red[warp][i] = ss;
        }
        asm volatile("bar.sync 1, %0;" ::"r"(32 * HCS_WARPS));
        if (tid < NB) {
            double a = 0;
            for (int w = 0; w < HCS_WARPS; w++) a += red[w][tid];
            r_y[tid] = 1.f / sqrtf((float)(a / H) + p.rms_eps);
        }
        asm volatile("bar.sync 1, %0;" ::"r"(32 * HCS_WARPS));
#pragma unroll
        for (int u = 0; u < HCS_PER; u++) {
            const int d4 = tid + u * 32 * HCS_WARPS;
            if (d4 >= H4) continue;
            const float4 w = EARLY_W ? nw[EARLY_W ? u : 0] : __ldg((const float4 *)p.norm_w + d4);
#pragma unroll
            for (int i = 0; i < NB; i++) {
                if (i >= p.n) continue;
                const float r = r_y[i];
                float4 o;
                o.x = __fmul_rn(__fmul_rn(y[i][u].x, r), w.x);
                o.y = __fmul_rn(__fmul_rn(y[i][u].y, r), w.y);
                o.z = __fmul_rn(__fmul_rn(y[i][u].z, r), w.z);
                o.w = __fmul_rn(__fmul_rn(y[i][u].w, r), w.w);
                ((float4 *)(p.h + (int64_t)i * H))[d4] = o;
            }
        }
    }
}

/* Whether the cluster kernel takes the shape (n rows, fn of dtype dt; norm: with the input norm
 * fused, which keeps each block's y columns in shared memory). */
static bool hc_pre_dec_ok(const mt_weight *fn, const float *X, int S, int H, int n, bool norm) {
    const int V = fn->dtype == MT_F32 ? 4 : 8;
    return n <= HC_DEC_MAX_N && S <= HC_DEC_MAX_S && ((int64_t)S * H) % ((int64_t)HC_CL * V) == 0 &&
           cu_aligned16(fn->data) && cu_aligned16(X) && (!norm || H <= HC_CL * HC_DEC_MAX_YLEN);
}

template <mt_dtype DT, bool NORM> static const void *hc_pre_dec_fn(int n) {
    if (n <= 1) return (const void *)hc_pre_dec_kernel<DT, 1, NORM>;
    if (n <= 2) return (const void *)hc_pre_dec_kernel<DT, 2, NORM>;
    return (const void *)hc_pre_dec_kernel<DT, 4, NORM>;
}

template <bool NORM> static const void *hc_pre_dec_pick(mt_dtype dt, int n) {
    return dt == MT_F32 ? hc_pre_dec_fn<MT_F32, NORM>(n)
           : dt == MT_F16 ? hc_pre_dec_fn<MT_F16, NORM>(n) : hc_pre_dec_fn<MT_BF16, NORM>(n);
}

/* Whether the split kernel takes it: the shape also fits the cluster kernel, whole 32-vector
 * blocks of columns, at most HCS_MAX_BLOCKS of them (the last block's lanes hold two blocks'
 * partials each: 16-bit fn at S*H <= 16384), H in float4 and within the last block's registers,
 * aligned norm_w. */
static bool hc_pre_split_ok(const mt_weight *fn, int S, int H, const float *norm_w) {
    const int64_t cpb = 32LL * (fn->dtype == MT_F32 ? 4 : 8), SH = (int64_t)S * H;
    return SH % cpb == 0 && SH / cpb <= HCS_MAX_BLOCKS && H % 4 == 0 && H / 4 <= HCS_MAX_H4 &&
           (!norm_w || cu_aligned16(norm_w));
}

template <mt_dtype DT, bool NORM, bool POST> static const void *hc_pre_split_fn(int n) {
    if (n <= 1) return (const void *)hc_pre_split_kernel<DT, 1, NORM, POST>;
    if (n <= 2) return (const void *)hc_pre_split_kernel<DT, 2, NORM, POST>;
    return (const void *)hc_pre_split_kernel<DT, 4, NORM, POST>;
}

template <bool NORM, bool POST> static const void *hc_pre_split_pick(mt_dtype dt, int n) {
    return dt == MT_F32 ? hc_pre_split_fn<MT_F32, NORM, POST>(n)
           : dt == MT_F16 ? hc_pre_split_fn<MT_F16, NORM, POST>(n) : hc_pre_split_fn<MT_BF16, NORM, POST>(n);
}

/* The split kernel's first launch: phase 1 (HCS_FIRST_PHASE 1), the dot products on every block,
 * then phase 2, the finish on one block, as a second launch; phase 0 would be one launch whose
 * last block finishes, but its fences, arrival and re-read of the partials cost more than a
 * programmatic kernel boundary (H200 decode_bench, the two forms alternating in one run: the
 * step's GPU time 1.175 / 1.174 / 1.175 ms fused, 1.168 / 1.169 / 1.169 ms as two launches). */
enum { HCS_FIRST_PHASE = 1 };

/* a: the fused hc_post's input (the split kernel's POST form; the caller checked
 * hc_post_pre_split_ok), else NULL. */
static mt_status hc_pre_dec_launch(mt_backend *be, hc_pre_params *p, mt_dtype dt, const mt_weight *fn,
                                   const float *a = NULL) {
    const cudaStream_t s = cu_stream(be);
    if (a || hc_pre_split_ok(fn, p->S, p->H, p->norm_w)) {
        const int blocks = (int)((int64_t)p->S * p->H / (32 * (dt == MT_F32 ? 4 : 8)));
        const int nb = p->n <= 1 ? 1 : p->n <= 2 ? 2 : 4;
        const size_t pf = cu_align_up((size_t)blocks * nb * HC_DEC_MIX * sizeof(float), 16);
        char *scr = (char *)cu_scratch(be, CU_SCRATCH_DENSE, pf + (size_t)blocks * nb * sizeof(double));
        if (!scr) return MT_ERR_NOMEM;
        hc_split_params q = {*p, (float *)scr, (double *)(scr + pf),
                             ((cu_backend *)be)->counters + CU_COUNTER_HC_PRE, a, HCS_FIRST_PHASE, blocks};
        const void *k = a ? hc_pre_split_pick<true, true>(dt, p->n)
                        : p->h ? hc_pre_split_pick<true, false>(dt, p->n) : hc_pre_split_pick<false, false>(dt, p->n);
        MT_CUDA_CHECK(cu_launch_pdl(k, dim3(blocks), dim3(HCS_THREADS), 0, s, &q));
        if (q.phase == 1) {
            q.phase = 2;
            MT_CUDA_CHECK(cu_launch_pdl(k, dim3(1), dim3(HCS_THREADS), 0, s, &q));
        }
        return MT_OK;
    }
    const void *k = p->h ? hc_pre_dec_pick<true>(dt, p->n) : hc_pre_dec_pick<false>(dt, p->n);
    MT_CUDA_CHECK(cu_launch_pdl(k, dim3(HC_CL), dim3(HC_DEC_THREADS), 0, s, p));
    return MT_OK;
}

static void hc_pre_check(const mt_weight *fn, const mt_hc_params *p, int n) {
    const int S = p->S, H = p->H, mix = (2 + S) * S;
    MT_ASSERT(S >= 1 && S <= HC_MAX_S && H > 0 && n >= 0);
    MT_ASSERT(fn->rows == mix && fn->cols == (int64_t)S * H);
    MT_ASSERT(fn->dtype == MT_F32 || fn->dtype == MT_F16 || fn->dtype == MT_BF16);
}

static void cu_hc_pre(mt_backend *be, float *y, float *post, float *comb, const float *X,
                      const mt_weight *fn, const float *base, const float *scale,
                      const mt_hc_params *p, int n) {
    hc_pre_check(fn, p, n);
    const int S = p->S, H = p->H, mix = (2 + S) * S;
    if (n == 0) return;
    hc_pre_params q = {y, post, comb, X, NULL, fn->data, base, scale, n, S, H, p->rms_eps, p->hc_eps,
                       p->sinkhorn_iters, NULL, NULL};
    if (hc_pre_dec_ok(fn, X, S, H, n, false)) {
        cu_op_status(be, "hc_pre", hc_pre_dec_launch(be, &q, fn->dtype, fn));
        return;
    }
    if (hc_pre_rows_ok(&q) && hcm_ok(fn, X, S, H)) { /* the mix on hcm_kernel, X split on the fly */
        /* slices of kc columns (a multiple of 16, rounded up: at most mk of them); the scratch is
         * sized by the count actually launched */
        const int K = S * H, mk = hcm_slices(n, K, cu_sms((const cu_backend *)be)),
                  kc = ((K + mk - 1) / mk + 15) / 16 * 16, slices = (K + kc - 1) / kc;
        float *mp = (float *)cu_scratch(be, CU_SCRATCH_DENSE, sizeof(float) * (size_t)slices * n * HCM_LD);
        if (!mp) return;
        const hcm_params hp = {mp, X, (const __nv_bfloat16 *)fn->data, n, K, mix, kc};
        const int rows = 16 * HCM_TILES * HCM_WARPS; /* a block's */
        const dim3 grid((unsigned)((n + rows - 1) / rows), (unsigned)slices);
        if (mix <= 24) hcm_kernel<3><<<grid, HCM_WARPS * 32, 0, cu_stream(be)>>>(hp);
        else hcm_kernel<4><<<grid, HCM_WARPS * 32, 0, cu_stream(be)>>>(hp);
        cu_check_launch(be, "hc_pre (mix)");
        q.m = mp;
        q.mk = (int)grid.y;
        cu_op_status(be, "hc_pre", hc_pre_launch(&q, cu_stream(be)));
        return;
    }
    float *m = (float *)cu_scratch(be, CU_SCRATCH_DENSE, sizeof(float) * (size_t)n * mix);
    if (!m) return;
    be->ops->matmul(be, m, X, fn, n); /* records its own failure */
    q.m = m;
    cu_op_status(be, "hc_pre", hc_pre_launch(&q, cu_stream(be)));
}

/* hc_pre, then h = rmsnorm(y) * norm_w (eps p->rms_eps): for a few rows one cluster launch that
 * never writes y (the norm's own kernel was ~4.5 us of latency per sublayer); otherwise the two
 * ops, y as their buffer. */
static void cu_hc_pre_norm(mt_backend *be, float *h, float *y, float *post, float *comb, const float *X,
                           const mt_weight *fn, const float *base, const float *scale, const float *norm_w,
                           const mt_hc_params *p, int n) {
    hc_pre_check(fn, p, n);
    if (n == 0) return;
    if (hc_pre_dec_ok(fn, X, p->S, p->H, n, true)) {
        hc_pre_params q = {y, post, comb, X, NULL, fn->data, base, scale, n, p->S, p->H, p->rms_eps, p->hc_eps,
                           p->sinkhorn_iters, h, norm_w};
        cu_op_status(be, "hc_pre_norm", hc_pre_dec_launch(be, &q, fn->dtype, fn));
        return;
    }
    cu_hc_pre(be, y, post, comb, X, fn, base, scale, p, n);
    be->ops->rmsnorm(be, h, y, norm_w, n, p->H, p->rms_eps);
}

/* Whether the split kernel's POST form takes it: the hc_pre_norm split shape, a stream's lanes a
 * whole share of the warp (S divides 32), aligned X and a. */
static bool hc_post_pre_split_ok(const mt_weight *fn, const float *X, const float *a, int S, int H, int n,
                                 const float *norm_w) {
    return hc_pre_dec_ok(fn, X, S, H, n, true) && hc_pre_split_ok(fn, S, H, norm_w) && 32 % S == 0 &&
           cu_aligned16(a) && norm_w;
}

static void cu_hc_post_pre_norm(mt_backend *be, float *X, const float *a, float *h, float *y, float *post,
                                float *comb, const mt_weight *fn, const float *base, const float *scale,
                                const float *norm_w, const mt_hc_params *p, int n) {
    hc_pre_check(fn, p, n);
    if (n == 0) return;
    if (hc_post_pre_split_ok(fn, X, a, p->S, p->H, n, norm_w)) {
        hc_pre_params q = {y, post, comb, X, NULL, fn->data, base, scale, n, p->S, p->H, p->rms_eps, p->hc_eps,
                           p->sinkhorn_iters, h, norm_w};
        cu_op_status(be, "hc_post_pre_norm", hc_pre_dec_launch(be, &q, fn->dtype, fn, a));
        return;
    }
    be->ops->hc_post(be, X, a, post, comb, p, n);
    cu_hc_pre_norm(be, h, y, post, comb, X, fn, base, scale, norm_w, p, n);
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

/* S <= HC_DEC_MAX_S, H % 4 == 0, X and a 16-byte aligned: one thread per (row, d .. d+3), float4
 * accesses, the same operations per element as hc_post_kernel. Launched for PDL (a is the
 * previous kernel's output). */
static __global__ void hc_post_vec_kernel(const hc_post_params p) {
    cu_pdl_wait();
    cu_pdl_trigger();
    const int H4 = p.H / 4;
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= p.n * H4) return;
    const int64_t i = t / H4;
    const int d = (int)(t % H4) * 4, S = p.S, H = p.H;
    float *x = p.X + i * S * H;
    const float *C = p.comb + i * S * S, *po = p.post + i * S;
    const float4 a4 = *(const float4 *)(p.a + i * H + d);
    const float ad[4] = {a4.x, a4.y, a4.z, a4.w};
    float col[HC_DEC_MAX_S][4];
#pragma unroll
    for (int r = 0; r < HC_DEC_MAX_S; r++)
        if (r < S) {
            const float4 c = *(const float4 *)(x + (int64_t)r * H + d);
            col[r][0] = c.x; col[r][1] = c.y; col[r][2] = c.z; col[r][3] = c.w;
        }
#pragma unroll
    for (int s = 0; s < HC_DEC_MAX_S; s++) {
        if (s >= S) break;
        float v[4];
#pragma unroll
        for (int c = 0; c < 4; c++) {
            v[c] = __fmul_rn(po[s], ad[c]);
#pragma unroll
            for (int r = 0; r < HC_DEC_MAX_S; r++)
                if (r < S) v[c] = __fadd_rn(v[c], __fmul_rn(C[r * S + s], col[r][c]));
        }
        *(float4 *)(x + (int64_t)s * H + d) = make_float4(v[0], v[1], v[2], v[3]);
    }
}

typedef struct hc_head_params {
    float *z;              /* [n, H] */
    const float *X;        /* [n, S, H] */
    int64_t n;
    int S, H;
} hc_head_params;

static __global__ void hc_head_kernel(const hc_head_params p) {
    cu_pdl_wait(); /* launched for PDL (cu_launch_pdl_k) */
    cu_pdl_trigger();
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= p.n * p.H) return;
    const int64_t i = t / p.H;
    const int d = (int)(t % p.H);
    float a = 0;
    for (int s = 0; s < p.S; s++) a += p.X[(i * p.S + s) * p.H + d];
    p.z[t] = a / (float)p.S;
}

static unsigned hc_grid(int64_t count) { return cu_grid_1d(count, HC_EW_THREADS, 0); }

enum { HC_POST_VEC_THREADS = 64 }; /* 16 blocks for one row of 4096: spread over the SMs */

static mt_status hc_post_launch(hc_post_params *p, cudaStream_t s) {
    if (p->S <= HC_DEC_MAX_S && p->H % 4 == 0 && cu_aligned16(p->X) && cu_aligned16(p->a)) {
        const int64_t count = p->n * (p->H / 4);
        const dim3 g((unsigned)((count + HC_POST_VEC_THREADS - 1) / HC_POST_VEC_THREADS));
        MT_CUDA_CHECK(cu_launch_pdl((const void *)hc_post_vec_kernel, g, dim3(HC_POST_VEC_THREADS), 0, s, p));
        return MT_OK;
    }
    hc_post_kernel<<<hc_grid(p->n * p->H), HC_EW_THREADS, 0, s>>>(*p);
    MT_CUDA_CHECK_LAUNCH();
    return MT_OK;
}

static mt_status hc_head_launch(const hc_head_params *p, cudaStream_t s) {
    cu_launch_pdl_k(hc_head_kernel, dim3(hc_grid(p->n * p->H)), dim3(HC_EW_THREADS), 0, s, *p);
    MT_CUDA_CHECK_LAUNCH();
    return MT_OK;
}

static void cu_hc_post(mt_backend *be, float *X, const float *a, const float *post,
                       const float *comb, const mt_hc_params *p, int n) {
    MT_ASSERT(p->S >= 1 && p->S <= HC_MAX_S && p->H > 0 && n >= 0);
    MT_ASSERT((int64_t)n * p->H / HC_EW_THREADS < INT_MAX);
    if (n == 0) return;
    hc_post_params q = {X, a, post, comb, n, p->S, p->H};
    cu_op_status(be, "hc_post", hc_post_launch(&q, cu_stream(be)));
}

static void cu_hc_head(mt_backend *be, float *z, const float *X, int n, int S, int H) {
    MT_ASSERT(S >= 1 && H > 0 && n >= 0);
    MT_ASSERT((int64_t)n * H / HC_EW_THREADS < INT_MAX);
    if (n == 0) return;
    hc_head_params q = {z, X, n, S, H};
    cu_op_status(be, "hc_head", hc_head_launch(&q, cu_stream(be)));
}

extern "C" void cu_hc_fill(mt_backend_ops *t) {
    t->hc_pre = cu_hc_pre;
    t->hc_pre_norm = cu_hc_pre_norm;
    t->hc_post_pre_norm = cu_hc_post_pre_norm;
    t->hc_post = cu_hc_post;
    t->hc_head = cu_hc_head;
}
