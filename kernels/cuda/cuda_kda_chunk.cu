/* kernels/cuda/cuda_kda_chunk.cu: the KDA delta rule in its chunked form, for prefill
 * (kda_chunked): the same function as kernels/cpu/cpu_kda.c's cpu_kda_chunked (and as
 * kda_recurrent in cuda_kda.cu). Per head, chunks of KDA_CHUNK = 64 steps; with G = cumsum g inside
 * a chunk (per key channel d) and S0 the state [dk(k), dk(v)] at the chunk's start:
 *   A_ij = sum_d k_i k_j e^{G_i - G_j}  (j < i),   B_ij = sum_d q_i k_j e^{G_i - G_j}  (j <= i)
 *   delta = (I + diag(beta) A)^-1 diag(beta) (V - KX S0),  KX = k e^G, QX = q e^G
 *   o = QX S0 + B delta,  S = diag(e^{G_L}) S0 + KL^T delta,  KL = k e^{G_L - G}
 *
 * Two implementations, chosen by the backend's tc_terms (mt_cuda_params.numerics, cuda_ops.h;
 * with tc_terms 1 the products keep two parts unless mt_cuda_params.kda_chunk_exact is off):
 *   tc_terms 0: kda_chunked_kernel, fp32 on the CUDA cores, one block per (head, 64 value
 *     columns) walking the chunks in sequence (the reference form; 8 ms at 4096 x 64 x 128).
 *   tc_terms 1 or 2 (default 2): two kernels on the tensor cores (bf16 mma.sync m16n8k16 and
 *     wgmma, tf32 m16n8k8 in the inverse; fp32 accumulation) through a scratch of per-chunk records:
 *     kc_intra_kernel, one block per (chunk, head), all in parallel: everything that does not
 *       depend on the state: G, KX/QX/KL, the intra-chunk A and B (16 x 16 sub-blocks on the
 *       tensor cores with the decay factored per sub-block, see there), the WY inverse
 *       Tb = (I + diag(beta) A)^-1 diag(beta) to fp32 accuracy (diagonal blocks by substitution,
 *       the rest by doubling on tf32 tensor cores in three terms); writes them
 *       as bf16 planes to the chunk's record.
 *     kc_state_kernel, one block per (head, 64 value columns), chunks in sequence: the state slice
 *       [128, 64] stays in fp32 registers; per chunk four small GEMMs read the record through
 *       bulk copies (a phase ahead): X = KX S0 and Y = QX S0; delta = Tb (V - X);
 *       o = Y + B delta; S = e^{G_L} S + KL^T delta. With two bf16 parts the same walk runs on
 *       the warpgroup MMA (kc_state_wg_kernel; with one part, kc_state_kernel on mma.sync).
 *   Every tensor-core operand x is split into bf16 parts x = hi + lo (hi = bf16(x),
 *   lo = bf16(x - hi)) and a product a b is hi_a hi_b + hi_a lo_b + lo_a hi_b: 16 significant bits,
 *   ~1e-5 relative error against the CPU twin (single bf16 rounding, tc_terms 1: ~4e-3, twice the
 *   rate; the tests' bound is 1e-4). The state itself is never rounded: it accumulates in fp32.
 * Head dims below KDA_MAX_DK are zero-padded to it in the tensor-core form. */
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_wgmma.h"

enum {
    KDA_MAX_DK = 128, /* head dim bound (state slice on chip; the tensor-core form pads to it) */
    KDA_CHUNK = 64,   /* chunk length, as in cpu_kda.c */
};

typedef struct chunk_params {
    float *o;                   /* [n, nh, dk] */
    const float *q, *k;         /* [n, nh, dk], l2-normalised, q pre-scaled */
    const float *v, *g;         /* [n, nh, dk]; g <= 0 */
    const float *beta;          /* [n, nh] */
    float *state;               /* [nh, dk(k), dk(v)] fp32, updated */
    int n, nh, dk;
    /* tensor-core form only */
    __nv_bfloat16 *rec;         /* [nh, nck, KC_REC] chunk records of the current segment */
    int t0;                     /* first step of the segment (a multiple of KDA_CHUNK) */
    int nck;                    /* chunks in the segment */
    int terms;                  /* bf16 parts per operand: 2 (hi + lo) or 1 (hi) */
    int vec4;                   /* q, k, g 16-byte aligned and dk % 4 == 0: float4 loads */
    int vec2;                   /* v, o 8-byte aligned and dk even: float2 loads and stores */
} chunk_params;

/* ------------------------------------------------------------------------------------------ */
/* fp32 form (tc_terms 0)
 *
 * Block = (head, 64 value columns), 256 threads; chunks of KDA_CHUNK steps in sequence with the
 * state slice S0 [dk, 64] resident in shared memory. Per chunk (cpu_kda.c kda_chunk_head):
 *   1 load k, q, g [L, dk], v [L, 64], beta; rows past the chunk's end are zero
 *   2 G = cumsum g (rows past the end repeat the last G, so no exponent there is positive)
 *   3 A_ij = sum_d k_i k_j e^{G_i-G_j} (j < i), B_ij = sum_d q_i k_j e^{G_i-G_j} (j <= i)
 *   4 KX = k e^G, QX = q e^G, KL = k e^{G_L - G} in place of k, q, G
 *   5 U = v - KX S0, OQ = QX S0
 *   6 delta_i = beta_i (U_i - sum_{j<i} A_ij delta_j), forward substitution per column
 *   7 o = OQ + B delta
 *   8 S0 = e^{G_L} S0 + KL^T delta                                                            */
enum {
    CH_THREADS = 256,
    CH_COLS = 64,            /* value columns per block */
    CH_AB_LD = KDA_CHUNK + 1,
    CH_DL_LD = CH_COLS + 8,  /* delta row stride: the 4 parts of a column fall in distinct banks */
};

typedef struct chunk_smem {
    float *K, *Q, *G;   /* [KDA_CHUNK, dk+1] each: k/q/g, then KX/QX/KL after step 4 */
    float *S0;          /* [dk, CH_COLS] state slice */
    float *A, *B;       /* [KDA_CHUNK, CH_AB_LD] */
    float *U, *OQ;      /* [KDA_CHUNK, CH_COLS] */
    float *Dl;          /* [KDA_CHUNK, CH_DL_LD] delta */
    float *gl, *egl;    /* [KDA_MAX_DK] G_L and e^{G_L} */
    float *bt;          /* [KDA_CHUNK] beta */
} chunk_smem;

/* Carves the dynamic shared memory; with smem == NULL only returns the size in bytes. */
static __host__ __device__ size_t chunk_smem_carve(float *smem, int dk, chunk_smem *c) {
    const size_t ld = (size_t)dk + 1;
    size_t off = 0;
    float *base = smem;
    float *K = base + off; off += KDA_CHUNK * ld;
    float *Q = base + off; off += KDA_CHUNK * ld;
    float *G = base + off; off += KDA_CHUNK * ld;
    off = (off + 3) & ~(size_t)3; /* 16-byte alignment for the float4 rows below */
    float *S0 = base + off; off += (size_t)dk * CH_COLS;
    float *A = base + off; off += KDA_CHUNK * CH_AB_LD;
    float *B = base + off; off += KDA_CHUNK * CH_AB_LD;
    off = (off + 3) & ~(size_t)3;
    float *U = base + off; off += KDA_CHUNK * CH_COLS;
    float *OQ = base + off; off += KDA_CHUNK * CH_COLS;
    float *Dl = base + off; off += KDA_CHUNK * CH_DL_LD;
    float *gl = base + off; off += KDA_MAX_DK;
    float *egl = base + off; off += KDA_MAX_DK;
    float *bt = base + off; off += KDA_CHUNK;
    if (c) *c = (chunk_smem){K, Q, G, S0, A, B, U, OQ, Dl, gl, egl, bt};
    return off * sizeof(float);
}

