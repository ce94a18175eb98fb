// router/validate: every GenerateRequest field at and past its limits; the message names the field.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

extern "C" {
#include "router/validate.h"
}

namespace {

// A valid request that a case then breaks; owns the storage the protobuf-c struct points into.
struct Req {
    Metrale__V1__GenerateRequest r = METRALE__V1__GENERATE_REQUEST__INIT;
    Metrale__V1__SamplingParams s = METRALE__V1__SAMPLING_PARAMS__INIT;
    Metrale__V1__StoppingCriteria st = METRALE__V1__STOPPING_CRITERIA__INIT;
    std::string id = "req-1", text;
    std::vector<uint32_t> prompt{1, 2, 3}, stops;
    Req() { st.max_new_tokens = 8; }
    const Metrale__V1__GenerateRequest *get() {
        r.request_id = (char *)id.c_str();
        r.prompt_text = (char *)text.c_str();
        r.n_prompt_token_ids = prompt.size();
        r.prompt_token_ids = prompt.data();
        st.n_stop_token_ids = stops.size();
        st.stop_token_ids = stops.data();
        if (!r.sampling) r.sampling = &s;
        if (!r.stopping) r.stopping = &st;
        return &r;
    }
};

const rtr_model_limits kLim = {300, 64};  // vocab 300, context 64

struct Case {
    const char *name;
    std::function<void(Req &)> edit;
    const char *field;  // nullptr: valid
};

std::vector<Case> cases() {
    return {
        {"valid as is", [](Req &) {}, nullptr},
        {"every knob at its top", [](Req &q) {
             q.s.temperature = 100; q.s.top_p = 1; q.s.top_k = 1 << 30; q.s.min_p = 1; q.s.repetition_penalty = 10;
             q.s.presence_penalty = 2; q.s.frequency_penalty = -2; q.s.has_seed = true; q.s.seed = 99;
             q.r.logprobs = true; q.r.top_logprobs = 20; q.stops = std::vector<uint32_t>(64, 299);
             q.id = std::string(128, '~'); q.st.max_new_tokens = 61; q.st.ignore_eos = true;
         }, nullptr},
        {"prompt fills the context", [](Req &q) { q.prompt.assign(63, 299); q.st.max_new_tokens = 1; }, nullptr},
        {"no sampling message", [](Req &q) { q.r.sampling = nullptr; }, nullptr},
        {"empty id", [](Req &q) { q.id = ""; }, "request_id"},
        {"id of 129", [](Req &q) { q.id = std::string(129, 'a'); }, "request_id"},
        {"id with newline", [](Req &q) { q.id = "a\nb"; }, "request_id byte 1"},
        {"id with DEL", [](Req &q) { q.id = "a\x7f"; }, "request_id"},
        {"id with UTF-8", [](Req &q) { q.id = "caf\xc3\xa9"; }, "request_id byte 3"},
        {"empty prompt", [](Req &q) { q.prompt.clear(); }, "prompt_token_ids is empty"},
        {"token == vocab", [](Req &q) { q.prompt = {1, 300}; }, "prompt_token_ids[1] = 300"},
        {"token max", [](Req &q) { q.prompt = {UINT32_MAX}; }, "prompt_token_ids[0]"},
        {"prompt over context", [](Req &q) { q.prompt.assign(65, 1); }, "prompt_token_ids has 65"},
        {"prompt + new over context", [](Req &q) { q.prompt.assign(60, 1); q.st.max_new_tokens = 5; }, "max_context 64"},
        {"max_new overflow", [](Req &q) { q.st.max_new_tokens = UINT32_MAX; }, "max_context"},
        {"prompt_text", [](Req &q) { q.text = "hi"; }, "prompt_text"},
        {"temperature < 0", [](Req &q) { q.s.temperature = -0.01f; }, "sampling.temperature"},
        {"temperature > 100", [](Req &q) { q.s.temperature = 100.5f; }, "sampling.temperature"},
        {"temperature NaN", [](Req &q) { q.s.temperature = NAN; }, "sampling.temperature"},
        {"temperature inf", [](Req &q) { q.s.temperature = INFINITY; }, "sampling.temperature"},
        {"top_p > 1", [](Req &q) { q.s.top_p = 1.0001f; }, "sampling.top_p"},
        {"top_p < 0", [](Req &q) { q.s.top_p = -1; }, "sampling.top_p"},
        {"top_k < 0", [](Req &q) { q.s.top_k = -1; }, "sampling.top_k = -1"},
        {"min_p > 1", [](Req &q) { q.s.min_p = 2; }, "sampling.min_p"},
        {"min_p NaN", [](Req &q) { q.s.min_p = NAN; }, "sampling.min_p"},
        {"repetition > 10", [](Req &q) { q.s.repetition_penalty = 10.5f; }, "sampling.repetition_penalty"},
        {"repetition < 0", [](Req &q) { q.s.repetition_penalty = -1; }, "sampling.repetition_penalty"},
        {"presence > 2", [](Req &q) { q.s.presence_penalty = 2.5f; }, "sampling.presence_penalty"},
        {"frequency < -2", [](Req &q) { q.s.frequency_penalty = -3; }, "sampling.frequency_penalty"},
        {"seed without has_seed", [](Req &q) { q.s.seed = 5; }, "sampling.has_seed"},
        {"no stopping", [](Req &q) { q.r.stopping = nullptr; }, "stopping.max_new_tokens = 0"},
        {"max_new 0", [](Req &q) { q.st.max_new_tokens = 0; }, "stopping.max_new_tokens"},
        {"65 stop ids", [](Req &q) { q.stops.assign(65, 1); }, "stopping.stop_token_ids has 65"},
        {"stop id == vocab", [](Req &q) { q.stops = {0, 300}; }, "stopping.stop_token_ids[1] = 300"},
        {"top_logprobs 21", [](Req &q) { q.r.logprobs = true; q.r.top_logprobs = 21; }, "top_logprobs = 21"},
        {"top_logprobs alone", [](Req &q) { q.r.top_logprobs = 1; }, "needs logprobs"},
    };
}

}  // namespace

