/* kernels/cuda/cuda_ple.cu: the injection of a PLE memory (kernels/backend.h ple_inject,
 * docs/MODEL.md "PLE layer"), fp32 with the norms' and the gate's sums in double as the CPU's
 * (kernels/cpu/cpu_ple.c). The CPU runs the rows one after the other; here three launches run
 * every row at once:
 *   1. gate_kernel, a block per (row, stream): the gate, and the conv input c = RMSNorm(gate v;
 *      conv_norm) into scratch; block (row, 0) also finds where the row's run of rows (the
 *      consecutive rows sharing its state pointer: one sequence's) starts;
 *   2. inject_kernel, a thread per (row, channel): the dilated conv over the sequence's history
 *      (its state rows, then the c of the run's earlier rows), X += gate v + silu(conv); reads
 *      the states only;
 *   3. state_kernel, a thread per (run's last row, channel): the state moves on by the run's rows.
 * Kernel boundaries order the three: (2) reads every row's c, (3) overwrites what (2) read.
 * Also ple_gather_rows (below). */
#include <math.h>
#include <stdint.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"

enum { PLE_THREADS = 256 };

typedef struct ple_params {
    float *X;                   /* [n, S, H] the highway rows, updated in place */
    const float *keys;          /* [n, S*H] */
    const float *vals;          /* [n, H] */
    float *const *states;       /* [n] -> [P, S*H], oldest row first; a run of rows shares one */
    const float *key_norm;      /* [S, H] */
    const float *query_norm;    /* [S, H] */
    const float *conv_norm;     /* [S, H] */
    const float *conv_w;        /* [S*H, K] */
    float *c;                   /* [n, S*H] scratch: the conv inputs */
    float *gate;                /* [n, S] scratch */
    int32_t *run0;              /* [n] scratch: the first row of each row's run */
    int n, S, H, K, dil, P;     /* P = (K-1) * dil state rows */
    float eps;
} ple_params;

/* 1 / sqrt(mean + eps) from a sum of squares over d values, as the CPU's inv_rms. */
static __device__ __forceinline__ float ple_inv_rms(double ss, int d, float eps) {
    return 1.f / sqrtf((float)(ss / d) + eps);
}

/* Block (row i, stream s). Block (i, 0) also finds where row i's run starts: a sequence's rows
 * are one run, so over rows [0, i] "has row i's state" is false, then true; a binary search finds
 * the first true (a prefill's run is as long as the pass, so a scan would cost O(n) a row). */
static __global__ void __launch_bounds__(PLE_THREADS) gate_kernel(ple_params p) {
    __shared__ double red[32];
    const int i = blockIdx.x, s = blockIdx.y, t = threadIdx.x, H = p.H;
    const size_t C = (size_t)p.S * H;
    if (s == 0 && t == 0) {
        int lo = i, hi = i; /* p.states[hi] is row i's; its run starts in [lo, hi] */
        if (p.P > 0) { /* else the runs do not matter and states may be NULL */
            float *const mine = p.states[i];
            for (lo = 0; lo < hi;) {
                const int mid = lo + (hi - lo) / 2;
                if (p.states[mid] == mine) hi = mid;
                else lo = mid + 1;
            }
        }
        p.run0[i] = lo;
    }
    const float *ks = p.keys + i * C + (size_t)s * H, *xs = p.X + i * C + (size_t)s * H;
    const float *kw = p.key_norm + (size_t)s * H, *qw = p.query_norm + (size_t)s * H;
    const float *v = p.vals + (size_t)i * H, *cw = p.conv_norm + (size_t)s * H;
    double sk = 0, sx = 0;
    for (int c = t; c < H; c += PLE_THREADS) {
        sk += (double)ks[c] * ks[c];
        sx += (double)xs[c] * xs[c];
    }
    const float rk = ple_inv_rms(cu_block_sum(sk, red), H, p.eps);
    const float rq = ple_inv_rms(cu_block_sum(sx, red), H, p.eps);
    double dot = 0;
    for (int c = t; c < H; c += PLE_THREADS) dot += (double)(ks[c] * rk * kw[c]) * (xs[c] * rq * qw[c]);
    dot = cu_block_sum(dot, red);
    const float g = (float)(dot / sqrt((double)H));
    const float gs = sqrtf(fmaxf(fabsf(g), 1e-6f)) * (g > 0.f ? 1.f : g < 0.f ? -1.f : 0.f);
    const float gate = cu_sigmoidf(gs);
    double sv = 0;
    for (int c = t; c < H; c += PLE_THREADS) {
        const float vs = gate * v[c];
        sv += (double)vs * vs;
    }
    const float rv = ple_inv_rms(cu_block_sum(sv, red), H, p.eps);
    float *co = p.c + i * C + (size_t)s * H;
    for (int c = t; c < H; c += PLE_THREADS) co[c] = gate * v[c] * rv * cw[c];
    if (t == 0) p.gate[(size_t)i * p.S + s] = gate;
}

