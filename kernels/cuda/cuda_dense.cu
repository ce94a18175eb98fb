/* kernels/cuda/cuda_dense.cu: embedding, matmul on bf16/fp16/fp32 weights with fp32 accumulation,
 * RMSNorm, LayerNorm, SwiGLU, sigmoid, l2norm, argmax: the same functions as kernels/cpu/
 * cpu_dense.c. Three tiers per op: kernels, a launcher that picks the grid, the
 * exported op that checks shapes.
 *
 * Matmul has three paths. Few rows (decode, n <= GEMV_MAX_N): a GEMV (bandwidth-bound on the
 * weight). From 3 rows, bf16 weights of at least GEMV_TC_MIN_ROWS rows take the tensor-core
 * GEMV (gemv_tc_kernel): one mma.sync m16n8k16 multiplies a 16-row weight tile by all n <= 8
 * inputs, x entering as three bf16 parts (24 significant bits, fp32-grade results), so x is read
 * once per 16 rows and n = 8 costs what n = 1 does. Other calls take the fp32 GEMV
 * (gemv_kernel): a warp streams 16-byte weight vectors of 4 rows (2 from 5 inputs) for all n
 * input rows, several loads in flight per lane, and short wide weights split K over up to 8 warps
 * of a block so that the grid always has work for every multiprocessor. Fixed-order reductions
 * finish each dot product. Many rows (prefill) on a bf16/fp16 weight: the tensor cores through
 * cuBLASLt (cu_gemm_tc, cuda_gemm16.cu, fp32 accumulation). x is split into 16-bit parts of the weight's type,
 * x ~ hi + lo (cu_split16, into CU_SCRATCH_GEMM), and y = w.hi + w.lo: 16 significant bits of x
 * for bf16, ~2e-6 relative error, twice the tensor-core work (MT_NUMERICS_EXACT). With
 * MT_NUMERICS_BF16, x is rounded once (hi only): half the work, ~1.5e-3 relative error for bf16,
 * which flips enough router/indexer choices downstream to fail the whole-model comparison with
 * the CPU. Otherwise (F32 weights, or MT_NUMERICS_FP32): at most 32 outputs (the mHC mix,
 * 24 x 16384), a narrow fp32 kernel where a warp owns whole input rows (mt_cuda_params.narrow
 * false: not used); wider, a 64 x 128 x 16 tiled fp32 GEMM (cu_gemm), which the MoE reuses in
 * grouped form. All are deterministic: the summation order depends only on the shape.
 *
 * Decode-path kernels (GEMV, norms, swiglu, sigmoid) are launched for programmatic dependent
 * launch (cu_launch_pdl, below); the norms keep few rows in registers (norm_vec_kernel). */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"

/* ================================ embed ================================ */

enum { EMBED_CHUNK = 4096, EMBED_THREADS = 256 };

/* ids travel by value (they are host memory), EMBED_CHUNK rows per launch: 16 KB of parameters,
 * within the 32 KB that CUDA 12.1+ allows. A 4096-token prefill looks up 16384 ids (each token
 * once a stream, glm_model.c): 4 launches, 0.20 ms on the H200, against 32 launches of 512 rows
 * and 0.27 ms. */
typedef struct embed_params {
    float *out;                /* [n, H] fp32 */
    const void *table;         /* [V, H] dtype */
    int n, H;                  /* n <= EMBED_CHUNK */
    int32_t ids[EMBED_CHUNK];  /* [n] rows of table */
} embed_params;

/* V: elements a load; cu_wvec<DT>::n (16-byte weight loads, 16-byte output stores) when H is a
 * multiple of it and the table and output are 16-byte aligned, else 1. Element loads of 2 bytes
 * made a 4096-token prefill's embedding 0.38 ms on the H200, 16-byte loads 0.26 ms (eight launches of
 * 512 rows). */
template <mt_dtype DT, int V> static __global__ void embed_kernel(const __grid_constant__ embed_params p) {
    const int i = blockIdx.x;
    const int64_t base = (int64_t)p.ids[i] * p.H; /* p.ids[i] < 0: another shard's row, zeros */
    float *o = p.out + (int64_t)i * p.H;
    for (int d = threadIdx.x * V; d < p.H; d += blockDim.x * V) {
        float v[V];
        if (p.ids[i] >= 0) {
            cu_wload<DT, V>(p.table, base + d, v);
        } else {
#pragma unroll
            for (int j = 0; j < V; j++) v[j] = 0.f;
        }
        if constexpr (V % 4 == 0) {
#pragma unroll
            for (int j = 0; j < V; j += 4) *(float4 *)(o + d + j) = make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]);
        } else {
#pragma unroll
            for (int j = 0; j < V; j++) o[d + j] = v[j];
        }
    }
}

template <mt_dtype DT> static void embed_launch_t(const embed_params *p, cudaStream_t s) {
    constexpr int V = cu_wvec<DT>::n;
    const bool vec = p->H % V == 0 && cu_aligned16(p->table) && cu_aligned16(p->out);
    if (vec) embed_kernel<DT, V><<<p->n, EMBED_THREADS, 0, s>>>(*p);
    else embed_kernel<DT, 1><<<p->n, EMBED_THREADS, 0, s>>>(*p);
}

static mt_status embed_launch(const embed_params *p, mt_dtype dt, cudaStream_t s) {
    switch (dt) {
    case MT_F32: embed_launch_t<MT_F32>(p, s); break;
    case MT_F16: embed_launch_t<MT_F16>(p, s); break;
    default: embed_launch_t<MT_BF16>(p, s); break;
    }
    MT_CUDA_CHECK_LAUNCH();
    return MT_OK;
}

static void cu_embed(mt_backend *be, float *out, const mt_weight *table, const int32_t *ids, int n) {
    MT_ASSERT(table->cols > 0 && table->cols <= INT_MAX);
    for (int i0 = 0; i0 < n; i0 += EMBED_CHUNK) {
        embed_params p;
        p.n = n - i0 < EMBED_CHUNK ? n - i0 : EMBED_CHUNK;
        p.H = (int)table->cols;
        p.table = table->data;
        p.out = out + (int64_t)i0 * p.H;
        for (int i = 0; i < p.n; i++) {
            const int64_t r = (int64_t)ids[i0 + i] - table->row0;
            p.ids[i] = r >= 0 && r < table->rows ? (int32_t)r : -1; /* -1: another shard's, zeros */
        }
        mt_status st = embed_launch(&p, table->dtype, cu_stream(be));
        if (st != MT_OK) return cu_op_status(be, "embed", st);
    }
    cu_prof_mark(be, "embed");
}

/* ================================ matmul ================================ */

enum { GEMV_THREADS = 256, GEMV_WARPS = GEMV_THREADS / 32, GEMV_MAX_N = 8, GEMV_LOADS = 8, GEMV_MAX_W = 6 };

/* Rows a warp of gemv_kernel (R) for NB input rows; it keeps GEMV_LOADS / R chunks of each row
 * in flight. Every x vector a lane loads from L1 serves R rows: with fp32 x that is 2 / R bytes
 * of L1 traffic a weight byte per input row, and it is that traffic, not the weight's, that held
 * the GEMV below a plain read. H200, kernels_cuda_dense_test DecodeTimings, the 15 decode shapes
 * at one row: R = 2 (4 chunks) 466.8 us = 93.4% of the copy bandwidth, R = 4 441.9 us = 98.6%
 * (n = 2: 548.3 -> 499.6 us); R = 8 at one row 439.7 us, but 78 registers and slower small
 * shapes; decode_bench's engine path 1.297 / 1.289 -> 1.264 / 1.282 ms (same machine, alternate
 * runs). The accumulators (R x NB) bound R as NB grows. */
static constexpr __host__ __device__ int gemv_r(int nb) { return nb <= 4 ? 4 : 2; }

typedef struct gemv_params {
    float *y;        /* [n, rows] fp32 */
    const float *x;  /* [n, cols] fp32 */
    const void *w;   /* [rows, cols] dtype */
    int n, rows, cols;
    int ksplit;      /* GEMV: warps sharing one group of gemv_r(NB) rows (1, 2, 4 or 8) */
    /* GEMV over an F8E4M3 weight (nw 0 or 1): its row stride cu_fp8_kpad(cols) and its 128 x 128
     * block scales (cuda_ops.h's layout); other dtypes leave ld 0 (the stride is cols) */
    int ld;
    const float *wscale;
    int persist;     /* GEMV: 0, block b takes tile b; 1, the grid is persistent and block b takes
                        the contiguous tiles [b T / grid, (b + 1) T / grid) of the T tiles */
    int ahead;       /* tensor-core GEMV: chunks a warp prefetches into L2 ahead of its loads */
    /* gemv_kernel over nw >= 2 weights of `cols` columns sharing x (cu_matmul_multi; nw 0 or 1:
     * w, y, rows above): weight j owns the tiles [wt0[j], wt0[j + 1]), each padded to whole tiles */
    int nw;
    const void *ws[GEMV_MAX_W];
    float *ys[GEMV_MAX_W];
    int wrows[GEMV_MAX_W];
    int wt0[GEMV_MAX_W + 1];
    unsigned sig;    /* bit j: weight j's outputs go through a sigmoid before they are stored */
    /* gemv_shortk_kernel over nw == 2 weights (cu_kda_gates): weight j's input xs[j], its blocks
     * [wt0[j], wt0[j + 1]) (set by the launcher); weight 0's outputs through the KDA gate with
     * gate_bias [rows0] and gate_alog [rows0 / gate_dk] when gate_alog is set */
    const float *xs[2];
    const float *gate_bias, *gate_alog;
    int gate_dk;
    bool gate_lb;
    float gate_lbv;
    /* gemv_shortk_kernel: wait for the previous kernel only before exiting, not before reading
     * (cu_kda_gates with beside_previous: its inputs are older than that kernel) */
    bool late_wait;
} gemv_params;


/* The weight is a list of chunks per row: chunk c holds the load units (V elements each) 32c ..
 * 32c + 31, lane l taking unit 32c + l, so one warp load is 512 contiguous bytes (VEC, bf16). A
 * warp owns a group of R = gemv_r(NB) rows and the chunks s, s + ksplit, s + 2 ksplit, ... of
 * them, s its slice among the ksplit warps of the group; each step it issues GEMV_LOADS / R
 * chunks x R rows of loads (8 x 16 bytes per lane in flight) before the first use. Short, wide
 * weights split K over 2-8 warps (the partial sums meet in shared memory, in slice order); tall
 * ones keep a group per warp with no barrier. Grid: ceil(groups / (8 / ksplit)) blocks of 8
 * warps. Each output is a per-lane running sum in chunk order, a fixed butterfly over the lanes,
 * then the slices in order: deterministic for a given shape. Launched for PDL: the first step's
 * weight lines are prefetched into L2 before waiting for the previous kernel (they depend on
 * none; the loads themselves land after the wait in the SASS, whatever their place in the
 * source). */