static __global__ void __launch_bounds__(CH_THREADS, 1) kda_chunked_kernel(chunk_params p) {
    extern __shared__ float4 smem_f4[];
    chunk_smem sm;
    chunk_smem_carve((float *)smem_f4, p.dk, &sm);
    const int h = blockIdx.x, j0 = blockIdx.y * CH_COLS, tid = threadIdx.x, dk = p.dk;
    const int ld = dk + 1;
    float *Sg = p.state + (size_t)h * dk * dk;

    for (int e = tid; e < dk * CH_COLS; e += CH_THREADS) {
        const int d = e / CH_COLS, c = e % CH_COLS;
        sm.S0[e] = j0 + c < dk ? Sg[(size_t)d * dk + j0 + c] : 0.f;
    }
    /* Tile coordinates shared by steps 3, 5, 7: rows 4*ti .. 4*ti+3, a second index from tc. */
    const int ti = tid / 16, tc = tid % 16;

    for (int t0 = 0; t0 < p.n; t0 += KDA_CHUNK) {
        const int Lc = p.n - t0 < KDA_CHUNK ? p.n - t0 : KDA_CHUNK;
        /* 1: load */
        for (int e = tid; e < KDA_CHUNK * dk; e += CH_THREADS) {
            const int i = e / dk, d = e % dk;
            float kv = 0.f, qv = 0.f, gv = 0.f;
            if (i < Lc) {
                const size_t off = ((size_t)(t0 + i) * p.nh + h) * dk + d;
                kv = p.k[off];
                qv = p.q[off];
                gv = p.g[off];
            }
            sm.K[i * ld + d] = kv;
            sm.Q[i * ld + d] = qv;
            sm.G[i * ld + d] = gv;
        }
        for (int e = tid; e < KDA_CHUNK * CH_COLS; e += CH_THREADS) {
            const int i = e / CH_COLS, c = e % CH_COLS;
            sm.U[e] = (i < Lc && j0 + c < dk) ? p.v[((size_t)(t0 + i) * p.nh + h) * dk + j0 + c] : 0.f;
        }
        if (tid < KDA_CHUNK) sm.bt[tid] = tid < Lc ? p.beta[(size_t)(t0 + tid) * p.nh + h] : 0.f;
        __syncthreads();
        /* 2: cumulative log-decay */
        for (int d = tid; d < dk; d += CH_THREADS) {
            float acc = 0.f;
            for (int i = 0; i < KDA_CHUNK; i++) {
                acc = sm.G[i * ld + d] + acc;
                sm.G[i * ld + d] = acc;
            }
        }
        __syncthreads();
        /* 3: A and B. Thread: rows i = 4*ti + x, columns j = tc + 16*y (interleaved: conflict-free
         * banks). Warp w only has rows <= 8w+7, so it skips the column blocks y with 16y above
         * that (warp-uniform). __expf: all exponents are <= 0 where a value is kept, and the
         * error of the fast exp (~2 ulp, plus the argument's rounding) is far below 1e-6. */
        {
            const int ymax = (8 * (tid >> 5) + 7) / 16;
            float a[4][4], b[4][4];
#pragma unroll
            for (int x = 0; x < 4; x++)
#pragma unroll
                for (int y = 0; y < 4; y++) a[x][y] = b[x][y] = 0.f;
            for (int d = 0; d < dk; d++) {
                float gi[4], ki[4], qi[4];
#pragma unroll
                for (int x = 0; x < 4; x++) {
                    const int i = 4 * ti + x;
                    gi[x] = sm.G[i * ld + d];
                    ki[x] = sm.K[i * ld + d];
                    qi[x] = sm.Q[i * ld + d];
                }
#pragma unroll
                for (int y = 0; y < 4; y++) {
                    if (y > ymax) break;
                    const int jj = tc + 16 * y;
                    const float gj = sm.G[jj * ld + d], kj = sm.K[jj * ld + d];
#pragma unroll
                    for (int x = 0; x < 4; x++) {
                        const float kk = kj * __expf(gi[x] - gj);
                        a[x][y] += ki[x] * kk;
                        b[x][y] += qi[x] * kk;
                    }
                }
            }
#pragma unroll
            for (int x = 0; x < 4; x++)
#pragma unroll
                for (int y = 0; y < 4; y++) {
                    const int i = 4 * ti + x, jj = tc + 16 * y;
                    const bool live = y <= ymax;
                    sm.A[i * CH_AB_LD + jj] = (live && jj < i) ? a[x][y] : 0.f;
                    sm.B[i * CH_AB_LD + jj] = (live && jj <= i) ? b[x][y] : 0.f;
                }
        }
        if (tid < dk) {
            const float gL = sm.G[(KDA_CHUNK - 1) * ld + tid]; /* = G at the chunk's last step */
            sm.gl[tid] = gL;
            sm.egl[tid] = expf(gL);
        }
        __syncthreads();
        /* 4: KX, QX, KL in place */
        for (int e = tid; e < KDA_CHUNK * dk; e += CH_THREADS) {
            const int i = e / dk, d = e % dk, x = i * ld + d;
            const float gv = sm.G[x], eg = expf(gv), kv = sm.K[x];
            sm.Q[x] = sm.Q[x] * eg;
            sm.K[x] = kv * eg;
            sm.G[x] = kv * expf(sm.gl[d] - gv);
        }
        __syncthreads();
        /* 5: U -= KX S0, OQ = QX S0. Thread: rows 4ti..4ti+3, columns 4tc..4tc+3. */
        {
            float u[4][4], oq[4][4];
#pragma unroll
            for (int x = 0; x < 4; x++)
#pragma unroll
                for (int y = 0; y < 4; y++) u[x][y] = oq[x][y] = 0.f;
            for (int d = 0; d < dk; d++) {
                const float4 s4 = *(const float4 *)(sm.S0 + (size_t)d * CH_COLS + 4 * tc);
                const float sv[4] = {s4.x, s4.y, s4.z, s4.w};
#pragma unroll
                for (int x = 0; x < 4; x++) {
                    const int i = 4 * ti + x;
                    const float kx = sm.K[i * ld + d], qx = sm.Q[i * ld + d];
#pragma unroll
                    for (int y = 0; y < 4; y++) {
                        u[x][y] += kx * sv[y];
                        oq[x][y] += qx * sv[y];
                    }
                }
            }
#pragma unroll
            for (int x = 0; x < 4; x++)
#pragma unroll
                for (int y = 0; y < 4; y++) {
                    const int e = (4 * ti + x) * CH_COLS + 4 * tc + y;
                    sm.U[e] = sm.U[e] - u[x][y];
                    sm.OQ[e] = oq[x][y];
                }
        }
        __syncthreads();
        /* 6: forward substitution. Thread (column c, part): the 4 parts of a column are adjacent
         * lanes and split the sum over j by j mod 4; the butterfly gives every part the same
         * total, and the part that owns delta_i (i mod 4) is the only one that reads it again,
         * so no barrier is needed inside the loop. */
        {
            const int c = tid >> 2, part = tid & 3;
            for (int i = 0; i < KDA_CHUNK; i++) {
                float acc = 0.f;
                for (int jj = part; jj < i; jj += 4) acc += sm.A[i * CH_AB_LD + jj] * sm.Dl[jj * CH_DL_LD + c];
                acc += __shfl_xor_sync(0xffffffffu, acc, 1);
                acc += __shfl_xor_sync(0xffffffffu, acc, 2);
                if ((i & 3) == part)
                    sm.Dl[i * CH_DL_LD + c] = i < Lc ? sm.bt[i] * (sm.U[i * CH_COLS + c] - acc) : 0.f;
            }
        }
        __syncthreads();
        /* 7: o = OQ + B delta, rows 4ti.., columns 4tc.. */
        {
            float o[4][4];
#pragma unroll
            for (int x = 0; x < 4; x++)
#pragma unroll
                for (int y = 0; y < 4; y++) o[x][y] = 0.f;
            const int jend = 4 * ti + 3 < Lc - 1 ? 4 * ti + 3 : Lc - 1;
            for (int jj = 0; jj <= jend; jj++) {
                const float4 d4 = *(const float4 *)(sm.Dl + jj * CH_DL_LD + 4 * tc);
                const float dv[4] = {d4.x, d4.y, d4.z, d4.w};
#pragma unroll
                for (int x = 0; x < 4; x++) {
                    const float bij = sm.B[(4 * ti + x) * CH_AB_LD + jj];
#pragma unroll
                    for (int y = 0; y < 4; y++) o[x][y] += bij * dv[y];
                }
            }
#pragma unroll
            for (int x = 0; x < 4; x++) {
                const int i = 4 * ti + x;
                if (i >= Lc) break;
                float *orow = p.o + ((size_t)(t0 + i) * p.nh + h) * dk;
#pragma unroll
                for (int y = 0; y < 4; y++) {
                    const int c = 4 * tc + y;
                    if (j0 + c < dk) orow[j0 + c] = sm.OQ[i * CH_COLS + c] + o[x][y];
                }
            }
        }
        /* 8: S0 = e^{G_L} S0 + KL^T delta. Thread: rows d = 8*(tid/16) + x, columns 4tc... Each
         * thread reads and writes only its own S0 entries, so this needs no barrier against 7. */
        {
            const int d0 = 8 * ti;
            float s[8][4];
#pragma unroll
            for (int x = 0; x < 8; x++) {
                const int d = d0 + x;
#pragma unroll
                for (int y = 0; y < 4; y++)
                    s[x][y] = d < dk ? sm.egl[d] * sm.S0[(size_t)d * CH_COLS + 4 * tc + y] : 0.f;
            }
            if (d0 < dk) {
                for (int jj = 0; jj < Lc; jj++) {
                    const float4 d4 = *(const float4 *)(sm.Dl + jj * CH_DL_LD + 4 * tc);
                    const float dv[4] = {d4.x, d4.y, d4.z, d4.w};
#pragma unroll
                    for (int x = 0; x < 8; x++) {
                        const float kl = d0 + x < dk ? sm.G[jj * ld + d0 + x] : 0.f;
#pragma unroll
                        for (int y = 0; y < 4; y++) s[x][y] += kl * dv[y];
                    }
                }
            }
#pragma unroll
            for (int x = 0; x < 8; x++) {
                const int d = d0 + x;
                if (d < dk)
#pragma unroll
                    for (int y = 0; y < 4; y++) sm.S0[(size_t)d * CH_COLS + 4 * tc + y] = s[x][y];
            }
        }
        __syncthreads();
    }
    for (int e = tid; e < dk * CH_COLS; e += CH_THREADS) {
        const int d = e / CH_COLS, c = e % CH_COLS;
        if (j0 + c < dk) Sg[(size_t)d * dk + j0 + c] = sm.S0[e];
    }
}

static mt_status kda_chunked_launch(mt_backend *be, const chunk_params *p) {
    const size_t smem = chunk_smem_carve(NULL, p->dk, NULL);
    MT_CUDA_CHECK(cudaFuncSetAttribute(kda_chunked_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)smem));
    const dim3 grid(p->nh, (p->dk + CH_COLS - 1) / CH_COLS);
    kda_chunked_kernel<<<grid, CH_THREADS, smem, cu_stream(be)>>>(*p);
    cu_check_launch(be, "kda_chunked");
    return MT_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* tensor-core form (tc_terms 1, 2)                                                             */

enum {
    KC_THREADS = 256,
    KC_COLS = 64,                 /* value columns per kc_state_kernel block */
    KC_SEG_CHUNKS = 64,           /* chunks per segment: bounds the record scratch (4096 steps,
                                     nh * 8.2 MiB at 64 chunks) */
    /* chunk record (bf16 units; offsets multiples of 8 = 16 bytes). The planes are stored
     * swizzled (kc_swz) so that the state kernels copy their parts of it with whole-plane
     * bulk copies into unpadded shared rows and still reads them without bank conflicts; each
     * set is contiguous, its hi planes first (single rounding copies only those). */
    KC_PLANE = KDA_CHUNK * KDA_MAX_DK, /* [64, 128] plane */
    KC_SMALL = KDA_CHUNK * KDA_CHUNK,  /* [64, 64] plane */
    KC_KXH = 0,                   /* set A: KX = k e^G  [64 steps, 128 channels] */
    KC_QXH = KC_KXH + KC_PLANE,   /*        QX = q e^G  [64, 128] */
    KC_KXL = KC_QXH + KC_PLANE,   /*        lo parts */
    KC_QXL = KC_KXL + KC_PLANE,
    KC_EGL = KC_QXL + KC_PLANE,   /* set B: e^{G_L} [128] fp32 (256 bf16 slots) */
    KC_KLH = KC_EGL + 2 * KDA_MAX_DK, /*    KL = k e^{G_L-G}  [64, 128] */
    KC_TBH = KC_KLH + KC_PLANE,   /*        Tb = (I + diag(beta) A)^-1 diag(beta)  [64 i, 64 j], lower */
    KC_AQH = KC_TBH + KC_SMALL,   /*        B (q k^T with decay) [64 i, 64 j], lower with diagonal */
    KC_KLL = KC_AQH + KC_SMALL,   /*        lo parts */
    KC_TBL = KC_KLL + KC_PLANE,
    KC_AQL = KC_TBL + KC_SMALL,
    KC_REC = KC_AQL + KC_SMALL,
    KC_SETA_HI = 2 * KC_PLANE,    /* set A's hi planes; TERMS 2: twice that */
    KC_SETB_HI = KC_KLL - KC_EGL, /* set B's e^{G_L} and hi planes; TERMS 2: KC_REC - KC_EGL */
    /* kc_intra_kernel shared memory (floats): the item's buffer, then small arrays */
    KI_LDF = KDA_MAX_DK,          /* [64, 128] fp32 rows, unpadded, odd rows' halves of 64 bytes
                                     swapped (kc_fx): step 5's 16-byte reads of two adjacent rows
                                     (a quarter warp) fall in opposite bank halves */
    KI_LDM = KDA_CHUNK + 4,       /* [64, 64] fp32 matrices */
    KI_LDZ = 24,                  /* 6b's Z blocks: the 4 rows of a B fragment 24 floats apart fall in distinct banks */
    KI_K = 0,                     /* in a buffer: k, then KP split (kc_pack4)  [64, KI_LDF] */
    KI_Q = KI_K + KDA_CHUNK * KI_LDF, /* q, then QP split (kc_pack4)  [64, KI_LDF] */
    KI_G = KI_Q + KDA_CHUNK * KI_LDF, /* g, G, then KN     [64, KI_LDF] */
    KI_BUF = KI_G + KDA_CHUNK * KI_LDF,
    KI_M = 0,                     /* after the products, over k/q/g: M = diag(beta) A [64, KI_LDM] */
    KI_AQ = KI_M + KDA_CHUNK * KI_LDM, /* B                [64, KI_LDM] */
    KI_T = KI_AQ + KDA_CHUNK * KI_LDM, /* T = (I + M)^-1   [64, KI_LDM] */
    KI_Z = KI_T + KDA_CHUNK * KI_LDM,  /* 6b's Z blocks [4, 16, KI_LDZ]: blocks 2-3 lie over KI_P,
                                          written past the barrier after P's last read */
    KI_P = KI_Z + 3 * 16 * 16,         /* step 5's split units: [8 warps, 16 values, 32 lanes], below KI_BUF */
    KI_R = KI_BUF,                     /* sub-block references R [4, 128] */
    KI_E = KI_R + 4 * KDA_MAX_DK,      /* e^{R_I - R_J}, I > J [6, 128] */
    KI_ER = KI_E + 6 * KDA_MAX_DK,     /* e^{R_J} [4, 128] */
    KI_EL = KI_ER + 4 * KDA_MAX_DK,    /* e^{G_L - R_J} [4, 128] */
    KI_GL = KI_EL + 4 * KDA_MAX_DK,    /* G_L [128] */
    KI_BT = KI_GL + KDA_MAX_DK,        /* beta [64] */
    KI_FLOATS = KI_BT + KDA_CHUNK,     /* 27072 floats = 108288 bytes: two blocks per SM */
    /* kc_state_kernel shared memory (bf16 units): sets A (read by P1) and B (read by P3, P4) as
     * in the record (swizzled, unpadded); then the kernel's own planes, rows padded by 8 (16
     * bytes) so the 8 row addresses of an ldmatrix fall in distinct bank groups */
    KS_LDB = KDA_CHUNK + 8,       /* [*, 64] planes: 144-byte rows */
    KS_KXH = KC_KXH,              /* set A */
    KS_QXH = KC_QXH,
    KS_KXL = KC_KXL,
    KS_QXL = KC_QXL,
    KS_EGL = KC_EGL,              /* set B: [128] fp32 */
    KS_KLH = KC_KLH,
    KS_TBH = KC_TBH,
    KS_AQH = KC_AQH,
    KS_KLL = KC_KLL,
    KS_TBL = KC_TBL,
    KS_AQL = KC_AQL,
    KS_SH = KC_REC,                       /* S0 [128 d, 64 columns] hi, lo: the B operand of P1 */
    KS_SL = KS_SH + KDA_MAX_DK * KS_LDB,
    KS_RH = KS_SL + KDA_MAX_DK * KS_LDB,  /* R = V - X [64 j, 64 columns], then delta */
    KS_RL = KS_RH + KDA_CHUNK * KS_LDB,
    KS_BAR = KS_RL + KDA_CHUNK * KS_LDB,  /* two mbarriers (sets A, B): 8 bf16 slots */
    KS_BF16 = KS_BAR + 8,                 /* 93448 bf16 = 186896 bytes */
};

