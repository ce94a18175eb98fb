/* kernels/cuda/cuda_skinny.cu: the tensor-core matmul of a batched decode step, y[j] = x . w[j]^T
 * for 9..CU_SKINNY_MAX_N rows of x and bf16 weights (cuda_dense.cu's matmul_tc sends it those
 * rows when mt_cuda_params.skinny_max_rows allows; cuda_ops.h declares cu_gemm_skinny).
 *
 * Why: at 64 rows a step's dense weights are read once and used 64 times, far below the tensor
 * cores' ridge point, so the matmul should stream its weights at the copy rate. cuBLAS ran the
 * batch-64 step's dense GEMMs at under half of it (docs/PERF.md, batch_bench's op profile).
 *
 * Shape: the weight rows are the MMA's M, the rows of x its N (mma.sync m16n8k16, bf16 operands,
 * fp32 sums). A block of SKN_THREADS owns SKN_BM = 256 weight rows (a warp 32: two m16 tiles)
 * and every row of x (NT n8 tiles, n <= 8 NT), over a contiguous run of k. The operands stream
 * through SKN_STAGES shared-memory stages of SKN_BK = 32 columns by cp.async (a weight row's 64
 * bytes a stage; rows past the weight's or x's end and columns past K zero-filled); ldmatrix
 * reads them, the 16-byte chunks of a row XOR-swizzled by (row / 2) % 4 so that 8 rows of one
 * chunk fall in distinct banks. The weight loads of the first stages go out before the PDL wait
 * (weights depend on no kernel); x's after it.
 *
 * x arrives as `terms` 16-bit parts (cu_split16, blocked: part t at x16 + t n K): with two parts
 * each weight fragment multiplies both into the same sums, the exact mode's hi + lo.
 *
 * Split k: a weight with few 256-row tiles would give fewer blocks than multiprocessors, so the
 * k axis is cut into `split` runs (1, 2, 4 or 8), the blocks of one tile forming a thread-block
 * cluster. Each block leaves its sums in its shared memory; after a cluster barrier block r adds
 * rows [r BM / split, +BM / split) of every block's sums, in rank order, through distributed
 * shared memory and stores them. No atomics, no global scratch: every sum's order depends only on
 * the shape, so results are deterministic. Several weights sharing x (a KDA layer's q, k, v) run
 * as one launch, weight j owning tiles [t0[j], t0[j + 1]).
 *
 * Needs K % 8 == 0 and 16-byte aligned weights and x (cu_skinny_ok). */
#include <limits.h>
#include <stdint.h>

#include <cuda_bf16.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_wgmma.h"

enum {
    SKN_THREADS = 256,
    SKN_WARPS = SKN_THREADS / 32,
    SKN_WROWS = 32,                    /* weight rows a warp: two m16 tiles */
    SKN_BM = SKN_WROWS * SKN_WARPS,    /* weight rows a block */
    SKN_BK = 32,                       /* k columns a stage: 64 bytes of each row */
    SKN_STAGES = 4,
    SKN_ROWB = SKN_BK * 2,             /* bytes of a row in a stage */
    SKN_WSTAGE = SKN_BM * SKN_ROWB,    /* weight bytes of a stage: 16 KB */
    SKN_PSTRIDE = SKN_BM + 4,          /* floats between x rows of the sums left for the cluster:
                                          rows 2q apart land 8q banks apart */
    SKN_MIN_KB = 4,                    /* k stages a run at least */
};

typedef struct skn_params {
    const uint16_t *x;        /* [terms][n][K] bf16 parts */
    int64_t part;             /* elements between parts: n K */
    int n, K;
    int split, kchunk;        /* k runs a tile and columns a run (a multiple of SKN_BK) */
    int nw;
    const uint16_t *w[CU_SKINNY_MAX_W]; /* [rows[j], K] bf16 */
    float *y[CU_SKINNY_MAX_W];          /* [n, rows[j]] fp32 */
    int rows[CU_SKINNY_MAX_W];
    int t0[CU_SKINNY_MAX_W + 1];        /* weight j owns tiles [t0[j], t0[j + 1]) */
} skn_params;

