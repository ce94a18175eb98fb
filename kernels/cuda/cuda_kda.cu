/* kernels/cuda/cuda_kda.cu: the KDA (Kimi Delta Attention) mixer's ops on the GPU, computing the
 * same functions as kernels/cpu/cpu_kda.c: causal depthwise conv with state + SiLU, the decay
 * gate, the recurrent delta rule (decode) and the gated output norm; the chunked delta rule
 * (prefill) is cuda_kda_chunk.cu. Three tiers per op: static kernels, a static launcher that
 * picks the grid, and the op that checks shapes.
 *
 * The delta rule's value columns are independent of each other (row i of the state decays by
 * exp(g[i]) for every column; u, delta and o are per column), so the recurrent kernels give one
 * block a head and a group of value columns, and keep that slice of the state on chip for all n
 * steps: read once, written once. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"

enum {
    KDA_MAX_DK = 128, /* head dim bound of the recurrent kernels (state slice on chip) */
    CONV_MAX_K = 8,   /* conv kernel bound (register history) */
    CONV_TSEG = 64,   /* time steps per thread in conv1d_silu */
    EW_BLOCK = 256,
};

/* ------------------------------------------------------------------------------------------ */
/* conv1d_silu                                                                                  */

typedef struct conv_params {
    float *out;        /* [n, C] */
    const float *x;    /* [n, C] */
    float *state;      /* [C, K-1] previous inputs, oldest first; updated by conv_state_kernel */
    const float *w;    /* [C, K] */
    int n, C, K;
} conv_params;

/* Thread = (channel c, time segment of CONV_TSEG steps). The K-1 inputs before the segment come
 * from x or, before time 0, from the state; they slide through a register window. KT > 0: the
 * kernel size known at compile time (the model's 4), which takes the window's bounds tests out of
 * every step: with them the kernel was issue-bound (SM throughput 70%, DRAM 30% at 4096 x 8192 on
 * the H200: 177 us where the bytes take ~65).
 * The inputs are loaded CONV_BATCH steps at a time before any of their outputs is stored (x and
 * out never alias: cu_conv1d_silu asserts it), so a thread has that many loads in flight rather
 * than one: the 9 calls of a 4096-token prefill 0.98 -> 0.85 ms on the H200 (16 steps: 0.83). */
enum { CONV_BATCH = 8 };
/* Channel c's conv + SiLU over steps [ta, tb): put(t, y) takes each output, in order of t. */
template <int KT, typename Put>
static __device__ __forceinline__ void conv_stretch(const conv_params &p, const float *__restrict__ x, int c, int ta,
                                                    int tb, Put put) {
    const int K = KT > 0 ? KT : p.K;
    const int P = K - 1;
    float wk[CONV_MAX_K], hist[CONV_MAX_K];
#pragma unroll
    for (int k = 0; k < CONV_MAX_K; k++) {
        wk[k] = k < K ? p.w[(size_t)c * K + k] : 0.f;
        const int pos = ta - P + k; /* hist[k] = input at time ta - P + k */
        hist[k] = 0.f;
        if (k < P) hist[k] = pos < 0 ? p.state[(size_t)c * P + (pos + P)] : x[(size_t)pos * p.C + c];
    }
    for (int t0 = ta; t0 < tb; t0 += CONV_BATCH) {
        float xb[CONV_BATCH];
#pragma unroll
        for (int u = 0; u < CONV_BATCH; u++) xb[u] = t0 + u < tb ? x[(size_t)(t0 + u) * p.C + c] : 0.f;
#pragma unroll
        for (int u = 0; u < CONV_BATCH; u++) {
            if (t0 + u >= tb) break;
            const float xv = xb[u];
            float a = 0.f;
#pragma unroll
            for (int k = 0; k < CONV_MAX_K; k++) {
                if (k < P) a += wk[k] * hist[k];
                else if (k == P) a += wk[k] * xv;
            }
            put(t0 + u, a / (1.f + expf(-a)));
#pragma unroll
            for (int k = 0; k < CONV_MAX_K - 1; k++) {
                if (k < P - 1) hist[k] = hist[k + 1];
                else if (k == P - 1) hist[k] = xv;
            }
        }
    }
}

