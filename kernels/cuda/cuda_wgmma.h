/* kernels/cuda/cuda_wgmma.h: Hopper (sm_90a) primitives for the kernels that fill shared memory
 * with the copy engine and feed the warpgroup MMA: mbarriers, bulk and tensor (TMA) loads,
 * shared-memory matrix descriptors, cluster primitives, and wgmma.mma_async for bf16 x bf16 ->
 * fp32 with both operands in shared memory (and one form with A in registers). Owner: the CUDA
 * backend (users: cuda_moe_wg.cu, cuda_kda_chunk.cu, cuda_dsa_mla_wg.cu).
 *
 * Operand layout: a tile of rows x 64 bf16 as a TMA box {64, rows} with CU_TENSOR_MAP_SWIZZLE_128B
 * writes it: row r at byte 128 r, its 16-byte chunk c at chunk c ^ (r % 8); 8-row groups 1024 bytes
 * apart; the tile 1024-byte aligned. Read K-major (cu_wg_desc), the k16 step j of such a tile
 * starts 32 j bytes in; read MN-major (cu_wg_desc_mn), the tile's rows are K, step j 2048 j bytes in.
 *
 * Accumulators of cu_wgmma_bf16<N> (m64nNk16, 128 threads): thread t of the warpgroup holds
 * d[i], i < N / 2, at row 16 (t / 32) + (t % 32) / 4 + 8 ((i / 2) % 2), column
 * 8 (i / 4) + 2 (t % 4) + i % 2, for N = 16 .. 256 in steps of 16. */
#ifndef MT_CUDA_WGMMA_H
#define MT_CUDA_WGMMA_H

#include <stdint.h>

static __device__ __forceinline__ uint32_t cu_smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* ---- mbarriers (shared memory, 8 bytes each) ---- */
static __device__ __forceinline__ void cu_mbar_init(uint64_t *bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(cu_smem_addr(bar)), "r"(count) : "memory");
}
/* Makes the inits visible to the async proxy (TMA) and to the cluster's other CTAs (their st.async
 * and copies complete on these barriers) before first use. */
static __device__ __forceinline__ void cu_mbar_init_fence(void) {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
static __device__ __forceinline__ void cu_mbar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(cu_smem_addr(bar)) : "memory");
}
/* One arrival that also expects `bytes` of TMA transfers before the phase completes. */
static __device__ __forceinline__ void cu_mbar_arrive_tx(uint64_t *bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(cu_smem_addr(bar)), "r"(bytes)
                 : "memory");
}
/* Waits until the phase of parity `parity` has completed. */
static __device__ __forceinline__ void cu_mbar_wait(uint64_t *bar, unsigned parity) {
    asm volatile("{\n.reg .pred done;\n"
                 "WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT;\n}\n" ::"r"(cu_smem_addr(bar)),
                 "r"(parity)
                 : "memory");
}

/* Orders this thread's earlier generic writes of shared memory before later async-proxy reads
 * (wgmma operands, bulk copies). */
static __device__ __forceinline__ void cu_proxy_fence_async(void) {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* ---- bulk copy of `bytes` (a multiple of 16, both ends 16-byte aligned) from global memory,
 * completing on bar. The fence orders this thread's earlier generic accesses of shared memory
 * before the copy's writes. ---- */
static __device__ __forceinline__ void cu_bulk_load(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
    cu_proxy_fence_async();
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     cu_smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(cu_smem_addr(bar))
                 : "memory");
}

/* ---- TMA: box at (c0 = inner coordinate, c1 = row) of a 2-D tensor map into dst, completing
 * its bytes on bar. The map lives in global or parameter memory (generic address). ---- */
static __device__ __forceinline__ void cu_tma_load_2d(void *dst, const void *map, uint64_t *bar, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
                 "[%4];\n" ::"r"(cu_smem_addr(dst)),
                 "l"(map), "r"(c0), "r"(c1), "r"(cu_smem_addr(bar))
                 : "memory");
}

