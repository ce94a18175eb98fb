/* worker/loader/glm_manifest.h: every text-model tensor a glm5_next checkpoint holds for a config,
 * with its exact name (docs/MODEL.md, "Checkpoint tensors"), dtype and shape.
 *
 * Owner: the model loader. The one place that knows checkpoint names: the weight binder checks a
 * checkpoint against it, and tools/mkckpt writes random checkpoints from it, so the two cannot
 * drift apart. The MTP block (layer num_hidden_layers) has its own list; vision tensors are not
 * listed.
 */
#ifndef GLM_MANIFEST_H
#define GLM_MANIFEST_H

#include "worker/loader/glm_config.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct glm_tensor_spec {
    char name[160];
    mt_dtype dtype;      /* as stored by transformers: BF16, or F32 for the fp32-kept tensors */
    int ndim;
    int64_t shape[4];
    /* A linear map's weight [out, in] (projections, experts, routers, eh_proj, lm_head): the
     * tensors an FP8 checkpoint may store as block-scaled F8_E4M3 (docs/MODEL.md, "FP8
     * checkpoints"). Norms, biases, the embedding, the mHC and the fp32 tensors are not. */
    bool linear;
    /* A sensible random init for tools: value = mean + std * N(0,1). */
    float mean, std;
} glm_tensor_spec;

typedef void (*glm_manifest_fn)(const glm_tensor_spec *spec, void *user);

/* Calls fn once per tensor, in a fixed order (top level, then layer by layer). Returns the count. */
int glm_manifest_foreach(const glm_config *cfg, glm_manifest_fn fn, void *user);

/* The MTP block's tensors (docs/MODEL.md, "MTP block"), at layer index num_hidden_layers:
 * eh_proj [H, 2H], enorm, hnorm, shared_head.norm, and a decoder layer with a DSA mixer, a full
 * indexer and an MoE, without hyper-connections. Returns the count. */
int glm_manifest_mtp_foreach(const glm_config *cfg, glm_manifest_fn fn, void *user);

/* Bytes the manifest's tensors take at their stored dtypes. */
uint64_t glm_manifest_bytes(const glm_config *cfg);

#ifdef __cplusplus
}
#endif
#endif /* GLM_MANIFEST_H */