template <int KT> static __global__ void conv1d_silu_kernel(conv_params p) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= p.C) return;
    float *__restrict__ out = p.out;
    const int ta = blockIdx.y * CONV_TSEG, tb = ta + CONV_TSEG < p.n ? ta + CONV_TSEG : p.n;
    const int C = p.C;
    conv_stretch<KT>(p, p.x, c, ta, tb, [=](int t, float y) { out[(size_t)t * C + c] = y; });
}

/* New state[c] = the last K-1 inputs of (old state ++ x). One thread per channel, ascending, so
 * the old entries it still needs (index j + n > j) are read before being overwritten. Runs after
 * conv1d_silu_kernel or conv_norm_kernel, which read the old state. */
static __global__ void conv_state_kernel(conv_params p) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= p.C) return;
    const int P = p.K - 1;
    float *st = p.state + (size_t)c * P;
    for (int j = 0; j < P; j++) {
        const int pos = p.n - P + j;
        st[j] = pos >= 0 ? p.x[(size_t)pos * p.C + c] : st[j + p.n];
    }
}

/* The state update after a conv over p->n steps (either conv kernel): nothing to keep at K = 1. */
static void conv_state_launch(mt_backend *be, const conv_params *p) {
    if (p->K > 1) {
        conv_state_kernel<<<(p->C + EW_BLOCK - 1) / EW_BLOCK, EW_BLOCK, 0, cu_stream(be)>>>(*p);
        cu_check_launch(be, "conv1d_silu (state)");
    }
}

static void conv1d_silu_launch(mt_backend *be, const conv_params *p) {
    const dim3 grid((p->C + EW_BLOCK - 1) / EW_BLOCK, (p->n + CONV_TSEG - 1) / CONV_TSEG);
    if (p->K == 4) conv1d_silu_kernel<4><<<grid, EW_BLOCK, 0, cu_stream(be)>>>(*p);
    else conv1d_silu_kernel<0><<<grid, EW_BLOCK, 0, cu_stream(be)>>>(*p);
    cu_check_launch(be, "conv1d_silu");
    conv_state_launch(be, p);
}

static void cu_conv1d_silu(mt_backend *be, float *out, const float *x, float *state,
                           const float *w, int n, int C, int K) {
    MT_ASSERT(n >= 0 && C > 0 && K >= 1 && K <= CONV_MAX_K);
    MT_ASSERT(out != x); /* segments of one channel run in parallel and read earlier inputs */
    if (n == 0) return;
    const conv_params p = {out, x, state, w, n, C, K};
    conv1d_silu_launch(be, &p);
}

/* conv1d_silu_l2norm: the conv of a KDA head's channels over a stretch of time steps into shared
 * memory, then each step's head row l2-normalised from there (the q and k of a prefill: the
 * separate l2norm pass read and wrote both again). Block = (head h, CN_TSEG steps), a thread a
 * channel for the conv (conv_stretch, as conv1d_silu_kernel: loads CONV_BATCH steps ahead), a warp a
 * step's row for the norm (sum of squares in float, a lane's channels in order then the warp's
 * butterfly; the CPU's l2norm sums in float too), so the row's stores are a warp's consecutive
 * floats. dk <= CN_MAX_DK (the shared stretch is CN_TSEG x dk floats, 16 KB at 128). */
enum { CN_TSEG = 32, CN_MAX_DK = 128, CN_BLOCKS_PER_SM = 12 /* 1536 threads: 40 registers */ };
template <int KT>
static __global__ void __launch_bounds__(CN_MAX_DK, CN_BLOCKS_PER_SM)
    conv_norm_kernel(conv_params p, int dk, float eps, float scale) {
    __shared__ float ys[CN_TSEG * CN_MAX_DK];
    const int h = blockIdx.x, t = threadIdx.x;
    const int ta = blockIdx.y * CN_TSEG, tb = ta + CN_TSEG < p.n ? ta + CN_TSEG : p.n;
    if (t < dk) conv_stretch<KT>(p, p.x, h * dk + t, ta, tb, [&](int s, float y) { ys[(s - ta) * dk + t] = y; });
    __syncthreads();
    const int lane = t & 31, nw = blockDim.x >> 5;
    for (int u = t >> 5; u < tb - ta; u += nw) {
        const float *y = ys + u * dk;
        float ss = 0.f;
        for (int j = lane; j < dk; j += 32) ss = fmaf(y[j], y[j], ss);
        const float r = scale / sqrtf(cu_warp_sum(ss) + eps);
        float *o = p.out + (size_t)(ta + u) * p.C + (size_t)h * dk;
        for (int j = lane; j < dk; j += 32) o[j] = __fmul_rn(y[j], r);
    }
}