/* ---- warpgroup MMA ---- */
/* Descriptor of a K-major, 128-byte-swizzled operand starting at p (see the file comment):
 * start address >> 4 in bits 0-13, leading offset 1 (unused by this layout), stride 1024 bytes
 * between 8-row groups in bits 32-45, swizzle mode 1 (128 bytes) in bits 62-63. */
static __device__ __forceinline__ uint64_t cu_wg_desc(const void *p) {
    return (uint64_t)((cu_smem_addr(p) & 0x3FFFFu) >> 4) | (uint64_t)1 << 16 | (uint64_t)(1024 >> 4) << 32 |
           (uint64_t)1 << 62;
}
/* Descriptor of an MN-major (transposed), 128-byte-swizzled operand at p: rows of 64 bf16 along
 * N (or M) in the swizzled tile layout of the file comment, read as K = the tile's rows (k16 step j
 * at 2048 j bytes in), N = its 64 columns, then further 64-column tiles `lbo` bytes apart (bits
 * 16-29); 8-row (k) groups 1024 bytes apart (bits 32-45). For a tile written once for a K-major
 * product (rows x columns) and used again with rows as K (scores, then P times the same rows). */
static __device__ __forceinline__ uint64_t cu_wg_desc_mn(const void *p, uint32_t lbo) {
    return (uint64_t)((cu_smem_addr(p) & 0x3FFFFu) >> 4) | (uint64_t)((lbo >> 4) & 0x3FFFu) << 16 |
           (uint64_t)(1024 >> 4) << 32 | (uint64_t)1 << 62;
}

/* ---- thread block clusters: rank, the address of a variable in another CTA, stores there that
 * complete on its mbarrier, cluster-scope waits, and the cluster barrier ---- */
static __device__ __forceinline__ unsigned cu_cluster_rank(void) {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
/* The shared::cluster address of the variable at local p in CTA `rank` of the cluster. */
static __device__ __forceinline__ uint32_t cu_cluster_map(const void *p, unsigned rank) {
    uint32_t r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(cu_smem_addr(p)), "r"(rank));
    return r;
}
/* A store into the shared memory of a CTA of the cluster that completes its 16 bytes on that CTA's
 * mbarrier bar (the waiter's arrive_tx counts them): no fence, no arrival. */