static_assert(KI_P + 8 * 16 * 32 <= KI_BUF, "step 5's partial sums overlap the small arrays");
static_assert(KI_Z + 4 * 16 * KI_LDZ <= KI_BUF, "6b's Z blocks overlap the small arrays");
static_assert(KC_THREADS == 2 * KDA_MAX_DK && KC_THREADS == 8 * 32, "kc_intra_kernel's steps 1-2 map 256 threads");
static_assert(KI_BT % 4 == 0 && KI_LDM % 4 == 0 && KI_T % 4 == 0 && KI_AQ % 4 == 0, "step 7 reads float4");

/* The intra-chunk products use one reference per 16-step sub-block and channel,
 * R = (max G + min G) / 2 over the sub-block, and factor e^{G_i - G_j} =
 * e^{G_i - R_I} e^{R_I - R_J} e^{R_J - G_j}: every factor stays in [e^-60, e^60] when no sub-block
 * spans more than KC_SPAN_MAX in G (products past the diagonal reach e^120 and may overflow; they
 * are masked, never used). A chunk that spans more (decay beyond ~e^-8 per step over a sub-block)
 * or has g > 0 takes the exact fp32 path for A and B instead (kc_intra_kernel step 3). */
#define KC_SPAN_MAX 120.f

/* ---- device helpers ---- */

static __device__ __forceinline__ float4 kc_exp4(float4 a) {
    return make_float4(__expf(a.x), __expf(a.y), __expf(a.z), __expf(a.w));
}
/* __expf's arithmetic (ex2 of x log2 e) without its guard for subnormal results (flushed to zero
 * here): equal to __expf wherever e^x is a normal float, as for every |x| <= 87. */
static __device__ __forceinline__ float kc_exp_n(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
    return y;
}
static __device__ __forceinline__ float4 kc_exp4_n(float4 a) {
    return make_float4(kc_exp_n(a.x), kc_exp_n(a.y), kc_exp_n(a.z), kc_exp_n(a.w));
}
static __device__ __forceinline__ float4 kc_sub4(float4 a, float4 b) {
    return make_float4(a.x - b.x, a.y - b.y, a.z - b.z, a.w - b.w);
}
static __device__ __forceinline__ float4 kc_mul4(float4 a, float4 b) {
    return make_float4(a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w);
}

/* The split product of one k step: d[nt] += a b_nt = al bh + ah bl + ah bh (TERMS 2; TERMS 1:
 * ah bh) for the N n8 tiles nt, b_nt in b*[nt >> 1][2 (nt & 1)], +1 (the register order of
 * cu_ldsm4_t over two n8 tiles); one or two A operands (a2h == NULL: one). Three passes over the
 * accumulators, in that term order, so that no mma waits on the one just before it. */
template <int TERMS, int N>
static __device__ __forceinline__ void kc_mma_tiles(float (*d1)[4], const uint32_t a1h[4], const uint32_t a1l[4],
                                                    float (*d2)[4], const uint32_t *a2h, const uint32_t *a2l,
                                                    const uint32_t (*bh)[4], const uint32_t (*bl)[4]) {
    if (TERMS > 1) {
#pragma unroll
        for (int nt = 0; nt < N; nt++) {
            cu_mma_bf16(d1[nt], a1l, bh[nt >> 1][2 * (nt & 1)], bh[nt >> 1][2 * (nt & 1) + 1]);
            if (a2h) cu_mma_bf16(d2[nt], a2l, bh[nt >> 1][2 * (nt & 1)], bh[nt >> 1][2 * (nt & 1) + 1]);
        }
#pragma unroll
        for (int nt = 0; nt < N; nt++) {
            cu_mma_bf16(d1[nt], a1h, bl[nt >> 1][2 * (nt & 1)], bl[nt >> 1][2 * (nt & 1) + 1]);
            if (a2h) cu_mma_bf16(d2[nt], a2h, bl[nt >> 1][2 * (nt & 1)], bl[nt >> 1][2 * (nt & 1) + 1]);
        }
    }
#pragma unroll
    for (int nt = 0; nt < N; nt++) {
        cu_mma_bf16(d1[nt], a1h, bh[nt >> 1][2 * (nt & 1)], bh[nt >> 1][2 * (nt & 1) + 1]);
        if (a2h) cu_mma_bf16(d2[nt], a2h, bh[nt >> 1][2 * (nt & 1)], bh[nt >> 1][2 * (nt & 1) + 1]);
    }
}

/* Fragment addresses for the cu_ldsm4 loads (cuda_ops.h), lane l, tile origin (r0, c0) in storage:
 *   A, storage [m][k] (row-major A):      row r0 + (l & 15),                col c0 + (l >> 4) * 8
 *   A, storage [k][m] (A^T stored), .trans: row r0 + (l & 7) + (l >> 4) * 8, col c0 + ((l >> 3) & 1) * 8
 *     (r0 = k0, c0 = m0; gives a[0..3] of rows m0.., k k0..)
 *   B, storage [k][n] (row-major B), .trans: row r0 + (l & 7) + ((l >> 3) & 1) * 8, col c0 + (l >> 4) * 8
 *     (r0 = k0, c0 = n0; gives b0, b1 of columns n0.. in r[0], r[1] and of n0 + 8.. in r[2], r[3]) */
static __device__ __forceinline__ const __nv_bfloat16 *kc_at_b(const __nv_bfloat16 *s, int ld, int r0, int c0, int l) {
    return s + (r0 + (l & 7) + ((l >> 3) & 1) * 8) * ld + c0 + (l >> 4) * 8;
}

/* Swizzled record planes (64 rows of 64 or 128 bf16), stored as 64-column chunks of 64 rows of
 * 128 bytes: the 16-byte piece c8 = (col % 64) / 8 of row r lies at piece c8 ^ (r & 7), so the 8
 * consecutive rows of an ldmatrix hit 8 distinct bank groups with no padding, and each chunk is
 * the 128-byte-swizzled tile the warpgroup MMA reads (cuda_wgmma.h). The place of an element
 * does not depend on the plane's row length. */
static __host__ __device__ __forceinline__ int kc_swz(int r, int col) {
    return (col >> 6) * (KDA_CHUNK * 64) + r * 64 + ((((col >> 3) & 7) ^ (r & 7)) << 3) + (col & 7);
}
/* Addresses of A fragments (row-major A; A^T stored, .trans) on a swizzled plane, by the rules above */
static __device__ __forceinline__ const __nv_bfloat16 *kc_sw_a(const __nv_bfloat16 *s, int r0, int c0, int l) {
    return s + kc_swz(r0 + (l & 15), c0 + (l >> 4) * 8);
}
static __device__ __forceinline__ const __nv_bfloat16 *kc_sw_at(const __nv_bfloat16 *s, int r0, int c0, int l) {
    return s + kc_swz(r0 + (l & 7) + (l >> 4) * 8, c0 + ((l >> 3) & 1) * 8);
}

/* Place of element (row i, channel d) of kc_intra_kernel's [64, 128] fp32 buffers (k, q, g and
 * what replaces them): odd rows have their two 64-byte halves of each 128 bytes swapped. */
static __device__ __forceinline__ int kc_fx(int i, int d) {
    return i * KI_LDF + (d ^ ((i & 1) << 4));
}

/* 4 consecutive fp32 values x0..x3 at p (16-byte aligned), in place, as bf16 parts
 * (hi x0 x1, hi x2 x3, lo x0 x1, lo x2 x3): one 16-byte load gives the hi and the lo B fragment of
 * step 5 (whose k order pairs channels 4 c4.. of a 16-channel step, see there). */
static __device__ __forceinline__ void kc_pack4(float *p, float4 a) {
    uint4 u;
    cu_split_bf16x2(a.x, a.y, &u.x, &u.z);
    cu_split_bf16x2(a.z, a.w, &u.y, &u.w);
    *reinterpret_cast<uint4 *>(p) = u;
}

static __device__ __forceinline__ void kc_prefetch_l2(const void *gmem) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(gmem));
}

/* Bulk copies (the copy engine, cuda_wgmma.h's cu_bulk_load) complete on a shared-memory
 * mbarrier of one arrival: a phase completes once that arrival (cu_mbar_arrive_tx, with the
 * phase's byte count) is in and all those bytes have landed; bytes may land before the arrival
 * (the count goes negative meanwhile). */

