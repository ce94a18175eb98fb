/* kernels/cuda/cuda_moe_grouped.cu: the routed experts (the moe_experts contract,
 * kernels/backend.h) grouped by expert on the device: decode-sized batches (cu_moe_experts routes
 * 5..64 rows here by default) and, in the exact numerics, every batch from 5 rows (so a row's sums
 * do not depend on the rows beside it); correct for any n.
 *
 * Why: cuda_moe.cu's many-row path reads idx back to group rows by expert on the host, so a
 * batched decode step cannot be captured in a CUDA graph; and at decode sizes (n = 64, top-8 of
 * 288: ~1.8 rows per touched expert) a step costs reading the touched experts' weights once, which
 * GEMV-style streaming does at memory speed while padded tensor-core GEMMs do not.
 *
 * Per chunk of rows (at most MOEG_CHUNK_PAIRS (row, slot) pairs, which bounds the scratch), four
 * kernels on the backend's stream, nothing on the host in between:
 *   1. group (one block): per-expert counts of the pairs by shared-memory atomics, an exclusive
 *      scan into start[E + 1], then list[] = the pair ids grouped by expert (order within an
 *      expert is arbitrary; no result depends on it, see 2).
 *   2. gate/up, grid (I / 16, E): block (tile, e) exits at once when no pair chose e; else each
 *      warp streams its 2 rows of e's gate and up once (16-byte loads, fp32 FMA) against up to 4
 *      of e's pairs at a time (more pairs: another pass over the same rows, now from L2), lanes
 *      splitting H, then a warp sum; h[pair, i] = silu(min(g, L)) * clamp(u, -L, L). Each pair's
 *      sum runs the same instruction sequence whatever its place in the list: deterministic.
 *   3. down, grid (H / 32, E): the same with 4 rows of e's down per warp, d[pair, :] = down h.
 *   4. combine: out[i] += sum_k weights[i, k] * d[i * top_k + k] in slot order (the CPU's),
 *      no atomics on out.
 * Measured (H200, real shapes 4096 x 2048 bf16, top-8 of 288 distinct experts, uniform random
 * choices; device copy 4.27 TB/s): n = 8 0.70 ms, 91% of the copy bandwidth on the touched
 * experts' bytes (94% replayed from a graph); n = 32 2.01 ms, 100%; n = 64 3.02 ms, 95%; n = 128
 * 4.36 ms, 76% (the backend's batched-GEMM path: 3.73 ms). The loss grows with the pairs per
 * expert (3.6 at n = 128), not with the passes (see MOEG_PASS_MAX): likely the x (h) reads: in
 * a pass every warp of a block reads the rows of all its NR pairs, NR / 16 of the block's weight
 * bytes when the 8 warps share them through L1, up to NR / 2 when they do not. Staging them in
 * shared memory once per block (in chunks of H) is the next step.
 *
 * The device table of expert weight pointers (gate, up, down data of each expert) is kept per
 * (backend, host experts array), covering experts [0, E): E is the router's n_experts when idx is
 * the last moe_route output (the engine's case), else 1 + the largest index read back from idx
 * (an eager call that does not follow moe_route synchronises once for that). Every call compares
 * the host array with the table's host copy (host work only) and rebuilds on a change.
 *
 * F8E4M3 experts (block-scaled, cuda_ops.h) take the same kernels: 16 e4m3 weights a 16-byte
 * load, each times its 128 x 128 block's scale in fp32 (not rounded), rows at the padded stride
 * cu_fp8_kpad; the activations stay fp32. cuda_moe.cu sends FP8 experts here for decode batches and,
 * in the exact and fp32 numerics modes, for every row count above the GEMV kernels' (bf16 experts:
 * in the exact mode only).
 *
 * Graph capture: a call never synchronises or allocates once warm, i.e. once an eager call has
 * built the table for these experts and sized the scratch (CU_SCRATCH_DENSE) for at least as many
 * pairs. The engine's first graph-form step runs eagerly and warms it. A captured call that would
 * need either (a table change, more scratch) fails with MT_ERR_INVALID, logged, instead of
 * breaking the capture; an index beyond the table in a captured call traps (a bug: without
 * moe_route, a capture must follow an eager call whose indices reached as far). The graph keeps
 * the table and scratch pointers: growing them later (more experts for the same array, a larger
 * op on the scratch slot) invalidates it, as for every op on the backend's scratch. */
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_bf16.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"