template <mt_dtype DT, int NB, bool VEC>
static __global__ void __launch_bounds__(GEMV_THREADS) gemv_kernel(const gemv_params p) {
    constexpr int R = gemv_r(NB), U = GEMV_LOADS / R, V = cu_wstream<DT, VEC>::V, W = cu_wstream<DT, VEC>::W;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int ks = p.ksplit, per_block = GEMV_WARPS / ks, s = warp % ks;
    const int nv = p.cols / V, nch = (nv + 31) >> 5;
    /* A tile is the block's per_block row groups (of one weight). */
    const int ntiles = ((p.rows + R - 1) / R + per_block - 1) / per_block;
    int t0 = blockIdx.x, t1 = blockIdx.x + 1;
    if (p.persist) {
        t0 = (int)((int64_t)blockIdx.x * ntiles / gridDim.x);
        t1 = (int)((int64_t)(blockIdx.x + 1) * ntiles / gridDim.x);
    }
    /* the tile's weight, output and rows, and its index within that weight */
    const void *w = p.w;
    float *y = p.y;
    int rows = p.rows, lt = t0;
    bool sig = p.sig & 1u;
    auto pick = [&](int tile) {
        lt = tile;
        if (p.nw < 2) return;
        int j = 0;
        while (j + 1 < p.nw && tile >= p.wt0[j + 1]) j++;
        w = p.ws[j];
        y = p.ys[j];
        rows = p.wrows[j];
        sig = p.sig >> j & 1u;
        lt = tile - p.wt0[j];
    };
    pick(t0);
    int row0 = (lt * per_block + warp / ks) * R;
    const int64_t ld = p.ld > 0 ? p.ld : p.cols;
    cu_wstream<DT, VEC> wr[U][R];
    auto load = [&](int c0) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int v = (c0 + u * ks) * 32 + lane;
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (v < nv && row0 + r < rows) cu_wstream_at(wr[u][r], w, p.wscale, row0 + r, ld, (int64_t)v * V);
                else wr[u][r].zero();
            }
        }
    };

    if constexpr (VEC) {
        /* The first step's 32 lines of 128 bytes (U chunks x R rows x 512 bytes) into L2, lane l
         * taking line l % 4 of chunk (l / 4) / R, row (l / 4) % R: issued before the PDL wait, which
         * ptxas would otherwise schedule ahead of the loads below (see gemv_tc_kernel). */
        const int u = (lane >> 2) / R, r = (lane >> 2) % R, v = (s + u * ks) * 32 + 8 * (lane & 3);
        if (v < nv && row0 + r < rows && (s + u * ks) < nch)
            asm volatile("prefetch.global.L2 [%0];" ::"l"((const char *)w +
                                                          ((int64_t)(row0 + r) * ld + (int64_t)v * V) *
                                                              (DT == MT_F32 ? 4 : DT == MT_F8E4M3 ? 1 : 2)));
    }
    load(s);
    cu_pdl_wait(); /* x is the previous kernel's output */
    cu_pdl_trigger();
    __shared__ float red[GEMV_WARPS][R * NB];
    for (int tile = t0; tile < t1; tile++) {
        if (tile != t0) pick(tile);
        row0 = (lt * per_block + warp / ks) * R;
        float acc[R][NB];
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int i = 0; i < NB; i++) acc[r][i] = 0.f;
        for (int c0 = s; c0 < nch; c0 += U * ks) {
            if (c0 != s || tile != t0) load(c0);
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int v = (c0 + u * ks) * 32 + lane;
                if (v >= nv) continue;
                /* in pieces of W elements: e4m3 loads hold 16 codes, dequantised 4 at a time so that
                 * the R x 16 weights never sit in registers at once; other dtypes take one piece */
#pragma unroll
                for (int q = 0; q < V / W; q++) {
                    float wf[R][W];
#pragma unroll
                    for (int r = 0; r < R; r++) wr[u][r].get_piece(q, wf[r]);
#pragma unroll
                    for (int i = 0; i < NB; i++) {
                        if (i >= p.n) break;
                        float xv[W];
                        cu_xload_ro<W>(p.x + (int64_t)i * p.cols + (int64_t)v * V + W * q, xv);
#pragma unroll
                        for (int r = 0; r < R; r++)
#pragma unroll
                            for (int j = 0; j < W; j++) acc[r][i] = fmaf(wf[r][j], xv[j], acc[r][i]);
                    }
                }
            }
        }

        /* Every lane ends with every sum; lane t < R*NB keeps sum t = (row t / NB, input t % NB). */
        float mine = 0.f;
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int i = 0; i < NB; i++) {
                const float v = cu_warp_sum(acc[r][i]);
                if (lane == r * NB + i) mine = v;
            }
        if (ks == 1) { /* uniform over the block */
            const int r = lane / NB, i = lane % NB;
            if (lane < R * NB && i < p.n && row0 + r < rows) y[(int64_t)i * rows + row0 + r] = sig ? cu_sigmoidf(mine) : mine;
            continue;
        }
        if (tile != t0) __syncthreads(); /* the previous tile's sums are read */
        if (lane < R * NB) red[warp][lane] = mine;
        __syncthreads();
        const int t = threadIdx.x;
        if (t < per_block * R * NB) {
            const int g = t / (R * NB), e = t % (R * NB), r = e / NB, i = e % NB;
            const int row = (lt * per_block + g) * R + r;
            if (i < p.n && row < rows) {
                float sum = 0.f;
                for (int q = 0; q < ks; q++) sum += red[g * ks + q][e];
                y[(int64_t)i * rows + row] = sig ? cu_sigmoidf(sum) : sum;
            }
        }
    }
}

/* ---- GEMV for short rows: cols <= 16 load vectors (the KDA gates' K = 128 at decode) ----
 * gemv_kernel gives a row group a whole warp-wide chunk, so a row of 16 vectors leaves half the
 * lanes idle and each warp one load in flight (~4.8 us for 2 MB). Here lanes form groups of G
 * (the vector count rounded up to a power of two), a group per row, 32 / G rows per warp load
 * and NK_U such loads in flight per lane; a group's partial sums meet by a butterfly within it.
 * Deterministic; needs 16-byte aligned w and x and cols a whole number of vectors. */
enum { NK_U = 4 };
template <mt_dtype DT, int NB, int G>
static __global__ void __launch_bounds__(GEMV_THREADS) gemv_shortk_kernel(const gemv_params p) {
    constexpr int V = cu_wvec<DT>::n, RPW = 32 / G * NK_U; /* rows a warp */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane / G, gl = lane % G;
    const int nv = p.cols / V;
    /* the block's weight (two with cu_kda_gates) */
    const void *w = p.w;
    const float *x = p.x;
    float *y = p.y;
    int rows = p.rows, blk = blockIdx.x;
    bool gate = false;
    if (p.nw == 2) {
        const int j = blk >= p.wt0[1];
        w = p.ws[j];
        x = p.xs[j];
        y = p.ys[j];
        rows = p.wrows[j];
        blk -= p.wt0[j];
        gate = j == 0 && p.gate_alog;
    }
    const int row0 = (blk * GEMV_WARPS + warp) * RPW;
    cu_wstream<DT, true> wr[NK_U];
#pragma unroll
    for (int u = 0; u < NK_U; u++) {
        const int row = row0 + u * (32 / G) + g;
        if (gl < nv && row < rows) wr[u].load(w, (int64_t)row * p.cols + (int64_t)gl * V);
        else wr[u].zero();
    }
    /* x is the previous kernel's output, or with late_wait an older one's: that kernel has passed
     * its own wait, so its predecessor has finished and its writes are visible */
    if (!p.late_wait) cu_pdl_wait();
    cu_pdl_trigger();
    float xv[NB][V];
#pragma unroll
    for (int i = 0; i < NB; i++) {
        if (i < p.n && gl < nv) cu_xload_ro<V>(x + (int64_t)i * p.cols + (int64_t)gl * V, xv[i]);
        else
#pragma unroll
            for (int j = 0; j < V; j++) xv[i][j] = 0.f;
    }
#pragma unroll
    for (int u = 0; u < NK_U; u++) {
        float wf[V];
        wr[u].get(wf);
        const int row = row0 + u * (32 / G) + g;
#pragma unroll
        for (int i = 0; i < NB; i++) {
            float a = 0.f;
#pragma unroll
            for (int j = 0; j < V; j++) a = fmaf(wf[j], xv[i][j], a);
#pragma unroll
            for (int o = G / 2; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
            if (gl == 0 && i < p.n && row < rows)
                y[(int64_t)i * rows + row] =
                    gate ? cu_kda_gate_value(a, p.gate_bias[row], p.gate_alog[row / p.gate_dk], p.gate_lb, p.gate_lbv) : a;
        }
    }
    /* late_wait: the kernel ends after the previous one, so the kernels after see both done */
    if (p.late_wait) cu_pdl_wait();
}

template <mt_dtype DT, int NB> static mt_status gemv_shortk_launch_nb(const gemv_params *p, int G, cudaStream_t s) {
    const int rpb = GEMV_WARPS * (32 / G) * NK_U;
    const void *k = G <= 2 ? (const void *)gemv_shortk_kernel<DT, NB, 2>
                    : G <= 4 ? (const void *)gemv_shortk_kernel<DT, NB, 4>
                    : G <= 8 ? (const void *)gemv_shortk_kernel<DT, NB, 8> : (const void *)gemv_shortk_kernel<DT, NB, 16>;
    gemv_params q = *p;
    if (q.nw == 2) { /* each weight its own whole blocks */
        q.wt0[0] = 0;
        for (int j = 0; j < 2; j++) q.wt0[j + 1] = q.wt0[j] + (q.wrows[j] + rpb - 1) / rpb;
    }
    const dim3 grid(q.nw == 2 ? (unsigned)q.wt0[2] : (unsigned)((q.rows + rpb - 1) / rpb));
    MT_CUDA_CHECK(cu_launch_pdl(k, grid, dim3(GEMV_THREADS), 0, s, &q));
    return MT_OK;
}

template <mt_dtype DT> static mt_status gemv_shortk_launch_dt(const gemv_params *p, int G, cudaStream_t s) {
    return p->n <= 1 ? gemv_shortk_launch_nb<DT, 1>(p, G, s) : gemv_shortk_launch_nb<DT, 2>(p, G, s);
}

/* Whether the short-row kernel takes it: n <= 2 rows of x, cols 2..16 vectors, aligned, one weight
 * (cu_kda_gates checks its two itself). */
static bool gemv_shortk_ok(const gemv_params *p, mt_dtype dt) {
    const int V = dt == MT_F32 ? 4 : 8;
    return p->nw < 2 && p->n <= 2 && p->cols % V == 0 && p->cols / V >= 2 && p->cols / V <= 16 &&
           cu_aligned16(p->w) && cu_aligned16(p->x);
}

static mt_status gemv_shortk_launch(const gemv_params *p, mt_dtype dt, cudaStream_t s) {
    const int nv = p->cols / (dt == MT_F32 ? 4 : 8);
    int G = 2;
    while (G < nv) G *= 2;
    switch (dt) {
    case MT_F32: return gemv_shortk_launch_dt<MT_F32>(p, G, s);
    case MT_F16: return gemv_shortk_launch_dt<MT_F16>(p, G, s);
    default: return gemv_shortk_launch_dt<MT_BF16>(p, G, s);
    }
}

/* The grid choice:
 *   GEMV_WARPS_PER_SM   split K until the grid has this many warps per multiprocessor
 *   GEMV_BLOCKS_PER_SM  0: one tile per block, as many blocks; b > 0: a persistent grid of at most b
 *                       blocks per multiprocessor, each over contiguous tiles (gemv_kernel's
 *                       p.persist form, measured slower)
 * H200, bench-4L decode shapes as graphs (kernels_cuda_dense_test DecodeTimings), sum of one
 * call of each of 15 shapes: warps 32 475.6 us, 64 470.8, 16 470.8; blocks 2 483.8, 3 539.9.
 * decode_bench graph: warps 32 2.255 / 2.239 ms, 64 2.223, blocks 2 2.251 (noise ~0.02 ms). */
enum { GEMV_WARPS_PER_SM = 64, GEMV_BLOCKS_PER_SM = 0 };

/* Warps per row group: split K until the grid has about GEMV_WARPS_PER_SM warps per
 * multiprocessor (64: two waves of the 4 resident 8-warp blocks per SM that its registers allow
 * at one row, each wave keeping ~128 KB of loads in flight per SM), while every slice still gets
 * at least two chunks. */
static int gemv_ksplit(int rows, int R, int nch, int n_sm) {
    const int64_t groups = (rows + R - 1) / R, want = (int64_t)n_sm * GEMV_WARPS_PER_SM;
    int ks = 1;
    while (ks < GEMV_WARPS && groups * ks < want && 2 * ks <= nch) ks *= 2;
    return ks;
}

template <mt_dtype DT, int NB>
static mt_status gemv_launch_nb(gemv_params *p, bool vec, int n_sm, cudaStream_t s) {
    const int V = vec ? cu_wvec<DT>::n : 1;
    constexpr int R = gemv_r(NB);
    p->ksplit = gemv_ksplit(p->rows, R, (p->cols / V + 31) / 32, n_sm); /* several weights: their total rows */
    const int64_t groups = (p->rows + R - 1) / R, per_block = GEMV_WARPS / p->ksplit;
    int64_t tiles = (groups + per_block - 1) / per_block;
    const int64_t cap = (int64_t)n_sm * GEMV_BLOCKS_PER_SM;
    if (p->nw >= 2) { /* each weight its own whole tiles */
        p->wt0[0] = 0;
        for (int j = 0; j < p->nw; j++)
            p->wt0[j + 1] = p->wt0[j] + (int)((((int64_t)p->wrows[j] + R - 1) / R + per_block - 1) / per_block);
        tiles = p->wt0[p->nw];
    }
    p->persist = p->nw < 2 && cap > 0 && tiles > cap;
    const dim3 grid((unsigned)(p->persist ? cap : tiles));
    const void *k = vec ? (const void *)gemv_kernel<DT, NB, true> : (const void *)gemv_kernel<DT, NB, false>;
    MT_CUDA_CHECK(cu_launch_pdl(k, grid, dim3(GEMV_THREADS), 0, s, p));
    return MT_OK;
}

template <mt_dtype DT> static mt_status gemv_launch_dt(gemv_params *p, bool vec, int n_sm, cudaStream_t s) {
    if (p->n <= 1) return gemv_launch_nb<DT, 1>(p, vec, n_sm, s);
    if (p->n <= 2) return gemv_launch_nb<DT, 2>(p, vec, n_sm, s);
    if (p->n <= 4) return gemv_launch_nb<DT, 4>(p, vec, n_sm, s);
    return gemv_launch_nb<DT, 8>(p, vec, n_sm, s);
}

/* 16-byte loads need cols to be a whole number of them and aligned bases. */
static mt_status gemv_launch(gemv_params *p, mt_dtype dt, int n_sm, cudaStream_t s) {
    const int vn = dt == MT_F32 ? 4 : dt == MT_F8E4M3 ? 16 : 8;
    const bool vec = p->cols % vn == 0 && cu_aligned16(p->w) && cu_aligned16(p->x);
    switch (dt) {
    case MT_F32: return gemv_launch_dt<MT_F32>(p, vec, n_sm, s);
    case MT_F16: return gemv_launch_dt<MT_F16>(p, vec, n_sm, s);
    case MT_F8E4M3: return gemv_launch_dt<MT_F8E4M3>(p, vec, n_sm, s);
    default: return gemv_launch_dt<MT_BF16>(p, vec, n_sm, s);
    }
}

/* ---- GEMV on the tensor cores: bf16 weights, n <= 8 ---- */

/* Why: the fp32 GEMV above does n FMAs per weight element and, for each 16-byte weight vector of
 * its 2 rows, loads n x vectors of 32 bytes from L1: at n = 8 that is 8 bytes of L1 traffic per
 * weight byte, past what L1 serves while the weight streams at HBM speed (H200: the batch-8 dense
 * matmuls ran at ~1 TB/s). Here one mma.sync m16n8k16 multiplies a 16-row weight tile by all
 * n <= 8 inputs (N = 8, columns n.. zero), so each x value loaded serves 16 rows (x traffic n/8
 * of the weight's at 4-byte x) and the arithmetic leaves the FMA pipes.
 *
 * Precision: x enters as three bf16 parts, hi = rn(x), mid = rn(x - hi), lo = rn(x - hi - mid)
 * (the differences are exact in fp32): 24 significant bits, x itself to fp32 rounding. bf16 x
 * bf16 products are exact in fp32. Each part has its own accumulator, restarted every chunk (8
 * k-steps) and then added into an fp32 running sum in RN, so the tensor core's own accumulation
 * (which truncates) covers at most 128 products at a time. Expected error: that of an fp32 GEMV.
 *
 * Layout: a tile is 16 weight rows; the k axis goes in blocks of 32 elements, lane (g, t) =
 * (lane / 4, lane % 4) loading the 16 bytes [32 kb + 8t, +8) of rows g and g + 8 and the same
 * 8 elements of x row g (g < n; zero otherwise). The MMA sees a permutation of k, the same for
 * A and B: k-step q (0, 1) of a k-block takes elements 4q .. 4q + 3 of each lane's vector, pair
 * (4q, 4q + 1) as the fragment's k = 2t, 2t + 1 and pair (4q + 2, 4q + 3) as k = 2t + 8, 2t + 9
 * (PTX m16n8k16 fragments: a0 row g, a1 row g + 8, a2 row g k + 8, a3 row g + 8 k + 8; b0, b1
 * column g; c0, c1 row g columns 2t, 2t + 1; c2, c3 row g + 8). A dot product is order-free.
 *
 * Work: a chunk is GEMV_TC_J k-blocks, J x 64 contiguous bytes of each of the 16 rows. The ks
 * warps of a tile take chunks s, s + ks, ... (s the warp's slice), so a block's warps together
 * read 8 / ks tiles x ks consecutive chunks (2 KB of each row at ks = 8) at a time. Each step a
 * warp loads one chunk into registers (8 x 16 bytes per lane; one buffer keeps the kernel at 113
 * registers, two blocks per SM; a second register buffer spilled at 128). p.ahead > 0 also
 * prefetches into L2 the chunk p.ahead steps ahead (one prefetch.global.L2 per lane: its 32
 * lines), the first ones before the PDL wait; measured no faster, so GEMV_TC_AHEAD is 0 (at 2,
 * n = 1: 3-9% slower on lm_head, gate/up, q/k/v, q_b, shared down, within 1% on kda o, dsa o,
 * 2-9% faster on the down, shared gate/up and dsa q_a shapes; the sums below).
 * Slices meet in shared memory in slice order; every sum's order depends only on the shape:
 * deterministic. Needs cols % 8 == 0 and 16-byte aligned w and x (gemv_tc_ok).
 *
 * Measured (H200, kernels_cuda_dense_test CudaOps.DecodeTimings: each shape's calls replayed as a
 * graph, weights from HBM; % of the 4241-4287 GB/s copy bandwidth), us at n = 1 / 2 / 4 / 8:
 *                        fp32 GEMV (gemv_kernel)        tensor-core GEMV (ahead 0)
 *   lm_head 154880x4096  292 / 299 / 432 / 743          341 / 342 / 343 / 351 (85-88%)
 *   gate/up 12288x4096   29.1 / 31.5 / 45.9 / 76.4      33.1 / 32.6 / 33.0 / 33.6
 *   down 4096x12288      26.8 / 34.3 / 51.8 / 101       30.8 / 30.8 / 31.0 / 30.8
 *   q/k/v 8192x4096      18.0 / 22.3 / 34.2 / 55.4      22.3 / 22.3 / 22.3 / 22.9
 *   shared down 4096x2048 9.1 / 12.2 / 17.6 / 24.3      7.1 / 7.0 / 7.1 / 7.1
 *   sum of 15 shapes     464 / 507 / 759 / 1299         557 / 559 / 566 / 587 (ahead 2)
 * The fp32 GEMV wins at n <= 2 (its 32 warps per SM keep more loads in flight than these 16; a
 * warp load here covers 64 bytes of each of 8 rows, not 512 of one), this one from n = 3 on
 * (GEMV_TC_MIN_N; n = 3 itself is interpolated). Rows < 1024 (router, kv_a, KDA f_a/b: 4-36
 * tiles) stay on the fp32 GEMV at any n: 6.3-6.8 us here against 1.5-5.6. Next steps: 128-byte
 * row segments per warp load (cp.async or TMA into shared memory, then ldmatrix) and more warps
 * per SM. */
enum { GEMV_TC_J = 4, GEMV_TC_TILE = 16, GEMV_TC_AHEAD = 0, GEMV_TC_MIN_ROWS = 1024, GEMV_TC_MIN_N = 3 };

/* 16 bytes of weight through the read-only path without allocating in L1 (read once). */
static __device__ __forceinline__ uint4 gemv_tc_ldw(const char *a) {
    uint4 u;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w)
                 : "l"(a));
    return u;
}