/* tf32 parts of x: hi = x rounded to tf32, lo = the rest rounded to tf32 (x = hi + lo to ~2^-22) */
static __device__ __forceinline__ void kc_split_tf32(float x, uint32_t *hi, uint32_t *lo) {
    uint32_t h, l;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(h) : "f"(x));
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(l) : "f"(x - __uint_as_float(h)));
    *hi = h;
    *lo = l;
}
static __device__ __forceinline__ void kc_mma_tf32(float c[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
/* acc (a 16 x 8 tile in the mma C layout) += A [16 x 16] B [16 x 8], fp32 in shared memory (row
 * strides lda, ldb), on the tensor cores in three tf32 terms (lo hi, hi lo, hi hi: the product of
 * the lo parts, ~2^-22 relative, is the only one dropped). */
static __device__ __forceinline__ void kc_tf32_blk(float acc[4], const float *A, int lda, const float *B, int ldb, int lane) {
    const int g8 = lane >> 2, c4 = lane & 3;
#pragma unroll
    for (int kk = 0; kk < 16; kk += 8) {
        const float av[4] = {A[g8 * lda + kk + c4], A[(g8 + 8) * lda + kk + c4], A[g8 * lda + kk + c4 + 4],
                             A[(g8 + 8) * lda + kk + c4 + 4]};
        const float bv[2] = {B[(kk + c4) * ldb + g8], B[(kk + c4 + 4) * ldb + g8]};
        uint32_t ah[4], al[4], bh[2], bl[2];
#pragma unroll
        for (int q = 0; q < 4; q++) kc_split_tf32(av[q], &ah[q], &al[q]);
#pragma unroll
        for (int q = 0; q < 2; q++) kc_split_tf32(bv[q], &bh[q], &bl[q]);
        kc_mma_tf32(acc, al, bh);
        kc_mma_tf32(acc, ah, bl);
        kc_mma_tf32(acc, ah, bh);
    }
}
/* A 16 x 8 tile in the mma C layout, times s, to shared memory at p (row stride ld). */
static __device__ __forceinline__ void kc_tile_store(float *p, int ld, const float acc[4], float s, int lane) {
    const int g8 = lane >> 2, c4 = lane & 3;
    *reinterpret_cast<float2 *>(p + g8 * ld + 2 * c4) = make_float2(s * acc[0], s * acc[1]);
    *reinterpret_cast<float2 *>(p + (g8 + 8) * ld + 2 * c4) = make_float2(s * acc[2], s * acc[3]);
}

/* ---- kc_intra_kernel ----
 * One block of 256 threads per item (chunk c of the segment, head h). Steps:
 *   1 load k, q, g [64, 128] fp32 (zero past the chunk's end and past dk) and beta
 *   2 G = cumsum g per channel (as cpu_kda.c: acc = g + acc); per 16-step sub-block J and channel
 *     the reference R_J = (max + min) / 2; fallback if some sub-block spans > KC_SPAN_MAX or g > 0
 *   3 per (sub-block, channel) factors E_IJ = e^{R_I - R_J} (I > J), e^{R_J}, e^{G_L - R_J};
 *     (fallback) A, B exactly in fp32, to registers
 *   4 in place: KP = k e^{G - R}, QP = q e^{G - R}, KN = k e^{R - G} (R of the step's own
 *     sub-block); record planes (bf16 hi/lo) KX = KP e^R, QX = QP e^R, KL = KN e^{G_L - R}: two
 *     exponentials a value. Where e^R or e^{G_L - R} underflows, the true value is below e^-27
 *     (the factors are within e^+-60). Fallback: KX = k e^G, QX = q e^G, KL = k e^{G_L - G}.
 *     KP and QP stay in place already split (kc_pack4), for step 5's B fragments.
 *   5 (no fallback) the 10 sub-block pairs J <= I on the tensor cores (a unit and a quarter a
 *     warp, see there):  A_IJ = KP_I (E_IJ KN_J)^T,  B_IJ = QP_I (E_IJ KN_J)^T  (K = 128 channels);
 *     then M = diag(beta) A (strictly lower) and B (lower with the diagonal) over the dead k/q/g
 *   6 T = (I + M)^-1: (6a) the four diagonal 16 x 16 blocks by forward substitution, a thread a
 *     column; (6b) the blocks below by doubling: the two 32 x 32 diagonal blocks' lower-left
 *     blocks, then the 64 x 64 matrix's lower-left quarter, T_BA = -T_B (M_BA T_A)
 *   7 record planes Tb = T diag(beta), B (bf16 hi/lo) and e^{G_L}
 * Rows past the chunk's end: k = q = g = beta = 0, so their KX, QX, KL, A, B rows are zero and
 * Tb's rows and columns there are zero (beta = 0): the state kernel needs no masking but v and o. */

/* 4 consecutive values as bf16 hi (and lo, when lo != NULL) at 8-byte aligned addresses. */
static __device__ __forceinline__ void kc_store4(__nv_bfloat16 *hi, __nv_bfloat16 *lo, float4 a) {
    uint2 h, l;
    cu_split_bf16x2(a.x, a.y, &h.x, &l.x);
    cu_split_bf16x2(a.z, a.w, &h.y, &l.y);
    *reinterpret_cast<uint2 *>(hi) = h;
    if (lo) *reinterpret_cast<uint2 *>(lo) = l;
}

/* Step 1 of item `item` into buffer buf (k, q, g) and bts (beta). With p.vec4, cp.async in two
 * commit groups, g first: steps 2-3 need only g, so they run while k and q land; else plain loads. */
static __device__ __forceinline__ void kc_intra_load(const chunk_params &p, float *buf, float *bts, int item, int tid) {
    const int c = item % p.nck, h = item / p.nck, dk = p.dk, t0 = p.t0 + c * KDA_CHUNK;
    const int Lc = p.n - t0 < KDA_CHUNK ? p.n - t0 : KDA_CHUNK;
    float *Ks = buf + KI_K, *Qs = buf + KI_Q, *Gs = buf + KI_G;
    if (p.vec4) {
        /* thread: channels d..d+3 of rows i0 + 8 r (r < 8): one source pointer a tensor, stepped */
        const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
        const int d = (tid & 31) * 4, i0 = tid >> 5;
        const size_t o0 = ((size_t)(t0 + i0) * p.nh + h) * dk + d, step = (size_t)8 * p.nh * dk;
        const float *gp = p.g + o0;
#pragma unroll
        for (int r = 0; r < KDA_CHUNK / 8; r++) {
            const int x = kc_fx(i0 + 8 * r, d);
            if (i0 + 8 * r < Lc && d < dk) cu_cp_async16(Gs + x, gp + r * step);
            else *reinterpret_cast<float4 *>(Gs + x) = z;
        }
        cu_cp_async_commit();
        const float *kp = p.k + o0, *qp = p.q + o0;
#pragma unroll
        for (int r = 0; r < KDA_CHUNK / 8; r++) {
            const int x = kc_fx(i0 + 8 * r, d);
            if (i0 + 8 * r < Lc && d < dk) {
                cu_cp_async16(Ks + x, kp + r * step);
                cu_cp_async16(Qs + x, qp + r * step);
            } else {
                *reinterpret_cast<float4 *>(Ks + x) = z;
                *reinterpret_cast<float4 *>(Qs + x) = z;
            }
        }
        cu_cp_async_commit();
    } else {
        for (int e = tid; e < KDA_CHUNK * KDA_MAX_DK; e += KC_THREADS) {
            const int i = e >> 7, d = e & 127;
            float kv = 0.f, qv = 0.f, gv = 0.f;
            if (i < Lc && d < dk) {
                const size_t off = ((size_t)(t0 + i) * p.nh + h) * dk + d;
                kv = p.k[off];
                qv = p.q[off];
                gv = p.g[off];
            }
            Ks[kc_fx(i, d)] = kv;
            Qs[kc_fx(i, d)] = qv;
            Gs[kc_fx(i, d)] = gv;
        }
    }
    if (tid < KDA_CHUNK) bts[tid] = tid < Lc ? p.beta[(size_t)(t0 + tid) * p.nh + h] : 0.f;
}

/* Step 5's accumulators of unit u (sub-block I, J), the transposed tiles (rows j, columns i), to
 * M = diag(beta) A (strictly lower) and B (lower with the diagonal), in shared memory. */
static __device__ __forceinline__ void kc_unit_store(float *Ms, float *Aq, const float *bts, int u, const float (*acc)[2][4],
                                                     int g8, int c4) {
    const int I = u >= 6 ? 3 : u >= 3 ? 2 : u >= 1 ? 1 : 0, J = u - I * (I + 1) / 2;
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int i = 16 * I + 8 * nt + 2 * c4 + (r & 1), j = 16 * J + g8 + 8 * (r >> 1);
            Ms[i * KI_LDM + j] = (I > J || j < i) ? bts[i] * acc[0][nt][r] : 0.f;
            Aq[i * KI_LDM + j] = (I > J || j <= i) ? acc[1][nt][r] : 0.f;
        }
}

/* Steps 2-7 of item `item`, whose g and beta are in buf and bts (all threads see them); k and q
 * may still be landing (kc_intra_load's second cp.async group: waited for after step 3's factors). */
static __device__ __forceinline__ void kc_intra_item(const chunk_params &p, float *sm, float *buf, const float *bts,
                                                     int item, int tid) {
    float *Ks = buf + KI_K, *Qs = buf + KI_Q, *Gs = buf + KI_G;
    float *Ms = buf + KI_M, *Aq = buf + KI_AQ, *Ts = buf + KI_T, *Zs = buf + KI_Z;
    float *Rs = sm + KI_R, *Es = sm + KI_E, *ERs = sm + KI_ER, *ELs = sm + KI_EL, *GLs = sm + KI_GL;
    const int lane = tid & 31, w = tid >> 5;
    const int c = item % p.nck, h = item / p.nck;
    __nv_bfloat16 *rec = p.rec + ((size_t)h * p.nck + c) * KC_REC;
    const bool lo = p.terms > 1;
    int bad = 0;

    /* 2: cumulative log-decay, sub-block references, the fallback test. Thread: channel gd, steps
     * 32 hf.. (sub-blocks 2 hf, 2 hf + 1). The second half first adds up the first half's 32 steps
     * in the same order, so G is the sequential sum either way (that chain's loads are
     * independent); every thread keeps its 32 values of G and stores them after the barrier, once
     * the second half has read the first half's g. */
    float gs[32];
    const int gd = tid & (KDA_MAX_DK - 1), hf = tid / KDA_MAX_DK; /* channel, half of the steps */
    {
        float acc = 0.f;
        if (hf) {
#pragma unroll
            for (int r = 0; r < 32; r++) acc = Gs[kc_fx(r, gd)] + acc;
        }
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int J = 2 * hf + j;
            float mx = -INFINITY, mn = INFINITY;
#pragma unroll
            for (int r = 0; r < 16; r++) {
                const float gv = Gs[kc_fx(16 * J + r, gd)];
                bad |= gv > 0.f;
                acc = gv + acc;
                gs[16 * j + r] = acc;
                mx = fmaxf(mx, acc);
                mn = fminf(mn, acc);
            }
            Rs[J * KDA_MAX_DK + gd] = 0.5f * (mx + mn);
            bad |= !(mx - mn <= KC_SPAN_MAX); /* NaN spans too */
        }
        if (hf) GLs[gd] = acc; /* = G at the chunk's last step: rows past the end add g = 0 */
    }
    const bool fallback = __syncthreads_or(bad) != 0;
#pragma unroll
    for (int r = 0; r < 32; r++) Gs[kc_fx(32 * hf + r, gd)] = gs[r];

    /* 3: factors; (fallback) A, B exactly. Fallback thread tile: rows 4ti..4ti+3, columns
     * tc + 16y (y < 4); warp w only has rows <= 8w+7, so it skips the column blocks above. */
    for (int e = tid; e < 6 * KDA_MAX_DK; e += KC_THREADS) {
        const int pr = e >> 7, d = e & 127;
        const int I = pr < 1 ? 1 : pr < 3 ? 2 : 3, J = pr - I * (I - 1) / 2;
        Es[e] = __expf(Rs[I * KDA_MAX_DK + d] - Rs[J * KDA_MAX_DK + d]);
    }
    for (int e = tid; e < 4 * KDA_MAX_DK; e += KC_THREADS) {
        ERs[e] = __expf(Rs[e]);
        ELs[e] = __expf(GLs[e & 127] - Rs[e]);
    }
    const int ti = tid >> 4, tc = tid & 15, ymax = (8 * w + 7) / 16;
    float fa[4][4], fb[4][4];
#pragma unroll
    for (int x = 0; x < 4; x++)
#pragma unroll
        for (int y = 0; y < 4; y++) fa[x][y] = fb[x][y] = 0.f;
    cu_cp_async_wait<0>(); /* k and q (kc_intra_load's second group) */
    if (fallback) {
        __syncthreads(); /* (fallback is the same in every thread) */
        for (int d = 0; d < KDA_MAX_DK; d++) {
            float gi[4], ki[4], qi[4];
#pragma unroll
            for (int x = 0; x < 4; x++) {
                const int i = 4 * ti + x;
                gi[x] = Gs[kc_fx(i, d)];
                ki[x] = Ks[kc_fx(i, d)];
                qi[x] = Qs[kc_fx(i, d)];
            }
#pragma unroll
            for (int y = 0; y < 4; y++) {
                if (y > ymax) break;
                const int jj = tc + 16 * y;
                const float gj = Gs[kc_fx(jj, d)], kj = Ks[kc_fx(jj, d)];
#pragma unroll
                for (int x = 0; x < 4; x++) {
                    /* e^{G_i - G_j} <= 1 where kept (j <= i); above the diagonal it may be inf
                     * (times k = 0: NaN), masked at the store */
                    const float kk = kj * __expf(gi[x] - gj);
                    fa[x][y] += ki[x] * kk;
                    fb[x][y] += qi[x] * kk;
                }
            }
        }
    }
    __syncthreads(); /* factors visible; the fallback's reads of raw k, q, G are done */

    /* 4: factors in place, record planes. Thread: 4 consecutive channels of a row, so a warp's
     * 16-byte accesses cover one 512-byte row with no bank conflict (8 channels a thread, 32
     * bytes apart a lane, took two wavefronts per quarter warp: half of this step's shared
     * traffic, by ncu). */
    for (int e = tid; e < KDA_CHUNK * KDA_MAX_DK / 4; e += KC_THREADS) {
        const int i = e >> 5, d = (e & 31) * 4, x = kc_fx(i, d), o = kc_swz(i, d);
        float4 k0 = *reinterpret_cast<const float4 *>(Ks + x), q0 = *reinterpret_cast<const float4 *>(Qs + x);
        const float4 g0 = *reinterpret_cast<const float4 *>(Gs + x);
        float4 kx0, qx0, kl0;
        if (!fallback) {
            const int r = (i >> 4) * KDA_MAX_DK + d;
            const float4 r0 = *reinterpret_cast<const float4 *>(Rs + r);
            /* |G - R| <= KC_SPAN_MAX / 2 here: normal results, kc_exp4_n is exact __expf */
            const float4 ep0 = kc_exp4_n(kc_sub4(g0, r0)), en0 = kc_exp4_n(kc_sub4(r0, g0));
            const float4 kn0 = kc_mul4(k0, en0);
            k0 = kc_mul4(k0, ep0);
            q0 = kc_mul4(q0, ep0);
            kc_pack4(Ks + x, k0); /* step 5's B operands, split once here */
            kc_pack4(Qs + x, q0);
            *reinterpret_cast<float4 *>(Gs + x) = kn0;
            const float4 er0 = *reinterpret_cast<const float4 *>(ERs + r), el0 = *reinterpret_cast<const float4 *>(ELs + r);
            kx0 = kc_mul4(k0, er0);
            qx0 = kc_mul4(q0, er0);
            kl0 = kc_mul4(kn0, el0);
        } else {
            const float4 gl0 = *reinterpret_cast<const float4 *>(GLs + d), eg0 = kc_exp4(g0);
            kx0 = kc_mul4(k0, eg0);
            qx0 = kc_mul4(q0, eg0);
            kl0 = kc_mul4(k0, kc_exp4(kc_sub4(gl0, g0)));
        }
        kc_store4(rec + KC_KXH + o, lo ? rec + KC_KXL + o : NULL, kx0);
        kc_store4(rec + KC_QXH + o, lo ? rec + KC_QXL + o : NULL, qx0);
        kc_store4(rec + KC_KLH + o, lo ? rec + KC_KLL + o : NULL, kl0);
    }
    __syncthreads();

    /* 5: sub-block products. Unit u -> (I, J): 0 (0,0) 1 (1,0) 2 (1,1) 3 (2,0) 4 (2,1) 5 (2,2)
     * 6 (3,0) 7 (3,1) 8 (3,2) 9 (3,3). Slot 0: warp w takes unit w (warp 7: unit 9) whole; slot 1:
     * units 7 and 8 (M31, M32) are split by channel quarters (two k steps) over warps
     * 0-3 and 4-7, whose partial sums warps 2 and 6 add in a fixed order beside 6a: no warp
     * does more than 1.25 units (two whole units a warp took twice as long as the rest).
     * acc[slot][A or B][n8 tile]. */
    const int g8 = lane >> 2, c4 = lane & 3;
    float acc[2][2][2][4];
#pragma unroll
    for (int s = 0; s < 2; s++)
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int r = 0; r < 4; r++) acc[s][m][nt][r] = 0.f;
    if (!fallback) {
#pragma unroll
        for (int s = 0; s < 2; s++) {
            const int u = s ? 7 + (w >> 2) : w == 7 ? 9 : w;
            const int ks0 = s ? 2 * (w & 3) : 0, ks1 = s ? ks0 + 2 : KDA_MAX_DK / 16;
            {
                const int I = u >= 6 ? 3 : u >= 3 ? 2 : u >= 1 ? 1 : 0, J = u - I * (I + 1) / 2;
                const float *ep = I > J ? Es + (I * (I - 1) / 2 + J) * KDA_MAX_DK : NULL;
                for (int ks = ks0; ks < ks1; ks++) {
                    /* k order within the step: the mma's k pairs c4 and c4 + 4 are channels
                     * 16 ks + 4 c4 + (0, 1) and + (2, 3), both operands alike */
                    const int d0 = 16 * ks + 4 * c4;
                    uint32_t kf[2][4], qf[2][4]; /* B: KP_I, QP_I rows 8 nt + g8: hi b0 b1, lo b0 b1 */
#pragma unroll
                    for (int nt = 0; nt < 2; nt++) {
                        const uint4 ku = *reinterpret_cast<const uint4 *>(Ks + kc_fx(16 * I + 8 * nt + g8, d0));
                        const uint4 qu = *reinterpret_cast<const uint4 *>(Qs + kc_fx(16 * I + 8 * nt + g8, d0));
                        kf[nt][0] = ku.x, kf[nt][1] = ku.y, kf[nt][2] = ku.z, kf[nt][3] = ku.w;
                        qf[nt][0] = qu.x, qf[nt][1] = qu.y, qf[nt][2] = qu.z, qf[nt][3] = qu.w;
                    }
                    const float4 e4 = ep ? *reinterpret_cast<const float4 *>(ep + d0) : make_float4(1.f, 1.f, 1.f, 1.f);
                    /* A: E_IJ KN_J, rows g8 and g8 + 8 of sub-block J */
                    const float4 n0 = *reinterpret_cast<const float4 *>(Gs + kc_fx(16 * J + g8, d0));
                    const float4 n1 = *reinterpret_cast<const float4 *>(Gs + kc_fx(16 * J + g8 + 8, d0));
                    uint32_t ah[4], al[4];
                    cu_split_bf16x2(n0.x * e4.x, n0.y * e4.y, &ah[0], &al[0]);
                    cu_split_bf16x2(n1.x * e4.x, n1.y * e4.y, &ah[1], &al[1]);
                    cu_split_bf16x2(n0.z * e4.z, n0.w * e4.w, &ah[2], &al[2]);
                    cu_split_bf16x2(n1.z * e4.z, n1.w * e4.w, &ah[3], &al[3]);
                    /* three passes over the 4 accumulators: no mma waits on the one just before */
#pragma unroll
                    for (int nt = 0; nt < 2; nt++) {
                        cu_mma_bf16(acc[s][0][nt], al, kf[nt][0], kf[nt][1]);
                        cu_mma_bf16(acc[s][1][nt], al, qf[nt][0], qf[nt][1]);
                    }
#pragma unroll
                    for (int nt = 0; nt < 2; nt++) {
                        cu_mma_bf16(acc[s][0][nt], ah, kf[nt][2], kf[nt][3]);
                        cu_mma_bf16(acc[s][1][nt], ah, qf[nt][2], qf[nt][3]);
                    }
#pragma unroll
                    for (int nt = 0; nt < 2; nt++) {
                        cu_mma_bf16(acc[s][0][nt], ah, kf[nt][0], kf[nt][1]);
                        cu_mma_bf16(acc[s][1][nt], ah, qf[nt][0], qf[nt][1]);
                    }
                }
            }
        }
    }
    __syncthreads(); /* k/q/g are dead from here: M, B, T, Z take their place */

    /* (No zero fill above the block diagonal: only the fallback writes M and B there. 6a reads M's
     * diagonal blocks below their diagonal, 6b the blocks on and below it, and step 7 stores zeros
     * there whatever it reads) */
    if (fallback) {
#pragma unroll
        for (int x = 0; x < 4; x++)
#pragma unroll
            for (int y = 0; y < 4; y++) {
                const int i = 4 * ti + x, jj = tc + 16 * y;
                const bool live = y <= ymax;
                Ms[i * KI_LDM + jj] = (live && jj < i) ? bts[i] * fa[x][y] : 0.f;
                Aq[i * KI_LDM + jj] = (live && jj <= i) ? fb[x][y] : 0.f;
            }
    } else {
        kc_unit_store(Ms, Aq, bts, w == 7 ? 9 : w, acc[0], g8, c4);
        float *pp = sm + KI_P + (w * 16) * 32 + lane; /* slot 1's partial sums, lane-minor */
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int r = 0; r < 4; r++) pp[(8 * m + 4 * nt + r) * 32] = acc[1][m][nt][r];
    }
    __syncthreads();

    /* units 7 and 8 (M31, M32: off the diagonal, which 6a reads; 6b reads them past its barrier),
     * by warps 2 and 6, which 6a leaves idle */
    if (!fallback && (w & 3) == 2) {
        float sum[2][2][4];
        const float *pp = sm + KI_P + ((w & 4) * 16) * 32 + lane;
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    const int v = (8 * m + 4 * nt + r) * 32;
                    sum[m][nt][r] = ((pp[v] + pp[v + 512]) + pp[v + 1024]) + pp[v + 1536];
                }
        kc_unit_store(Ms, Aq, bts, 7 + (w >> 2), sum, g8, c4);
    }
    /* 6a: diagonal blocks of T, T_bb = (I + M_bb)^-1, by columns: thread (block b, column m) of
     * warps 0-1 walks down the column, T_rm = [r == m] - sum_{j<r} M_rj T_jm, adding each new entry's
     * products into the running sums of the rows below at once, so a step's dependent chain is one
     * multiply-add and one subtraction (four threads a column with shuffles had four adds and two
     * shuffles a step). */
    if (tid < 64) {
        const int b = tid >> 4, m = tid & 15;
        const float *Mb = Ms + 16 * b * KI_LDM + 16 * b;
        float run[16], t[16];
#pragma unroll
        for (int r = 0; r < 16; r++) run[r] = 0.f;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            t[j] = j < m ? 0.f : (j == m ? 1.f : 0.f) - run[j];
#pragma unroll
            for (int r = j + 1; r < 16; r++) run[r] += Mb[r * KI_LDM + j] * t[j];
        }