enum {
    MOEG_THREADS = 256,                 /* gate/up, down and combine blocks */
    MOEG_WARPS = MOEG_THREADS / 32,
    MOEG_GROUP_THREADS = 1024,          /* the one group block */
    MOEG_GU_ROWS = 2,                   /* rows of gate and of up per warp */
    MOEG_GU_TILE = MOEG_GU_ROWS * MOEG_WARPS,
    MOEG_DN_ROWS = 4,                   /* rows of down per warp */
    MOEG_DN_TILE = MOEG_DN_ROWS * MOEG_WARPS,
    MOEG_PASS_MAX = 4,                  /* pairs per pass over a warp's weight rows. 8 took the
                                           kernels past 128 registers a thread (the most that keeps
                                           2 blocks of 256 on an SM); an 8-pair pass without the
                                           unrolling measured no faster at n = 128 and ~4% slower
                                           at n = 32..64 */
    MOEG_MAX_TOPK = 64,
    MOEG_MAX_EXPERTS = 6144,            /* group kernel: 2 ints per expert in 48 KiB of smem */
    MOEG_CHUNK_PAIRS = 4096,            /* pairs per chunk: 96 MiB of scratch at 4096 x 2048 */
    MOEG_TABLES_MAX = 1024,             /* tables kept; beyond, the oldest slot is reused */
};

/* ================================ kernels ================================ */

typedef struct moeg_params {
    float *out;             /* [n, H] this chunk's rows, accumulated */
    float *h;               /* [P, I] scratch: swiglu(gate x, up x) of pair q (row q / top_k) */
    float *d;               /* [P, H] scratch: down h of pair q */
    int32_t *start;         /* [E + 1] scratch: expert e owns list[start[e], start[e + 1]) */
    int32_t *list;          /* [P] scratch: pair ids grouped by expert */
    const float *x;         /* [n, H] this chunk's rows */
    const int32_t *idx;     /* [P] = [n, top_k] this chunk's rows */
    const float *wts;       /* [P] = [n, top_k] */
    const void *const *w;   /* [3 E] device table: gate, up, down data of expert e at 3e + 0, 1, 2 */
    const float *const *s;  /* [3 E] device table: their block scales (F8E4M3 experts; else NULL) */
    int64_t ldgu, lddn;     /* row strides of gate/up and of down: H and I, or for F8E4M3 experts
                               the padded cu_fp8_kpad(H) and cu_fp8_kpad(I) (cuda_ops.h) */
    int E, n, top_k, H, I;  /* P = n * top_k */
    float L;                /* swiglu clamp */
} moeg_params;

/* out[V] = weight elements (row, col .. col + V) as fp32: data w with row stride ld; an F8E4M3
 * weight's e4m3 codes times their block scale from s (V 16: one 16-byte load, col a multiple of
 * 16; or V 1). */
template <mt_dtype DT, int V>
static __device__ __forceinline__ void moeg_wload(const void *w, const float *s, int64_t row, int64_t ld, int64_t col,
                                                  float (&out)[V]) {
    if constexpr (DT == MT_F8E4M3) {
        cu_wstream<MT_F8E4M3, V == 16> st;
        cu_wstream_at(st, w, s, row, ld, col);
        st.get(out);
    } else {
        cu_wload<DT, V>(w, row * ld + col, out);
    }
}

/* One block of MOEG_GROUP_THREADS. Dynamic shared memory: cnt[E], cur[E] int32. */
static __global__ void __launch_bounds__(MOEG_GROUP_THREADS) moeg_group_kernel(const moeg_params p) {
    extern __shared__ int32_t moeg_group_smem[];
    int32_t *cnt = moeg_group_smem, *cur = moeg_group_smem + p.E;
    const int P = p.n * p.top_k, tid = threadIdx.x;
    for (int e = tid; e < p.E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int q = tid; q < P; q += blockDim.x) {
        const int e = p.idx[q];
        if ((unsigned)e >= (unsigned)p.E) __trap(); /* index beyond the table: a bug (file comment) */
        atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    if (tid < 32) { /* exclusive scan by warp 0, 32 experts at a time */
        int run = 0;
        for (int b = 0; b < p.E; b += 32) {
            const int e = b + tid, c = e < p.E ? cnt[e] : 0;
            int inc = c;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int v = __shfl_up_sync(0xffffffffu, inc, o);
                if (tid >= o) inc += v;
            }
            if (e < p.E) cur[e] = p.start[e] = run + inc - c;
            run += __shfl_sync(0xffffffffu, inc, 31);
        }
        if (tid == 0) p.start[p.E] = run;
    }
    __syncthreads();
    for (int q = tid; q < P; q += blockDim.x) p.list[atomicAdd(&cur[p.idx[q]], 1)] = q;
}

