/* kernels/cuda/cuda_dsa_mla_wg.cu: the sparse MLA attend of prefill on the warpgroup MMA (sm_90a), for
 * kv_lora 512 and heads in groups of 64 (the real model's shape; cuda_dsa.cu plans the pass and
 * keeps mla_attend_tc_kernel for the other shapes). Same function as mla_attend_tc_kernel: per
 * query row i, 64 heads and a split of its selected latent rows, the scores s = qa . lat, an online
 * softmax, and (max, sum, acc) per split or, with one split, acc / sum as the output GEMM's bf16
 * rows ((hi | lo) with two parts, hi with one).
 *
 * A cluster of two CTAs takes (row i, 64 heads, split); CTA r owns latent columns [256 r, 256 r
 * + 256). In a CTA two warpgroups take the tiles of 32 selected rows in turn (tile tt to warpgroup
 * tt % 2, each with its own softmax state and output, merged at the end), so one's softmax and
 * exchange run while the other's products do. Per tile, in its warpgroup:
 *   S_r[64 h, 32 rows] = QA[:, cols_r] Lat[rows, cols_r]^T   (wgmma, both operands in shared memory)
 *   S = S_0 + S_1: each CTA's warpgroup stores its partial into the same warpgroup's buffer in the
 *     other CTA (st.async, completing on that buffer's mbarrier; 16 values a thread in the
 *     accumulator layout, so thread t adds thread t's)
 *   online softmax per head in registers; P [64 h, 32 rows] stays in registers as the A operand of
 *   O_r[64 h, 256] += P Lat[rows, cols_r]                    (wgmma, the same staged tile read MN-major)
 * so the two CTAs hold identical P (a + b == b + a) and never exchange the output. Why a pair: with
 * the two-part split every operand doubles, and one CTA holding the query (64 x 512 x hi/lo = 128
 * KB) and a 32-row tile (64 KB) in flight has no room left for a pipeline; half the width each
 * leaves room for 4 stages.
 *
 * With one part a tile may be 64 selected rows instead of 32 (mt_cuda_params.mla_attend_rows; the
 * template's R): the scores one N = 64 product a k-step, P four k-steps of 16; the stage's lo
 * rows, unused with one part, hold rows 32 .. 63, and each exchange, softmax and turn at the
 * tensor cores serves twice the products. The partial scores double to 16 KB a buffer, laid out
 * [float4][thread] so that a quarter-warp's accesses spread over the banks: warpgroup 0's two
 * live in the query's unused lo part, warpgroup 1's in xs.
 *
 * Precision (the template's TERMS = p.terms): with two parts, as mla_attend_tc_kernel, every fp32
 * operand x = hi + lo (bf16 each), products as hi*hi + hi*lo + lo*hi with fp32 accumulation: per
 * k step of the scores one wgmma of N = 64 takes Qhi against the tile's hi and lo rows (they lie
 * one after the other), one of N = 32 Qlo against the hi rows (the query, the A operand, is read
 * from shared memory once per wgmma: the wider one halves that traffic, which bounds this kernel
 * with the B operands). With one part (the backend's single rounding) only the hi parts are
 * staged and multiplied: Qhi . hi for the scores, Phi . hi for the output, in the same layout
 * (the lo halves of the query and of each stage stay unused).
 *
 * Shared memory of a CTA (1024-byte aligned parts; 16-byte units of a 128-byte row swizzled by
 * row % 8, the layout cu_wg_desc describes):
 *   q     [2 (hi, lo)][4 chunks of 64 columns][64 heads][128 B]         64 KB
 *   tile  [MW_STAGES][4 chunks][2 (hi, lo)][32 rows][128 B]             32 KB a stage (tile tt in
 *                                                                        stage tt % 4)
 *   xs    [2 warpgroups][2][128 threads][16] fp32: the peer's partials  32 KB
 *   full  [2 warpgroups][2] mbarriers of xs
 * (the stages hold the second warpgroup's output for the merge at the end). */
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include <type_traits>

#include "kernels/cuda/cuda_dsa_mla.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_wgmma.h"

