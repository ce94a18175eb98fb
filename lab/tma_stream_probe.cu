/* lab/tma_stream_probe.cu: how fast TMA can stream the wgmma MoE kernel's weight boxes
 * (kernels/cuda/cuda_moe_wg.cu) from DRAM, with the products taken out. Taken apart, the
 * gate/up launch apart: its weight stream alone, with the MMAs, is as slow as the whole launch, and
 * DRAM ran at 60% of the copy rate there (docs/PERF.md). The question
 * here: is it the boxes' layout (64 rows of 128 bytes, 8 KB apart, as a row-major [rows, 4096]
 * bf16 weight gives them) or the consumer's pace?
 *
 * Persistent: a CTA a multiprocessor, one producer thread filling a ring of 4 stages of 32 KB (4
 * boxes of 64 rows x 64 K, as gate/up's), one consumer warp that waits for each stage and then
 * spins `delay` SM cycles (standing in for the MMAs: ~700 ns, ~1300 cycles, a stage at 128 token
 * rows) before giving it back. Tiles walk (expert, 256 weight rows, K) in the MoE plan's order; `share` tiles in a row
 * read the same boxes (an expert's chunks of token rows: 2 at 4096 tokens), so they meet in L2.
 * Layouts: row-major (a 2-D map over [rows, 4096]) or tiled ([K / 64][rows][64], each box one
 * contiguous 8 KB, through a 3-D map). Timed with events, median of 5; the GB/s count every byte
 * the ring receives and, apart, the distinct bytes (what DRAM must supply at least).
 *   nvcc -arch=sm_90a -I. lab/tma_stream_probe.cu -o tma_stream_probe; tma_stream_probe [experts]   (default 64) */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

#include "kernels/cuda/cuda_wgmma.h"
#include "lab/probe_check.h"

enum { K = 4096, ROWS = 4096 /* gate and up of one expert, 2048 each */, BK = 64, BOX = 64 * BK * 2,
       STAGES = 4, STAGE = 4 * BOX, TILE_ROWS = 256 };

struct params {
    const CUtensorMap *maps; /* [experts] */
    int experts, share, tiled;
    long long delay; /* consumer cycles a stage */
};

static __device__ __forceinline__ void tma_3d(void *dst, const void *map, uint64_t *bar, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
                 "[%5];\n" ::"r"(cu_smem_addr(dst)),
                 "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(cu_smem_addr(bar))
                 : "memory");
}

__global__ void __launch_bounds__(64, 1) stream_kernel(const params p) {
    extern __shared__ uint8_t smem_raw[];
    uint8_t *sm = (uint8_t *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    uint64_t *full = (uint64_t *)(sm + STAGES * STAGE), *empty = full + STAGES;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            cu_mbar_init(&full[s], 1);
            cu_mbar_init(&empty[s], 1);
        }
        cu_mbar_init_fence();
    }
    __syncthreads();
    const int ntiles = p.experts * (ROWS / TILE_ROWS) * p.share, kb_n = K / BK;
    if (threadIdx.x == 0) { /* producer */
        int it = 0;
        for (int ti = blockIdx.x; ti < ntiles; ti += gridDim.x) {
            const int e = ti / ((ROWS / TILE_ROWS) * p.share), r0 = (ti / p.share) % (ROWS / TILE_ROWS) * TILE_ROWS;
            const CUtensorMap *map = p.maps + e;
            for (int kb = 0; kb < kb_n; kb++, it++) {
                const int s = it % STAGES;
                if (it >= STAGES) cu_mbar_wait(&empty[s], (unsigned)(it / STAGES - 1) & 1u);
                cu_mbar_arrive_tx(&full[s], STAGE);
                for (int b = 0; b < 4; b++) {
                    uint8_t *dst = sm + s * STAGE + b * BOX;
                    if (p.tiled) tma_3d(dst, map, &full[s], 0, r0 + 64 * b, kb);
                    else cu_tma_load_2d(dst, map, &full[s], kb * BK, r0 + 64 * b);
                }
            }
        }
    } else if (threadIdx.x == 32) { /* consumer */
        int it = 0;
        for (int ti = blockIdx.x; ti < ntiles; ti += gridDim.x)
            for (int kb = 0; kb < kb_n; kb++, it++) {
                const int s = it % STAGES;
                cu_mbar_wait(&full[s], (unsigned)(it / STAGES) & 1u);
                if (p.delay > 0) { /* SM cycles (%globaltimer ticks too coarsely for this) */
                    const long long t0 = clock64();
                    while (clock64() - t0 < p.delay) {
                    }
                }
                cu_mbar_arrive(&empty[s]);
            }
    }
}

