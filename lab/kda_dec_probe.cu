/* lab/kda_dec_probe.cu: shapes of the KDA decode step (kernels/cuda/cuda_kda.cu,
 * kda_decode_kernel) side by side, for finding what holds B = 32 below the copy rate after
 * do_bench's memset flush (docs/PERF.md). Standalone (no backend): nh = B * 64 heads of 128 x 128 fp32 state,
 * one step; each variant is timed as bench/kda_bench.c times the op (a 256 MB memset, then
 * events around one call; median), and so is a cudaMemcpy of the same bytes. A development
 * tool, not a benchmark of record: its figures are compared with each other in one run.
 *   nvcc -arch=sm_90a -I. lab/kda_dec_probe.cu -o kda_dec_probe; kda_dec_probe [B...]   (default B = 32 256)
 * The kernels here have the production arithmetic but not its rows form or programmatic launch,
 * and the compiler spills some of them and not others (ptxas -v): when a shape wins here, build
 * it into the real kernel and A/B that with bench/kda_bench (the 128-thread shape
 * that read 1.4-1.8 points faster here gained nothing there; staging the slice in
 * shared memory by cp.async, dec_smem_kernel, read 1-9 points slower than the register forms;
 * L2 prefetch of a later block's slice, dec_ahead_kernel, and dropping the slice's L2
 * lines before the in-place stores, dec_disc_kernel, both slower; persistent CTAs
 * loading the next item into registers while computing one, dec_persist_kernel, 74-82% at B = 32
 * flushed against the production shape's 87.7%). */
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <vector>

#include "lab/probe_check.h"

enum { DK = 128, FLUSH = 256 << 20 };

struct prm {
    float *o, *state, *state_out; /* state_out: where the OOP variants write the new state */
    const float *q, *k, *v, *g, *beta;
    int nh;
};

/* The production kernel's arithmetic with its shape as parameters: T threads, COLS value columns
 * a block (G = COLS / 4 float4 groups), R rows a thread; PF: the L2 prefetch prologue (0 none,
 * 1 a prefetch.global.L2 per 128-byte line as in production, 2 a bulk L2 prefetch per row's
 * segment, 3 one bulk L2 prefetch of 32 KB of the head a block); REV: blocks in reverse order. */
/* The per-warp partial sums in shared memory (red_*[warp][g]) summed over the W warps in order,
 * for column group g: the same order in every thread, so deterministic. */
template <int W, int G>
__device__ __forceinline__ void dec_sum_warps(const float4 (*red_u)[G], const float4 (*red_w)[G], const float *red_qk,
                                              int g, float4 &u, float4 &wq, float &qk) {
    u = red_u[0][g];
    wq = red_w[0][g];
    qk = red_qk[0];
#pragma unroll
    for (int ww = 1; ww < W; ww++) {
        const float4 a = red_u[ww][g], c = red_w[ww][g];
        u.x += a.x; u.y += a.y; u.z += a.z; u.w += a.w;
        wq.x += c.x; wq.y += c.y; wq.z += c.z; wq.w += c.w;
        qk += red_qk[ww];
    }
}

/* The block's sums of u, w (a float4 of columns each) and qk: over the warp's row parities (lanes
 * c4 + G m), then over the W warps in order through shared memory; every thread gets its columns'. */
template <int W, int G>
__device__ __forceinline__ void dec_reduce(float4 &u, float4 &wq, float &qk, float4 (*red_u)[G], float4 (*red_w)[G],
                                           float *red_qk, int lane, int w, int c4, int sub) {
#pragma unroll
    for (int m = G; m < 32; m *= 2) {
        u.x += __shfl_xor_sync(0xffffffffu, u.x, m);
        u.y += __shfl_xor_sync(0xffffffffu, u.y, m);
        u.z += __shfl_xor_sync(0xffffffffu, u.z, m);
        u.w += __shfl_xor_sync(0xffffffffu, u.w, m);
        wq.x += __shfl_xor_sync(0xffffffffu, wq.x, m);
        wq.y += __shfl_xor_sync(0xffffffffu, wq.y, m);
        wq.z += __shfl_xor_sync(0xffffffffu, wq.z, m);
        wq.w += __shfl_xor_sync(0xffffffffu, wq.w, m);
        qk += __shfl_xor_sync(0xffffffffu, qk, m);
    }
    if (sub == 0) {
        red_u[w][c4] = u;
        red_w[w][c4] = wq;
    }
    if (lane == 0) red_qk[w] = qk;
    __syncthreads();
    dec_sum_warps<W, G>(red_u, red_w, red_qk, c4, u, wq, qk);
}

/* u = k^T S', w = q^T S' (a float4 of columns each) and qk = q.k over the thread's R rows, with
 * S' = diag(e) S scaled in place in s. */