enum {
    MW_KVL = 512,
    MW_HEADS = 64,
    MW_COLS = 256, /* latent columns per CTA */
    MW_R = 32,     /* selected rows per tile (= MLAT_R: splits are whole tiles of it) */
    MW_STAGES = 4,
    MW_WG = 2,     /* consumer warpgroups */
    MW_THREADS = 128 * MW_WG,
    MW_Q_PART = 4 * MW_HEADS * 128,  /* 32 KB: one bf16 part of the query slice */
    MW_T_CHUNK = 2 * MW_R * 128,     /* 8 KB: a 64-column chunk of a tile, hi rows then lo rows */
    MW_T_STAGE = 4 * MW_T_CHUNK,     /* 32 KB */
    MW_X_BUF = 128 * 16 * 4,         /* 8 KB: one warpgroup's partial scores */
    MW_SMEM = 2 * MW_Q_PART + MW_STAGES * MW_T_STAGE + MW_WG * 2 * MW_X_BUF + MW_WG * 2 * 8 + 1024 /* alignment */,
};

/* Turns at the tensor cores: warpgroup wg waits for its turn (barrier 3 + wg: its 128 threads and
 * the other warpgroup's arrival), issues its products, and hands the turn over. */
static __device__ __forceinline__ void mw_turn_wait(int wg) {
    if (wg == 0) asm volatile("bar.sync 3, 256;\n" ::: "memory");
    else asm volatile("bar.sync 4, 256;\n" ::: "memory");
}
static __device__ __forceinline__ void mw_turn_pass(int wg) {
    if (wg == 0) asm volatile("bar.arrive 4, 256;\n" ::: "memory");
    else asm volatile("bar.arrive 3, 256;\n" ::: "memory");
}
/* The 128 threads of warpgroup wg (named barrier 1 + wg). */
static __device__ __forceinline__ void mw_wg_sync(int wg) {
    if (wg == 0) asm volatile("bar.sync 1, 128;\n" ::: "memory");
    else asm volatile("bar.sync 2, 128;\n" ::: "memory");
}

/* Positions of the rows thread wt of a warpgroup stages for selected entries s .. s+rows-1 (rows
 * wt / 32 + 4 k): loaded a step before the copies, so the copies do not wait on them. */
template <int R>
static __device__ __forceinline__ void mw_positions(int (&pos)[R / 4], const int32_t *srow, int m, int s, int rows,
                                                    int wt) {
#pragma unroll
    for (int k = 0; k < R / 4; k++) {
        const int r = (wt >> 5) + 4 * k;
        pos[k] = r < rows ? (m > 0 ? __ldg(srow + s + r) : s + r) : -1;
    }
}

/* cp.async of this CTA's 256 columns (from c0) of the split latent rows at pos into a stage; rows
 * without a position are zeroed instead (P is 0 there, and 0 times stale data may be NaN). Thread
 * wt copies 16-byte unit wt % 32 (chunk u / 8) of rows wt / 32 + 4 k of both parts. */