/* One warp, one pass: rows [i0, i0 + MOEG_GU_ROWS) of gate (wg) and up (wu), each [I, H], against
 * the NR pairs pl[0, NR); lanes split H in V-element pieces. Rows past I read row I - 1 (no
 * branch in the loop) and are not written. */
template <mt_dtype DT, int V, int NR>
static __device__ __forceinline__ void moeg_gateup_pass(const moeg_params &p, const void *wg, const void *wu,
                                                        const float *sg, const float *su, int i0, const int32_t *pl) {
    constexpr int R = MOEG_GU_ROWS;
    const int lane = threadIdx.x & 31;
    int q[NR], xo[NR]; /* pair ids; offsets of their x rows (32-bit: fewer registers) */
#pragma unroll
    for (int t = 0; t < NR; t++) {
        q[t] = pl[t];
        xo[t] = q[t] / p.top_k * p.H;
    }
    int64_t wrow[R];
#pragma unroll
    for (int r = 0; r < R; r++) wrow[r] = min(i0 + r, p.I - 1);
    float ag[R][NR], au[R][NR];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NR; t++) ag[r][t] = au[r][t] = 0.f;
    const int nv = p.H / V;
    /* e4m3 (V 16): one step's weights take the registers two bf16 steps do (unrolled, it spills) */
#pragma unroll(V == 16 ? 1 : 2)
    for (int v = lane; v < nv; v += 32) {
        float g[R][V], u[R][V];
#pragma unroll
        for (int r = 0; r < R; r++) {
            moeg_wload<DT, V>(wg, sg, wrow[r], p.ldgu, (int64_t)v * V, g[r]);
            moeg_wload<DT, V>(wu, su, wrow[r], p.ldgu, (int64_t)v * V, u[r]);
        }
#pragma unroll
        for (int t = 0; t < NR; t++) {
            float xv[V];
            cu_xload<V>(p.x + xo[t] + v * V, xv);
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int j = 0; j < V; j++) {
                    ag[r][t] = fmaf(g[r][j], xv[j], ag[r][t]);
                    au[r][t] = fmaf(u[r][j], xv[j], au[r][t]);
                }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NR; t++) {
            const float a = cu_warp_sum(ag[r][t]), b = cu_warp_sum(au[r][t]);
            if (lane == r * NR + t && i0 + r < p.I) { /* R * NR <= 32: one lane per output */
                const float gc = fminf(a, p.L), uc = fminf(fmaxf(b, -p.L), p.L);
                p.h[(int64_t)q[t] * p.I + i0 + r] = gc / (1.f + expf(-gc)) * uc;
            }
        }
}

/* Grid (ceil(I / MOEG_GU_TILE), E): block (tile, e) computes h rows [tile * MOEG_GU_TILE, +TILE)
 * of every pair of expert e, MOEG_GU_ROWS per warp. */
template <mt_dtype DT, bool VEC>
static __global__ void __launch_bounds__(MOEG_THREADS, 2) moeg_gateup_kernel(const moeg_params p) {
    constexpr int V = VEC ? cu_wvec<DT>::n : 1;
    const int e = blockIdx.y, c0 = p.start[e], c1 = p.start[e + 1];
    if (c0 == c1) return; /* no pair chose e */
    const int i0 = blockIdx.x * MOEG_GU_TILE + (threadIdx.x >> 5) * MOEG_GU_ROWS;
    if (i0 >= p.I) return;
    const void *wg = p.w[3 * e], *wu = p.w[3 * e + 1];
    const float *sg = p.s[3 * e], *su = p.s[3 * e + 1];
    for (int c = c0; c < c1;) { /* passes of 4, then 3, 2 or 1 */
        const int m = c1 - c;
        if (m >= MOEG_PASS_MAX) {
            moeg_gateup_pass<DT, V, MOEG_PASS_MAX>(p, wg, wu, sg, su, i0, p.list + c);
            c += MOEG_PASS_MAX;
        }
        else if (m == 3) { moeg_gateup_pass<DT, V, 3>(p, wg, wu, sg, su, i0, p.list + c); c += 3; }
        else if (m == 2) { moeg_gateup_pass<DT, V, 2>(p, wg, wu, sg, su, i0, p.list + c); c += 2; }
        else { moeg_gateup_pass<DT, V, 1>(p, wg, wu, sg, su, i0, p.list + c); c += 1; }
    }
}