template <int R, int PASS>
__device__ __forceinline__ void dec_accumulate(float4 *s, const float *qs, const float *ks, const float *es, int rbase,
                                               float4 &u, float4 &wq, float &qk) {
    u = make_float4(0.f, 0.f, 0.f, 0.f);
    wq = u;
    qk = 0.f;
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int i = rbase + PASS * r;
        const float e = es[i], kk = ks[i], qq = qs[i];
        s[r].x *= e; s[r].y *= e; s[r].z *= e; s[r].w *= e;
        u.x += kk * s[r].x; u.y += kk * s[r].y; u.z += kk * s[r].z; u.w += kk * s[r].w;
        wq.x += qq * s[r].x; wq.y += qq * s[r].y; wq.z += qq * s[r].z; wq.w += qq * s[r].w;
        qk += qq * kk;
    }
}

/* Head h's step inputs: v's columns j.. j+3 and beta into registers, q, k and e = exp(g) into
 * shared memory (threads below DK; the caller's barrier publishes them). */
__device__ __forceinline__ void dec_stage(const prm &p, int h, int j, int tid, float *qs, float *ks, float *es,
                                          float4 &v4, float &b) {
    const size_t off = (size_t)h * DK;
    v4 = *reinterpret_cast<const float4 *>(p.v + off + j);
    b = p.beta[h];
    if (tid < DK) {
        qs[tid] = p.q[off + tid];
        ks[tid] = p.k[off + tid];
        es[tid] = expf(p.g[off + tid]);
    }
}

/* Head h's slice from column j0 (DK rows x COLS columns, row-major state) into L2, a 128-byte
 * line a prefetch, spread over the block's T threads; EL: with the evict_last priority. */
template <int T, int COLS, bool EL>
__device__ __forceinline__ void dec_prefetch_slice(const prm &p, int h, int j0, int tid) {
    const char *base = (const char *)(p.state + (size_t)h * DK * DK);
    for (int e = tid; e < DK * (COLS / 32); e += T) {
        const char *a = base + ((size_t)(e / (COLS / 32)) * DK + j0) * 4 + (e % (COLS / 32)) * 128;
        if (EL)
            asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(a));
        else
            asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
    }
}

template <int T, int COLS, int PF, bool REV, bool BL, bool PDL = false, bool OOP = false, int AH = 0, bool DISC = false>
__device__ __forceinline__ void dec_item(const prm &p, int bid) {
    constexpr int G = COLS / 4, PASS = T / G, R = DK / PASS, W = T / 32, SUBS = 32 / G;
    const int nblk = DK / COLS;
    const int h = bid / nblk, j0 = (bid - h * nblk) * COLS;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, c4 = lane % G, sub = lane / G;
    const int j = j0 + 4 * c4, rbase = SUBS * w + sub;
    __shared__ float qs[DK], ks[DK], es[DK];
    __shared__ float4 red_u[W][G], red_w[W][G];
    __shared__ float red_qk[W];
    /* BL: the blocked layout (timing only): a head's state as DK / COLS slabs of DK rows x COLS
     * columns, so a block's slice is one contiguous 32 KB */
    constexpr int LD4 = BL ? COLS / 4 : DK / 4;
    float4 *S = BL ? reinterpret_cast<float4 *>(p.state + (size_t)h * DK * DK + (size_t)(j0 / COLS) * DK * COLS) + c4
                   : reinterpret_cast<float4 *>(p.state + (size_t)h * DK * DK) + (j >> 2);
    const char *hb = (const char *)(p.state + (size_t)h * DK * DK);
    if (PF == 2)
        for (int r = tid; r < DK; r += T)
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(hb + ((size_t)r * DK + j0) * 4), "r"(COLS * 4)
                         : "memory");
    if (PF == 3 && tid == 0)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(hb + (size_t)(j0 / COLS) * (DK * DK * 4 / nblk)),
                     "r"(DK * DK * 4 / nblk)
                     : "memory");
    if (PF == 1 && BL)
        for (int e = tid; e < DK * (COLS / 32); e += T)
            asm volatile("prefetch.global.L2 [%0];" ::"l"((const char *)(S - c4) + 128 * e));
    if (PF == 1 && !BL) dec_prefetch_slice<T, COLS, false>(p, h, j0, tid);
    /* PF 4 / 5: the slice of item bid + AH into L2 (5: with the evict_last
     * priority), and a block of the first AH its own, so that the block which takes this one's
     * place about AH items later finds its slice in L2: DRAM reads run ahead of the registers */
    if (PF >= 4) {
        const int nitems = p.nh * nblk;
        for (int pass = bid < AH ? 0 : 1; pass < 2; pass++) {
            const int b2 = pass ? bid + AH : bid;
            if (b2 >= nitems) break;
            const int h2 = b2 / nblk;
            dec_prefetch_slice<T, COLS, PF == 5>(p, h2, (b2 - h2 * nblk) * COLS, tid);
        }
    }
    if (PDL) asm volatile("griddepcontrol.wait;\ngriddepcontrol.launch_dependents;\n" ::: "memory");
    float4 s[R];