static bool cu_conv1d_silu_l2norm(mt_backend *be, float *out, const float *x, float *state, const float *w, int n,
                                  int C, int K, int dk, float eps, float scale) {
    MT_ASSERT(n >= 0 && C > 0 && K >= 1 && K <= CONV_MAX_K && dk > 0 && C % dk == 0);
    MT_ASSERT(out != x); /* stretches of one channel run in parallel and read earlier inputs */
    if (dk > CN_MAX_DK || (n + CN_TSEG - 1) / CN_TSEG > 65535 /* grid.y */) return false;
    if (n == 0) return true;
    const conv_params p = {out, x, state, w, n, C, K};
    const dim3 grid((unsigned)(C / dk), (unsigned)((n + CN_TSEG - 1) / CN_TSEG)), block((unsigned)((dk + 31) / 32 * 32));
    if (K == 4) conv_norm_kernel<4><<<grid, block, 0, cu_stream(be)>>>(p, dk, eps, scale);
    else conv_norm_kernel<0><<<grid, block, 0, cu_stream(be)>>>(p, dk, eps, scale);
    cu_check_launch(be, "conv1d_silu_l2norm");
    conv_state_launch(be, &p);
    return true;
}

/* ------------------------------------------------------------------------------------------ */
/* kda_gate                                                                                     */

typedef struct gate_params {
    float *g;              /* [n, nh*dk]; may alias f */
    const float *f;        /* [n, nh*dk] */
    const float *dt_bias;  /* [nh*dk] */
    const float *A_log;    /* [nh] */
    int64_t count;         /* n * nh * dk */
    int D, dk;             /* nh * dk, dk */
    bool has_lower_bound;
    float lower_bound;
} gate_params;

static __global__ void kda_gate_kernel(gate_params p) {
    cu_pdl_wait(); /* launched for PDL (cu_launch_pdl_k) */
    cu_pdl_trigger();
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < p.count; e += stride) {
        const int c = (int)(e % p.D);
        p.g[e] = cu_kda_gate_value(p.f[e], p.dt_bias[c], p.A_log[c / p.dk], p.has_lower_bound, p.lower_bound);
    }
}

/* Many rows (prefill): block = one row, thread = float4 groups tid, tid + 256, ... (up to
 * GATE_VEC of them, loaded before the first is used), one A_log per group (dk % 4 == 0). The
 * grid-stride form above did a 64-bit division per element with one load in flight a thread: 190
 * us for 4096 x 8192 on the H200, where the bytes take ~65; this form 85 us. */
enum { GATE_VEC = 8, GATE_ROW_MIN = 64 /* rows from which the row form runs (rows of 1024+) */ };

static __global__ void __launch_bounds__(EW_BLOCK) kda_gate_rows_kernel(gate_params p) {
    cu_pdl_wait(); /* launched for PDL (cu_launch_pdl_k) */
    cu_pdl_trigger();
    const int D4 = p.D >> 2, dk4 = p.dk >> 2;
    const float4 *f = reinterpret_cast<const float4 *>(p.f) + (size_t)blockIdx.x * D4;
    float4 *g = reinterpret_cast<float4 *>(p.g) + (size_t)blockIdx.x * D4;
    const float4 *bias = reinterpret_cast<const float4 *>(p.dt_bias);
    for (int c0 = threadIdx.x; c0 < D4; c0 += GATE_VEC * EW_BLOCK) {
        float4 x[GATE_VEC];
#pragma unroll
        for (int u = 0; u < GATE_VEC; u++) {
            const int c = c0 + u * EW_BLOCK;
            x[u] = c < D4 ? f[c] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < GATE_VEC; u++) {
            const int c = c0 + u * EW_BLOCK;
            if (c >= D4) break;
            const float4 b = bias[c];
            const float al = p.A_log[c / dk4];
            g[c] = make_float4(cu_kda_gate_value(x[u].x, b.x, al, p.has_lower_bound, p.lower_bound),
                               cu_kda_gate_value(x[u].y, b.y, al, p.has_lower_bound, p.lower_bound),
                               cu_kda_gate_value(x[u].z, b.z, al, p.has_lower_bound, p.lower_bound),
                               cu_kda_gate_value(x[u].w, b.w, al, p.has_lower_bound, p.lower_bound));
        }
    }
}

