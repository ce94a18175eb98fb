/* kernels/cuda/cuda_moe_wg.cu: the routed experts' GEMMs of a prefill on Hopper's warpgroup MMA,
 * fed by TMA (the batched cuBLAS GEMMs of cuda_moe.cu did the same work at ~60% of the tensor
 * pipe: each padded size class a call, each call its own last wave, every part written as fp32
 * and summed by a separate pass). Owner: the CUDA backend; cuda_moe.cu calls it.
 *
 * The rows: x split into bf16 hi and lo parts, interleaved (x16 [2P, K]: pair q's hi at row 2q,
 * lo at 2q + 1, the pairs sorted by expert, expert e's at [2 start[e], 2 start[e + 1])), so that
 * both parts of a pair meet in one thread's accumulators (adjacent columns below). With the
 * backend's single rounding (tc_terms 1, MT_NUMERICS_BF16) x16 is [P, K], hi only, a row a pair:
 * the same tiles and main loop over half the rows, an epilogue that takes each column as a pair.
 *
 * A tile is (expert e, 256 weight rows from n0, up to 128 of e's x16 rows from row0; or for down
 * by default 128 weight rows and up to 256 x16 rows):
 *   D^T [rows of W, N token rows] = W[rows, K] . x16[rows, K]^T
 * the weight rows as wgmma's M (each consumer warpgroup 128 of them, as two accumulators of 64;
 * or 64, one), the token rows as its N (a multiple of 16, so an expert's rows need no padding
 * beyond 16), K in
 * stages of 64 through a 4-deep ring of shared memory that a producer thread fills by TMA (2-D
 * boxes of 64 weight rows, one box of token rows). Persistent: a CTA a multiprocessor walks the
 * tiles (blockIdx.x, + gridDim.x, ...), and the ring runs on across tiles, so the next tile's
 * loads overlap this one's last MMAs and its epilogue, which works from registers:
 *   gate/up (down = 0; 128 output columns from n0): warpgroup c multiplies its 64 gate rows and
 *     its 64 up rows (columns n0 + 64 c ..) into the two accumulators, so each thread holds gate
 *     and up of the same columns and pairs. It sums each pair's two parts (hi + lo, as
 *     moe_swiglu_split_kernel), applies swiglu and writes h's bf16 parts into out [2P, I].
 *     (Against gate and up rows interleaved in 8-row blocks through one 4-D TMA box into one
 *     accumulator, N <= 256, the two accumulators made the 4096-token prefill's gate/up
 *     13.24-13.26 -> 12.26-12.32 ms on the H200.)
 *   down (down = 1): each pair's hi + lo sum is written as one fp32 row of out [P, H] (the
 *     combine then reads one row a pair). By default a tile is 128 output columns from n0,
 *     warpgroup c's 64 rows of down from n0 + 64 c into one accumulator, against up to 256 token
 *     rows: a stage carries 16 KB of weights beside up to 32 KB of rows, and each token row of h is
 *     read once per 128 output columns. Wide (mt_cuda_params.moe_wg_wide_down) a tile is 256
 *     output columns, warpgroup c's 128 rows from n0 + 128 c into two accumulators, against up
 *     to 128 token rows, gate/up's shape: 32 KB of weights beside at most 16 KB of rows, each
 *     token row read half as often.
 * Deterministic: fixed tiles, no atomics. */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_wgmma.h"