/* cp.async of 16 bytes that zero-fills the destination when !in (the source is then not read). */
static __device__ __forceinline__ void skn_cp16(uint32_t dst, const void *src, bool in) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(in ? 16 : 0)
                 : "memory");
}

/* Byte offset of 16-byte chunk c (0..3) of row r in a stage. */
static __device__ __forceinline__ uint32_t skn_off(int r, int c) {
    return (uint32_t)(r * SKN_ROWB + ((c ^ ((r >> 1) & 3)) << 4));
}

static __device__ __forceinline__ float skn_ld_cluster(uint32_t addr) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
    return v;
}

/* Dynamic shared memory: SKN_STAGES x (weights SKN_WSTAGE, then x: T parts of 8 NT rows), and
 * after the k loop the block's sums [8 NT][SKN_PSTRIDE] fp32 over the same bytes. */
template <int NT, int T> static constexpr __host__ __device__ int skn_xstage() { return T * 8 * NT * SKN_ROWB; }
template <int NT, int T> static constexpr __host__ __device__ int skn_smem_bytes() {
    return SKN_STAGES * (SKN_WSTAGE + skn_xstage<NT, T>()) > 8 * NT * SKN_PSTRIDE * 4
               ? SKN_STAGES * (SKN_WSTAGE + skn_xstage<NT, T>())
               : 8 * NT * SKN_PSTRIDE * 4;
}

/* Grid: (tiles x split) blocks, clusters of split along x: block b takes tile b / split and k run
 * b % split (its cluster rank). */