/* (a, b) as three bf16x2 parts, a in the low half (the lower k of a fragment register). */
static __device__ __forceinline__ void gemv_tc_split(float a, float b, uint32_t &h, uint32_t &m, uint32_t &l) {
    const __nv_bfloat162 hh = __floats2bfloat162_rn(a, b);
    const float2 hf = __bfloat1622float2(hh);
    const float ra = a - hf.x, rb = b - hf.y;
    const __nv_bfloat162 mm = __floats2bfloat162_rn(ra, rb);
    const float2 mf = __bfloat1622float2(mm);
    const __nv_bfloat162 ll = __floats2bfloat162_rn(ra - mf.x, rb - mf.y);
    h = *(const uint32_t *)&hh;
    m = *(const uint32_t *)&mm;
    l = *(const uint32_t *)&ll;
}

/* Grid: ceil(tiles / (8 / ksplit)) blocks of 8 warps; warp w of block b owns tile
 * b * (8 / ksplit) + w / ksplit (rows [16 tile, +16)) and slice w % ksplit of its chunks. At most
 * 128 registers a thread (two blocks per multiprocessor or more). */
static __global__ void __launch_bounds__(GEMV_THREADS, 2) gemv_tc_kernel(const gemv_params p) {
    constexpr int J = GEMV_TC_J;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int ks = p.ksplit, s = warp % ks;
    const int row0 = (blockIdx.x * (GEMV_WARPS / ks) + warp / ks) * GEMV_TC_TILE;
    const int nch = (p.cols + 32 * J - 1) / (32 * J);
    const bool ok0 = row0 + g < p.rows, ok1 = row0 + g + 8 < p.rows, okx = g < p.n;
    const char *w0 = (const char *)p.w + ((int64_t)(ok0 ? row0 + g : 0) * p.cols + 8 * t) * 2;
    const char *w1 = (const char *)p.w + ((int64_t)(ok1 ? row0 + g + 8 : 0) * p.cols + 8 * t) * 2;
    const float *xg = p.x + (int64_t)(okx ? g : 0) * p.cols + 8 * t;
    /* L2 prefetch of a chunk: lane l takes 128-byte line l % LPR of row l / LPR of the tile
     * (LPR = J / 2 lines per row and chunk), every line of the chunk once. */
    constexpr int LPR = J / 2;
    const int prow = row0 + lane / LPR;
    const char *pf = (const char *)p.w + ((int64_t)(prow < p.rows ? prow : 0) * p.cols) * 2 + 128 * (lane % LPR);
    auto prefetch = [&](int c) {
        const int64_t k = (int64_t)c * J * 32 + 64 * (lane % LPR);
        if (c < nch && prow < p.rows && lane < GEMV_TC_TILE * LPR && k < p.cols)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(pf + (int64_t)c * J * 64));
    };

    /* With p.ahead > 0, prefetches go out in program order, ahead of the PDL wait (loads would be
     * scheduled after it: ptxas issues griddepcontrol.wait first, as nothing it needs is
     * pending), so the first chunks stream into L2 while the previous kernel finishes. */
    for (int q = 0; q < p.ahead; q++) prefetch(s + q * ks);
    cu_pdl_wait(); /* x is the previous kernel's output */
    cu_pdl_trigger();

    float sum[4] = {0.f, 0.f, 0.f, 0.f}; /* c0..c3 of the tile over this warp's chunks */
    for (int c = s; c < nch; c += ks) {
        if (p.ahead > 0) prefetch(c + p.ahead * ks);
        /* w[j][0], w[j][1]: this lane's 16 bytes of k-block j, rows g and g + 8 (zero past the
         * rows or the columns) */
        uint4 w[J][2];
#pragma unroll
        for (int j = 0; j < J; j++) {
            const int64_t k = ((int64_t)c * J + j) * 32; /* the k-block's first element */
            const bool in = k + 8 * t < p.cols;
            w[j][0] = in && ok0 ? gemv_tc_ldw(w0 + 2 * k) : make_uint4(0u, 0u, 0u, 0u);
            w[j][1] = in && ok1 ? gemv_tc_ldw(w1 + 2 * k) : make_uint4(0u, 0u, 0u, 0u);
        }
        float ah[4] = {0.f, 0.f, 0.f, 0.f}, am[4] = {0.f, 0.f, 0.f, 0.f}, al[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < J; j++) {
            const int64_t k = ((int64_t)c * J + j) * 32;
            const bool in = okx && k + 8 * t < p.cols;
#pragma unroll
            for (int q = 0; q < 2; q++) { /* k-step q: elements 4q .. 4q + 3 */
                const float4 xv = in ? __ldg((const float4 *)(xg + k + 4 * q)) : make_float4(0.f, 0.f, 0.f, 0.f);
                uint32_t h0, m0, l0, h1, m1, l1;
                gemv_tc_split(xv.x, xv.y, h0, m0, l0);
                gemv_tc_split(xv.z, xv.w, h1, m1, l1);
                const uint32_t a[4] = {q ? w[j][0].z : w[j][0].x, q ? w[j][1].z : w[j][1].x,
                                       q ? w[j][0].w : w[j][0].y, q ? w[j][1].w : w[j][1].y};
                cu_mma_bf16(al, a, l0, l1);
                cu_mma_bf16(am, a, m0, m1);
                cu_mma_bf16(ah, a, h0, h1);
            }
        }
#pragma unroll
        for (int r = 0; r < 4; r++) sum[r] += ah[r] + (am[r] + al[r]);
    }

    if (ks > 1) { /* uniform over the block */
        __shared__ float red[GEMV_WARPS][4][32];
#pragma unroll
        for (int r = 0; r < 4; r++) red[warp][r][lane] = sum[r];
        __syncthreads();
        if (s != 0) return;
        for (int q = 1; q < ks; q++)
#pragma unroll
            for (int r = 0; r < 4; r++) sum[r] += red[warp + q][r][lane];
    }
    const int i0 = 2 * t; /* c0, c2: input i0; c1, c3: input i0 + 1 */
    float *y0 = p.y + (int64_t)i0 * p.rows + row0 + g;
    if (ok0 && i0 < p.n) y0[0] = sum[0];
    if (ok0 && i0 + 1 < p.n) y0[p.rows] = sum[1];
    if (ok1 && i0 < p.n) y0[8] = sum[2];
    if (ok1 && i0 + 1 < p.n) y0[p.rows + 8] = sum[3];
}

/* Whether the tensor-core GEMV takes this call (see the measurements above): bf16 weights of at
 * least GEMV_TC_MIN_ROWS rows at n >= GEMV_TC_MIN_N. Fewer rows stay on the fp32 kernel (a 16-row
 * tile per block gives them fewer blocks than multiprocessors), as do n = 1, 2 (the fp32 kernel
 * streams faster there). */
static bool gemv_tc_ok(const gemv_params *p, mt_dtype dt) {
    return dt == MT_BF16 && p->n <= GEMV_MAX_N && p->cols % 8 == 0 && cu_aligned16(p->w) && cu_aligned16(p->x) &&
           p->rows >= GEMV_TC_MIN_ROWS && p->n >= GEMV_TC_MIN_N;
}

/* Warps per tile: 8 (fine-grained blocks, 16 rows each, so the last wave is short and a block's
 * loads cover 2 KB of each row at a time), halved while a warp would get fewer than 2 chunks. */