static PFN_cuTensorMapEncodeTiled_v12000 encode_fn(void) {
    void *f = NULL;
    cudaDriverEntryPointQueryResult q;
    CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess) {
        fprintf(stderr, "no cuTensorMapEncodeTiled\n");
        exit(1);
    }
    return (PFN_cuTensorMapEncodeTiled_v12000)f;
}

int main(int argc, char **argv) {
    const int experts = argc > 1 ? atoi(argv[1]) : 64;
    const size_t per = (size_t)ROWS * K * 2;
    uint8_t *w;
    CK(cudaMalloc(&w, per * experts));
    CK(cudaMemset(w, 1, per * experts));
    PFN_cuTensorMapEncodeTiled_v12000 enc = encode_fn();
    std::vector<CUtensorMap> rm(experts), tl(experts);
    for (int e = 0; e < experts; e++) {
        void *base = w + per * e;
        const cuuint64_t d2[2] = {K, ROWS}, s2[1] = {(cuuint64_t)K * 2};
        const cuuint32_t b2[2] = {BK, 64}, e2[2] = {1, 1};
        const cuuint64_t d3[3] = {BK, ROWS, K / BK}, s3[2] = {BK * 2, (cuuint64_t)ROWS * BK * 2};
        const cuuint32_t b3[3] = {BK, 64, 1}, e3[3] = {1, 1, 1};
        if (enc(&rm[e], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, d2, s2, b2, e2, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) !=
                CUDA_SUCCESS ||
            enc(&tl[e], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, base, d3, s3, b3, e3, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) !=
                CUDA_SUCCESS) {
            fprintf(stderr, "tensor map encode failed\n");
            return 1;
        }
    }
    CUtensorMap *d_rm, *d_tl;
    CK(cudaMalloc(&d_rm, sizeof(CUtensorMap) * experts));
    CK(cudaMalloc(&d_tl, sizeof(CUtensorMap) * experts));
    CK(cudaMemcpy(d_rm, rm.data(), sizeof(CUtensorMap) * experts, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_tl, tl.data(), sizeof(CUtensorMap) * experts, cudaMemcpyHostToDevice));
    const int smem = STAGES * STAGE + 1024 + 2 * STAGES * 8;
    CK(cudaFuncSetAttribute(stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    int dev = 0, sms = 0;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    printf("tma_stream_probe: %d experts x %d rows x %d K bf16 = %.2f GB; %d CTAs, 4 stages of 32 KB\n", experts, ROWS,
           K, per * experts / 1e9, sms);
    printf("| layout | share | consumer cycles a stage | ms | received GB/s | distinct GB/s | stage ns (at %d CTAs) |\n", sms);
    printf("|---|---:|---:|---:|---:|---:|---:|\n");
    for (int delay : {0, 1300, 1800})
        for (int share : {1, 2})
            for (int tiled : {0, 1}) {
                const params p = {tiled ? d_tl : d_rm, experts, share, tiled, delay};
                std::vector<float> ms;
                for (int r = 0; r < 6; r++) {
                    CK(cudaMemset(w, r, 1 << 20)); /* touch nothing relevant; keeps the reps alike */
                    CK(cudaEventRecord(e0));
                    stream_kernel<<<sms, 64, smem>>>(p);
                    CK(cudaEventRecord(e1));
                    CK(cudaEventSynchronize(e1));
                    CK(cudaGetLastError());
                    float t;
                    CK(cudaEventElapsedTime(&t, e0, e1));
                    if (r > 0) ms.push_back(t);
                }
                std::sort(ms.begin(), ms.end());
                const double t = ms[ms.size() / 2];
                const double distinct = (double)per * experts, received = distinct * share;
                const double stages = received / STAGE;
                printf("| %s | %d | %d | %.3f | %.0f | %.0f | %.0f |\n", tiled ? "tiled (8 KB boxes)" : "row-major",
                       share, delay, t, received / (t * 1e-3) / 1e9, distinct / (t * 1e-3) / 1e9,
                       t * 1e6 / (stages / sms));
            }
    return 0;
}