template <int NT, int T>
static __global__ void __launch_bounds__(SKN_THREADS, 2) skinny_kernel(const __grid_constant__ skn_params p) {
    extern __shared__ __align__(128) unsigned char skn_sm[];
    constexpr int XS = skn_xstage<NT, T>(), STAGE = SKN_WSTAGE + XS, XR = 8 * NT;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int tile = blockIdx.x / p.split, run = blockIdx.x % p.split;
    int j = 0;
    while (j + 1 < p.nw && tile >= p.t0[j + 1]) j++;
    const int row0 = (tile - p.t0[j]) * SKN_BM, R = p.rows[j];
    const uint16_t *w = p.w[j];
    const int kb = run * p.kchunk, ke = min(p.K, kb + p.kchunk);
    const int nk = ke > kb ? (ke - kb + SKN_BK - 1) / SKN_BK : 0;
    const uint32_t base = cu_smem_addr(skn_sm);

    auto load_w = [&](int st, int it) {
        const int k0 = kb + it * SKN_BK;
#pragma unroll
        for (int i = 0; i < SKN_BM * 4 / SKN_THREADS; i++) {
            const int c = tid + i * SKN_THREADS, r = c >> 2, ch = c & 3, k = k0 + ch * 8;
            const bool in = row0 + r < R && k < ke;
            const uint16_t *src = in ? w + (int64_t)(row0 + r) * p.K + k : w;
            skn_cp16(base + st * STAGE + skn_off(r, ch), src, in);
        }
    };
    auto load_x = [&](int st, int it) {
        const int k0 = kb + it * SKN_BK;
        for (int c = tid; c < T * XR * 4; c += SKN_THREADS) {
            const int t = c / (XR * 4), r = (c >> 2) % XR, ch = c & 3, k = k0 + ch * 8;
            const bool in = r < p.n && k < ke;
            const uint16_t *src = in ? p.x + t * p.part + (int64_t)r * p.K + k : p.x;
            skn_cp16(base + st * STAGE + SKN_WSTAGE + t * XR * SKN_ROWB + skn_off(r, ch), src, in);
        }
    };

    /* weights of the first stages before the wait; the groups then are {W0..W(S-2), X0}, {X1}, ...
     * so group s still completes stage s */
    for (int s = 0; s < SKN_STAGES - 1; s++)
        if (s < nk) load_w(s, s);
    cu_pdl_wait(); /* x is the previous kernel's output; y is written below */
    cu_pdl_trigger();
    for (int s = 0; s < SKN_STAGES - 1; s++) {
        if (s < nk) load_x(s, s);
        cu_cp_async_commit();
    }

    float acc[2][NT][4];
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int q = 0; q < NT; q++)
#pragma unroll
            for (int r = 0; r < 4; r++) acc[m][q][r] = 0.f;

    for (int it = 0; it < nk; it++) {
        cu_cp_async_wait<SKN_STAGES - 2>();
        __syncthreads(); /* stage it landed for all; stage it - 1 is free for every warp */
        const int nx = it + SKN_STAGES - 1;
        if (nx < nk) {
            load_w(nx % SKN_STAGES, nx);
            load_x(nx % SKN_STAGES, nx);
        }
        cu_cp_async_commit();
        const uint32_t sw = base + (it % SKN_STAGES) * STAGE, sx = sw + SKN_WSTAGE;
#pragma unroll
        for (int kk = 0; kk < SKN_BK / 16; kk++) {
            uint32_t a[2][4];
#pragma unroll
            for (int m = 0; m < 2; m++) {
                const int r = warp * SKN_WROWS + m * 16 + (lane & 15);
                cu_ldsm4(a[m], sw + skn_off(r, 2 * kk + (lane >> 4)));
            }
#pragma unroll
            for (int t = 0; t < T; t++) {
#pragma unroll
                for (int q = 0; q < NT; q += 2) {
                    uint32_t b[4];
                    const int r = q * 8 + 8 * (lane >> 4) + (lane & 7);
                    cu_ldsm4(b, sx + t * XR * SKN_ROWB + skn_off(r, 2 * kk + ((lane >> 3) & 1)));
#pragma unroll
                    for (int m = 0; m < 2; m++) {
                        cu_mma_bf16(acc[m][q], a[m], b[0], b[1]);
                        cu_mma_bf16(acc[m][q + 1], a[m], b[2], b[3]);
                    }
                }
            }
        }
    }
    cu_cp_async_wait<0>();

    /* fragment (m, q): c0, c1 weight row g, x rows 2t, 2t + 1; c2, c3 weight row g + 8 */
    const int g = lane >> 2, t4 = lane & 3;
    if (p.split == 1) {
        float *y = p.y[j];
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int q = 0; q < NT; q++) {
                const int r = row0 + warp * SKN_WROWS + m * 16 + g, i = q * 8 + 2 * t4;
                if (r < R && i < p.n) y[(int64_t)i * R + r] = acc[m][q][0];
                if (r < R && i + 1 < p.n) y[(int64_t)(i + 1) * R + r] = acc[m][q][1];
                if (r + 8 < R && i < p.n) y[(int64_t)i * R + r + 8] = acc[m][q][2];
                if (r + 8 < R && i + 1 < p.n) y[(int64_t)(i + 1) * R + r + 8] = acc[m][q][3];
            }
        return;
    }
    __syncthreads(); /* every warp is past its last ldmatrix: the stages become the sums */
    float *sums = (float *)skn_sm; /* [XR][SKN_PSTRIDE]: x row i, weight row r of the tile */
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int q = 0; q < NT; q++) {
            const int r = warp * SKN_WROWS + m * 16 + g, i = q * 8 + 2 * t4;
            sums[i * SKN_PSTRIDE + r] = acc[m][q][0];
            sums[(i + 1) * SKN_PSTRIDE + r] = acc[m][q][1];
            sums[i * SKN_PSTRIDE + r + 8] = acc[m][q][2];
            sums[(i + 1) * SKN_PSTRIDE + r + 8] = acc[m][q][3];
        }
    cu_cluster_sync(); /* every block's sums are in place */
    const int span = SKN_BM / p.split, n = min(p.n, XR);
    float *y = p.y[j];
    for (int e = tid; e < n * span; e += SKN_THREADS) {
        const int i = e / span, r = run * span + e % span;
        if (row0 + r >= R) continue;
        float s = 0.f;
        for (int b = 0; b < p.split; b++) s += skn_ld_cluster(cu_cluster_map(&sums[i * SKN_PSTRIDE + r], b));
        y[(int64_t)i * R + row0 + r] = s;
    }
    cu_cluster_sync(); /* no block leaves while another still reads its sums */
}

