// tests/spec_engine_run.h: one engine run with speculative decoding and the forcing hooks, shared
// by the speculation tests on the CPU (engine_spec_test) and the GPU (spec_cuda_test,
// model_ple_cuda_test). Forced acceptance makes each draft the reference run's own next token,
// forced rejection any other token; either way the output must stay the reference's, which
// proves the commit and the rollback of every layer's state.
#ifndef TESTS_SPEC_ENGINE_RUN_H
#define TESTS_SPEC_ENGINE_RUN_H

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "worker/engine/engine.h"
#include "worker/model/glm/glm_model.h"
#include "worker/model/model.h"

enum class Force { kNone, kAccept, kReject };

// What one request gave.
struct SpecOut {
    std::vector<int32_t> tokens;
    std::vector<float> logprobs;
    int finishes = 0, drafted = 0, accepted = 0;
    eng_finish reason = ENG_FINISH_ERROR;
};

// A run's requests by id (request i of the run has id i + 1) and the engine's counters after it.
struct SpecRun {
    std::map<uint64_t, SpecOut> out;
    eng_stats stats = {};
};

struct SpecRequest {
    std::vector<int32_t> prompt;
    int max_new = 64;
    bool no_speculation = false;
    const eng_sample_params *sampling = nullptr;  // NULL: greedy
    uint64_t seed = 0;                            // with sampling
    bool logprobs = false;                        // the sampled token's and its top 3
};

// n prompts of ids below 300: every third starts with the same 32 tokens (prefix reuse), then
// 5 .. 20 of its own.
inline std::vector<std::vector<int32_t>> SpecPrompts(int n) {
    std::vector<int32_t> common;
    for (int i = 0; i < 32; i++) common.push_back((i * 37 + 11) % 300);
    std::vector<std::vector<int32_t>> ps;
    for (int r = 0; r < n; r++) {
        std::vector<int32_t> p;
        if (r % 3 == 0) p = common;
        const int extra = 5 + (r * 7) % 16;
        for (int i = 0; i < extra; i++) p.push_back((r * 101 + i * 13 + 7) % 300);
        ps.push_back(p);
    }
    return ps;
}

namespace spec_run_detail {
struct Harness {
    Force force = Force::kNone;
    const SpecRun *ref = nullptr;
    int vocab = 0;
    SpecRun run;
};
}  // namespace spec_run_detail

// The requests through an engine of params p (its spec_tokens set to k, its draft hook to the
// forcing one when force is not kNone: then ref is the K = 0 run whose tokens the hook proposes,
// and past their end the drafter's own), stepped until done. Each request must finish once, with
// as many completion tokens as it streamed.
inline SpecRun RunSpec(glm_model *m, eng_params p, int k, const std::vector<SpecRequest> &reqs,
                       Force force = Force::kNone, const SpecRun *ref = nullptr) {
    using spec_run_detail::Harness;
    Harness h;
    h.force = force;
    h.ref = ref;
    h.vocab = mt_model_describe(glm_model_as_model(m)).vocab_size;
    p.spec_tokens = k;
    p.spec_hook_user = &h;
    p.spec_draft_hook = nullptr;
    if (force != Force::kNone)
        p.spec_draft_hook = [](void *u, uint64_t id, int gen_index, int32_t drafted) -> int32_t {
            auto *hh = static_cast<Harness *>(u);
            const std::vector<int32_t> &t = hh->ref->out.at(id).tokens;
            if (gen_index >= (int)t.size()) return drafted;
            return hh->force == Force::kAccept ? t[gen_index] : (t[gen_index] + 1) % hh->vocab;
        };
    eng_callbacks cb = {};
    cb.user = &h;
    cb.on_tokens = [](void *u, uint64_t id, const eng_sample_result *t, int n) {
        SpecOut &o = static_cast<Harness *>(u)->run.out[id];
        EXPECT_EQ(o.finishes, 0) << "a token after the finish, id " << id;
        for (int i = 0; i < n; i++) {
            o.tokens.push_back(t[i].token);
            o.logprobs.push_back(t[i].logprob);
        }
    };
    cb.on_finished = [](void *u, uint64_t id, const eng_finish_info *f) {
        SpecOut &o = static_cast<Harness *>(u)->run.out[id];
        o.finishes++;
        o.reason = f->reason;
        o.drafted = f->draft_tokens;
        o.accepted = f->accepted_tokens;
        EXPECT_EQ(f->completion_tokens, (int)o.tokens.size()) << "id " << id;
    };
    eng_engine *e = nullptr;
    mt_error err = { "" };
    EXPECT_EQ(eng_new(glm_model_as_model(m), &p, &cb, &e, &err), MT_OK) << err.msg;
    if (!e) return {};
    for (size_t i = 0; i < reqs.size(); i++) {
        const SpecRequest &q = reqs[i];
        eng_request r = eng_default_request();
        r.prompt = q.prompt.data();
        r.n_prompt = (int)q.prompt.size();
        r.max_new_tokens = q.max_new;
        r.ignore_eos = true;
        r.no_speculation = q.no_speculation;
        if (q.sampling) {
            r.sampling = *q.sampling;
            r.has_seed = true;
            r.seed = q.seed;
            r.logprobs = q.logprobs;
            r.top_logprobs = q.logprobs ? 3 : 0;
        }
        EXPECT_EQ(eng_submit(e, i + 1, &r, 0, &err), MT_OK) << err.msg;
    }
    for (int guard = 0; eng_has_work(e) && guard < 100000; guard++) EXPECT_EQ(eng_step(e, nullptr), MT_OK);
    EXPECT_FALSE(eng_has_work(e));
    eng_get_stats(e, &h.run.stats);
    eng_free(e);
    return h.run;
}

// The counters of a run with drafts: verify steps, and with forcing, every draft accepted
// (kAccept) or none (kReject).
inline void ExpectSpecCounts(const SpecRun &g, Force force, const std::string &what) {
    EXPECT_GT(g.stats.spec_steps, 0u) << what;
    if (force == Force::kAccept) {
        EXPECT_EQ(g.stats.accepted_tokens, g.stats.draft_tokens) << what;
    }
    if (force == Force::kReject) {
        EXPECT_EQ(g.stats.accepted_tokens, 0u) << what;
    }
}

#endif  // TESTS_SPEC_ENGINE_RUN_H
