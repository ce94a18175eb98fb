/* kernels/cuda/cuda_dsa.cu: the DSA ops on the GPU, computing the same functions as
 * kernels/cpu/cpu_dsa.c: pooled indexer keys, the head-weighted ReLU pool scores with pool top-k
 * plus the tail, and sparse MLA in the latent space (weight absorption). Three tiers per op:
 * static kernels, a static launcher that picks the grid, and the op that checks shapes and
 * dtypes. */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_dsa_mla.h"
#include "kernels/cuda/cuda_ops.h"


/* ------------------------------------------------------------------------------------------ */
/* dsa_pool_keys                                                                                */

typedef struct pool_params {
    mt_paged pool_keys;  /* [n_pages, page / kpool, id] */
    mt_paged ki, gs;     /* [n_pages, page, id] */
    const int32_t *bt;   /* block table */
    const float *ape;    /* [kpool, id] */
    int p0, p1, kpool, id;
    const int32_t *pos;  /* graph form: pool (*pos+1)/kpool - 1 when *pos completes it, else none */
} pool_params;

/* One thread per (pool, channel): cu_pool_key (cuda_ops.h). Adjacent threads are adjacent
 * channels (coalesced). */
static __global__ void dsa_pool_keys_kernel(pool_params p) {
    if (p.pos) { /* one pool, decided at run time */
        const int t = *p.pos;
        if ((t + 1) % p.kpool != 0) return;
        p.p0 = t / p.kpool;
        p.p1 = p.p0 + 1;
    }
    const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (int64_t)(p.p1 - p.p0) * p.id) return;
    cu_pool_key(p.pool_keys, p.ki, p.gs, p.bt, p.ape, p.p0 + (int)(e / p.id), (int)(e % p.id), p.kpool);
}

static void dsa_pool_keys_launch(mt_backend *be, const pool_params *p) {
    const int64_t count = (int64_t)(p->p1 - p->p0) * p->id;
    dsa_pool_keys_kernel<<<(unsigned)((count + 255) / 256), 256, 0, cu_stream(be)>>>(*p);
    cu_check_launch(be, "dsa_pool_keys");
}

static pool_params pool_setup(mt_paged pool_keys, mt_paged ki, mt_paged gs, const int32_t *bt, const float *ape,
                              int p0, int p1, int kpool, const int32_t *pos) {
    const int id = (int)ki.row;
    MT_ASSERT(p0 >= 0 && p1 >= p0 && kpool > 0 && id > 0 && gs.row == id && pool_keys.row == id && bt);
    MT_ASSERT(ki.page == gs.page && pool_keys.page > 0 && ki.page == pool_keys.page * kpool);
    return (pool_params){pool_keys, ki, gs, bt, ape, p0, p1, kpool, id, pos};
}

static void cu_dsa_pool_keys(mt_backend *be, mt_paged pool_keys, mt_paged ki, mt_paged gs, const int32_t *bt,
                             const float *ape, int p0, int p1, int kpool) {
    const pool_params p = pool_setup(pool_keys, ki, gs, bt, ape, p0, p1, kpool, NULL);
    if (p1 == p0) return;
    dsa_pool_keys_launch(be, &p);
}

static void cu_dsa_pool_keys_at(mt_backend *be, mt_paged pool_keys, mt_paged ki, mt_paged gs,
                                const int32_t *bt, const float *ape, const int32_t *pos, int kpool) {
    MT_ASSERT(pos);
    const pool_params p = pool_setup(pool_keys, ki, gs, bt, ape, 0, 1, kpool, pos); /* grid sized for one pool */
    dsa_pool_keys_launch(be, &p);
}

/* ------------------------------------------------------------------------------------------ */
/* dsa_select                                                                                   */

enum {
    SEL_THREADS = 256,
    SEL_WARPS = SEL_THREADS / 32,
    SEL_GROUP = 4,  /* pools scored together by one warp */
};

typedef struct select_params {
    int32_t *sel;            /* [n, max_sel] */
    int32_t *nsel;           /* [n] */
    const float *qi;         /* [n, ih, id] */
    const float *w;          /* [n, ih] weights_proj(x), unscaled */
    mt_paged pool_keys;      /* [n_pages, page / kpool, id]: pool c of a query's sequence is row
                              * c % page of page bt[c / page] (page = pools a page here) */
    const int32_t *bt;       /* the sequence's block table, covering pools [0, (t0+n)/kpool) */
    int t0, n, ih, id, kpool, max_pools, max_sel;
    bool tail;
    bool vec4;               /* id % 4 == 0 and qi, pool_keys.base 16-byte aligned */
    float qscale, wscale;    /* id^-0.5, ih^-0.5 (computed on the host as the CPU does) */
    int qld;                 /* row stride of the staged qi in shared memory (id + 4) */
    int max_cand;            /* (t0+n)/kpool, or t_cap/kpool in graph form: capacity of the key array */
    const int32_t *t0_dev;   /* graph form: t0 read here at run time */
    /* rows form (batched decode): query i is at position pos_rows[i] of the sequence whose block
     * table is bt_rows[i] (device tables [n]); t0, t0_dev and bt are then unused */
    const int32_t *pos_rows;
    const int32_t *const *bt_rows;
} select_params;

typedef struct select_smem {
    float *q;          /* [ih, qld] query row i */
    float *w;          /* [ih] w * wscale */
    uint32_t *key;     /* [max_cand] order-preserving keys of the pool scores */
    uint32_t *kkey;    /* [max_pools] kept keys */
    int32_t *kidx;     /* [max_pools] kept pool indices */
    int32_t *order;    /* [max_pools] kept pools, best first */
} select_smem;

static __host__ __device__ size_t select_smem_carve(void *smem, const select_params *p, select_smem *s) {
    size_t off = 0;
    char *b = (char *)smem;
    float *q = (float *)(b + off); off += sizeof(float) * (size_t)p->ih * p->qld;
    float *w = (float *)(b + off); off += sizeof(float) * (size_t)p->ih;
    uint32_t *key = (uint32_t *)(b + off); off += sizeof(uint32_t) * (size_t)(p->max_cand > 0 ? p->max_cand : 1);
    uint32_t *kkey = (uint32_t *)(b + off); off += sizeof(uint32_t) * (size_t)(p->max_pools > 0 ? p->max_pools : 1);
    int32_t *kidx = (int32_t *)(b + off); off += sizeof(int32_t) * (size_t)(p->max_pools > 0 ? p->max_pools : 1);
    int32_t *order = (int32_t *)(b + off); off += sizeof(int32_t) * (size_t)(p->max_pools > 0 ? p->max_pools : 1);
    if (s) *s = (select_smem){q, w, key, kkey, kidx, order};
    return off;
}

/* Float -> uint32 with the same order (for non-NaN); -0 is folded into +0 first so that equal
 * scores give equal keys, as the CPU's comparison treats them. */