extern "C" bool cu_skinny_ok(const mt_weight *const *w, int count, int n, int terms) {
    if (count < 1 || count > CU_SKINNY_MAX_W || n < 1 || n > CU_SKINNY_MAX_N || terms < 1 || terms > 2) return false;
    for (int j = 0; j < count; j++)
        if (w[j]->dtype != MT_BF16 || w[j]->cols != w[0]->cols || w[j]->cols % 8 != 0 ||
            w[j]->cols > INT_MAX - 2 * SKN_BK || w[j]->rows < 1 || w[j]->rows > INT_MAX - SKN_BM ||
            !cu_aligned16(w[j]->data)) /* the kernel's int k and row indices stay in range */
            return false;
    return true;
}

template <int NT, int T> static mt_status skinny_launch_t(const skn_params *p, int tiles, cudaStream_t s) {
    constexpr int smem = skn_smem_bytes<NT, T>();
    const mt_status st = cu_smem_opt_in((const void *)skinny_kernel<NT, T>, smem);
    if (st != MT_OK) return st;
    MT_CUDA_CHECK(cu_launch_pdl_cluster((const void *)skinny_kernel<NT, T>, dim3((unsigned)(tiles * p->split)),
                                        dim3(SKN_THREADS), (size_t)smem, s, (void *)p, p->split));
    return MT_OK;
}

template <int T> static mt_status skinny_launch_nt(const skn_params *p, int tiles, cudaStream_t s) {
    if (p->n <= 16) return skinny_launch_t<2, T>(p, tiles, s);
    if (p->n <= 32) return skinny_launch_t<4, T>(p, tiles, s);
    if (p->n <= 48) return skinny_launch_t<6, T>(p, tiles, s);
    return skinny_launch_t<8, T>(p, tiles, s);
}

/* The k runs a tile: the fewest (a power of two, at most 8) that give every multiprocessor a
 * block, keeping SKN_MIN_KB stages a run. One block a multiprocessor already keeps 3 stages of
 * 16 KB of weights in flight, more than the copy rate needs. */
static int skinny_split(int tiles, int K, int n_sm) {
    const int kbs = (K + SKN_BK - 1) / SKN_BK;
    int split = 1;
    /* doubled only while the last run, after the others' whole chunks, keeps SKN_MIN_KB stages */
    while (split < 8 && tiles * split < n_sm &&
           (2 * split - 1) * ((kbs + 2 * split - 1) / (2 * split)) + SKN_MIN_KB <= kbs)
        split *= 2;
    return split;
}

extern "C" mt_status cu_gemm_skinny(cu_backend *cb, float *const *y, const void *x16, int terms,
                                    const mt_weight *const *w, int count, int n) {
    MT_ASSERT(cu_skinny_ok(w, count, n, terms) && cu_aligned16(x16));
    skn_params p = {};
    p.x = (const uint16_t *)x16;
    p.n = n;
    p.K = (int)w[0]->cols;
    p.part = (int64_t)n * p.K;
    p.nw = count;
    int tiles = 0;
    for (int j = 0; j < count; j++) {
        p.w[j] = (const uint16_t *)w[j]->data;
        p.y[j] = y[j];
        p.rows[j] = (int)w[j]->rows;
        p.t0[j] = tiles;
        tiles += (p.rows[j] + SKN_BM - 1) / SKN_BM;
    }
    p.t0[count] = tiles;
    p.split = skinny_split(tiles, p.K, cu_sms(cb));
    const int kbs = (p.K + SKN_BK - 1) / SKN_BK;
    p.kchunk = (kbs + p.split - 1) / p.split * SKN_BK;
    return terms == 2 ? skinny_launch_nt<2>(&p, tiles, cb->stream) : skinny_launch_nt<1>(&p, tiles, cb->stream);
}
