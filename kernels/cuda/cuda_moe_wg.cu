/* kernels/cuda/cuda_moe_wg.cu: the routed experts' GEMMs of a prefill on Hopper's warpgroup MMA,
 * fed by TMA (the batched cuBLAS GEMMs of cuda_moe.cu did the same work at ~60% of the tensor
 * pipe: each padded size class a call, each call its own last wave, every part written as fp32
 * and summed by a separate pass). Owner: the CUDA backend; cuda_moe.cu calls it.
 *
 * The rows: x split into bf16 hi and lo parts, interleaved (x16 [2P, K]: pair q's hi at row 2q,
 * lo at 2q + 1, the pairs sorted by expert, expert e's at [2 start[e], 2 start[e + 1])), so that
 * both parts of a pair meet in one thread's accumulators (adjacent columns below).
 *
 * One CTA per tile (expert e, 128 weight rows from n0, up to 256 of e's x16 rows from row0):
 *   D^T [128 weight rows, N token rows] = W[rows, K] . x16[rows, K]^T
 * the weight rows as wgmma's M (two consumer warpgroups of 64), the token rows as its N (a
 * multiple of 16 from 16 to 256, so an expert's rows need no padding beyond 16), K in stages of
 * 64 through a 4-deep ring of shared memory that a producer warpgroup fills by TMA.
 *   gate/up (down = 0): the first warpgroup's 64 rows are gate rows n0.., the second's the up
 *     rows n0..; the epilogue sums each pair's two parts (hi + lo, as moe_swiglu_split_kernel),
 *     applies swiglu and writes h as bf16 hi/lo rows into out [2P, I].
 *   down (down = 1): rows n0 .. n0+127 of down; the epilogue writes each pair's hi + lo sum as
 *     one fp32 row of out [P, H] (the combine then reads one row a pair).
 * The epilogue passes the accumulators through shared memory so that each warp writes
 * contiguous runs of a row. Deterministic: fixed tiles, no atomics. */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_wgmma.h"

enum {
    WG_BK = 64,                              /* K a stage: one 128-byte swizzled row of bf16 */
    WG_BW = 128,                             /* weight rows a tile (2 warpgroups of 64) */
    WG_NMAX = 256,                           /* token rows a tile (wgmma N) */
    WG_STAGES = 4,
    WG_A_BYTES = WG_BW * 2 * WG_BK,          /* 16 KB: [2][64 rows][64] */
    WG_B_BYTES = WG_NMAX * 2 * WG_BK,        /* 32 KB */
    WG_STAGE_BYTES = WG_A_BYTES + WG_B_BYTES,
    WG_SLD = WG_BW + 4,                      /* epilogue row stride in floats: conflict-free */
    WG_THREADS = 384,                        /* producer + 2 consumer warpgroups */
    WG_SMEM = WG_STAGES * WG_STAGE_BYTES + 1024 /* alignment */ + 2 * WG_STAGES * 8 /* barriers */,
};
static_assert(WG_NMAX * WG_SLD * 4 <= WG_STAGES * WG_STAGE_BYTES, "epilogue staging fits the ring");

typedef struct moe_wg_xmaps {
    CUtensorMap m[4]; /* x16 with boxes of 32, 64, 128, 256 rows: the smallest that covers N */
} moe_wg_xmaps;

typedef struct moe_wg_params {
    const CUtensorMap *wmaps; /* [E][3] gate, up, down (cu_moe_wg_maps) */
    const int4 *tiles;        /* [grid] (expert, n0, row0, rows): rows even, <= WG_NMAX */
    void *out;
    int ldo;                  /* out's row stride: I (gate/up) or H (down) */
    int kblocks;              /* K / WG_BK */
    int down;
    float L;                  /* swiglu limit */
} moe_wg_params;

/* The consumer warpgroup c's main loop at N token rows, then its accumulators into the
 * epilogue's staging S [token row][WG_SLD] (columns 64 c ..). */
