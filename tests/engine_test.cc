// worker/engine: the continuous-batching loop on the real tiny_a checkpoint (CPU backend).
// Greedy through the engine equals glm_prefill/glm_decode greedy; sequences joining and leaving
// get the same tokens as each run alone (greedy and seeded sampling); abort, deadlines and errors
// free the state back to zero; stop tokens and EOS; bounds (max_sequences, queue, prefill budget).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "kernels/backend.h"
#include "worker/engine/engine.h"
#include "worker/model/glm/glm_model.h"

namespace {

const char *kDir = "tests/fixtures/tiny_a";  // vocab 300, no EOS

struct Result {
    std::vector<int32_t> tokens;
    std::vector<float> logprobs;
    std::vector<std::vector<int32_t>> top;
    int finishes = 0;
    eng_finish reason = ENG_FINISH_ERROR;
    std::string message;
    int prompt_tokens = -1, completion_tokens = -1;
    std::vector<int> echo_pos;  // prompt logprobs: positions, logprobs, top ids
    std::vector<float> echo_lp;
    std::vector<std::vector<int32_t>> echo_top;
};

struct Model {
    explicit Model(const char *dir = kDir, bool layered_sites = false, int expert_parts = 0) {
        be = mt_cpu_backend_new(1);
        mt_error err = { "" };
        glm_model_params p = glm_model_default_params();
        p.layered_sites = layered_sites;
        p.layered_expert_parts = expert_parts;
        EXPECT_EQ(glm_model_load(dir, be, &p, &m, &err), MT_OK) << err.msg;
    }
    ~Model() {
        glm_model_free(m);
        mt_backend_free(be);
    }
    int vocab() const { return glm_model_config(m)->vocab_size; }
    mt_backend *be = nullptr;
    glm_model *m = nullptr;
};

// The reference: prefill, then greedy decode, straight on the model.
std::vector<int32_t> DirectGreedy(glm_model *m, const std::vector<int32_t> &prompt, int n,
                                  std::vector<std::vector<float>> *logits = nullptr) {
    const int V = glm_model_config(m)->vocab_size;
    glm_seq *s = nullptr;
    mt_error err = { "" };
    EXPECT_EQ(glm_seq_new(m, (int)prompt.size() + n, &s, &err), MT_OK) << err.msg;
    std::vector<float> l(V);
    EXPECT_EQ(glm_prefill(m, s, prompt.data(), (int)prompt.size(), l.data(), false, &err), MT_OK) << err.msg;
    std::vector<int32_t> out;
    for (int i = 0; i < n; i++) {
        if (logits) logits->push_back(l);
        out.push_back(glm_argmax(l.data(), V));
        if (i + 1 < n) {
            EXPECT_EQ(glm_decode(m, s, out.back(), l.data(), &err), MT_OK) << err.msg;
        }
    }
    glm_seq_free(s);
    return out;
}

struct Engine {
    explicit Engine(glm_model *m, eng_params p = eng_default_params())
        : run_ahead(p.run_ahead == ENG_RUN_AHEAD_ALWAYS) {  // AUTO: off on the CPU backend
        p.now_ms = [](void *u) { return static_cast<Engine *>(u)->now; };
        p.clock_user = this;
        eng_callbacks cb = {};
        cb.user = this;
        cb.on_tokens = [](void *u, uint64_t id, const eng_sample_result *t, int n) {
            auto *self = static_cast<Engine *>(u);
            Result &r = self->results[id];
            EXPECT_EQ(r.finishes, 0) << "token after finish, id " << id;
            EXPECT_EQ(n, 1);
            for (int i = 0; i < n; i++) {
                r.tokens.push_back(t[i].token);
                r.logprobs.push_back(t[i].logprob);
                r.top.emplace_back(t[i].top_ids, t[i].top_ids + t[i].n_top);
            }
            self->step_tokens[id]++;
        };
        cb.on_prompt_logprobs = [](void *u, uint64_t id, int first, const eng_sample_result *r, int n) {
            Result &res = static_cast<Engine *>(u)->results[id];
            EXPECT_TRUE(res.tokens.empty()) << "prompt logprobs after a token, id " << id;
            for (int i = 0; i < n; i++) {
                res.echo_pos.push_back(first + i);
                res.echo_lp.push_back(r[i].logprob);
                res.echo_top.emplace_back(r[i].top_ids, r[i].top_ids + r[i].n_top);
            }
        };
        cb.on_finished = [](void *u, uint64_t id, const eng_finish_info *f) {
            Result &r = static_cast<Engine *>(u)->results[id];
            r.finishes++;
            r.reason = f->reason;
            r.message = f->message;
            r.prompt_tokens = f->prompt_tokens;
            r.completion_tokens = f->completion_tokens;
        };
        mt_error err = { "" };
        EXPECT_EQ(eng_new(glm_model_as_model(m), &p, &cb, &e, &err), MT_OK) << err.msg;
    }
    ~Engine() { eng_free(e); }
    mt_status Submit(uint64_t id, const std::vector<int32_t> &prompt, eng_request r = eng_default_request(),
                     uint64_t deadline = 0, std::string *msg = nullptr) {
        r.prompt = prompt.data();
        r.n_prompt = (int)prompt.size();
        mt_error err = { "" };
        mt_status st = eng_submit(e, id, &r, deadline, &err);
        if (msg) *msg = err.msg;
        return st;
    }
    // One step; checks that no sequence got more than one token in it (two when it ran ahead: a
    // step that ends the run-ahead reports the step in flight and then decodes one more).
    void Step() {
        step_tokens.clear();
        int n = -1;
        ASSERT_EQ(eng_step(e, &n), MT_OK);
        int sum = 0;
        for (auto &kv : step_tokens) {
            EXPECT_LE(kv.second, run_ahead ? 2 : 1) << "id " << kv.first;
            EXPECT_GE(kv.second, 1) << "id " << kv.first;
            sum += kv.second;
        }
        EXPECT_EQ(n, sum);
    }
    void RunToEnd(int max_steps = 10000) {
        for (int i = 0; i < max_steps && eng_has_work(e); i++) Step();
        EXPECT_FALSE(eng_has_work(e));
    }
    eng_stats Stats() const {
        eng_stats s;
        eng_get_stats(e, &s);
        return s;
    }
    eng_engine *e = nullptr;
    bool run_ahead;
    uint64_t now = 1000000;
    std::map<uint64_t, Result> results;
    std::map<uint64_t, int> step_tokens;
};

std::vector<int32_t> Prompt(int n, int salt) {
    std::vector<int32_t> p;
    for (int i = 0; i < n; i++) p.push_back((i * 37 + salt * 101 + 7) % 300);
    return p;
}

eng_request Req(int max_new) {
    eng_request r = eng_default_request();
    r.max_new_tokens = max_new;
    return r;
}

TEST(Engine, GreedyEqualsDirectModel) {
    Model M;
    const std::vector<int32_t> prompt = Prompt(9, 1);
    std::vector<std::vector<float>> logits;
    const std::vector<int32_t> want = DirectGreedy(M.m, prompt, 12, &logits);
    Engine E(M.m);
    eng_request r = Req(12);
    r.logprobs = true;
    r.top_logprobs = 2;
    ASSERT_EQ(E.Submit(5, prompt, r), MT_OK);
    E.RunToEnd();
    const Result &got = E.results[5];
    EXPECT_EQ(got.tokens, want);
    EXPECT_EQ(got.finishes, 1);
    EXPECT_EQ(got.reason, ENG_FINISH_LENGTH);
    EXPECT_EQ(got.prompt_tokens, 9);
    EXPECT_EQ(got.completion_tokens, 12);
    for (size_t i = 0; i < want.size(); i++) {  // raw logprobs of the model's logits
        const std::vector<float> &l = logits[i];
        double mx = -INFINITY, sum = 0;
        for (float x : l) mx = std::max(mx, (double)x);
        for (float x : l) sum += std::exp(x - mx);
        EXPECT_NEAR(got.logprobs[i], l[want[i]] - mx - std::log(sum), 1e-4);
        ASSERT_EQ(got.top[i].size(), 2u);
        EXPECT_EQ(got.top[i][0], want[i]);
    }
    const eng_stats s = E.Stats();
    EXPECT_EQ(s.sequences_finished, 1u);
    EXPECT_EQ(s.tokens_generated, 12u);
    EXPECT_EQ(s.cache_bytes_in_use, 0u);
}

// Prompt logprobs: every prompt position after the first once, in order, equal to the log-softmax
// of a whole-prompt prefill's logits; across chunks (a prompt longer than ENG_ECHO_CHUNK and a small
// prefill budget), beside a prefix kept by an earlier request (not reused), and the generated
// tokens unchanged.
// The start-up warm-up leaves no trace: no callback, nothing counted, no prefix kept, the pools
// back to baseline; later requests get the tokens a fresh engine gives. A busy engine refuses one.
TEST(Engine, WarmupLeavesNoTrace) {
    Model M;
    const std::vector<int32_t> prompt = Prompt(70, 3);
    const std::vector<int32_t> want = DirectGreedy(M.m, prompt, 6);
    eng_params p = eng_default_params();
    p.prefix_block = 16;
    Engine E(M.m, p);
    const eng_stats before = E.Stats();
    mt_error err = { "" };
    ASSERT_EQ(eng_warmup(E.e, 70, 4, &err), MT_OK) << err.msg;
    EXPECT_TRUE(E.results.empty());
    const eng_stats s = E.Stats();
    EXPECT_EQ(s.steps, 0u);
    EXPECT_EQ(s.tokens_generated, 0u);
    EXPECT_EQ(s.sequences_finished, 0u);
    EXPECT_EQ(s.prefill_tokens, 0u);
    EXPECT_EQ(s.prefix_entries, 0);
    EXPECT_EQ(s.prefix_misses, 0u);
    EXPECT_EQ(s.cache_bytes_in_use, 0u);
    EXPECT_EQ(s.pages_free, before.pages_free);
    EXPECT_EQ(s.slots_free, before.slots_free);
    ASSERT_EQ(E.Submit(1, prompt, Req(6)), MT_OK);
    E.RunToEnd();
    EXPECT_EQ(E.results[1].tokens, want);
    EXPECT_EQ(E.Stats().prefix_entries, 1);  // prefix reuse is back on after the warm-up
    ASSERT_EQ(E.Submit(2, prompt, Req(6)), MT_OK);
    EXPECT_EQ(eng_warmup(E.e, 8, 2, &err), MT_ERR_INVALID);
    E.RunToEnd();
    EXPECT_EQ(E.results[2].tokens, want);
}

TEST(Engine, PromptLogprobsMatchAWholePrefill) {
    Model M;
    const int V = M.vocab();
    const std::vector<int32_t> prompt = Prompt(ENG_ECHO_CHUNK + 70, 4);
    glm_seq *gs = nullptr;
    mt_error err = { "" };
    ASSERT_EQ(glm_seq_new(M.m, (int)prompt.size(), &gs, &err), MT_OK) << err.msg;
    std::vector<float> all((size_t)prompt.size() * V);
    ASSERT_EQ(glm_prefill(M.m, gs, prompt.data(), (int)prompt.size(), all.data(), true, &err), MT_OK) << err.msg;
    glm_seq_free(gs);
    const std::vector<int32_t> want = DirectGreedy(M.m, prompt, 4);

    eng_params p = eng_default_params();
    p.prefill_budget = 100;
    p.prefix_block = 64;
    Engine E(M.m, p);
    ASSERT_EQ(E.Submit(1, prompt, Req(2)), MT_OK);  // keeps a prefix of the same prompt
    E.RunToEnd();
    eng_request r = Req(4);
    r.prompt_logprobs = true;
    r.top_logprobs = 3;
    ASSERT_EQ(E.Submit(2, prompt, r), MT_OK);
    E.RunToEnd();
    const Result &got = E.results[2];
    EXPECT_EQ(got.tokens, want);
    ASSERT_EQ(got.echo_pos.size(), prompt.size() - 1);
    for (size_t i = 0; i < got.echo_pos.size(); i++) {
        const int pos = got.echo_pos[i];
        ASSERT_EQ(pos, (int)i + 1);
        const float *l = all.data() + (size_t)(pos - 1) * V;
        double mx = -INFINITY, sum = 0;
        for (int v = 0; v < V; v++) mx = std::max(mx, (double)l[v]);
        for (int v = 0; v < V; v++) sum += std::exp(l[v] - mx);
        EXPECT_NEAR(got.echo_lp[i], l[prompt[pos]] - mx - std::log(sum), 2e-4) << "position " << pos;
        ASSERT_EQ(got.echo_top[i].size(), 3u);
        EXPECT_EQ(got.echo_top[i][0], glm_argmax(l, V)) << "position " << pos;
    }
    EXPECT_TRUE(E.results[1].echo_pos.empty());
}

TEST(Engine, SequencesJoiningAndLeavingMatchEachAlone) {
    Model M;
    struct Spec { uint64_t id; int plen, max_new, submit_at; float temperature; uint64_t seed; };
    const Spec specs[] = {
        { 1, 5, 10, 0, 0.f, 0 },   { 2, 12, 4, 0, 0.f, 0 },   { 3, 3, 14, 0, 0.9f, 11 },
        { 4, 20, 6, 2, 0.f, 0 },   { 5, 1, 9, 3, 1.2f, 12 },  { 6, 7, 1, 3, 0.f, 0 },
        { 7, 30, 8, 5, 0.7f, 13 }, { 8, 2, 12, 9, 0.f, 0 },
    };
    auto request = [](const Spec &s) {
        eng_request r = Req(s.max_new);
        r.sampling.temperature = s.temperature;
        r.sampling.top_p = s.temperature > 0 ? 0.9f : 1.0f;
        r.sampling.repetition_penalty = s.temperature > 0 ? 1.1f : 1.0f;
        r.has_seed = true;
        r.seed = s.seed;
        return r;
    };
    std::map<uint64_t, std::vector<int32_t>> alone;
    for (const Spec &s : specs) {
        Engine E(M.m);
        ASSERT_EQ(E.Submit(s.id, Prompt(s.plen, (int)s.id), request(s)), MT_OK);
        E.RunToEnd();
        alone[s.id] = E.results[s.id].tokens;
        ASSERT_EQ((int)alone[s.id].size(), s.max_new);
    }
    eng_params p = eng_default_params();
    p.max_sequences = 3;  // some wait, and join as others leave
    Engine E(M.m, p);
    int max_running = 0;
    for (int step = 0; step < 200; step++) {
        for (const Spec &s : specs)
            if (s.submit_at == step) {
                ASSERT_EQ(E.Submit(s.id, Prompt(s.plen, (int)s.id), request(s)), MT_OK);
            }
        if (step > 10 && !eng_has_work(E.e)) break;
        E.Step();
        const eng_stats st = E.Stats();
        max_running = std::max(max_running, st.running);
        EXPECT_LE(st.running, 3);
    }
    EXPECT_EQ(max_running, 3);
    for (const Spec &s : specs) {
        EXPECT_EQ(E.results[s.id].tokens, alone[s.id]) << "id " << s.id;
        EXPECT_EQ(E.results[s.id].reason, ENG_FINISH_LENGTH);
        EXPECT_EQ(E.results[s.id].finishes, 1);
    }
    const eng_stats st = E.Stats();
    EXPECT_EQ(st.live_sequences, 0);
    EXPECT_EQ(st.cache_bytes_in_use, 0u);
    EXPECT_EQ(st.sequences_finished, 8u);
}

TEST(Engine, SeededSamplingIsReproducible) {
    Model M;
    eng_request r = Req(20);
    r.sampling.temperature = 1.5f;
    r.sampling.top_k = 50;
    r.sampling.min_p = 0.01f;
    r.sampling.presence_penalty = 0.5f;
    r.sampling.frequency_penalty = 0.2f;
    r.has_seed = true;
    auto run = [&](uint64_t seed) {
        Engine E(M.m);
        r.seed = seed;
        EXPECT_EQ(E.Submit(1, Prompt(6, 2), r), MT_OK);
        E.RunToEnd();
        return E.results[1].tokens;
    };
    EXPECT_EQ(run(7), run(7));
    EXPECT_NE(run(7), run(8));
}

TEST(Engine, AbortFreesStateBackToBaseline) {
    Model M;
    eng_params p = eng_default_params();
    p.max_sequences = 4;
    Engine E(M.m, p);
    EXPECT_EQ(E.Stats().cache_bytes_in_use, 0u);
    for (uint64_t id = 1; id <= 10; id++) ASSERT_EQ(E.Submit(id, Prompt(4 + (int)id, (int)id), Req(50)), MT_OK);
    E.Step();
    E.Step();
    eng_stats s = E.Stats();
    EXPECT_EQ(s.running, 4);
    EXPECT_EQ(s.waiting, 6);
    EXPECT_EQ(s.live_sequences, 10);
    EXPECT_GT(s.cache_bytes_in_use, 0u);
    // running 1..4, waiting 5..10: abort one of each, then everything
    EXPECT_EQ(eng_abort(E.e, 2, ENG_FINISH_CANCELLED, nullptr), MT_OK);
    EXPECT_EQ(eng_abort(E.e, 9, ENG_FINISH_CANCELLED, "client went away"), MT_OK);
    EXPECT_EQ(eng_abort(E.e, 9, ENG_FINISH_CANCELLED, nullptr), MT_ERR_NOT_FOUND);
    EXPECT_EQ(eng_abort(E.e, 99, ENG_FINISH_CANCELLED, nullptr), MT_ERR_NOT_FOUND);
    EXPECT_EQ(E.results[2].reason, ENG_FINISH_CANCELLED);
    EXPECT_EQ(E.results[2].completion_tokens, 2);
    EXPECT_EQ(E.results[9].message, "client went away");
    EXPECT_EQ(E.results[9].completion_tokens, 0);
    s = E.Stats();
    EXPECT_EQ(s.running, 3);
    EXPECT_EQ(s.waiting, 5);
    E.Step();  // a waiting one takes the freed slot
    EXPECT_EQ(E.Stats().running, 4);
    eng_abort_all(E.e, ENG_FINISH_CANCELLED, "shutting down");
    s = E.Stats();
    EXPECT_EQ(s.live_sequences, 0);
    EXPECT_EQ(s.cache_bytes_in_use, 0u);
    EXPECT_EQ(s.sequences_aborted, 10u);
    EXPECT_FALSE(eng_has_work(E.e));
    for (uint64_t id = 1; id <= 10; id++) {
        EXPECT_EQ(E.results[id].finishes, 1) << id;
        EXPECT_EQ(E.results[id].reason, ENG_FINISH_CANCELLED) << id;
    }
    // the engine is reusable afterwards and the id can come back
    E.results.erase(2);
    ASSERT_EQ(E.Submit(2, Prompt(5, 1), Req(3)), MT_OK);
    E.RunToEnd();
    EXPECT_EQ(E.results[2].finishes, 1);
    EXPECT_EQ(E.results[2].reason, ENG_FINISH_LENGTH);
}

TEST(Engine, CacheBytesCountEveryRunningSequence) {
    Model M;
    eng_params p = eng_default_params();
    p.max_sequences = 2;
    Engine E(M.m, p);
    ASSERT_EQ(E.Submit(1, Prompt(10, 1), Req(6)), MT_OK);
    ASSERT_EQ(E.Submit(2, Prompt(3, 2), Req(40)), MT_OK);
    E.Step();
    // each holds its slot and the one page its prompt and first token fit in
    const size_t want = 2 * (glm_model_slot_bytes(M.m) + glm_model_page_bytes(M.m));
    EXPECT_GT(want, 0u);
    EXPECT_EQ(E.Stats().cache_bytes_in_use, want);
    E.RunToEnd();
    EXPECT_EQ(E.Stats().cache_bytes_in_use, 0u);
}

TEST(Engine, StopTokenEndsAndIsIncluded) {
    Model M;
    const std::vector<int32_t> prompt = Prompt(8, 3);
    const std::vector<int32_t> greedy = DirectGreedy(M.m, prompt, 16);
    // stop at the token greedy produces at index 3 (or earlier, if it came before)
    const int32_t stop = greedy[3];
    size_t first = 0;
    while (greedy[first] != stop) first++;
    Engine E(M.m);
    eng_request r = Req(16);
    const int32_t stops[] = { 299, stop };
    r.stop_ids = stops;
    r.n_stop = 2;
    ASSERT_EQ(E.Submit(1, prompt, r), MT_OK);
    r.n_stop = 0;  // the same without stop tokens runs to the length
    ASSERT_EQ(E.Submit(2, prompt, r), MT_OK);
    E.RunToEnd();
    EXPECT_EQ(E.results[1].reason, ENG_FINISH_STOP);
    EXPECT_EQ(E.results[1].tokens, std::vector<int32_t>(greedy.begin(), greedy.begin() + first + 1));
    EXPECT_EQ(E.results[1].completion_tokens, (int)first + 1);
    EXPECT_EQ(E.results[2].reason, ENG_FINISH_LENGTH);
    EXPECT_EQ(E.results[2].tokens, greedy);
    EXPECT_EQ(E.Stats().sequences_finished, 2u);
}

// Greedy batches run ahead (step k + 1 queued on the device's tokens of step k before the host
// reads them) give the tokens, finishes and pool state of step-by-step decoding, through a stop
// token met while the next step is in flight, sequences of different lengths ending in
// different steps, a request arriving mid-run and a deadline between steps (the step in flight
// is read first); an abort drops the step in flight, so it may report one token fewer.
TEST(Engine, RunAheadGivesTheTokensOfStepByStep) {
    Model M;
    const std::vector<int32_t> p1 = Prompt(8, 3), p2 = Prompt(5, 7), p3 = Prompt(11, 2), p4 = Prompt(6, 9);
    const std::vector<int32_t> g1 = DirectGreedy(M.m, p1, 20);
    const int32_t stop = g1[6];  // ends sequence 1 at its first occurrence, at index <= 6
    struct Run {
        std::map<uint64_t, Result> results;
        eng_stats stats;
    };
    auto run = [&](bool ahead) {
        eng_params p = eng_default_params();
        p.run_ahead = ahead ? ENG_RUN_AHEAD_ALWAYS : ENG_RUN_AHEAD_OFF;
        Engine E(M.m, p);
        eng_request r = Req(20);
        const int32_t stops[] = { stop };
        r.stop_ids = stops;
        r.n_stop = 1;
        EXPECT_EQ(E.Submit(1, p1, r), MT_OK);
        EXPECT_EQ(E.Submit(2, p2, Req(9)), MT_OK);
        EXPECT_EQ(E.Submit(3, p3, Req(25)), MT_OK);
        EXPECT_EQ(E.Submit(6, p4, Req(30), E.now + 1000), MT_OK);  // deadline at step 14
        for (int step = 0; step < 200 && eng_has_work(E.e); step++) {
            if (step == 5) {
                EXPECT_EQ(E.Submit(4, p4, Req(12)), MT_OK);
            }
            if (step == 10) {
                EXPECT_EQ(eng_abort(E.e, 3, ENG_FINISH_CANCELLED, nullptr), MT_OK);
            }
            if (step == 14) E.now += 1000;
            E.Step();
        }
        EXPECT_FALSE(eng_has_work(E.e));
        Run out{ E.results, E.Stats() };
        return out;
    };
    const Run off = run(false), on = run(true);
    EXPECT_EQ(off.stats.ahead_steps, 0u);
    EXPECT_GT(on.stats.ahead_steps, 5u);
    for (uint64_t id : { 1, 2, 3, 4, 6 }) {
        const Result &a = off.results.at(id), &b = on.results.at(id);
        if (id == 3) { // aborted: the step in flight is dropped, so one token fewer at most
            ASSERT_LE(b.tokens.size(), a.tokens.size());
            EXPECT_GE(b.tokens.size() + 1, a.tokens.size());
            EXPECT_EQ(b.tokens, std::vector<int32_t>(a.tokens.begin(), a.tokens.begin() + b.tokens.size()));
        } else {
            EXPECT_EQ(b.tokens, a.tokens) << "id " << id;
        }
        EXPECT_EQ(b.finishes, 1) << "id " << id;
        EXPECT_EQ(b.reason, a.reason) << "id " << id;
        if (id != 3) {
            EXPECT_EQ(b.completion_tokens, a.completion_tokens) << "id " << id;
        }
    }
    size_t first = 0;
    while (g1[first] != stop) first++;
    EXPECT_EQ(on.results.at(1).reason, ENG_FINISH_STOP);
    EXPECT_EQ(on.results.at(1).tokens, std::vector<int32_t>(g1.begin(), g1.begin() + first + 1));
    EXPECT_EQ(on.results.at(2).tokens, DirectGreedy(M.m, p2, 9));
    EXPECT_EQ(on.results.at(4).tokens, DirectGreedy(M.m, p4, 12));
    EXPECT_EQ(on.results.at(3).reason, ENG_FINISH_CANCELLED);
    EXPECT_EQ(on.results.at(6).reason, ENG_FINISH_CANCELLED);
    EXPECT_EQ(on.stats.cache_bytes_in_use, 0u);
    EXPECT_EQ(on.stats.pages_free, off.stats.pages_free);
    EXPECT_EQ(on.stats.slots_free, on.stats.slots_total - on.stats.prefix_entries);
}

// With every running place taken, waiting requests do not stop the running batch from running
// ahead; each is admitted at the boundary after a running sequence ends, and every request gets the
// tokens it gets step by step.
TEST(Engine, RunAheadWhileRequestsWaitForAPlace) {
    Model M;
    auto run = [&](bool ahead) {
        eng_params p = eng_default_params();
        p.run_ahead = ahead ? ENG_RUN_AHEAD_ALWAYS : ENG_RUN_AHEAD_OFF;
        p.max_sequences = 2;
        Engine E(M.m, p);
        for (uint64_t id = 1; id <= 5; id++) EXPECT_EQ(E.Submit(id, Prompt(3 + 2 * (int)id, (int)id), Req(4 + 3 * (int)id)), MT_OK);
        E.RunToEnd();
        std::pair<std::map<uint64_t, Result>, eng_stats> out{ E.results, E.Stats() };
        return out;
    };
    const auto off = run(false), on = run(true);
    EXPECT_EQ(off.second.ahead_steps, 0u);
    EXPECT_GT(on.second.ahead_steps, 10u);
    for (uint64_t id = 1; id <= 5; id++) {
        EXPECT_EQ(on.first.at(id).tokens, off.first.at(id).tokens) << "id " << id;
        EXPECT_EQ(on.first.at(id).tokens, DirectGreedy(M.m, Prompt(3 + 2 * (int)id, (int)id), 4 + 3 * (int)id))
            << "id " << id;
        EXPECT_EQ(on.first.at(id).reason, ENG_FINISH_LENGTH) << "id " << id;
    }
    EXPECT_EQ(on.second.cache_bytes_in_use, 0u);
}

// tiny_a with eos_token_id set: a copy of its config beside a link to its weights.
std::string ModelWithEos(int eos) {
    char tmpl[] = "/tmp/engine_test_eos_XXXXXX";
    const char *dir = mkdtemp(tmpl);
    EXPECT_NE(dir, nullptr);
    std::ifstream in(std::string(kDir) + "/config.json");
    std::stringstream ss;
    ss << in.rdbuf();
    std::string cfg = ss.str();
    const std::string key = "\"eos_token_id\": null";
    const size_t at = cfg.find(key);
    EXPECT_NE(at, std::string::npos);
    cfg.replace(at, key.size(), "\"eos_token_id\": " + std::to_string(eos));
    std::ofstream(std::string(dir) + "/config.json") << cfg;
    char cwd[4096];
    EXPECT_NE(getcwd(cwd, sizeof cwd), nullptr);
    const std::string w = std::string(cwd) + "/" + kDir + "/model.safetensors";
    EXPECT_EQ(symlink(w.c_str(), (std::string(dir) + "/model.safetensors").c_str()), 0);
    return dir;
}

TEST(Engine, EosStopsUnlessIgnored) {
    Model plain;
    const std::vector<int32_t> prompt = Prompt(8, 4);
    const std::vector<int32_t> greedy = DirectGreedy(plain.m, prompt, 12);
    const int32_t eos = greedy[2];
    size_t first = 0;
    while (greedy[first] != eos) first++;
    const std::string dir = ModelWithEos(eos);
    Model M(dir.c_str());
    ASSERT_EQ(glm_model_config(M.m)->eos_token_id, eos);
    Engine E(M.m);
    eng_request r = Req(12);
    ASSERT_EQ(E.Submit(1, prompt, r), MT_OK);
    r.ignore_eos = true;
    ASSERT_EQ(E.Submit(2, prompt, r), MT_OK);
    E.RunToEnd();
    EXPECT_EQ(E.results[1].reason, ENG_FINISH_STOP);
    EXPECT_EQ(E.results[1].tokens, std::vector<int32_t>(greedy.begin(), greedy.begin() + first + 1));
    EXPECT_EQ(E.results[2].reason, ENG_FINISH_LENGTH);
    EXPECT_EQ(E.results[2].tokens, greedy);
    std::remove((dir + "/model.safetensors").c_str());
    std::remove((dir + "/config.json").c_str());
    rmdir(dir.c_str());
}

TEST(Engine, DeadlineEndsRunningAndWaitingSequences) {
    Model M;
    eng_params p = eng_default_params();
    p.max_sequences = 1;
    Engine E(M.m, p);
    ASSERT_EQ(E.Submit(1, Prompt(5, 1), Req(100), E.now + 50), MT_OK);  // runs
    ASSERT_EQ(E.Submit(2, Prompt(5, 2), Req(100), E.now + 50), MT_OK);  // waits behind it
    ASSERT_EQ(E.Submit(3, Prompt(5, 3), Req(3)), MT_OK);                // no deadline
    E.Step();
    E.Step();
    EXPECT_EQ(E.results[1].tokens.size(), 2u);
    E.now += 50;
    E.Step();  // both expire; 3 is admitted in the same step
    for (uint64_t id : { 1, 2 }) {
        EXPECT_EQ(E.results[id].reason, ENG_FINISH_CANCELLED) << id;
        EXPECT_EQ(E.results[id].message, "deadline exceeded") << id;
        EXPECT_EQ(E.results[id].finishes, 1) << id;
    }
    EXPECT_EQ(E.results[1].tokens.size(), 2u);
    EXPECT_EQ(E.results[2].tokens.size(), 0u);
    EXPECT_EQ(E.results[3].tokens.size(), 1u);
    E.RunToEnd();
    EXPECT_EQ(E.results[3].reason, ENG_FINISH_LENGTH);
    const eng_stats s = E.Stats();
    EXPECT_EQ(s.sequences_aborted, 2u);
    EXPECT_EQ(s.sequences_finished, 1u);
    EXPECT_EQ(s.cache_bytes_in_use, 0u);
}

// A deadline is considered at admission: once a prompt token's cost is measured, a request whose
// prefill cannot end before its deadline is ended when it would be admitted, before any of its
// prefill runs; a request with time enough beside it is served.
TEST(Engine, DeadlineTooNearForThePrefillEndsItAtAdmission) {
    Model M;
    Engine E(M.m);
    ASSERT_EQ(E.Submit(1, Prompt(8, 1), Req(8)), MT_OK);
    E.Step();
    E.Step();  // a decode step: the base
    ASSERT_EQ(E.Submit(4, Prompt(64, 4), Req(2)), MT_OK);
    E.Step();  // a prompt beside a decode row: a prompt token's time (real time; deadlines use E.now)
    E.RunToEnd();
    ASSERT_EQ(E.Submit(2, Prompt(3000, 2), Req(4), E.now + 1), MT_OK);  // 1 ms for 3000 tokens
    ASSERT_EQ(E.Submit(3, Prompt(40, 3), Req(4), E.now + 3600000), MT_OK);
    E.Step();
    EXPECT_EQ(E.results[2].reason, ENG_FINISH_CANCELLED);
    EXPECT_EQ(E.results[2].message.rfind("deadline exceeded: its prefill of 3000 tokens takes about", 0), 0u)
        << E.results[2].message;
    EXPECT_EQ(E.results[2].tokens.size(), 0u);
    E.RunToEnd();
    EXPECT_EQ(E.results[3].reason, ENG_FINISH_LENGTH);
    EXPECT_EQ(E.results[3].tokens.size(), 4u);
    EXPECT_EQ(E.Stats().cache_bytes_in_use, 0u);
}

TEST(Engine, BadRequestsAreRejectedWithoutSideEffects) {
    Model M;
    eng_params p = eng_default_params();
    p.max_context = 64;
    p.max_waiting = 2;
    Engine E(M.m, p);
    const std::vector<int32_t> ok = Prompt(4, 1);
    struct Bad { std::vector<int32_t> prompt; eng_request r; const char *says; };
    std::vector<Bad> bad;
    auto add = [&](std::vector<int32_t> pr, auto f, const char *says) {
        eng_request r = Req(4);
        f(r);
        bad.push_back({ pr, r, says });
    };
    add({}, [](eng_request &) {}, "prompt is empty");
    add({ 1, 300 }, [](eng_request &) {}, "outside the vocabulary");
    add({ -1 }, [](eng_request &) {}, "outside the vocabulary");
    add(ok, [](eng_request &r) { r.max_new_tokens = 0; }, "max_new_tokens");
    add(ok, [](eng_request &r) { r.max_new_tokens = 61; }, "context limit");
    add(ok, [](eng_request &r) { static const int32_t s[] = { 300 }; r.stop_ids = s; r.n_stop = 1; }, "stop token");
    add(ok, [](eng_request &r) { r.top_logprobs = 21; }, "top_logprobs");
    add(ok, [](eng_request &r) { r.sampling.top_p = 0; }, "top_p");
    add(ok, [](eng_request &r) { r.sampling.temperature = NAN; }, "temperature");
    for (const Bad &b : bad) {
        std::string msg;
        EXPECT_EQ(E.Submit(1, b.prompt, b.r, 0, &msg), MT_ERR_INVALID) << b.says;
        EXPECT_NE(msg.find(b.says), std::string::npos) << msg;
    }
    EXPECT_FALSE(eng_has_work(E.e));
    ASSERT_EQ(E.Submit(1, ok, Req(60)), MT_OK);  // exactly at the context limit
    std::string msg;
    EXPECT_EQ(E.Submit(1, ok, Req(4), 0, &msg), MT_ERR_INVALID);
    EXPECT_NE(msg.find("already live"), std::string::npos) << msg;
    ASSERT_EQ(E.Submit(2, ok, Req(4)), MT_OK);
    EXPECT_EQ(E.Submit(3, ok, Req(4), 0, &msg), MT_ERR_FULL);
    EXPECT_EQ(E.Stats().waiting, 2);
    E.RunToEnd();
    EXPECT_TRUE(E.results.count(3) == 0);
    EXPECT_EQ(E.results[1].tokens.size(), 60u);
}

// Chunked prefill: no step feeds more than prefill_budget prompt tokens, a long prompt is spread
// over steps while the running sequences keep getting a token every step, and every sequence's
// tokens still equal plain greedy decoding of its prompt.
TEST(Engine, LongPromptsArePrefilledInChunksBesideDecode) {
    Model M;
    eng_params p = eng_default_params();
    p.prefill_budget = 20;
    Engine E(M.m, p);
    for (uint64_t id = 1; id <= 3; id++) ASSERT_EQ(E.Submit(id, Prompt(15, (int)id), Req(30)), MT_OK);
    E.Step();  // 15 tokens of #1 (first token), then 5 of #2
    EXPECT_EQ(E.results[1].tokens.size(), 1u);
    EXPECT_EQ(E.results[2].tokens.size(), 0u);
    E.Step();  // #1 decodes; #2's last 10 (first token), then 10 of #3
    EXPECT_EQ(E.results[1].tokens.size(), 2u);
    EXPECT_EQ(E.results[2].tokens.size(), 1u);
    EXPECT_EQ(E.results[3].tokens.size(), 0u);
    const std::vector<int32_t> long_prompt = Prompt(100, 5);
    ASSERT_EQ(E.Submit(5, long_prompt, Req(5)), MT_OK);
    size_t before = E.results[1].tokens.size();
    int steps_to_first = 0;
    while (E.results[5].tokens.empty()) {
        E.Step();
        steps_to_first++;
        // the running sequence is never stalled by the long prompt: one token a step
        EXPECT_EQ(E.results[1].tokens.size(), before + steps_to_first) << "step " << steps_to_first;
        ASSERT_LT(steps_to_first, 20);
    }
    EXPECT_GE(steps_to_first, 5);  // 100 tokens at <= 20 a step (and #3's remainder first)
    E.RunToEnd();
    for (uint64_t id = 1; id <= 3; id++)
        EXPECT_EQ(E.results[id].tokens, DirectGreedy(M.m, Prompt(15, (int)id), 30)) << id;
    EXPECT_EQ(E.results[5].tokens, DirectGreedy(M.m, long_prompt, 5));
    EXPECT_EQ(E.Stats().cache_bytes_in_use, 0u);
}

// Staggered arrivals of greedy and seeded sampled requests with prefill chunks of 16 tokens
// spread over steps beside the decode rows: each request's tokens under params p (max_sequences
// 4, budget 16 set here), and the engine's stats at the end.
struct Staggered {
    uint64_t id;
    int plen, max_new, submit_at;
    float temperature;
    uint64_t seed;
};
const Staggered kStaggered[] = {
    { 1, 5, 12, 0, 0.f, 0 },   { 2, 40, 6, 1, 0.f, 0 },   { 3, 3, 14, 1, 0.9f, 11 },
    { 4, 25, 8, 2, 0.f, 0 },   { 5, 1, 9, 3, 1.2f, 12 },  { 6, 33, 3, 4, 0.f, 0 },
    { 7, 18, 8, 6, 0.7f, 13 }, { 8, 2, 12, 9, 0.f, 0 },
};

std::map<uint64_t, std::vector<int32_t>> RunStaggered(glm_model *m, eng_params p, eng_stats *stats) {
    std::map<uint64_t, std::vector<int32_t>> got;
    p.max_sequences = 4;
    p.prefill_budget = 16;
    Engine E(m, p);
    for (int step = 0; step < 300; step++) {
        for (const Staggered &s : kStaggered)
            if (s.submit_at == step) {
                eng_request r = Req(s.max_new);
                r.sampling.temperature = s.temperature;
                r.has_seed = true;
                r.seed = s.seed;
                EXPECT_EQ(E.Submit(s.id, Prompt(s.plen, (int)s.id), r), MT_OK);
            }
        if (step > 10 && !eng_has_work(E.e)) break;
        E.Step();
    }
    for (const Staggered &s : kStaggered) {
        EXPECT_EQ((int)E.results[s.id].tokens.size(), s.max_new) << "id " << s.id;
        got[s.id] = E.results[s.id].tokens;
    }
    *stats = E.Stats();
    EXPECT_EQ(stats->cache_bytes_in_use, 0u);
    return got;
}

// Mixed steps (a step's decode rows and prompt chunks in one model call) change no token: the
// staggered arrivals give the same tokens with mixed_steps on and off, and on they ran.
TEST(Engine, MixedStepsGiveTheTokensOfSeparateCalls) {
    Model M;
    std::map<uint64_t, std::vector<int32_t>> got[2];
    eng_stats st[2];
    for (int on = 0; on < 2; on++) {
        eng_params p = eng_default_params();
        p.mixed_steps = on;
        got[on] = RunStaggered(M.m, p, &st[on]);
    }
    for (const Staggered &s : kStaggered) EXPECT_EQ(got[1][s.id], got[0][s.id]) << "id " << s.id;
    EXPECT_EQ(st[0].mixed_steps, 0u);
    EXPECT_GE(st[1].mixed_steps, 5u);
    for (const Staggered &s : kStaggered)
        if (s.temperature == 0.f) {
            EXPECT_EQ(got[1][s.id], DirectGreedy(M.m, Prompt(s.plen, (int)s.id), s.max_new)) << s.id;
        }
}

// Four places, mixed steps, a layered unit a step.
eng_params LayeredParams() {
    eng_params p = eng_default_params();
    p.max_sequences = 4;
    p.mixed_steps = true;
    p.prefill_layers = 1;
    return p;
}

// The steps until sequence `id` gives its first token (at most `limit`), sequence 1 (running)
// getting a token in each and, unless `waiting` is -1, that many requests waiting before each.
int StepsToFirstToken(Engine &E, uint64_t id, int limit, int waiting) {
    int steps = 0;
    while (E.results[id].tokens.empty() && steps < limit) {
        const size_t had = E.results[1].tokens.size();
        if (waiting >= 0) {
            EXPECT_EQ(E.Stats().waiting, waiting) << "step " << steps;
        }
        E.Step();
        steps++;
        EXPECT_EQ(E.results[1].tokens.size(), had + 1) << "step " << steps;
    }
    return steps;
}

// On a model loaded in layered units (`layered`: layers, sites or parts), a unit a step: a 10-token prompt submitted
// beside a running sequence gives its first token after `steps` steps, the running sequence a
// token in each, and both the tokens of `whole` (the same checkpoint in whole layers) alone.
void CheckUnitAStep(glm_model *layered, glm_model *whole, int steps_want) {
    const eng_params p = LayeredParams();
    Engine E(layered, p);
    ASSERT_EQ(E.Submit(1, Prompt(5, 1), Req(20)), MT_OK);
    E.Step();
    ASSERT_EQ(E.Submit(2, Prompt(10, 2), Req(4)), MT_OK);
    EXPECT_EQ(StepsToFirstToken(E, 2, 2 * steps_want, -1), steps_want);
    E.RunToEnd();
    EXPECT_EQ(E.results[1].tokens, DirectGreedy(whole, Prompt(5, 1), 20));
    EXPECT_EQ(E.results[2].tokens, DirectGreedy(whole, Prompt(10, 2), 4));
    EXPECT_EQ(E.Stats().cache_bytes_in_use, 0u);
}

// Layered prefill (prefill_layers): the staggered arrivals give the tokens of whole-step chunks
// with one and two layers a step, and chunks ran layered; a running sequence got a token every
// step while a prompt's chunk was in flight, and that prompt's first token came only after the
// steps its layers took. Aborting a sequence whose chunk is in flight leaves the others' tokens
// as they were.
TEST(Engine, LayeredPrefillGivesTheTokensOfWholeSteps) {
    Model M;
    std::map<uint64_t, std::vector<int32_t>> got[3];
    eng_stats st[3];
    for (int k = 0; k < 3; k++) {
        eng_params p = eng_default_params();
        p.mixed_steps = true;
        p.prefill_layers = k;
        got[k] = RunStaggered(M.m, p, &st[k]);
    }
    for (int k = 1; k < 3; k++)
        for (const Staggered &s : kStaggered) EXPECT_EQ(got[k][s.id], got[0][s.id]) << "id " << s.id << " layers " << k;
    EXPECT_EQ(st[0].layered_steps, 0u);
    EXPECT_GE(st[1].layered_steps, 5u);
    EXPECT_GE(st[2].layered_steps, 3u);

    // one running sequence, then a 10-token prompt: a layer a step beside it (tiny_a: 3 steps,
    // its shared-indexer layer rides with the full one before it), a token a step for the first
    CheckUnitAStep(M.m, M.m, 3);
    const eng_params p = LayeredParams();
    // abort a sequence in flight; the one in flight beside it completes and a new prompt follows
    {
        Engine E(M.m, p);
        ASSERT_EQ(E.Submit(1, Prompt(5, 1), Req(20)), MT_OK);
        E.Step();
        ASSERT_EQ(E.Submit(2, Prompt(10, 2), Req(4)), MT_OK);
        ASSERT_EQ(E.Submit(3, Prompt(12, 3), Req(4)), MT_OK);
        E.Step();  // 2 and 3 in flight
        EXPECT_TRUE(E.results[2].tokens.empty());
        ASSERT_EQ(eng_abort(E.e, 2, ENG_FINISH_CANCELLED, "test"), MT_OK);
        ASSERT_EQ(E.Submit(4, Prompt(7, 4), Req(5)), MT_OK);
        E.RunToEnd();
        EXPECT_EQ(E.results[2].finishes, 1);
        EXPECT_EQ(E.results[1].tokens, DirectGreedy(M.m, Prompt(5, 1), 20));
        EXPECT_EQ(E.results[3].tokens, DirectGreedy(M.m, Prompt(12, 3), 4));
        EXPECT_EQ(E.results[4].tokens, DirectGreedy(M.m, Prompt(7, 4), 5));
        EXPECT_EQ(E.Stats().cache_bytes_in_use, 0u);
    }
}

// Layered prefill in sites (a model loaded with layered_sites: prefill_layers counts a layer's
// attention and MLP apart): the staggered arrivals give the tokens of whole-step chunks, and a
// 10-token prompt beside a running sequence takes a site a step (tiny_a: 4 layers, 8 sites, its
// shared-indexer attention riding with the full layer's MLP before it: 6 steps), the running
// sequence getting a token every step.
TEST(Engine, LayeredSitesGiveTheTokensOfWholeSteps) {
    Model M, S(kDir, true);
    std::map<uint64_t, std::vector<int32_t>> got[3];
    eng_stats st[3];
    for (int k = 0; k < 3; k++) {
        eng_params p = eng_default_params();
        p.mixed_steps = true;
        p.prefill_layers = k ? 1 : 0;
        got[k] = RunStaggered(k == 2 ? S.m : M.m, p, &st[k]);
    }
    for (const Staggered &s : kStaggered) EXPECT_EQ(got[2][s.id], got[0][s.id]) << "id " << s.id;
    EXPECT_GT(st[2].layered_steps, st[1].layered_steps);

    CheckUnitAStep(S.m, M.m, 6);
}

// Layered prefill in sites with the MLP site in two parts of the routed experts: the staggered
// arrivals give the tokens of whole-step chunks, and the 10-token prompt beside a running sequence
// takes a unit a step: tiny_a's 12 units, less the three that ride in the step of the full DSA
// layer's attention (its MLP's two parts and the shared-indexer attention after it), are 9 steps,
// the running sequence decoding in each.
TEST(Engine, LayeredExpertPartsGiveTheTokensOfWholeSteps) {
    Model M, S(kDir, true, 2);
    std::map<uint64_t, std::vector<int32_t>> whole, parts;
    eng_stats st;
    eng_params p = eng_default_params();
    p.mixed_steps = true;
    p.prefill_layers = 0;
    whole = RunStaggered(M.m, p, &st);
    p.prefill_layers = 1;
    parts = RunStaggered(S.m, p, &st);
    for (const Staggered &s : kStaggered) EXPECT_EQ(parts[s.id], whole[s.id]) << "id " << s.id;

    CheckUnitAStep(S.m, M.m, 9);
}

// Fine units (sites, expert parts) go a layer a step while a request waits: the group in flight
// holds up its admission. tiny_a in sites with two expert parts (12 units; alone a 10-token prompt
// takes 9 steps beside a running sequence): the prompt's first step runs one unit, then a third
// prompt arrives and waits, and the group runs three units a step (the full DSA layer's step
// also takes the shared-indexer attention after it), so its first token comes 3 steps later; the
// waiting prompt then starts, nobody behind it, a unit a step. Every sequence gets the tokens of
// whole steps, and the running one a token every step.
TEST(Engine, FineLayeredUnitsGoALayerAStepWhileARequestWaits) {
    Model M, S(kDir, true, 2);
    const eng_params p = LayeredParams();
    Engine E(S.m, p);
    ASSERT_EQ(E.Submit(1, Prompt(5, 1), Req(20)), MT_OK);
    E.Step();
    ASSERT_EQ(E.Submit(2, Prompt(10, 2), Req(4)), MT_OK);
    E.Step();
    EXPECT_EQ(E.Stats().layered_steps, 1u);
    ASSERT_EQ(E.Submit(3, Prompt(7, 3), Req(5)), MT_OK);
    EXPECT_EQ(StepsToFirstToken(E, 2, 9, 1), 3);
    EXPECT_EQ(StepsToFirstToken(E, 3, 20, -1), 9);
    E.RunToEnd();
    EXPECT_EQ(E.results[1].tokens, DirectGreedy(M.m, Prompt(5, 1), 20));
    EXPECT_EQ(E.results[2].tokens, DirectGreedy(M.m, Prompt(10, 2), 4));
    EXPECT_EQ(E.results[3].tokens, DirectGreedy(M.m, Prompt(7, 3), 5));
    EXPECT_EQ(E.Stats().cache_bytes_in_use, 0u);
}

// fine_units_max_rows: fine units (a unit a step) only while at most that many rows decode beside
// the group. tiny_a in sites with two expert parts, two running sequences and a 10-token prompt:
// under a limit of 2 the prompt takes a unit a step (9 steps, as beside one row); under a limit
// of 1 a layer's worth of units a step (three: the prompt's 12 units, and the full DSA layer's step
// also takes the shared-indexer attention after it), so 4 steps. Both running sequences decode
// in every step, and every sequence gets the tokens of whole steps.
TEST(Engine, FineLayeredUnitsGoALayerAStepBesideMoreRowsThanTheLimit) {
    Model M, S(kDir, true, 2);
    for (const int lim : { 2, 1 }) {
        eng_params p = LayeredParams();
        p.fine_units_max_rows = lim;
        Engine E(S.m, p);
        ASSERT_EQ(E.Submit(1, Prompt(5, 1), Req(20)), MT_OK);
        ASSERT_EQ(E.Submit(3, Prompt(6, 3), Req(20)), MT_OK);
        E.Step();
        ASSERT_EQ(E.results[3].tokens.size(), 1u) << "limit " << lim;
        ASSERT_EQ(E.Submit(2, Prompt(10, 2), Req(4)), MT_OK);
        size_t had3 = E.results[3].tokens.size();
        int steps = 0;
        while (E.results[2].tokens.empty() && steps < 20) {
            const size_t had1 = E.results[1].tokens.size();
            E.Step();
            steps++;
            EXPECT_EQ(E.results[1].tokens.size(), had1 + 1) << "limit " << lim << ", step " << steps;
            EXPECT_EQ(E.results[3].tokens.size(), ++had3) << "limit " << lim << ", step " << steps;
        }
        EXPECT_EQ(steps, lim == 2 ? 9 : 4) << "limit " << lim;
        E.RunToEnd();
        EXPECT_EQ(E.results[1].tokens, DirectGreedy(M.m, Prompt(5, 1), 20)) << "limit " << lim;
        EXPECT_EQ(E.results[2].tokens, DirectGreedy(M.m, Prompt(10, 2), 4)) << "limit " << lim;
        EXPECT_EQ(E.results[3].tokens, DirectGreedy(M.m, Prompt(6, 3), 20)) << "limit " << lim;
        EXPECT_EQ(E.Stats().cache_bytes_in_use, 0u);
    }
}

// layered_max_waiting: from that many requests waiting for a place on, a step's chunks run every
// layer at once. The staggered arrivals give the same tokens with fewer layered steps; one running
// sequence and two prompts for its one free place: the first prompt's chunk runs whole while the
// other waits (its first token in the next step), and layered (three steps) under a higher limit.
TEST(Engine, LayeredPrefillGivesWayToABacklog) {
    Model M;
    std::map<uint64_t, std::vector<int32_t>> got[2];
    eng_stats st[2];
    for (int lim = 0; lim < 2; lim++) {
        eng_params p = eng_default_params();
        p.mixed_steps = true;
        p.prefill_layers = 1;
        p.layered_max_waiting = lim;
        got[lim] = RunStaggered(M.m, p, &st[lim]);
    }
    for (const Staggered &s : kStaggered) EXPECT_EQ(got[1][s.id], got[0][s.id]) << "id " << s.id;
    EXPECT_GE(st[0].layered_steps, 5u);
    EXPECT_LT(st[1].layered_steps, st[0].layered_steps);

    for (const int lim : { 1, 3 }) {
        eng_params p = eng_default_params();
        p.max_sequences = 2;
        p.mixed_steps = true;
        p.prefill_layers = 1;
        p.layered_max_waiting = lim;
        Engine E(M.m, p);
        ASSERT_EQ(E.Submit(1, Prompt(5, 1), Req(20)), MT_OK);
        E.Step();
        ASSERT_EQ(E.Submit(2, Prompt(10, 2), Req(4)), MT_OK);
        ASSERT_EQ(E.Submit(3, Prompt(12, 3), Req(4)), MT_OK);
        int steps = 0;
        while (E.results[2].tokens.empty()) {
            const size_t had = E.results[1].tokens.size();
            E.Step();
            steps++;
            EXPECT_EQ(E.results[1].tokens.size(), had + 1) << "limit " << lim << ", step " << steps;
            ASSERT_LT(steps, 8);
        }
        EXPECT_EQ(steps, lim == 1 ? 1 : 3) << "limit " << lim;
        EXPECT_TRUE(E.results[3].tokens.empty()) << "limit " << lim;
        E.RunToEnd();
        EXPECT_EQ(E.results[1].tokens, DirectGreedy(M.m, Prompt(5, 1), 20));
        EXPECT_EQ(E.results[2].tokens, DirectGreedy(M.m, Prompt(10, 2), 4));
        EXPECT_EQ(E.results[3].tokens, DirectGreedy(M.m, Prompt(12, 3), 4));
        EXPECT_EQ(E.Stats().cache_bytes_in_use, 0u);
    }
}

// A sequence whose layered chunk is in flight is preempted like any other: in 3 pages of 64, #1
// (60 + 30 tokens) needs its second page while #2's 100-token chunk (two pages) runs its layers
// beside it; #2 gives its pages back, waits, is prefilled again later, and both give the plain
// greedy tokens.
TEST(Engine, LayeredChunkInFlightIsPreempted) {
    Model M;
    mt_error err = { "" };
    ASSERT_EQ(glm_model_set_pools(M.m, 3, 8, &err), MT_OK) << err.msg;
    eng_params p = eng_default_params();
    p.prefix_cache_bytes = 0;
    p.max_sequences = 4;
    p.mixed_steps = true;
    p.prefill_layers = 1;
    Engine E(M.m, p);
    ASSERT_EQ(E.Submit(1, Prompt(60, 1), Req(30)), MT_OK);
    E.Step();  // #1's prompt and first token
    E.Step();
    E.Step();
    ASSERT_EQ(E.Submit(2, Prompt(100, 2), Req(5)), MT_OK);
    E.Step();  // #2's chunk starts, beside #1's row at position 62
    EXPECT_EQ(E.Stats().layered_steps, 1u);
    EXPECT_EQ(glm_model_pages_free(M.m), 0);
    E.Step();  // position 63
    EXPECT_EQ(E.Stats().preemptions, 0u);
    E.Step();  // position 64: a page #2 holds
    EXPECT_EQ(E.Stats().preemptions, 1u);
    EXPECT_TRUE(E.results[2].tokens.empty());
    E.RunToEnd();
    EXPECT_EQ(E.results[1].tokens, DirectGreedy(M.m, Prompt(60, 1), 30));
    EXPECT_EQ(E.results[2].tokens, DirectGreedy(M.m, Prompt(100, 2), 5));
    EXPECT_EQ(glm_model_pages_free(M.m), glm_model_pages_total(M.m));
    EXPECT_EQ(glm_model_slots_free(M.m), glm_model_slots_total(M.m));
}

// Paced steps (itl_target_ms): with a target no step can meet, a long prompt beside a decoding
// sequence goes in ENG_PACE_FLOOR-token chunks, one a step, instead of in one step of the whole
// budget; it still advances every step, and every token is the unpaced run's.
TEST(Engine, PacedStepsMoveLongPromptsInFloorChunks) {
    Model M;
    std::map<uint64_t, std::vector<int32_t>> got[2];
    uint64_t mixed[2] = { 0, 0 }, steps[2] = { 0, 0 };
    for (int paced = 0; paced < 2; paced++) {
        eng_params p = eng_default_params();
        p.max_sequences = 4;
        p.mixed_steps = true;
        p.itl_target_ms = paced ? 1e-6 : 0;
        Engine E(M.m, p);
        ASSERT_EQ(E.Submit(1, Prompt(5, 1), Req(30)), MT_OK);
        E.Step();
        E.Step();  // decode alone: measures the base
        ASSERT_EQ(E.Submit(3, Prompt(20, 3), Req(20)), MT_OK);
        E.Step();  // a short prompt beside a decode row: measures a prompt token's time
        ASSERT_EQ(E.Submit(2, Prompt(300, 2), Req(6)), MT_OK);
        const uint64_t mixed0 = E.Stats().mixed_steps, steps0 = E.Stats().steps;
        while (E.results[2].tokens.empty() && eng_has_work(E.e)) E.Step();
        mixed[paced] = E.Stats().mixed_steps - mixed0;
        steps[paced] = E.Stats().steps - steps0;
        E.RunToEnd();
        for (uint64_t id : { 1, 2, 3 }) got[paced][id] = E.results[id].tokens;
    }
    EXPECT_EQ(mixed[0], 2u);  // to the kept prefix's boundary (256), then the rest
    EXPECT_EQ(steps[0], 2u);
    EXPECT_EQ(mixed[1], 256u / ENG_PACE_FLOOR + 1);  // a floor chunk each step, then the rest
    EXPECT_EQ(steps[1], mixed[1]);
    for (uint64_t id : { 1, 2, 3 }) EXPECT_EQ(got[1][id], got[0][id]) << "id " << id;
    EXPECT_EQ(got[0][1].size(), 30u);
    EXPECT_EQ(got[0][2].size(), 6u);
}

// Mixed steps of max_sequences places and prefill_budget tokens, prompts held up to hold_ms.
eng_params HoldParams(int max_sequences, int prefill_budget, double hold_ms) {
    eng_params p = eng_default_params();
    p.max_sequences = max_sequences;
    p.prefill_budget = prefill_budget;
    p.mixed_steps = true;
    p.prefill_hold_ms = hold_ms;
    return p;
}

// Prefill coalescing (prefill_hold_ms): with more requests waiting than there are free places and
// too few of their prompt tokens ready, admission waits (the running sequences decode meanwhile)
// until the hold time has passed on the engine's clock; the tokens of every request are the
// unheld run's.
TEST(Engine, HeldPrefillWaitsUpToTheHoldTimeAndKeepsTokens) {
    Model M;
    const int plen[] = { 0, 6, 7, 8, 10, 12 }, n_new[] = { 0, 3, 40, 40, 5, 5 };
    std::map<uint64_t, std::vector<int32_t>> got[2];
    for (int hold = 0; hold < 2; hold++) {
        Engine E(M.m, HoldParams(3, 64, hold ? 50 : 0));
        // three running (the first ends after 3 tokens), then two waiting with short prompts (10
        // and 12 tokens, under half the budget)
        for (uint64_t id = 1; id <= 5; id++) ASSERT_EQ(E.Submit(id, Prompt(plen[id], (int)id), Req(n_new[id])), MT_OK);
        while (E.results[1].finishes == 0) E.Step();
        // a place is free, two wait for it: held, decode steps go on without a prompt
        const uint64_t held0 = E.Stats().held_steps;
        const size_t had2 = E.results[2].tokens.size(), had3 = E.results[3].tokens.size();
        for (int i = 0; i < 3; i++) {
            E.Step();
            E.now += 10;
        }
        EXPECT_EQ(E.results[2].tokens.size(), had2 + 3);  // the running ones decode meanwhile
        EXPECT_EQ(E.results[3].tokens.size(), had3 + 3);
        if (hold) {
            EXPECT_EQ(E.Stats().held_steps - held0, 3u);
            EXPECT_TRUE(E.results[4].tokens.empty());
            EXPECT_EQ(E.Stats().running, 2);
            E.now += 20;  // 50 ms since the hold began: the prompt goes in
            E.Step();
            EXPECT_EQ(E.results[4].tokens.size(), 1u);
            EXPECT_EQ(E.Stats().held_steps - held0, 3u);
        } else {
            EXPECT_EQ(E.Stats().held_steps, 0u);
            EXPECT_FALSE(E.results[4].tokens.empty());
        }
        E.RunToEnd();
        for (uint64_t id = 1; id <= 5; id++) got[hold][id] = E.results[id].tokens;
    }
    for (uint64_t id = 1; id <= 5; id++) {
        EXPECT_EQ(got[1][id], got[0][id]) << "id " << id;
        EXPECT_EQ(got[1][id], DirectGreedy(M.m, Prompt(plen[id], (int)id), n_new[id])) << "id " << id;
    }
}

// Prefill coalescing releases at once when the waiting prompts that fit the free places hold half
// a budget of tokens: nothing is held, however long the hold time.
TEST(Engine, HeldPrefillGoesOnWhenHalfABudgetIsReady) {
    Model M;
    Engine E(M.m, HoldParams(2, 64, 1e6));
    ASSERT_EQ(E.Submit(1, Prompt(6, 1), Req(3)), MT_OK);
    ASSERT_EQ(E.Submit(2, Prompt(7, 2), Req(30)), MT_OK);
    ASSERT_EQ(E.Submit(3, Prompt(40, 3), Req(5)), MT_OK);  // 40 tokens: more than half of 64
    ASSERT_EQ(E.Submit(4, Prompt(8, 4), Req(5)), MT_OK);
    while (E.results[1].finishes == 0) E.Step();
    E.Step();
    EXPECT_EQ(E.Stats().held_steps, 0u);
    EXPECT_EQ(E.results[3].tokens.size(), 1u);
    E.RunToEnd();
    EXPECT_EQ(E.results[3].tokens, DirectGreedy(M.m, Prompt(40, 3), 5));
    EXPECT_EQ(E.results[4].tokens, DirectGreedy(M.m, Prompt(8, 4), 5));
}

// A prompt under way is never held, and nothing is held while one runs: its chunks take the
// same steps as without the hold, even with a place free and short prompts waiting for it.
TEST(Engine, HeldPrefillNeverHoldsAPromptUnderWay) {
    Model M;
    int first_token_step[2] = { 0, 0 };
    std::map<uint64_t, std::vector<int32_t>> got[2];
    for (int hold = 0; hold < 2; hold++) {
        Engine E(M.m, HoldParams(3, 16, hold ? 1e6 : 0));
        // 1 ends early and frees a place while 3's 200-token prompt is still under way; 4 and 5
        // (5 tokens each, under half the budget) wait for it
        const int plen[] = { 0, 6, 7, 200, 5, 5 }, n_new[] = { 0, 3, 40, 5, 5, 5 };
        for (uint64_t id = 1; id <= 5; id++) ASSERT_EQ(E.Submit(id, Prompt(plen[id], (int)id), Req(n_new[id])), MT_OK);
        for (int step = 1; E.results[3].tokens.empty() && step < 100; step++) {
            E.Step();
            first_token_step[hold] = step;
        }
        EXPECT_GT(E.results[1].finishes, 0);  // the place was free while the prompt ran
        EXPECT_EQ(E.Stats().held_steps, 0u);
        E.RunToEnd();
        for (uint64_t id = 1; id <= 5; id++) got[hold][id] = E.results[id].tokens;
    }
    EXPECT_EQ(first_token_step[1], first_token_step[0]);
    for (uint64_t id = 1; id <= 5; id++) EXPECT_EQ(got[1][id], got[0][id]) << "id " << id;
}

// Prefix reuse: a prompt that starts with a kept prefix copies its state instead of prefilling it,
// and its tokens equal a cold run's; a cache too small for two prefixes evicts the older one, and
// everything kept is accounted and freed.
TEST(Engine, PrefixReuseGivesColdTokensAndEvicts) {
    Model M;
    std::vector<int32_t> shared = Prompt(100, 42), a = shared, b = shared;
    for (int i = 0; i < 10; i++) a.push_back((i * 13 + 1) % 250);
    for (int i = 0; i < 7; i++) b.push_back((i * 29 + 5) % 250);
    {
        Engine E(M.m);
        ASSERT_EQ(E.Submit(1, a, Req(12)), MT_OK);
        E.RunToEnd();
        EXPECT_EQ(E.Stats().prefix_misses, 1u);
        EXPECT_EQ(E.Stats().prefix_entries, 1);  // kept at 64, the last block boundary of 110 - 1
        EXPECT_GT(E.Stats().prefix_cache_bytes, 0u);
        EXPECT_EQ(eng_prefix_pages(E.e), 1);     // its one page, which only it holds
        ASSERT_EQ(E.Submit(2, b, Req(12)), MT_OK);
        E.Step();
        EXPECT_EQ(eng_prefix_pages(E.e), 0);     // shared with the running hit: the hit's page
        E.RunToEnd();
        EXPECT_EQ(eng_prefix_pages(E.e), 1);
        EXPECT_EQ(E.Stats().prefix_hits, 1u);
        EXPECT_EQ(E.results[1].tokens, DirectGreedy(M.m, a, 12));
        EXPECT_EQ(E.results[2].tokens, DirectGreedy(M.m, b, 12));  // the hit equals a cold run
        EXPECT_EQ(E.Stats().cache_bytes_in_use, 0u);
        // the kept 64-token prefix holds one page (shared with the hit while it ran) and one slot
        EXPECT_EQ(glm_model_pages_free(M.m), glm_model_pages_total(M.m) - 1);
    }
    EXPECT_EQ(glm_model_pages_free(M.m), glm_model_pages_total(M.m));
    EXPECT_EQ(glm_model_slots_free(M.m), glm_model_slots_total(M.m));
    {
        eng_params p = eng_default_params();
        p.prefix_cache_bytes = 0;  // off: every request prefills in full
        Engine E(M.m, p);
        ASSERT_EQ(E.Submit(1, a, Req(12)), MT_OK);
        ASSERT_EQ(E.Submit(2, b, Req(12)), MT_OK);
        E.RunToEnd();
        EXPECT_EQ(E.Stats().prefix_hits + E.Stats().prefix_misses, 0u);
        EXPECT_EQ(E.Stats().prefix_entries, 0);
        EXPECT_EQ(E.results[2].tokens, DirectGreedy(M.m, b, 12));
    }
    {
        // room for one 64-token prefix only: three distinct prompts keep evicting
        glm_seq *probe = nullptr;
        mt_error err{};
        ASSERT_EQ(glm_seq_new(M.m, 64, &probe, &err), MT_OK);
        ASSERT_EQ(glm_seq_reserve(probe, 64, &err), MT_OK);  // a 64-token snapshot: its slot and one page
        eng_params p = eng_default_params();
        p.prefix_cache_bytes = glm_seq_bytes(probe) + 1;
        glm_seq_free(probe);
        Engine E(M.m, p);
        for (uint64_t id = 1; id <= 3; id++) {
            ASSERT_EQ(E.Submit(id, Prompt(80, (int)id * 7), Req(3)), MT_OK);
            E.RunToEnd();
            EXPECT_EQ(E.Stats().prefix_entries, 1) << id;
            EXPECT_LE(E.Stats().prefix_cache_bytes, p.prefix_cache_bytes) << id;
        }
        EXPECT_EQ(E.Stats().prefix_misses, 3u);
        ASSERT_EQ(E.Submit(4, Prompt(80, 21), Req(3)), MT_OK);  // id 3's prompt: still kept, a hit
        E.RunToEnd();
        EXPECT_EQ(E.Stats().prefix_hits, 1u);
        EXPECT_EQ(E.results[4].tokens, E.results[3].tokens);
        EXPECT_EQ(E.Stats().cache_bytes_in_use, 0u);
        EXPECT_EQ(glm_model_slots_free(M.m), glm_model_slots_total(M.m) - 1);  // the kept prefix's slot
    }
    // every page and slot is back once the engine (and its kept prefixes) is gone
    EXPECT_EQ(glm_model_pages_free(M.m), glm_model_pages_total(M.m));
    EXPECT_EQ(glm_model_slots_free(M.m), glm_model_slots_total(M.m));
}

// The cache budget: requests wait for room instead of failing; never more state than the budget
// is held at once; every request still completes with plain greedy tokens; a request that could
// never fit is refused at submit with both sizes in the message.
TEST(Engine, CacheBudgetQueuesInsteadOfFailing) {
    Model M;
    eng_params p = eng_default_params();
    p.prefix_cache_bytes = 0;
    p.cache_budget_bytes = 2 * glm_model_seq_bytes(M.m, 20 + 10) + 1;  // two 30-token sequences
    Engine E(M.m, p);
    for (uint64_t id = 1; id <= 5; id++) ASSERT_EQ(E.Submit(id, Prompt(20, (int)id), Req(10)), MT_OK);
    int max_running = 0;
    while (eng_has_work(E.e)) {
        E.Step();
        max_running = std::max(max_running, E.Stats().running);
        ASSERT_LE(E.Stats().cache_bytes_in_use, p.cache_budget_bytes);
    }
    EXPECT_EQ(max_running, 2);
    for (uint64_t id = 1; id <= 5; id++) {
        EXPECT_EQ(E.results[id].reason, ENG_FINISH_LENGTH) << id;
        EXPECT_EQ(E.results[id].tokens, DirectGreedy(M.m, Prompt(20, (int)id), 10)) << id;
    }
    std::string msg;
    EXPECT_EQ(E.Submit(9, Prompt(200, 1), Req(100), 0, &msg), MT_ERR_FULL);
    EXPECT_NE(msg.find("cache budget"), std::string::npos) << msg;
}

// Pools: with too few cache pages for every running sequence's growth, a sequence that
// needs a new page preempts the newest running one (which gives its pages and slot back, waits
// at the head of the queue, is prefilled again from its prompt and generated tokens, and decodes
// on). Every request still completes with the plain greedy tokens, preemptions happened, and the
// pools are whole again at the end; a request longer than the whole pool is refused at submit.
// With mixed steps and layered prefill (one layer a step) the same holds, sequences whose chunk
// is in flight being preempted too.
class PoolShortage : public ::testing::TestWithParam<int> {};

TEST_P(PoolShortage, PreemptsAndResumes) {
    Model M;
    const int n_req = 6, prompt_len = 40, new_tokens = 60;
    std::vector<std::vector<int32_t>> want;
    for (int id = 1; id <= n_req; id++) want.push_back(DirectGreedy(M.m, Prompt(prompt_len, id), new_tokens));
    mt_error err = { "" };
    const int page = glm_model_page_tokens(M.m);
    ASSERT_EQ(page, 64);
    ASSERT_EQ(glm_model_set_pools(M.m, 5, 8, &err), MT_OK) << err.msg; // 5 pages: 2 full sequences
    eng_params p = eng_default_params();
    p.prefix_cache_bytes = 0;
    p.max_sequences = 4;
    p.mixed_steps = GetParam() > 0;
    p.prefill_layers = GetParam();
    Engine E(M.m, p);
    for (int id = 1; id <= n_req; id++) ASSERT_EQ(E.Submit(id, Prompt(prompt_len, id), Req(new_tokens)), MT_OK);
    int steps = 0;
    while (eng_has_work(E.e) && steps < 5000) {
        E.Step();
        steps++;
        ASSERT_GE(glm_model_pages_free(M.m), 0);
    }
    ASSERT_FALSE(eng_has_work(E.e));
    for (int id = 1; id <= n_req; id++) {
        EXPECT_EQ(E.results[id].reason, ENG_FINISH_LENGTH) << id << ": " << E.results[id].message;
        EXPECT_EQ(E.results[id].tokens, want[id - 1]) << id;
    }
    EXPECT_GT(E.Stats().preemptions, 0u);
    EXPECT_EQ(glm_model_pages_free(M.m), glm_model_pages_total(M.m));
    EXPECT_EQ(glm_model_slots_free(M.m), glm_model_slots_total(M.m));
    printf("6 requests of %d + %d tokens in 5 pages of %d: %d steps, %llu preemptions\n", prompt_len, new_tokens, page,
           steps, (unsigned long long)E.Stats().preemptions);
    std::string msg;
    EXPECT_EQ(E.Submit(9, Prompt(300, 1), Req(100), 0, &msg), MT_ERR_FULL);
    EXPECT_NE(msg.find("cache pages"), std::string::npos) << msg;
    if (GetParam() > 0) {
        EXPECT_GT(E.Stats().layered_steps, 0u);
    }
}
INSTANTIATE_TEST_SUITE_P(Engine, PoolShortage, ::testing::Values(0, 1));

// A model with PLE memories (tiny_ple: on a KDA and a DSA layer), whose history and conv state
// move only through the layers' aux snapshots: a prefix hit and preempted, re-prefilled sequences
// give exactly the tokens of plain greedy runs.
TEST(Engine, PleStateSurvivesPrefixReuseAndPreemption) {
    Model M("tests/fixtures/tiny_ple");
    auto prompt = [](int n, int salt) {
        std::vector<int32_t> p;
        for (int i = 0; i < n; i++) p.push_back((i * 37 + salt * 101 + 7) % 256);
        return p;
    };
    std::vector<int32_t> a = prompt(100, 42), b = a;
    for (int i = 0; i < 10; i++) a.push_back((i * 13 + 1) % 250);
    for (int i = 0; i < 7; i++) b.push_back((i * 29 + 5) % 250);
    {
        Engine E(M.m);
        ASSERT_EQ(E.Submit(1, a, Req(12)), MT_OK);
        E.RunToEnd();
        ASSERT_EQ(E.Submit(2, b, Req(12)), MT_OK);
        E.RunToEnd();
        EXPECT_EQ(E.Stats().prefix_hits, 1u);
        EXPECT_EQ(E.results[1].tokens, DirectGreedy(M.m, a, 12));
        EXPECT_EQ(E.results[2].tokens, DirectGreedy(M.m, b, 12));
    }
    const int n_req = 6, prompt_len = 40, new_tokens = 60;
    std::vector<std::vector<int32_t>> want;
    for (int id = 1; id <= n_req; id++) want.push_back(DirectGreedy(M.m, prompt(prompt_len, id), new_tokens));
    mt_error err = { "" };
    ASSERT_EQ(glm_model_set_pools(M.m, 5, 8, &err), MT_OK) << err.msg;
    eng_params p = eng_default_params();
    p.prefix_cache_bytes = 0;
    p.max_sequences = 4;
    Engine E(M.m, p);
    for (int id = 1; id <= n_req; id++) ASSERT_EQ(E.Submit(id, prompt(prompt_len, id), Req(new_tokens)), MT_OK);
    for (int steps = 0; eng_has_work(E.e) && steps < 5000; steps++) E.Step();
    ASSERT_FALSE(eng_has_work(E.e));
    for (int id = 1; id <= n_req; id++) EXPECT_EQ(E.results[id].tokens, want[id - 1]) << id;
    EXPECT_GT(E.Stats().preemptions, 0u);
}

// The other policy: with preempt off a sequence is admitted only with pages for its whole length,
// so the same shortage queues requests instead (no preemption, at most 2 running in 5 pages).
TEST(Engine, PoolShortageQueuesWhenPreemptionIsOff) {
    Model M;
    std::vector<std::vector<int32_t>> want;
    for (int id = 1; id <= 4; id++) want.push_back(DirectGreedy(M.m, Prompt(40, id), 60));
    mt_error err = { "" };
    ASSERT_EQ(glm_model_set_pools(M.m, 5, 8, &err), MT_OK) << err.msg;
    eng_params p = eng_default_params();
    p.prefix_cache_bytes = 0;
    p.max_sequences = 4;
    p.preempt = false;
    Engine E(M.m, p);
    for (int id = 1; id <= 4; id++) ASSERT_EQ(E.Submit(id, Prompt(40, id), Req(60)), MT_OK);
    int max_running = 0;
    while (eng_has_work(E.e)) {
        E.Step();
        max_running = std::max(max_running, E.Stats().running);
    }
    for (int id = 1; id <= 4; id++) EXPECT_EQ(E.results[id].tokens, want[id - 1]) << id;
    EXPECT_EQ(E.Stats().preemptions, 0u);
    EXPECT_EQ(max_running, 2);
    EXPECT_EQ(glm_model_pages_free(M.m), glm_model_pages_total(M.m));
}

// More running sequences than one model pass takes (a model of 4 scratch rows, 6 sequences):
// the engine decodes them in passes, and a refused pass would fall back for its own rows only;
// every stream equals decoding alone (a fallback over all rows once fed tokens twice).
TEST(Engine, BatchesLargerThanOnePassDecodeInPasses) {
    mt_backend *be = mt_cpu_backend_new(1);
    glm_model_params mp = glm_model_default_params();
    mp.prefill_chunk = 4;
    glm_model *m = nullptr;
    mt_error err = { "" };
    ASSERT_EQ(glm_model_load(kDir, be, &mp, &m, &err), MT_OK) << err.msg;
    ASSERT_EQ(glm_model_batch_rows(m), 4);
    std::vector<std::vector<int32_t>> want;
    for (int id = 1; id <= 6; id++) want.push_back(DirectGreedy(m, Prompt(5 + id, id), 8));
    {
        Engine E(m);
        for (int id = 1; id <= 6; id++) ASSERT_EQ(E.Submit(id, Prompt(5 + id, id), Req(8)), MT_OK);
        E.RunToEnd();
        for (int id = 1; id <= 6; id++) EXPECT_EQ(E.results[id].tokens, want[id - 1]) << id;
    }
    glm_model_free(m);
    mt_backend_free(be);
}

// A model with no DSA layer has no cache pages to run out of: requests are admitted and served
// (the page checks apply only to a model with paged layers).
TEST(Engine, ModelWithoutPagedLayersServes) {
    mt_backend *be = mt_cpu_backend_new(1);
    glm_config c;
    mt_error err = { "" };
    ASSERT_EQ(glm_config_preset("tiny", &c, &err), MT_OK) << err.msg;
    for (int i = 0; i < c.num_hidden_layers; i++) c.layer_types[i] = GLM_MIXER_KDA;
    glm_model *m = nullptr;
    ASSERT_EQ(glm_model_new_random(&c, 3, be, nullptr, &m, &err), MT_OK) << err.msg;
    ASSERT_EQ(glm_model_page_bytes(m), 0u);
    ASSERT_EQ(glm_model_set_pools(m, 1, 8, &err), MT_OK) << err.msg;
    auto small = [](int n, int seed) { /* the preset's vocabulary is 256 */
        std::vector<int32_t> p = Prompt(n, seed);
        for (int32_t &t : p) t %= 256;
        return p;
    };
    const std::vector<int32_t> want = DirectGreedy(m, small(7, 1), 20);
    {
        Engine E(m);
        ASSERT_EQ(E.Submit(1, small(7, 1), Req(20)), MT_OK);
        ASSERT_EQ(E.Submit(2, small(90, 2), Req(100)), MT_OK);
        E.RunToEnd();
        EXPECT_EQ(E.results[1].tokens, want);
        EXPECT_EQ(E.results[2].reason, ENG_FINISH_LENGTH);
    }
    glm_model_free(m);
    mt_backend_free(be);
}

TEST(Engine, OneTokenRequestsFinishAtPrefill) {
    Model M;
    Engine E(M.m);
    const std::vector<int32_t> prompt = Prompt(6, 9);
    ASSERT_EQ(E.Submit(1, prompt, Req(1)), MT_OK);
    E.Step();
    EXPECT_FALSE(eng_has_work(E.e));
    EXPECT_EQ(E.results[1].tokens, DirectGreedy(M.m, prompt, 1));
    EXPECT_EQ(E.results[1].reason, ENG_FINISH_LENGTH);
    EXPECT_EQ(E.Stats().cache_bytes_in_use, 0u);
}

TEST(Engine, ParamsAreChecked) {
    Model M;
    eng_params p = eng_default_params();
    p.max_sequences = 0;
    eng_engine *e = nullptr;
    mt_error err = { "" };
    EXPECT_EQ(eng_new(glm_model_as_model(M.m), &p, nullptr, &e, &err), MT_ERR_INVALID);
    EXPECT_EQ(e, nullptr);
    EXPECT_NE(std::string(err.msg).find("max_sequences"), std::string::npos);
    eng_free(nullptr);
}

}  // namespace