/* Thread (row i, channel ch). The sequence's history h is its state's P rows, then the c of its
 * run's rows; row i is h[P + q] (q: its place in the run), and tap j < K-1 reads h[q + j dil]. */
static __global__ void inject_kernel(ple_params p) {
    const int i = blockIdx.x, ch = blockIdx.y * PLE_THREADS + threadIdx.x;
    const int C = p.S * p.H;
    if (ch >= C) return;
    const int r0 = p.run0[i], q = i - r0;
    const float *w = p.conv_w + (size_t)ch * p.K;
    const float *st = p.P > 0 ? p.states[i] : NULL;
    float acc = w[p.K - 1] * p.c[(size_t)i * C + ch];
    for (int j = 0; j < p.K - 1; j++) {
        const int h = q + j * p.dil;
        acc += w[j] * (h < p.P ? st[(size_t)h * C + ch] : p.c[(size_t)(r0 + h - p.P) * C + ch]);
    }
    const int s = ch / p.H;
    const float val = p.gate[(size_t)i * p.S + s] * p.vals[(size_t)i * p.H + (ch - s * p.H)];
    p.X[(size_t)i * C + ch] += val + acc / (1.f + expf(-acc));
}

/* Thread (row i, channel ch), acting where row i ends its run of m rows: the state becomes the
 * last P rows of the history, h[m .. m + P). In ascending r, h[m + r] (m >= 1) is read before
 * the loop writes over it. */
static __global__ void state_kernel(ple_params p) {
    const int i = blockIdx.x, ch = blockIdx.y * PLE_THREADS + threadIdx.x;
    const int C = p.S * p.H;
    if (ch >= C) return;
    float *st = p.states[i];
    if (i + 1 < p.n && p.states[i + 1] == st) return; /* not the run's last row */
    const int m = i - p.run0[i] + 1;
    for (int r = 0; r < p.P; r++)
        st[(size_t)r * C + ch] = m + r < p.P ? st[(size_t)(m + r) * C + ch] : p.c[(size_t)(i + 1 + r - p.P) * C + ch];
}

static mt_status ple_launch(const ple_params *p, cudaStream_t s) {
    const unsigned cb = (unsigned)((p->S * p->H + PLE_THREADS - 1) / PLE_THREADS);
    gate_kernel<<<dim3((unsigned)p->n, (unsigned)p->S), PLE_THREADS, 0, s>>>(*p);
    MT_CUDA_CHECK_LAUNCH();
    inject_kernel<<<dim3((unsigned)p->n, cb), PLE_THREADS, 0, s>>>(*p);
    MT_CUDA_CHECK_LAUNCH();
    if (p->P > 0) {
        state_kernel<<<dim3((unsigned)p->n, cb), PLE_THREADS, 0, s>>>(*p);
        MT_CUDA_CHECK_LAUNCH();
    }
    return MT_OK;
}

static void cu_ple_inject(mt_backend *be, float *X, const float *keys, const float *vals, float *const *states,
                          const float *key_norm, const float *query_norm, const float *conv_norm,
                          const float *conv_w, int n, const mt_ple_params *pp) {
    MT_ASSERT(n >= 0 && pp->S >= 1 && pp->H >= 1 && pp->K >= 1 && pp->dil >= 1);
    MT_ASSERT(n <= 0x7fffffff / 2 && (int64_t)pp->S * pp->H <= 0x7fffffff / 2);
    MT_ASSERT(states || pp->K == 1); /* K == 1: no state rows, states unread */
    if (n == 0) return;
    const size_t C = (size_t)pp->S * pp->H;
    const size_t cb = cu_align_up(sizeof(float) * (size_t)n * C, 256), gb = cu_align_up(sizeof(float) * (size_t)n * pp->S, 256);
    char *scr = (char *)cu_scratch(be, CU_SCRATCH_DENSE, cb + gb + sizeof(int32_t) * (size_t)n);
    if (!scr) return; /* logged and recorded by cu_scratch */
    ple_params p = { X, keys, vals, states, key_norm, query_norm, conv_norm, conv_w,
                     (float *)scr, (float *)(scr + cb), (int32_t *)(scr + cb + gb),
                     n, pp->S, pp->H, pp->K, pp->dil, (pp->K - 1) * pp->dil, pp->eps };
    mt_status st = ple_launch(&p, cu_stream(be));
    if (st != MT_OK) return cu_op_status(be, "ple_inject", st);
    cu_prof_mark(be, "ple_inject");
}