static __device__ __forceinline__ void cu_cluster_st_async4(uint32_t addr, float4 v, uint32_t bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(
                     addr),
                 "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar)
                 : "memory");
}
/* cu_mbar_wait with acquire at cluster scope: sees what the remote arrivers released. */
static __device__ __forceinline__ void cu_mbar_wait_cluster(uint64_t *bar, unsigned parity) {
    asm volatile("{\n.reg .pred done;\n"
                 "WAITC:\n"
                 "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAITC;\n}\n" ::"r"(cu_smem_addr(bar)),
                 "r"(parity)
                 : "memory");
}
/* Every thread of every CTA of the cluster (also a CTA barrier). */
static __device__ __forceinline__ void cu_cluster_sync(void) {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

static __device__ __forceinline__ void cu_wg_fence(void) { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
static __device__ __forceinline__ void cu_wg_commit(void) {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N> static __device__ __forceinline__ void cu_wg_wait(void) {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* Keeps the compiler from moving accesses of an accumulator across the asynchronous MMAs. */
static __device__ __forceinline__ void cu_wg_reg_fence(float &r) { asm volatile("" : "+f"(r)::"memory"); }
static __device__ __forceinline__ void cu_wg_reg_fence_u(uint32_t &r) { asm volatile("" : "+r"(r)::"memory"); }

/* The accumulator operands of the wrappers below, 8 registers a group: CU_WG_REGS<g> names the
 * first g groups in the asm text ("%0, %1, ..., %<8g - 1>"), CU_WG_ACC<g> binds them to d[0 .. 8g).
 * Inline asm takes no arrays and its operand list is fixed per N, which no function or template
 * can vary; these spell each list once instead of once per wrapper. */
#define CU_WG_D8(i)                                                                                    \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
        "+f"(d[i + 7])
#define CU_WG_REGS1 "%0, %1, %2, %3, %4, %5, %6, %7"
#define CU_WG_REGS2 CU_WG_REGS1 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define CU_WG_REGS3 CU_WG_REGS2 ", %16, %17, %18, %19, %20, %21, %22, %23"
#define CU_WG_REGS4 CU_WG_REGS3 ", %24, %25, %26, %27, %28, %29, %30, %31"
#define CU_WG_REGS5 CU_WG_REGS4 ", %32, %33, %34, %35, %36, %37, %38, %39"
#define CU_WG_REGS6 CU_WG_REGS5 ", %40, %41, %42, %43, %44, %45, %46, %47"
#define CU_WG_REGS7 CU_WG_REGS6 ", %48, %49, %50, %51, %52, %53, %54, %55"
#define CU_WG_REGS8 CU_WG_REGS7 ", %56, %57, %58, %59, %60, %61, %62, %63"
#define CU_WG_REGS9 CU_WG_REGS8 ", %64, %65, %66, %67, %68, %69, %70, %71"
#define CU_WG_REGS10 CU_WG_REGS9 ", %72, %73, %74, %75, %76, %77, %78, %79"
#define CU_WG_REGS11 CU_WG_REGS10 ", %80, %81, %82, %83, %84, %85, %86, %87"
#define CU_WG_REGS12 CU_WG_REGS11 ", %88, %89, %90, %91, %92, %93, %94, %95"
#define CU_WG_REGS13 CU_WG_REGS12 ", %96, %97, %98, %99, %100, %101, %102, %103"
#define CU_WG_REGS14 CU_WG_REGS13 ", %104, %105, %106, %107, %108, %109, %110, %111"
#define CU_WG_REGS15 CU_WG_REGS14 ", %112, %113, %114, %115, %116, %117, %118, %119"
#define CU_WG_REGS16 CU_WG_REGS15 ", %120, %121, %122, %123, %124, %125, %126, %127"
#define CU_WG_ACC1 CU_WG_D8(0)
#define CU_WG_ACC2 CU_WG_ACC1, CU_WG_D8(8)
#define CU_WG_ACC3 CU_WG_ACC2, CU_WG_D8(16)
#define CU_WG_ACC4 CU_WG_ACC3, CU_WG_D8(24)
#define CU_WG_ACC5 CU_WG_ACC4, CU_WG_D8(32)
#define CU_WG_ACC6 CU_WG_ACC5, CU_WG_D8(40)
#define CU_WG_ACC7 CU_WG_ACC6, CU_WG_D8(48)
#define CU_WG_ACC8 CU_WG_ACC7, CU_WG_D8(56)
#define CU_WG_ACC9 CU_WG_ACC8, CU_WG_D8(64)
#define CU_WG_ACC10 CU_WG_ACC9, CU_WG_D8(72)
#define CU_WG_ACC11 CU_WG_ACC10, CU_WG_D8(80)
#define CU_WG_ACC12 CU_WG_ACC11, CU_WG_D8(88)
#define CU_WG_ACC13 CU_WG_ACC12, CU_WG_D8(96)
#define CU_WG_ACC14 CU_WG_ACC13, CU_WG_D8(104)
#define CU_WG_ACC15 CU_WG_ACC14, CU_WG_D8(112)
#define CU_WG_ACC16 CU_WG_ACC15, CU_WG_D8(120)

/* d[64, N] += A[64, 16] B[N, 16]^T, A and B from descriptors (cu_wg_desc), d as in the file
 * comment; with acc == 0, d = A B^T (d's old values unread: no zeroing by ordinary instructions,
 * which would serialize the wgmmas in flight). */
template <int N> __device__ __forceinline__ void cu_wgmma_bf16(float *d, uint64_t a, uint64_t b, int acc = 1);

/* The specialisation of cu_wgmma_bf16 for N = 16 G: G groups of accumulators (operands %0 ..
 * %<N/2 - 1>), then the descriptors a (%A = N / 2), b (%B) and acc (%P). */
#define CU_WGMMA_BF16(N, G, A, B, P)                                                                            \
    template <> __device__ __forceinline__ void cu_wgmma_bf16<N>(float *d, uint64_t a, uint64_t b, int acc) {   \
        static_assert(N == 16 * G && A == N / 2 && B == A + 1 && P == A + 2, "wgmma operand numbering");        \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #P ", 0;\n"                                           \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" CU_WG_REGS##G                 \
                     "}, %" #A ", %" #B ", p, 1, 1, 0, 0;\n}\n"                                                 \
                     : CU_WG_ACC##G                                                                             \
                     : "l"(a), "l"(b), "r"(acc));                                                               \
    }
CU_WGMMA_BF16(16, 1, 8, 9, 10)
CU_WGMMA_BF16(32, 2, 16, 17, 18)
CU_WGMMA_BF16(48, 3, 24, 25, 26)

/* d[64, 64] (+)= A[64, 16] B[16, 64] with either operand MN-major (TA, TB = 1: cu_wg_desc_mn) or
 * K-major (0: cu_wg_desc); d overwritten where acc == 0. */
template <int TA, int TB>
static __device__ __forceinline__ void cu_wgmma_bf16_64t(float *d, uint64_t a, uint64_t b, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" CU_WG_REGS4
                 "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
                 : CU_WG_ACC4
                 : "l"(a), "l"(b), "r"(acc), "n"(TA), "n"(TB));
}
template <> __device__ __forceinline__ void cu_wgmma_bf16<64>(float *d, uint64_t a, uint64_t b, int acc) {
    cu_wgmma_bf16_64t<0, 0>(d, a, b, acc);
}
CU_WGMMA_BF16(80, 5, 40, 41, 42)
CU_WGMMA_BF16(96, 6, 48, 49, 50)
CU_WGMMA_BF16(112, 7, 56, 57, 58)
CU_WGMMA_BF16(128, 8, 64, 65, 66)
CU_WGMMA_BF16(144, 9, 72, 73, 74)
CU_WGMMA_BF16(160, 10, 80, 81, 82)
CU_WGMMA_BF16(176, 11, 88, 89, 90)
CU_WGMMA_BF16(192, 12, 96, 97, 98)
CU_WGMMA_BF16(208, 13, 104, 105, 106)
CU_WGMMA_BF16(224, 14, 112, 113, 114)
CU_WGMMA_BF16(240, 15, 120, 121, 122)
CU_WGMMA_BF16(256, 16, 128, 129, 130)
#undef CU_WGMMA_BF16

/* d[64, 256] += A[64, 16] B[16, 256] with A from registers and B MN-major (cu_wg_desc_mn). Warp w
 * of the warpgroup gives rows 16 w .. 16 w + 15 of A as the m16n8k16 A fragment: a[0] = (row g,
 * k 2q, 2q + 1), a[1] = (row g + 8, the same k), a[2] = (row g, k 2q + 8, 2q + 9), a[3] = (row
 * g + 8, those k); g = lane / 4, q = lane % 4, the lower k in the low half. That is the layout of
 * an accumulator's columns 16 j .. 16 j + 15 (file comment), d[8 j + 2 i], d[8 j + 2 i + 1] as
 * a[i], so a product's scores feed the next product without shared memory. */
static __device__ __forceinline__ void cu_wgmma_bf16_ra256_mn(float *d, const uint32_t *a, uint64_t b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" CU_WG_REGS16
                 "}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
                 : CU_WG_ACC16
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

#endif /* MT_CUDA_WGMMA_H */