static __device__ __forceinline__ uint32_t score_key(float s) {
    if (s == 0.f) s = 0.f;
    const uint32_t u = __float_as_uint(s);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* Block = query row i. (1) Each warp scores groups of 4 candidate pools, lanes over indexer
 * heads; the scores become keys in shared memory. (2) When more pools are complete than
 * max_pools: a 4-pass radix select finds the keep-th largest key T; the pools above T and the
 * lowest-indexed ones equal to T are kept and ranked by (score desc, pool asc); otherwise every
 * pool is kept in ascending order, exactly as the CPU (which sorts only when it drops some).
 * (3) The kept pools' positions, then the tail, go to sel. */
static __global__ void __launch_bounds__(SEL_THREADS) dsa_select_kernel(select_params p) {
    cu_pdl_wait(); /* launched for PDL (cu_launch_pdl_k) */
    cu_pdl_trigger();
    extern __shared__ float4 smem_f4[];
    select_smem sm;
    select_smem_carve(smem_f4, &p, &sm);
    __shared__ uint32_t hist[256];
    __shared__ uint32_t sh_prefix;
    __shared__ int sh_remaining, sh_ngt;

    const int i = blockIdx.x, tid = threadIdx.x, lane = tid & 31, wp = tid >> 5;
    const int t = p.pos_rows ? p.pos_rows[i] : (p.t0_dev ? *p.t0_dev : p.t0) + i, ncand = (t + 1) / p.kpool;
    const int keep = ncand < p.max_pools ? ncand : p.max_pools;
    const int32_t *bt = p.bt_rows ? p.bt_rows[i] : p.bt;
    const int ih = p.ih, id = p.id, ppp = p.pool_keys.page;

    if (keep < ncand) {
        /* (1) scores */
        const float *qrow = p.qi + (size_t)i * ih * id;
        for (int e = tid; e < ih * id; e += SEL_THREADS) sm.q[(e / id) * p.qld + e % id] = qrow[e];
        for (int h = tid; h < ih; h += SEL_THREADS) sm.w[h] = p.w[(size_t)i * ih + h] * p.wscale;
        __syncthreads();
        for (int c0 = wp * SEL_GROUP; c0 < ncand; c0 += SEL_WARPS * SEL_GROUP) {
            const float *P[SEL_GROUP]; /* the group's key rows, looked up once per group */
#pragma unroll
            for (int g = 0; g < SEL_GROUP; g++) { /* past the end: score pool ncand-1 again, dropped */
                const int c = c0 + g < ncand ? c0 + g : ncand - 1;
                P[g] = p.pool_keys.base + ((int64_t)__ldg(bt + c / ppp) * ppp + c % ppp) * id;
            }
            float part[SEL_GROUP] = {0.f, 0.f, 0.f, 0.f};
            for (int hb = 0; hb < ih; hb += 32) {
                const int h = hb + lane;
                if (h >= ih) break;
                const float *qh = sm.q + (size_t)h * p.qld;
                float acc[SEL_GROUP] = {0.f, 0.f, 0.f, 0.f};
                if (p.vec4) {
                    for (int d = 0; d < id; d += 4) {
                        const float4 q4 = *(const float4 *)(qh + d);
#pragma unroll
                        for (int g = 0; g < SEL_GROUP; g++) {
                            const float4 k4 = __ldg((const float4 *)(P[g] + d));
                            acc[g] += q4.x * k4.x + q4.y * k4.y + q4.z * k4.z + q4.w * k4.w;
                        }
                    }
                } else {
                    for (int d = 0; d < id; d++) {
                        const float qv = qh[d];
#pragma unroll
                        for (int g = 0; g < SEL_GROUP; g++) acc[g] += qv * __ldg(P[g] + d);
                    }
                }
#pragma unroll
                for (int g = 0; g < SEL_GROUP; g++) {
                    const float dd = acc[g] * p.qscale;
                    part[g] += sm.w[h] * (dd > 0.f ? dd : 0.f);
                }
            }
#pragma unroll
            for (int g = 0; g < SEL_GROUP; g++) {
#pragma unroll
                for (int m = 16; m > 0; m >>= 1) part[g] += __shfl_xor_sync(0xffffffffu, part[g], m);
            }
            if (lane < SEL_GROUP && c0 + lane < ncand) {
                float s = part[0];
#pragma unroll
                for (int g = 1; g < SEL_GROUP; g++)
                    if (lane == g) s = part[g];
                sm.key[c0 + lane] = score_key(s);
            }
        }
        __syncthreads();

        /* (2a) radix select: T = the keep-th largest key; remaining = how many keys equal to T
         * are kept (the lowest-indexed ones). */
        uint32_t prefix = 0;
        int remaining = keep;
        for (int shift = 24; shift >= 0; shift -= 8) {
            const uint32_t hi_mask = shift == 24 ? 0u : 0xffffffffu << (shift + 8);
            for (int b = tid; b < 256; b += SEL_THREADS) hist[b] = 0;
            __syncthreads();
            for (int c = tid; c < ncand; c += SEL_THREADS) {
                const uint32_t k = sm.key[c];
                if ((k & hi_mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], 1u);
            }
            __syncthreads();
            if (wp == 0) {
                /* Lane l owns bins 255-8l .. 248-8l (descending); inclusive scan over lanes. */
                uint32_t own = 0;
#pragma unroll
                for (int m = 0; m < 8; m++) own += hist[255 - 8 * lane - m];
                uint32_t incl = own;
#pragma unroll
                for (int m = 1; m < 32; m <<= 1) {
                    const uint32_t v = __shfl_up_sync(0xffffffffu, incl, m);
                    if (lane >= m) incl += v;
                }
                const unsigned hit = __ballot_sync(0xffffffffu, incl >= (uint32_t)remaining);
                if (lane == __ffs(hit) - 1) {
                    uint32_t cum = incl - own;
                    for (int m = 0; m < 8; m++) {
                        const int b = 255 - 8 * lane - m;
                        if (cum + hist[b] >= (uint32_t)remaining) {
                            sh_prefix = prefix | ((uint32_t)b << shift);
                            sh_remaining = remaining - (int)cum;
                            break;
                        }
                        cum += hist[b];
                    }
                }
            }
            __syncthreads();
            prefix = sh_prefix;
            remaining = sh_remaining;
        }
        const uint32_t T = prefix;

        /* (2b) gather: keys above T in any order, then the first `remaining` equal to T by index */
        if (tid == 0) sh_ngt = 0;
        __syncthreads();
        for (int c = tid; c < ncand; c += SEL_THREADS) {
            const uint32_t k = sm.key[c];
            if (k > T) {
                const int slot = atomicAdd(&sh_ngt, 1);
                sm.kkey[slot] = k;
                sm.kidx[slot] = c;
            }
        }
        __syncthreads();
        if (wp == 0) {
            const int base = sh_ngt;
            int taken = 0;
            for (int c0 = 0; c0 < ncand && taken < remaining; c0 += 32) {
                const int c = c0 + lane;
                const bool eq = c < ncand && sm.key[c] == T;
                const unsigned m = __ballot_sync(0xffffffffu, eq);
                const int r = __popc(m & ((1u << lane) - 1u));
                if (eq && taken + r < remaining) {
                    sm.kkey[base + taken + r] = T;
                    sm.kidx[base + taken + r] = c;
                }
                taken += __popc(m);
            }
        }
        __syncthreads();
        /* (2c) rank by (key desc, pool asc) */
        for (int a = tid; a < keep; a += SEL_THREADS) {
            const uint32_t ka = sm.kkey[a];
            const int ia = sm.kidx[a];
            int rank = 0;
            for (int b = 0; b < keep; b++) {
                const uint32_t kb = sm.kkey[b];
                rank += (kb > ka) || (kb == ka && sm.kidx[b] < ia);
            }
            sm.order[rank] = ia;
        }
    } else {
        for (int c = tid; c < keep; c += SEL_THREADS) sm.order[c] = c;
    }
    __syncthreads();

    /* (3) positions */
    int32_t *row = p.sel + (size_t)i * p.max_sel;
    const int npos = keep * p.kpool;
    for (int e = tid; e < npos; e += SEL_THREADS) row[e] = sm.order[e / p.kpool] * p.kpool + e % p.kpool;
    const int ntail = p.tail ? (t + 1) % p.kpool : 0, tail0 = t + 1 - (t + 1) % p.kpool;
    for (int e = tid; e < ntail; e += SEL_THREADS) row[npos + e] = tail0 + e;
    if (tid == 0) p.nsel[i] = npos + ntail;
}

static mt_status dsa_select_launch(mt_backend *be, const select_params *p) {
    const size_t smem = select_smem_carve(NULL, p, NULL);
    if (smem > (size_t)cu_smem_max()) {
        mt_log(MT_LOG_ERROR, "dsa_select: %d candidate pools need %zu bytes of shared memory, over the "
               "device's limit", p->max_cand, smem);
        return MT_ERR_UNSUPPORTED;
    }
    mt_status st = cu_smem_opt_in((const void *)dsa_select_kernel, smem);
    if (st != MT_OK) return st;
    cu_launch_pdl_k(dsa_select_kernel, dim3(p->n), dim3(SEL_THREADS), smem, cu_stream(be), *p);
    cu_check_launch(be, "dsa_select");
    return MT_OK;
}

/* The parameters of one select launch; the rows form (pos_rows) passes its tables and t0 = 0. */
static select_params select_setup(int32_t *sel, int32_t *nsel, const float *qi, const float *w,
                                  mt_paged pool_keys, const int32_t *bt, int t0, int n, const mt_dsa_select_params *p,
                                  const int32_t *pos_rows, const int32_t *const *bt_rows) {
    MT_ASSERT(t0 >= 0 && n >= 0 && p->ih > 0 && p->id > 0 && p->kpool > 0 && p->max_pools >= 0);
    MT_ASSERT(pool_keys.row == p->id && pool_keys.page > 0 && (bt || bt_rows));
    MT_ASSERT(p->max_sel >= p->max_pools * p->kpool + (p->tail ? p->kpool - 1 : 0));
    select_params sp;
    sp.sel = sel;
    sp.nsel = nsel;
    sp.qi = qi;
    sp.w = w;
    sp.pool_keys = pool_keys;
    sp.bt = bt;
    sp.t0 = t0;
    sp.n = n;
    sp.ih = p->ih;
    sp.id = p->id;
    sp.kpool = p->kpool;
    sp.max_pools = p->max_pools;
    sp.max_sel = p->max_sel;
    sp.tail = p->tail;
    /* every key row is 16-byte aligned when the pool is and id % 4 == 0 */
    sp.vec4 = p->id % 4 == 0 && cu_aligned16(qi) && cu_aligned16(pool_keys.base);
    sp.qscale = 1.f / sqrtf((float)p->id);
    sp.wscale = 1.f / sqrtf((float)p->ih);
    sp.qld = p->id + 4;
    sp.t0_dev = pos_rows ? NULL : p->t0_dev;
    sp.max_cand = (pos_rows || p->t0_dev ? p->t_cap : t0 + n) / p->kpool;
    sp.pos_rows = pos_rows;
    sp.bt_rows = bt_rows;
    return sp;
}

static void cu_dsa_select(mt_backend *be, int32_t *sel, int32_t *nsel, const float *qi,
                          const float *w, mt_paged pool_keys, const int32_t *bt, int t0, int n,
                          const mt_dsa_select_params *p) {
    if (n == 0) return;
    const select_params sp = select_setup(sel, nsel, qi, w, pool_keys, bt, t0, n, p, NULL, NULL);
    cu_op_status(be, "dsa_select", dsa_select_launch(be, &sp));
}

static void cu_dsa_select_rows(mt_backend *be, int32_t *sel, int32_t *nsel, const float *qi,
                               const float *w, mt_paged pool_keys, const int32_t *const *bts,
                               const int32_t *pos, int n, const mt_dsa_select_params *p) {
    MT_ASSERT(p->t_cap > 0 && bts && pos);
    if (n == 0) return;
    const select_params sp = select_setup(sel, nsel, qi, w, pool_keys, NULL, 0, n, p, pos, bts);
    cu_op_status(be, "dsa_select_rows", dsa_select_launch(be, &sp));
}

/* ------------------------------------------------------------------------------------------ */
/* mla_sparse                                                                                   */
/* Three kernels per batch of up to MLA_BATCH query rows, through the op's device scratch:
 *   absorb  qa[i, h] = W_k[h]^T q[i, h]                 (each kv_b key row read once per 8 rows)
 *   attend  per (row, group of hg heads, split of the selected rows): scores against the latent
 *           rows, an online softmax, and the unnormalised latent sum; (max, sum, acc) per split
 *           (fp32 for decode and a few rows; on the tensor cores for prefill: kv_lora 512 with
 *           heads in 64s on wgmma, cuda_dsa_mla_wg.cu, else mla_attend_tc_kernel on mma.sync)
 *   output  merge the splits, normalise, o[i, h] = W_v[h] ol  (each value row read once per 8 rows)
 * Splitting the selected rows gives decode (one row, 64 heads) enough blocks for the GPU. */

enum {
    /* query rows per pass (bounds the scratch: ~0.27 GB of qa and partials plus the GEMMs' 128 MB
     * of bf16 rows at 64 heads of kv_lora 512, within the worker's reserve). H200, 4096-token
     * prefill: absorb + output GEMMs 1.47-1.80 ms in passes of 256, 1.18 of 512, 1.01 of 1024;
     * the attend the same */
    MLA_BATCH = 1024,
    MLA_MAX_HG = 8,      /* heads per attend block, sharing each latent tile */
    MLA_ROWS = 32,       /* latent rows per tile */
    MLA_MAX_SPLIT = 64,
    MLA_THREADS = 256,
    MLA_WARPS = MLA_THREADS / 32,
    MLA_MAX_COLS = 4,    /* kv_lora columns per attend thread: kvl <= 1024 */
    MLA_SC_ILP = 4,      /* attend: (head, row) scores a warp computes together */
    MLA_SPLIT_ROUND = 8, /* attend (mla_attend_kernel): a split's rows, a multiple of this */
    ABS_THREADS = 128,   /* absorb: one kv_lora column per thread */
    ABS_Q = 8,           /* absorb: query rows per block */
    OUT_Q = 8,           /* output: query rows per block */
    OUT_RB = 4,          /* output: value rows per warp pass */
};


/* Query i's position and block table, in every form. */
static __device__ __forceinline__ int mla_pos(const mla_dev_params &p, int i) {
    return p.pos_rows ? p.pos_rows[i] : (p.t0_dev ? *p.t0_dev : 0) + p.t0 + i;
}
static __device__ __forceinline__ const int32_t *mla_bt(const mla_dev_params &p, int i) {
    return p.bt_rows ? p.bt_rows[i] : p.bt;
}
/* Offset (floats) of position t's latent row in the pool: row t % page of page bt[t / page]. The
 * attend kernels look it up once per selected row of a tile and keep it beside the tile. */
static __device__ __forceinline__ int64_t mla_row_off(const mla_dev_params &p, const int32_t *bt, int t) {
    const int page = p.latent.page;
    return ((int64_t)__ldg(bt + t / page) * page + t % page) * p.kvl;
}

/* Element i of a weight in its dtype, as fp32 (exact for all three). */
static __device__ __forceinline__ float mla_wload(const void *w, mt_dtype dt, size_t i) {
    if (dt == MT_BF16) return __bfloat162float(((const __nv_bfloat16 *)w)[i]);
    if (dt == MT_F16) return __half2float(((const __half *)w)[i]);
    return ((const float *)w)[i];
}

/* Block = (head h, 128 kv_lora columns, ABS_Q query rows); q rows staged in shared memory
 * [ABS_Q, dn]; the weight row d is read coalesced and used for all the block's rows. */
static __global__ void __launch_bounds__(ABS_THREADS) mla_absorb_kernel(mla_dev_params p) {
    extern __shared__ float4 smem_f4[];
    float *qs = (float *)smem_f4;
    const int h = blockIdx.x, c = blockIdx.y * ABS_THREADS + threadIdx.x, i0 = blockIdx.z * ABS_Q;
    const int nq = p.nb - i0 < ABS_Q ? p.nb - i0 : ABS_Q, dn = p.dn;
    for (int e = threadIdx.x; e < ABS_Q * dn; e += ABS_THREADS) {
        const int qq = e / dn, d = e % dn;
        qs[e] = qq < nq ? p.q[((size_t)(i0 + qq) * p.Hq + h) * dn + d] : 0.f;
    }
    __syncthreads();
    if (c >= p.kvl) return;
    float acc[ABS_Q];
#pragma unroll
    for (int qq = 0; qq < ABS_Q; qq++) acc[qq] = 0.f;
    const size_t rb = (size_t)h * (dn + p.dv) * p.kvl + c;
#pragma unroll 4
    for (int d = 0; d < dn; d++) {
        const float w = mla_wload(p.kv_b, p.kv_dtype, rb + (size_t)d * p.kvl);
#pragma unroll
        for (int qq = 0; qq < ABS_Q; qq++) acc[qq] += qs[qq * dn + d] * w;
    }
#pragma unroll
    for (int qq = 0; qq < ABS_Q; qq++)
        if (qq < nq) p.qa[((size_t)(i0 + qq) * p.Hq + h) * p.kvl + c] = acc[qq];
}

typedef struct mla_smem {
    float *qa;      /* [hg, kvl] */
    float *lat;     /* [MLA_ROWS, kvl] latent tile */
    float *sc;      /* [hg, MLA_ROWS] scores, then probabilities */
    float *m, *l, *corr; /* [MLA_MAX_HG] running max, running sum, rescale of this tile */
    int64_t *off;   /* [MLA_ROWS] pool offsets of the tile's latent rows (mla_row_off) */
} mla_smem;

static __host__ __device__ size_t mla_smem_carve(void *smem, const mla_dev_params *p, mla_smem *s) {
    size_t off = 0;
    char *b = (char *)smem;
    float *qa = (float *)(b + off); off += sizeof(float) * (size_t)p->hg * p->kvl;
    float *lat = (float *)(b + off); off += sizeof(float) * (size_t)MLA_ROWS * p->kvl;
    float *sc = (float *)(b + off); off += sizeof(float) * (size_t)p->hg * MLA_ROWS;
    float *m = (float *)(b + off); off += sizeof(float) * MLA_MAX_HG;
    float *l = (float *)(b + off); off += sizeof(float) * MLA_MAX_HG;
    float *corr = (float *)(b + off); off += sizeof(float) * MLA_MAX_HG;
    off = (off + 7) & ~(size_t)7;
    int64_t *roff = (int64_t *)(b + off); off += sizeof(int64_t) * MLA_ROWS;
    if (s) *s = (mla_smem){qa, lat, sc, m, l, corr, roff};
    return off;
}

/* Block = (query row i, heads h0 .. h0+hg-1, split). The row's selection (or, with nsel == 0,
 * every position <= t with score 0: equal weights) is cut into nsplit ranges of whole tiles.
 * Per tile of 32 latent rows: scores (a warp per (head, row), lanes over kvl), an online
 * softmax per head, and the accumulators acc[h][c] in registers (threads over columns). */
/* Decode (one query row), 16-bit kv_b, kvl a multiple of 256: the absorb as a GEMV over the
 * key rows of head h. Block (h, column block cb) owns the 256 columns [256 cb, +256): lane l of
 * every warp reads 8 consecutive columns (one 16-byte load) at 256 cb + 8 l, so a warp reads 512
 * contiguous bytes of a row; warp w takes rows d = w, w + 8, ..., ABS1_U of them in flight per
 * step (2 blocks per head at kvl 512: 128 blocks, ~128 KB of loads in flight each, dn = 256 in
 * two steps; one block per head with 2 columns per lane kept 16 KB in flight on 64 SMs and ran at
 * ~0.7 TB/s). The 8
 * warps' partial sums are added in warp order (deterministic). */
enum { ABS1_THREADS = 256, ABS1_WARPS = ABS1_THREADS / 32, ABS1_MAX_K = 4 /* kvl <= 1024 */, ABS1_U = 16,
       OUT1_ROWS = 64 /* value rows per output1 block */ };

/* 8 consecutive 16-bit elements: one 16-byte load, then their fp32 values. */
template <typename T> static __device__ __forceinline__ uint4 raw8(const void *base, size_t elem) {
    return *(const uint4 *)((const T *)base + elem);
}
template <typename T> static __device__ __forceinline__ void cvt8(uint4 u, float *out) {
    const T *h = (const T *)&u;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        if (__is_same(T, __nv_bfloat16)) out[j] = __bfloat162float(((const __nv_bfloat16 *)h)[j]);
        else out[j] = __half2float(((const __half *)h)[j]);
    }
}
template <typename T> static __device__ __forceinline__ void load8(const void *base, size_t elem, float *out) {
    cvt8<T>(raw8<T>(base, elem), out);
}