static int gemv_tc_ksplit(int cols) {
    const int nch = (cols + 32 * GEMV_TC_J - 1) / (32 * GEMV_TC_J);
    int ks = GEMV_WARPS;
    while (ks > 1 && nch < 2 * ks) ks /= 2;
    return ks;
}

static mt_status gemv_tc_launch(gemv_params *p, cudaStream_t s) {
    p->ksplit = gemv_tc_ksplit(p->cols);
    p->persist = 0;
    p->ahead = GEMV_TC_AHEAD;
    const int64_t tiles = (p->rows + GEMV_TC_TILE - 1) / GEMV_TC_TILE, per_block = GEMV_WARPS / p->ksplit;
    const dim3 grid((unsigned)((tiles + per_block - 1) / per_block));
    MT_CUDA_CHECK(cu_launch_pdl((const void *)gemv_tc_kernel, grid, dim3(GEMV_THREADS), 0, s, p));
    return MT_OK;
}

/* ---- narrow GEMM: at most 32 outputs per row, many rows (the mHC mix: 24 x 16384) ---- */

/* The tiled GEMM below spends a 128-wide column tile on such a weight (a fifth of it used for 24
 * rows) and has only n/64 blocks. Here a warp owns R input rows and every output of them; the
 * block stages NARROW_KC columns of the whole (<= NW-row) weight in shared memory as fp32, and
 * lane l takes columns 4l + 128j of each stage, so the x loads are 16-byte and coalesced. Each
 * output is a per-lane running sum over its columns in order, then a fixed butterfly over the
 * lanes (lane 0's result is stored): deterministic for a given shape. H200: 24 x 16384 at 512
 * rows 187 us (tiled 1414), at 4096 rows 306 us (tiled 1420); the two-part tensor-core path, which
 * bf16 weights take, 55 / 216 us at ~3e-6 instead of ~1e-7 relative error. */
enum { NARROW_THREADS = 128, NARROW_WARPS = NARROW_THREADS / 32, NARROW_KC = 256, NARROW_MAX_ROWS = 32 };

template <mt_dtype DT, int NW, int R>
static __global__ void __launch_bounds__(NARROW_THREADS) narrow_kernel(const gemv_params p) {
    constexpr int V = cu_wvec<DT>::n; /* weight elements per 16-byte load */
    constexpr int J = NARROW_KC / 128; /* 4-column groups per lane per stage */
    __shared__ __align__(16) float Ws[NW][NARROW_KC];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int K = p.cols, N = p.rows;
    const int64_t row0 = ((int64_t)blockIdx.x * NARROW_WARPS + warp) * R;
    const bool xvec = (K & 3) == 0 && cu_aligned16(p.x);
    const bool wvec = K % V == 0 && cu_aligned16(p.w);
    const float *xr[R];
    bool ok[R];
#pragma unroll
    for (int i = 0; i < R; i++) {
        ok[i] = row0 + i < p.n;
        xr[i] = p.x + (ok[i] ? row0 + i : 0) * (int64_t)K;
    }
    float acc[R][NW];
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int r = 0; r < NW; r++) acc[i][r] = 0.f;

    for (int k0 = 0; k0 < K; k0 += NARROW_KC) {
        __syncthreads(); /* the previous stage is consumed */
        for (int t = threadIdx.x; t < NW * (NARROW_KC / V); t += NARROW_THREADS) {
            const int r = t / (NARROW_KC / V), c = (t % (NARROW_KC / V)) * V, k = k0 + c;
            float v[V];
            if (r < N && wvec && k + V <= K) {
                cu_wload<DT, V>(p.w, (int64_t)r * K + k, v);
            } else {
#pragma unroll
                for (int q = 0; q < V; q++)
                    v[q] = r < N && k + q < K ? cu_wget<DT>(p.w, (int64_t)r * K + k + q) : 0.f;
            }
#pragma unroll
            for (int q = 0; q < V; q += 4)
                *(float4 *)&Ws[r][c + q] = make_float4(v[q], v[q + 1], v[q + 2], v[q + 3]);
        }
        __syncthreads();
        float xv[J][R][4];
#pragma unroll
        for (int j = 0; j < J; j++) {
            const int k = k0 + j * 128 + lane * 4;
#pragma unroll
            for (int i = 0; i < R; i++) {
                if (ok[i] && xvec && k + 4 <= K) {
                    const float4 a = *(const float4 *)(xr[i] + k);
                    xv[j][i][0] = a.x; xv[j][i][1] = a.y; xv[j][i][2] = a.z; xv[j][i][3] = a.w;
                } else {
#pragma unroll
                    for (int q = 0; q < 4; q++) xv[j][i][q] = ok[i] && k + q < K ? xr[i][k + q] : 0.f;
                }
            }
        }
#pragma unroll
        for (int j = 0; j < J; j++) {
            const int c = j * 128 + lane * 4;
#pragma unroll
            for (int r = 0; r < NW; r++) {
                const float4 w = *(const float4 *)&Ws[r][c];
#pragma unroll
                for (int i = 0; i < R; i++) {
                    acc[i][r] = fmaf(xv[j][i][0], w.x, acc[i][r]);
                    acc[i][r] = fmaf(xv[j][i][1], w.y, acc[i][r]);
                    acc[i][r] = fmaf(xv[j][i][2], w.z, acc[i][r]);
                    acc[i][r] = fmaf(xv[j][i][3], w.w, acc[i][r]);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int r = 0; r < NW; r++) {
            const float s = cu_warp_sum(acc[i][r]);
            if (lane == 0 && ok[i] && r < N) p.y[(row0 + i) * N + r] = s;
        }
}

template <mt_dtype DT, int NW> static void narrow_launch_nw(const gemv_params *p, cudaStream_t s) {
    if (p->n >= 2048) {
        const int64_t rows_per = 4 * NARROW_WARPS;
        narrow_kernel<DT, NW, 4><<<(unsigned)((p->n + rows_per - 1) / rows_per), NARROW_THREADS, 0, s>>>(*p);
    } else {
        const int64_t rows_per = 2 * NARROW_WARPS;
        narrow_kernel<DT, NW, 2><<<(unsigned)((p->n + rows_per - 1) / rows_per), NARROW_THREADS, 0, s>>>(*p);
    }
}

template <mt_dtype DT> static void narrow_launch_dt(const gemv_params *p, cudaStream_t s) {
    if (p->rows <= 8) narrow_launch_nw<DT, 8>(p, s);
    else if (p->rows <= 16) narrow_launch_nw<DT, 16>(p, s);
    else if (p->rows <= 24) narrow_launch_nw<DT, 24>(p, s);
    else narrow_launch_nw<DT, 32>(p, s);
}

static mt_status narrow_launch(const gemv_params *p, mt_dtype dt, cudaStream_t s) {
    MT_ASSERT(p->rows >= 1 && p->rows <= NARROW_MAX_ROWS);
    switch (dt) {
    case MT_F32: narrow_launch_dt<MT_F32>(p, s); break;
    case MT_F16: narrow_launch_dt<MT_F16>(p, s); break;
    default: narrow_launch_dt<MT_BF16>(p, s); break;
    }
    MT_CUDA_CHECK_LAUNCH();
    return MT_OK;
}

/* ---- tiled GEMM ---- */

enum { TM = CU_GEMM_TM, TN = 128, TK = 16, GEMM_THREADS = 256 };

/* Block: output rows [m0, m1) (<= 64) x columns [128*blockIdx.x, +128), k in steps of 16 with
 * the next step's tile prefetched into registers. Thread (ty, tx) = (tid / 16, tid % 16) owns rows
 * m0 + 4ty + [0, 4) and columns 4tx + [0, 4), 64 + 4tx + [0, 4); each output is one running sum
 * over k in order. */
template <mt_dtype DT>
static __global__ void __launch_bounds__(GEMM_THREADS) gemm_kernel(const cu_gemm_params p) {
    __shared__ __align__(16) float As[TK][TM + 4];  /* x tile, k-major */
    __shared__ __align__(16) float Bs[TK][TN + 4];  /* weight tile, k-major */
    const int z = blockIdx.z; /* ternaries below: a run-time index would copy p to local memory */
    int64_t m0, m1;
    const void *w;
    if (p.tiles) {
        const cu_gemm_tile t = p.tiles[blockIdx.y];
        const mt_expert *e = &p.experts[t.expert];
        m0 = t.m0;
        m1 = t.m1;
        const int mat = z == 0 ? p.mat[0] : p.mat[1];
        w = mat == 0 ? e->gate.data : mat == 1 ? e->up.data : e->down.data;
    } else {
        m0 = (int64_t)blockIdx.y * TM;
        m1 = m0 + TM < p.M ? m0 + TM : p.M;
        w = p.w;
    }
    float *y = z == 0 ? p.y[0] : p.y[1];
    const int K = p.K, N = p.N;
    const int n0 = blockIdx.x * TN;
    const int tid = threadIdx.x;

    /* Loads: x row ar at k ak..ak+3; weight row br at k bk..bk+7. */
    const int ar = tid >> 2, ak = (tid & 3) * 4;
    const int br = tid >> 1, bk = (tid & 1) * 8;
    const bool a_ok = m0 + ar < m1, b_ok = n0 + br < N;
    const float *arow = NULL;
    if (a_ok) arow = p.x + (int64_t)(p.gather ? p.gather[m0 + ar] : m0 + ar) * K;
    const int64_t brow = (int64_t)(n0 + br) * K;
    const bool xvec = (K & 3) == 0 && cu_aligned16(p.x);
    const bool wvec = (K % cu_wvec<DT>::n) == 0 && cu_aligned16(w);
    float ra[4], rb[8];

    auto load = [&](int k0) {
        const int ka = k0 + ak, kb = k0 + bk;
        if (a_ok && xvec && ka + 4 <= K) {
            cu_xload<4>(arow + ka, ra);
        } else {
#pragma unroll
            for (int q = 0; q < 4; q++) ra[q] = a_ok && ka + q < K ? arow[ka + q] : 0.f;
        }
        if (b_ok && wvec && kb + 8 <= K) {
            if constexpr (DT == MT_F32) {
                float h0[4], h1[4];
                cu_wload<DT, 4>(w, brow + kb, h0);
                cu_wload<DT, 4>(w, brow + kb + 4, h1);
#pragma unroll
                for (int q = 0; q < 4; q++) { rb[q] = h0[q]; rb[4 + q] = h1[q]; }
            } else {
                cu_wload<DT, 8>(w, brow + kb, rb);
            }
        } else {
#pragma unroll
            for (int q = 0; q < 8; q++) rb[q] = b_ok && kb + q < K ? cu_wget<DT>(w, brow + kb + q) : 0.f;
        }
    };
    auto store = [&]() {
#pragma unroll
        for (int q = 0; q < 4; q++) As[ak + q][ar] = ra[q];
#pragma unroll
        for (int q = 0; q < 8; q++) Bs[bk + q][br] = rb[q];
    };

    const int tx = tid & 15, ty = tid >> 4;
    float acc[4][8];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[i][j] = 0.f;

    load(0);
    store();
    __syncthreads();
    for (int k0 = 0; k0 < K; k0 += TK) {
        const bool more = k0 + TK < K;
        if (more) load(k0 + TK);
#pragma unroll
        for (int kk = 0; kk < TK; kk++) {
            const float4 a = *(const float4 *)&As[kk][ty * 4];
            const float4 b0 = *(const float4 *)&Bs[kk][tx * 4];
            const float4 b1 = *(const float4 *)&Bs[kk][64 + tx * 4];
            const float av[4] = {a.x, a.y, a.z, a.w};
            const float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 8; j++) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
        __syncthreads();
        if (more) {
            store();
            __syncthreads();
        }
    }

#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int64_t m = m0 + ty * 4 + i;
        if (m >= m1) continue;
        float *yr = y + m * N;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int n = n0 + (j < 4 ? tx * 4 + j : 64 + tx * 4 + j - 4);
            if (n < N) yr[n] = acc[i][j];
        }
    }
}

extern "C" mt_status cu_gemm(const cu_gemm_params *p, cudaStream_t s) {
    MT_ASSERT(p->nmat >= 1 && p->nmat <= 2 && (p->tiles || p->nmat == 1));
    dim3 grid((unsigned)((p->N + TN - 1) / TN), 1, (unsigned)p->nmat);
    if (p->tiles) {
        if (p->ntiles == 0) return MT_OK;
        grid.y = (unsigned)p->ntiles;
    } else {
        if (p->M == 0) return MT_OK;
        grid.y = (unsigned)((p->M + TM - 1) / TM);
    }
    MT_ASSERT(grid.y <= 65535);
    switch (p->dtype) {
    case MT_F32: gemm_kernel<MT_F32><<<grid, GEMM_THREADS, 0, s>>>(*p); break;
    case MT_F16: gemm_kernel<MT_F16><<<grid, GEMM_THREADS, 0, s>>>(*p); break;
    default: gemm_kernel<MT_BF16><<<grid, GEMM_THREADS, 0, s>>>(*p); break;
    }
    MT_CUDA_CHECK_LAUNCH();
    return MT_OK;
}