template <int N>
static __device__ __forceinline__ void moe_wg_consume(uint8_t *sm, uint64_t *full, uint64_t *empty, int kblocks,
                                                      int c, float *S) {
    float d[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; i++) d[i] = 0.f;
    for (int kb = 0; kb < kblocks; kb++) {
        const int s = kb % WG_STAGES;
        cu_mbar_wait(&full[s], (unsigned)(kb / WG_STAGES) & 1u);
        const uint8_t *a = sm + s * WG_STAGE_BYTES + c * (WG_A_BYTES / 2), *b = sm + s * WG_STAGE_BYTES + WG_A_BYTES;
#pragma unroll
        for (int i = 0; i < N / 2; i++) cu_wg_reg_fence(d[i]);
        cu_wg_fence();
#pragma unroll
        for (int k = 0; k < WG_BK / 16; k++) cu_wgmma_bf16<N>(d, cu_wg_desc(a + 32 * k), cu_wg_desc(b + 32 * k));
        cu_wg_commit();
#pragma unroll
        for (int i = 0; i < N / 2; i++) cu_wg_reg_fence(d[i]);
        cu_wg_wait<1>(); /* the previous stage's MMAs are done: give it back */
        if (kb > 0 && (threadIdx.x & 127) == 0) cu_mbar_arrive(&empty[(kb - 1) % WG_STAGES]);
    }
    cu_wg_wait<0>();
#pragma unroll
    for (int i = 0; i < N / 2; i++) cu_wg_reg_fence(d[i]);
    /* every consumer is past its last read of the ring before it becomes S */
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
    const int lane = threadIdx.x & 31, w0 = 64 * c + 16 * ((threadIdx.x >> 5) & 3) + (lane >> 2);
#pragma unroll
    for (int i = 0; i < N / 2; i++) {
        const int w = w0 + 8 * ((i >> 1) & 1), tok = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
        S[tok * WG_SLD + w] = d[i];
    }
}

