// The worker's scheduling defaults by backend (worker/loop.h): a GPU worker prefills
// WKR_GPU_PREFILL_BUDGET prompt tokens a step and a CPU worker the engine's default, unless
// --prefill-budget says otherwise; on the GPU a pass holds the whole budget (layered chunks and the
// rows beside them must fit one pass), within [the model's default pass, WKR_PREFILL_PASS_MAX].
#include <gtest/gtest.h>

#include "worker/engine/engine.h"
#include "worker/loop.h"
#include "worker/model/model.h"

namespace {

TEST(WorkerParams, PromptBudgetByBackend) {
    wkr_params p = wkr_default_params();
    EXPECT_EQ(wkr_prefill_budget(&p, true), WKR_GPU_PREFILL_BUDGET);
    EXPECT_EQ(wkr_prefill_budget(&p, false), eng_default_params().prefill_budget);
    p.prefill_budget = 1000;
    EXPECT_EQ(wkr_prefill_budget(&p, true), 1000);
    EXPECT_EQ(wkr_prefill_budget(&p, false), 1000);
}

TEST(WorkerParams, GpuPassHoldsTheBudget) {
    wkr_params p = wkr_default_params();
    const int dflt = mt_model_default_params().prefill_chunk;
    EXPECT_EQ(wkr_prefill_pass(&p, true), WKR_GPU_PREFILL_BUDGET);
    EXPECT_EQ(wkr_prefill_pass(&p, false), dflt);
    p.prefill_budget = 3000;
    EXPECT_EQ(wkr_prefill_pass(&p, true), 3000);
    p.prefill_budget = 1;
    EXPECT_EQ(wkr_prefill_pass(&p, true), dflt > p.max_sequences ? dflt : p.max_sequences);
    p.prefill_budget = 8192;
    EXPECT_EQ(wkr_prefill_pass(&p, true), WKR_PREFILL_PASS_MAX);
    p.prefill_pass = 512;
    EXPECT_EQ(wkr_prefill_pass(&p, true), 512);
    EXPECT_EQ(wkr_prefill_pass(&p, false), 512);
}

}  // namespace