enum {
    WG_BK = 64,                              /* K a stage: one 128-byte swizzled row of bf16 */
    WG_BW = 128,                             /* output columns a tile: 2 warpgroups of 64 */
    WG_BW_WIDE = 256,                        /* a wide down tile's: 2 warpgroups of 128 */
    WG_NMAX = 256,                           /* token rows a down tile (wgmma N, one accumulator) */
    WG_NMAX_GU = 128,                        /* token rows a tile of two accumulators (gate/up, wide down) */
    WG_NBOX = WG_NMAX / 32,                  /* x16 maps: boxes of 32, 64, .. 256 rows */
    WG_STAGES = 4,                           /* 8 stages of 32 were slower (H200) */
    WG_ROWS_BYTES = 64 * 2 * WG_BK,          /* 8 KB: one box of 64 weight rows */
    WG_A_BYTES = 4 * WG_ROWS_BYTES,          /* 32 KB of weights: 4 boxes; a down tile uses half */
    WG_STAGE_BYTES = WG_A_BYTES + WG_NMAX_GU * 2 * WG_BK, /* 48 KB either way */
    WG_THREADS = 384,                        /* producer + 2 consumer warpgroups */
    WG_SMEM = WG_STAGES * WG_STAGE_BYTES + 1024 /* alignment */ + 2 * WG_STAGES * 8 /* barriers */,
};

static_assert(WG_A_BYTES / 2 + WG_NMAX * 2 * WG_BK == WG_STAGE_BYTES, "down's stage is gate/up's");

typedef struct moe_wg_xmaps {
    CUtensorMap m[WG_NBOX]; /* x16, box b of 32 (b + 1) rows: the smallest that covers N */
} moe_wg_xmaps;

typedef struct moe_wg_params {
    const CUtensorMap *wmaps; /* [E][3] gate, up, down, boxes of 64 rows: cu_moe_wg_maps */
    const int4 *tiles;        /* [*ntiles] (expert, n0, row0, rows): rows a multiple of terms, <= WG_NMAX_GU
                                 (gate/up, wide down) or WG_NMAX (down) */
    const int32_t *ntiles;    /* device: written by moe_wg_plan_kernel */
    void *out;
    int ldo;                  /* out's row stride: I (gate/up) or H (down) */
    int kblocks;              /* K / WG_BK */
    int down;
    int terms;                /* 16-bit parts of x a pair: 2 (rows 2q, 2q + 1) or 1 (row q) */
    float L;                  /* swiglu limit */
} moe_wg_params;

/* h = silu(min(g, L)) * clamp(u, -L, L), as cu_swiglu */
static __device__ __forceinline__ float moe_wg_swiglu(float gv, float uv, float L) {
    const float g = fminf(gv, L), u = fminf(fmaxf(uv, -L), L);
    return g / (1.f + expf(-g)) * u;
}

/* One tile's main loop and epilogue on consumer warpgroup c at N token rows; it counts the ring's
 * stages across tiles (as the producer does). TWO: the warpgroup's two boxes of 64 weight rows in
 * the stage into two accumulators (GU: gate and up of the same 64 columns; else a wide down
 * tile's rows n0 + 128 c .. + 63 and the 64 after them); else its one box of down's rows. */