/* One warp, one pass: rows [i0, i0 + MOEG_DN_ROWS) of down (wd, [H, I]) against the NR pairs
 * pl[0, NR); lanes split I. d[pair, i] = down_i . h[pair]. */
template <mt_dtype DT, int V, int NR>
static __device__ __forceinline__ void moeg_down_pass(const moeg_params &p, const void *wd, const float *sd, int i0,
                                                      const int32_t *pl) {
    constexpr int R = MOEG_DN_ROWS;
    const int lane = threadIdx.x & 31;
    int q[NR], ho[NR]; /* pair ids; offsets of their h rows */
#pragma unroll
    for (int t = 0; t < NR; t++) {
        q[t] = pl[t];
        ho[t] = q[t] * p.I;
    }
    int64_t wrow[R];
#pragma unroll
    for (int r = 0; r < R; r++) wrow[r] = min(i0 + r, p.H - 1);
    float acc[R][NR];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NR; t++) acc[r][t] = 0.f;
    const int nv = p.I / V;
#pragma unroll 2
    for (int v = lane; v < nv; v += 32) {
        float dw[R][V];
#pragma unroll
        for (int r = 0; r < R; r++) moeg_wload<DT, V>(wd, sd, wrow[r], p.lddn, (int64_t)v * V, dw[r]);
#pragma unroll
        for (int t = 0; t < NR; t++) {
            float hv[V];
            cu_xload<V>(p.h + ho[t] + v * V, hv);
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int j = 0; j < V; j++) acc[r][t] = fmaf(dw[r][j], hv[j], acc[r][t]);
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < NR; t++) {
            const float s = cu_warp_sum(acc[r][t]);
            if (lane == r * NR + t && i0 + r < p.H) p.d[(int64_t)q[t] * p.H + i0 + r] = s;
        }
}

/* Grid (ceil(H / MOEG_DN_TILE), E): block (tile, e) computes d rows [tile * MOEG_DN_TILE, +TILE)
 * of every pair of expert e, MOEG_DN_ROWS per warp. */
template <mt_dtype DT, bool VEC>
static __global__ void __launch_bounds__(MOEG_THREADS, 2) moeg_down_kernel(const moeg_params p) {
    constexpr int V = VEC ? cu_wvec<DT>::n : 1;
    const int e = blockIdx.y, c0 = p.start[e], c1 = p.start[e + 1];
    if (c0 == c1) return;
    const int i0 = blockIdx.x * MOEG_DN_TILE + (threadIdx.x >> 5) * MOEG_DN_ROWS;
    if (i0 >= p.H) return;
    const void *wd = p.w[3 * e + 2];
    const float *sd = p.s[3 * e + 2];
    for (int c = c0; c < c1;) {
        const int m = c1 - c;
        if (m >= MOEG_PASS_MAX) {
            moeg_down_pass<DT, V, MOEG_PASS_MAX>(p, wd, sd, i0, p.list + c);
            c += MOEG_PASS_MAX;
        }
        else if (m == 3) { moeg_down_pass<DT, V, 3>(p, wd, sd, i0, p.list + c); c += 3; }
        else if (m == 2) { moeg_down_pass<DT, V, 2>(p, wd, sd, i0, p.list + c); c += 2; }
        else { moeg_down_pass<DT, V, 1>(p, wd, sd, i0, p.list + c); c += 1; }
    }
}

/* Grid-stride over out's n * H elements: out[i, c] += sum_k wts[i, k] * d[i * top_k + k, c], slots
 * in order, product rounded then sum (no FMA contraction), as the CPU adds them. */