TEST(RouterValidate, TableOfFields) {
    for (const Case &c : cases()) {
        Req q;
        q.get();
        c.edit(q);
        // get() fills pointers from the vectors unless a case cleared a sub-message on purpose.
        Metrale__V1__SamplingParams *keep_s = q.r.sampling;
        Metrale__V1__StoppingCriteria *keep_st = q.r.stopping;
        q.get();
        q.r.sampling = keep_s;
        q.r.stopping = keep_st;
        mt_error err{};
        mt_status st = rtr_validate_generate(&q.r, &kLim, &err);
        if (!c.field) {
            EXPECT_EQ(st, MT_OK) << c.name << ": " << err.msg;
        } else {
            EXPECT_EQ(st, MT_ERR_INVALID) << c.name;
            EXPECT_NE(std::string(err.msg).find(c.field), std::string::npos)
                << c.name << ": message \"" << err.msg << "\" does not name " << c.field;
        }
    }
}

TEST(RouterValidate, WithoutLimitsOnlyModelFreeChecksRun) {
    Req q;
    q.prompt = {100000};
    q.st.max_new_tokens = 1000000;
    mt_error err{};
    EXPECT_EQ(rtr_validate_generate(q.get(), nullptr, &err), MT_OK) << err.msg;
    q.s.top_p = 2;
    EXPECT_EQ(rtr_validate_generate(q.get(), nullptr, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("sampling.top_p = 2"), std::string::npos) << err.msg;
}

TEST(RouterValidate, NullRequestIsInvalid) {
    mt_error err{};
    EXPECT_EQ(rtr_validate_generate(nullptr, &kLim, &err), MT_ERR_INVALID);
}