/* ---- tensor-core GEMM (cuBLAS) ---- */

enum { SPLIT_THREADS = 256, SPLIT_MAX_BLOCKS = 1 << 16 };

typedef struct split_params {
    void *out;              /* [*, K] bf16 or fp16: hi of row m at row m*rstride, lo at +lo_off */
    const float *x;         /* [*, K] fp32 rows */
    const int32_t *gather;  /* [M] x row of output row m; NULL: row m */
    int64_t M;
    int K;
    int64_t rstride, lo_off;
} split_params;

/* Grid-stride over groups of V elements (V == 4: float4 loads, 8-byte stores; K % 4 == 0 and
 * aligned bases). hi = round(x); lo = round(x - hi) (x - hi is exact in fp32). */
template <mt_dtype DT, int V, int T> static __global__ void __launch_bounds__(SPLIT_THREADS)
split_kernel(const split_params p) {
    const int per_row = p.K / V;
    const int64_t total = p.M * per_row, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += stride) {
        const int64_t m = t / per_row;
        const int k = (int)(t - m * per_row) * V;
        const float *xr = p.x + (p.gather ? (int64_t)p.gather[m] : m) * p.K + k;
        unsigned short *hi = (unsigned short *)p.out + m * p.rstride * p.K + k;
        unsigned short *lo = hi + p.lo_off * p.K;
        float v[V];
        cu_xload<V>(xr, v);
        uint32_t h[V], l[V];
#pragma unroll
        for (int j = 0; j < V; j++) {
            h[j] = cu_bits16<DT>(v[j]);
            if constexpr (T == 2) l[j] = cu_bits16<DT>(v[j] - cu_round16<DT>(v[j]));
        }
        if constexpr (V == 4) {
            *(uint2 *)hi = make_uint2(h[0] | h[1] << 16, h[2] | h[3] << 16);
            if constexpr (T == 2) *(uint2 *)lo = make_uint2(l[0] | l[1] << 16, l[2] | l[3] << 16);
        } else {
            hi[0] = (unsigned short)h[0];
            if constexpr (T == 2) lo[0] = (unsigned short)l[0];
        }
    }
}

template <mt_dtype DT, int T> static void split_launch_t(const split_params *p, bool vec, unsigned blocks,
                                                         cudaStream_t s) {
    if (vec) split_kernel<DT, 4, T><<<blocks, SPLIT_THREADS, 0, s>>>(*p);
    else split_kernel<DT, 1, T><<<blocks, SPLIT_THREADS, 0, s>>>(*p);
}

extern "C" mt_status cu_split16(void *out, const float *x, const int32_t *gather, int64_t M, int K,
                                mt_dtype dt, int terms, bool interleave, cudaStream_t s) {
    MT_ASSERT(dt == MT_BF16 || dt == MT_F16);
    MT_ASSERT(M >= 0 && K > 0 && (terms == 1 || terms == 2));
    if (M == 0) return MT_OK;
    split_params p = {out, x, gather, M, K, 1, 0};
    if (terms == 2) {
        p.rstride = interleave ? 2 : 1;
        p.lo_off = interleave ? 1 : M;
    }
    const bool vec = K % 4 == 0 && cu_aligned16(x) && ((uintptr_t)out & 7u) == 0;
    const int64_t groups = M * (vec ? K / 4 : K);
    const int64_t want = (groups + SPLIT_THREADS - 1) / SPLIT_THREADS;
    const unsigned blocks = (unsigned)(want < SPLIT_MAX_BLOCKS ? want : SPLIT_MAX_BLOCKS);
    if (dt == MT_BF16) {
        if (terms == 2) split_launch_t<MT_BF16, 2>(&p, vec, blocks, s);
        else split_launch_t<MT_BF16, 1>(&p, vec, blocks, s);
    } else {
        if (terms == 2) split_launch_t<MT_F16, 2>(&p, vec, blocks, s);
        else split_launch_t<MT_F16, 1>(&p, vec, blocks, s);
    }
    MT_CUDA_CHECK_LAUNCH();
    return MT_OK;
}

/* Every matmul of more than GEMV_MAX_N rows on a 16-bit weight, narrow outputs too (router, mHC mix,
 * per-head gates): the two-part split keeps ~3e-6 relative error, and the fp32 narrow/tiled
 * kernels took 40% of a batch-64 decode step (batch_bench: 66% of the floor with tensor cores,
 * 40% without). */
static bool matmul_use_tc(const cu_backend *cb, const mt_weight *w, int n) {
    return cb->tc_terms > 0 && n > GEMV_MAX_N && (w->dtype == MT_BF16 || w->dtype == MT_F16) && w->rows > 0 &&
           w->cols > 0;
}

/* w2[r, :] = (w[r, :], w[r, :]) for a [N, K] 16-bit weight: one thread a 16-bit element. */
static __global__ void dup_k_kernel(uint16_t *w2, const uint16_t *w, int64_t N, int K) {
    const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= N * K) return;
    const int64_t r = e / K;
    const int k = (int)(e - r * K);
    const uint16_t v = w[e];
    w2[r * 2 * K + k] = v;
    w2[r * 2 * K + K + k] = v;
}

/* A low-K weight (K <= MATMUL_LOWK, at least K rows of x) in one GEMM over K' = 2K: x split
 * interleaved into rows (hi | lo), the weight duplicated along K into the same scratch, so y is
 * written once instead of written, read and written again by the lo part (at K = 128 the two-part
 * form is bound by that output traffic: the KDA gates' second projections, [4096, 8192] fp32; on
 * the H200 the prefill's tensor-core matmuls took 0.5-0.85 ms less at 4096 tokens). The duplicate is made per call (a few MB): no cache to go stale. */
enum { MATMUL_LOWK = 512 };
static mt_status matmul_tc_lowk(cu_backend *cb, float *y, const float *x, const mt_weight *w, int n) {
    const int N = (int)w->rows, K = (int)w->cols;
    const size_t bx = sizeof(uint16_t) * (size_t)n * 2 * K, bw = sizeof(uint16_t) * (size_t)N * 2 * K;
    const size_t wo = (bx + 255) & ~(size_t)255; /* the weight's offset, 256-byte aligned */
    char *buf = (char *)cu_scratch(&cb->base, CU_SCRATCH_GEMM, wo + bw);
    if (!buf) return MT_ERR_NOMEM; /* logged */
    uint16_t *x16 = (uint16_t *)buf, *w2 = (uint16_t *)(buf + wo);
    mt_status st = cu_split16(x16, x, NULL, n, K, w->dtype, 2, true, cb->stream);
    if (st != MT_OK) return st;
    const int64_t count = (int64_t)N * K;
    dup_k_kernel<<<(unsigned)((count + 255) / 256), 256, 0, cb->stream>>>(w2, (const uint16_t *)w->data, N, K);
    MT_CUDA_CHECK_LAUNCH();
    return cu_gemm_tc(cb, y, x16, w2, w->dtype, n, N, 2 * K, 0.f);
}

extern "C" int cu_tc_terms(const cu_backend *cb, const mt_weight *w) {
    return cb->tc_terms == 1 && (cb->params.exact_classes >> w->cls & 1u) ? 2 : cb->tc_terms;
}

/* y[j] = x . w[j]^T for count weights of x's columns and one dtype, with x split once into the
 * most 16-bit parts any of them takes, [hi; lo] (CU_SCRATCH_GEMM): y[j] = w[j].hi, then, for a
 * weight of two parts (cu_tc_terms), y[j] += w[j].lo. hi is x rounded once, so a weight of one
 * part gets the same product as with a one-part split. */
static mt_status matmul_tc(cu_backend *cb, float *const *y, const float *x, const mt_weight *const *w, int count,
                           int n) {
    const int K = (int)w[0]->cols;
    int T = 0;
    for (int j = 0; j < count; j++) {
        const int tj = cu_tc_terms(cb, w[j]);
        T = tj > T ? tj : T;
    }
    if (count == 1 && T == 2 && K <= MATMUL_LOWK && n >= K && (int64_t)w[0]->rows * K <= INT_MAX)
        return matmul_tc_lowk(cb, y[0], x, w[0], n);
    const size_t part = sizeof(uint16_t) * (size_t)n * (size_t)K;
    char *x16 = (char *)cu_scratch(&cb->base, CU_SCRATCH_GEMM, part * (size_t)T);
    if (!x16) return MT_ERR_NOMEM; /* logged */
    mt_status st = cu_split16(x16, x, NULL, n, K, w[0]->dtype, T, false, cb->stream);
    for (int j = 0; j < count; j++)
        for (int t = 0, tj = cu_tc_terms(cb, w[j]); t < tj && st == MT_OK; t++)
            st = cu_gemm_tc(cb, y[j], x16 + part * (size_t)t, w[j]->data, w[j]->dtype, n, (int)w[j]->rows, K,
                            t ? 1.f : 0.f);
    return st;
}

/* Packed groups (weights_pack): weights whose rows lie one after another in memory, in the call's
 * order, run as one product of their summed rows. At a decode batch's rows a projection of a few
 * hundred rows reads its weight far below the copy rate (cuBLAS has too few tiles to fill the
 * device), while the group's sum reads like one large weight. */
enum { PACKED_MAX_N = 512 };
static_assert((int)CU_PACK_MAX <= (int)GEMV_MAX_W, "a packed group's outputs must fit packed_split_params");

typedef struct packed_split_params {
    const float *hi;          /* [n, total]: every weight's product with x's first part */
    const float *lo;          /* [n, total - c0]: the two-part tail's product with x's second part; NULL: none */
    int64_t n;
    int total, c0;
    unsigned sig;             /* bit j: sigmoid on y[j] */
    float *ys[GEMV_MAX_W];
    int c[GEMV_MAX_W + 1];    /* y[j] holds columns [c[j], c[j+1]) */
} packed_split_params;

static __global__ void packed_split_kernel(const packed_split_params p) {
    const int64_t all = p.n * p.total, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < all; e += stride) {
        const int64_t m = e / p.total;
        const int col = (int)(e - m * p.total);
        float v = p.hi[e];
        if (p.lo && col >= p.c0) v += p.lo[m * (p.total - p.c0) + col - p.c0];
        int j = 0;
        while (col >= p.c[j + 1]) j++;
        const int w = p.c[j + 1] - p.c[j];
        p.ys[j][m * w + col - p.c[j]] = p.sig >> j & 1u ? cu_sigmoidf(v) : v;
    }
}

/* The weights packed by weights_pack (w[0] owns the allocation, the others own nothing: weights
 * merely adjacent in memory do not count), in call order, with the two-part weights (cu_tc_terms)
 * after every one-part one: *c0 is the first two-part weight's first column (total: none). */
static bool packed_run(const cu_backend *cb, const mt_weight *const *w, int count, int *total, int *c0) {
    if (count < 2 || count > CU_PACK_MAX || !w[0]->owned) return false;
    int64_t t = 0, first2 = -1;
    for (int j = 0; j < count; j++) {
        const int tj = cu_tc_terms(cb, w[j]);
        if (j > 0 && (w[j]->owned || w[j]->host)) return false;
        if (j > 0 && (const char *)w[j]->data !=
                         (const char *)w[j - 1]->data + w[j - 1]->rows * w[j - 1]->cols * (int64_t)mt_dtype_size(w[j]->dtype))
            return false;
        if (tj == 2 && first2 < 0) first2 = t;
        if (tj != 2 && first2 >= 0) return false;
        t += w[j]->rows;
    }
    if (t > INT_MAX) return false;
    *total = (int)t;
    *c0 = first2 < 0 ? (int)t : (int)first2;
    return true;
}

/* y[j] = x . w[j]^T for a packed run: x split once ([hi; lo] when the tail takes two parts), hi
 * times the whole run into [n, total], lo times the tail into [n, total - c0] (both in
 * CU_SCRATCH_GEMM after x's parts; a run of two-part weights only adds lo's product into hi's in
 * the GEMM, as the unpacked path does), then one pass writes each output, the tail's two sums
 * added as the unpacked path's second product adds them, the sigmoid applied where the mask says. */