static __global__ void __launch_bounds__(MOEG_THREADS) moeg_combine_kernel(const moeg_params p) {
    const int64_t total = (int64_t)p.n * p.H, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += stride) {
        const int64_t i = t / p.H;
        const int c = (int)(t - i * p.H);
        float v = p.out[t];
        for (int k = 0; k < p.top_k; k++) {
            const int64_t pair = i * p.top_k + k;
            v = __fadd_rn(v, __fmul_rn(p.wts[pair], p.d[pair * p.H + c]));
        }
        p.out[t] = v;
    }
}

/* =============================== launchers =============================== */

template <mt_dtype DT> static void moeg_gateup_launch_dt(const moeg_params *p, bool vec, cudaStream_t s) {
    const dim3 grid((unsigned)((p->I + MOEG_GU_TILE - 1) / MOEG_GU_TILE), (unsigned)p->E);
    if (vec) moeg_gateup_kernel<DT, true><<<grid, MOEG_THREADS, 0, s>>>(*p);
    else moeg_gateup_kernel<DT, false><<<grid, MOEG_THREADS, 0, s>>>(*p);
}

template <mt_dtype DT> static void moeg_down_launch_dt(const moeg_params *p, bool vec, cudaStream_t s) {
    const dim3 grid((unsigned)((p->H + MOEG_DN_TILE - 1) / MOEG_DN_TILE), (unsigned)p->E);
    if (vec) moeg_down_kernel<DT, true><<<grid, MOEG_THREADS, 0, s>>>(*p);
    else moeg_down_kernel<DT, false><<<grid, MOEG_THREADS, 0, s>>>(*p);
}

/* The four kernels of one chunk (file comment) on cb's stream; vec: 16-byte loads of weights, x
 * and h. The marks split the op's time under mt_cuda_profile (no-ops otherwise). */
static mt_status moeg_launch(cu_backend *cb, const moeg_params *p, mt_dtype dt, bool vec) {
    cudaStream_t s = cb->stream;
    moeg_group_kernel<<<1, MOEG_GROUP_THREADS, sizeof(int32_t) * 2 * (size_t)p->E, s>>>(*p);
    MT_CUDA_CHECK_LAUNCH();
    cu_prof_mark(&cb->base, "moe_experts_grouped (group)");
    switch (dt) {
    case MT_F32: moeg_gateup_launch_dt<MT_F32>(p, vec, s); break;
    case MT_F16: moeg_gateup_launch_dt<MT_F16>(p, vec, s); break;
    case MT_F8E4M3: moeg_gateup_launch_dt<MT_F8E4M3>(p, vec, s); break;
    default: moeg_gateup_launch_dt<MT_BF16>(p, vec, s); break;
    }
    MT_CUDA_CHECK_LAUNCH();
    cu_prof_mark(&cb->base, "moe_experts_grouped (gate/up)");
    switch (dt) {
    case MT_F32: moeg_down_launch_dt<MT_F32>(p, vec, s); break;
    case MT_F16: moeg_down_launch_dt<MT_F16>(p, vec, s); break;
    case MT_F8E4M3: moeg_down_launch_dt<MT_F8E4M3>(p, vec, s); break;
    default: moeg_down_launch_dt<MT_BF16>(p, vec, s); break;
    }
    MT_CUDA_CHECK_LAUNCH();
    cu_prof_mark(&cb->base, "moe_experts_grouped (down)");
    const int64_t blocks = ((int64_t)p->n * p->H + MOEG_THREADS - 1) / MOEG_THREADS;
    const int64_t cap = (int64_t)cu_sms(cb) * 8;
    moeg_combine_kernel<<<(unsigned)(blocks < cap ? blocks : cap), MOEG_THREADS, 0, s>>>(*p);
    MT_CUDA_CHECK_LAUNCH();
    return MT_OK;
}

/* ======================= expert tables on the device ======================= */

typedef struct moeg_table {
    const cu_backend *cb;   /* key: owning backend; NULL: free slot */
    const mt_expert *host;  /* key: the caller's array */
    int count;              /* E: experts [0, count) in dev */
    int cap;                /* entries copy holds, 6 * cap pointers in stage and dev */
    mt_expert *copy;        /* [cap] host copy of host[0, count), to revalidate */
    const void **stage;     /* [6 cap] host staging of dev */
    const void **dev;       /* [6 count] device: gate, up, down data of expert e at 3e + 0, 1, 2, then
                               their scales (NULL for float experts) at 3 count + 3e + 0, 1, 2 */
    bool vec_ok;            /* every weight's data 16-byte aligned */
} moeg_table;