#pragma unroll
        for (int r = 0; r < 16; r++) Ts[(16 * b + r) * KI_LDM + 16 * b + m] = t[r];
    }
    __syncthreads();
    /* 6b: the blocks below the diagonal, by doubling: T10 = -T11 (M10 T00) and T32 = -T33 (M32 T22)
     * (the two 32 x 32 diagonal blocks), then the lower-left 32 x 32 quarter
     * T_{2+i, j} = -sum_k T_{2+i, 2+k} Z_{2+k, j} with Z_{2+i, j} = sum_{k >= j} M_{2+i, k} T_{k j}.
     * Each product stage on the tensor cores (kc_tf32_blk, fp32-accurate), a 16 x 8 tile a warp:
     * four barriers instead of six, and no per-element shared loads (the CUDA-core form took 14%
     * of the kernel's stall samples, by ncu). Z in Zs [4][16][KI_LDZ]. */
    {
        const int nt = w & 1, z = w >> 1; /* output tile: columns 8 nt.. of block z */
        float acc[4];
        if (w < 4) { /* level 1, Z: z = 0: Z10 = M10 T00, z = 1: Z32 = M32 T22 */
            const int r0 = 16 * (1 + 2 * z), c0 = 32 * z;
            acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
            kc_tf32_blk(acc, Ms + r0 * KI_LDM + c0, KI_LDM, Ts + c0 * KI_LDM + c0 + 8 * nt, KI_LDM, lane);
            kc_tile_store(Zs + z * 16 * KI_LDZ + 8 * nt, KI_LDZ, acc, 1.f, lane);
        }
        __syncthreads();
        if (w < 4) { /* level 1, T: T10 = -T11 Z10, T32 = -T33 Z32 */
            const int r0 = 16 * (1 + 2 * z);
            acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
            kc_tf32_blk(acc, Ts + r0 * KI_LDM + r0, KI_LDM, Zs + z * 16 * KI_LDZ + 8 * nt, KI_LDZ, lane);
            kc_tile_store(Ts + r0 * KI_LDM + 32 * z + 8 * nt, KI_LDM, acc, -1.f, lane);
        }
        __syncthreads();
        const int i = z >> 1, j = z & 1; /* level 2: block (2 + i, j) */
        acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
#pragma unroll
        for (int k = 0; k < 2; k++) /* Z_{2+i, j} = sum_{k >= j} M_{2+i, k} T_{k j} */
            if (k >= j)
                kc_tf32_blk(acc, Ms + 16 * (2 + i) * KI_LDM + 16 * k, KI_LDM, Ts + 16 * k * KI_LDM + 16 * j + 8 * nt, KI_LDM, lane);
        kc_tile_store(Zs + z * 16 * KI_LDZ + 8 * nt, KI_LDZ, acc, 1.f, lane);
        __syncthreads();
        acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
#pragma unroll
        for (int k = 0; k < 2; k++) /* T_{2+i, j} = -sum_{k <= i} T_{2+i, 2+k} Z_{2+k, j} */
            if (k <= i)
                kc_tf32_blk(acc, Ts + 16 * (2 + i) * KI_LDM + 16 * (2 + k), KI_LDM, Zs + (2 * k + j) * 16 * KI_LDZ + 8 * nt, KI_LDZ, lane);
        kc_tile_store(Ts + 16 * (2 + i) * KI_LDM + 16 * j + 8 * nt, KI_LDM, acc, -1.f, lane);
        __syncthreads();
    }

    /* 7: Tb, B, e^{G_L}; the 16 x 16 blocks above the diagonal block row stored as zeros,
     * explicitly (T and B are not written there): kc_state_wg_kernel multiplies whole planes */
    for (int e = tid; e < KDA_CHUNK * KDA_CHUNK / 4; e += KC_THREADS) { /* 4 values each (see step 4) */
        const int i = e >> 4, j = (e & 15) * 4, o = kc_swz(i, j);
        const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
        const bool up = (j >> 4) > (i >> 4);
        const float4 t4 = *reinterpret_cast<const float4 *>(Ts + i * KI_LDM + j);
        const float4 a4 = *reinterpret_cast<const float4 *>(Aq + i * KI_LDM + j);
        const float4 b4 = *reinterpret_cast<const float4 *>(bts + j);
        kc_store4(rec + KC_TBH + o, lo ? rec + KC_TBL + o : NULL, up ? z : kc_mul4(t4, b4));
        kc_store4(rec + KC_AQH + o, lo ? rec + KC_AQL + o : NULL, up ? z : a4);
    }
    if (tid < KDA_MAX_DK) reinterpret_cast<float *>(rec + KC_EGL)[tid] = expf(GLs[tid]);
}

/* Block = item (chunk, head) = blockIdx.x + nck * blockIdx.y, two blocks per SM: while one waits
 * on its loads or a barrier, the other computes. (A persistent form, one block per SM loading the
 * next item into a second buffer during the current one, measured 0.65 ms against 0.42 ms for
 * this on the 4096 x 64 x 128 bench: an item's phases are latency-bound, and two blocks hide that
 * better than prefetching does.) */
static __global__ void __launch_bounds__(KC_THREADS, 2) kc_intra_kernel(chunk_params p) {
    extern __shared__ float4 kc_smem4[];
    float *sm = reinterpret_cast<float *>(kc_smem4);
    const int tid = threadIdx.x, item = blockIdx.x + p.nck * blockIdx.y;
    kc_intra_load(p, sm, sm + KI_BT, item, tid);
    cu_cp_async_wait<1>(); /* g (kc_intra_item waits for k and q after step 3's factors) */
    __syncthreads();
    kc_intra_item(p, sm, sm, sm + KI_BT, item, tid);
}