#pragma unroll
    for (int r = 0; r < R; r++) s[r] = __ldca(S + (size_t)(rbase + PASS * r) * LD4);
    const size_t off = (size_t)h * DK;
    float4 v4;
    float b;
    dec_stage(p, h, j, tid, qs, ks, es, v4, b);
    __syncthreads();
    float4 u, wq;
    float qk;
    dec_accumulate<R, PASS>(s, qs, ks, es, rbase, u, wq, qk);
    dec_reduce<W, G>(u, wq, qk, red_u, red_w, red_qk, lane, w, c4, sub);
    const float4 d = make_float4(b * (v4.x - u.x), b * (v4.y - u.y), b * (v4.z - u.z), b * (v4.w - u.w));
    /* DISC: the slice's L2 lines dropped (no write-back) once read into registers,
     * so the in-place stores allocate fresh lines, as the out-of-place stores do; a lane at
     * the start of each 128-byte line drops it, the warp's stores follow the __syncwarp */
    if (DISC && !BL && COLS % 32 == 0) {
        if ((c4 & 7) == 0)
#pragma unroll
            for (int r = 0; r < R; r++)
                asm volatile("discard.global.L2 [%0], 128;" ::"l"(S + (size_t)(rbase + PASS * r) * LD4) : "memory");
        __syncwarp();
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int i = rbase + PASS * r;
        const float kk = ks[i];
        s[r].x += kk * d.x; s[r].y += kk * d.y; s[r].z += kk * d.z; s[r].w += kk * d.w;
        float4 *So = OOP ? S + (p.state_out - p.state) / 4 : S; /* the same offsets in the other buffer */
        __stcs(So + (size_t)i * LD4, s[r]);
    }
    if (w == 0 && sub == 0)
        *reinterpret_cast<float4 *>(p.o + off + j) =
            make_float4(wq.x + qk * d.x, wq.y + qk * d.y, wq.z + qk * d.z, wq.w + qk * d.w);
}

/* OOP: the new state written to another buffer (p.state_out) instead of in place, as
 * flash-linear-attention's fused_recurrent writes its final state: does reading and writing
 * the same lines cost the in-place kernel against a copy? */
template <int T, int COLS, int MINB>
__global__ void __launch_bounds__(T, MINB) dec_oop_kernel(prm p) {
    dec_item<T, COLS, 1, false, false, false, true>(p, blockIdx.x);
}