static mt_status matmul_packed(cu_backend *cb, float *const *y, const float *x, const mt_weight *const *w,
                               int count, int n, int total, int c0, unsigned sigmoid_mask) {
    const int K = (int)w[0]->cols, T = c0 < total ? 2 : 1;
    const size_t part = sizeof(uint16_t) * (size_t)n * (size_t)K, xb = (part * (size_t)T + 255) & ~(size_t)255;
    const size_t hb = (sizeof(float) * (size_t)n * (size_t)total + 255) & ~(size_t)255;
    const size_t lb = T == 2 && c0 > 0 ? sizeof(float) * (size_t)n * (size_t)(total - c0) : 0;
    char *buf = (char *)cu_scratch(&cb->base, CU_SCRATCH_GEMM, xb + hb + lb);
    if (!buf) return MT_ERR_NOMEM; /* logged */
    float *hi = (float *)(buf + xb), *lo = lb ? (float *)(buf + xb + hb) : NULL;
    mt_status st = cu_split16(buf, x, NULL, n, K, w[0]->dtype, T, false, cb->stream);
    if (st == MT_OK) st = cu_gemm_tc(cb, hi, buf, w[0]->data, w[0]->dtype, n, total, K, 0.f);
    if (st == MT_OK && T == 2 && c0 == 0) { /* every weight two-part: lo adds into hi, as the unpacked path */
        st = cu_gemm_tc(cb, hi, buf + part, w[0]->data, w[0]->dtype, n, total, K, 1.f);
        lo = NULL;
    } else if (st == MT_OK && T == 2) {
        const char *tail = (const char *)w[0]->data + (size_t)c0 * (size_t)K * mt_dtype_size(w[0]->dtype);
        st = cu_gemm_tc(cb, lo, buf + part, tail, w[0]->dtype, n, total - c0, K, 0.f);
    }
    if (st != MT_OK) return st;
    packed_split_params p = {hi, lo, n, total, c0, sigmoid_mask, {}, {}};
    for (int j = 0; j < count; j++) {
        p.ys[j] = y[j];
        p.c[j + 1] = p.c[j] + (int)w[j]->rows;
    }
    const int64_t want = ((int64_t)n * total + 255) / 256;
    const unsigned blocks = (unsigned)(want < 8 * (int64_t)cb->n_sm ? want : 8 * (int64_t)cb->n_sm);
    packed_split_kernel<<<blocks, 256, 0, cb->stream>>>(p);
    MT_CUDA_CHECK_LAUNCH();
    return MT_OK;
}

static_assert((int)CU_FP8_GEMV_MAX_N <= (int)GEMV_MAX_N, "cu_fp8_gemv's runs must fit the GEMV's rows");
extern "C" mt_status cu_gemv_f8(cu_backend *cb, float *y, const float *x, const mt_weight *w, int n) {
    MT_ASSERT(w->dtype == MT_F8E4M3 && w->scale && n >= 0 && n <= GEMV_MAX_N);
    MT_ASSERT(w->rows <= INT_MAX && cu_fp8_kpad(w->cols) <= INT_MAX);
    if (n == 0 || w->rows == 0) return MT_OK;
    gemv_params p = {y, x, w->data, n, (int)w->rows, (int)w->cols, 1, (int)cu_fp8_kpad(w->cols), w->scale};
    return gemv_launch(&p, MT_F8E4M3, cb->n_sm, cb->stream);
}

/* The op profile's name of a tensor-core matmul of n rows: decode-sized (a batch's rows, read
 * bound) apart from prompt-sized (compute bound), so a mixed step's two kinds of work show apart;
 * a packed group's (at most PACKED_MAX_N rows) apart from the rest. */
static const char *matmul_tc_name(int n, bool packed) {
    if (packed) return n <= 64 ? "matmul (tensor cores, packed, <= 64 rows)" : "matmul (tensor cores, packed, 65-512 rows)";
    return n <= 64 ? "matmul (tensor cores, <= 64 rows)" : n <= 512 ? "matmul (tensor cores, 65-512 rows)"
                                                         : "matmul (tensor cores, > 512 rows)";
}

static void cu_matmul(mt_backend *be, float *y, const float *x, const mt_weight *w, int n) {
    MT_ASSERT(w->dtype == MT_F32 || w->dtype == MT_F16 || w->dtype == MT_BF16 || w->dtype == MT_F8E4M3);
    MT_ASSERT(w->rows <= INT_MAX && w->cols <= INT_MAX && n >= 0);
    if (n == 0 || w->rows == 0) return;
    if (w->dtype == MT_F8E4M3) { /* block-scaled FP8 (cuda_fp8.cu) */
        cu_fp8_matmul(be, y, x, w, n);
        return;
    }
    cu_backend *cb = (cu_backend *)be;
    mt_status st;
    if (n <= GEMV_MAX_N) {
        gemv_params p = {y, x, w->data, n, (int)w->rows, (int)w->cols, 1, 0};
        if (gemv_tc_ok(&p, w->dtype)) {
            st = gemv_tc_launch(&p, cu_stream(be));
            cu_prof_mark(be, "matmul (GEMV, tensor cores)");
        } else if (gemv_shortk_ok(&p, w->dtype)) {
            st = gemv_shortk_launch(&p, w->dtype, cu_stream(be));
            cu_prof_mark(be, "matmul (GEMV, short rows)");
        } else {
            st = gemv_launch(&p, w->dtype, cb->n_sm, cu_stream(be));
            cu_prof_mark(be, "matmul (GEMV, fp32)");
        }
    } else if (matmul_use_tc(cb, w, n)) {
        st = matmul_tc(cb, &y, x, &w, 1, n);
        cu_prof_mark(be, matmul_tc_name(n, false));
    } else if (cb->params.narrow && w->rows <= NARROW_MAX_ROWS && w->cols > 0) {
        gemv_params p = {y, x, w->data, n, (int)w->rows, (int)w->cols, 1, 0};
        st = narrow_launch(&p, w->dtype, cu_stream(be));
        cu_prof_mark(be, "matmul (narrow fp32)");
    } else {
        cu_gemm_params p = {};
        p.y[0] = y;
        p.x = x;
        p.w = w->data;
        p.nmat = 1;
        p.M = n;
        p.N = (int)w->rows;
        p.K = (int)w->cols;
        p.dtype = w->dtype;
        st = cu_gemm(&p, cu_stream(be));
        cu_prof_mark(be, "matmul (tiled fp32)");
    }
    cu_op_status(be, "matmul", st);
}

/* y[j] = x . w[j]^T for count weights of the same columns and dtype: for the rows the fp32 GEMV
 * takes (n <= 2 at the default knobs), one gemv_kernel launch over all of them (decode's q/k/v
 * projections of a KDA layer: 3 launches of ~21 us at ~3.25 TB/s, each with its own ramp and
 * tail, become one); for many rows with every weight on the tensor cores, one split of x for all
 * of them (matmul_tc); otherwise one cu_matmul each. */
static void cu_matmul_multi(mt_backend *be, float *const *y, const float *x, const mt_weight *const *w,
                            int count, int n, unsigned sigmoid_mask) {
    MT_ASSERT(count >= 0 && n >= 0);
    bool fuse = count >= 2 && count <= GEMV_MAX_W && n >= 1 && n <= GEMV_MAX_N && cu_aligned16(x);
    int64_t total = 0;
    for (int j = 0; fuse && j < count; j++) {
        const mt_weight *wj = w[j];
        gemv_params one = {y[j], x, wj->data, n, (int)wj->rows, (int)wj->cols, 1, 0};
        fuse = wj->dtype == w[0]->dtype && wj->dtype != MT_F8E4M3 && wj->cols == w[0]->cols && wj->rows > 0 &&
               wj->cols > 0 &&
               cu_aligned16(wj->data) && !gemv_tc_ok(&one, wj->dtype);
        total += wj->rows;
    }
    if (!fuse || total > INT_MAX || w[0]->cols > INT_MAX) {
        /* prefill: every weight on the tensor cores, one dtype: x is split once for all of them
         * (a KDA layer's six projections of the same h split it six times before) */
        cu_backend *cb = (cu_backend *)be;
        bool tc = count >= 2 && n > GEMV_MAX_N && w[0]->cols <= INT_MAX;
        for (int j = 0; tc && j < count; j++)
            tc = matmul_use_tc(cb, w[j], n) && w[j]->dtype == w[0]->dtype && w[j]->cols == w[0]->cols &&
                 w[j]->rows <= INT_MAX;
        int cols_all, c0;
        if (tc && n <= PACKED_MAX_N && packed_run(cb, w, count, &cols_all, &c0)) {
            const mt_status st = matmul_packed(cb, y, x, w, count, n, cols_all, c0, sigmoid_mask);
            cu_prof_mark(be, matmul_tc_name(n, true));
            cu_op_status(be, "matmul_multi", st);
            return;
        }
        if (tc) {
            mt_status st = matmul_tc(cb, y, x, w, count, n);
            cu_prof_mark(be, matmul_tc_name(n, false));
            for (int j = 0; j < count && st == MT_OK; j++)
                if (sigmoid_mask >> j & 1u) be->ops->sigmoid(be, y[j], (int64_t)n * w[j]->rows);
            cu_op_status(be, "matmul_multi", st);
            return;
        }
        for (int j = 0; j < count; j++) {
            cu_matmul(be, y[j], x, w[j], n);
            if (sigmoid_mask >> j & 1u) be->ops->sigmoid(be, y[j], (int64_t)n * w[j]->rows);
        }
        return;
    }
    gemv_params p = {y[0], x, w[0]->data, n, (int)total, (int)w[0]->cols, 1, 0};
    p.nw = count;
    p.sig = sigmoid_mask;
    for (int j = 0; j < count; j++) {
        p.ws[j] = w[j]->data;
        p.ys[j] = y[j];
        p.wrows[j] = (int)w[j]->rows;
    }
    const mt_status st = gemv_launch(&p, w[0]->dtype, ((cu_backend *)be)->n_sm, cu_stream(be));
    cu_prof_mark(be, "matmul_multi (GEMV, fp32)");
    cu_op_status(be, "matmul_multi", st);
}

/* g = kda_gate(f_in . f_b^T), gate = g_in . g_b^T: for the rows the short-row GEMV takes (decode:
 * n <= 2, K = 128), one gemv_shortk_kernel launch whose blocks [0, wt0[1]) are f_b's, with the gate
 * as their epilogue, and the rest g_b's (a KDA layer's three small launches, f_b, kda_gate, g_b, of
 * ~3 us each, become one); otherwise matmul, kda_gate in place, matmul. */
static void cu_kda_gates(mt_backend *be, float *g, float *gate, const float *f_in, const float *g_in,
                         const mt_weight *f_b, const mt_weight *g_b, const float *dt_bias, const float *A_log,
                         const mt_kda_gate_params *gp, int n) {
    MT_ASSERT(n >= 0 && f_b->rows == (int64_t)gp->nh * gp->dk);
    if (n == 0) return;
    gemv_params p = {};
    p.n = n;
    p.cols = (int)f_b->cols;
    p.w = f_b->data;
    p.x = f_in;
    bool fuse = f_b->dtype == g_b->dtype && f_b->cols == g_b->cols && f_b->rows <= INT_MAX && g_b->rows <= INT_MAX &&
                cu_aligned16(g_b->data) && cu_aligned16(g_in) && f_b->dtype != MT_F32 && f_b->dtype != MT_F8E4M3;
    fuse = fuse && gemv_shortk_ok(&p, f_b->dtype);
    if (!fuse) {
        cu_matmul(be, g, f_in, f_b, n);
        be->ops->kda_gate(be, g, g, dt_bias, A_log, gp, n);
        cu_matmul(be, gate, g_in, g_b, n);
        return;
    }
    p.nw = 2;
    const mt_weight *ws[2] = {f_b, g_b};
    float *ys[2] = {g, gate};
    const float *xs[2] = {f_in, g_in};
    for (int j = 0; j < 2; j++) {
        p.ws[j] = ws[j]->data;
        p.ys[j] = ys[j];
        p.xs[j] = xs[j];
        p.wrows[j] = (int)ws[j]->rows;
    }
    p.gate_bias = dt_bias;
    p.gate_alog = A_log;
    p.gate_dk = gp->dk;
    p.gate_lb = gp->has_lower_bound;
    p.gate_lbv = gp->lower_bound;
    p.late_wait = gp->beside_previous;
    cu_op_status(be, "kda_gates", gemv_shortk_launch(&p, f_b->dtype, cu_stream(be)));
}

/* ================================ norms ================================ */

typedef struct norm_params {
    float *out;      /* [n, d] fp32, may alias x */
    const float *x;  /* [n, d] fp32 */
    const float *w;  /* [d] or NULL (rmsnorm) */
    const float *b;  /* [d] (layernorm) */
    int64_t n;
    int d;
    float eps;
    float scale;     /* l2norm */
    int hs;          /* norm_vec_kernel's HEAD form (cu_hc_head_norm): x is [n, hs, d], normalised is
                        the mean of its hs streams */
} norm_params;

enum norm_kind { NORM_RMS, NORM_LAYER, NORM_L2 };

/* ---- rows held in registers: d % 4 == 0, 16-byte aligned vectors, d <= NORM_ROW_MAX ----
 * Decode normalises one row of 4096 (the site norms), 1536 and 512 (DSA), or 64 rows of 128
 * (l2norm of the KDA heads): latency, not bandwidth. Each thread loads its NORM_VPT float4 at
 * once, the sums reduce across the warp or block, and the same registers are scaled and stored:
 * one read and one write of x. Rows of at most NORM_WARP_MAX elements take one warp each (8 rows
 * a block, no barrier); longer rows a block each (32..1024 threads). The formulas and the
 * double sums follow cpu_dense.c as the scalar kernels below do; only the order of the partial
 * sums differs. Launched for PDL (the input is the previous kernel's output). */
enum { NORM_VPT = 4, NORM_WARP_MAX = 32 * 4 * NORM_VPT, NORM_ROW_MAX = 1024 * 4 * NORM_VPT,
       NORM_WARP_ROWS = 8, NORM_HEAD_MAX_S = 4, NORM_HEAD_THREADS = 512 /* hc_head_norm's form */ };

