/* kernels/cuda/cuda_mla_wg.cu: the sparse MLA attend of prefill on the warpgroup MMA (sm_90a), for
 * kv_lora 512 and heads in groups of 64 (the real model's shape; cuda_dsa.cu plans the pass and
 * keeps mla_attend_tc_kernel for the other shapes). Same function as mla_attend_tc_kernel: per
 * query row i, 64 heads and a split of its selected latent rows, the scores s = qa . lat, an online
 * softmax, and (max, sum, acc) per split or, with one split, acc / sum as the output GEMM's bf16
 * (hi | lo) rows.
 *
 * A cluster of two CTAs takes (row i, 64 heads, split); CTA r owns latent columns [256 r, 256 r
 * + 256). One warpgroup a CTA, per tile of 32 selected rows:
 *   S_r[64 h, 32 rows] = QA[:, cols_r] Lat[rows, cols_r]^T   (wgmma, both operands in shared memory)
 *   S = S_0 + S_1: each CTA stores its partial into the other's shared memory and arrives on the
 *     other's mbarrier (16 values a thread, in the accumulator layout, so thread t adds thread t's)
 *   online softmax per head in registers; P [64 h, 32 rows] stays in registers as the A operand of
 *   O_r[64 h, 256] += P Lat[rows, cols_r]                    (wgmma, the same staged tile read MN-major)
 * so the two CTAs hold identical P (a + b == b + a) and never exchange the output. Why a pair: with
 * the two-part split every operand doubles, and one CTA holding the query (64 x 512 x hi/lo = 128
 * KB) and a 32-row tile (64 KB) in flight has no room left for a pipeline; half the width each
 * leaves room for 4 stages.
 *
 * Precision as mla_attend_tc_kernel: every fp32 operand x = hi + lo (bf16 each), products as
 * hi*hi + hi*lo + lo*hi with fp32 accumulation. The scores' Qhi Lhi and Qhi Llo are one wgmma with
 * N = 64 (the tile's hi and lo rows lie one after the other), Qlo Lhi another with N = 32.
 *
 * Shared memory of a CTA (1024-byte aligned parts; 16-byte units of a 128-byte row swizzled by
 * row % 8, the layout cu_wg_desc describes):
 *   q     [2 (hi, lo)][4 chunks of 64 columns][64 heads][128 B]         64 KB
 *   tile  [MW_STAGES][4 chunks][2 (hi, lo)][32 rows][128 B]             32 KB a stage
 *   xs    [2][128 threads][16] fp32: the partial scores the peer sent   16 KB */
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "kernels/cuda/cuda_mla.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_wgmma.h"

enum {
    MW_KVL = 512,
    MW_HEADS = 64,
    MW_COLS = 256, /* latent columns per CTA */
    MW_R = 32,     /* selected rows per tile (= MLAT_R: splits are whole tiles of it) */
    MW_STAGES = 4,
    MW_THREADS = 128,
    MW_Q_PART = 4 * MW_HEADS * 128,      /* 32 KB: one bf16 part of the query slice */
    MW_T_CHUNK = 2 * MW_R * 128,         /* 8 KB: a 64-column chunk of a tile, hi rows then lo rows */
    MW_T_STAGE = 4 * MW_T_CHUNK,         /* 32 KB */
    MW_X_BYTES = 2 * MW_THREADS * 16 * 4, /* 16 KB */
    MW_SMEM = 2 * MW_Q_PART + MW_STAGES * MW_T_STAGE + MW_X_BYTES + 2 * 8 + 1024 /* alignment */,
};