/* All tables of the process. The mutex covers the host part of every call (a few microseconds
 * once warm), since backends on other threads share the slots. */
static struct {
    pthread_mutex_t mu;
    moeg_table t[MOEG_TABLES_MAX];
    int n;                  /* slots used so far */
    int next;               /* slot reused when full */
    int32_t *hidx;          /* [hcap] read-back indices (calls that do not follow moe_route) */
    size_t hcap;
} moeg_reg = {PTHREAD_MUTEX_INITIALIZER};

static void moeg_table_release(moeg_table *t) {
    if (t->dev) MT_CUDA_WARN(cudaFree(t->dev));
    free(t->copy);
    free(t->stage);
    memset(t, 0, sizeof *t);
}

extern "C" void cu_moe_grouped_free(cu_backend *cb) {
    if (!cb) return;
    MT_CUDA_WARN(cu_wait(&cb->base)); /* kernels may still read the tables */
    pthread_mutex_lock(&moeg_reg.mu);
    for (int k = 0; k < moeg_reg.n; k++)
        if (moeg_reg.t[k].cb == cb) moeg_table_release(&moeg_reg.t[k]);
    pthread_mutex_unlock(&moeg_reg.mu);
}

/* Whether a and b agree on what the kernels read (data pointers, dtype, shape) for [0, count). */
static bool moeg_same(const mt_expert *a, const mt_expert *b, int count) {
    for (int e = 0; e < count; e++) {
        const mt_weight *wa[3] = {&a[e].gate, &a[e].up, &a[e].down}, *wb[3] = {&b[e].gate, &b[e].up, &b[e].down};
        for (int m = 0; m < 3; m++)
            if (wa[m]->data != wb[m]->data || wa[m]->dtype != wb[m]->dtype || wa[m]->rows != wb[m]->rows ||
                wa[m]->cols != wb[m]->cols || wa[m]->scale != wb[m]->scale)
                return false;
    }
    return true;
}


static moeg_table *moeg_table_find(const cu_backend *cb, const mt_expert *experts) {
    for (int k = 0; k < moeg_reg.n; k++)
        if (moeg_reg.t[k].cb == cb && moeg_reg.t[k].host == experts) return &moeg_reg.t[k];
    return NULL;
}

/* (Re)builds t (NULL: a new slot) as the device copy of experts[0, need). Synchronises; must not
 * run during a capture. NULL on failure (logged, *st set). */