template <int T, int COLS, int MINB, int PF, bool REV, bool BL = false>
__global__ void __launch_bounds__(T, MINB) dec_kernel(prm p) {
    dec_item<T, COLS, PF, REV, BL>(p, REV ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
}

/* The slice's L2 lines discarded before the in-place stores: see dec_item */
template <int T, int COLS, int MINB>
__global__ void __launch_bounds__(T, MINB) dec_disc_kernel(prm p) {
    dec_item<T, COLS, 1, false, false, false, false, 0, true>(p, blockIdx.x);
}

/* Prefetch ahead (PF 4, 5 with evict_last): see dec_item */
template <int T, int COLS, int MINB, int PF, int AH>
__global__ void __launch_bounds__(T, MINB) dec_ahead_kernel(prm p) {
    dec_item<T, COLS, PF, false, false, false, false, AH>(p, blockIdx.x);
}

/* PDL: the kernel launched with programmatic stream serialization (variant.pdl) and, with W,
 * waiting and triggering as kda_decode_kernel does (after its L2 prefetch) */
template <int T, int COLS, int MINB, bool W>
__global__ void __launch_bounds__(T, MINB) dec_pdl_kernel(prm p) {
    dec_item<T, COLS, 1, false, false, W>(p, blockIdx.x);
}

/* The last TAIL 64-column items as two 32-column items each (a shorter last wave): grid =
 * 2 nh + TAIL blocks, the halves last. */
template <int TAIL>
__global__ void __launch_bounds__(256, 3) dec_tail_kernel(prm p) {
    const int full = 2 * p.nh - TAIL;
    if ((int)blockIdx.x < full) dec_item<256, 64, 1, false, false>(p, blockIdx.x);
    else dec_item<256, 32, 1, false, false>(p, 4 * p.nh - 2 * TAIL + (blockIdx.x - full));
}


/* Persistent and software-pipelined: grid = MINB CTAs a multiprocessor, each walking
 * items blockIdx.x, + gridDim.x, ...; the next item's slice (and its q, k, g, v, beta) is loaded
 * into a second register set before this item's reductions and stores, so a CTA keeps a slice in
 * flight while it computes, and no block launches or drains between items. q, k, e are staged
 * in shared memory by item parity (a barrier of the next item lies between an item's last read
 * of its buffer and the write two items later). */
template <int T, int COLS>
struct dec_in {
    static constexpr int G = COLS / 4, PASS = T / G, R = DK / PASS;
    float4 s[R], v4;
    float b, q, k, g;
};

template <int T, int COLS>
__device__ __forceinline__ void dec_load(const prm &p, int item, dec_in<T, COLS> &in) {
    constexpr int G = COLS / 4, PASS = T / G, R = DK / PASS, SUBS = 32 / G;
    const int nblk = DK / COLS, h = item / nblk, j0 = (item - h * nblk) * COLS;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, c4 = lane % G, sub = lane / G;
    const int j = j0 + 4 * c4, rbase = SUBS * w + sub;
    const float4 *S = reinterpret_cast<const float4 *>(p.state + (size_t)h * DK * DK) + (j >> 2);
#pragma unroll
    for (int r = 0; r < R; r++) in.s[r] = __ldca(S + (size_t)(rbase + PASS * r) * (DK / 4));
    const size_t off = (size_t)h * DK;
    in.v4 = *reinterpret_cast<const float4 *>(p.v + off + j);
    in.b = p.beta[h];
    if (tid < DK) {
        in.q = p.q[off + tid];
        in.k = p.k[off + tid];
        in.g = p.g[off + tid];
    }
}

template <int T, int COLS>
__device__ __forceinline__ void dec_step(const prm &p, int item, dec_in<T, COLS> &in, float *qs, float *ks, float *es,
                                         float4 (*red_u)[COLS / 4], float4 (*red_w)[COLS / 4], float *red_qk) {
    constexpr int G = COLS / 4, PASS = T / G, R = DK / PASS, W = T / 32, SUBS = 32 / G;
    const int nblk = DK / COLS, h = item / nblk, j0 = (item - h * nblk) * COLS;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, c4 = lane % G, sub = lane / G;
    const int j = j0 + 4 * c4, rbase = SUBS * w + sub;
    if (tid < DK) {
        qs[tid] = in.q;
        ks[tid] = in.k;
        es[tid] = expf(in.g);
    }
    __syncthreads();
    float4 u, wq;
    float qk;
    dec_accumulate<R, PASS>(in.s, qs, ks, es, rbase, u, wq, qk);
    dec_reduce<W, G>(u, wq, qk, red_u, red_w, red_qk, lane, w, c4, sub);
    const float b = in.b;
    const float4 d = make_float4(b * (in.v4.x - u.x), b * (in.v4.y - u.y), b * (in.v4.z - u.z), b * (in.v4.w - u.w));
    float4 *S = reinterpret_cast<float4 *>(p.state + (size_t)h * DK * DK) + (j >> 2);
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int i = rbase + PASS * r;
        const float kk = ks[i];
        float4 &x = in.s[r];
        x.x += kk * d.x; x.y += kk * d.y; x.z += kk * d.z; x.w += kk * d.w;
        __stcs(S + (size_t)i * (DK / 4), x);
    }
    if (w == 0 && sub == 0)
        *reinterpret_cast<float4 *>(p.o + (size_t)h * DK + j) =
            make_float4(wq.x + qk * d.x, wq.y + qk * d.y, wq.z + qk * d.z, wq.w + qk * d.w);
}

template <int T, int COLS, int MINB>
__global__ void __launch_bounds__(T, MINB) dec_persist_kernel(prm p) {
    constexpr int G = COLS / 4, W = T / 32;
    __shared__ float qs[2][DK], ks[2][DK], es[2][DK];
    __shared__ float4 red_u[W][G], red_w[W][G];
    __shared__ float red_qk[W];
    const int items = p.nh * (DK / COLS), step = gridDim.x;
    dec_in<T, COLS> a, b;
    int it = blockIdx.x;
    if (it < items) dec_load<T, COLS>(p, it, a);
    for (; it < items; it += 2 * step) {
        if (it + step < items) dec_load<T, COLS>(p, it + step, b);
        dec_step<T, COLS>(p, it, a, qs[0], ks[0], es[0], red_u, red_w, red_qk);
        if (it + step >= items) break;
        if (it + 2 * step < items) dec_load<T, COLS>(p, it + 2 * step, a);
        dec_step<T, COLS>(p, it + step, b, qs[1], ks[1], es[1], red_u, red_w, red_qk);
    }
}