/* ---- kc_state_kernel ----
 * Block = (64 value columns j0.., head h), 256 threads (8 warps), one block per SM (187 KB of
 * shared memory). The state slice S [128 d, 64 columns] lives in fp32 registers: warp w holds
 * rows 16w..16w+15 as the accumulators of 8 n8 tiles. Per chunk (the record's two sets by bulk
 * copies, a few per set, each completing on the set's mbarrier: set A = KX, QX is loaded during
 * the previous chunk's P3-P4, set B = KL, Tb, B, e^{G_L} during this chunk's P1-P2; the records
 * two chunks ahead and v one chunk ahead are prefetched to L2 and v of the next chunk is loaded
 * to registers after P2). Bulk copies replaced per-thread 16-byte cp.async (32 a thread and
 * chunk, padded rows): the state kernel went from 0.428 to 0.343 ms at 4096 x 64 x 128 on the
 * H200; one bulk copy per row was slower (0.500 ms).
 *   P1 X = KX S0, Y = QX S0       [64, 64] each, K = 128 (S0 = bf16 hi/lo copy of S in smem)
 *   P2 R = V - X                   to smem (bf16 hi/lo)
 *   P3 delta = Tb R                [64, 64], K = 64 (Tb lower: k blocks <= the row block)
 *   P4 o = Y + B delta, stored;    S = e^{G_L} S + KL^T delta  [128, 64], K = 64; S0 = bf16(S)
 * Warp tile of P1-P4a: rows 16 rb.. (rb = w / 2: the two warps of a scheduler differ in rb, which
 * evens out the triangular P3/P4a), columns 32 ch.. (ch = w % 2) of the block's 64. */
/* Part `part` of `parts` of the 128-byte lines of rec[off, off + len) (bf16 units) into L2. */
static __device__ __forceinline__ void kc_prefetch_range(const __nv_bfloat16 *rec, int off, int len, int part,
                                                         int parts, int tid) {
    const char *b = reinterpret_cast<const char *>(rec + off);
    const int lines = (len * 2 + 127) / 128;
    for (int e = part + parts * tid; e < lines; e += parts * KC_THREADS) kc_prefetch_l2(b + 128 * e);
}

/* This block's share (the ncb blocks of a head split it) of the planes of a record that the state
 * kernel reads, into L2 ahead of its bulk copies (kc_state_kernel: two chunks; kc_state_wg_kernel: one). */
template <int TERMS>
static __device__ __forceinline__ void kc_prefetch_rec(const __nv_bfloat16 *rec, int part, int parts, int tid) {
    kc_prefetch_range(rec, KC_KXH, TERMS * KC_SETA_HI, part, parts, tid);
    kc_prefetch_range(rec, KC_EGL, TERMS > 1 ? KC_REC - KC_EGL : KC_SETB_HI, part, parts, tid);
}

/* Sets A and B of a record into shared memory: a bulk copy per plane, issued by lanes of warp
 * 0, whose lane 0 also arrives on the set's barrier with the byte count. */
template <int TERMS>
static __device__ __forceinline__ void kc_load_set_a(__nv_bfloat16 *sb, const __nv_bfloat16 *rec, uint64_t *bar, int tid) {
    if (tid == 0) cu_mbar_arrive_tx(bar, TERMS * KC_SETA_HI * 2);
    if (tid < 2 * TERMS) cu_bulk_load(sb + KS_KXH + tid * KC_PLANE, rec + KC_KXH + tid * KC_PLANE, KC_PLANE * 2, bar);
}

template <int TERMS>
static __device__ __forceinline__ void kc_load_set_b(__nv_bfloat16 *sb, const __nv_bfloat16 *rec, uint64_t *bar, int tid) {
    /* pieces: e^{G_L} with KL hi; Tb hi, B hi; (KL lo; Tb lo, B lo) */
    if (tid == 0) cu_mbar_arrive_tx(bar, (TERMS > 1 ? KC_REC - KC_EGL : KC_SETB_HI) * 2);
    if (tid < 3 * TERMS) {
        const int a = tid == 0 ? KC_EGL : tid == 1 ? KC_TBH : tid == 2 ? KC_AQH : tid == 3 ? KC_KLL : tid == 4 ? KC_TBL : KC_AQL;
        const int b = tid == 0 ? KC_TBH : tid == 1 ? KC_AQH : tid == 2 ? KC_KLL : tid == 3 ? KC_TBL : tid == 4 ? KC_AQL : KC_REC;
        cu_bulk_load(sb + a, rec + a, (b - a) * 2, bar);
    }
}

/* The state registers (rows 16w + g8 (+8), columns 8nt + 2c4 (+1)) to the S0 planes. */
static __device__ __forceinline__ void kc_state_to_smem(__nv_bfloat16 *sb, const float S[8][4], int w, int g8, int c4) {
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int o = (16 * w + g8 + 8 * hf) * KS_LDB + 8 * nt + 2 * c4;
            uint32_t hi, lw;
            cu_split_bf16x2(S[nt][2 * hf], S[nt][2 * hf + 1], &hi, &lw);
            *reinterpret_cast<uint32_t *>(sb + KS_SH + o) = hi;
            *reinterpret_cast<uint32_t *>(sb + KS_SL + o) = lw;
        }
}

/* v of head h at step t0 + i, columns col and col + 1 (col even): zero past the chunk's end Lc
 * and past dk. */
static __device__ __forceinline__ float2 kc_v2(const chunk_params &p, int t0, int Lc, int h, int i, int col) {
    float2 x = make_float2(0.f, 0.f);
    if (i < Lc) {
        const float *vp = p.v + ((size_t)(t0 + i) * p.nh + h) * p.dk + col;
        if (p.vec2) {
            if (col < p.dk) x = *reinterpret_cast<const float2 *>(vp);
        } else {
            if (col < p.dk) x.x = vp[0];
            if (col + 1 < p.dk) x.y = vp[1];
        }
    }
    return x;
}
/* o of head h at step t0 + i, columns col and col + 1 (col even) = (a, b), where inside the
 * chunk's Lc steps and dk. */
static __device__ __forceinline__ void kc_o2(const chunk_params &p, int t0, int Lc, int h, int i, int col, float a,
                                             float b) {
    if (i < Lc && col < p.dk) {
        float *op = p.o + ((size_t)(t0 + i) * p.nh + h) * p.dk + col;
        if (p.vec2) {
            *reinterpret_cast<float2 *>(op) = make_float2(a, b);
        } else {
            op[0] = a;
            if (col + 1 < p.dk) op[1] = b;
        }
    }
}

/* v of the chunk starting at step t0 at the P1-P2 tile positions of this thread: rows
 * 16rb + g8 (+8), columns j0 + 32ch + 8nt + 2c4 (+1); zero past the end and past dk. */
static __device__ __forceinline__ void kc_load_v(const chunk_params &p, float vr[4][4], int t0, int h, int j0,
                                                 int rb, int ch, int g8, int c4) {
    const int Lc = p.n - t0 < KDA_CHUNK ? p.n - t0 : KDA_CHUNK;
#pragma unroll
    for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const float2 x = kc_v2(p, t0, Lc, h, 16 * rb + g8 + 8 * hf, j0 + 32 * ch + 8 * nt + 2 * c4);
            vr[nt][2 * hf] = x.x;
            vr[nt][2 * hf + 1] = x.y;
        }
}

template <int TERMS>
static __global__ void __launch_bounds__(KC_THREADS, 1) kc_state_kernel(chunk_params p) {
    extern __shared__ float4 kc_smem4[];
    __nv_bfloat16 *sb = reinterpret_cast<__nv_bfloat16 *>(kc_smem4);
    const float *sEGL = reinterpret_cast<const float *>(sb + KS_EGL);
    const int j0 = blockIdx.x * KC_COLS, h = blockIdx.y, tid = threadIdx.x, l = tid & 31, w = tid >> 5;
    const int g8 = l >> 2, c4 = l & 3, rb = w >> 1, ch = w & 1, dk = p.dk;
    const __nv_bfloat16 *rec0 = p.rec + (size_t)h * p.nck * KC_REC;
    float *Sg = p.state + (size_t)h * dk * dk;

    const int ncb = gridDim.x;
    uint64_t *barA = reinterpret_cast<uint64_t *>(sb + KS_BAR), *barB = barA + 1;
    if (tid == 0) {
        cu_mbar_init(barA, 1);
        cu_mbar_init(barB, 1);
        cu_mbar_init_fence();
    }
    __syncthreads();
    kc_load_set_a<TERMS>(sb, rec0, barA, tid);
    if (p.nck > 1) kc_prefetch_rec<TERMS>(rec0 + KC_REC, blockIdx.x, ncb, tid);
    float S[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int d = 16 * w + g8 + 8 * (r >> 1), col = j0 + 8 * nt + 2 * c4 + (r & 1);
            S[nt][r] = (d < dk && col < dk) ? Sg[(size_t)d * dk + col] : 0.f;
        }
    kc_state_to_smem(sb, S, w, g8, c4);
    float vr[4][4]; /* v of the current chunk for P2, loaded a chunk ahead */
    kc_load_v(p, vr, p.t0, h, j0, rb, ch, g8, c4);

    for (int c = 0; c < p.nck; c++) {
        const int t0 = p.t0 + c * KDA_CHUNK, Lc = p.n - t0 < KDA_CHUNK ? p.n - t0 : KDA_CHUNK;
        const __nv_bfloat16 *rec = rec0 + (size_t)c * KC_REC;
        cu_mbar_wait(barA, c & 1);
        __syncthreads(); /* set A(c) and S0 in place; sets B and R free (P4 of c-1 is done) */
        kc_load_set_b<TERMS>(sb, rec, barB, tid);
        if (c + 2 < p.nck) kc_prefetch_rec<TERMS>(rec + 2 * KC_REC, blockIdx.x, ncb, tid);
        if (tid < 2 * KDA_CHUNK && t0 + 2 * KDA_CHUNK + (tid >> 1) < p.n && j0 + 32 * (tid & 1) < dk)
            kc_prefetch_l2(p.v + ((size_t)(t0 + 2 * KDA_CHUNK + (tid >> 1)) * p.nh + h) * dk + j0 + 32 * (tid & 1));

        /* P1 */
        float X[4][4], Y[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int r = 0; r < 4; r++) X[nt][r] = Y[nt][r] = 0.f;
#pragma unroll 2
        for (int ks = 0; ks < KDA_MAX_DK / 16; ks++) {
            uint32_t kh[4], kl[4], qh[4], ql[4];
            cu_ldsm4(kh, kc_sw_a(sb + KS_KXH, 16 * rb, 16 * ks, l));
            cu_ldsm4(qh, kc_sw_a(sb + KS_QXH, 16 * rb, 16 * ks, l));
            if (TERMS > 1) {
                cu_ldsm4(kl, kc_sw_a(sb + KS_KXL, 16 * rb, 16 * ks, l));
                cu_ldsm4(ql, kc_sw_a(sb + KS_QXL, 16 * rb, 16 * ks, l));
            }
            uint32_t bh[2][4], bl[2][4];
#pragma unroll
            for (int np = 0; np < 2; np++) {
                cu_ldsm4_t(bh[np], kc_at_b(sb + KS_SH, KS_LDB, 16 * ks, 32 * ch + 16 * np, l));
                if (TERMS > 1) cu_ldsm4_t(bl[np], kc_at_b(sb + KS_SL, KS_LDB, 16 * ks, 32 * ch + 16 * np, l));
            }
            kc_mma_tiles<TERMS, 4>(X, kh, kl, Y, qh, ql, bh, bl);
        }
        /* P2 */
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const int o = (16 * rb + g8 + 8 * hf) * KS_LDB + 32 * ch + 8 * nt + 2 * c4;
                uint32_t hi, lw;
                cu_split_bf16x2(vr[nt][2 * hf] - X[nt][2 * hf], vr[nt][2 * hf + 1] - X[nt][2 * hf + 1], &hi, &lw);
                *reinterpret_cast<uint32_t *>(sb + KS_RH + o) = hi;
                *reinterpret_cast<uint32_t *>(sb + KS_RL + o) = lw;
            }
        if (c + 1 < p.nck) kc_load_v(p, vr, t0 + KDA_CHUNK, h, j0, rb, ch, g8, c4);
        cu_mbar_wait(barB, c & 1);
        __syncthreads(); /* set B(c) and R in place; set A is free */
        if (c + 1 < p.nck) kc_load_set_a<TERMS>(sb, rec + KC_REC, barA, tid);

        /* P3: delta = Tb R over k blocks 0..rb */
        float D[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int r = 0; r < 4; r++) D[nt][r] = 0.f;
        for (int ks = 0; ks <= rb; ks++) {
            uint32_t th[4], tl[4];
            cu_ldsm4(th, kc_sw_a(sb + KS_TBH, 16 * rb, 16 * ks, l));
            if (TERMS > 1) cu_ldsm4(tl, kc_sw_a(sb + KS_TBL, 16 * rb, 16 * ks, l));
            uint32_t bh[2][4], bl[2][4];
#pragma unroll
            for (int np = 0; np < 2; np++) {
                cu_ldsm4_t(bh[np], kc_at_b(sb + KS_RH, KS_LDB, 16 * ks, 32 * ch + 16 * np, l));
                if (TERMS > 1) cu_ldsm4_t(bl[np], kc_at_b(sb + KS_RL, KS_LDB, 16 * ks, 32 * ch + 16 * np, l));
            }
            kc_mma_tiles<TERMS, 4>(D, th, tl, NULL, NULL, NULL, bh, bl);
        }
        __syncthreads(); /* every warp has read R: delta replaces it */
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const int o = (16 * rb + g8 + 8 * hf) * KS_LDB + 32 * ch + 8 * nt + 2 * c4;
                uint32_t hi, lw;
                cu_split_bf16x2(D[nt][2 * hf], D[nt][2 * hf + 1], &hi, &lw);
                *reinterpret_cast<uint32_t *>(sb + KS_RH + o) = hi;
                *reinterpret_cast<uint32_t *>(sb + KS_RL + o) = lw;
            }
        __syncthreads();

        /* P4a: o = Y + B delta over k blocks 0..rb */
        for (int ks = 0; ks <= rb; ks++) {
            uint32_t ah[4], al[4];
            cu_ldsm4(ah, kc_sw_a(sb + KS_AQH, 16 * rb, 16 * ks, l));
            if (TERMS > 1) cu_ldsm4(al, kc_sw_a(sb + KS_AQL, 16 * rb, 16 * ks, l));
            uint32_t bh[2][4], bl[2][4];
#pragma unroll
            for (int np = 0; np < 2; np++) {
                cu_ldsm4_t(bh[np], kc_at_b(sb + KS_RH, KS_LDB, 16 * ks, 32 * ch + 16 * np, l));
                if (TERMS > 1) cu_ldsm4_t(bl[np], kc_at_b(sb + KS_RL, KS_LDB, 16 * ks, 32 * ch + 16 * np, l));
            }
            kc_mma_tiles<TERMS, 4>(Y, ah, al, NULL, NULL, NULL, bh, bl);
        }
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++)
                kc_o2(p, t0, Lc, h, 16 * rb + g8 + 8 * hf, j0 + 32 * ch + 8 * nt + 2 * c4, Y[nt][2 * hf],
                      Y[nt][2 * hf + 1]);

        /* P4b: S = e^{G_L} S + KL^T delta, rows 16w.. */
        {
            const float e0 = sEGL[16 * w + g8], e1 = sEGL[16 * w + g8 + 8];
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
                S[nt][0] *= e0;
                S[nt][1] *= e0;
                S[nt][2] *= e1;
                S[nt][3] *= e1;
            }
        }