template <int N, bool GU, bool TWO>
static __device__ __forceinline__ void moe_wg_tile(uint8_t *sm, uint64_t *full, uint64_t *empty, const moe_wg_params &p,
                                                   int c, int n0, int row0, int rows, int &it) {
    static_assert(TWO || !GU, "gate/up takes two accumulators");
    float d[N / 2], du[TWO ? N / 2 : 1];
#pragma unroll
    for (int i = 0; i < N / 2; i++) d[i] = 0.f;
#pragma unroll
    for (int i = 0; i < (TWO ? N / 2 : 1); i++) du[i] = 0.f;
    for (int kb = 0; kb < p.kblocks; kb++, it++) {
        const int s = it % WG_STAGES;
        cu_mbar_wait(&full[s], (unsigned)(it / WG_STAGES) & 1u);
        const uint8_t *st = sm + s * WG_STAGE_BYTES;
        const uint8_t *a = st + c * (TWO ? 2 : 1) * WG_ROWS_BYTES, *b = st + (TWO ? WG_A_BYTES : WG_A_BYTES / 2);
#pragma unroll
        for (int i = 0; i < N / 2; i++) cu_wg_reg_fence(d[i]);
        if constexpr (TWO)
#pragma unroll
            for (int i = 0; i < N / 2; i++) cu_wg_reg_fence(du[i]);
        cu_wg_fence();
#pragma unroll
        for (int k = 0; k < WG_BK / 16; k++) {
            cu_wgmma_bf16<N>(d, cu_wg_desc(a + 32 * k), cu_wg_desc(b + 32 * k));
            if constexpr (TWO) cu_wgmma_bf16<N>(du, cu_wg_desc(a + WG_ROWS_BYTES + 32 * k), cu_wg_desc(b + 32 * k));
        }
        cu_wg_commit();
#pragma unroll
        for (int i = 0; i < N / 2; i++) cu_wg_reg_fence(d[i]);
        if constexpr (TWO)
#pragma unroll
            for (int i = 0; i < N / 2; i++) cu_wg_reg_fence(du[i]);
        cu_wg_wait<1>(); /* the previous stage's MMAs are done: give it back */
        if (kb > 0 && (threadIdx.x & 127) == 0) cu_mbar_arrive(&empty[(it - 1) % WG_STAGES]);
    }
    cu_wg_wait<0>();
#pragma unroll
    for (int i = 0; i < N / 2; i++) cu_wg_reg_fence(d[i]);
    if constexpr (TWO)
#pragma unroll
        for (int i = 0; i < N / 2; i++) cu_wg_reg_fence(du[i]);
    if ((threadIdx.x & 127) == 0) cu_mbar_arrive(&empty[(it - 1) % WG_STAGES]);

    /* d[4j + h] (h = 0, 1: output row r, 2, 3: row r + 8; r = 16 w + lane / 4 of the box's 64) at
     * token rows 8j + 2 (lane % 4) + (h & 1): pair q = 4j + lane % 4, its hi part in d[4j + 2h'],
     * its lo part beside it; du likewise for the second box (up, or down's next 64 rows) */
    const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3, pairs = rows >> 1;
    /* down: its box (wide: both boxes, 128 consecutive columns) of out; gate/up: h's columns */
    const int col = n0 + (!GU && TWO ? 128 : 64) * c + 16 * w + (lane >> 2);
    if constexpr (!GU && TWO)
        if (col >= p.ldo) return; /* a last wide tile of 128 columns: warpgroup 1 past H */
    if (p.terms == 1) { /* one part: d[4j + 2hh + t] is pair 8j + 2 (lane % 4) + t at column col + 8hh */
#pragma unroll
        for (int j = 0; j < N / 8; j++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++)
#pragma unroll
                for (int t = 0; t < 2; t++) {
                    const int q = 8 * j + 2 * (lane & 3) + t;
                    if (q >= rows) continue;
                    if constexpr (GU) {
                        if (col + 8 * hh >= p.ldo) continue;
                        const float h = moe_wg_swiglu(d[4 * j + 2 * hh + t], du[4 * j + 2 * hh + t], p.L);
                        ((uint16_t *)p.out)[(size_t)(row0 + q) * p.ldo + col + 8 * hh] = cu_bits16<MT_BF16>(h);
                    } else {
                        ((float *)p.out)[(size_t)(row0 + q) * p.ldo + col + 8 * hh] = d[4 * j + 2 * hh + t];
                        if constexpr (TWO)
                            ((float *)p.out)[(size_t)(row0 + q) * p.ldo + col + 64 + 8 * hh] = du[4 * j + 2 * hh + t];
                    }
                }
        return;
    }
    if constexpr (!GU) {
        float *o = (float *)p.out + (size_t)(row0 >> 1) * p.ldo + col;
#pragma unroll
        for (int j = 0; j < N / 8; j++) {
            const int q = 4 * j + (lane & 3);
            if (q < pairs) {
                o[(size_t)q * p.ldo] = __fadd_rn(d[4 * j], d[4 * j + 1]);
                o[(size_t)q * p.ldo + 8] = __fadd_rn(d[4 * j + 2], d[4 * j + 3]);
                if constexpr (TWO) {
                    o[(size_t)q * p.ldo + 64] = __fadd_rn(du[4 * j], du[4 * j + 1]);
                    o[(size_t)q * p.ldo + 72] = __fadd_rn(du[4 * j + 2], du[4 * j + 3]);
                }
            }
        }
        return;
    }
    uint16_t *o = (uint16_t *)p.out + (size_t)row0 * p.ldo + col;
#pragma unroll
    for (int j = 0; j < N / 8; j++) {
        const int q = 4 * j + (lane & 3);
        if (q < pairs)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                if (col + 8 * hh >= p.ldo) continue; /* a last tile of 64 columns: WG 1 past I */
                const float h = moe_wg_swiglu(__fadd_rn(d[4 * j + 2 * hh], d[4 * j + 2 * hh + 1]),
                                              __fadd_rn(du[4 * j + 2 * hh], du[4 * j + 2 * hh + 1]), p.L);
                o[(size_t)2 * q * p.ldo + 8 * hh] = cu_bits16<MT_BF16>(h);
                o[(size_t)(2 * q + 1) * p.ldo + 8 * hh] = cu_bits16<MT_BF16>(h - cu_round16<MT_BF16>(h));
            }
    }
}