static moeg_table *moeg_table_build(cu_backend *cb, moeg_table *t, const mt_expert *experts, int need,
                                    int H, int I, mt_status *st) {
    cu_moe_check_experts(experts, need, H, I);
    if (!t) {
        for (int k = 0; k < moeg_reg.n && !t; k++)
            if (!moeg_reg.t[k].cb) t = &moeg_reg.t[k];
        if (!t && moeg_reg.n < MOEG_TABLES_MAX) t = &moeg_reg.t[moeg_reg.n++];
        if (!t) { /* full: reuse the oldest slot; its owner's kernels may still read it */
            t = &moeg_reg.t[moeg_reg.next];
            moeg_reg.next = (moeg_reg.next + 1) % MOEG_TABLES_MAX;
            MT_CUDA_(cudaDeviceSynchronize(), "cudaDeviceSynchronize(moe grouped table)", *st = mt_st_; return NULL);
        }
        t->count = 0;
    }
    /* Kernels queued earlier may read the old contents. */
    MT_CUDA_(cu_wait(&cb->base), "cudaStreamSynchronize(moe grouped table)", *st = mt_st_; return NULL);
    t->cb = cb;
    t->host = experts;
    if (need > t->cap) {
        if (t->dev) MT_CUDA_WARN(cudaFree(t->dev));
        free(t->copy);
        free(t->stage);
        t->dev = NULL;
        t->cap = t->count = 0;
        t->copy = (mt_expert *)malloc(sizeof(mt_expert) * (size_t)need);
        t->stage = (const void **)malloc(sizeof(void *) * 6 * (size_t)need);
        if (!t->copy || !t->stage || cudaMalloc((void **)&t->dev, sizeof(void *) * 6 * (size_t)need) != cudaSuccess) {
            (void)cudaGetLastError();
            mt_log(MT_LOG_ERROR, "cuda backend: moe_experts_grouped: out of memory for a table of %d experts", need);
            moeg_table_release(t); /* slot free again */
            *st = MT_ERR_NOMEM;
            return NULL;
        }
        t->cap = need;
    }
    t->count = 0; /* invalid until the copy below has landed */
    t->vec_ok = true;
    for (int e = 0; e < need; e++) {
        t->copy[e] = experts[e];
        t->stage[3 * e] = experts[e].gate.data;
        t->stage[3 * e + 1] = experts[e].up.data;
        t->stage[3 * e + 2] = experts[e].down.data;
        t->stage[3 * (size_t)need + 3 * e] = experts[e].gate.scale;
        t->stage[3 * (size_t)need + 3 * e + 1] = experts[e].up.scale;
        t->stage[3 * (size_t)need + 3 * e + 2] = experts[e].down.scale;
        for (int m = 0; m < 3; m++)
            if (!cu_aligned16(t->stage[3 * e + m])) t->vec_ok = false;
    }
    MT_CUDA_(cudaMemcpyAsync(t->dev, t->stage, sizeof(void *) * 6 * (size_t)need, cudaMemcpyHostToDevice,
                             cb->stream),
             "cudaMemcpyAsync(moe grouped table)", *st = mt_st_; return NULL);
    /* The staging must stay untouched until the transfer has read it. */
    MT_CUDA_(cu_wait(&cb->base), "cudaStreamSynchronize(moe grouped table)", *st = mt_st_; return NULL);
    t->count = need;
    return t;
}

/* 1 + the largest of idx[0, P) (device), read back: the table size an unrouted call needs.
 * Synchronises. 0 with *st set on failure. */
static int moeg_need_from_idx(cu_backend *cb, const int32_t *idx, int64_t P, mt_status *st) {
    if (moeg_reg.hcap < (size_t)P) {
        int32_t *h = (int32_t *)realloc(moeg_reg.hidx, sizeof(int32_t) * (size_t)P);
        if (!h) { *st = MT_ERR_NOMEM; return 0; }
        moeg_reg.hidx = h;
        moeg_reg.hcap = (size_t)P;
    }
    MT_CUDA_(cu_copy_to_host(&cb->base, moeg_reg.hidx, idx, sizeof(int32_t) * (size_t)P), "cudaMemcpyAsync(idx)",
             *st = mt_st_; return 0);
    int mx = -1;
    for (int64_t q = 0; q < P; q++) {
        MT_ASSERT(moeg_reg.hidx[q] >= 0);
        if (moeg_reg.hidx[q] > mx) mx = moeg_reg.hidx[q];
    }
    return mx + 1;
}

/* Scratch bytes for chunks of `pairs` pairs: start[E + 1], list[pairs], h[pairs, I], d[pairs, H]. */
static size_t moeg_scratch_bytes(int E, int64_t pairs, int H, int I) {
    return cu_align_up(sizeof(int32_t) * ((size_t)E + 1), 256) + cu_align_up(sizeof(int32_t) * (size_t)pairs, 256) +
           cu_align_up(sizeof(float) * (size_t)pairs * I, 256) +
           cu_align_up(sizeof(float) * (size_t)pairs * H, 256);
}