static __global__ void __launch_bounds__(WG_THREADS, 1)
    moe_wg_kernel(const __grid_constant__ moe_wg_xmaps xm, const moe_wg_params p) {
    extern __shared__ uint8_t wg_smem_raw[];
    uint8_t *sm = (uint8_t *)(((uintptr_t)wg_smem_raw + 1023) & ~(uintptr_t)1023);
    uint64_t *full = (uint64_t *)(sm + WG_STAGES * WG_STAGE_BYTES), *empty = full + WG_STAGES;
    const int4 tile = p.tiles[blockIdx.x];
    const int e = tile.x, n0 = tile.y, row0 = tile.z, rows = tile.w;
    const int nt = (rows + 15) >> 4; /* N / 16 */
    const int box = nt <= 2 ? 0 : nt <= 4 ? 1 : nt <= 8 ? 2 : 3;
    const int wg = threadIdx.x >> 7;
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
        if (threadIdx.x == 0) {
            const CUtensorMap *wa = p.wmaps + 3 * e + (p.down ? 2 : 0), *wb = p.wmaps + 3 * e + (p.down ? 2 : 1);
            const int ra = n0, rb = p.down ? n0 + WG_BW / 2 : n0;
            const CUtensorMap *xmap = &xm.m[box];
            const unsigned bytes = WG_A_BYTES + (32u << box) * 2 * WG_BK;
            for (int kb = 0; kb < p.kblocks; kb++) {
                const int s = kb % WG_STAGES;
                if (kb >= WG_STAGES) cu_mbar_wait(&empty[s], (unsigned)(kb / WG_STAGES - 1) & 1u);
                uint8_t *st = sm + s * WG_STAGE_BYTES;
                cu_mbar_arrive_tx(&full[s], bytes);
                cu_tma_load_2d(st, wa, &full[s], kb * WG_BK, ra);
                cu_tma_load_2d(st + WG_A_BYTES / 2, wb, &full[s], kb * WG_BK, rb);
                cu_tma_load_2d(st + WG_A_BYTES, xmap, &full[s], kb * WG_BK, row0);
            }
        }
        return; /* the consumers synchronise among themselves from here on (barrier 1) */
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int c = wg - 1;
    float *S = (float *)sm;
    switch (nt) {
#define WG_CASE(k) \
    case k: moe_wg_consume<16 * k>(sm, full, empty, p.kblocks, c, S); break;
        WG_CASE(1) WG_CASE(2) WG_CASE(3) WG_CASE(4) WG_CASE(5) WG_CASE(6) WG_CASE(7) WG_CASE(8)
        WG_CASE(9) WG_CASE(10) WG_CASE(11) WG_CASE(12) WG_CASE(13) WG_CASE(14) WG_CASE(15) WG_CASE(16)
#undef WG_CASE
    default: break;
    }
    asm volatile("bar.sync 1, 256;\n" ::: "memory");

    const int t = threadIdx.x - 128, pairs = rows >> 1;
    if (!p.down) { /* column w of gate (S[.][w]) and of up (S[.][64 + w]) */
        const int w = t & 63;
        for (int q = t >> 6; q < pairs; q += 4) {
            const float *s0 = S + 2 * q * WG_SLD + w, *s1 = s0 + WG_SLD;
            const float a = __fadd_rn(s0[0], s1[0]), b = __fadd_rn(s0[64], s1[64]);
            const float g = fminf(a, p.L), u = fminf(fmaxf(b, -p.L), p.L);
            const float h = g / (1.f + expf(-g)) * u;
            uint16_t *o = (uint16_t *)p.out + (size_t)(row0 + 2 * q) * p.ldo + n0 + w;
            o[0] = cu_bits16<MT_BF16>(h);
            o[p.ldo] = cu_bits16<MT_BF16>(h - cu_round16<MT_BF16>(h));
        }
    } else {
        const int w = t & 127;
        for (int q = t >> 7; q < pairs; q += 2) {
            const float *s0 = S + 2 * q * WG_SLD + w;
            ((float *)p.out)[(size_t)((row0 >> 1) + q) * p.ldo + n0 + w] = __fadd_rn(s0[0], s0[WG_SLD]);
        }
    }
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

/* A 2-D bf16 [rows, cols] row-major tensor, boxes of {WG_BK, box_rows}, 128-byte swizzle. */
static bool wg_encode(CUtensorMap *m, const void *base, int64_t rows, int64_t cols, int box_rows) {
    PFN_cuTensorMapEncodeTiled_v12000 fn = wg_encode_fn();
    if (!fn) return false;
    const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
    const cuuint64_t strides[1] = {(cuuint64_t)cols * 2};
    const cuuint32_t box[2] = {WG_BK, (cuuint32_t)box_rows}, estr[2] = {1, 1};
    return fn(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)base, dims, strides, box, estr,
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
    return cb->moe_wg && cb->tc_terms == 2 && dt == MT_BF16 && arch == 90 && H % WG_BW == 0 &&
           I % (WG_BW / 2) == 0 && wg_encode_fn() != NULL;
}

extern "C" mt_status cu_moe_wg_maps(const mt_expert *ex, int count, int cap, void **dev, cudaStream_t s) {
    CUtensorMap *h = (CUtensorMap *)malloc(sizeof(CUtensorMap) * 3 * (size_t)count);
    if (!h) return MT_ERR_NOMEM;
    for (int e = 0; e < count; e++) {
        const mt_weight *w[3] = {&ex[e].gate, &ex[e].up, &ex[e].down};
        for (int j = 0; j < 3; j++)
            if (!wg_encode(&h[3 * e + j], w[j]->data, w[j]->rows, w[j]->cols, WG_BW / 2)) {
                free(h);
                mt_log(MT_LOG_ERROR, "cuda backend: moe_experts: cuTensorMapEncodeTiled failed (expert %d)", e);
                return MT_ERR_BACKEND;
            }
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

extern "C" mt_status cu_moe_wg_gemm(const void *wmaps, const int32_t *tiles, int ntiles, const void *x16,
                                    int64_t xrows, int K, void *out, int ldo, bool down, float L, cudaStream_t s) {
    if (ntiles == 0) return MT_OK;
    static const bool attr = [] {
        return cudaFuncSetAttribute(moe_wg_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, WG_SMEM) ==
               cudaSuccess;
    }();
    if (!attr) {
        mt_log(MT_LOG_ERROR, "cuda backend: moe_experts: the wgmma kernel's %d bytes of shared memory refused",
               (int)WG_SMEM);
        return MT_ERR_BACKEND;
    }
    moe_wg_xmaps xm;
    for (int b = 0; b < 4; b++)
        if (!wg_encode(&xm.m[b], x16, xrows, K, 32 << b)) {
            mt_log(MT_LOG_ERROR, "cuda backend: moe_experts: cuTensorMapEncodeTiled failed (rows)");
            return MT_ERR_BACKEND;
        }
    const moe_wg_params p = {(const CUtensorMap *)wmaps, (const int4 *)tiles, out, ldo, K / WG_BK, down ? 1 : 0, L};
    moe_wg_kernel<<<(unsigned)ntiles, WG_THREADS, WG_SMEM, s>>>(xm, p);
    MT_CUDA_CHECK_LAUNCH();
    return MT_OK;
}