#pragma unroll
        for (int ks = 0; ks < KDA_CHUNK / 16; ks++) {
            uint32_t ah[4], al[4];
            cu_ldsm4_t(ah, kc_sw_at(sb + KS_KLH, 16 * ks, 16 * w, l));
            if (TERMS > 1) cu_ldsm4_t(al, kc_sw_at(sb + KS_KLL, 16 * ks, 16 * w, l));
            uint32_t bh[4][4], bl[4][4];
#pragma unroll
            for (int np = 0; np < 4; np++) {
                cu_ldsm4_t(bh[np], kc_at_b(sb + KS_RH, KS_LDB, 16 * ks, 16 * np, l));
                if (TERMS > 1) cu_ldsm4_t(bl[np], kc_at_b(sb + KS_RL, KS_LDB, 16 * ks, 16 * np, l));
            }
            kc_mma_tiles<TERMS, 8>(S, ah, al, NULL, NULL, NULL, bh, bl);
        }
        kc_state_to_smem(sb, S, w, g8, c4); /* S0 of the next chunk (P1 of this one is done) */
    }

#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int d = 16 * w + g8 + 8 * (r >> 1), col = j0 + 8 * nt + 2 * c4 + (r & 1);
            if (d < dk && col < dk) Sg[(size_t)d * dk + col] = S[nt][r];
        }
}

/* ---- kc_state_wg_kernel (two-part arithmetic only) ----
 * kc_state_kernel's function on the warpgroup MMA. Block = (64 value columns j0.., head h), two
 * warpgroups; the state slice S [128 d, 64 columns] in fp32 registers as warpgroup wg's m64n64
 * accumulator over rows 64 wg.. (cuda_wgmma.h's layout). Every operand is read from shared memory:
 * the record planes as stored (64-column chunks of 128-byte swizzled rows, kc_swz), S0, R and
 * delta as [rows][64] tiles of the same swizzle, read MN-major as B (and KL MN-major as the A of
 * KL^T). Per chunk, three terms a product (lo hi, hi lo, hi hi):
 *   P1 warpgroup 0: X = KX S0, warpgroup 1: Y = QX S0        [64, 64], K = 128
 *   P2 warpgroup 0: R = V - X to shared memory (bf16 hi, lo)
 *   P3 warpgroup 0: delta = Tb R (the planes' upper blocks are zero)   K = 64
 *   P4 warpgroup 1: o = Y + B delta, stored; both: S = e^{G_L} S + KL^T delta over their rows
 * The record loads in three parts, each on an mbarrier of its own: set A (KX, QX) during P3-P4 of
 * the chunk before; Tb and B into one of two buffers, a chunk ahead (with set A), so P3 never waits
 * for them; e^{G_L} and KL during P1-P3 (P4 reads them). All to 1024-byte aligned places. With one
 * set B on one barrier issued at P1 (Tb, B and KL together), the walk waited for its copies before
 * P3 in 11% of its stall samples (ncu). */
enum {
    KW_SA = 0,                                   /* KX hi, QX hi, KX lo, QX lo: 16 KB each */
    KW_EGL = 64 * 1024,                          /* e^{G_L} [128] fp32 */
    KW_KLH = 65 * 1024, KW_KLL = 81 * 1024,
    KW_TB = 97 * 1024,                           /* two buffers of 32 KB: Tb hi, B hi, Tb lo, B lo */
    KW_TBUF = 32 * 1024, KW_TBH = 0, KW_AQH = 8 * 1024, KW_TBL = 16 * 1024, KW_AQL = 24 * 1024,
    KW_S0H = 161 * 1024, KW_S0L = 177 * 1024,    /* [128 d][64] */
    KW_RH = 193 * 1024, KW_RL = 201 * 1024,      /* [64 steps][64] */
    KW_DH = 209 * 1024, KW_DL = 217 * 1024,
    KW_BAR = 225 * 1024,                         /* sets A, B (e^{G_L}, KL), Tb/B buffers 0, 1 */
    KW_SMEM = KW_BAR + 32 + 1024 /* alignment */,
};
static_assert(KC_AQH == KC_TBH + KC_SMALL && KC_AQL == KC_TBL + KC_SMALL, "Tb and B planes adjacent in the record");

/* Byte offset of element (r, col < 64) of a [rows][64] bf16 tile with 128-byte swizzled rows. */
static __device__ __forceinline__ int kw_off(int r, int col) {
    return r * 128 + (((col >> 3) ^ (r & 7)) << 4) + (col & 7) * 2;
}

/* An m64n64 accumulator of fp32 pairs into a [rows][64] tile as bf16 hi and lo (row r0 + its
 * row in the tile); entries x, x + 1 are adjacent columns. */
static __device__ __forceinline__ void kw_store_split(uint8_t *hi, uint8_t *lo, const float *acc, int r0, int wt) {
    const int w = wt >> 5, g = (wt & 31) >> 2, q4 = wt & 3;
#pragma unroll
    for (int x = 0; x < 32; x += 2) {
        const int r = r0 + 16 * w + g + 8 * ((x >> 1) & 1), col = 8 * (x >> 2) + 2 * q4;
        uint32_t h2, l2;
        cu_split_bf16x2(acc[x], acc[x + 1], &h2, &l2);
        *reinterpret_cast<uint32_t *>(hi + kw_off(r, col)) = h2;
        *reinterpret_cast<uint32_t *>(lo + kw_off(r, col)) = l2;
    }
}

/* v of the chunk at step t0 at accumulator positions (rows = steps), zero past the end and dk. */
static __device__ __forceinline__ void kw_load_v(const chunk_params &p, float *vr, int t0, int h, int j0, int wt) {
    const int Lc = p.n - t0 < KDA_CHUNK ? p.n - t0 : KDA_CHUNK;
    const int w = wt >> 5, g = (wt & 31) >> 2, q4 = wt & 3;
#pragma unroll
    for (int x = 0; x < 32; x += 2) {
        const float2 v = kc_v2(p, t0, Lc, h, 16 * w + g + 8 * ((x >> 1) & 1), j0 + 8 * (x >> 2) + 2 * q4);
        vr[x] = v.x;
        vr[x + 1] = v.y;
    }
}