template <int TERMS, int R>
static __device__ __forceinline__ void mw_stage(uint8_t *dst, const __nv_bfloat16 *lat16, const int (&pos)[R / 4],
                                                int c0, int wt) {
    const int u = wt & 31;
#pragma unroll
    for (int k = 0; k < R / 4; k++) {
        const int r = (wt >> 5) + 4 * k;
        uint8_t *d = dst + (u >> 3) * MW_T_CHUNK + r * 128 + (((u & 7) ^ (r & 7)) << 4);
        if (pos[k] >= 0) {
            const __nv_bfloat16 *src = lat16 + (size_t)pos[k] * TERMS * MW_KVL + c0 + 8 * u;
            cu_cp_async16(d, src);
            if (TERMS == 2) cu_cp_async16(d + MW_R * 128, src + MW_KVL);
        } else {
            *(uint4 *)d = make_uint4(0u, 0u, 0u, 0u);
            if (TERMS == 2) *(uint4 *)(d + MW_R * 128) = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

template <int TERMS, int R>
static __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(MW_THREADS, 1)
    mla_attend_wg_kernel(const mla_dev_params p) {
    static_assert(R == MW_R || (TERMS == 1 && R == 2 * MW_R), "64-row tiles take the lo rows of one part");
    extern __shared__ uint8_t mw_smem_raw[];
    uint8_t *sm = (uint8_t *)(((uintptr_t)mw_smem_raw + 1023) & ~(uintptr_t)1023);
    uint8_t *qs = sm, *tiles = sm + 2 * MW_Q_PART;
    float *xs = (float *)(tiles + MW_STAGES * MW_T_STAGE);          /* [wg][2][128][16] */
    uint64_t *full = (uint64_t *)((uint8_t *)xs + MW_WG * 2 * MW_X_BUF); /* [wg][2] */

    const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127, lane = tid & 31, w = wt >> 5, g = lane >> 2,
              q4 = lane & 3;
    const unsigned rank = cu_cluster_rank(), peer = rank ^ 1u;
    const int i = blockIdx.x >> 1, h0 = blockIdx.y * MW_HEADS, split = blockIdx.z, c0 = (int)rank * MW_COLS;
    /* R tile rows (64: the stage's unused lo rows hold rows 32 .. 63); S: score entries a thread;
     * XB: bytes of one warpgroup's partial scores */
    constexpr int S = R / 2, XB = 128 * S * 4;
    const int t = p.t0 + i, m = p.nsel[i];
    const int cnt = m > 0 ? m : t + 1;
    int rps = (cnt + p.nsplit - 1) / p.nsplit; /* rows per split, whole tiles (as the other kernels) */
    rps = (rps + R - 1) / R * R;
    const int sb = split * rps, se = sb + rps < cnt ? sb + rps : cnt;
    const int ntiles = sb < se ? (se - sb + R - 1) / R : 0;
    const int32_t *srow = p.sel + (size_t)i * p.max_sel;
    auto tile_rows = [&](int tt) { return se - (sb + tt * R) < R ? se - (sb + tt * R) : R; };

    if (tid == 0) { /* armed for the peer's first two partials of each warpgroup */
        for (int b = 0; b < MW_WG * 2; b++) {
            cu_mbar_init(&full[b], 1);
            cu_mbar_arrive_tx(&full[b], XB);
        }
        cu_mbar_init_fence();
    }
    /* warpgroup wg's first two tiles (wg, wg + 2), one group each, empty or not; pn: the positions
     * of its first refill (tile wg + 4) */
    int pn[R / 4];
#pragma unroll
    for (int j = 0; j < 3; j++) {
        const int tt = wg + 2 * j;
        if (tt < ntiles) mw_positions<R>(pn, srow, m, sb + tt * R, tile_rows(tt), wt);
        if (j < 2) {
            if (tt < ntiles) mw_stage<TERMS, R>(tiles + (tt % MW_STAGES) * MW_T_STAGE, p.lat16, pn, c0, wt);
            cu_cp_async_commit();
        }
    }
    /* this CTA's query slice, split: thread t takes float4 e = t + 256 k of [64 heads][64 float4] */
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
            if (TERMS == 2) *(uint2 *)(qs + MW_Q_PART + off) = lo;
        }
    }
    cu_proxy_fence_async();
    cu_cluster_sync(); /* the query slice written; the barriers armed; the peer CTA running */

    /* this warpgroup's two buffers; with one part 16 KB each: warpgroup 0's in the query's unused lo
     * part, warpgroup 1's in xs */
    float *xw = R > MW_R ? (wg == 0 ? (float *)(qs + MW_Q_PART) : xs) : xs + wg * 2 * (MW_X_BUF / 4);
    uint64_t *fw = full + wg * 2;
    /* XT: a buffer laid out [float4 v][thread] (a thread's 8 float4 of 64-row scores side by side
     * would put a quarter-warp's accesses on 4 banks); 32-row ones [thread][v] */
    constexpr bool XT = R > MW_R;
    const uint32_t peer_xs = cu_cluster_map(xw + wt * (XT ? 4 : S), peer), peer_full = cu_cluster_map(fw, peer);
    const float sl2 = p.scale * 1.4426950408889634f;
    /* rows r0 = 16 w + g (accumulator entries x with x & 2 == 0) and r1 = r0 + 8 of the 64 heads */
    float m_run0 = -INFINITY, m_run1 = -INFINITY, l_run0 = 0.f, l_run1 = 0.f;
    float o[2 * MW_COLS / 4];
#pragma unroll
    for (int x = 0; x < 2 * MW_COLS / 4; x++) o[x] = 0.f;

    /* This warpgroup's tiles tt = wg, wg + 2, ..., compiled apart for rows with selected positions
     * (SC: scores) and rows whose empty selection attends every position with equal weight (no
     * scores, no exchange), so no wgmma accumulator is merged across a branch (ptxas would then
     * serialize the wgmmas). */
    auto run = [&](auto sc_tag) {
        constexpr bool SC = decltype(sc_tag)::value;
        /* Tiles tt = wg, wg + 2, .. (step u = tt / 2). The products go out in blocks, each in
         * this warpgroup's turn at the tensor cores: P Lat of tile tt - 2 and the scores of tile
         * tt. The turns alternate between the warpgroups (with two tiles at least), so one's
         * exchange and softmax run while the other's products do. */
        const bool turns = ntiles >= 2;
        /* two parts: lo*hi in s, hi*hi in s2[0..15] and hi*lo in s2[16..31] (the same entries); one
         * part: hi*hi in s (s2 unused) */
        float s[S], s2[TERMS == 2 ? 32 : 1];
        auto issue_scores = [&](int tt, int u) {
            /* groups so far: tiles wg, wg + 2, then one a step (the refill of tile tt + 2 at
             * step u >= 1): tile tt is the newest from step 2 on */
            if (u < 2) cu_cp_async_wait<1>();
            else cu_cp_async_wait<0>();
            cu_proxy_fence_async(); /* this thread's copies and zero rows, for the async proxy */
            mw_wg_sync(wg);         /* everybody's */
            if (SC) { /* the partial scores over this CTA's columns */
                const uint8_t *lt = tiles + (tt % MW_STAGES) * MW_T_STAGE;
                /* (no register fence on s: the first product overwrites it) */
                cu_wg_fence();
#pragma unroll
                for (int c = 0; c < 4; c++)
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        const uint8_t *qh = qs + c * (MW_HEADS * 128) + 32 * j, *tb = lt + c * MW_T_CHUNK + 32 * j;
                        if (TERMS == 2) {
                            cu_wgmma_bf16<64>(s2, cu_wg_desc(qh), cu_wg_desc(tb), c | j);            /* hi (hi | lo) */
                            cu_wgmma_bf16<32>(s, cu_wg_desc(qh + MW_Q_PART), cu_wg_desc(tb), c | j); /* lo hi */
                        } else {
                            cu_wgmma_bf16<R>(s, cu_wg_desc(qh), cu_wg_desc(tb), c | j); /* hi hi */
                        }
                    }
                cu_wg_commit();
            }
        };
        if (turns && wg == 1) mw_turn_pass(1); /* warpgroup 0 goes first */
        if (turns) mw_turn_wait(wg);
        for (int tt = wg, u = 0; tt < ntiles; tt += 2, u++) {
            const int rows = tile_rows(tt);
            const uint8_t *lt = tiles + (tt % MW_STAGES) * MW_T_STAGE;
            issue_scores(tt, u); /* in the turn that issued P Lat of tile tt - 2 */
            if (turns) mw_turn_pass(wg);
            cu_wg_wait<0>(); /* the scores, and P Lat of this warpgroup's last tile */
#pragma unroll
            for (int x = 0; x < S; x++) cu_wg_reg_fence(s[x]);
#pragma unroll
            for (int x = 0; x < (TERMS == 2 ? 32 : 0); x++) cu_wg_reg_fence(s2[x]);
#pragma unroll
            for (int x = 0; x < 2 * MW_COLS / 4; x++) cu_wg_reg_fence(o[x]);
            float sc[S];
#pragma unroll
            for (int x = 0; x < S; x++) sc[x] = !SC ? 0.f : TERMS == 2 ? s2[x] + s2[x + 16] + s[x] : s[x];
            /* S = own + the peer's partial: the peer's warpgroup wg stores into xw[u % 2] here
             * and this one into the peer's. A buffer is written again two steps later, after the
             * peer has the partial of the step between, which this side stores only after reading
             * the buffer (each thread its own entries). */
            const int xb = u & 1;
            if (SC) {
                const uint32_t dst = peer_xs + (uint32_t)(xb * XB);
#pragma unroll
                for (int v = 0; v < S / 4; v++)
                    cu_cluster_st_async4(dst + (XT ? 16 * 128 : 16) * v,
                                         make_float4(sc[4 * v], sc[4 * v + 1], sc[4 * v + 2], sc[4 * v + 3]),
                                         peer_full + 8 * xb);
            }
            /* refill: tile tt + 2 into the stage of tile tt - 2 (its P Lat, this warpgroup's, is
             * done: a wgmma completes for the whole warpgroup, so this thread's wait above covers
             * every warp's reads), then the positions of tile tt + 4 */
            if (u >= 1 && tt + 2 < ntiles) {
                mw_stage<TERMS, R>(tiles + ((tt + 2) % MW_STAGES) * MW_T_STAGE, p.lat16, pn, c0, wt);
                if (tt + 4 < ntiles) mw_positions<R>(pn, srow, m, sb + (tt + 4) * R, tile_rows(tt + 4), wt);
            }
            cu_cp_async_commit();
            if (SC) {
                cu_mbar_wait_cluster(&fw[xb], (unsigned)(u >> 1) & 1u);
                if (wt == 0) cu_mbar_arrive_tx(&fw[xb], XB); /* armed for step u + 2 */
                const float4 *src =
                    XT ? (const float4 *)(xw + xb * (XB / 4)) + wt : (const float4 *)(xw + (xb * 128 + wt) * S);
#pragma unroll
                for (int v = 0; v < S / 4; v++) {
                    const float4 a = src[XT ? 128 * v : v];
                    sc[4 * v] += a.x;
                    sc[4 * v + 1] += a.y;
                    sc[4 * v + 2] += a.z;
                    sc[4 * v + 3] += a.w;
                }
            }

            /* online softmax in log2 units; column (tile row) of entry x: 8 (x / 4) + 2 q4 + x % 2 */
            float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
            for (int x = 0; x < S; x++) {
                const int col = 8 * (x >> 2) + 2 * q4 + (x & 1);
                sc[x] = col < rows ? sc[x] * sl2 : -INFINITY;
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
            for (int x = 0; x < S; x++) {
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
            uint32_t ph[R / 16][4], pl[TERMS == 2 ? R / 16 : 1][4]; /* P's A fragments, tile rows 16 kk .. + 15 */
#pragma unroll
            for (int kk = 0; kk < R / 16; kk++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    cu_split_bf16x2(sc[8 * kk + 2 * j], sc[8 * kk + 2 * j + 1], &ph[kk][j], &pl[TERMS == 2 ? kk : 0][j]);
                    cu_wg_reg_fence_u(ph[kk][j]); /* made before the fence below, not sunk past it */
                    if constexpr (TERMS == 2) cu_wg_reg_fence_u(pl[kk][j]);
                }
#pragma unroll
            for (int x = 0; x < 2 * MW_COLS / 4; x++) cu_wg_reg_fence(o[x]);
            if (turns) mw_turn_wait(wg);
            cu_wg_fence();
#pragma unroll
            for (int kk = 0; kk < R / 16; kk++) {
                const uint64_t bh = cu_wg_desc_mn(lt + kk * 16 * 128, MW_T_CHUNK);
                if constexpr (TERMS == 2) {
                    const uint64_t bl = cu_wg_desc_mn(lt + MW_R * 128 + kk * 16 * 128, MW_T_CHUNK);
                    cu_wgmma_bf16_ra256_mn(o, pl[kk], bh);
                    cu_wgmma_bf16_ra256_mn(o, ph[kk], bl);
                }
                cu_wgmma_bf16_ra256_mn(o, ph[kk], bh);
            }
            cu_wg_commit();
        }
        if (turns) mw_turn_pass(wg);
        /* every turn handed over was taken: one is left over for warpgroup 0 when the tiles are
         * even in number, for warpgroup 1 when odd */
        if (turns && wg == (ntiles & 1)) mw_turn_wait(wg);
        cu_wg_wait<0>();
#pragma unroll
        for (int x = 0; x < 2 * MW_COLS / 4; x++) cu_wg_reg_fence(o[x]);
    };
    if (m > 0) run(std::true_type{});
    else run(std::false_type{});

    /* The two warpgroups' (max, sum, acc) into one, through the stages (free now): warpgroup 1
     * stores, warpgroup 0 merges and writes the output. [x][thread] so a store is conflict-free. */
    __syncthreads(); /* both warpgroups past their last tile */
    float *mo = (float *)tiles;
    if (wg == 1) {
#pragma unroll
        for (int x = 0; x < 2 * MW_COLS / 4; x++) mo[x * 128 + wt] = o[x];
        mo[128 * 128 + wt] = m_run0;
        mo[129 * 128 + wt] = m_run1;
        mo[130 * 128 + wt] = l_run0;
        mo[131 * 128 + wt] = l_run1;
    }
    __syncthreads();
    if (wg == 0) {
        const float mb0 = mo[128 * 128 + wt], mb1 = mo[129 * 128 + wt];
        const float M0 = fmaxf(m_run0, mb0), M1 = fmaxf(m_run1, mb1);
        /* both empty (an empty split): -inf, and nothing to scale */
        const float fa0 = M0 == -INFINITY ? 0.f : exp2f(m_run0 - M0), fb0 = M0 == -INFINITY ? 0.f : exp2f(mb0 - M0);
        const float fa1 = M1 == -INFINITY ? 0.f : exp2f(m_run1 - M1), fb1 = M1 == -INFINITY ? 0.f : exp2f(mb1 - M1);
        l_run0 = l_run0 * fa0 + mo[130 * 128 + wt] * fb0;
        l_run1 = l_run1 * fa1 + mo[131 * 128 + wt] * fb1;
        m_run0 = M0;
        m_run1 = M1;
#pragma unroll
        for (int x = 0; x < 2 * MW_COLS / 4; x++)
            o[x] = (x & 2) ? o[x] * fa1 + mo[x * 128 + wt] * fb1 : o[x] * fa0 + mo[x * 128 + wt] * fb0;

        /* entry x of o: head h0 + r0 (x & 2 == 0) or r1, column c0 + 8 (x / 4) + 2 q4 + x % 2 */
        const int r0 = 16 * w + g;
        if (p.o16) { /* one split (l_run > 0: a split has at least one row): acc / l as (hi[ | lo]) rows */
            const float inv0 = 1.f / l_run0, inv1 = 1.f / l_run1;
#pragma unroll
            for (int x = 0; x < 2 * MW_COLS / 4; x += 2) {
                const int hh = h0 + r0 + ((x & 2) ? 8 : 0), c = c0 + 8 * (x >> 2) + 2 * q4;
                const float inv = (x & 2) ? inv1 : inv0;
                __nv_bfloat16 *oh = p.o16 + ((size_t)i * p.Hq + hh) * TERMS * MW_KVL + c;
                uint32_t hi, lo;
                cu_split_bf16x2(o[x] * inv, o[x + 1] * inv, &hi, &lo);
                *(uint32_t *)oh = hi;
                if (TERMS == 2) *(uint32_t *)(oh + MW_KVL) = lo;
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
    }
    cu_cluster_sync(); /* the peer's stores into this CTA's shared memory all landed before it exits */
}

size_t mla_wg_smem_bytes(void) { return MW_SMEM; }

cudaError_t mla_wg_opt_in(void) {
    const auto attr = [](auto k) { return cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, MW_SMEM); };
    cudaError_t e = attr(mla_attend_wg_kernel<2, MW_R>);
    if (e == cudaSuccess) e = attr(mla_attend_wg_kernel<1, MW_R>);
    return e == cudaSuccess ? attr(mla_attend_wg_kernel<1, 2 * MW_R>) : e;
}

void mla_wg_launch(const mla_dev_params *b, int rows, cudaStream_t s) {
    const dim3 grid(2 * (unsigned)b->nb, (unsigned)(b->Hq / MW_HEADS), (unsigned)b->nsplit);
    if (b->terms == 2) mla_attend_wg_kernel<2, MW_R><<<grid, MW_THREADS, MW_SMEM, s>>>(*b);
    else if (rows == 2 * MW_R) mla_attend_wg_kernel<1, 2 * MW_R><<<grid, MW_THREADS, MW_SMEM, s>>>(*b);
    else mla_attend_wg_kernel<1, MW_R><<<grid, MW_THREADS, MW_SMEM, s>>>(*b);
}
