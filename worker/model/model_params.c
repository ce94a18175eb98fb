/* worker/model/model_params.c: the defaults of mt_model_params (model.h). */
#include "worker/model/model.h"

mt_model_params mt_model_default_params(void) {
    return (mt_model_params){ .prefill_chunk = 256, .decode_graphs = true, .device_positions = false,
                              .graph_max_rows = 64, .verify_seqs = 1 };
}