static __global__ void __launch_bounds__(KC_THREADS, 1) kc_state_wg_kernel(chunk_params p) {
    extern __shared__ uint8_t kw_raw[];
    uint8_t *sm = (uint8_t *)(((uintptr_t)kw_raw + 1023) & ~(uintptr_t)1023);
    const int j0 = blockIdx.x * KC_COLS, h = blockIdx.y, tid = threadIdx.x, wg = tid >> 7, wt = tid & 127;
    const int w = wt >> 5, g = (wt & 31) >> 2, q4 = wt & 3, dk = p.dk, ncb = gridDim.x;
    const __nv_bfloat16 *rec0 = p.rec + (size_t)h * p.nck * KC_REC;
    float *Sg = p.state + (size_t)h * dk * dk;
    uint64_t *barA = reinterpret_cast<uint64_t *>(sm + KW_BAR), *barB = barA + 1, *barT = barA + 2;
    const float *sEGL = reinterpret_cast<const float *>(sm + KW_EGL);
    auto load_a = [&](const __nv_bfloat16 *rec) {
        if (tid == 0) cu_mbar_arrive_tx(barA, 4 * KC_PLANE * 2);
        if (tid < 4) cu_bulk_load(sm + KW_SA + tid * KC_PLANE * 2, rec + KC_KXH + tid * KC_PLANE, KC_PLANE * 2, barA);
    };
    /* e^{G_L} and KL hi, lo: a piece a thread. The piece is chosen by selects, not branches: a form
     * whose choice compiled as branches (warp 0 diverging before the chunk's wgmmas) made the walk
     * 7% slower on the H200 (0.314 against 0.293 ms, same run). */
    auto load_b = [&](const __nv_bfloat16 *rec) {
        if (tid == 0) cu_mbar_arrive_tx(barB, (KC_KLH - KC_EGL + 2 * KC_PLANE) * 2);
        const int k = tid;
        if (k < 3) {
            const int src = k == 0 ? KC_EGL : k == 1 ? KC_KLH : KC_KLL;
            const int len = k == 0 ? KC_KLH - KC_EGL : KC_PLANE;
            const int dst = k == 0 ? KW_EGL : k == 1 ? KW_KLH : KW_KLL;
            cu_bulk_load(sm + dst, rec + src, (uint32_t)len * 2, barB);
        }
    };
    /* Tb and B (hi planes adjacent in the record, lo planes too) into buffer b */
    auto load_t = [&](const __nv_bfloat16 *rec, int b) {
        if (tid == 0) cu_mbar_arrive_tx(barT + b, 4 * KC_SMALL * 2);
        if (tid < 2)
            cu_bulk_load(sm + KW_TB + b * KW_TBUF + (tid ? KW_TBL : KW_TBH), rec + (tid ? KC_TBL : KC_TBH),
                         2 * KC_SMALL * 2, barT + b);
    };
    if (tid == 0) {
        cu_mbar_init(barA, 1);
        cu_mbar_init(barB, 1);
        cu_mbar_init(barT, 1);
        cu_mbar_init(barT + 1, 1);
        cu_mbar_init_fence();
    }
    __syncthreads();
    load_a(rec0);
    load_t(rec0, 0);
    /* S entry x: row d = 64 wg + 16 w + g + 8 ((x >> 1) & 1), column j0 + 8 (x >> 2) + 2 q4 + (x & 1) */
    float S[32];
#pragma unroll
    for (int x = 0; x < 32; x++) {
        const int d = 64 * wg + 16 * w + g + 8 * ((x >> 1) & 1), col = j0 + 8 * (x >> 2) + 2 * q4 + (x & 1);
        S[x] = (d < dk && col < dk) ? Sg[(size_t)d * dk + col] : 0.f;
    }
    kw_store_split(sm + KW_S0H, sm + KW_S0L, S, 64 * wg, wt);
    cu_proxy_fence_async();
    float vr[32]; /* warpgroup 0: v of the current chunk, loaded a chunk ahead */
    if (wg == 0) kw_load_v(p, vr, p.t0, h, j0, wt);

    for (int c = 0; c < p.nck; c++) {
        const int t0 = p.t0 + c * KDA_CHUNK, Lc = p.n - t0 < KDA_CHUNK ? p.n - t0 : KDA_CHUNK;
        const __nv_bfloat16 *rec = rec0 + (size_t)c * KC_REC;
        const uint8_t *tb = sm + KW_TB + (c & 1) * KW_TBUF; /* Tb(c), B(c) */
        cu_mbar_wait(barA, c & 1);
        __syncthreads(); /* set A(c) and S0 in place; e^{G_L}, KL, R, delta free (P3, P4 of c - 1 done) */
        load_b(rec);
        /* the next chunk's record into L2, ahead of its copies (set A and Tb, B after P2 here; e^{G_L}
         * and KL at the next chunk's top). Two, three and four chunks ahead took 0.291, 0.301 and
         * 0.318 ms against 0.285 on the H200 */
        if (c + 1 < p.nck) kc_prefetch_rec<2>(rec + KC_REC, blockIdx.x, ncb, tid);
        if (tid < 2 * KDA_CHUNK && t0 + 2 * KDA_CHUNK + (tid >> 1) < p.n && j0 + 32 * (tid & 1) < dk)
            kc_prefetch_l2(p.v + ((size_t)(t0 + 2 * KDA_CHUNK + (tid >> 1)) * p.nh + h) * dk + j0 + 32 * (tid & 1));

        /* P1: X (warpgroup 0) or Y (1) = [KX | QX] S0 */
        float XY[32];
        {
            const uint8_t *ah = sm + KW_SA + wg * KC_PLANE * 2, *al = ah + 2 * KC_PLANE * 2;
            cu_wg_fence();
#pragma unroll
            for (int ks = 0; ks < KDA_MAX_DK / 16; ks++) {
                const int ao = (ks >> 2) * (KDA_CHUNK * 128) + 32 * (ks & 3);
                const uint64_t bh = cu_wg_desc_mn(sm + KW_S0H + ks * 2048, 8192), bl = cu_wg_desc_mn(sm + KW_S0L + ks * 2048, 8192);
                cu_wgmma_bf16_64t<0, 1>(XY, cu_wg_desc(al + ao), bh, ks);
                cu_wgmma_bf16_64t<0, 1>(XY, cu_wg_desc(ah + ao), bl, 1);
                cu_wgmma_bf16_64t<0, 1>(XY, cu_wg_desc(ah + ao), bh, 1);
            }
            cu_wg_commit();
            cu_wg_wait<0>();
#pragma unroll
            for (int x = 0; x < 32; x++) cu_wg_reg_fence(XY[x]);
        }
        /* P2 */
        if (wg == 0) {
            float r[32];
#pragma unroll
            for (int x = 0; x < 32; x++) r[x] = vr[x] - XY[x];
            kw_store_split(sm + KW_RH, sm + KW_RL, r, 0, wt);
            cu_proxy_fence_async();
            if (c + 1 < p.nck) kw_load_v(p, vr, t0 + KDA_CHUNK, h, j0, wt);
        }
        cu_mbar_wait(barT + (c & 1), (c >> 1) & 1);
        __syncthreads(); /* Tb(c) and R in place; set A and the other Tb buffer (c - 1's) are free */
        if (c + 1 < p.nck) {
            load_a(rec + KC_REC);
            load_t(rec + KC_REC, (c + 1) & 1);
        }

        /* P3: delta = Tb R (warpgroup 0) */
        if (wg == 0) {
            float D[32];
            cu_wg_fence();
#pragma unroll
            for (int ks = 0; ks < KDA_CHUNK / 16; ks++) {
                const uint64_t th = cu_wg_desc(tb + KW_TBH + 32 * ks), tl = cu_wg_desc(tb + KW_TBL + 32 * ks);
                const uint64_t bh = cu_wg_desc_mn(sm + KW_RH + ks * 2048, 8192), bl = cu_wg_desc_mn(sm + KW_RL + ks * 2048, 8192);
                cu_wgmma_bf16_64t<0, 1>(D, tl, bh, ks);
                cu_wgmma_bf16_64t<0, 1>(D, th, bl, 1);
                cu_wgmma_bf16_64t<0, 1>(D, th, bh, 1);
            }
            cu_wg_commit();
            cu_wg_wait<0>();
#pragma unroll
            for (int x = 0; x < 32; x++) cu_wg_reg_fence(D[x]);
            kw_store_split(sm + KW_DH, sm + KW_DL, D, 0, wt);
            cu_proxy_fence_async();
        }
        __syncthreads(); /* delta in place */
        cu_mbar_wait(barB, c & 1); /* e^{G_L} and KL */

        /* P4: o = Y + B delta (warpgroup 1); S = e^{G_L} S + KL^T delta over this warpgroup's rows */
#pragma unroll
        for (int x = 0; x < 32; x++) S[x] *= sEGL[64 * wg + 16 * w + g + 8 * ((x >> 1) & 1)];
#pragma unroll
        for (int x = 0; x < 32; x++) cu_wg_reg_fence(S[x]);
        /* KL^T: the plane's chunk of rows d in 64 wg.., read MN-major (M = d, K = steps) */
        auto kl_delta = [&] {
#pragma unroll
            for (int ks = 0; ks < KDA_CHUNK / 16; ks++) {
                const uint64_t ah = cu_wg_desc_mn(sm + KW_KLH + wg * 8192 + ks * 2048, 8192),
                               al = cu_wg_desc_mn(sm + KW_KLL + wg * 8192 + ks * 2048, 8192);
                const uint64_t bh = cu_wg_desc_mn(sm + KW_DH + ks * 2048, 8192), bl = cu_wg_desc_mn(sm + KW_DL + ks * 2048, 8192);
                cu_wgmma_bf16_64t<1, 1>(S, al, bh, 1);
                cu_wgmma_bf16_64t<1, 1>(S, ah, bl, 1);
                cu_wgmma_bf16_64t<1, 1>(S, ah, bh, 1);
            }
        };
        if (wg == 1) { /* (each warpgroup's products in one straight run: no wgmma in a branch of it) */
            cu_wg_fence();
#pragma unroll
            for (int ks = 0; ks < KDA_CHUNK / 16; ks++) {
                const uint64_t ah = cu_wg_desc(tb + KW_AQH + 32 * ks), al = cu_wg_desc(tb + KW_AQL + 32 * ks);
                const uint64_t bh = cu_wg_desc_mn(sm + KW_DH + ks * 2048, 8192), bl = cu_wg_desc_mn(sm + KW_DL + ks * 2048, 8192);
                cu_wgmma_bf16_64t<0, 1>(XY, al, bh, 1);
                cu_wgmma_bf16_64t<0, 1>(XY, ah, bl, 1);
                cu_wgmma_bf16_64t<0, 1>(XY, ah, bh, 1);
            }
            kl_delta();
            cu_wg_commit();
            cu_wg_wait<0>();
        } else {
            cu_wg_fence();
            kl_delta();
            cu_wg_commit();
            cu_wg_wait<0>();
        }
#pragma unroll
        for (int x = 0; x < 32; x++) cu_wg_reg_fence(S[x]);
#pragma unroll
        for (int x = 0; x < 32; x++) cu_wg_reg_fence(XY[x]);
        if (wg == 1) {
#pragma unroll
            for (int x = 0; x < 32; x += 2)
                kc_o2(p, t0, Lc, h, 16 * w + g + 8 * ((x >> 1) & 1), j0 + 8 * (x >> 2) + 2 * q4, XY[x], XY[x + 1]);
        }
        kw_store_split(sm + KW_S0H, sm + KW_S0L, S, 64 * wg, wt); /* S0 of the next chunk */
        cu_proxy_fence_async();
    }

#pragma unroll
    for (int x = 0; x < 32; x++) {
        const int d = 64 * wg + 16 * w + g + 8 * ((x >> 1) & 1), col = j0 + 8 * (x >> 2) + 2 * q4 + (x & 1);
        if (d < dk && col < dk) Sg[(size_t)d * dk + col] = S[x];
    }
}

/* Segments of at most KC_SEG_CHUNKS chunks: the intra kernel over all of a segment's chunks, then
 * the state kernel walks them. The records live in the backend's attention scratch. */
static mt_status kc_launch(mt_backend *be, const chunk_params *p0) {
    const cu_backend *cb = (const cu_backend *)be;
    chunk_params p = *p0;
    p.terms = cb->tc_terms > 1 || cb->params.kda_chunk_exact ? 2 : 1;
    p.vec4 = p.dk % 4 == 0 && (((uintptr_t)p.q | (uintptr_t)p.k | (uintptr_t)p.g) & 15) == 0;
    p.vec2 = p.dk % 2 == 0 && (((uintptr_t)p.v | (uintptr_t)p.o) & 7) == 0;
    const int nck_all = (p.n + KDA_CHUNK - 1) / KDA_CHUNK;
    const int seg = nck_all < KC_SEG_CHUNKS ? nck_all : KC_SEG_CHUNKS;
    p.rec = (__nv_bfloat16 *)cu_scratch(be, CU_SCRATCH_ATTN, (size_t)p.nh * seg * KC_REC * sizeof(__nv_bfloat16));
    if (!p.rec) return MT_ERR_NOMEM;

    const size_t smem_i = (size_t)KI_FLOATS * sizeof(float), smem_s = (size_t)KS_BF16 * sizeof(__nv_bfloat16);
    MT_CUDA_CHECK(cudaFuncSetAttribute(kc_intra_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_i));
    /* two-part arithmetic on kc_state_wg_kernel, one part on kc_state_kernel */
    const bool wgs = p.terms > 1;
    void (*state_kernel)(chunk_params) = wgs ? kc_state_wg_kernel : kc_state_kernel<1>;
    const size_t smem_st = wgs ? (size_t)KW_SMEM : smem_s;
    MT_CUDA_CHECK(cudaFuncSetAttribute(state_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_st));
    /* mt_cuda_params.kda_chunk_kernels: one kernel alone, to time it apart (outputs wrong) */
    const mt_cuda_kda_chunk_kernels only = cb->params.kda_chunk_kernels;
    for (int c0 = 0; c0 < nck_all; c0 += seg) {
        p.t0 = c0 * KDA_CHUNK;
        p.nck = nck_all - c0 < seg ? nck_all - c0 : seg;
        if (only != MT_CUDA_KDA_CHUNK_STATE) {
            kc_intra_kernel<<<dim3(p.nck, p.nh), KC_THREADS, smem_i, cu_stream(be)>>>(p);
            cu_check_launch(be, "kda_chunked (intra)");
        }
        if (only != MT_CUDA_KDA_CHUNK_INTRA) {
            state_kernel<<<dim3((p.dk + KC_COLS - 1) / KC_COLS, p.nh), KC_THREADS, smem_st, cu_stream(be)>>>(p);
            cu_check_launch(be, "kda_chunked (state)");
        }
    }
    return MT_OK;
}

static void cu_kda_chunked(mt_backend *be, float *o, const float *q, const float *k,
                           const float *v, const float *g, const float *beta, float *state,
                           int n, int nh, int dk) {
    MT_ASSERT(n >= 0 && nh > 0 && nh <= 65535 && dk > 0 && dk <= KDA_MAX_DK);
    if (n == 0) return;
    chunk_params p;
    memset(&p, 0, sizeof p);
    p.o = o;
    p.q = q;
    p.k = k;
    p.v = v;
    p.g = g;
    p.beta = beta;
    p.state = state;
    p.n = n;
    p.nh = nh;
    p.dk = dk;
    const bool tc = ((const cu_backend *)be)->tc_terms > 0;
    cu_op_status(be, "kda_chunked", tc ? kc_launch(be, &p) : kda_chunked_launch(be, &p));
}

extern "C" void cu_kda_chunk_fill(mt_backend_ops *t) {
    t->kda_chunked = cu_kda_chunked;
}