template <typename T>
static __global__ void __launch_bounds__(ABS1_THREADS) mla_absorb1_kernel(mla_dev_params p) {
    __shared__ float qs[1024];                    /* [dn] (the launch checks dn <= 1024) */
    __shared__ float part[ABS1_WARPS][256];       /* per warp, this block's columns */
    const int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, wp = tid >> 5, kvl = p.kvl;
    const int col = blockIdx.y * 256 + lane * 8;
    /* The block's weight lines (dn rows x 512 bytes) into L2 while the kernel before runs: they
     * depend on no kernel (launched for PDL, cu_launch_pdl_k; prefetches, as the loads themselves
     * would be scheduled after the wait). */
    for (int e = tid; e < p.dn * 4; e += ABS1_THREADS)
        asm volatile("prefetch.global.L2 [%0];" ::"l"((const char *)p.kv_b +
                                                      (((size_t)h * (p.dn + p.dv) + e / 4) * kvl + blockIdx.y * 256 +
                                                       (e % 4) * 64) * sizeof(T)));
    cu_pdl_wait();
    cu_pdl_trigger();
    for (int d = tid; d < p.dn; d += ABS1_THREADS) qs[d] = p.q[(size_t)h * p.dn + d];
    __syncthreads();
    float acc[8];
#pragma unroll
    for (int j = 0; j < 8; j++) acc[j] = 0.f;
    const size_t row0 = (size_t)h * (p.dn + p.dv);
    for (int d0 = wp; d0 < p.dn; d0 += ABS1_WARPS * ABS1_U) {
        uint4 w[ABS1_U];
#pragma unroll
        for (int u = 0; u < ABS1_U; u++) { /* all loads first: ABS1_U x 16 bytes in flight a lane */
            const int d = d0 + u * ABS1_WARPS;
            w[u] = d < p.dn ? raw8<T>(p.kv_b, (row0 + d) * kvl + col) : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < ABS1_U; u++) {
            const int d = d0 + u * ABS1_WARPS;
            if (d < p.dn) {
                const float qd = qs[d];
                float wf[8];
                cvt8<T>(w[u], wf);
#pragma unroll
                for (int j = 0; j < 8; j++) acc[j] += qd * wf[j];
            }
        }
    }
#pragma unroll
    for (int j = 0; j < 8; j++) part[wp][lane * 8 + j] = acc[j];
    __syncthreads();
    {
        const int c = tid; /* 256 threads, 256 columns */
        float a = 0.f;
#pragma unroll
        for (int w = 0; w < ABS1_WARPS; w++) a += part[w][c];
        p.qa[(size_t)h * kvl + blockIdx.y * 256 + c] = a;
    }
}

/* Decode output. Block (h, value-row block): merges the splits into ol[kvl] in shared memory —
 * warp 0 reads the splits' (max, sum) one per lane and makes each split's weight
 * exp(max_s - M) / L; every thread then sums its columns over the splits with a nonzero weight
 * (an empty split, written (-inf, 0, 0), is not read) — then each warp dots OUT1_ROWS / 8 value
 * rows with ol, all its 16-byte loads of them issued before the first use; lanes reduce by
 * shuffles. Several blocks per head (4 at dv 256: 256 blocks) keep the weight stream wide; each
 * redoes the small merge from L2. */
template <typename T>
static __global__ void __launch_bounds__(ABS1_THREADS) mla_output1_kernel(mla_dev_params p) {
    extern __shared__ float4 smem_f4[];
    float *ol = (float *)smem_f4;           /* [kvl] */
    float *ws = ol + p.kvl;                 /* [nsplit] merge weights of the nonempty splits */
    __shared__ int act[MLA_MAX_SPLIT];      /* their split indices, in order */
    __shared__ int nact;
    const int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, wp = tid >> 5, kvl = p.kvl, ns = p.nsplit;
    {   /* the block's value rows (OUT1_ROWS x kvl) into L2 before the wait, as in mla_absorb1_kernel */
        const int lines = (int)((size_t)kvl * sizeof(T) / 128);
        const size_t vr0 = (size_t)h * (p.dn + p.dv) + p.dn + (size_t)blockIdx.y * OUT1_ROWS;
        for (int e = tid; e < OUT1_ROWS * lines; e += ABS1_THREADS)
            if (blockIdx.y * OUT1_ROWS + e / lines < p.dv)
                asm volatile("prefetch.global.L2 [%0];" ::"l"((const char *)p.kv_b +
                                                              ((vr0 + e / lines) * kvl) * sizeof(T) + (size_t)(e % lines) * 128));
    }
    cu_pdl_wait(); /* launched for PDL (cu_launch_pdl_k) */
    cu_pdl_trigger();
    const int K = kvl / 256;
    const float *pb = p.part + (size_t)h * ns * (kvl + 2);
    if (wp == 0) {
        float m[MLA_MAX_SPLIT / 32], l[MLA_MAX_SPLIT / 32], M = -INFINITY, L = 0.f;
#pragma unroll
        for (int j = 0; j < MLA_MAX_SPLIT / 32; j++) {
            const int s = lane + 32 * j;
            m[j] = s < ns ? pb[(size_t)s * (kvl + 2)] : -INFINITY;
            l[j] = s < ns ? pb[(size_t)s * (kvl + 2) + 1] : 0.f;
            M = fmaxf(M, m[j]);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
        float e[MLA_MAX_SPLIT / 32];
#pragma unroll
        for (int j = 0; j < MLA_MAX_SPLIT / 32; j++) {
            e[j] = l[j] > 0.f ? expf(m[j] - M) : 0.f;
            L += e[j] * l[j];
        }
        L = cu_warp_sum(L);
        const float inv = 1.f / L;
        /* the splits with a nonzero weight, compacted in split order (ballot + popc) */
        int base = 0;
#pragma unroll
        for (int j = 0; j < MLA_MAX_SPLIT / 32; j++) {
            const bool on = lane + 32 * j < ns && e[j] != 0.f;
            const unsigned bal = __ballot_sync(0xffffffffu, on);
            if (on) {
                const int k = base + __popc(bal & ((1u << lane) - 1u));
                act[k] = lane + 32 * j;
                ws[k] = e[j] * inv;
            }
            base += __popc(bal);
        }
        if (lane == 0) nact = base;
    }
    __syncthreads();
    const int na = nact;
    for (int c = tid; c < kvl; c += ABS1_THREADS) { /* every split's load issued before the sum */
        float a = 0.f;
        for (int k0 = 0; k0 < na; k0 += 8) {
            float v[8];
#pragma unroll
            for (int u = 0; u < 8; u++) v[u] = k0 + u < na ? pb[(size_t)act[k0 + u] * (kvl + 2) + 2 + c] : 0.f;
#pragma unroll
            for (int u = 0; u < 8; u++)
                if (k0 + u < na) a += ws[k0 + u] * v[u];
        }
        ol[c] = a;
    }
    __syncthreads();
    float o[ABS1_MAX_K][8];
#pragma unroll
    for (int k = 0; k < ABS1_MAX_K; k++)
#pragma unroll
        for (int j = 0; j < 8; j++) o[k][j] = k < K ? ol[k * 256 + lane * 8 + j] : 0.f;
    constexpr int RPW = OUT1_ROWS / ABS1_WARPS; /* value rows per warp */
    const int e0 = blockIdx.y * OUT1_ROWS + wp * RPW;
    const size_t vrow0 = (size_t)h * (p.dn + p.dv) + p.dn;
    uint4 w[RPW][2]; /* the first two column blocks of each row, all loads issued first */
#pragma unroll
    for (int r = 0; r < RPW; r++)
#pragma unroll
        for (int k = 0; k < 2; k++)
            w[r][k] = e0 + r < p.dv && k < K ? raw8<T>(p.kv_b, (vrow0 + e0 + r) * kvl + (size_t)k * 256 + lane * 8)
                                             : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int r = 0; r < RPW; r++) {
        float a = 0.f;
#pragma unroll
        for (int k = 0; k < ABS1_MAX_K; k++) {
            if (k < K) {
                float wk[8] = {};
                if (k < 2) {
                    cvt8<T>(w[r][k], wk);
                } else if (e0 + r < p.dv) {
                    load8<T>(p.kv_b, (vrow0 + e0 + r) * kvl + (size_t)k * 256 + lane * 8, wk);
                }
#pragma unroll
                for (int j = 0; j < 8; j++) a += wk[j] * o[k][j];
            }
        }
        a = cu_warp_sum(a);
        if (lane == 0 && e0 + r < p.dv) p.out[(size_t)h * p.dv + e0 + r] = a;
    }
}

/* dst[e] = get(e) for e < n, thread tid of MLA_THREADS taking e = tid + MLA_THREADS j, U loads
 * issued before their U stores. */
template <int U, typename F> static __device__ __forceinline__ void mla_copy4(float4 *dst, F get, int n, int tid) {
    for (int e0 = tid; e0 < n; e0 += MLA_THREADS * U) {
        float4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++)
            if (e0 + u * MLA_THREADS < n) v[u] = get(e0 + u * MLA_THREADS);
#pragma unroll
        for (int u = 0; u < U; u++)
            if (e0 + u * MLA_THREADS < n) dst[e0 + u * MLA_THREADS] = v[u];
    }
}