/* The op under moeg_reg.mu. */
static mt_status moeg_experts(cu_backend *cb, float *out, const float *x, const int32_t *idx,
                              const float *weights, const mt_expert *experts, int n, int top_k, int H,
                              int I, float L) {
    mt_status st = MT_OK;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    MT_CUDA_CHECK(cudaStreamIsCapturing(cb->stream, &cs));
    const bool capturing = cs != cudaStreamCaptureStatusNone;
    const int64_t P = (int64_t)n * top_k;
    moeg_table *t = moeg_table_find(cb, experts);

    /* How many table entries the indices can reach. */
    int need;
    if (cb->route_idx == idx && cb->route_len >= P) {
        need = cb->route_experts;
    } else if (capturing) {
        if (!t) {
            mt_log(MT_LOG_ERROR, "cuda backend: moe_experts_grouped: captured before an eager call built "
                   "the expert table (and idx is not the last moe_route output)");
            return MT_ERR_INVALID;
        }
        need = t->count; /* indices beyond it trap in the group kernel */
    } else if ((need = moeg_need_from_idx(cb, idx, P, &st)) == 0) {
        return st;
    }
    MT_ASSERT(need >= 1 && need <= MOEG_MAX_EXPERTS);
    if (!t || t->count < need || !moeg_same(t->copy, experts, need)) {
        if (capturing) {
            mt_log(MT_LOG_ERROR, "cuda backend: moe_experts_grouped: the expert table changed during a "
                   "capture; run the step eagerly first");
            return MT_ERR_INVALID;
        }
        if (!(t = moeg_table_build(cb, t, experts, need, H, I, &st))) return st;
    }

    const int chunk_rows = MOEG_CHUNK_PAIRS / top_k;
    const int64_t chunk_pairs = (int64_t)(n < chunk_rows ? n : chunk_rows) * top_k;
    MT_ASSERT(chunk_pairs * (H > I ? H : I) <= INT_MAX); /* 32-bit row offsets in the kernels */
    const size_t bytes = moeg_scratch_bytes(need, chunk_pairs, H, I);
    const cu_buf *sb = &cb->scratch[CU_SCRATCH_DENSE];
    if (capturing && (!sb->p || sb->bytes < bytes)) {
        mt_log(MT_LOG_ERROR, "cuda backend: moe_experts_grouped: %zu bytes of scratch needed during a "
               "capture (%zu held); run the step eagerly first", bytes, sb->bytes);
        return MT_ERR_INVALID;
    }
    char *scr = (char *)cu_scratch(&cb->base, CU_SCRATCH_DENSE, bytes);
    if (!scr) return MT_ERR_NOMEM;

    const mt_dtype dt = t->copy[0].gate.dtype;
    const bool fp8 = dt == MT_F8E4M3;
    const int V = dt == MT_F32 ? 4 : fp8 ? 16 : 8;
    const bool vec = t->vec_ok && H % V == 0 && I % V == 0 && cu_aligned16(x);
    moeg_params p = {};
    p.start = (int32_t *)scr;
    p.list = (int32_t *)(scr + cu_align_up(sizeof(int32_t) * ((size_t)need + 1), 256));
    p.h = (float *)((char *)p.list + cu_align_up(sizeof(int32_t) * (size_t)chunk_pairs, 256));
    p.d = (float *)((char *)p.h + cu_align_up(sizeof(float) * (size_t)chunk_pairs * I, 256));
    p.w = t->dev;
    p.s = (const float *const *)(t->dev + 3 * (size_t)t->count);
    p.ldgu = fp8 ? cu_fp8_kpad(H) : H;
    p.lddn = fp8 ? cu_fp8_kpad(I) : I;
    p.E = need;
    p.top_k = top_k;
    p.H = H;
    p.I = I;
    p.L = L;
    for (int r0 = 0; r0 < n && st == MT_OK; r0 += chunk_rows) {
        const int r1 = n - r0 < chunk_rows ? n : r0 + chunk_rows;
        p.out = out + (int64_t)r0 * H;
        p.x = x + (int64_t)r0 * H;
        p.idx = idx + (int64_t)r0 * top_k;
        p.wts = weights + (int64_t)r0 * top_k;
        p.n = r1 - r0;
        st = moeg_launch(cb, &p, dt, vec);
    }
    return st;
}

/* ================================ the op ================================ */

extern "C" void cu_moe_experts_grouped(mt_backend *be, float *out, const float *x, const int32_t *idx,
                                       const float *weights, const mt_expert *experts, int n, int top_k,
                                       int H, int I, float L) {
    MT_ASSERT(n >= 0 && top_k >= 1 && top_k <= MOEG_MAX_TOPK && H > 0 && I > 0);
    MT_ASSERT((int64_t)n * top_k <= INT_MAX / 2);
    if (n == 0) return;
    pthread_mutex_lock(&moeg_reg.mu);
    const mt_status st = moeg_experts((cu_backend *)be, out, x, idx, weights, experts, n, top_k, H, I, L);
    pthread_mutex_unlock(&moeg_reg.mu);
    cu_op_status(be, "moe_experts_grouped", st);
}