static void kda_gate_launch(mt_backend *be, const gate_params *p) {
    const int64_t rows = p->count / p->D;
    if (rows >= GATE_ROW_MIN && rows <= 0x7fffffff && p->D / 4 >= EW_BLOCK && p->dk % 4 == 0 &&
        cu_aligned16(p->f) && cu_aligned16(p->g) && cu_aligned16(p->dt_bias)) {
        cu_launch_pdl_k(kda_gate_rows_kernel, dim3((unsigned)rows), dim3(EW_BLOCK), 0, cu_stream(be), *p);
        cu_check_launch(be, "kda_gate");
        return;
    }
    int64_t blocks = (p->count + EW_BLOCK - 1) / EW_BLOCK;
    if (blocks > 65536) blocks = 65536;
    cu_launch_pdl_k(kda_gate_kernel, dim3((unsigned)blocks), dim3(EW_BLOCK), 0, cu_stream(be), *p);
    cu_check_launch(be, "kda_gate");
}

static void cu_kda_gate(mt_backend *be, float *g, const float *f, const float *dt_bias,
                        const float *A_log, const mt_kda_gate_params *p, int n) {
    MT_ASSERT(n >= 0 && p->nh > 0 && p->dk > 0);
    if (n == 0) return;
    const gate_params gp = {g, f, dt_bias, A_log, (int64_t)n * p->nh * p->dk, p->nh * p->dk, p->dk,
                            p->has_lower_bound, p->lower_bound};
    kda_gate_launch(be, &gp);
}

/* ------------------------------------------------------------------------------------------ */
/* Delta rule                                                                                   */

typedef struct delta_params {
    float *o;              /* [n, nh, dk] */
    const float *q, *k;    /* [n, nh, dk], l2-normalised, q pre-scaled */
    const float *v, *g;    /* [n, nh, dk] */
    const float *beta;     /* [n, nh] */
    float *state;          /* [nh, dk(k), dk(v)] fp32, updated */
    int n, nh, dk;
    float *const *states;  /* rows form (batched decode): row t of the inputs is one step on its own
                            * state states[t] (device table [n]); the recurrent kernels then take
                            * the row from blockIdx.z / blockIdx.y and ignore state */
} delta_params;

enum {
    REC_COLS = 32,                          /* value columns per block = lanes */
    REC_WARPS = 8,                          /* row groups */
    REC_ROWS = KDA_MAX_DK / REC_WARPS,      /* state rows per thread, in registers */
};

/* Block = (head, 32 value columns); thread (warp w, lane) holds state rows w, w+8, ... of column
 * j0+lane in registers. Per step: decay, u = k^T S (partials reduced over warps through shared
 * memory), delta, rank-1 update, o = q^T S. Step inputs are double-buffered so three barriers a
 * step suffice. */