static __global__ void __launch_bounds__(MLA_THREADS) mla_attend_kernel(mla_dev_params p) {
    cu_pdl_wait(); /* launched for PDL (cu_launch_pdl_k) */
    cu_pdl_trigger();
    extern __shared__ float4 smem_f4[];
    mla_smem sm;
    mla_smem_carve(smem_f4, &p, &sm);
    const int i = blockIdx.x, h0 = blockIdx.y * p.hg, split = blockIdx.z, hg = p.hg;
    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5, kvl = p.kvl;

    const int t = mla_pos(p, i), m = p.nsel[i];
    const int32_t *const bt = mla_bt(p, i);
    const int cnt = m > 0 ? m : t + 1;
    /* rows per split, in whole MLA_SPLIT_ROUND (a split's last tile may be partial): a decode
     * step's 69 rows make 9 splits of 8, not 3 of a full tile; each block's scores are ~8K cycles
     * of shared-memory reads per full tile, so fewer rows a block is what spreads them */
    int rps = (cnt + p.nsplit - 1) / p.nsplit;
    rps = (rps + MLA_SPLIT_ROUND - 1) / MLA_SPLIT_ROUND * MLA_SPLIT_ROUND;
    const int sb = split * rps, se = sb + rps < cnt ? sb + rps : cnt;
    if (sb >= se) { /* an empty split (decode plans splits for the longest selection): (-inf, 0) and
                       no acc, which the output kernels do not read for a zero weight */
        if (tid < hg) {
            float *dst = p.part + (((size_t)i * p.Hq + h0 + tid) * p.nsplit + split) * (kvl + 2);
            dst[0] = -INFINITY;
            dst[1] = 0.f;
        }
        return;
    }

    const float *const latp = p.latent.base;
    /* 16-byte copies, several in flight per thread (a scalar loop here kept one load in flight
     * and left this kernel latency-bound: ~50 us for a decode step's 3 tiles) */
    const bool v4 = (kvl & 3) == 0 && (((uintptr_t)latp | (uintptr_t)p.qa) & 15) == 0;
    if (v4) {
        const float4 *src = (const float4 *)(p.qa + ((size_t)i * p.Hq + h0) * kvl);
        mla_copy4<4>((float4 *)sm.qa, [&](int e) { return src[e]; }, hg * kvl / 4, tid);
    } else {
        for (int e = tid; e < hg * kvl; e += MLA_THREADS) sm.qa[e] = p.qa[((size_t)i * p.Hq + h0) * kvl + e];
    }
    if (tid < hg) {
        sm.m[tid] = -INFINITY;
        sm.l[tid] = 0.f;
    }
    const int32_t *srow = p.sel + (size_t)i * p.max_sel;
    float acc[MLA_MAX_HG][MLA_MAX_COLS];
#pragma unroll
    for (int hh = 0; hh < MLA_MAX_HG; hh++)
#pragma unroll
        for (int cc = 0; cc < MLA_MAX_COLS; cc++) acc[hh][cc] = 0.f;
    __syncthreads();
    for (int s0 = sb; s0 < se; s0 += MLA_ROWS) {
        const int rows = se - s0 < MLA_ROWS ? se - s0 : MLA_ROWS;
        if (tid < rows) sm.off[tid] = mla_row_off(p, bt, m > 0 ? srow[s0 + tid] : s0 + tid);
        __syncthreads();
        if (v4) {
            const int k4 = kvl / 4;
            mla_copy4<8>((float4 *)sm.lat, [&](int e) { return *(const float4 *)(latp + sm.off[e / k4] + 4 * (e % k4)); },
                         rows * k4, tid);
        } else {
            for (int e = tid; e < rows * kvl; e += MLA_THREADS) {
                const int r = e / kvl, c = e % kvl;
                sm.lat[e] = latp[sm.off[r] + c];
            }
        }
        __syncthreads();
        /* scores: a warp per (head, row) pair, lanes over kvl, MLA_SC_ILP pairs at once (one
         * pair's dot and butterfly at a time left ~5 us of dependent latency per tile) */
        for (int e0 = wp * MLA_SC_ILP; e0 < hg * rows; e0 += MLA_WARPS * MLA_SC_ILP) {
            float a[MLA_SC_ILP];
            const float *qa[MLA_SC_ILP], *lr[MLA_SC_ILP];
#pragma unroll
            for (int u = 0; u < MLA_SC_ILP; u++) {
                const int e = e0 + u < hg * rows ? e0 + u : e0; /* past the end: a repeat, not stored */
                qa[u] = sm.qa + (size_t)(e / rows) * kvl;
                lr[u] = sm.lat + (size_t)(e % rows) * kvl;
                a[u] = 0.f;
            }
            if (m > 0) {
                for (int c = lane; c < kvl; c += 32)
#pragma unroll
                    for (int u = 0; u < MLA_SC_ILP; u++) a[u] += qa[u][c] * lr[u][c];
#pragma unroll
                for (int k = 16; k > 0; k >>= 1)
#pragma unroll
                    for (int u = 0; u < MLA_SC_ILP; u++) a[u] += __shfl_xor_sync(0xffffffffu, a[u], k);
            }
#pragma unroll
            for (int u = 0; u < MLA_SC_ILP; u++) {
                const int e = e0 + u;
                if (lane == 0 && e < hg * rows) sm.sc[(e / rows) * MLA_ROWS + e % rows] = m > 0 ? a[u] * p.scale : 0.f;
            }
        }
        __syncthreads();
        if (wp < hg) {
            const int hh = wp;
            const float v = lane < rows ? sm.sc[hh * MLA_ROWS + lane] : -INFINITY;
            float mx = v;
#pragma unroll
            for (int k = 16; k > 0; k >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, k));
            const float m_old = sm.m[hh], m_new = fmaxf(m_old, mx);
            const float pr = lane < rows ? expf(v - m_new) : 0.f;
            float sum = pr;
#pragma unroll
            for (int k = 16; k > 0; k >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, k);
            sm.sc[hh * MLA_ROWS + lane] = pr;
            __syncwarp();
            if (lane == 0) {
                const float corr = expf(m_old - m_new); /* 0 on the first tile (m_old = -inf) */
                sm.corr[hh] = corr;
                sm.l[hh] = sm.l[hh] * corr + sum;
                sm.m[hh] = m_new;
            }
        }
        __syncthreads();
#pragma unroll
        for (int hh = 0; hh < MLA_MAX_HG; hh++) {
            if (hh < hg) {
                const float corr = sm.corr[hh];
#pragma unroll
                for (int cc = 0; cc < MLA_MAX_COLS; cc++) acc[hh][cc] *= corr;
            }
        }
        for (int r = 0; r < rows; r++) {
            float lv[MLA_MAX_COLS];
#pragma unroll
            for (int cc = 0; cc < MLA_MAX_COLS; cc++) {
                const int c = tid + MLA_THREADS * cc;
                lv[cc] = c < kvl ? sm.lat[(size_t)r * kvl + c] : 0.f;
            }
#pragma unroll
            for (int hh = 0; hh < MLA_MAX_HG; hh++) {
                if (hh < hg) {
                    const float pr = sm.sc[hh * MLA_ROWS + r];
#pragma unroll
                    for (int cc = 0; cc < MLA_MAX_COLS; cc++) acc[hh][cc] += pr * lv[cc];
                }
            }
        }
        __syncthreads(); /* before the next tile overwrites lat, sc, off */
    }
    /* This split's (max, sum, acc); an empty split leaves (-inf, 0, 0), which merges as nothing. */
#pragma unroll
    for (int hh = 0; hh < MLA_MAX_HG; hh++) {
        if (hh < hg) {
            float *dst = p.part + (((size_t)i * p.Hq + h0 + hh) * p.nsplit + split) * (kvl + 2);
            if (tid == 0) {
                dst[0] = sm.m[hh];
                dst[1] = sm.l[hh];
            }
#pragma unroll
            for (int cc = 0; cc < MLA_MAX_COLS; cc++) {
                const int c = tid + MLA_THREADS * cc;
                if (c < kvl) dst[2 + c] = acc[hh][cc];
            }
        }
    }
}

/* Block = (head h, OUT_Q query rows). Merges the splits into the normalised latent output
 * ol [OUT_Q, kvl] in shared memory, then each warp takes OUT_RB value rows at a time: lanes over
 * kvl, the weights read once for all the block's rows. */