/* Cluster pair: block = (head, row half), all 128 columns, so a block reads 32 KB of contiguous
 * state; the two halves' partial sums meet through distributed shared memory. 128 threads: lane
 * = column group (4 columns), warp w takes rows 64 half + w + 4 r. */
template <int PF>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(128, 5) dec_pair_kernel(prm p) {
    namespace cg = cooperative_groups;
    constexpr int T = 128, W = 4, R = 16;
    cg::cluster_group cl = cg::this_cluster();
    const int h = blockIdx.x >> 1, half = (int)cl.block_rank();
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, j = 4 * lane, r0 = 64 * half + w;
    __shared__ float qs[DK], ks[DK], es[DK];
    __shared__ float4 red_u[W][32], red_w[W][32];
    __shared__ float red_qk[W];
    __shared__ float4 part_u[32], part_w[32];
    __shared__ float part_qk;
    const char *hb = (const char *)(p.state + (size_t)h * DK * DK) + (size_t)half * 32768;
    if (PF == 1)
        for (int e = tid; e < 256; e += T) asm volatile("prefetch.global.L2 [%0];" ::"l"(hb + 128 * e));
    float4 *S = reinterpret_cast<float4 *>(p.state + (size_t)h * DK * DK) + lane;
    float4 s[R];
#pragma unroll
    for (int r = 0; r < R; r++) s[r] = __ldca(S + (size_t)(r0 + 4 * r) * (DK / 4));
    const size_t off = (size_t)h * DK;
    if (tid < DK) {
        qs[tid] = p.q[off + tid];
        ks[tid] = p.k[off + tid];
        es[tid] = expf(p.g[off + tid]);
    }
    __syncthreads();
    float4 u, wq;
    float qk;
    dec_accumulate<R, 4>(s, qs, ks, es, r0, u, wq, qk);
    red_u[w][lane] = u;
    red_w[w][lane] = wq;
    if (lane == 0) red_qk[w] = qk;
    __syncthreads();
    if (w == 0) {
        dec_sum_warps<W, 32>(red_u, red_w, red_qk, lane, u, wq, qk);
        part_u[lane] = u;
        part_w[lane] = wq;
        if (lane == 0) part_qk = qk;
    }
    cl.sync();
    {
        const float4 *pu0 = cl.map_shared_rank(part_u, 0), *pu1 = cl.map_shared_rank(part_u, 1);
        const float4 *pw0 = cl.map_shared_rank(part_w, 0), *pw1 = cl.map_shared_rank(part_w, 1);
        const float a0 = *cl.map_shared_rank(&part_qk, 0), a1 = *cl.map_shared_rank(&part_qk, 1);
        const float4 x0 = pu0[lane], x1 = pu1[lane], y0 = pw0[lane], y1 = pw1[lane];
        u = make_float4(x0.x + x1.x, x0.y + x1.y, x0.z + x1.z, x0.w + x1.w);
        wq = make_float4(y0.x + y1.x, y0.y + y1.y, y0.z + y1.z, y0.w + y1.w);
        qk = a0 + a1;
    }
    const float4 v4 = *reinterpret_cast<const float4 *>(p.v + off + j);
    const float b = p.beta[h];
    const float4 d = make_float4(b * (v4.x - u.x), b * (v4.y - u.y), b * (v4.z - u.z), b * (v4.w - u.w));
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int i = r0 + 4 * r;
        const float kk = ks[i];
        s[r].x += kk * d.x; s[r].y += kk * d.y; s[r].z += kk * d.z; s[r].w += kk * d.w;
        __stcs(S + (size_t)i * (DK / 4), s[r]);
    }
    if (half == 0 && w == 0)
        *reinterpret_cast<float4 *>(p.o + off + j) =
            make_float4(wq.x + qk * d.x, wq.y + qk * d.y, wq.z + qk * d.z, wq.w + qk * d.w);
    cl.sync(); /* the partner may still read our partial sums */
}

/* Staged through shared memory: the block's state slice (DK rows x COLS columns)
 * lands in dynamic shared memory by per-thread 16-byte cp.async (L1 bypassed), so the bytes in
 * flight are bounded by shared memory (6 blocks of 32 KB a multiprocessor) rather than by
 * registers (3 blocks of 32 KB in kda_decode_kernel). Both passes read the slice from shared
 * memory; the arithmetic and its order are the register kernel's, so results match bit for bit.
 * L2H: cp.async's L2::256B prefetch hint. */