static __device__ __forceinline__ int moe_wg_nt(int rows) { return (rows + 15) >> 4; } /* N / 16 */

/* WIDE: down's tiles are wide (file comment). */
template <bool WIDE>
static __global__ void __launch_bounds__(WG_THREADS, 1)
    moe_wg_kernel(const __grid_constant__ moe_wg_xmaps xm, const moe_wg_params p) {
    extern __shared__ uint8_t wg_smem_raw[];
    uint8_t *sm = (uint8_t *)(((uintptr_t)wg_smem_raw + 1023) & ~(uintptr_t)1023);
    uint64_t *full = (uint64_t *)(sm + WG_STAGES * WG_STAGE_BYTES), *empty = full + WG_STAGES;
    const int wg = threadIdx.x >> 7, ntiles = *p.ntiles;
    if (threadIdx.x == 0) {
        for (int s = 0; s < WG_STAGES; s++) {
            cu_mbar_init(&full[s], 1);
            cu_mbar_init(&empty[s], 2);
        }
        cu_mbar_init_fence();
    }
    __syncthreads();

    if (wg == 0) { /* producer: one thread issues every load */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (threadIdx.x != 0) return;
        const int abytes = p.down && !WIDE ? WG_A_BYTES / 2 : WG_A_BYTES;
        int it = 0;
        for (int ti = blockIdx.x; ti < ntiles; ti += gridDim.x) {
            const int4 tile = p.tiles[ti];
            const int e = tile.x, n0 = tile.y, row0 = tile.z, box = (tile.w + 31) / 32 - 1;
            const CUtensorMap *wmap = p.wmaps + 3 * e, *xmap = &xm.m[box];
            const unsigned bytes = (unsigned)abytes + (unsigned)(box + 1) * 32 * 2 * WG_BK;
            for (int kb = 0; kb < p.kblocks; kb++, it++) {
                const int s = it % WG_STAGES;
                if (it >= WG_STAGES) cu_mbar_wait(&empty[s], (unsigned)(it / WG_STAGES - 1) & 1u);
                uint8_t *st = sm + s * WG_STAGE_BYTES;
                cu_mbar_arrive_tx(&full[s], bytes);
                for (int h = 0; h < 2; h++) /* each consumer warpgroup's boxes of 64 weight rows */
                    if (p.down && !WIDE) {
                        cu_tma_load_2d(st + h * WG_ROWS_BYTES, wmap + 2, &full[s], kb * WG_BK, n0 + 64 * h);
                    } else if (p.down) { /* down's rows n0 + 128 h .. + 127 */
                        cu_tma_load_2d(st + 2 * h * WG_ROWS_BYTES, wmap + 2, &full[s], kb * WG_BK, n0 + 128 * h);
                        cu_tma_load_2d(st + (2 * h + 1) * WG_ROWS_BYTES, wmap + 2, &full[s], kb * WG_BK,
                                       n0 + 128 * h + 64);
                    } else { /* its gate rows, then its up rows, of the same 64 columns */
                        cu_tma_load_2d(st + 2 * h * WG_ROWS_BYTES, wmap, &full[s], kb * WG_BK, n0 + 64 * h);
                        cu_tma_load_2d(st + (2 * h + 1) * WG_ROWS_BYTES, wmap + 1, &full[s], kb * WG_BK, n0 + 64 * h);
                    }
                cu_tma_load_2d(st + abytes, xmap, &full[s], kb * WG_BK, row0);
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int c = wg - 1;
    int it = 0;
    for (int ti = blockIdx.x; ti < ntiles; ti += gridDim.x) {
        const int4 tile = p.tiles[ti];
        if (p.down && !WIDE) switch (moe_wg_nt(tile.w)) {
#define WG_CASE(k) \
    case k: moe_wg_tile<16 * k, false, false>(sm, full, empty, p, c, tile.y, tile.z, tile.w, it); break;
            WG_CASE(1) WG_CASE(2) WG_CASE(3) WG_CASE(4) WG_CASE(5) WG_CASE(6) WG_CASE(7) WG_CASE(8)
            WG_CASE(9) WG_CASE(10) WG_CASE(11) WG_CASE(12) WG_CASE(13) WG_CASE(14) WG_CASE(15) WG_CASE(16)
#undef WG_CASE
            default: break;
            }
        else if (p.down) switch (moe_wg_nt(tile.w)) {
#define WG_CASE(k) \
    case k: moe_wg_tile<16 * k, false, true>(sm, full, empty, p, c, tile.y, tile.z, tile.w, it); break;
            WG_CASE(1) WG_CASE(2) WG_CASE(3) WG_CASE(4) WG_CASE(5) WG_CASE(6) WG_CASE(7) WG_CASE(8)
#undef WG_CASE
            default: break;
            }
        else switch (moe_wg_nt(tile.w)) {
#define WG_CASE(k) \
    case k: moe_wg_tile<16 * k, true, true>(sm, full, empty, p, c, tile.y, tile.z, tile.w, it); break;
            WG_CASE(1) WG_CASE(2) WG_CASE(3) WG_CASE(4) WG_CASE(5) WG_CASE(6) WG_CASE(7) WG_CASE(8)
#undef WG_CASE
            default: break;
            }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* The plan of a call, on the device (no host round trip): the pairs sorted by expert (stable,
 * so each expert's pairs keep their order), and both tile lists. One block of 32 warps, each
 * owning a stretch of the pairs in order: it counts its stretch per expert (shared atomics:
 * order-free), thread e scans expert e's counts over the warps into each warp's first slot after
 * the exclusive scans of the pairs and of the row chunks over the experts (an expert's terms * c
 * rows in ceil(terms * c / NMAX) chunks, as even as possible, NMAX WG_NMAX_GU for gate/up and a
 * wide down, WG_NMAX for down); each warp then places its pairs (ranked among equal experts by a
 * match, 32 at a step) and thread e writes expert e's tiles: gate/up at (chunk offset) * ceil(I /
 * 128), in order of columns then chunk, down likewise at * ceil(H / 128) (wide: 256). (One warp
 * placing every pair took 0.6 ms at 32768 pairs: a chain of dependent steps.) */
enum { WG_PLAN_THREADS = CU_MOE_WG_MAX_E }; /* a thread an expert */

typedef struct moe_wg_plan_params {
    const int32_t *idx;       /* [P] the expert of each (row, slot) pair */
    int P, top_k, E, r0, I, H, terms; /* terms: x16's rows a pair (moe_wg_params.terms) */
    int32_t *gather, *inv;    /* [P]: sorted slot -> row r0 + q / top_k; pair q -> sorted slot */
    int4 *tgu, *tdn;          /* tiles (cu_moe_wg_gemm's format) */
    int32_t *ntiles;          /* [2]: gate/up, down */
} moe_wg_plan_params;

/* Exclusive block-wide scan of v (both parts) over the 1024 threads; *total gets the sums. */
static __device__ int2 wg_scan2(int2 v, int2 *total) {
    __shared__ int2 ws[WG_PLAN_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int2 inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int a = __shfl_up_sync(0xffffffffu, inc.x, o), b = __shfl_up_sync(0xffffffffu, inc.y, o);
        if (lane >= o) inc.x += a, inc.y += b;
    }
    if (lane == 31) ws[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        int2 w = ws[lane], wi = w;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int a = __shfl_up_sync(0xffffffffu, wi.x, o), b = __shfl_up_sync(0xffffffffu, wi.y, o);
            if (lane >= o) wi.x += a, wi.y += b;
        }
        ws[lane] = make_int2(wi.x - w.x, wi.y - w.y); /* exclusive */
        if (lane == 31) *total = wi;
    }
    __syncthreads();
    const int2 base = ws[warp];
    return make_int2(base.x + inc.x - v.x, base.y + inc.y - v.y);
}

template <bool WIDE>
static __global__ void __launch_bounds__(WG_PLAN_THREADS) moe_wg_plan_kernel(moe_wg_plan_params p) {
    extern __shared__ int wcnt[]; /* [32 warps][E]: each warp's count of an expert, then its cursor */
    __shared__ int2 tot, totd;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int seg = (p.P + 32 * 32 - 1) / (32 * 32) * 32; /* pairs a warp: its own stretch, in order */
    const int q0 = warp * seg, q1 = min(q0 + seg, p.P);
    for (int i = tid; i < 32 * p.E; i += WG_PLAN_THREADS) wcnt[i] = 0;
    __syncthreads();
    for (int q = q0 + lane; q < q1; q += 32) {
        const int e = p.idx[q];
        if ((unsigned)e < (unsigned)p.E) atomicAdd(&wcnt[warp * p.E + e], 1);
    }
    __syncthreads();
    int c = 0;
    if (tid < p.E)
        for (int w = 0; w < 32; w++) c += wcnt[w * p.E + tid];
    constexpr int NMD = WIDE ? WG_NMAX_GU : WG_NMAX; /* token rows a down tile */
    const int rows = p.terms * c, nch = (rows + WG_NMAX_GU - 1) / WG_NMAX_GU, nchd = (rows + NMD - 1) / NMD;
    const int2 ex = wg_scan2(make_int2(c, nch), &tot); /* first pair, first gate/up chunk of expert tid */
    __syncthreads(); /* every read of the scan's shared partials is done */
    const int exd = wg_scan2(make_int2(nchd, 0), &totd).x; /* its first down chunk */
    if (tid < p.E)
        for (int w = 0, run = ex.x; w < 32; w++) { /* warp w's first slot for expert tid */
            const int k = wcnt[w * p.E + tid];
            wcnt[w * p.E + tid] = run;
            run += k;
        }
    __syncthreads();
    /* each warp places its pairs: pos = its cursor of the expert + rank among equal lanes */
    int *cur = wcnt + warp * p.E;
    for (int base = q0; base < q1; base += 32) {
        const int q = base + lane, e = q < q1 ? p.idx[q] : -1;
        const bool ok = (unsigned)e < (unsigned)p.E;
        const unsigned same = __match_any_sync(0xffffffffu, ok ? e : -1);
        const int rank = __popc(same & ((1u << lane) - 1u));
        const int pos = ok ? cur[e] + rank : 0;
        __syncwarp();
        if (ok && rank == 0) cur[e] += __popc(same);
        __syncwarp();
        if (ok) p.gather[pos] = p.r0 + q / p.top_k;
        if (q < q1) p.inv[q] = pos; /* an index outside [0, E) (never from the router) reads slot 0 */
    }
    if (nch > 0) {
        const int per = p.terms * ((c + nch - 1) / nch), perd = p.terms * ((c + nchd - 1) / nchd);
        const int row0 = p.terms * ex.x;
        const int ng = (p.I + WG_BW - 1) / WG_BW, nd = WIDE ? (p.H + WG_BW_WIDE - 1) / WG_BW_WIDE : p.H / WG_BW;
        int4 *g = p.tgu + (size_t)ex.y * ng, *d = p.tdn + (size_t)exd * nd;
        for (int n = 0; n < ng; n++)
            for (int r = 0; r < rows; r += per) *g++ = make_int4(tid, n * WG_BW, row0 + r, min(per, rows - r));
        for (int n = 0; n < nd; n++)
            for (int r = 0; r < rows; r += perd)
                *d++ = make_int4(tid, n * (WIDE ? WG_BW_WIDE : WG_BW), row0 + r, min(perd, rows - r));
    }
    for (int q = tot.x + tid; q < p.P; q += WG_PLAN_THREADS) p.gather[q] = p.r0; /* slots of invalid pairs */
    if (tid == 0) {
        p.ntiles[0] = tot.y * ((p.I + WG_BW - 1) / WG_BW);
        p.ntiles[1] = totd.x * (WIDE ? (p.H + WG_BW_WIDE - 1) / WG_BW_WIDE : p.H / WG_BW);
    }
}

extern "C" size_t cu_moe_wg_max_tiles(int P, int E, int cols, bool down, bool wide) {
    const size_t nmax = down && !wide ? WG_NMAX : WG_NMAX_GU, bw = down && wide ? WG_BW_WIDE : WG_BW;
    return ((2 * (size_t)P + nmax - 1) / nmax + (size_t)E) * ((cols + bw - 1) / bw);
}

extern "C" mt_status cu_moe_wg_plan(const int32_t *idx, int P, int top_k, int E, int r0, int H,
                                    int I, int terms, bool wide, int32_t *gather, int32_t *inv, int32_t *tgu,
                                    int32_t *tdn, int32_t *ntiles, cudaStream_t s) {
    MT_ASSERT(E >= 1 && E <= WG_PLAN_THREADS && P >= 1 && (terms == 1 || terms == 2));
    const moe_wg_plan_params p = {idx, P, top_k, E, r0, I, H, terms, gather, inv, (int4 *)tgu, (int4 *)tdn, ntiles};
    const size_t smem = sizeof(int) * 32 * (size_t)E;
    static const bool attr = [] {
        const int most = (int)(sizeof(int) * 32 * WG_PLAN_THREADS);
        return cudaFuncSetAttribute(moe_wg_plan_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, most) ==
                   cudaSuccess &&
               cudaFuncSetAttribute(moe_wg_plan_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, most) ==
                   cudaSuccess;
    }();
    if (!attr) {
        mt_log(MT_LOG_ERROR, "cuda backend: moe_experts: the plan kernel's shared memory refused");
        return MT_ERR_BACKEND;
    }
    if (wide) moe_wg_plan_kernel<true><<<1, WG_PLAN_THREADS, smem, s>>>(p);
    else moe_wg_plan_kernel<false><<<1, WG_PLAN_THREADS, smem, s>>>(p);
    MT_CUDA_CHECK_LAUNCH();
    return MT_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* host */

static PFN_cuTensorMapEncodeTiled_v12000 wg_encode_fn(void) {
    static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
        void *f = NULL;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) !=
                cudaSuccess ||
            q != cudaDriverEntryPointSuccess) {
            (void)cudaGetLastError();
            f = NULL;
        }
        return (PFN_cuTensorMapEncodeTiled_v12000)f;
    }();
    return fn;
}

/* A row-major bf16 [rows, cols] matrix, boxes of {WG_BK, box_rows}, 128-byte swizzle. */
static bool wg_encode(CUtensorMap *m, const void *base, int64_t rows, int64_t cols, int box_rows) {
    PFN_cuTensorMapEncodeTiled_v12000 fn = wg_encode_fn();
    const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)cols * 2};
    const cuuint32_t box[2] = {WG_BK, (cuuint32_t)box_rows}, estr[2] = {1, 1};
    return fn && fn(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)base, dims, strides, box, estr,
                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

extern "C" bool cu_moe_wg_ok(const cu_backend *cb, mt_dtype dt, int H, int I) {
    static const int arch = [] {
        int dev = 0, major = 0, minor = 0;
        if (cudaGetDevice(&dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
            (void)cudaGetLastError();
            return 0;
        }
        return 10 * major + minor;
    }();
    return cb->params.moe_wg && cb->tc_terms >= 1 && dt == MT_BF16 && arch == 90 && H % WG_BW == 0 &&
           I % 64 == 0 && wg_encode_fn() != NULL;
}

extern "C" mt_status cu_moe_wg_maps(const mt_expert *ex, int count, int cap, void **dev, cudaStream_t s) {
    /* 64-byte aligned, as the encoder wants its map (malloc promises 16) */
    CUtensorMap *h = (CUtensorMap *)aligned_alloc(128, sizeof(CUtensorMap) * 3 * (size_t)count);
    if (!h) return MT_ERR_NOMEM;
    for (int e = 0; e < count; e++)
        if (!wg_encode(&h[3 * e], ex[e].gate.data, ex[e].gate.rows, ex[e].gate.cols, 64) ||
            !wg_encode(&h[3 * e + 1], ex[e].up.data, ex[e].up.rows, ex[e].up.cols, 64) ||
            !wg_encode(&h[3 * e + 2], ex[e].down.data, ex[e].down.rows, ex[e].down.cols, 64)) {
            free(h);
            mt_log(MT_LOG_ERROR, "cuda backend: moe_experts: cuTensorMapEncodeTiled failed (expert %d)", e);
            return MT_ERR_BACKEND;
        }
    mt_status st = MT_OK;
    if (!*dev && cudaMalloc(dev, sizeof(CUtensorMap) * 3 * (size_t)cap) != cudaSuccess) {
        (void)cudaGetLastError();
        *dev = NULL;
        st = MT_ERR_NOMEM;
    }
    if (st == MT_OK) {
        MT_CUDA_(cudaMemcpyAsync(*dev, h, sizeof(CUtensorMap) * 3 * (size_t)count, cudaMemcpyHostToDevice, s),
                 "cudaMemcpyAsync(moe tensor maps)", st = mt_st_);
        if (st == MT_OK) MT_CUDA_(cudaStreamSynchronize(s), "cudaStreamSynchronize(moe tensor maps)", st = mt_st_);
    }
    free(h);
    return st;
}

extern "C" mt_status cu_moe_wg_gemm(const void *wmaps, const int32_t *tiles, const int32_t *ntiles, int max_tiles,
                                    const void *x16, int64_t xrows, int K, void *out, int ldo, bool down, bool wide,
                                    int terms, float L, int sms, cudaStream_t s) {
    MT_ASSERT(terms == 1 || terms == 2);
    if (max_tiles == 0) return MT_OK;
    static const bool attr = [] {
        return cudaFuncSetAttribute(moe_wg_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, WG_SMEM) ==
                   cudaSuccess &&
               cudaFuncSetAttribute(moe_wg_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, WG_SMEM) ==
                   cudaSuccess;
    }();
    if (!attr) {
        mt_log(MT_LOG_ERROR, "cuda backend: moe_experts: the wgmma kernel's %d bytes of shared memory refused",
               (int)WG_SMEM);
        return MT_ERR_BACKEND;
    }
    moe_wg_xmaps xm;
    for (int b = 0; b < WG_NBOX; b++)
        if (!wg_encode(&xm.m[b], x16, xrows, K, 32 * (b + 1))) {
            mt_log(MT_LOG_ERROR, "cuda backend: moe_experts: cuTensorMapEncodeTiled failed (rows)");
            return MT_ERR_BACKEND;
        }
    const moe_wg_params p = {(const CUtensorMap *)wmaps, (const int4 *)tiles, ntiles, out, ldo, K / WG_BK,
                             down ? 1 : 0, terms, L};
    const int grid = max_tiles < sms ? max_tiles : sms;
    if (down && wide) moe_wg_kernel<true><<<(unsigned)grid, WG_THREADS, WG_SMEM, s>>>(xm, p);
    else moe_wg_kernel<false><<<(unsigned)grid, WG_THREADS, WG_SMEM, s>>>(xm, p);
    MT_CUDA_CHECK_LAUNCH();
    return MT_OK;
}