template <typename T, bool BLOCK> static __device__ __forceinline__ T norm_sum(T v, T *red) {
    if constexpr (BLOCK) return cu_block_sum(v, red);
    else return cu_warp_sum(v);
}

/* HEAD: rmsnorm of hc_head(x) (p.hs streams at p.x; cu_hc_head_norm), at most NORM_HEAD_THREADS
 * threads so that the S x NORM_VPT loads fit in registers. */
template <int KIND, bool BLOCK, bool HEAD = false>
static __global__ void __launch_bounds__(HEAD ? NORM_HEAD_THREADS : 1024) norm_vec_kernel(const norm_params p) {
    __shared__ double redd[32];
    __shared__ float redf[32];
    const int64_t row = BLOCK ? (int64_t)blockIdx.x
                              : (int64_t)blockIdx.x * NORM_WARP_ROWS + (threadIdx.x >> 5);
    const int t = BLOCK ? threadIdx.x : (threadIdx.x & 31), nt = BLOCK ? blockDim.x : 32;
    const bool ok = row < p.n;  /* warp form: the last block's spare warps */
    const int d4 = p.d / 4;
    const float *x = (KIND == NORM_L2 ? p.out : p.x) + (ok ? row : 0) * p.d;
    float *o = p.out + (ok ? row : 0) * p.d;
    /* rmsnorm's weights depend on no kernel: loaded before the PDL wait, not after the sums (the
     * layernorm's weight and bias too would spill at 1024 threads) */
    float4 wq[KIND == NORM_RMS ? NORM_VPT : 1];
    if constexpr (KIND == NORM_RMS) {
#pragma unroll
        for (int q = 0; q < NORM_VPT; q++) {
            const int j = t + q * nt;
            wq[q] = ok && j < d4 && p.w ? __ldg((const float4 *)(p.w + 4 * j)) : make_float4(1.f, 1.f, 1.f, 1.f);
        }
    }
    cu_pdl_wait();
    cu_pdl_trigger();
    float4 v[NORM_VPT];
#pragma unroll
    for (int q = 0; q < NORM_VPT; q++) {
        const int j = t + q * nt;
        v[q] = ok && j < d4 && !HEAD ? *(const float4 *)(x + 4 * j) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if constexpr (HEAD) { /* x = hc_head(X): the streams summed in order, / S (cpu_hc.c) */
        const float *X = p.x + (ok ? row : 0) * p.hs * p.d;
        float4 e[NORM_VPT][NORM_HEAD_MAX_S]; /* every load issued before the first sum: one L2 round trip */
#pragma unroll
        for (int q = 0; q < NORM_VPT; q++)
#pragma unroll
            for (int s = 0; s < NORM_HEAD_MAX_S; s++) {
                const int j = t + q * nt;
                e[q][s] = ok && j < d4 && s < p.hs ? *(const float4 *)(X + (int64_t)s * p.d + 4 * j)
                                                   : make_float4(0.f, 0.f, 0.f, 0.f);
            }
        const float S = (float)p.hs;
#pragma unroll
        for (int q = 0; q < NORM_VPT; q++) {
            float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int s = 0; s < NORM_HEAD_MAX_S; s++)
                if (s < p.hs) { a.x += e[q][s].x; a.y += e[q][s].y; a.z += e[q][s].z; a.w += e[q][s].w; }
            v[q] = make_float4(a.x / S, a.y / S, a.z / S, a.w / S);
        }
    }
    float r;
    double mean = 0;
    if constexpr (KIND == NORM_L2) {
        float ss = 0;
#pragma unroll
        for (int q = 0; q < NORM_VPT; q++) {
            ss = fmaf(v[q].x, v[q].x, ss); ss = fmaf(v[q].y, v[q].y, ss);
            ss = fmaf(v[q].z, v[q].z, ss); ss = fmaf(v[q].w, v[q].w, ss);
        }
        ss = norm_sum<float, BLOCK>(ss, redf);
        r = p.scale / sqrtf(ss + p.eps);
    } else if constexpr (KIND == NORM_RMS) {
        double ss = 0;
#pragma unroll
        for (int q = 0; q < NORM_VPT; q++)
            ss += (double)v[q].x * v[q].x + (double)v[q].y * v[q].y + (double)v[q].z * v[q].z +
                  (double)v[q].w * v[q].w;
        ss = norm_sum<double, BLOCK>(ss, redd);
        r = 1.f / sqrtf((float)(ss / p.d) + p.eps);
    } else {
        double sum = 0, var = 0;
#pragma unroll
        for (int q = 0; q < NORM_VPT; q++) sum += (double)v[q].x + v[q].y + (double)v[q].z + v[q].w;
        mean = norm_sum<double, BLOCK>(sum, redd) / p.d;
#pragma unroll
        for (int q = 0; q < NORM_VPT; q++) {
            if (t + q * nt >= d4) continue; /* the zero padding is not (0 - mean)^2 */
            const double a = v[q].x - mean, b = v[q].y - mean, c = v[q].z - mean, e = v[q].w - mean;
            var += a * a + b * b + c * c + e * e;
        }
        var = norm_sum<double, BLOCK>(var, redd) / p.d;
        r = 1.f / sqrtf((float)var + p.eps);
    }
    if (!ok) return;
#pragma unroll
    for (int q = 0; q < NORM_VPT; q++) {
        const int j = t + q * nt;
        if (j >= d4) continue;
        float e[4] = {v[q].x, v[q].y, v[q].z, v[q].w};
        if constexpr (KIND == NORM_L2) {
#pragma unroll
            for (int c = 0; c < 4; c++) e[c] = __fmul_rn(e[c], r);
        } else if constexpr (KIND == NORM_RMS) {
            const float4 a = wq[q];
            const float wv[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int c = 0; c < 4; c++) e[c] = __fmul_rn(__fmul_rn(e[c], r), wv[c]);
        } else {
            const float4 a = __ldg((const float4 *)(p.w + 4 * j)), b = __ldg((const float4 *)(p.b + 4 * j));
            const float wv[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int c = 0; c < 4; c++) e[c] = __fadd_rn(__fmul_rn(__fmul_rn((float)(e[c] - mean), r), wv[c]), bv[c]);
        }
        *(float4 *)(o + 4 * j) = make_float4(e[0], e[1], e[2], e[3]);
    }
}

/* ---- any shape: one block per row, scalar loads ---- */

/* One block per row. Each thread rereads only the elements it summed, so out may alias x. The
 * double sums and the rounding steps follow cpu_dense.c. */
static __global__ void rmsnorm_kernel(const norm_params p) {
    __shared__ double red[32];
    const float *x = p.x + (int64_t)blockIdx.x * p.d;
    float *o = p.out + (int64_t)blockIdx.x * p.d;
    double ss = 0;
#pragma unroll 8
    for (int j = threadIdx.x; j < p.d; j += blockDim.x) ss += (double)x[j] * x[j];
    ss = cu_block_sum(ss, red);
    const float r = 1.f / sqrtf((float)(ss / p.d) + p.eps);
#pragma unroll 8
    for (int j = threadIdx.x; j < p.d; j += blockDim.x)
        o[j] = __fmul_rn(__fmul_rn(x[j], r), p.w ? p.w[j] : 1.f);
}

static __global__ void layernorm_kernel(const norm_params p) {
    __shared__ double red[32];
    const float *x = p.x + (int64_t)blockIdx.x * p.d;
    float *o = p.out + (int64_t)blockIdx.x * p.d;
    double mean = 0, var = 0;
#pragma unroll 8
    for (int j = threadIdx.x; j < p.d; j += blockDim.x) mean += x[j];
    mean = cu_block_sum(mean, red) / p.d;
#pragma unroll 8
    for (int j = threadIdx.x; j < p.d; j += blockDim.x) var += (x[j] - mean) * (x[j] - mean);
    var = cu_block_sum(var, red) / p.d;
    const float r = 1.f / sqrtf((float)var + p.eps);
    for (int j = threadIdx.x; j < p.d; j += blockDim.x)
        o[j] = __fadd_rn(__fmul_rn(__fmul_rn((float)(x[j] - mean), r), p.w[j]), p.b[j]);
}

static __global__ void l2norm_kernel(const norm_params p) {
    __shared__ float red[32];
    float *x = p.out + (int64_t)blockIdx.x * p.d;
    float ss = 0;
#pragma unroll 8
    for (int j = threadIdx.x; j < p.d; j += blockDim.x) ss = fmaf(x[j], x[j], ss);
    ss = cu_block_sum(ss, red);
    const float r = p.scale / sqrtf(ss + p.eps);
    for (int j = threadIdx.x; j < p.d; j += blockDim.x) x[j] = __fmul_rn(x[j], r);
}

enum { NORM_MAX_THREADS = 512 };

/* About 8 elements per thread, 32 to 512 threads. */
static int norm_threads(int d) {
    int t = ((d + 7) / 8 + 31) / 32 * 32;
    return t < 32 ? 32 : t > NORM_MAX_THREADS ? NORM_MAX_THREADS : t;
}

/* Whether the register-resident kernels take the shape: whole float4s, aligned vectors. */
static bool norm_vec_ok(const norm_params *p, norm_kind kind) {
    const bool al = cu_aligned16(p->out) && (kind == NORM_L2 || cu_aligned16(p->x)) &&
                    (!p->w || cu_aligned16(p->w)) && (kind != NORM_LAYER || cu_aligned16(p->b));
    return al && p->d % 4 == 0 && p->d <= NORM_ROW_MAX;
}

template <int KIND> static mt_status norm_vec_launch(norm_params *q, cudaStream_t s) {
    if (q->d <= NORM_WARP_MAX) {
        const unsigned g = (unsigned)((q->n + NORM_WARP_ROWS - 1) / NORM_WARP_ROWS);
        MT_CUDA_CHECK(cu_launch_pdl((const void *)norm_vec_kernel<KIND, false>, dim3(g), dim3(32 * NORM_WARP_ROWS), 0, s, q));
    } else {
        const int per = (q->d / 4 + NORM_VPT - 1) / NORM_VPT; /* threads to hold the row */
        const int t = (per + 31) / 32 * 32;
        MT_CUDA_CHECK(cu_launch_pdl((const void *)norm_vec_kernel<KIND, true>, dim3((unsigned)q->n), dim3(t), 0, s, q));
    }
    return MT_OK;
}

/* z[n, H] = rmsnorm(hc_head(X)) * w: norm_vec_kernel reading the S streams of X instead of a
 * row (one kernel for the head's two; the final norm of a decode step). The shapes the
 * register-resident kernel takes (H % 4 == 0, aligned); else hc_head, then rmsnorm. */
static void cu_hc_head_norm(mt_backend *be, float *z, const float *X, const float *w, int n, int S, int H,
                            float eps) {
    MT_ASSERT(n >= 0 && S >= 1 && H > 0);
    if (n == 0) return;
    norm_params p = {};
    p.out = z;
    p.x = X;
    p.w = w;
    p.n = n;
    p.d = H;
    p.eps = eps;
    p.hs = S;
    const int per = (H / 4 + NORM_VPT - 1) / NORM_VPT, t = (per + 31) / 32 * 32; /* threads to hold a row */
    if (S > NORM_HEAD_MAX_S || H <= NORM_WARP_MAX || t > NORM_HEAD_THREADS || !norm_vec_ok(&p, NORM_RMS)) {
        be->ops->hc_head(be, z, X, n, S, H);
        be->ops->rmsnorm(be, z, z, w, n, H, eps);
        return;
    }
    (void)cu_launch_pdl((const void *)norm_vec_kernel<NORM_RMS, true, true>, dim3((unsigned)n), dim3(t), 0,
                        cu_stream(be), &p);
    cu_check_launch(be, "hc_head_norm");
}

static mt_status norm_launch(const norm_params *p, norm_kind kind, cudaStream_t s) {
    const bool vec = norm_vec_ok(p, kind);
    /* grid.x is at most 2^31 - 1 (the warp form covers 8 rows a block) */
    const int64_t chunk = vec && p->d <= NORM_WARP_MAX ? (int64_t)INT_MAX / NORM_WARP_ROWS * NORM_WARP_ROWS : INT_MAX;
    const int t = norm_threads(p->d);
    for (int64_t r0 = 0; r0 < p->n; r0 += chunk) {
        norm_params q = *p;
        q.n = p->n - r0 < chunk ? p->n - r0 : chunk;
        q.out += r0 * p->d;
        if (q.x) q.x += r0 * p->d;
        if (vec) {
            mt_status st = kind == NORM_RMS     ? norm_vec_launch<NORM_RMS>(&q, s)
                           : kind == NORM_LAYER ? norm_vec_launch<NORM_LAYER>(&q, s)
                                                : norm_vec_launch<NORM_L2>(&q, s);
            if (st != MT_OK) return st;
            continue;
        }
        const unsigned g = (unsigned)q.n;
        switch (kind) {
        case NORM_RMS: rmsnorm_kernel<<<g, t, 0, s>>>(q); break;
        case NORM_LAYER: layernorm_kernel<<<g, t, 0, s>>>(q); break;
        case NORM_L2: l2norm_kernel<<<g, t, 0, s>>>(q); break;
        }
        MT_CUDA_CHECK_LAUNCH();
    }
    return MT_OK;
}