static __global__ void __launch_bounds__(REC_WARPS * 32)
kda_recurrent_kernel(delta_params p) {
    const int h = blockIdx.x, j0 = blockIdx.y * REC_COLS;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, dk = p.dk;
    const int j = j0 + lane;
    const bool jok = j < dk;
    __shared__ float qs[2][KDA_MAX_DK], ks[2][KDA_MAX_DK], es[2][KDA_MAX_DK]; /* step inputs */
    __shared__ float vs[2][REC_COLS], bs[2];
    __shared__ float red_u[REC_WARPS][REC_COLS], red_o[REC_WARPS][REC_COLS];

    const int row = blockIdx.z; /* rows form: one step, row `row`, on states[row] */
    float *S = (p.states ? p.states[row] : p.state) + (size_t)h * dk * dk;
    const int t0 = p.states ? row : 0, t1 = p.states ? row + 1 : p.n;
    float s[REC_ROWS];
#pragma unroll
    for (int r = 0; r < REC_ROWS; r++) {
        const int i = w + REC_WARPS * r;
        s[r] = (i < dk && jok) ? S[(size_t)i * dk + j] : 0.f;
    }
    for (int t = t0; t < t1; t++) {
        const int buf = (t - t0) & 1;
        const size_t off = ((size_t)t * p.nh + h) * dk;
        if (tid < dk) {
            qs[buf][tid] = p.q[off + tid];
            ks[buf][tid] = p.k[off + tid];
            es[buf][tid] = expf(p.g[off + tid]);
        }
        if (tid < REC_COLS) vs[buf][tid] = j0 + tid < dk ? p.v[off + j0 + tid] : 0.f;
        if (tid == 0) bs[buf] = p.beta[(size_t)t * p.nh + h];
        __syncthreads();
        float u = 0.f;
#pragma unroll
        for (int r = 0; r < REC_ROWS; r++) {
            const int i = w + REC_WARPS * r;
            if (i < dk) {
                s[r] *= es[buf][i];
                u += ks[buf][i] * s[r];
            }
        }
        red_u[w][lane] = u;
        __syncthreads();
        u = 0.f;
#pragma unroll
        for (int ww = 0; ww < REC_WARPS; ww++) u += red_u[ww][lane];
        const float delta = bs[buf] * (vs[buf][lane] - u);
        float o = 0.f;
#pragma unroll
        for (int r = 0; r < REC_ROWS; r++) {
            const int i = w + REC_WARPS * r;
            if (i < dk) {
                s[r] += ks[buf][i] * delta;
                o += qs[buf][i] * s[r];
            }
        }
        red_o[w][lane] = o;
        __syncthreads();
        if (w == 0 && jok) {
            o = 0.f;
#pragma unroll
            for (int ww = 0; ww < REC_WARPS; ww++) o += red_o[ww][lane];
            p.o[off + j] = o;
        }
    }
#pragma unroll
    for (int r = 0; r < REC_ROWS; r++) {
        const int i = w + REC_WARPS * r;
        if (i < dk && jok) S[(size_t)i * dk + j] = s[r];
    }
}

/* ---- decode (n == 1) ----
 * One step streams the state through once, so the kernel is a copy with two reductions in the
 * middle; it is built to keep many bytes in flight. Block = (head, 64 value columns), 256
 * threads; lane = (row parity sub, column group c4): thread (warp w, lane) owns the 4 consecutive
 * columns j0+4*c4.. of rows 2w+sub+16r (r < 8), loaded as float4 (a warp reads two rows' 256-byte
 * segments per instruction). All 8 loads are issued before the first use; the step inputs are
 * staged in shared memory meanwhile. Using S' = diag(e) S:
 *   u = k^T S', w = q^T S', qk = q.k     (one reduction: shuffle over sub, shared over warps)
 *   delta = beta (v - u), S'' = S' + k delta^T, o = q^T S'' = w + qk delta
 * so a step costs a single reduction barrier. Requires dk % 4 == 0 and 16-byte aligned state, v,
 * o (cu_kda_recurrent falls back to kda_recurrent_kernel otherwise).
 * The state is loaded with plain (cache-all, ld.global.ca) loads and stored streaming
 * (st.global.cs): on the H200 at B = 32 x 64 heads that moved it 2% faster than streaming loads
 * (ld.global.cs), flushed or back to back; read-only (.nc), last-use (.lu), evict-first policy and
 * 256-byte L2 prefetch loads were no better, plain stores 6% slower. */
enum {
    DEC_THREADS = 256,
    DEC_COLS = 64,                               /* value columns per block */
    DEC_GROUPS = DEC_COLS / 4,                   /* float4 column groups = 16 lanes */
    DEC_WARPS = DEC_THREADS / 32,
    DEC_PASS = DEC_THREADS / DEC_GROUPS,         /* rows covered per pass: 16 */
    DEC_ROWS = KDA_MAX_DK / DEC_PASS,            /* rows per thread: 8 */
};