/* ---- ple_gather_rows: the hash and the gather of decode rows whose ids are on the device ----
 * Two launches: gather_rows_kernel, a block per (row, table): the row's n-gram ids (its run's
 * earlier rows, then its sequence's history, then the pad id), the table's hash and its row
 * copied (d values, read over the bus when the table is host memory); then hist_kernel, a thread
 * per row, where a run ends: the sequence's history takes the run's ids. The boundary orders the
 * reads of the histories before their writes. */

enum { GATHER_THREADS = 64 };

typedef struct gather_params {
    float *emb;                 /* [n, ntab * d] */
    const void *table;          /* [sum of the primes, d] of dtype */
    const int32_t *ids;         /* row i's at ids[i * ids_stride], device */
    int ids_stride;
    uint32_t *const *hist;      /* [n] -> [MT_PLE_MAX_ORDER]: length, then ids oldest first */
    const mt_ple_hash *hash;    /* device */
    int N, ntab, d, n;
} gather_params;

/* The first row of row i's run: over rows [0, i] "shares row i's history" is false, then true. */
static __device__ int run_start(const gather_params &p, int i) {
    uint32_t *const mine = p.hist[i];
    int lo = 0, hi = i;
    while (lo < hi) {
        const int mid = lo + (hi - lo) / 2;
        if (p.hist[mid] == mine) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

template <mt_dtype DT>
static __global__ void __launch_bounds__(GATHER_THREADS) gather_rows_kernel(gather_params p) {
    __shared__ int64_t row;
    const int i = blockIdx.x, t = blockIdx.y;
    if (threadIdx.x == 0) {
        const mt_ple_hash *hp = p.hash;
        const int r0 = run_start(p, i), heads = hp->heads, o = 2 + t / heads;
        const uint32_t *h = p.hist[i];
        const int len = (int)h[0];
        uint64_t hs = 0;
        for (int k = 0; k < o; k++) {
            const int back = k - (i - r0); /* > 0: that many positions back into the history */
            const uint64_t x = back <= 0 ? (uint64_t)(uint32_t)p.ids[(size_t)(i - k) * p.ids_stride]
                               : back <= len ? (uint64_t)h[1 + len - back] : (uint64_t)hp->pad;
            hs ^= x * hp->mult[k];
        }
        row = hp->off[t] + (int64_t)(hs % (uint64_t)hp->prime[t]);
    }
    __syncthreads();
    float *out = p.emb + ((size_t)i * p.ntab + t) * p.d;
    for (int c = threadIdx.x; c < p.d; c += GATHER_THREADS) out[c] = cu_wget<DT>(p.table, row * p.d + c);
}

static __global__ void hist_kernel(gather_params p) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= p.n || (i + 1 < p.n && p.hist[i + 1] == p.hist[i])) return; /* not a run's last row */
    uint32_t *w = p.hist[i];
    for (int r = run_start(p, i); r <= i; r++) {
        const uint32_t id = (uint32_t)p.ids[(size_t)r * p.ids_stride];
        if ((int)w[0] == p.N - 1) {
            for (int k = 1; k < p.N - 1; k++) w[k] = w[k + 1];
            w[p.N - 1] = id;
        } else {
            w[1 + w[0]] = id;
            w[0]++;
        }
    }
}

static void cu_ple_gather_rows(mt_backend *be, float *emb, const mt_weight *table, const int32_t *ids, int ids_stride,
                               uint32_t *const *hist, const mt_ple_hash *hash, int N, int ntab, int n) {
    MT_ASSERT(N >= 2 && N <= MT_PLE_MAX_ORDER && ntab >= 1 && ntab <= MT_PLE_MAX_TABLES && ntab % (N - 1) == 0);
    MT_ASSERT(n >= 0 && n <= 65535 && table->cols >= 1);
    if (n == 0) return;
    gather_params p = { emb, table->data, ids, ids_stride, hist, hash, N, ntab, (int)table->cols, n };
    cudaStream_t s = cu_stream(be);
    const dim3 g((unsigned)n, (unsigned)ntab);
    switch (table->dtype) {
    case MT_F32: gather_rows_kernel<MT_F32><<<g, GATHER_THREADS, 0, s>>>(p); break;
    case MT_F16: gather_rows_kernel<MT_F16><<<g, GATHER_THREADS, 0, s>>>(p); break;
    default: gather_rows_kernel<MT_BF16><<<g, GATHER_THREADS, 0, s>>>(p); break;
    }
    cu_check_launch(be, "ple_gather_rows");
    hist_kernel<<<(unsigned)((n + 127) / 128), 128, 0, s>>>(p);
    cu_check_launch(be, "ple_gather_rows");
    cu_prof_mark(be, "ple_gather_rows");
}

extern "C" void cu_ple_fill(mt_backend_ops *t) {
    t->ple_inject = cu_ple_inject;
    t->ple_gather_rows = cu_ple_gather_rows;
}
