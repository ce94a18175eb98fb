/* kernels/cuda/cuda_dsa_mla.h: internal to the CUDA backend's sparse MLA (owner: cuda_dsa.cu, which
 * plans and launches the op; cuda_dsa_mla_wg.cu holds its prefill attend on wgmma). The parameters of
 * one pass of query rows, shared by every attend, absorb and output kernel of the op. */
#ifndef MT_CUDA_DSA_MLA_H
#define MT_CUDA_DSA_MLA_H

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <stdbool.h>
#include <stddef.h>

#include "kernels/backend.h"

typedef struct mla_dev_params {
    float *out;              /* [nb, Hq, dv] (this batch) */
    const float *q;          /* [nb, Hq, dn] */
    mt_paged latent;         /* [n_pages, page, kvl]: the latent cache pool (row == kvl) */
    const int32_t *bt;       /* the sequence's block table, covering positions [0, t0+nb) */
    const void *kv_b;        /* [Hq*(dn+dv), kvl], dtype kv_dtype */
    mt_dtype kv_dtype;
    const int32_t *sel;      /* [nb, max_sel] */
    const int32_t *nsel;     /* [nb] */
    float *qa;               /* [nb, Hq, kvl] scratch */
    float *part;             /* [nb, Hq, nsplit, kvl + 2] scratch: max, sum, acc[kvl] per split */
    int max_sel, t0, nb, Hq, dn, dv, kvl;
    int hg, nsplit;          /* heads per attend block, splits of the selected rows */
    float scale;
    const int32_t *t0_dev;   /* graph form: positions are *t0_dev + t0 + i (t0 = batch offset) */
    int t_cap;               /* graph form: bound on every position (plans the splits) */
    /* rows form (batched decode): query i is at position pos_rows[i] of the sequence whose block
     * table is bt_rows[i] (device tables [nb] of this batch); t0, t0_dev and bt are then unused */
    const int32_t *pos_rows;
    const int32_t *const *bt_rows;
    /* tensor-core attend (prefill, eager, one sequence): the bf16 parts every fp32 operand enters
     * the tensor cores as: 2 (x ~ hi + lo, the exact mode) or 1 (x rounded once: the backend's
     * MT_NUMERICS_BF16, on the wgmma attend only; mla_attend_tc_kernel always takes 2) */
    int terms;
    /* the latent rows of positions [0, t0+n) gathered from the pages and split into bf16 parts,
     * in scratch */
    const __nv_bfloat16 *lat16; /* [t0+n, terms, kvl]: row r = (hi[, lo]) of position r's latent row */
    /* with the absorb/output through cuBLAS and one split: the attend writes its normalised
     * output straight as the output GEMM's bf16 parts [nb * Hq][terms * kvl] (no part, no merge) */
    __nv_bfloat16 *o16;
} mla_dev_params;

/* The prefill attend of cuda_dsa_mla_wg.cu (kvl 512, Hq % 64 == 0, p->lat16 and p->qa 16-byte
 * aligned): its dynamic shared memory in bytes. */
size_t mla_wg_smem_bytes(void);
/* Launches it for the pass's b->nb rows (grid 2 nb x Hq / 64 x nsplit, clusters of 2) with tiles of
 * `rows` selected rows (32, or 64 with one part: mt_cuda_params.mla_attend_rows); the caller has
 * raised the kernels' shared memory limit (mla_wg_opt_in) and checks the launch. */
cudaError_t mla_wg_opt_in(void);
void mla_wg_launch(const mla_dev_params *b, int rows, cudaStream_t s);

#endif /* MT_CUDA_DSA_MLA_H */
