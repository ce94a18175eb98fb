// The worker's scheduling defaults by backend (worker/loop.h): a GPU worker prefills
// WKR_GPU_PREFILL_BUDGET prompt tokens a step and a CPU worker the engine's default, unless
// --prefill-budget says otherwise; on the GPU a pass holds the whole budget (layered chunks and the
// rows beside them must fit one pass), within [the model's default pass, WKR_PREFILL_PASS_MAX].
// A worker on one GPU runs layered prompts in sites with WKR_GPU_EXPERT_PARTS expert parts (soft:
// a model without the experts keeps whole MLP sites) beside at most WKR_GPU_FINE_ROWS rows; a CPU
// worker and a tensor-parallel group whole layers; the options override each part.
#include <gtest/gtest.h>

#include "worker/engine/engine.h"
#include "worker/loop.h"
#include "kernels/backend.h"
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

TEST(WorkerParams, LayeredUnitsByBackend) {
    wkr_params p = wkr_default_params();
    wkr_layering g = wkr_layering_of(&p, true);
    EXPECT_TRUE(g.sites);
    EXPECT_EQ(g.expert_parts, WKR_GPU_EXPERT_PARTS);
    EXPECT_TRUE(g.parts_soft);
    EXPECT_EQ(g.fine_rows, WKR_GPU_FINE_ROWS);
    for (const bool tp : { false, true }) {
        wkr_params q = wkr_default_params();
        q.tp = tp ? 2 : 0;
        const wkr_layering c = wkr_layering_of(&q, tp); // a CPU worker, a GPU group
        EXPECT_FALSE(c.sites) << "tp " << tp;
        EXPECT_LE(c.expert_parts, 1) << "tp " << tp;
        EXPECT_EQ(c.fine_rows, 0) << "tp " << tp;
    }
    p.prefill_sites = 0;
    g = wkr_layering_of(&p, true);
    EXPECT_FALSE(g.sites);
    EXPECT_LE(g.expert_parts, 1);
    p.prefill_sites = 1;
    p.prefill_expert_parts = 3;
    p.fine_units_max_rows = 0;
    for (const bool gpu : { true, false }) {
        g = wkr_layering_of(&p, gpu);
        EXPECT_TRUE(g.sites);
        EXPECT_EQ(g.expert_parts, 3);
        EXPECT_FALSE(g.parts_soft);
        EXPECT_EQ(g.fine_rows, 0);
    }
}

// The soft default on a model that cannot take it: tiny_a has 16 routed experts, so 17 parts
// are refused as a request and dropped as a default (the MLP sites whole), and parts without
// sites likewise.
TEST(WorkerParams, SoftExpertPartsFallBackToWholeSites) {
    mt_backend *be = mt_cpu_backend_new(1);
    for (const bool sites : { true, false }) {
        mt_model_params mp = mt_model_default_params();
        mp.layered_sites = sites;
        mp.layered_expert_parts = 17;
        mt_model *m = nullptr;
        mt_error err{};
        EXPECT_EQ(mt_model_load("tests/fixtures/tiny_a", be, &mp, &m, &err), MT_ERR_INVALID) << "sites " << sites;
        EXPECT_EQ(m, nullptr);
        mp.layered_expert_parts_soft = true;
        ASSERT_EQ(mt_model_load("tests/fixtures/tiny_a", be, &mp, &m, &err), MT_OK) << err.msg;
        const mt_model_info mi = mt_model_describe(m);
        EXPECT_EQ(mi.layered_units, sites ? 2 * mi.n_layers : mi.n_layers) << "sites " << sites;
        mt_model_free(m);
    }
    mt_backend_free(be);
}

}  // namespace