/* 80 registers with 3 blocks a SM, no spills (a dk = 128 specialisation spilled at that cap; 4
 * blocks a SM spill 112 bytes and stream at 66% of the copy bandwidth instead of 85%) */
enum { DEC_BLOCKS_PER_SM = 3 };
static __global__ void __launch_bounds__(DEC_THREADS, DEC_BLOCKS_PER_SM) kda_decode_kernel(delta_params p) {
    const int dk = p.dk, nblk = (dk + DEC_COLS - 1) / DEC_COLS;
    const int h = blockIdx.x / nblk, j0 = (blockIdx.x - h * nblk) * DEC_COLS;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int c4 = lane & (DEC_GROUPS - 1), sub = lane >> 4;
    const int j = j0 + 4 * c4, rbase = 2 * w + sub;
    const bool jok = j < dk; /* dk % 4 == 0: the whole group is in range */
    const int ld4 = dk >> 2;
    __shared__ float qs[KDA_MAX_DK], ks[KDA_MAX_DK], es[KDA_MAX_DK];
    __shared__ float4 red_u[DEC_WARPS][DEC_GROUPS], red_w[DEC_WARPS][DEC_GROUPS];
    __shared__ float red_qk[DEC_WARPS];

    const int row = blockIdx.y; /* rows form: input row `row` on states[row]; else 0 */
    float4 *S = reinterpret_cast<float4 *>((p.states ? p.states[row] : p.state) + (size_t)h * dk * dk) + (j >> 2);
    /* The state slice (dk rows x 256 bytes) into L2 while the kernel before runs: no kernel of
     * this step writes it before us (the pointer tables are uploaded before the step). Launched
     * for PDL (cu_launch_pdl_k); prefetches, as the loads would be scheduled after the wait. */
    for (int e = tid; e < dk * 2; e += DEC_THREADS)
        if (j0 + (e & 1) * 32 < dk)
            asm volatile("prefetch.global.L2 [%0];" ::"l"((const char *)(S - (j >> 2)) + ((size_t)(e >> 1) * dk + j0) * 4 +
                                                          (e & 1) * 128));
    cu_pdl_wait();
    cu_pdl_trigger();
    float4 s[DEC_ROWS];
#pragma unroll
    for (int r = 0; r < DEC_ROWS; r++) {
        const int i = rbase + DEC_PASS * r; /* < KDA_MAX_DK */
        s[r] = (i < dk && jok) ? __ldca(S + (size_t)i * ld4) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    const size_t off = ((size_t)row * p.nh + h) * dk;
    const float4 v4 = jok ? *reinterpret_cast<const float4 *>(p.v + off + j)
                          : make_float4(0.f, 0.f, 0.f, 0.f);
    const float b = p.beta[(size_t)row * p.nh + h];
    if (tid < KDA_MAX_DK) { /* rows past dk read zeros, never uninitialised shared memory */
        const bool ok = tid < dk;
        qs[tid] = ok ? p.q[off + tid] : 0.f;
        ks[tid] = ok ? p.k[off + tid] : 0.f;
        es[tid] = ok ? expf(p.g[off + tid]) : 0.f;
    }
    __syncthreads();

    float4 u = make_float4(0.f, 0.f, 0.f, 0.f), wq = u;
    float qk = 0.f;
#pragma unroll
    for (int r = 0; r < DEC_ROWS; r++) {
        const int i = rbase + DEC_PASS * r;
        const float e = es[i], kk = ks[i], qq = qs[i];
        s[r].x *= e; s[r].y *= e; s[r].z *= e; s[r].w *= e;
        u.x += kk * s[r].x; u.y += kk * s[r].y; u.z += kk * s[r].z; u.w += kk * s[r].w;
        wq.x += qq * s[r].x; wq.y += qq * s[r].y; wq.z += qq * s[r].z; wq.w += qq * s[r].w;
        qk += qq * kk;
    }
    /* the two row parities of a warp: lanes l and l^16 (same sums either way round) */
    u.x += __shfl_xor_sync(0xffffffffu, u.x, 16);
    u.y += __shfl_xor_sync(0xffffffffu, u.y, 16);
    u.z += __shfl_xor_sync(0xffffffffu, u.z, 16);
    u.w += __shfl_xor_sync(0xffffffffu, u.w, 16);
    wq.x += __shfl_xor_sync(0xffffffffu, wq.x, 16);
    wq.y += __shfl_xor_sync(0xffffffffu, wq.y, 16);
    wq.z += __shfl_xor_sync(0xffffffffu, wq.z, 16);
    wq.w += __shfl_xor_sync(0xffffffffu, wq.w, 16);
    qk += __shfl_xor_sync(0xffffffffu, qk, 16);
    if (sub == 0) {
        red_u[w][c4] = u;
        red_w[w][c4] = wq;
    }
    if (lane == 0) red_qk[w] = qk;
    __syncthreads();
    u = red_u[0][c4];
    wq = red_w[0][c4];
    qk = red_qk[0];
#pragma unroll
    for (int ww = 1; ww < DEC_WARPS; ww++) { /* same order in every thread: deterministic */
        const float4 a = red_u[ww][c4], c = red_w[ww][c4];
        u.x += a.x; u.y += a.y; u.z += a.z; u.w += a.w;
        wq.x += c.x; wq.y += c.y; wq.z += c.z; wq.w += c.w;
        qk += red_qk[ww];
    }
    const float4 d = make_float4(b * (v4.x - u.x), b * (v4.y - u.y), b * (v4.z - u.z),
                                 b * (v4.w - u.w));
    if (!jok) return; /* no barrier follows */
#pragma unroll
    for (int r = 0; r < DEC_ROWS; r++) {
        const int i = rbase + DEC_PASS * r;
        if (i < dk) {
            const float kk = ks[i];
            s[r].x += kk * d.x; s[r].y += kk * d.y; s[r].z += kk * d.z; s[r].w += kk * d.w;
            __stcs(S + (size_t)i * ld4, s[r]);
        }
    }
    if (w == 0 && sub == 0)
        *reinterpret_cast<float4 *>(p.o + off + j) =
            make_float4(wq.x + qk * d.x, wq.y + qk * d.y, wq.z + qk * d.z, wq.w + qk * d.w);
}

/* Single sequence: n steps on state. Rows form (p->states): n rows, one step each on its own state,
 * laid out as n single steps (grid y or z = row); device allocations keep the states 16-byte
 * aligned, which the decode kernel needs (checked for the single state only). */
static void kda_recurrent_launch(mt_backend *be, const delta_params *p) {
    const bool rows = p->states != NULL;
    const bool aligned =
        (((uintptr_t)(rows ? NULL : p->state) | (uintptr_t)p->v | (uintptr_t)p->o) & 15) == 0;
    if ((p->n == 1 || rows) && p->dk % 4 == 0 && aligned) {
        const int64_t blocks = (int64_t)p->nh * ((p->dk + DEC_COLS - 1) / DEC_COLS);
        MT_ASSERT(blocks <= 0x7fffffff && (!rows || p->n <= 65535));
        cu_launch_pdl_k(kda_decode_kernel, dim3(dim3((unsigned)blocks, rows ? p->n : 1)), dim3(DEC_THREADS), 0, cu_stream(be), *p);
        cu_check_launch(be, rows ? "kda_recurrent_rows (decode)" : "kda_recurrent (decode)");
        return;
    }
    const dim3 grid(p->nh, (p->dk + REC_COLS - 1) / REC_COLS, rows ? p->n : 1);
    kda_recurrent_kernel<<<grid, REC_WARPS * 32, 0, cu_stream(be)>>>(*p);
    cu_check_launch(be, "kda_recurrent");
}

static void cu_kda_recurrent(mt_backend *be, float *o, const float *q, const float *k,
                             const float *v, const float *g, const float *beta, float *state,
                             int n, int nh, int dk) {
    MT_ASSERT(n >= 0 && nh > 0 && dk > 0 && dk <= KDA_MAX_DK);
    if (n == 0) return;
    const delta_params p = {o, q, k, v, g, beta, state, n, nh, dk, NULL};
    kda_recurrent_launch(be, &p);
}

static void cu_kda_recurrent_rows(mt_backend *be, float *o, const float *q, const float *k,
                                  const float *v, const float *g, const float *beta,
                                  float *const *states, int n, int nh, int dk) {
    MT_ASSERT(n >= 0 && nh > 0 && dk > 0 && dk <= KDA_MAX_DK && states);
    if (n == 0) return;
    const delta_params p = {o, q, k, v, g, beta, NULL, n, nh, dk, states};
    kda_recurrent_launch(be, &p);
}

/* ------------------------------------------------------------------------------------------ */
/* gated_rmsnorm                                                                                */

typedef struct gnorm_params {
    float *out;           /* [rows, d]; may alias o */
    const float *o;       /* [rows, d] */
    const float *gate;    /* [rows, d] */
    const float *w;       /* [d] */
    int64_t rows;
    int d;
    float eps;
} gnorm_params;

enum { GNORM_WARPS = 8 };

/* One warp per row. */
enum { GNORM_PER = 8 }; /* elements a lane holds in the register form: d <= 256 */
static __global__ void gated_rmsnorm_kernel(gnorm_params p) {
    cu_pdl_wait(); /* launched for PDL (cu_launch_pdl_k) */
    cu_pdl_trigger();
    const int64_t r = (int64_t)blockIdx.x * GNORM_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= p.rows) return;
    const float *x = p.o + r * p.d, *gt = p.gate + r * p.d;
    float *y = p.out + r * p.d;
    if (p.d <= 32 * GNORM_PER) { /* every load of the row (x, gate, w) issued before the sum */
        float xv[GNORM_PER], gv[GNORM_PER], wv[GNORM_PER];
#pragma unroll
        for (int u = 0; u < GNORM_PER; u++) {
            const int j = lane + 32 * u;
            const bool in = j < p.d;
            xv[u] = in ? x[j] : 0.f;
            gv[u] = in ? gt[j] : 0.f;
            wv[u] = in ? p.w[j] : 0.f;
        }
        float ss = 0.f;
#pragma unroll
        for (int u = 0; u < GNORM_PER; u++) ss += xv[u] * xv[u];
#pragma unroll
        for (int m = 16; m > 0; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
        const float rs = 1.f / sqrtf(ss / (float)p.d + p.eps);
#pragma unroll
        for (int u = 0; u < GNORM_PER; u++)
            if (lane + 32 * u < p.d) y[lane + 32 * u] = wv[u] * (xv[u] * rs) * cu_sigmoidf(gv[u]);
        return;
    }
    float ss = 0.f;
    for (int j = lane; j < p.d; j += 32) ss += x[j] * x[j];
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
    const float rs = 1.f / sqrtf(ss / (float)p.d + p.eps);
    for (int j = lane; j < p.d; j += 32) y[j] = p.w[j] * (x[j] * rs) * cu_sigmoidf(gt[j]);
}

static void gated_rmsnorm_launch(mt_backend *be, const gnorm_params *p) {
    const int64_t blocks = (p->rows + GNORM_WARPS - 1) / GNORM_WARPS;
    cu_launch_pdl_k(gated_rmsnorm_kernel, dim3((unsigned)blocks), dim3(GNORM_WARPS * 32), 0, cu_stream(be), *p);
    cu_check_launch(be, "gated_rmsnorm");
}

static void cu_gated_rmsnorm(mt_backend *be, float *out, const float *o, const float *gate,
                             const float *w, int64_t rows, int d, float eps) {
    MT_ASSERT(rows >= 0 && d > 0 && (rows + GNORM_WARPS - 1) / GNORM_WARPS < 0x7fffffff);
    if (rows == 0) return;
    const gnorm_params p = {out, o, gate, w, rows, d, eps};
    gated_rmsnorm_launch(be, &p);
}

extern "C" void cu_kda_fill(mt_backend_ops *t) {
    t->conv1d_silu = cu_conv1d_silu;
    t->conv1d_silu_l2norm = cu_conv1d_silu_l2norm;
    t->kda_gate = cu_kda_gate;
    t->kda_recurrent = cu_kda_recurrent;
    t->kda_recurrent_rows = cu_kda_recurrent_rows;
    t->gated_rmsnorm = cu_gated_rmsnorm;
}