static __global__ void __launch_bounds__(MLA_THREADS) mla_output_kernel(mla_dev_params p) {
    extern __shared__ float4 smem_f4[];
    float *ol = (float *)smem_f4; /* [OUT_Q, kvl] */
    const int h = blockIdx.x, i0 = blockIdx.y * OUT_Q, tid = threadIdx.x, lane = tid & 31, wp = tid >> 5;
    const int nq = p.nb - i0 < OUT_Q ? p.nb - i0 : OUT_Q, kvl = p.kvl, ns = p.nsplit;
    for (int qq = 0; qq < nq; qq++) {
        const float *pb = p.part + ((size_t)(i0 + qq) * p.Hq + h) * ns * (kvl + 2);
        float M = -INFINITY, L = 0.f;
        for (int s = 0; s < ns; s++) M = fmaxf(M, pb[(size_t)s * (kvl + 2)]);
        for (int s = 0; s < ns; s++) L += expf(pb[(size_t)s * (kvl + 2)] - M) * pb[(size_t)s * (kvl + 2) + 1];
        const float inv = 1.f / L;
        for (int c = tid; c < kvl; c += MLA_THREADS) {
            float a = 0.f;
            for (int s = 0; s < ns; s++) {
                const float *ps = pb + (size_t)s * (kvl + 2);
                const float w = expf(ps[0] - M); /* 0 for an empty split, whose acc is not written */
                if (w != 0.f) a += w * ps[2 + c];
            }
            ol[qq * kvl + c] = a * inv;
        }
    }
    __syncthreads();
    const size_t vrow0 = (size_t)h * (p.dn + p.dv) + p.dn; /* kv_b row of value 0 of head h */
    for (int e0 = wp * OUT_RB; e0 < p.dv; e0 += MLA_WARPS * OUT_RB) {
        float a[OUT_RB][OUT_Q];
#pragma unroll
        for (int r = 0; r < OUT_RB; r++)
#pragma unroll
            for (int qq = 0; qq < OUT_Q; qq++) a[r][qq] = 0.f;
        for (int c = lane; c < kvl; c += 32) {
            float w[OUT_RB];
#pragma unroll
            for (int r = 0; r < OUT_RB; r++)
                w[r] = e0 + r < p.dv ? mla_wload(p.kv_b, p.kv_dtype, (vrow0 + e0 + r) * kvl + c) : 0.f;
#pragma unroll
            for (int qq = 0; qq < OUT_Q; qq++) {
                if (qq < nq) {
                    const float o = ol[qq * kvl + c];
#pragma unroll
                    for (int r = 0; r < OUT_RB; r++) a[r][qq] += w[r] * o;
                }
            }
        }
#pragma unroll
        for (int qq = 0; qq < OUT_Q; qq++) {
            if (qq < nq) {
#pragma unroll
                for (int r = 0; r < OUT_RB; r++) {
                    float v = a[r][qq];
#pragma unroll
                    for (int k = 16; k > 0; k >>= 1) v += __shfl_xor_sync(0xffffffffu, v, k);
                    if (lane == 0 && e0 + r < p.dv) p.out[((size_t)(i0 + qq) * p.Hq + h) * p.dv + e0 + r] = v;
                }
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Prefill attend (n > 1, kvl = 256*J, Hq % 32 == 0): block = (query row i, 32 heads, split).
 * The old kernel re-read the row's selected latent rows once per 8 heads; this one once per 32,
 * and register-tiles both products out of shared memory:
 *   scores S[32 h, 32 r] = QA[32, kvl] Lat^T: thread = 2 heads x 2 rows, float4 loads along kvl
 *           (rows padded by 4 floats: the 8 rows a warp reads hit distinct banks);
 *   acc  O[32 h, kvl] += P[32, 32] Lat: thread = 8 heads x 4J columns in registers.
 * Latent tiles are double-buffered with cp.async (16-byte copies). Online softmax per head as in
 * mla_attend_kernel (same (max, sum, acc) per split into p.part, merged by the output kernels). */
enum { MLAW_HB = 32, MLAW_R = 32, MLAW_THREADS = 256 };

static __host__ __device__ size_t mlaw_smem_floats(int kvl) {
    const size_t ld = (size_t)kvl + 4;
    return (size_t)MLAW_HB * ld + 2 * (size_t)MLAW_R * ld + (size_t)MLAW_HB * (MLAW_R + 1) +
           (size_t)MLAW_R * MLAW_HB + 3 * (size_t)MLAW_HB;
}

template <int J>
static __global__ void __launch_bounds__(MLAW_THREADS, 1) mla_attend_wide_kernel(mla_dev_params p) {
    constexpr int KVL = 256 * J, LD = KVL + 4, K4 = KVL / 4, HB = MLAW_HB, R = MLAW_R, SLD = R + 1;
    constexpr int HPW = HB / (MLAW_THREADS / 32);
    /* tile staging: lane l of each warp looks up tile row l's address (R rows, one per lane), and
     * a warp's threads copy one row at a time (K4 a multiple of 32), taking it by shuffle */
    static_assert(R == 32 && K4 % 32 == 0 && MLAW_THREADS % K4 == 0, "staging mapping");
    extern __shared__ float4 smem_f4[];
    float *qa = (float *)smem_f4;            /* [HB][LD] */
    float *lat = qa + HB * LD;               /* [2][R][LD] */
    float *sc = lat + 2 * R * LD;            /* [HB][SLD] scores */
    float *pT = sc + HB * SLD;               /* [R][HB] probabilities */
    float *sm_m = pT + R * HB, *sm_l = sm_m + HB, *sm_c = sm_l + HB;
    const int i = blockIdx.x, h0 = blockIdx.y * HB, split = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5;

    const float4 *qsrc = (const float4 *)(p.qa + ((size_t)i * p.Hq + h0) * KVL);
    for (int e = tid; e < HB * K4; e += MLAW_THREADS) {
        const int h = e / K4, k = e % K4;
        *(float4 *)(qa + h * LD + 4 * k) = qsrc[e];
    }
    if (tid < HB) {
        sm_m[tid] = -INFINITY;
        sm_l[tid] = 0.f;
    }
    const int t = mla_pos(p, i), m = p.nsel[i];
    const int32_t *const bt = mla_bt(p, i);
    const float *const latp = p.latent.base;
    const int cnt = m > 0 ? m : t + 1;
    int rps = (cnt + p.nsplit - 1) / p.nsplit;
    rps = (rps + R - 1) / R * R;
    const int sb = split * rps, se = sb + rps < cnt ? sb + rps : cnt;
    const int32_t *srow = p.sel + (size_t)i * p.max_sel;

    /* score mapping: rows tr, tr+16; heads th, th+16 (a warp: 8 rows x 4 heads) */
    const int tr = (tid & 7) + 8 * (wp & 1), th = ((tid >> 3) & 3) + 4 * (wp >> 1);
    /* acc mapping: heads ah*8 .. ah*8+7; columns j*256 + tc*4 + 0..3 */
    const int ah = tid >> 6, tc = tid & 63;
    float acc[8][4 * J];
#pragma unroll
    for (int hh = 0; hh < 8; hh++)
#pragma unroll
        for (int c = 0; c < 4 * J; c++) acc[hh][c] = 0.f;

    if (sb < se) { /* first tile into buffer 0 */
        const int rows = se - sb < R ? se - sb : R;
        const int64_t off = lane < rows ? mla_row_off(p, bt, m > 0 ? srow[sb + lane] : sb + lane) : 0;
        for (int e = tid; e < rows * K4; e += MLAW_THREADS) { /* r is uniform across the warp */
            const int r = e / K4, k = e % K4;
            cu_cp_async16(lat + r * LD + 4 * k, latp + __shfl_sync(0xffffffffu, off, r) + 4 * k);
        }
    }
    cu_cp_async_commit();
    __syncthreads(); /* qa, m, l */
    int buf = 0;
    for (int s0 = sb; s0 < se; s0 += R) {
        const int rows = se - s0 < R ? se - s0 : R;
        const int nx = s0 + R;
        if (nx < se) { /* prefetch the next tile into the other buffer (freed by the barrier below) */
            const int nrows = se - nx < R ? se - nx : R;
            float *dst = lat + (buf ^ 1) * R * LD;
            const int64_t off = lane < nrows ? mla_row_off(p, bt, m > 0 ? srow[nx + lane] : nx + lane) : 0;
            for (int e = tid; e < nrows * K4; e += MLAW_THREADS) {
                const int r = e / K4, k = e % K4;
                cu_cp_async16(dst + r * LD + 4 * k, latp + __shfl_sync(0xffffffffu, off, r) + 4 * k);
            }
            cu_cp_async_commit();
            cu_cp_async_wait<1>();
        } else {
            cu_cp_async_wait<0>();
        }
        __syncthreads(); /* this tile visible to all */
        const float *L = lat + buf * R * LD;
        if (m > 0) {
            float s00 = 0.f, s01 = 0.f, s10 = 0.f, s11 = 0.f;
            const float *q0 = qa + th * LD, *q1 = qa + (th + 16) * LD;
            const float *l0 = L + tr * LD, *l1 = L + (tr + 16) * LD;
#pragma unroll 4
            for (int k = 0; k < KVL; k += 4) {
                const float4 a0 = *(const float4 *)(q0 + k), a1 = *(const float4 *)(q1 + k);
                const float4 b0 = *(const float4 *)(l0 + k), b1 = *(const float4 *)(l1 + k);
                s00 = fmaf(a0.x, b0.x, s00); s00 = fmaf(a0.y, b0.y, s00); s00 = fmaf(a0.z, b0.z, s00); s00 = fmaf(a0.w, b0.w, s00);
                s01 = fmaf(a0.x, b1.x, s01); s01 = fmaf(a0.y, b1.y, s01); s01 = fmaf(a0.z, b1.z, s01); s01 = fmaf(a0.w, b1.w, s01);
                s10 = fmaf(a1.x, b0.x, s10); s10 = fmaf(a1.y, b0.y, s10); s10 = fmaf(a1.z, b0.z, s10); s10 = fmaf(a1.w, b0.w, s10);
                s11 = fmaf(a1.x, b1.x, s11); s11 = fmaf(a1.y, b1.y, s11); s11 = fmaf(a1.z, b1.z, s11); s11 = fmaf(a1.w, b1.w, s11);
            }
            sc[th * SLD + tr] = s00 * p.scale;
            sc[th * SLD + tr + 16] = s01 * p.scale;
            sc[(th + 16) * SLD + tr] = s10 * p.scale;
            sc[(th + 16) * SLD + tr + 16] = s11 * p.scale;
        } else { /* nsel == 0: every position <= t with score 0 (equal weights) */
            sc[th * SLD + tr] = 0.f;
            sc[th * SLD + tr + 16] = 0.f;
            sc[(th + 16) * SLD + tr] = 0.f;
            sc[(th + 16) * SLD + tr + 16] = 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int qh = 0; qh < HPW; qh++) { /* HPW heads a warp */
            const int hh = wp * HPW + qh;
            const float v = lane < rows ? sc[hh * SLD + lane] : -INFINITY;
            float mx = v;
#pragma unroll
            for (int k = 16; k > 0; k >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, k));
            const float m_old = sm_m[hh], m_new = fmaxf(m_old, mx);
            const float pr = lane < rows ? expf(v - m_new) : 0.f;
            float sum = pr;
#pragma unroll
            for (int k = 16; k > 0; k >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, k);
            pT[lane * HB + hh] = pr;
            if (lane == 0) {
                const float corr = expf(m_old - m_new); /* 0 on the first tile (m_old = -inf) */
                sm_c[hh] = corr;
                sm_l[hh] = sm_l[hh] * corr + sum;
                sm_m[hh] = m_new;
            }
        }
        __syncthreads();
#pragma unroll
        for (int hh = 0; hh < 8; hh++) {
            const float corr = sm_c[ah * 8 + hh];
#pragma unroll
            for (int c = 0; c < 4 * J; c++) acc[hh][c] *= corr;
        }
        for (int r = 0; r < rows; r++) {
            const float4 p0 = *(const float4 *)(pT + r * HB + ah * 8), p1 = *(const float4 *)(pT + r * HB + ah * 8 + 4);
            const float pv[8] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
#pragma unroll
            for (int j = 0; j < J; j++) {
                const float4 lv = *(const float4 *)(L + r * LD + j * 256 + tc * 4);
#pragma unroll
                for (int hh = 0; hh < 8; hh++) {
                    acc[hh][4 * j + 0] = fmaf(pv[hh], lv.x, acc[hh][4 * j + 0]);
                    acc[hh][4 * j + 1] = fmaf(pv[hh], lv.y, acc[hh][4 * j + 1]);
                    acc[hh][4 * j + 2] = fmaf(pv[hh], lv.z, acc[hh][4 * j + 2]);
                    acc[hh][4 * j + 3] = fmaf(pv[hh], lv.w, acc[hh][4 * j + 3]);
                }
            }
        }
        __syncthreads(); /* before the next prefetch overwrites this buffer and sc, pT are rewritten */
        buf ^= 1;
    }
    /* This split's (max, sum, acc); an empty split leaves (-inf, 0, 0), which merges as nothing. */
#pragma unroll
    for (int hh = 0; hh < 8; hh++) {
        const int hl = ah * 8 + hh;
        float *dst = p.part + (((size_t)i * p.Hq + h0 + hl) * p.nsplit + split) * (KVL + 2);
        if (tc == 0) {
            dst[0] = sm_m[hl];
            dst[1] = sm_l[hl];
        }
#pragma unroll
        for (int j = 0; j < J; j++)
#pragma unroll
            for (int x = 0; x < 4; x++) dst[2 + j * 256 + tc * 4 + x] = acc[hh][4 * j + x];
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Prefill attend on the tensor cores (n >= MLAT_MIN_ROWS, eager, kvl = 64*NW with NW 4 or 8,
 * Hq % 32 == 0): block = (query row i, 32 heads, split), NW warps. Per tile of 32 selected rows:
 *   S[32 h, 32 r] = QA[32, kvl] Lat^T      warp w takes kvl columns [64w, 64w+64) of the product;
 *                                           its slice of qa lives in registers for the whole block,
 *                                           and the NW partial sums meet in shared memory;
 *   online softmax per head over the tile   (NW threads a head), P [32 h, 32 r] to shared memory;
 *   O[32 h, 64w .. 64w+63] += P Lat[32 r, 64w ..]   the same latent slice as warp w's scores,
 * so each warp only ever reads its own 64 columns of a tile: it stages them itself (cp.async,
 * double-buffered) and meets the others only at the two barriers around the softmax. O stays in
 * registers (64 a thread); (max, sum, acc) per split into p.part as the fp32 kernels write them,
 * merged by the same output kernel, or, with one split and the cuBLAS output (p.o16), acc / sum
 * straight as the output GEMM's bf16 (hi | lo) rows (no part, no merge: the merge took 0.69 ms of a 4096-token prefill on the H200).
 * Precision: bf16 mma.sync m16n8k16 with fp32 accumulation, where each fp32 operand (qa, the latent
 * rows, P) is split into x = hi + lo (bf16 each) and each product taken as hi*hi + hi*lo + lo*hi
 * (lo*lo is ~2^-18 of it): ~1e-5 relative. Single bf16 rounding gives ~1e-3 on the output, over
 * the 1e-4 the tests allow against the fp32 CPU twin. The latent rows are split once per call
 * (mla_split_kernel, into the op's scratch: 4 bytes a value, as the fp32 cache), not per tile. */
enum {
    MLAT_HB = 32,        /* heads per block (two m16 tiles) */
    MLAT_R = 32,         /* latent rows per tile (= MLA_ROWS: the splits are whole tiles) */
    MLAT_COLS = 64,      /* kvl columns per warp */
    MLAT_LDH = 72,       /* bf16 row stride of a warp's tile slice: 144 bytes, so the 8 rows an
                            ldmatrix reads fall in distinct banks */
    MLAT_LDS = 40,       /* row stride of the partial scores (fp32) and of P (bf16): conflict-free */
    MLAT_MIN_ROWS = 16,  /* fewer query rows (decode, speculative verify) stay on the fp32 kernels */
    MLAT_SPLIT_THREADS = 256,
};

/* Shared memory of mla_attend_tc_kernel<NW>, in bytes (every part a multiple of 16):
 *   vt    [NW][2 buf][2 (hi, lo)][R][LDH] bf16   each warp's double-buffered tile slice
 *   sp    [NW][HB][LDS] fp32                      each warp's partial scores
 *   pt    [2 (hi, lo)][HB][LDS] bf16              P
 *   corr  [HB] fp32                               this tile's rescale of each head's accumulator */
static __host__ __device__ size_t mlat_smem_bytes(int nw) {
    return 2 * (size_t)nw * 2 * 2 * MLAT_R * MLAT_LDH + sizeof(float) * (size_t)nw * MLAT_HB * MLAT_LDS +
           2 * (size_t)2 * MLAT_HB * MLAT_LDS + sizeof(float) * MLAT_HB;
}

/* lat16 [T, terms, kvl]: row r is (hi, lo) of position r's latent row (terms 2), or hi alone
 * (terms 1), gathered from the pages through bt (so the attend kernel reads lat16 by position,
 * contiguous). One thread per 4 values (kvl % 4 == 0: every latent row is 16-byte aligned in an
 * aligned pool). */
static __global__ void __launch_bounds__(MLAT_SPLIT_THREADS) mla_split_kernel(__nv_bfloat16 *lat16,
                                                                              mt_paged latent, const int32_t *bt,
                                                                              int64_t count, int kvl, int terms) {
    const int64_t e = ((int64_t)blockIdx.x * MLAT_SPLIT_THREADS + threadIdx.x) * 4;
    if (e >= count) return;
    const int64_t r = e / kvl;
    const int c = (int)(e % kvl);
    const int64_t src = ((int64_t)__ldg(bt + r / latent.page) * latent.page + r % latent.page) * kvl + c;
    const float4 v = *(const float4 *)(latent.base + src);
    uint2 hi, lo;
    cu_split_bf16x2(v.x, v.y, &hi.x, &lo.x);
    cu_split_bf16x2(v.z, v.w, &hi.y, &lo.y);
    *(uint2 *)(lat16 + (size_t)r * terms * kvl + c) = hi;
    if (terms == 2) *(uint2 *)(lat16 + (size_t)r * 2 * kvl + kvl + c) = lo;
}

/* Warp-wide: cp.async of this warp's 64 columns (from c0) of the split rows of selected entries
 * s .. s+rows-1 into dst [2 (hi, lo)][R][LDH]. Lane l copies 16-byte chunk l % 8 of rows l / 8,
 * l / 8 + 4, ... of both parts; rows past `rows` are zeroed instead (P is 0 there, and 0 times
 * stale data may be NaN). */
static __device__ __forceinline__ void mlat_stage(__nv_bfloat16 *dst, const __nv_bfloat16 *lat16,
                                                  const int32_t *srow, int m, int s, int rows, int c0, int kvl,
                                                  int lane) {
    const int pr = lane < rows ? (m > 0 ? srow[s + lane] : s + lane) : 0;
    const int ch = lane & 7;
#pragma unroll
    for (int k = 0; k < MLAT_R / 4; k++) {
        const int r = (lane >> 3) + 4 * k;
        const int pos = __shfl_sync(0xffffffffu, pr, r);
        __nv_bfloat16 *d = dst + r * MLAT_LDH + 8 * ch;
        if (r < rows) {
            const __nv_bfloat16 *src = lat16 + (size_t)pos * 2 * kvl + c0 + 8 * ch;
            cu_cp_async16(d, src);
            cu_cp_async16(d + MLAT_R * MLAT_LDH, src + kvl);
        } else {
            *(uint4 *)d = make_uint4(0u, 0u, 0u, 0u);
            *(uint4 *)(d + MLAT_R * MLAT_LDH) = make_uint4(0u, 0u, 0u, 0u);
        }
    }
    cu_cp_async_commit();
}

template <int NW>
static __global__ void __launch_bounds__(NW * 32, 1) mla_attend_tc_kernel(mla_dev_params p) {
    constexpr int KVL = MLAT_COLS * NW, NT = 32 * NW, HB = MLAT_HB, R = MLAT_R, LDH = MLAT_LDH,
                  LDS = MLAT_LDS, VT = 2 * R * LDH /* bf16 in one buffer of a warp's slice */;
    constexpr int E = HB * R / NT; /* softmax: scores per thread (4 or 8) */
    constexpr int TPH = R / E;     /* softmax: threads per head (NW), adjacent lanes */
    static_assert(E % 4 == 0 && TPH * HB == NT, "softmax mapping");
    extern __shared__ float4 smem_f4[];
    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5, g = lane >> 2, q4 = lane & 3, mi = lane >> 3;
    __nv_bfloat16 *vt = (__nv_bfloat16 *)smem_f4 + wp * 2 * VT;             /* this warp's [2][2][R][LDH] */
    float *sp0 = (float *)((__nv_bfloat16 *)smem_f4 + NW * 2 * VT);          /* [NW][HB][LDS] */
    float *sp = sp0 + wp * HB * LDS;                                          /* this warp's partials */
    __nv_bfloat16 *ph = (__nv_bfloat16 *)(sp0 + NW * HB * LDS), *pl = ph + HB * LDS; /* P hi, lo */
    float *corr_s = (float *)(pl + HB * LDS);                                 /* [HB] */

    const int i = blockIdx.x, h0 = blockIdx.y * HB, split = blockIdx.z, c0 = wp * MLAT_COLS;
    const int t = p.t0 + i, m = p.nsel[i];
    const int cnt = m > 0 ? m : t + 1;
    int rps = (cnt + p.nsplit - 1) / p.nsplit; /* rows per split, whole tiles (as the fp32 kernels) */
    rps = (rps + R - 1) / R * R;
    const int sb = split * rps, se = sb + rps < cnt ? sb + rps : cnt;
    const int32_t *srow = p.sel + (size_t)i * p.max_sel;
    if (sb < se) mlat_stage(vt, p.lat16, srow, m, sb, se - sb < R ? se - sb : R, c0, KVL, lane);

    /* A fragments of this warp's qa slice, heads 16mb .. 16mb+15, columns c0 + 16kb ..: register j
     * holds (head g + 8 (j & 1), columns 2 q4 + 8 (j >> 1) + 0, 1). */
    uint32_t qh[2][4][4], ql[2][4][4];
    {
        const float *qsrc = p.qa + ((size_t)i * p.Hq + h0) * KVL + c0;
#pragma unroll
        for (int mb = 0; mb < 2; mb++)
#pragma unroll
            for (int kb = 0; kb < 4; kb++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int hh = 16 * mb + g + 8 * (j & 1), c = 16 * kb + 2 * q4 + 8 * (j >> 1);
                    const float2 v = *(const float2 *)(qsrc + (size_t)hh * KVL + c);
                    cu_split_bf16x2(v.x, v.y, &qh[mb][kb][j], &ql[mb][kb][j]);
                }
    }
    /* O fragments: o[mb][nb] holds heads 16mb + g (+8), columns c0 + 8nb + 2q4 (+1). */
    float o[2][8][4];
#pragma unroll
    for (int mb = 0; mb < 2; mb++)
#pragma unroll
        for (int nb = 0; nb < 8; nb++)
#pragma unroll
            for (int x = 0; x < 4; x++) o[mb][nb][x] = 0.f;
    /* softmax: head hs, tile rows rs .. rs+E-1; the threads of a head all keep its (max, sum), in
     * log2 units (scores times log2 e, so p = exp2(s - max)) */
    const int hs = tid / TPH, rs = (tid % TPH) * E;
    const float sl2 = p.scale * 1.4426950408889634f;
    float m_run = -INFINITY, l_run = 0.f;

    int buf = 0;
    for (int s0 = sb; s0 < se; s0 += R, buf ^= 1) {
        const int rows = se - s0 < R ? se - s0 : R;
        __syncwarp(); /* this warp's reads of the other buffer (the last tile) are done: refill it */
        if (s0 + R < se) {
            const int nx = s0 + R, nrows = se - nx < R ? se - nx : R;
            mlat_stage(vt + (buf ^ 1) * VT, p.lat16, srow, m, nx, nrows, c0, KVL, lane);
            cu_cp_async_wait<1>();
        } else {
            cu_cp_async_wait<0>();
        }
        __syncwarp(); /* the warp's copies and zero rows of this tile landed */
        const __nv_bfloat16 *vh = vt + buf * VT, *vl = vh + R * LDH;

        if (m > 0) { /* partial scores over this warp's columns into sp [HB][LDS] */
            float s[2][4][4];
#pragma unroll
            for (int mb = 0; mb < 2; mb++)
#pragma unroll
                for (int nb = 0; nb < 4; nb++)
#pragma unroll
                    for (int x = 0; x < 4; x++) s[mb][nb][x] = 0.f;
#pragma unroll
            for (int kb = 0; kb < 4; kb++) {
                uint32_t bh[2][4], bl[2][4]; /* rows 16np .. 16np+15 (two n8 tiles), columns 16kb .. */
#pragma unroll
                for (int np = 0; np < 2; np++) {
                    const int r = 16 * np + (lane & 7) + 8 * (mi >> 1), c = 16 * kb + 8 * (mi & 1);
                    cu_ldsm4(bh[np], vh + r * LDH + c);
                    cu_ldsm4(bl[np], vl + r * LDH + c);
                }
                /* lo*hi, hi*lo, hi*hi as three passes over the 8 accumulators: no mma waits on the
                 * one just before it */
#pragma unroll
                for (int mb = 0; mb < 2; mb++)
#pragma unroll
                    for (int nb = 0; nb < 4; nb++)
                        cu_mma_bf16(s[mb][nb], ql[mb][kb], bh[nb >> 1][2 * (nb & 1)], bh[nb >> 1][2 * (nb & 1) + 1]);
#pragma unroll
                for (int mb = 0; mb < 2; mb++)
#pragma unroll
                    for (int nb = 0; nb < 4; nb++)
                        cu_mma_bf16(s[mb][nb], qh[mb][kb], bl[nb >> 1][2 * (nb & 1)], bl[nb >> 1][2 * (nb & 1) + 1]);
#pragma unroll
                for (int mb = 0; mb < 2; mb++)
#pragma unroll
                    for (int nb = 0; nb < 4; nb++)
                        cu_mma_bf16(s[mb][nb], qh[mb][kb], bh[nb >> 1][2 * (nb & 1)], bh[nb >> 1][2 * (nb & 1) + 1]);
            }
#pragma unroll
            for (int mb = 0; mb < 2; mb++)
#pragma unroll
                for (int nb = 0; nb < 4; nb++) {
                    const int hh = 16 * mb + g, c = 8 * nb + 2 * q4;
                    *(float2 *)(sp + hh * LDS + c) = make_float2(s[mb][nb][0], s[mb][nb][1]);
                    *(float2 *)(sp + (hh + 8) * LDS + c) = make_float2(s[mb][nb][2], s[mb][nb][3]);
                }
        }
        __syncthreads(); /* every warp's partial scores */

        { /* online softmax of head hs over rows rs .. rs+E-1 (nsel == 0: scores 0, equal weights) */
            float sv[E];
#pragma unroll
            for (int e = 0; e < E; e++) sv[e] = 0.f;
            if (m > 0) {
#pragma unroll
                for (int w = 0; w < NW; w++) { /* in warp order: deterministic */
                    const float *src = sp0 + (w * HB + hs) * LDS + rs;
#pragma unroll
                    for (int e = 0; e < E; e += 4) {
                        const float4 v = *(const float4 *)(src + e);
                        sv[e] += v.x;
                        sv[e + 1] += v.y;
                        sv[e + 2] += v.z;
                        sv[e + 3] += v.w;
                    }
                }
#pragma unroll
                for (int e = 0; e < E; e++) sv[e] *= sl2;
            }
            float mx = -INFINITY;
#pragma unroll
            for (int e = 0; e < E; e++)
                if (rs + e < rows) mx = fmaxf(mx, sv[e]);
#pragma unroll
            for (int k = 1; k < TPH; k <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, k));
            const float m_new = fmaxf(m_run, mx); /* finite: a tile has at least one row */
            float sum = 0.f;
#pragma unroll
            for (int e = 0; e < E; e++) {
                sv[e] = rs + e < rows ? exp2f(sv[e] - m_new) : 0.f;
                sum += sv[e];
            }
#pragma unroll
            for (int k = 1; k < TPH; k <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, k);
            const float corr = exp2f(m_run - m_new); /* 0 on the first tile (m_run = -inf) */
            l_run = l_run * corr + sum;
            m_run = m_new;
            if (tid % TPH == 0) corr_s[hs] = corr;
#pragma unroll
            for (int e = 0; e < E; e += 4) {
                uint2 hi, lo;
                cu_split_bf16x2(sv[e], sv[e + 1], &hi.x, &lo.x);
                cu_split_bf16x2(sv[e + 2], sv[e + 3], &hi.y, &lo.y);
                *(uint2 *)(ph + hs * LDS + rs + e) = hi;
                *(uint2 *)(pl + hs * LDS + rs + e) = lo;
            }
        }
        __syncthreads(); /* P and corr */

#pragma unroll
        for (int mb = 0; mb < 2; mb++) {
            const float c_lo = corr_s[16 * mb + g], c_hi = corr_s[16 * mb + g + 8];
#pragma unroll
            for (int nb = 0; nb < 8; nb++) {
                o[mb][nb][0] *= c_lo;
                o[mb][nb][1] *= c_lo;
                o[mb][nb][2] *= c_hi;
                o[mb][nb][3] *= c_hi;
            }
        }
#pragma unroll
        for (int kb = 0; kb < R / 16; kb++) { /* tile rows 16kb .. 16kb+15 */
            uint32_t ah[2][4], al[2][4];
#pragma unroll
            for (int mb = 0; mb < 2; mb++) {
                const int hh = 16 * mb + (lane & 7) + 8 * (mi & 1), c = 16 * kb + 8 * (mi >> 1);
                cu_ldsm4(ah[mb], ph + hh * LDS + c);
                cu_ldsm4(al[mb], pl + hh * LDS + c);
            }
#pragma unroll
            for (int nq = 0; nq < 2; nq++) { /* columns c0 + 32nq .. +31: four n8 tiles */
                uint32_t bh[2][4], bl[2][4];
#pragma unroll
                for (int x2 = 0; x2 < 2; x2++) {
                    const int r = 16 * kb + (lane & 7) + 8 * (mi & 1), c = 32 * nq + 16 * x2 + 8 * (mi >> 1);
                    cu_ldsm4_t(bh[x2], vh + r * LDH + c);
                    cu_ldsm4_t(bl[x2], vl + r * LDH + c);
                }
                /* n8 tile 4nq + j takes registers 2 (j & 1), +1 of bh[j >> 1]; three passes as above */
#pragma unroll
                for (int mb = 0; mb < 2; mb++)
#pragma unroll
                    for (int j = 0; j < 4; j++)
                        cu_mma_bf16(o[mb][4 * nq + j], al[mb], bh[j >> 1][2 * (j & 1)], bh[j >> 1][2 * (j & 1) + 1]);
#pragma unroll
                for (int mb = 0; mb < 2; mb++)
#pragma unroll
                    for (int j = 0; j < 4; j++)
                        cu_mma_bf16(o[mb][4 * nq + j], ah[mb], bl[j >> 1][2 * (j & 1)], bl[j >> 1][2 * (j & 1) + 1]);
#pragma unroll
                for (int mb = 0; mb < 2; mb++)
#pragma unroll
                    for (int j = 0; j < 4; j++)
                        cu_mma_bf16(o[mb][4 * nq + j], ah[mb], bh[j >> 1][2 * (j & 1)], bh[j >> 1][2 * (j & 1) + 1]);
            }
        }
        /* No barrier here: sp is rewritten only after the barrier above has seen every read of it,
         * and P, corr only after the next one. */
    }
    if (p.o16) { /* one split (l_run > 0: a split has at least one row): acc / l as (hi | lo) rows */
        __syncthreads(); /* every warp's reads of corr_s for the last tile are done */
        if (tid % TPH == 0) corr_s[hs] = 1.f / l_run;
        __syncthreads();
        __nv_bfloat16 *oh = p.o16 + ((size_t)i * p.Hq + h0) * 2 * KVL + c0, *ol = oh + KVL; /* (hi | lo) rows */
#pragma unroll
        for (int mb = 0; mb < 2; mb++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const int hh = 16 * mb + g + 8 * hf;
                const float inv = corr_s[hh];
#pragma unroll
                for (int nb = 0; nb < 8; nb++) {
                    const int c = 8 * nb + 2 * q4;
                    cu_split_bf16x2(o[mb][nb][2 * hf] * inv, o[mb][nb][2 * hf + 1] * inv,
                                (uint32_t *)(oh + (size_t)hh * 2 * KVL + c), (uint32_t *)(ol + (size_t)hh * 2 * KVL + c));
                }
            }
        return;
    }
    /* This split's (max, sum, acc), the max back in natural-log units; an empty split leaves
     * (-inf, 0, 0), which merges as nothing. */
    const size_t hstride = (size_t)p.nsplit * (KVL + 2);
    float *dst = p.part + (((size_t)i * p.Hq + h0) * p.nsplit + split) * (KVL + 2);
#pragma unroll
    for (int mb = 0; mb < 2; mb++)
#pragma unroll
        for (int nb = 0; nb < 8; nb++) {
            const int hh = 16 * mb + g, c = 2 + c0 + 8 * nb + 2 * q4;
            *(float2 *)(dst + hh * hstride + c) = make_float2(o[mb][nb][0], o[mb][nb][1]);
            *(float2 *)(dst + (hh + 8) * hstride + c) = make_float2(o[mb][nb][2], o[mb][nb][3]);
        }
    if (tid % TPH == 0) {
        dst[hs * hstride] = m_run * 0.6931471805599453f;
        dst[hs * hstride + 1] = l_run;
    }
}

/* The absorb and the output of the prefill path on the tensor cores (bf16 kv_b), as per-head GEMMs
 * C_h[M, N] = A_h[M, K] B_h:
 *   absorb  qa[i, h, :] = q[i, h, :] W_k[h]        A = q (rows i), B = W_k[h] [K = dn][N = kvl]
 *   output  out[i, h, :] = ol[i, h, :] W_v[h]^T    A = ol (rows i), B = W_v[h] [N = dv][K = kvl]
 * through cuBLAS: A is fp32, split into bf16 hi and lo parts (the bf16 weight is exact, so ~1e-5
 * relative as the attend) laid side by side in each row, A16 [nb * Hq][2K] = (hi | lo), and the
 * weight duplicated along K (W2, made once a call): one strided-batched GEMM over K' = 2K per
 * head gives C = hi B + lo B with C written once. (Two GEMMs, the lo part accumulating with beta
 * 1, wrote C, read it and wrote it again, and each ran its short K = 256 or 512 through its own
 * prologue and epilogue.) It replaced a mma.sync kernel of 64 x 64 tiles that converted A on the
 * way in: 4096-token prefill of bench-4L on the H200, absorb 1.33 -> 1.09 ms, output 1.29 ->
 * 1.00 ms (H200) as two GEMMs.
 * With one part (p.terms 1: the default numerics on the wgmma attend) A16 [nb * Hq][K] is A
 * rounded once and B is kv_b itself (no W2): C = hi B over K.
 * The output's A is the merged, normalised latent output, split as it is merged
 * (mla_merge_split_kernel), or written so by the attend itself (p.o16).
 * cuBLAS is column-major: row-major C_h [nb, N] (ldc) is C_h^T [N, nb]; A16_h [nb, 2K] (lda) is
 * A16_h^T [2K, nb]; the absorb's W2_k [2 dn, kvl] row-major is [kvl, 2 dn] column-major (op N),
 * the output's W2_v [dv, 2 kvl] is [2 kvl, dv] (op T). With one part the same over K: A16_h
 * [nb, K], and kv_b's W_k [dn, kvl] and W_v [dv, kvl] rows (ld kvl, a head every dn + dv rows). */
enum { MLAG_THREADS = 128 /* mla_merge_split_kernel */, MLAD_THREADS = 256 /* mla_dup_kernel */ };

/* The GEMMs' operands in CU_SCRATCH_GEMM: a16 [nb_max * Hq][terms max(dn, kvl)] (sized for the
 * larger K so that no pass grows, and synchronises, it again), then, with two parts only,
 * wk2 [Hq][2 dn][kvl] and wv2 [Hq][dv][2 kvl], each 256-byte aligned (NULL with one part). */
typedef struct mla_gemm_buf {
    __nv_bfloat16 *a16, *wk2, *wv2;
} mla_gemm_buf;

/* W2 from kv_b (per head h: W_k rows [h (dn + dv), + dn), W_v the next dv), 8 bf16 a thread:
 * e < Hq 2 dn kvl / 8 for wk2 (row k' of head h is W_k row k' mod dn), the rest for wv2 (row n of
 * head h is W_v row n twice over). kvl % 8 == 0. */
static __global__ void __launch_bounds__(MLAD_THREADS) mla_dup_kernel(mla_gemm_buf g, const __nv_bfloat16 *kv_b,
                                                                     int Hq, int dn, int dv, int kvl) {
    const int64_t e = (int64_t)blockIdx.x * MLAD_THREADS + threadIdx.x, nk = (int64_t)Hq * 2 * dn * kvl / 8;
    const int64_t nv = (int64_t)Hq * dv * 2 * kvl / 8;
    const int64_t hrows = (int64_t)(dn + dv);
    if (e < nk) {
        const int64_t x = 8 * e, h = x / (2 * (int64_t)dn * kvl), r = x - h * 2 * dn * kvl;
        const int kr = (int)(r / kvl), c = (int)(r - (int64_t)kr * kvl);
        *(uint4 *)(g.wk2 + x) = *(const uint4 *)(kv_b + (h * hrows + kr % dn) * kvl + c);
    } else if (e < nk + nv) {
        const int64_t x = 8 * (e - nk), h = x / ((int64_t)dv * 2 * kvl), r = x - h * dv * 2 * kvl;
        const int n = (int)(r / (2 * kvl)), c = (int)(r - (int64_t)n * 2 * kvl);
        *(uint4 *)(g.wv2 + x) = *(const uint4 *)(kv_b + (h * hrows + dn + n) * kvl + c % kvl);
    }
}

/* Carves CU_SCRATCH_GEMM for passes of up to nb_max rows and makes W2 (once a call; two parts only). */
static mt_status mla_gemm_prep(mt_backend *be, const mla_dev_params *p, int nb_max, mla_gemm_buf *g) {
    const size_t k = (size_t)(p->dn > p->kvl ? p->dn : p->kvl);
    const size_t a_b = cu_align_up(sizeof(__nv_bfloat16) * (size_t)nb_max * p->Hq * p->terms * k, 256);
    if (p->terms == 1) {
        g->a16 = (__nv_bfloat16 *)cu_scratch(be, CU_SCRATCH_GEMM, a_b);
        g->wk2 = g->wv2 = NULL;
        return g->a16 ? MT_OK : MT_ERR_NOMEM; /* logged */
    }
    const size_t wk_b = cu_align_up(sizeof(__nv_bfloat16) * (size_t)p->Hq * 2 * p->dn * p->kvl, 256);
    const size_t wv_b = sizeof(__nv_bfloat16) * (size_t)p->Hq * p->dv * 2 * p->kvl;
    char *buf = (char *)cu_scratch(be, CU_SCRATCH_GEMM, a_b + wk_b + wv_b);
    if (!buf) return MT_ERR_NOMEM; /* logged */
    *g = (mla_gemm_buf){(__nv_bfloat16 *)buf, (__nv_bfloat16 *)(buf + a_b), (__nv_bfloat16 *)(buf + a_b + wk_b)};
    const int64_t items = ((int64_t)p->Hq * 2 * p->dn * p->kvl + (int64_t)p->Hq * p->dv * 2 * p->kvl) / 8;
    mla_dup_kernel<<<(unsigned)((items + MLAD_THREADS - 1) / MLAD_THREADS), MLAD_THREADS, 0, cu_stream(be)>>>(
        *g, (const __nv_bfloat16 *)p->kv_b, p->Hq, p->dn, p->dv, p->kvl);
    MT_CUDA_CHECK_LAUNCH();
    return MT_OK;
}

/* C = (hi + lo) B per head: one GEMM over K' = 2K (see above); with one part C = hi B, B read
 * from kv_b (head h's W_k at rows h (dn + dv), its W_v dn rows on). */
static mt_status mla_gemm_blas(mt_backend *be, const mla_dev_params *b, bool output, const mla_gemm_buf *g) {
    cu_backend *cb = (cu_backend *)be;
    const int nb = b->nb, Hq = b->Hq, K = output ? b->kvl : b->dn, N = output ? b->dv : b->kvl, T = b->terms;
    const __nv_bfloat16 *kvb = (const __nv_bfloat16 *)b->kv_b;
    const __nv_bfloat16 *w = T == 2 ? (output ? g->wv2 : g->wk2) : output ? kvb + (size_t)b->dn * b->kvl : kvb;
    const int ldw = output ? T * b->kvl : b->kvl;
    const long long w_h = T == 2 ? 2LL * K * N : (long long)(b->dn + b->dv) * b->kvl; /* a head's W2, or kv_b rows */
    float *c = output ? b->out : b->qa;
    const float one = 1.f, zero = 0.f;
    MT_CUBLAS_CHECK(cublasGemmStridedBatchedEx(cb->blas, output ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, N, nb, T * K,
                                               &one, w, CUDA_R_16BF, ldw, w_h, g->a16, CUDA_R_16BF, Hq * T * K, T * K,
                                               &zero, c, CUDA_R_32F, Hq * N, N, Hq, CUBLAS_COMPUTE_32F,
                                               CUBLAS_GEMM_DEFAULT));
    return MT_OK;
}

/* ol[i, h, :] = the splits of (row i, head h) merged and normalised, exactly as
 * mla_output_kernel merges them, written straight as the output GEMM's bf16 parts
 * (a16 [nb * Hq][terms kvl], (hi | lo) or hi a row): no fp32 ol and no split pass over it. Block = (head h, row i); a
 * thread takes column pairs (8-byte loads of the partial sums: their rows are kvl + 2 floats;
 * kvl is 256 or 512 on this path). */
static __global__ void __launch_bounds__(MLAG_THREADS) mla_merge_split_kernel(mla_dev_params p,
                                                                              __nv_bfloat16 *a16) {
    const int h = blockIdx.x, i = blockIdx.y, kvl = p.kvl, ns = p.nsplit;
    const size_t rs = (size_t)kvl + 2;
    const float *pb = p.part + ((size_t)i * p.Hq + h) * ns * rs;
    float M = -INFINITY, L = 0.f;
    for (int s = 0; s < ns; s++) M = fmaxf(M, pb[s * rs]);
    for (int s = 0; s < ns; s++) L += expf(pb[s * rs] - M) * pb[s * rs + 1];
    const float inv = 1.f / L;
    __nv_bfloat16 *hi = a16 + ((size_t)i * p.Hq + h) * p.terms * kvl, *lo = hi + kvl;
    for (int c = 2 * threadIdx.x; c < kvl; c += 2 * MLAG_THREADS) {
        float a0 = 0.f, a1 = 0.f;
        for (int s = 0; s < ns; s++) {
            const float e = expf(pb[s * rs] - M);
            const float2 v = *(const float2 *)(pb + s * rs + 2 + c);
            a0 += e * v.x;
            a1 += e * v.y;
        }
        uint32_t vh, vl;
        cu_split_bf16x2(a0 * inv, a1 * inv, &vh, &vl);
        *(uint32_t *)(hi + c) = vh;
        if (p.terms == 2) *(uint32_t *)(lo + c) = vl;
    }
}

/* Picks heads per block (the largest of 8, 4, 2, 1 dividing Hq) and the splits: enough blocks for
 * about two per multiprocessor, no more splits than tiles in the longest selection. */
static void mla_plan(mt_backend *be, mla_dev_params *p, int nb_max, int rows_max, bool wide) {
    const int sms = cu_sms((const cu_backend *)be);
    int hg = MLA_MAX_HG;
    while (p->Hq % hg != 0) hg /= 2;
    if (wide) hg = MLAW_HB; /* mla_attend_wide_kernel: one block per multiprocessor */
    const int64_t blocks = (int64_t)nb_max * (p->Hq / hg);
    int64_t ns = (2 * (int64_t)sms + blocks - 1) / blocks;
    const int per = wide ? MLA_ROWS : MLA_SPLIT_ROUND; /* rows of a split, at the least */
    const int64_t tiles = ((int64_t)rows_max + per - 1) / per;
    if (wide) { /* one block per multiprocessor: the split count that fills the last wave best */
        const int64_t hi = (4 * (int64_t)sms + blocks - 1) / blocks;
        int64_t best = 1;
        double best_u = 0.;
        for (int64_t c = 1; c <= hi && c <= tiles && c <= MLA_MAX_SPLIT; c++) {
            const int64_t tot = blocks * c, waves = (tot + sms - 1) / sms;
            const double u = (double)tot / (double)(waves * sms);
            if (u > best_u + 1e-9) {
                best_u = u;
                best = c;
            }
        }
        ns = best;
    }
    if (ns > tiles) ns = tiles;
    if (ns > MLA_MAX_SPLIT) ns = MLA_MAX_SPLIT;
    if (ns < 1) ns = 1;
    p->hg = hg;
    p->nsplit = (int)ns;
}

static mt_status mla_sparse_launch(mt_backend *be, mla_dev_params *p, int n) {
    const int nb_max = n < MLA_BATCH ? n : MLA_BATCH;
    const int last = p->t0_dev || p->pos_rows ? p->t_cap : p->t0 + n; /* positions attended to, at most */
    const int rows_max = p->max_sel > last ? p->max_sel : last;
    /* The attend kernel: prefill (n >= MLAT_MIN_ROWS of one sequence, eager) on the tensor cores,
     * a few rows on the fp32 wide kernel (32 heads a block), where the shape allows; else, and for
     * one row, the per-8-heads kernel. mt_cuda_params.mla_attend: MT_CUDA_MLA_ATTEND_WIDE forces the
     * fp32 wide kernel, _MMA the mma.sync tensor-core kernel over the wgmma one (for comparison). */
    const size_t lim = (size_t)cu_smem_max();
    const size_t wide_smem = sizeof(float) * mlaw_smem_floats(p->kvl);
    const size_t tc_smem = mlat_smem_bytes(p->kvl / MLAT_COLS);
    const mt_cuda_mla_attend mode = ((const cu_backend *)be)->params.mla_attend;
    /* kvl 256 or 512 and an aligned pool: every latent row is 16-byte aligned for cp.async */
    const bool shape32 = p->Hq % MLAW_HB == 0 && (p->kvl == 256 || p->kvl == 512) && cu_aligned16(p->latent.base);
    const bool force_wide = mode == MT_CUDA_MLA_ATTEND_WIDE;
    const bool tc = n >= MLAT_MIN_ROWS && !force_wide && shape32 && !p->t0_dev && !p->pos_rows && tc_smem <= lim;
    /* of those, kvl 512 with heads in 64s on wgmma (cuda_dsa_mla_wg.cu); MT_CUDA_MLA_ATTEND_MMA keeps
     * mla_attend_tc_kernel (for comparison) */
    const bool wgk = tc && p->kvl == 512 && p->Hq % 64 == 0 && mode != MT_CUDA_MLA_ATTEND_MMA &&
                     mla_wg_smem_bytes() <= lim;
    const bool wide = !tc && n > 1 && shape32 && wide_smem <= lim;
    /* with it, the absorb and output through cuBLAS (mla_gemm_blas) when kv_b is bf16 */
    const bool tcg = tc && p->kv_dtype == MT_BF16 && cu_aligned16(p->kv_b); /* mla_dup_kernel's 16-byte loads */
    /* the parts of the tensor-core operands: one (as mla_setup's caller chose) only on the wgmma
     * attend with the cuBLAS absorb and output; two on the others */
    if (!wgk || !tcg) p->terms = 2;
    mla_plan(be, p, nb_max, rows_max, wide || tc); /* MLAT_HB == MLAW_HB: the same plan */
    /* scratch: [lat16 (tc only): (t0+n) * kvl floats of room] [qa] [part]; lat16 first keeps qa
     * and part where they were, 16-byte aligned */
    const size_t l16_f = tc ? (size_t)(p->t0 + n) * p->kvl : 0;
    const size_t qa_f = (size_t)nb_max * p->Hq * p->kvl;
    const size_t part_f = (size_t)nb_max * p->Hq * p->nsplit * (p->kvl + 2);
    float *scratch = (float *)cu_scratch(be, CU_SCRATCH_ATTN, sizeof(float) * (l16_f + qa_f + part_f));
    if (!scratch) return MT_ERR_NOMEM;
    p->lat16 = tc ? (const __nv_bfloat16 *)scratch : NULL;
    p->qa = scratch + l16_f;
    p->part = scratch + l16_f + qa_f;
    if (tc) { /* every latent row a query of this call may select: positions < t0 + n, by position */
        const int64_t count = (int64_t)(p->t0 + n) * p->kvl;
        const int64_t blocks = (count / 4 + MLAT_SPLIT_THREADS - 1) / MLAT_SPLIT_THREADS;
        if (blocks > 0) {
            mla_split_kernel<<<(unsigned)blocks, MLAT_SPLIT_THREADS, 0, cu_stream(be)>>>(
                (__nv_bfloat16 *)scratch, p->latent, p->bt, count, p->kvl, p->terms);
            cu_check_launch(be, "mla_sparse (split)");
        }
    }

    const size_t abs_smem = sizeof(float) * ABS_Q * (size_t)p->dn;
    const size_t att_smem = mla_smem_carve(NULL, p, NULL);
    const size_t out_smem = sizeof(float) * OUT_Q * (size_t)p->kvl;
    if (abs_smem > lim || att_smem > lim || out_smem > lim) {
        mt_log(MT_LOG_ERROR, "mla_sparse: kv_lora %d, qk_nope %d need more shared memory than the device has",
               p->kvl, p->dn);
        return MT_ERR_UNSUPPORTED;
    }
    mt_status st;
    if ((st = cu_smem_opt_in((const void *)mla_absorb_kernel, abs_smem)) != MT_OK) return st;
    if ((st = cu_smem_opt_in((const void *)mla_attend_kernel, att_smem)) != MT_OK) return st;
    if (wide) {
        if (p->kvl == 256) st = cu_smem_opt_in((const void *)mla_attend_wide_kernel<1>, wide_smem);
        else st = cu_smem_opt_in((const void *)mla_attend_wide_kernel<2>, wide_smem);
        if (st != MT_OK) return st;
    }
    if (wgk) MT_CUDA_CHECK(mla_wg_opt_in());
    if (tc && !wgk) {
        if (p->kvl == 256) st = cu_smem_opt_in((const void *)mla_attend_tc_kernel<4>, tc_smem);
        else st = cu_smem_opt_in((const void *)mla_attend_tc_kernel<8>, tc_smem);
        if (st != MT_OK) return st;
    }
    if ((st = cu_smem_opt_in((const void *)mla_output_kernel, out_smem)) != MT_OK) return st;

    mla_gemm_buf gb = {NULL, NULL, NULL};
    if (tcg && (st = mla_gemm_prep(be, p, nb_max, &gb)) != MT_OK) return st;
    mla_dev_params b = *p;
    for (int b0 = 0; b0 < n; b0 += MLA_BATCH) {
        b.nb = n - b0 < MLA_BATCH ? n - b0 : MLA_BATCH;
        b.t0 = p->t0 + b0;
        b.q = p->q + (size_t)b0 * p->Hq * p->dn;
        b.out = p->out + (size_t)b0 * p->Hq * p->dv;
        b.sel = p->sel + (size_t)b0 * p->max_sel;
        b.nsel = p->nsel + b0;
        if (p->pos_rows) {
            b.pos_rows = p->pos_rows + b0;
            b.bt_rows = p->bt_rows + b0;
        }
        /* one query row with a 16-bit kv_b: the vectorised decode kernels */
        const bool dec1 = b.nb == 1 && p->kvl % 256 == 0 && p->kvl <= 256 * ABS1_MAX_K && p->dn <= 1024 &&
                          (p->kv_dtype == MT_BF16 || p->kv_dtype == MT_F16) && cu_aligned16(p->kv_b);
        b.o16 = NULL;
        if (tcg) {
            if (p->nsplit == 1) b.o16 = gb.a16; /* the attend writes the output GEMM's A itself */
            if ((st = cu_split16(gb.a16, b.q, NULL, (int64_t)b.nb * p->Hq, p->dn, MT_BF16, p->terms, true, cu_stream(be))) != MT_OK ||
                (st = mla_gemm_blas(be, &b, false, &gb)) != MT_OK)
                return st;
        } else if (dec1) {
            const dim3 g1(p->Hq, p->kvl / 256);
            if (p->kv_dtype == MT_BF16) cu_launch_pdl_k(mla_absorb1_kernel<__nv_bfloat16>, dim3(g1), dim3(ABS1_THREADS), 0, cu_stream(be), b);
            else cu_launch_pdl_k(mla_absorb1_kernel<__half>, dim3(g1), dim3(ABS1_THREADS), 0, cu_stream(be), b);
        } else {
            const dim3 ga(p->Hq, (p->kvl + ABS_THREADS - 1) / ABS_THREADS, (b.nb + ABS_Q - 1) / ABS_Q);
            mla_absorb_kernel<<<ga, ABS_THREADS, abs_smem, cu_stream(be)>>>(b);
        }
        cu_check_launch(be, "mla_sparse (absorb)");
        const dim3 gt(b.nb, p->Hq / p->hg, p->nsplit);
        if (wgk) mla_wg_launch(&b, ((const cu_backend *)be)->params.mla_attend_rows, cu_stream(be));
        else if (tc && p->kvl == 256) mla_attend_tc_kernel<4><<<gt, 4 * 32, tc_smem, cu_stream(be)>>>(b);
        else if (tc) mla_attend_tc_kernel<8><<<gt, 8 * 32, tc_smem, cu_stream(be)>>>(b);
        else if (!wide) cu_launch_pdl_k(mla_attend_kernel, dim3(gt), dim3(MLA_THREADS), att_smem, cu_stream(be), b);
        else if (p->kvl == 256) mla_attend_wide_kernel<1><<<gt, MLAW_THREADS, wide_smem, cu_stream(be)>>>(b);
        else mla_attend_wide_kernel<2><<<gt, MLAW_THREADS, wide_smem, cu_stream(be)>>>(b);
        cu_check_launch(be, "mla_sparse (attend)");
        if (tcg) {
            if (!b.o16) {
                mla_merge_split_kernel<<<dim3(p->Hq, b.nb), MLAG_THREADS, 0, cu_stream(be)>>>(b, gb.a16);
                cu_check_launch(be, "mla_sparse (merge)");
            }
            if ((st = mla_gemm_blas(be, &b, true, &gb)) != MT_OK) return st;
        } else if (dec1) {
            const size_t o1 = sizeof(float) * ((size_t)p->kvl + MLA_MAX_SPLIT);
            const dim3 g1(p->Hq, (p->dv + OUT1_ROWS - 1) / OUT1_ROWS);
            if (p->kv_dtype == MT_BF16) cu_launch_pdl_k(mla_output1_kernel<__nv_bfloat16>, dim3(g1), dim3(ABS1_THREADS), o1, cu_stream(be), b);
            else cu_launch_pdl_k(mla_output1_kernel<__half>, dim3(g1), dim3(ABS1_THREADS), o1, cu_stream(be), b);
        } else {
            const dim3 go(p->Hq, (b.nb + OUT_Q - 1) / OUT_Q);
            mla_output_kernel<<<go, MLA_THREADS, out_smem, cu_stream(be)>>>(b);
        }
        cu_check_launch(be, "mla_sparse (output)");
    }
    return MT_OK;
}

/* The parameters of one mla_sparse call; the rows form passes its tables (then bt is NULL). */
static mla_dev_params mla_setup(float *out, const float *q, mt_paged latent, const int32_t *bt, const mt_weight *kv_b,
                                const int32_t *sel, const int32_t *nsel, int max_sel, int t0, int n,
                                const mt_mla_params *p, const int32_t *pos_rows, const int32_t *const *bt_rows) {
    MT_ASSERT(t0 >= 0 && n >= 0 && max_sel >= 0 && p->Hq > 0 && p->dn > 0 && p->dv > 0 && p->kvl > 0);
    MT_ASSERT(latent.row == p->kvl && latent.page > 0 && (bt || bt_rows));
    MT_ASSERT(p->kvl <= MLA_THREADS * MLA_MAX_COLS);
    MT_ASSERT(kv_b->dtype == MT_F32 || kv_b->dtype == MT_F16 || kv_b->dtype == MT_BF16);
    MT_ASSERT(kv_b->rows == (int64_t)p->Hq * (p->dn + p->dv) && kv_b->cols == p->kvl);
    mla_dev_params dp;
    dp.out = out;
    dp.q = q;
    dp.latent = latent;
    dp.bt = bt;
    dp.kv_b = kv_b->data;
    dp.kv_dtype = kv_b->dtype;
    dp.sel = sel;
    dp.nsel = nsel;
    dp.qa = NULL;
    dp.part = NULL;
    dp.max_sel = max_sel;
    dp.t0 = p->t0_dev || pos_rows ? 0 : t0;
    dp.t0_dev = pos_rows ? NULL : p->t0_dev;
    dp.pos_rows = pos_rows;
    dp.bt_rows = bt_rows;
    dp.terms = 2;
    dp.lat16 = NULL;
    dp.o16 = NULL;
    dp.t_cap = p->t_cap;
    dp.nb = 0;
    dp.Hq = p->Hq;
    dp.dn = p->dn;
    dp.dv = p->dv;
    dp.kvl = p->kvl;
    dp.hg = 1;
    dp.nsplit = 1;
    dp.scale = p->scale;
    return dp;
}

static void cu_mla_sparse(mt_backend *be, float *out, const float *q, mt_paged latent, const int32_t *bt,
                          const mt_weight *kv_b, const int32_t *sel, const int32_t *nsel,
                          int max_sel, int t0, int n, const mt_mla_params *p) {
    mla_dev_params dp = mla_setup(out, q, latent, bt, kv_b, sel, nsel, max_sel, t0, n, p, NULL, NULL);
    /* the backend's rounding for kv_b's class (the wgmma attend only: mla_sparse_launch) */
    if (cu_tc_terms((const cu_backend *)be, kv_b) == 1) dp.terms = 1;
    if (n == 0) return;
    cu_op_status(be, "mla_sparse", mla_sparse_launch(be, &dp, n));
}

static void cu_mla_sparse_rows(mt_backend *be, float *out, const float *q, mt_paged latent,
                               const int32_t *const *bts, const mt_weight *kv_b, const int32_t *sel,
                               const int32_t *nsel, int max_sel, const int32_t *pos, int n,
                               const mt_mla_params *p) {
    MT_ASSERT(p->t_cap > 0 && pos && bts);
    mla_dev_params dp = mla_setup(out, q, latent, NULL, kv_b, sel, nsel, max_sel, 0, n, p, pos, bts);
    if (n == 0) return;
    cu_op_status(be, "mla_sparse_rows", mla_sparse_launch(be, &dp, n));
}

extern "C" void cu_dsa_fill(mt_backend_ops *t) {
    t->dsa_pool_keys = cu_dsa_pool_keys;
    t->dsa_pool_keys_at = cu_dsa_pool_keys_at;
    t->dsa_select = cu_dsa_select;
    t->dsa_select_rows = cu_dsa_select_rows;
    t->mla_sparse = cu_mla_sparse;
    t->mla_sparse_rows = cu_mla_sparse_rows;
}
