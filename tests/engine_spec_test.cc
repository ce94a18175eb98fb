// Speculative decoding in the engine (eng_params.spec_tokens) on the CPU, with the MTP block of
// tests/fixtures/mtp_a as the drafter: greedy output with K = 1..4 drafts a step is token for
// token the output with K = 0, for many prompts at once, with prefix reuse and preemption forced,
// and so is greedy with penalties (speculative sampling's path); seeded sampling is reproducible;
// forced acceptance (the drafter proposes the target's own next token) and forced rejection (it
// proposes any other) leave the output the same, which proves both the commit and the rollback
// of every layer's state; the counts of drafted and accepted tokens are reported. With mixed steps,
// the same holds while prompts are prefilled in chunks beside the speculating sequences, and a
// step's verifies, decode rows and prompt chunks go to the model in one call.
// The greedy and forced checks run again on a random model with PLE memories and an MTP block
// (K = 1..3).
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "tests/spec_engine_run.h"
#include "worker/engine/engine.h"
#include "worker/model/glm/glm_model.h"

namespace {

const char kDir[] = "tests/fixtures/mtp_a";  // tiny_a (vocab 300, no EOS) with an MTP block
const int kMaxNew = 96;

using Out = SpecOut;
using Outputs = SpecRun;

// mixed: every other request opts out of speculation. mixed_steps: eng_params.mixed_steps, with
// prompts fed in chunks of at most budget tokens (0: the default budget).
Outputs Generate(glm_model *m, int k, int max_seqs, int pages, Force force = Force::kNone, const Outputs *ref = nullptr,
                 const eng_sample_params *sampling = nullptr, bool logprobs = false, int n_prompts = 12,
                 bool mixed = false, bool mixed_steps = false, int budget = 0, int layers = 0) {
    mt_error err = { "" };
    EXPECT_EQ(glm_model_set_pools(m, pages, 64, &err), MT_OK) << err.msg;
    eng_params p = eng_default_params();
    p.max_sequences = max_seqs;
    p.prefix_block = 16;
    p.spec_max_batch = 0;
    p.mixed_steps = mixed_steps;
    p.prefill_layers = layers;
    if (budget > 0) p.prefill_budget = budget;
    std::vector<SpecRequest> reqs;
    const auto prompts = SpecPrompts(n_prompts);
    for (size_t i = 0; i < prompts.size(); i++) {
        SpecRequest q;
        q.prompt = prompts[i];
        q.max_new = kMaxNew;
        q.no_speculation = mixed && i % 2 == 1;
        q.sampling = sampling;
        q.seed = 1000 + i;
        q.logprobs = logprobs;
        reqs.push_back(q);
    }
    return RunSpec(m, p, k, reqs, force, ref);
}

class Spec : public ::testing::Test {
  protected:
    void SetUp() override {
        be_ = mt_cpu_backend_new(1);
        glm_model_params p = glm_model_default_params();
        p.mtp = true;
        p.verify_seqs = 3;  // groups of three verifies in one call, and partial groups
        mt_error err = { "" };
        ASSERT_EQ(glm_model_load(kDir, be_, &p, &m_, &err), MT_OK) << err.msg;
    }
    void TearDown() override {
        glm_model_free(m_);
        mt_backend_free(be_);
    }
    void ExpectSame(const Outputs &a, const Outputs &b, const char *what) {
        ASSERT_EQ(a.out.size(), b.out.size()) << what;
        for (const auto &[id, o] : a.out) {
            const Out &r = b.out.at(id);
            EXPECT_EQ(o.finishes, 1) << what << " id " << id;
            EXPECT_EQ(o.reason, ENG_FINISH_LENGTH) << what << " id " << id;
            EXPECT_EQ(o.tokens, r.tokens) << what << " id " << id;
        }
    }
    mt_backend *be_ = nullptr;
    glm_model *m_ = nullptr;
};

// K = 1..4 against K = 0, at batch 1 and 12, with roomy pools and with pools small enough that
// running sequences are preempted; prefixes are reused in every run.
TEST_F(Spec, GreedyOutputEqualsNoSpeculation) {
    for (int batch : { 1, 12 }) {
        for (int pages : { 256, 14 }) {
            const Outputs ref = Generate(m_, 0, batch, pages);
            EXPECT_EQ(ref.stats.spec_steps, 0u);
            for (int k = 1; k <= ENG_SPEC_MAX; k++) {
                const Outputs r = Generate(m_, k, batch, pages);
                char what[96];
                snprintf(what, sizeof what, "K=%d batch %d pages %d", k, batch, pages);
                ExpectSame(r, ref, what);
                EXPECT_GT(r.stats.spec_steps, 0u) << what;
                EXPECT_GT(r.stats.prefix_hits, 0u) << what;
                EXPECT_EQ(r.stats.prefix_hits, ref.stats.prefix_hits) << what;
                if (pages == 14 && batch > 1) {
                    EXPECT_GT(r.stats.preemptions, 0u) << what;
                }
                printf("%s: %llu steps, %llu spec steps, drafted %llu, accepted %llu, %llu preemptions, %llu prefix hits\n",
                       what, (unsigned long long)r.stats.steps, (unsigned long long)r.stats.spec_steps,
                       (unsigned long long)r.stats.draft_tokens, (unsigned long long)r.stats.accepted_tokens,
                       (unsigned long long)r.stats.preemptions, (unsigned long long)r.stats.prefix_hits);
            }
        }
    }
}

// Forced acceptance: every draft is accepted (the commit path), in fewer steps; forced rejection:
// none is (the rollback path). The output is K = 0's either way.
TEST_F(Spec, ForcedAcceptanceAndRejection) {
    const Outputs ref = Generate(m_, 0, 12, 256);
    for (int k = 1; k <= ENG_SPEC_MAX; k++) {
        const Outputs acc = Generate(m_, k, 12, 256, Force::kAccept, &ref);
        ExpectSame(acc, ref, "forced acceptance");
        const Outputs rej = Generate(m_, k, 12, 256, Force::kReject, &ref);
        ExpectSame(rej, ref, "forced rejection");
        for (const auto &[id, o] : acc.out) {
            EXPECT_GT(o.drafted, 0) << "K=" << k << " id " << id;
            EXPECT_EQ(o.accepted, o.drafted) << "K=" << k << " id " << id;
            EXPECT_EQ(rej.out.at(id).accepted, 0) << "K=" << k << " id " << id;
            EXPECT_GT(rej.out.at(id).drafted, 0) << "K=" << k << " id " << id;
        }
        EXPECT_LT(acc.stats.steps, ref.stats.steps) << "K=" << k;
        ExpectSpecCounts(acc, Force::kAccept, "forced acceptance, K=" + std::to_string(k));
        ExpectSpecCounts(rej, Force::kReject, "forced rejection, K=" + std::to_string(k));
    }
}

// Speculating and plain sequences in the same steps (every other request opts out), at batch
// sizes around the decode buckets' edges (the plain rows go through batched decode together).
TEST_F(Spec, MixedBatchesAtBucketEdges) {
    for (int n : { 15, 16, 17, 33 }) {
        const Outputs ref = Generate(m_, 0, n, 512, Force::kNone, nullptr, nullptr, false, n);
        const Outputs r = Generate(m_, 3, n, 512, Force::kNone, nullptr, nullptr, false, n, true);
        char what[48];
        snprintf(what, sizeof what, "batch %d, half opted out", n);
        ExpectSame(r, ref, what);
        EXPECT_GT(r.stats.spec_steps, 0u) << what;
        for (const auto &[id, o] : r.out) EXPECT_EQ(o.drafted == 0, (id - 1) % 2 == 1) << what << " id " << id;
    }
}

// Greedy with penalties goes through speculative sampling's path (one-hot distributions, the
// drafts counted as generated tokens by the penalties): still K = 0's tokens exactly, and the
// reported logprobs are the target's.
TEST_F(Spec, PenalisedGreedyEqualsNoSpeculation) {
    eng_sample_params sp = eng_sample_default_params();
    sp.repetition_penalty = 1.3f;
    sp.presence_penalty = 0.5f;
    sp.frequency_penalty = 0.2f;
    const Outputs ref = Generate(m_, 0, 12, 256, Force::kNone, nullptr, &sp, true);
    for (int k = 1; k <= ENG_SPEC_MAX; k++) {
        const Outputs r = Generate(m_, k, 12, 256, Force::kNone, nullptr, &sp, true);
        ExpectSame(r, ref, "penalised greedy");
        EXPECT_GT(r.stats.spec_steps, 0u);
        for (const auto &[id, o] : r.out) {
            const std::vector<float> &l = ref.out.at(id).logprobs;
            ASSERT_EQ(o.logprobs.size(), l.size());
            for (size_t i = 0; i < l.size(); i++) EXPECT_NEAR(o.logprobs[i], l[i], 1e-4) << "id " << id << " token " << i;
        }
    }
}

// Sampled requests decode speculatively too: a seed gives the same tokens again (with the same
// K), every stream is whole, and the logprobs are log-probabilities.
TEST_F(Spec, SampledRunsAreReproducible) {
    eng_sample_params sp = eng_sample_default_params();
    sp.temperature = 0.9f;
    sp.top_p = 0.95f;
    for (int k : { 2, 4 }) {
        const Outputs a = Generate(m_, k, 12, 256, Force::kNone, nullptr, &sp, true);
        const Outputs b = Generate(m_, k, 12, 256, Force::kNone, nullptr, &sp, true);
        ExpectSame(a, b, "seeded sampling");
        EXPECT_GT(a.stats.spec_steps, 0u);
        for (const auto &[id, o] : a.out)
            for (float lp : o.logprobs) EXPECT_LE(lp, 0.f) << "id " << id;
    }
}

// A request may opt out; a model without a drafter turns speculation off.
TEST_F(Spec, OptOutAndNoDrafter) {
    mt_error err = { "" };
    eng_params p = eng_default_params();
    p.spec_tokens = 2;
    std::vector<int> drafted;
    eng_callbacks cb = {};
    cb.user = &drafted;
    cb.on_finished = [](void *u, uint64_t, const eng_finish_info *f) {
        static_cast<std::vector<int> *>(u)->push_back(f->draft_tokens);
    };
    eng_engine *e = nullptr;
    ASSERT_EQ(eng_new(glm_model_as_model(m_), &p, &cb, &e, &err), MT_OK) << err.msg;
    const std::vector<int32_t> prompt = { 1, 2, 3, 4, 5 };
    eng_request r = eng_default_request();
    r.prompt = prompt.data();
    r.n_prompt = 5;
    r.max_new_tokens = 12;
    r.no_speculation = true;
    ASSERT_EQ(eng_submit(e, 1, &r, 0, &err), MT_OK) << err.msg;
    while (eng_has_work(e)) ASSERT_EQ(eng_step(e, nullptr), MT_OK);
    eng_free(e);
    ASSERT_EQ(drafted.size(), 1u);
    EXPECT_EQ(drafted[0], 0);

    glm_model *plain = nullptr;
    ASSERT_EQ(glm_model_load("tests/fixtures/tiny_a", be_, nullptr, &plain, &err), MT_OK) << err.msg;
    ASSERT_EQ(eng_new(glm_model_as_model(plain), &p, &cb, &e, &err), MT_OK) << err.msg;
    r.no_speculation = false;
    ASSERT_EQ(eng_submit(e, 2, &r, 0, &err), MT_OK) << err.msg;
    while (eng_has_work(e)) ASSERT_EQ(eng_step(e, nullptr), MT_OK);
    eng_stats st;
    eng_get_stats(e, &st);
    EXPECT_EQ(st.spec_steps, 0u);
    eng_free(e);
    glm_model_free(plain);

    p.spec_tokens = ENG_SPEC_MAX + 1;
    EXPECT_EQ(eng_new(glm_model_as_model(m_), &p, &cb, &e, &err), MT_ERR_INVALID);
}

// Layered prefill beside verifies: the chunks run a layer a step in the calls that carry the
// verifies and plain decode rows (the drafter follows a chunk when its last layer runs); greedy
// output with K = 1 and 3 is K = 0's, with roomy pools and with preemption forced.
TEST_F(Spec, LayeredPrefillEqualsNoSpeculation) {
    const Outputs ref = Generate(m_, 0, 6, 256);
    for (int pages : { 256, 14 }) {
        for (int k : { 1, 3 }) {
            const Outputs r = Generate(m_, k, 12, pages, Force::kNone, nullptr, nullptr, false, 12, true, true, 8, 1);
            char what[96];
            snprintf(what, sizeof what, "layered prefill, K=%d pages %d", k, pages);
            ExpectSame(r, ref, what);
            EXPECT_GT(r.stats.layered_steps, 0u) << what;
            EXPECT_GT(r.stats.spec_mixed_steps, 0u) << what;
            if (pages == 14) {
                EXPECT_GT(r.stats.preemptions, 0u) << what;
            }
        }
    }
}

// With mixed steps and prompts fed 8 tokens a step, the verifies ride in one model call with the
// plain decode rows (every other request opts out) and the chunks of the prompts admitted behind
// them: greedy output with K = 1..4 is K = 0's without mixed steps, token for token, with roomy
// pools and with preemption forced, prefixes reused; and with forced acceptance and rejection.
TEST_F(Spec, MixedStepsEqualNoSpeculation) {
    const Outputs ref = Generate(m_, 0, 6, 256);
    for (int pages : { 256, 14 }) {
        const Outputs ref_mixed = Generate(m_, 0, 12, pages, Force::kNone, nullptr, nullptr, false, 12, true, true, 8);
        ExpectSame(ref_mixed, ref, "K=0 mixed steps");
        for (int k = 1; k <= ENG_SPEC_MAX; k++) {
            const Outputs r = Generate(m_, k, 12, pages, Force::kNone, nullptr, nullptr, false, 12, true, true, 8);
            char what[96];
            snprintf(what, sizeof what, "mixed steps, K=%d pages %d", k, pages);
            ExpectSame(r, ref, what);
            EXPECT_GT(r.stats.spec_mixed_steps, 0u) << what;
            EXPECT_GT(r.stats.mixed_steps, 0u) << what;
            EXPECT_GT(r.stats.prefix_hits, 0u) << what;
            EXPECT_EQ(r.stats.prefix_hits, ref_mixed.stats.prefix_hits) << what;
            if (pages == 14) {
                EXPECT_GT(r.stats.preemptions, 0u) << what;
            }
            printf("%s: %llu steps, %llu with verifies in the mixed call, %llu spec steps, drafted %llu, accepted %llu, "
                   "%llu preemptions\n",
                   what, (unsigned long long)r.stats.steps, (unsigned long long)r.stats.spec_mixed_steps,
                   (unsigned long long)r.stats.spec_steps, (unsigned long long)r.stats.draft_tokens,
                   (unsigned long long)r.stats.accepted_tokens, (unsigned long long)r.stats.preemptions);
        }
    }
    for (int k : { 1, 3 }) {
        const Outputs acc = Generate(m_, k, 6, 256, Force::kAccept, &ref, nullptr, false, 12, true, true, 8);
        ExpectSame(acc, ref, "mixed steps, forced acceptance");
        const Outputs rej = Generate(m_, k, 6, 256, Force::kReject, &ref, nullptr, false, 12, true, true, 8);
        ExpectSame(rej, ref, "mixed steps, forced rejection");
        EXPECT_GT(acc.stats.spec_mixed_steps, 0u);
        EXPECT_GT(rej.stats.spec_mixed_steps, 0u);
        EXPECT_EQ(acc.stats.accepted_tokens, acc.stats.draft_tokens);
        EXPECT_GT(acc.stats.draft_tokens, 0u);
        EXPECT_EQ(rej.stats.accepted_tokens, 0u);
        EXPECT_GT(rej.stats.draft_tokens, 0u);
    }
}

// Speculative sampling's path (penalised greedy: every verify row's logits come back) in the mixed
// call: K = 0's tokens and logprobs.
TEST_F(Spec, MixedStepsPenalisedGreedyEqualsNoSpeculation) {
    eng_sample_params sp = eng_sample_default_params();
    sp.repetition_penalty = 1.3f;
    sp.presence_penalty = 0.5f;
    const Outputs ref = Generate(m_, 0, 6, 256, Force::kNone, nullptr, &sp, true);
    const Outputs r = Generate(m_, 2, 6, 256, Force::kNone, nullptr, &sp, true, 12, true, true, 8);
    ExpectSame(r, ref, "mixed steps, penalised greedy");
    EXPECT_GT(r.stats.spec_mixed_steps, 0u);
    for (const auto &[id, o] : r.out) {
        const std::vector<float> &l = ref.out.at(id).logprobs;
        ASSERT_EQ(o.logprobs.size(), l.size());
        for (size_t i = 0; i < l.size(); i++) EXPECT_NEAR(o.logprobs[i], l[i], 1e-4) << "id " << id << " token " << i;
    }
}

// A model that counts the engine's forward calls and the kinds of part in each, passing every
// call to the model it wraps (whose sequences the engine then holds).
struct CountingModel {
    mt_model base;  // first: the engine's handle
    mt_model *inner;
    struct Call {
        int rows = 0, verifies = 0, chunks = 0;
    };
    std::vector<Call> calls;
    static mt_model_ops ops;
};

CountingModel *AsCounting(mt_model *m) { return reinterpret_cast<CountingModel *>(m); }
const CountingModel *AsCounting(const mt_model *m) { return reinterpret_cast<const CountingModel *>(m); }

mt_model_ops CountingOps() {
    mt_model_ops o = {};
    o.destroy = [](mt_model *) {};
    o.describe = [](const mt_model *m, mt_model_info *out) { *out = mt_model_describe(AsCounting(m)->inner); };
    o.set_pools = [](mt_model *m, int p, int s, mt_error *err) { return mt_model_set_pools(AsCounting(m)->inner, p, s, err); };
    o.ensure_pools = [](mt_model *m, mt_error *err) { return mt_model_ensure_pools(AsCounting(m)->inner, err); };
    o.pool_stats = [](const mt_model *m, mt_pool_stats *out) { *out = mt_model_pool_stats(AsCounting(m)->inner); };
    o.seq_bytes_max = [](const mt_model *m, int n) { return mt_model_seq_bytes_max(AsCounting(m)->inner, n); };
    o.seq_new = [](mt_model *m, int n, mt_seq **out, mt_error *err) { return mt_seq_new(AsCounting(m)->inner, n, out, err); };
    o.seq_copy_prefix = [](mt_model *m, const mt_seq *src, mt_seq *dst, mt_error *err) {
        return mt_seq_copy_prefix(AsCounting(m)->inner, src, dst, err);
    };
    o.forward = [](mt_model *m, const mt_batch *b, mt_error *err) {
        CountingModel::Call c;
        for (int i = 0; i < b->n_parts; i++) {
            const mt_batch_part &p = b->parts[i];
            if (p.kind == MT_PART_PREFILL) c.chunks++;
            else if (p.n == 1) c.rows++;
            else c.verifies++;
        }
        AsCounting(m)->calls.push_back(c);
        return mt_model_forward(AsCounting(m)->inner, b, err);
    };
    o.decode_ahead = [](mt_model *m, mt_seq **seqs, const int32_t *t, int n, int64_t *ticket, mt_error *err) {
        return mt_model_decode_ahead(AsCounting(m)->inner, seqs, t, n, ticket, err);
    };
    o.ahead_tokens = [](mt_model *m, int64_t ticket, int32_t *out, int n) {
        return mt_model_ahead_tokens(AsCounting(m)->inner, ticket, out, n);
    };
    o.draft = [](mt_model *m, mt_seq *s, int32_t t, float *logits, mt_error *err) {
        return mt_model_draft(AsCounting(m)->inner, s, t, logits, err);
    };
    o.draft_rows = [](mt_model *m, mt_seq **seqs, const int32_t *t, int n, float *logits, int32_t *argmax,
                      mt_error *err) {
        return mt_model_draft_rows(AsCounting(m)->inner, seqs, t, n, logits, argmax, err);
    };
    o.seq_keep = [](mt_model *m, mt_seq *s, int keep, mt_error *err) { return mt_seq_keep(AsCounting(m)->inner, s, keep, err); };
    return o;
}
mt_model_ops CountingModel::ops = CountingOps();

// One step that has a speculating sequence (A), a plain decode row (B, opted out) and a prompt
// chunk (C, fed 8 tokens a step) makes one model call carrying all three, counted in the stats;
// the tokens of every request are K = 0's (the same requests without speculation or mixed steps).
TEST_F(Spec, VerifyDecodeRowAndChunkMakeOneModelCall) {
    const std::vector<int32_t> pa = { 11, 22, 33, 44, 55, 66 }, pb = { 7, 8, 9, 10, 11 };
    std::vector<int32_t> pc;
    for (int i = 0; i < 40; i++) pc.push_back((i * 29 + 5) % 300);
    struct Run {
        std::map<uint64_t, std::vector<int32_t>> tokens;
    };
    auto run = [&](int k, bool mixed_steps, bool check_step) {
        Run out;
        CountingModel cm{ { &CountingModel::ops }, glm_model_as_model(m_), {} };
        mt_error err = { "" };
        EXPECT_EQ(glm_model_set_pools(m_, 256, 64, &err), MT_OK) << err.msg;
        eng_params p = eng_default_params();
        p.max_sequences = 4;
        p.spec_tokens = k;
        p.mixed_steps = mixed_steps;
        p.prefill_budget = 8;
        p.prefix_cache_bytes = 0;
        eng_callbacks cb = {};
        cb.user = &out;
        cb.on_tokens = [](void *u, uint64_t id, const eng_sample_result *t, int n) {
            for (int i = 0; i < n; i++) static_cast<Run *>(u)->tokens[id].push_back(t[i].token);
        };
        eng_engine *e = nullptr;
        EXPECT_EQ(eng_new(&cm.base, &p, &cb, &e, &err), MT_OK) << err.msg;
        if (!e) return out;
        auto submit = [&](uint64_t id, const std::vector<int32_t> &prompt, bool no_spec) {
            eng_request r = eng_default_request();
            r.prompt = prompt.data();
            r.n_prompt = (int)prompt.size();
            r.max_new_tokens = 24;
            r.ignore_eos = true;
            r.no_speculation = no_spec;
            EXPECT_EQ(eng_submit(e, id, &r, 0, &err), MT_OK) << err.msg;
        };
        submit(1, pa, false);
        submit(2, pb, true);
        for (int guard = 0; guard < 8 && (out.tokens[1].empty() || out.tokens[2].empty()); guard++)
            EXPECT_EQ(eng_step(e, nullptr), MT_OK);
        EXPECT_FALSE(out.tokens[1].empty());
        EXPECT_FALSE(out.tokens[2].empty());
        submit(3, pc, false);
        eng_stats st0, st1;
        eng_get_stats(e, &st0);
        cm.calls.clear();
        EXPECT_EQ(eng_step(e, nullptr), MT_OK);
        eng_get_stats(e, &st1);
        if (check_step) {
            // A's verify, B's decode row and C's first chunk
            EXPECT_EQ(cm.calls.size(), 1u);
            if (!cm.calls.empty()) {
                EXPECT_EQ(cm.calls[0].rows, 1);
                EXPECT_EQ(cm.calls[0].verifies, 1);
                EXPECT_EQ(cm.calls[0].chunks, 1);
            }
            EXPECT_EQ(st1.spec_mixed_steps, st0.spec_mixed_steps + 1);
            EXPECT_EQ(st1.mixed_steps, st0.mixed_steps + 1);
            EXPECT_EQ(st1.spec_steps, st0.spec_steps + 1);
            EXPECT_EQ(st1.prefill_tokens, st0.prefill_tokens + 8);
        }
        for (int guard = 0; eng_has_work(e) && guard < 1000; guard++) EXPECT_EQ(eng_step(e, nullptr), MT_OK);
        EXPECT_FALSE(eng_has_work(e));
        eng_get_stats(e, &st1);
        if (check_step) {
            EXPECT_GT(st1.spec_mixed_steps, 1u);
            EXPECT_GT(st1.spec_steps, 0u);
        }
        eng_free(e);
        return out;
    };
    const Run ref = run(0, false, false);
    for (int k = 1; k <= ENG_SPEC_MAX; k++) {
        const Run r = run(k, true, true);
        ASSERT_EQ(r.tokens.size(), 3u);
        for (const auto &[id, t] : ref.tokens) {
            EXPECT_EQ(t.size(), 24u) << "id " << id;
            EXPECT_EQ(r.tokens.at(id), t) << "K=" << k << " id " << id;
        }
    }
}

// ---- a model with PLE memories (docs/MODEL.md "PLE layer") ----

// A random tiny-ple model (memories on layers 0 and 2, vocabulary 300 for the prompts above) with
// an MTP block: each verify's rows gather and advance the memories' history provisionally, and
// seq_keep rewinds the history and conv state to the kept row. Prefix reuse and preemption
// carry the memories through their snapshots.
class SpecPle : public Spec {
  protected:
    void SetUp() override {
        be_ = mt_cpu_backend_new(1);
        mt_error err = { "" };
        glm_config c;
        ASSERT_EQ(glm_config_preset("tiny-ple", &c, &err), MT_OK) << err.msg;
        c.vocab_size = 300;
        c.num_nextn_predict_layers = 1;
        glm_model_params p = glm_model_default_params();
        p.mtp = true;
        p.verify_seqs = 3;
        ASSERT_EQ(glm_model_new_random(&c, 5, be_, &p, &m_, &err), MT_OK) << err.msg;
    }
};

TEST_F(SpecPle, GreedyOutputEqualsNoSpeculation) {
    for (int batch : { 1, 12 }) {
        for (int pages : { 256, 14 }) {
            const Outputs ref = Generate(m_, 0, batch, pages);
            for (int k = 1; k <= 3; k++) {
                const Outputs r = Generate(m_, k, batch, pages);
                char what[96];
                snprintf(what, sizeof what, "PLE K=%d batch %d pages %d", k, batch, pages);
                ExpectSame(r, ref, what);
                EXPECT_GT(r.stats.spec_steps, 0u) << what;
                EXPECT_GT(r.stats.prefix_hits, 0u) << what;
                if (pages == 14 && batch > 1) {
                    EXPECT_GT(r.stats.preemptions, 0u) << what;
                }
                printf("%s: %llu spec steps, drafted %llu, accepted %llu, %llu preemptions, %llu prefix hits\n", what,
                       (unsigned long long)r.stats.spec_steps, (unsigned long long)r.stats.draft_tokens,
                       (unsigned long long)r.stats.accepted_tokens, (unsigned long long)r.stats.preemptions,
                       (unsigned long long)r.stats.prefix_hits);
            }
        }
    }
}

TEST_F(SpecPle, ForcedAcceptanceAndRejection) {
    const Outputs ref = Generate(m_, 0, 12, 256);
    for (int k = 1; k <= 3; k++) {
        const Outputs acc = Generate(m_, k, 12, 256, Force::kAccept, &ref);
        ExpectSame(acc, ref, "PLE forced acceptance");
        const Outputs rej = Generate(m_, k, 12, 256, Force::kReject, &ref);
        ExpectSame(rej, ref, "PLE forced rejection");
        for (const auto &[id, o] : acc.out) {
            EXPECT_EQ(o.accepted, o.drafted) << "K=" << k << " id " << id;
            EXPECT_GT(rej.out.at(id).drafted, 0) << "K=" << k << " id " << id;
            EXPECT_EQ(rej.out.at(id).accepted, 0) << "K=" << k << " id " << id;
        }
        EXPECT_LT(acc.stats.steps, ref.stats.steps) << "K=" << k;
    }
}

// With mixed steps (prompts fed 8 tokens a step), each step's verifies, decode rows and prompt
// chunks go to the model in one call: the memories' verify segments keep their conv states in
// rings beside the other parts' rows. Greedy output with K = 1..3 is K = 0's, with roomy pools
// and with preemption forced, and with forced acceptance and rejection.
TEST_F(SpecPle, MixedStepsEqualNoSpeculation) {
    const Outputs ref = Generate(m_, 0, 6, 256);
    for (int pages : { 256, 14 }) {
        for (int k = 1; k <= 3; k++) {
            const Outputs r = Generate(m_, k, 12, pages, Force::kNone, nullptr, nullptr, false, 12, true, true, 8);
            char what[64];
            snprintf(what, sizeof what, "PLE mixed steps, K=%d pages %d", k, pages);
            ExpectSame(r, ref, what);
            EXPECT_GT(r.stats.spec_mixed_steps, 0u) << what;
            if (pages == 14) {
                EXPECT_GT(r.stats.preemptions, 0u) << what;
            }
        }
    }
    const Outputs acc = Generate(m_, 2, 6, 256, Force::kAccept, &ref, nullptr, false, 12, true, true, 8);
    ExpectSame(acc, ref, "PLE mixed steps, forced acceptance");
    EXPECT_EQ(acc.stats.accepted_tokens, acc.stats.draft_tokens);
    const Outputs rej = Generate(m_, 2, 6, 256, Force::kReject, &ref, nullptr, false, 12, true, true, 8);
    ExpectSame(rej, ref, "PLE mixed steps, forced rejection");
    EXPECT_EQ(rej.stats.accepted_tokens, 0u);
    EXPECT_GT(rej.stats.draft_tokens, 0u);
}

}  // namespace