template <int T, int COLS, int MINB, bool L2H>
__global__ void __launch_bounds__(T, MINB) dec_smem_kernel(prm p) {
    constexpr int G = COLS / 4, PASS = T / G, R = DK / PASS, W = T / 32, SUBS = 32 / G;
    static_assert(T >= DK, "a thread a row of q, k, g");
    extern __shared__ float4 sst[]; /* [DK][G] */
    const int nblk = DK / COLS, h = blockIdx.x / nblk, j0 = (blockIdx.x - h * nblk) * COLS;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, c4 = lane % G, sub = lane / G;
    const int j = j0 + 4 * c4, rbase = SUBS * w + sub;
    __shared__ float qs[DK], ks[DK], es[DK];
    __shared__ float4 red_u[W][G], red_w[W][G];
    __shared__ float red_qk[W];
    float4 *S = reinterpret_cast<float4 *>(p.state + (size_t)h * DK * DK) + (j0 >> 2);
    /* chunk e = tid + T * n: row e / G = tid / G + PASS * n, column group tid % G */
    unsigned dst = (unsigned)__cvta_generic_to_shared(sst + tid);
    const float4 *src = S + (size_t)(tid / G) * (DK / 4) + tid % G;
#pragma unroll 4
    for (int n = 0; n < R; n++, dst += T * 16, src += PASS * (DK / 4)) {
        if (L2H)
            asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
        else
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    const size_t off = (size_t)h * DK;
    float4 v4;
    float b;
    dec_stage(p, h, j, tid, qs, ks, es, v4, b);
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    float4 u = make_float4(0.f, 0.f, 0.f, 0.f), wq = u;
    float qk = 0.f;
#pragma unroll 8
    for (int r = 0; r < R; r++) {
        const int i = rbase + PASS * r;
        const float e = es[i], kk = ks[i], qq = qs[i];
        float4 t = sst[i * G + c4];
        t.x *= e; t.y *= e; t.z *= e; t.w *= e;
        u.x += kk * t.x; u.y += kk * t.y; u.z += kk * t.z; u.w += kk * t.w;
        wq.x += qq * t.x; wq.y += qq * t.y; wq.z += qq * t.z; wq.w += qq * t.w;
        qk += qq * kk;
    }
    dec_reduce<W, G>(u, wq, qk, red_u, red_w, red_qk, lane, w, c4, sub);
    const float4 d = make_float4(b * (v4.x - u.x), b * (v4.y - u.y), b * (v4.z - u.z), b * (v4.w - u.w));
#pragma unroll 8
    for (int r = 0; r < R; r++) {
        const int i = rbase + PASS * r;
        const float e = es[i], kk = ks[i];
        float4 t = sst[i * G + c4];
        t.x *= e; t.y *= e; t.z *= e; t.w *= e;
        t.x += kk * d.x; t.y += kk * d.y; t.z += kk * d.z; t.w += kk * d.w;
        __stcs(S + (size_t)i * (DK / 4) + c4, t);
    }
    if (w == 0 && sub == 0)
        *reinterpret_cast<float4 *>(p.o + off + j) =
            make_float4(wq.x + qk * d.x, wq.y + qk * d.y, wq.z + qk * d.z, wq.w + qk * d.w);
}

typedef void (*kfn)(prm);
struct variant {
    const char *name;
    kfn k;
    int threads, cols;
    int smem;  /* dynamic shared memory bytes (the staged forms) */
    int extra; /* blocks beyond nh * DK / cols (the tail forms) */
    int pdl;   /* launched with programmatic stream serialization */
    int persist; /* > 0: a persistent grid of persist CTAs a multiprocessor */
};

#define V(T, C, M, PF, RV) {#T "t " #C "c " #M "b pf" #PF " rev" #RV, dec_kernel<T, C, M, PF, RV>, T, C, 0, 0, 0}
#define VB(T, C, M) {#T "t " #C "c " #M "b blocked (timing)", dec_kernel<T, C, M, 1, false, true>, T, C, 0, 0, 0}
#define VA(T, C, M, PF, AH) {#T "t " #C "c " #M "b pf" #PF " ahead " #AH, dec_ahead_kernel<T, C, M, PF, AH>, T, C, 0, 0, 0}
#define VS(T, C, M, H) {"smem " #T "t " #C "c " #M "b l2h" #H, dec_smem_kernel<T, C, M, H>, T, C, DK * C * 4, 0, 0}
static const variant g_var[] = {
    V(256, 64, 3, 1, false), /* kda_decode_kernel's shape (its first row is the others' reference) */
    VB(256, 64, 3),
    VB(128, 64, 5),
    V(256, 64, 3, 0, false),
    V(256, 64, 3, 1, true),
    V(256, 64, 3, 2, false),
    V(256, 64, 3, 3, false),
    V(256, 64, 2, 1, false),
    V(128, 64, 4, 1, false),
    V(128, 64, 5, 1, false),
    VS(128, 64, 6, false),
    VS(128, 64, 6, true),
    VS(256, 64, 6, false),
    VS(256, 64, 6, true),
    VS(128, 32, 10, false),
    VS(128, 32, 10, true),
    V(128, 64, 5, 0, false),
    V(128, 64, 5, 2, false),
    V(128, 64, 5, 3, false),
    V(128, 64, 6, 1, false),
    V(256, 128, 2, 1, false),
    V(512, 128, 1, 1, false),
    V(128, 32, 8, 1, false),
    {"pair 128t 128c pf1", dec_pair_kernel<1>, 128, 64, 0, 0, 0},
    {"pair 128t 128c pf0", dec_pair_kernel<0>, 128, 64, 0, 0, 0},
    {"128t 64c 5b pdl attr", dec_pdl_kernel<128, 64, 5, false>, 128, 64, 0, 0, 1},
    {"128t 64c 5b pdl attr+wait", dec_pdl_kernel<128, 64, 5, true>, 128, 64, 0, 0, 1},
    {"256t 64c 3b pdl attr", dec_pdl_kernel<256, 64, 3, false>, 256, 64, 0, 0, 1},
    {"256t 64c 3b pdl attr+wait", dec_pdl_kernel<256, 64, 3, true>, 256, 64, 0, 0, 1},
    {"tail: last 132 items halved", dec_tail_kernel<132>, 256, 64, 0, 132, 0},
    {"tail: last 264 items halved", dec_tail_kernel<264>, 256, 64, 0, 264, 0},
    {"tail: last 396 items halved", dec_tail_kernel<396>, 256, 64, 0, 396, 0},
    {"tail: last 792 items halved", dec_tail_kernel<792>, 256, 64, 0, 792, 0},
    {"256t 64c 3b out of place", dec_oop_kernel<256, 64, 3>, 256, 64, 0, 0, 0},
    {"128t 64c 5b out of place", dec_oop_kernel<128, 64, 5>, 128, 64, 0, 0, 0},
    VA(256, 64, 3, 4, 132), VA(256, 64, 3, 4, 264), VA(256, 64, 3, 4, 396), VA(256, 64, 3, 4, 792),
    VA(256, 64, 3, 5, 264), VA(256, 64, 3, 5, 396),
    VA(128, 64, 5, 4, 330), VA(128, 64, 5, 4, 660), VA(128, 64, 5, 5, 660),
    {"256t 64c 3b discard", dec_disc_kernel<256, 64, 3>, 256, 64, 0, 0, 0},
    {"128t 64c 5b discard", dec_disc_kernel<128, 64, 5>, 128, 64, 0, 0, 0},
#define VP(T, C, M) {"persistent " #T "t " #C "c " #M "b", dec_persist_kernel<T, C, M>, T, C, 0, 0, 0, M}
    VP(256, 64, 2), VP(128, 32, 4), VP(256, 32, 2), VP(256, 32, 3),
};

static void launch(const variant &va, int grid, cudaStream_t s, prm p) {
    if (!va.pdl) {
        va.k<<<grid, va.threads, va.smem, s>>>(p);
        return;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(va.threads);
    cfg.dynamicSmemBytes = va.smem;
    cfg.stream = s;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, va.k, p));
}

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char **argv) {
    std::vector<int> bs;
    for (int i = 1; i < argc; i++) bs.push_back(atoi(argv[i]));
    if (bs.empty()) bs = {32, 256};
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    int nsm = 0;
    CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
    void *flush, *ca, *cb;
    CK(cudaMalloc(&flush, FLUSH));
    const size_t cbytes = (size_t)2 << 30;
    CK(cudaMalloc(&ca, cbytes));
    CK(cudaMalloc(&cb, cbytes));
    CK(cudaMemsetAsync(ca, 1, cbytes, s));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> cm;
    for (int r = -2; r < 20; r++) {
        CK(cudaEventRecord(e0, s));
        CK(cudaMemcpyAsync(r & 1 ? ca : cb, r & 1 ? cb : ca, cbytes, cudaMemcpyDeviceToDevice, s));
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (r >= 0) cm.push_back(ms);
    }
    const double copy_gbs = 2.0 * cbytes / (median(cm) * 1e-3) / 1e9;
    CK(cudaFree(ca));
    CK(cudaFree(cb));
    printf("copy %.1f GB/s (2 GB cudaMemcpy, read + written)\n", copy_gbs);

    for (int B : bs) {
        const int nh = B * 64;
        const size_t sc = (size_t)nh * DK * DK, cnt = (size_t)nh * DK;
        std::vector<float> hs(sc), hq(cnt), hk(cnt), hv(cnt), hg(cnt), hb(nh);
        srand(1);
        auto U = [] { return (float)rand() / RAND_MAX; };
        for (auto &x : hs) x = U() - 0.5f;
        for (size_t i = 0; i < cnt; i++) {
            hq[i] = (U() - 0.5f) * 0.1f;
            hk[i] = (U() - 0.5f) * 0.1f;
            hv[i] = U() - 0.5f;
            hg[i] = -U();
        }
        for (auto &x : hb) x = U();
        float *st0, *st, *o, *q, *k, *v, *g, *be, *dst;
        CK(cudaMalloc(&st0, sc * 4));
        CK(cudaMalloc(&st, sc * 4));
        CK(cudaMalloc(&dst, sc * 4));
        CK(cudaMalloc(&o, cnt * 4));
        for (float **pp : {&q, &k, &v, &g}) CK(cudaMalloc(pp, cnt * 4));
        CK(cudaMalloc(&be, nh * 4));
        CK(cudaMemcpy(st0, hs.data(), sc * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(q, hq.data(), cnt * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(k, hk.data(), cnt * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(v, hv.data(), cnt * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(g, hg.data(), cnt * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(be, hb.data(), nh * 4, cudaMemcpyHostToDevice));
        float *st2;
        CK(cudaMalloc(&st2, sc * 4));
        const prm p = {o, st, st2, q, k, v, g, be, nh};
        const double bytes = 2.0 * sc * 4;
        std::vector<float> ref_s(sc), ref_o(cnt), got_s(sc), got_o(cnt);
        const int reps = 200;
        /* mode 0: memset flush; 1: back to back (20 calls between events) */
        auto time_it = [&](auto &&call, int mode) {
            for (int i = 0; i < 3; i++) call();
            std::vector<float> ms;
            for (int r = 0; r < (mode ? 30 : reps); r++) {
                if (mode == 0) CK(cudaMemsetAsync(flush, r & 0xff, FLUSH, s));
                CK(cudaEventRecord(e0, s));
                for (int i = 0; i < (mode ? 20 : 1); i++) call();
                CK(cudaEventRecord(e1, s));
                CK(cudaEventSynchronize(e1));
                float t;
                CK(cudaEventElapsedTime(&t, e0, e1));
                ms.push_back(mode ? t / 20 : t);
            }
            return median(ms);
        };
        auto frac = [&](float ms) { return bytes / (ms * 1e-3) / 1e9 / copy_gbs; };
        const float mc = time_it([&] { CK(cudaMemcpyAsync(dst, st0, sc * 4, cudaMemcpyDeviceToDevice, s)); }, 0);
        const float mcs = time_it([&] { CK(cudaMemcpyAsync(dst, st0, sc * 4, cudaMemcpyDeviceToDevice, s)); }, 1);
        printf("B=%d (%.0f MB moved): cudaMemcpy flush %.2f us %.1f%%  back-to-back %.2f us %.1f%%\n", B, bytes / 1e6,
               mc * 1e3, 100 * frac(mc), mcs * 1e3, 100 * frac(mcs));
        for (size_t vi = 0; vi < sizeof g_var / sizeof g_var[0]; vi++) {
            const variant &va = g_var[vi];
            const int grid = va.persist ? nsm * va.persist : nh * (DK / va.cols) + va.extra;
            CK(cudaMemcpy(st, st0, sc * 4, cudaMemcpyDeviceToDevice));
            launch(va, grid, s, p);
            CK(cudaStreamSynchronize(s));
            CK(cudaGetLastError());
            const bool oop = strstr(va.name, "out of place") != NULL;
            CK(cudaMemcpy(got_s.data(), oop ? st2 : st, sc * 4, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(got_o.data(), o, cnt * 4, cudaMemcpyDeviceToHost));
            double es = 0, eo = 0;
            if (vi == 0) {
                ref_s = got_s;
                ref_o = got_o;
            } else {
                for (size_t i = 0; i < sc; i++) es = fmax(es, fabs(got_s[i] - ref_s[i]));
                for (size_t i = 0; i < cnt; i++) eo = fmax(eo, fabs(got_o[i] - ref_o[i]));
            }
            auto call = [&] { launch(va, grid, s, p); };
            cudaFuncAttributes fa;
            CK(cudaFuncGetAttributes(&fa, va.k));
            int occ = 0;
            CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, va.k, va.threads, va.smem));
            const float m0 = time_it(call, 0), m1 = time_it(call, 1);
            printf("  %-26s regs %3d spill %3zu occ %d grid %6d: flush %.2f us %.1f%%  b2b %.2f us %.1f%%  "
                   "maxdiff s %.1e o %.1e\n",
                   va.name, fa.numRegs, fa.localSizeBytes, occ, grid, m0 * 1e3, 100 * frac(m0), m1 * 1e3,
                   100 * frac(m1), es, eo);
        }
        for (float *x : {st0, st, st2, dst, o, q, k, v, g, be}) CK(cudaFree(x));
    }
    return 0;
}