static __device__ __forceinline__ void mw_cp16(void *s, const void *g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(cu_smem_addr(s)), "l"(g) : "memory");
}
static __device__ __forceinline__ void mw_commit(void) { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> static __device__ __forceinline__ void mw_wait(void) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
static __device__ __forceinline__ void mw_proxy_fence(void) {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* cp.async of this CTA's 256 columns (from c0) of the split rows of selected entries s .. s+rows-1
 * into a stage; rows past `rows` are zeroed instead (P is 0 there, and 0 times stale data may be
 * NaN). Thread t copies 16-byte unit t % 32 (chunk u / 8) of rows t / 32, t / 32 + 4, .. of both
 * parts. */
static __device__ __forceinline__ void mw_stage(uint8_t *dst, const __nv_bfloat16 *lat16, const int32_t *srow, int m,
                                                int s, int rows, int c0, int tid) {
    const int u = tid & 31;
#pragma unroll
    for (int k = 0; k < MW_R / 4; k++) {
        const int r = (tid >> 5) + 4 * k;
        uint8_t *d = dst + (u >> 3) * MW_T_CHUNK + r * 128 + (((u & 7) ^ (r & 7)) << 4);
        if (r < rows) {
            const int pos = m > 0 ? srow[s + r] : s + r;
            const __nv_bfloat16 *src = lat16 + (size_t)pos * 2 * MW_KVL + c0 + 8 * u;
            mw_cp16(d, src);
            mw_cp16(d + MW_R * 128, src + MW_KVL);
        } else {
            *(uint4 *)d = make_uint4(0u, 0u, 0u, 0u);
            *(uint4 *)(d + MW_R * 128) = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

template <bool PIPE, int XCH>
static __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(MW_THREADS, 1)
    mla_attend_wg_kernel(const mla_dev_params p) {
    extern __shared__ uint8_t mw_smem_raw[];
    uint8_t *sm = (uint8_t *)(((uintptr_t)mw_smem_raw + 1023) & ~(uintptr_t)1023);
    uint8_t *qs = sm, *tiles = sm + 2 * MW_Q_PART;
    float *xs = (float *)(tiles + MW_STAGES * MW_T_STAGE);
    uint64_t *full = (uint64_t *)(xs + 2 * MW_THREADS * 16); /* [2] (XCH 1) */

    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, q4 = lane & 3;
    const unsigned rank = cu_cluster_rank(), peer = rank ^ 1u;
    const int i = blockIdx.x >> 1, h0 = blockIdx.y * MW_HEADS, split = blockIdx.z, c0 = (int)rank * MW_COLS;
    const int t = p.t0 + i, m = p.nsel[i];
    const int cnt = m > 0 ? m : t + 1;
    int rps = (cnt + p.nsplit - 1) / p.nsplit; /* rows per split, whole tiles (as the other kernels) */
    rps = (rps + MW_R - 1) / MW_R * MW_R;
    const int sb = split * rps, se = sb + rps < cnt ? sb + rps : cnt;
    const int ntiles = sb < se ? (se - sb + MW_R - 1) / MW_R : 0;
    const int32_t *srow = p.sel + (size_t)i * p.max_sel;

    if (XCH == 1 && tid == 0) { /* armed for the peer's first two partials */
        for (int b = 0; b < 2; b++) {
            cu_mbar_init(&full[b], 1);
            cu_mbar_arrive_tx(&full[b], MW_THREADS * 16 * 4);
        }
        cu_mbar_init_fence();
    }
#pragma unroll
    for (int st = 0; st < MW_STAGES - 1; st++) { /* one group each, empty or not */
        if (st < ntiles) {
            const int s0 = sb + st * MW_R;
            mw_stage(tiles + st * MW_T_STAGE, p.lat16, srow, m, s0, se - s0 < MW_R ? se - s0 : MW_R, c0, tid);
        }
        mw_commit();
    }
    /* this CTA's query slice, split: thread t takes float4 e = t + 128 k of [64 heads][64 float4] */
    {
        const float *qsrc = p.qa + ((size_t)i * p.Hq + h0) * MW_KVL + c0;
#pragma unroll 4
        for (int k = 0; k < MW_HEADS * 64 / MW_THREADS; k++) {
            const int e = tid + MW_THREADS * k, hh = e >> 6, f4 = e & 63;
            const float4 v = *(const float4 *)(qsrc + (size_t)hh * MW_KVL + 4 * f4);
            uint2 hi, lo;
            cu_split_bf16x2(v.x, v.y, &hi.x, &lo.x);
            cu_split_bf16x2(v.z, v.w, &hi.y, &lo.y);
            const int off = (f4 >> 4) * (MW_HEADS * 128) + hh * 128 + ((((f4 & 15) >> 1) ^ (hh & 7)) << 4) + (f4 & 1) * 8;
            *(uint2 *)(qs + off) = hi;
            *(uint2 *)(qs + MW_Q_PART + off) = lo;
        }
    }
    mw_proxy_fence();
    cu_cluster_sync(); /* the query slice written; the peer CTA running before any remote store */

    const uint32_t peer_xs = cu_cluster_map(xs + tid * 16, peer); /* + buffer * MW_THREADS * 16 * 4 */
    const uint32_t peer_full = cu_cluster_map(full, peer);
    const float sl2 = p.scale * 1.4426950408889634f;
    /* rows r0 = 16 w + g (accumulator entries x with x & 2 == 0) and r1 = r0 + 8 of the 64 heads */
    float m_run0 = -INFINITY, m_run1 = -INFINITY, l_run0 = 0.f, l_run1 = 0.f;
    float o[2 * MW_COLS / 4];
#pragma unroll
    for (int x = 0; x < 2 * MW_COLS / 4; x++) o[x] = 0.f;

    /* The tile loop, compiled apart for rows with selected positions (SC: scores) and rows whose
     * empty selection attends every position with equal weight (no scores, no exchange), so no
     * wgmma accumulator is ever merged across a branch (ptxas would serialize the wgmmas). */
    auto run = [&](auto sc_tag) {
        constexpr bool SC = decltype(sc_tag)::value;
        /* This CTA's partial scores of tile tt (hi*hi + hi*lo + lo*hi over its 256 columns) into s,
         * asynchronously (one wgmma group); tile tt's stage must have landed for every thread. */
        auto issue_scores = [&](int tt, float(&s)[16]) {
            const uint8_t *lt = tiles + (tt % MW_STAGES) * MW_T_STAGE;
            if (SC) {
    #pragma unroll
                for (int x = 0; x < 16; x++) cu_wg_reg_fence(s[x]);
                cu_wg_fence();
    #pragma unroll
                for (int c = 0; c < 4; c++)
    #pragma unroll
                    for (int j = 0; j < 4; j++) {
                        const uint8_t *qh = qs + c * (MW_HEADS * 128) + 32 * j, *tb = lt + c * MW_T_CHUNK + 32 * j;
                        cu_wgmma_bf16_32(s, cu_wg_desc(qh + MW_Q_PART), cu_wg_desc(tb), c | j); /* lo hi */
                        cu_wgmma_bf16<32>(s, cu_wg_desc(qh), cu_wg_desc(tb + MW_R * 128));      /* hi lo */
                        cu_wgmma_bf16<32>(s, cu_wg_desc(qh), cu_wg_desc(tb));                   /* hi hi */
                    }
                cu_wg_commit();
            }
        };
        /* Tile tt, whose scores are in flight into sc: issue tile tt + 1's into sn (they run while
         * this tile's scores cross to the peer and its softmax runs), then P Lat into o. Groups in
         * order: S(tt), PV(tt - 1), S(tt + 1), PV(tt). */
        auto step = [&](int tt, float(&sacc)[16], float(&sn)[16]) {
            const int s0 = sb + tt * MW_R, rows = se - s0 < MW_R ? se - s0 : MW_R;
            const uint8_t *lt = tiles + (tt % MW_STAGES) * MW_T_STAGE;
            const bool more = tt + 1 < ntiles;
            if (!PIPE) {
                mw_wait<MW_STAGES - 2>(); /* this thread's copies of tile tt landed */
                mw_proxy_fence();
                __syncthreads();
                if (SC) issue_scores(tt, sacc);
                cu_wg_wait<0>();
            } else if (more) {
                mw_wait<MW_STAGES - 3>(); /* this thread's copies of tile tt + 1 landed */
                mw_proxy_fence();         /* ... and its zero rows, for the async proxy */
                __syncthreads();          /* everybody's */
                if (SC) {
                    issue_scores(tt + 1, sn);
                    cu_wg_wait<1>(); /* S(tt) and PV(tt - 1) */
                } else {
                    cu_wg_wait<0>(); /* PV(tt - 1) */
                }
            } else {
                cu_wg_wait<0>();
            }
    #pragma unroll
            for (int x = 0; x < 16; x++) cu_wg_reg_fence(sacc[x]);
            /* worked on in a copy: only the wgmmas define their accumulators (ptxas serializes
             * them otherwise, S(tt + 1) being in flight) */
            float sc[16];
    #pragma unroll
            for (int x = 0; x < 16; x++) sc[x] = sacc[x];
    #pragma unroll
            for (int x = 0; x < 2 * MW_COLS / 4; x++) cu_wg_reg_fence(o[x]);
            /* S = own + the peer's partial. Each side stores its partial into the other's xs[tt % 2]
             * and meets it at the cluster barrier; the refill (into the stage PV(tt - 1) read) goes
             * out in between. xs[b] is written again two tiles later, after the next barrier, which
             * the peer reaches only after reading it. */
            const int xb = tt & 1;
            if (SC) {
                const uint32_t dst = peer_xs + (uint32_t)(xb * MW_THREADS * 16 * 4);
    #pragma unroll
                for (int v = 0; v < 4; v++) {
                    const float4 f = make_float4(sc[4 * v], sc[4 * v + 1], sc[4 * v + 2], sc[4 * v + 3]);
                    if (XCH == 1) cu_cluster_st_async4(dst + 16 * v, f, peer_full + 8 * xb);
                    else cu_cluster_st4(dst + 16 * v, f);
                }
                if (XCH == 0) cu_cluster_arrive_all();
            }
            if (tt + MW_STAGES - 1 < ntiles) {
                const int nt = tt + MW_STAGES - 1, n0 = sb + nt * MW_R;
                mw_stage(tiles + (nt % MW_STAGES) * MW_T_STAGE, p.lat16, srow, m, n0, se - n0 < MW_R ? se - n0 : MW_R, c0,
                         tid);
            }
            mw_commit();
            if (SC) {
                if (XCH == 1) {
                    cu_mbar_wait_cluster(&full[xb], (unsigned)(tt >> 1) & 1u);
                    if (tid == 0) cu_mbar_arrive_tx(&full[xb], MW_THREADS * 16 * 4); /* for tile tt + 2 */
                } else {
                    cu_cluster_wait_all();
                }
                const float4 *src = (const float4 *)(xs + (xb * MW_THREADS + tid) * 16);
    #pragma unroll
                for (int v = 0; v < 4; v++) {
                    const float4 a = src[v];
                    sc[4 * v] += a.x;
                    sc[4 * v + 1] += a.y;
                    sc[4 * v + 2] += a.z;
                    sc[4 * v + 3] += a.w;
                }
            }

            /* online softmax in log2 units; column (tile row) of entry x: 8 (x / 4) + 2 q4 + x % 2 */
            float mx0 = -INFINITY, mx1 = -INFINITY;
    #pragma unroll
            for (int x = 0; x < 16; x++) {
                const int col = 8 * (x >> 2) + 2 * q4 + (x & 1);
                sc[x] = col < rows ? (SC ? sc[x] * sl2 : 0.f) : -INFINITY;
                if (x & 2) mx1 = fmaxf(mx1, sc[x]);
                else mx0 = fmaxf(mx0, sc[x]);
            }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            const float mn0 = fmaxf(m_run0, mx0), mn1 = fmaxf(m_run1, mx1); /* finite: a tile has a row */
            float sum0 = 0.f, sum1 = 0.f;
    #pragma unroll
            for (int x = 0; x < 16; x++) {
                sc[x] = exp2f(sc[x] - ((x & 2) ? mn1 : mn0));
                if (x & 2) sum1 += sc[x];
                else sum0 += sc[x];
            }
            sum0 += __shfl_xor_sync(0xffffffffu, sum0, 1);
            sum0 += __shfl_xor_sync(0xffffffffu, sum0, 2);
            sum1 += __shfl_xor_sync(0xffffffffu, sum1, 1);
            sum1 += __shfl_xor_sync(0xffffffffu, sum1, 2);
            const float corr0 = exp2f(m_run0 - mn0), corr1 = exp2f(m_run1 - mn1); /* 0 on the first tile */
            l_run0 = l_run0 * corr0 + sum0;
            l_run1 = l_run1 * corr1 + sum1;
            m_run0 = mn0;
            m_run1 = mn1;
    #pragma unroll
            for (int x = 0; x < 2 * MW_COLS / 4; x++) o[x] *= (x & 2) ? corr1 : corr0;
            uint32_t ph[2][4], pl[2][4]; /* P's A fragments for tile rows 16 kk .. 16 kk + 15 */
    #pragma unroll
            for (int kk = 0; kk < 2; kk++)
    #pragma unroll
                for (int j = 0; j < 4; j++) {
                    cu_split_bf16x2(sc[8 * kk + 2 * j], sc[8 * kk + 2 * j + 1], &ph[kk][j], &pl[kk][j]);
                    cu_wg_reg_fence_u(ph[kk][j]); /* made before the fence below, not sunk past it */
                    cu_wg_reg_fence_u(pl[kk][j]);
                }
    #pragma unroll
            for (int x = 0; x < 2 * MW_COLS / 4; x++) cu_wg_reg_fence(o[x]);
            cu_wg_fence();
    #pragma unroll
            for (int kk = 0; kk < 2; kk++) {
                const uint64_t bh = cu_wg_desc_mn(lt + kk * 16 * 128, MW_T_CHUNK),
                               bl = cu_wg_desc_mn(lt + MW_R * 128 + kk * 16 * 128, MW_T_CHUNK);
                cu_wgmma_bf16_ra256_mn(o, pl[kk], bh);
                cu_wgmma_bf16_ra256_mn(o, ph[kk], bl);
                cu_wgmma_bf16_ra256_mn(o, ph[kk], bh);
            }
            cu_wg_commit();
        };

        float sa[16], sbuf[16];
        if (PIPE && ntiles > 0) {
            mw_wait<MW_STAGES - 2>(); /* tile 0 */
            mw_proxy_fence();
            __syncthreads();
            if (SC) issue_scores(0, sa);
        }
        for (int tt = 0; tt < ntiles; tt += 2) { /* two tiles a trip: the score sets swap by name */
            step(tt, sa, sbuf);
            if (tt + 1 < ntiles) step(tt + 1, sbuf, sa);
        }
    };
    if (m > 0) run(std::true_type{});
    else run(std::false_type{});
    cu_wg_wait<0>();
#pragma unroll
    for (int x = 0; x < 2 * MW_COLS / 4; x++) cu_wg_reg_fence(o[x]);

    /* entry x of o: head h0 + r0 (x & 2 == 0) or r1, column c0 + 8 (x / 4) + 2 q4 + x % 2 */
    const int r0 = 16 * w + g;
    if (p.o16) { /* one split (l_run > 0: a split has at least one row): acc / l as (hi | lo) rows */
        const float inv0 = 1.f / l_run0, inv1 = 1.f / l_run1;
#pragma unroll
        for (int x = 0; x < 2 * MW_COLS / 4; x += 2) {
            const int hh = h0 + r0 + ((x & 2) ? 8 : 0), c = c0 + 8 * (x >> 2) + 2 * q4;
            const float inv = (x & 2) ? inv1 : inv0;
            __nv_bfloat16 *oh = p.o16 + ((size_t)i * p.Hq + hh) * 2 * MW_KVL + c;
            cu_split_bf16x2(o[x] * inv, o[x + 1] * inv, (uint32_t *)oh, (uint32_t *)(oh + MW_KVL));
        }
    } else { /* this split's (max, sum, acc), the max in natural-log units; empty: (-inf, 0, 0) */
        const size_t hstride = (size_t)p.nsplit * (MW_KVL + 2);
        float *dst = p.part + (((size_t)i * p.Hq + h0) * p.nsplit + split) * (MW_KVL + 2);
#pragma unroll
        for (int x = 0; x < 2 * MW_COLS / 4; x += 2) {
            const int hh = r0 + ((x & 2) ? 8 : 0), c = 2 + c0 + 8 * (x >> 2) + 2 * q4;
            *(float2 *)(dst + hh * hstride + c) = make_float2(o[x], o[x + 1]);
        }
        if (rank == 0 && q4 == 0) {
            dst[r0 * hstride] = m_run0 * 0.6931471805599453f;
            dst[r0 * hstride + 1] = l_run0;
            dst[(r0 + 8) * hstride] = m_run1 * 0.6931471805599453f;
            dst[(r0 + 8) * hstride + 1] = l_run1;
        }
    }
    cu_cluster_sync(); /* neither CTA leaves while the other may still be at a cluster barrier */
}

bool mla_wg_usable(const mla_dev_params *p) {
    return p->kvl == MW_KVL && p->Hq % MW_HEADS == 0 && p->lat16 && cu_aligned16(p->qa);
}

size_t mla_wg_smem_bytes(void) { return MW_SMEM; }

cudaError_t mla_wg_opt_in(void) {
    cudaError_t e = cudaSuccess;
    if (e == cudaSuccess) e = cudaFuncSetAttribute(mla_attend_wg_kernel<false, 0>, cudaFuncAttributeMaxDynamicSharedMemorySize, MW_SMEM);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(mla_attend_wg_kernel<false, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize, MW_SMEM);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(mla_attend_wg_kernel<true, 0>, cudaFuncAttributeMaxDynamicSharedMemorySize, MW_SMEM);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(mla_attend_wg_kernel<true, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize, MW_SMEM);
    return e;
}

void mla_wg_launch(const mla_dev_params *b, cudaStream_t s) {
    const dim3 grid(2 * (unsigned)b->nb, (unsigned)(b->Hq / MW_HEADS), (unsigned)b->nsplit);
    static int mode = -1; /* TEMPORARY A/B switch MT_MLA_WG = "PX" (P pipelined, X exchange) */
    if (mode < 0) {
        const char *e = getenv("MT_MLA_WG");
        mode = e && strlen(e) == 2 ? (e[0] - '0') * 2 + (e[1] - '0') : 3;
    }
    switch (mode) {
    case 0: mla_attend_wg_kernel<false, 0><<<grid, MW_THREADS, MW_SMEM, s>>>(*b); break;
    case 1: mla_attend_wg_kernel<false, 1><<<grid, MW_THREADS, MW_SMEM, s>>>(*b); break;
    case 2: mla_attend_wg_kernel<true, 0><<<grid, MW_THREADS, MW_SMEM, s>>>(*b); break;
    default: mla_attend_wg_kernel<true, 1><<<grid, MW_THREADS, MW_SMEM, s>>>(*b); break;
    }
}