static void cu_rmsnorm(mt_backend *be, float *out, const float *x, const float *w, int n, int d,
                       float eps) {
    MT_ASSERT(n >= 0 && d > 0);
    if (n == 0) return;
    norm_params p = {out, x, w, NULL, n, d, eps, 1.f};
    cu_op_status(be, "rmsnorm", norm_launch(&p, NORM_RMS, cu_stream(be)));
}

static void cu_layernorm(mt_backend *be, float *out, const float *x, const float *w,
                         const float *b, int n, int d, float eps) {
    MT_ASSERT(n >= 0 && d > 0 && w && b);
    if (n == 0) return;
    norm_params p = {out, x, w, b, n, d, eps, 1.f};
    cu_op_status(be, "layernorm", norm_launch(&p, NORM_LAYER, cu_stream(be)));
}

static void cu_l2norm(mt_backend *be, float *x, int64_t n, int d, float eps, float scale) {
    MT_ASSERT(n >= 0 && d > 0);
    if (n == 0) return;
    norm_params p = {x, NULL, NULL, NULL, n, d, eps, scale};
    cu_op_status(be, "l2norm", norm_launch(&p, NORM_L2, cu_stream(be)));
}

/* ============================ elementwise ============================ */

enum { EW_THREADS = 256, EW_MAX_GRID = 65536 };

typedef struct ew_params {
    float *out;         /* [count] fp32; may alias a */
    const float *a;     /* [count] gate (swiglu) or x (sigmoid) */
    const float *b;     /* [count] up (swiglu) */
    int64_t count;
    float L;            /* swiglu limit */
} ew_params;

static __device__ __forceinline__ float siluf_dev(float x) { return x / (1.f + expf(-x)); }

static __device__ __forceinline__ float swiglu_dev(float a, float b, float L) {
    return siluf_dev(fminf(a, L)) * fminf(fmaxf(b, -L), L);
}

/* Both launched for PDL: they wait for the previous kernel before touching memory. V = 4: float4
 * accesses (count % 4 == 0, 16-byte aligned arrays), so a thread has 4x the bytes in flight of the
 * scalar form, which kept a 4096-token prefill's 4 calls at ~60% of the copy rate. */
template <int V> static __global__ void swiglu_kernel(const ew_params p) {
    cu_pdl_wait();
    cu_pdl_trigger();
    const int64_t stride = (int64_t)gridDim.x * blockDim.x, n = p.count / V;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        if constexpr (V == 4) {
            const float4 a = reinterpret_cast<const float4 *>(p.a)[i], b = reinterpret_cast<const float4 *>(p.b)[i];
            reinterpret_cast<float4 *>(p.out)[i] = make_float4(swiglu_dev(a.x, b.x, p.L), swiglu_dev(a.y, b.y, p.L),
                                                               swiglu_dev(a.z, b.z, p.L), swiglu_dev(a.w, b.w, p.L));
        } else {
            p.out[i] = swiglu_dev(p.a[i], p.b[i], p.L);
        }
    }
}

static __global__ void sigmoid_kernel(const ew_params p) {
    cu_pdl_wait();
    cu_pdl_trigger();
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < p.count; i += stride)
        p.out[i] = cu_sigmoidf(p.a[i]);
}

static __global__ void add_kernel(const ew_params p) {
    cu_pdl_wait();
    cu_pdl_trigger();
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < p.count; i += stride)
        p.out[i] += p.a[i];
}

static unsigned ew_grid(int64_t count) { return cu_grid_1d(count, EW_THREADS, EW_MAX_GRID); }

static mt_status swiglu_launch(ew_params *p, cudaStream_t s) {
    const bool v4 = p->count % 4 == 0 && cu_aligned16(p->out) && cu_aligned16(p->a) && cu_aligned16(p->b);
    if (v4)
        MT_CUDA_CHECK(cu_launch_pdl((const void *)swiglu_kernel<4>, dim3(ew_grid(p->count / 4)), dim3(EW_THREADS), 0, s, p));
    else
        MT_CUDA_CHECK(cu_launch_pdl((const void *)swiglu_kernel<1>, dim3(ew_grid(p->count)), dim3(EW_THREADS), 0, s, p));
    return MT_OK;
}

static mt_status sigmoid_launch(ew_params *p, cudaStream_t s) {
    MT_CUDA_CHECK(cu_launch_pdl((const void *)sigmoid_kernel, dim3(ew_grid(p->count)), dim3(EW_THREADS), 0, s, p));
    return MT_OK;
}

static void cu_swiglu(mt_backend *be, float *out, const float *gate, const float *up, int n, int I,
                      float L) {
    MT_ASSERT(n >= 0 && I >= 0);
    ew_params p = {out, gate, up, (int64_t)n * I, L};
    if (p.count == 0) return;
    cu_op_status(be, "swiglu", swiglu_launch(&p, cu_stream(be)));
}

static mt_status add_launch(ew_params *p, cudaStream_t s) {
    MT_CUDA_CHECK(cu_launch_pdl((const void *)add_kernel, dim3(ew_grid(p->count)), dim3(EW_THREADS), 0, s, p));
    return MT_OK;
}

static void cu_add(mt_backend *be, float *y, const float *x, int64_t count) {
    MT_ASSERT(count >= 0);
    if (count == 0) return;
    ew_params p = {y, x, NULL, count, 0.f};
    cu_op_status(be, "add", add_launch(&p, cu_stream(be)));
}

static void cu_sigmoid(mt_backend *be, float *x, int64_t count) {
    MT_ASSERT(count >= 0);
    if (count == 0) return;
    ew_params p = {x, x, NULL, count, 0.f};
    cu_op_status(be, "sigmoid", sigmoid_launch(&p, cu_stream(be)));
}

/* ================================ argmax ================================ */

/* A chunk is 8 values a thread, all loaded before the first compare (one row of a decode step,
 * 154880 logits, is 76 blocks; chunks of 8192 with one load in flight a thread took ~16 us). */
enum { ARGMAX_THREADS = 256, ARGMAX_PER_THREAD = 8, ARGMAX_CHUNK = ARGMAX_THREADS * ARGMAX_PER_THREAD };

typedef struct argmax_params {
    const float *logits;  /* [n, V] fp32 */
    float *part_v;        /* [n, nchunk] best value per chunk */
    int32_t *part_i;      /* [n, nchunk] its index */
    int32_t *out;         /* [n, rep] device: each row's index rep times */
    int rep;
    unsigned *count;      /* arrival counter (CU_COUNTER_ARGMAX), 0 between calls */
    int n, V, nchunk;
} argmax_params;

/* (v, i) beats (bv, bi): larger value, lowest index on ties; NaN never wins (as in the CPU scan). */
static __device__ __forceinline__ bool argmax_better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}

/* The warp's best (v, i) in every lane. */
static __device__ __forceinline__ void argmax_warp(float &v, int &i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (argmax_better(ov, oi, v, i)) { v = ov; i = oi; }
    }
}

static __device__ __forceinline__ void argmax_block(float &v, int &i) {
    __shared__ float sv[32];
    __shared__ int si[32];
    argmax_warp(v, i);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = v; si[warp] = i; }
    __syncthreads();
    v = sv[0];
    i = si[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); w++)
        if (argmax_better(sv[w], si[w], v, i)) { v = sv[w]; i = si[w]; }
}

/* Grid (nchunk, n): the best of one chunk of one row; the last block to arrive (an arrival
 * counter it returns to 0) then takes each row's best over its chunks, a warp a row, in chunk
 * order: one kernel where a second would wait a launch. */
static __global__ void argmax_chunk_kernel(const argmax_params p) {
    cu_pdl_wait(); /* launched for PDL (cu_launch_pdl_k) */
    cu_pdl_trigger();
    const int row = blockIdx.y, c = blockIdx.x;
    const float *l = p.logits + (int64_t)row * p.V;
    const int lo = c * ARGMAX_CHUNK, hi = lo + ARGMAX_CHUNK < p.V ? lo + ARGMAX_CHUNK : p.V;
    float bv = -INFINITY;
    int bi = INT_MAX;
    float v[ARGMAX_PER_THREAD];
#pragma unroll
    for (int u = 0; u < ARGMAX_PER_THREAD; u++) {
        const int j = lo + threadIdx.x + u * ARGMAX_THREADS;
        v[u] = j < hi ? l[j] : -INFINITY;
    }
#pragma unroll
    for (int u = 0; u < ARGMAX_PER_THREAD; u++) { /* ascending j: the lowest index of ties */
        const int j = lo + threadIdx.x + u * ARGMAX_THREADS;
        if (j < hi && argmax_better(v[u], j, bv, bi)) { bv = v[u]; bi = j; }
    }
    argmax_block(bv, bi);
    if (threadIdx.x == 0) {
        p.part_v[(int64_t)row * p.nchunk + c] = bv;
        p.part_i[(int64_t)row * p.nchunk + c] = bi;
        __threadfence(); /* the partial before the arrival */
    }
    if (!cu_arrives_last(p.count, gridDim.x * gridDim.y)) return;
    const int lane = threadIdx.x & 31;
    for (int r = threadIdx.x >> 5; r < p.n; r += ARGMAX_THREADS / 32) {
        float rv = -INFINITY;
        int ri = INT_MAX;
        for (int k = lane; k < p.nchunk; k += 32) { /* ascending chunks a lane, then the butterfly */
            const float v = __ldcg(p.part_v + (int64_t)r * p.nchunk + k);
            const int i = __ldcg(p.part_i + (int64_t)r * p.nchunk + k);
            if (argmax_better(v, i, rv, ri)) { rv = v; ri = i; }
        }
        argmax_warp(rv, ri);
        if (lane < p.rep) p.out[(int64_t)r * p.rep + lane] = ri == INT_MAX ? 0 : ri; /* all NaN: 0, as the CPU */
    }
    if (threadIdx.x == 0) *p.count = 0u; /* every block has arrived: ready for the next call */
}

static mt_status argmax_launch(const argmax_params *p, cudaStream_t s) {
    cu_launch_pdl_k(argmax_chunk_kernel, dim3((unsigned)p->nchunk, (unsigned)p->n), dim3(ARGMAX_THREADS), 0, s, *p);
    MT_CUDA_CHECK_LAUNCH();
    return MT_OK;
}

/* out: device [n, rep], or NULL for the scratch (returned; NULL on OOM). */
static int32_t *argmax_to(mt_backend *be, int32_t *out, int rep, const float *logits, int n, int V, mt_status *st) {
    argmax_params p;
    p.logits = logits;
    p.n = n;
    p.V = V;
    p.rep = rep;
    p.nchunk = (V + ARGMAX_CHUNK - 1) / ARGMAX_CHUNK;
    const size_t np = (size_t)n * p.nchunk;
    char *scr = (char *)cu_scratch(be, CU_SCRATCH_DENSE, np * 8 + (size_t)n * 4 + 16);
    *st = MT_ERR_NOMEM;
    if (!scr) return NULL;
    p.part_v = (float *)scr;
    p.part_i = (int32_t *)(scr + np * 4);
    p.out = out ? out : (int32_t *)(scr + np * 8);
    p.count = ((cu_backend *)be)->counters + CU_COUNTER_ARGMAX;
    *st = argmax_launch(&p, cu_stream(be));
    return p.out;
}

static void cu_argmax_dev(mt_backend *be, int32_t *out, int rep, const float *logits, int n, int V) {
    MT_ASSERT(n >= 0 && V > 0 && n <= 65535 && rep >= 1 && rep <= 32 && out);
    if (n == 0) return;
    mt_status st;
    argmax_to(be, out, rep, logits, n, V, &st);
    cu_op_status(be, "argmax_dev", st);
}

static void cu_argmax(mt_backend *be, int32_t *out, const float *logits, int n, int V) {
    MT_ASSERT(n >= 0 && V > 0 && n <= 65535);
    if (n == 0) return;
    mt_status st;
    const int32_t *dev = argmax_to(be, NULL, 1, logits, n, V, &st);
    if (!dev) return; /* cu_scratch logged and recorded it */
    if (st == MT_OK) MT_CUDA_(cu_copy_to_host(be, out, dev, (size_t)n * 4), "cudaMemcpyAsync(out, argmax)", st = mt_st_);
    cu_op_status(be, "argmax", st);
    cu_gap_open(be);
}

extern "C" void cu_dense_fill(mt_backend_ops *t) {
    t->embed = cu_embed;
    t->matmul = cu_matmul;
    t->matmul_multi = cu_matmul_multi;
    t->kda_gates = cu_kda_gates;
    t->hc_head_norm = cu_hc_head_norm;
    t->rmsnorm = cu_rmsnorm;
    t->layernorm = cu_layernorm;
    t->l2norm = cu_l2norm;
    t->swiglu = cu_swiglu;
    t->sigmoid = cu_sigmoid;
    t->add = cu_add;
    t->argmax = cu_argmax;
    t->argmax_dev = cu_argmax_dev;
}
