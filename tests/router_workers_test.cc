// router/workers: Hello checks, least-loaded picks with round-robin ties, liveness (silence and a
// closed connection), restarts, limits.
#include <gtest/gtest.h>

#include <string>
#include <vector>

extern "C" {
#include "router/workers.h"
}

namespace {

struct Hello {
    Metrale__V1__ModelInfo m = METRALE__V1__MODEL_INFO__INIT;
    Metrale__Internal__V1__Hello h = METRALE__INTERNAL__V1__HELLO__INIT;
    Hello(uint32_t id, uint32_t max_seq, uint32_t vocab = 300, uint32_t ctx = 4096) {
        m.model_type = (char *)"glm5_next";
        m.backend = (char *)"cpu";
        m.vocab_size = vocab;
        m.max_context = ctx;
        h.worker_id = id;
        h.model = &m;
        h.max_sequences = max_seq;
    }
};

rtr_worker *hello(rtr_workers *reg, const char *peer, Hello &&h, double now = 0) {
    rtr_worker *w = nullptr;
    mt_error err{};
    EXPECT_EQ(rtr_workers_hello(reg, peer, &h.h, now, &w, &err), MT_OK) << err.msg;
    return w;
}

struct Reg {
    rtr_workers r;
    Reg() { rtr_workers_init(&r, rtr_workers_default_params()); }
    ~Reg() { rtr_workers_free(&r); }
};

}  // namespace

TEST(RouterWorkers, HelloIsChecked) {
    Reg g;
    rtr_worker *w = nullptr;
    mt_error err{};
    Hello bad_id(3, 4);
    EXPECT_EQ(rtr_workers_hello(&g.r, "w4", &bad_id.h, 0, &w, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("\"w3\""), std::string::npos) << err.msg;
    Hello no_vocab(1, 4, 0);
    EXPECT_EQ(rtr_workers_hello(&g.r, "w1", &no_vocab.h, 0, &w, &err), MT_ERR_INVALID);
    Hello no_model(1, 4);
    no_model.h.model = nullptr;
    EXPECT_EQ(rtr_workers_hello(&g.r, "w1", &no_model.h, 0, &w, &err), MT_ERR_INVALID);
    EXPECT_EQ(g.r.n, 0u);
    rtr_model_limits lim;
    EXPECT_FALSE(rtr_workers_limits(&g.r, &lim));
    EXPECT_EQ(rtr_workers_pick(&g.r), nullptr);
}

TEST(RouterWorkers, PicksLeastLoadedThenRoundRobin) {
    Reg g;
    rtr_worker *a = hello(&g.r, "w0", Hello(0, 2));
    rtr_worker *b = hello(&g.r, "w1", Hello(1, 4));
    // Equal load (0): alternate.
    rtr_worker *p1 = rtr_workers_pick(&g.r);
    rtr_worker *p2 = rtr_workers_pick(&g.r);
    EXPECT_NE(p1, p2);
    a->in_flight = 1;  // 1/2 loaded
    b->in_flight = 1;  // 1/4 loaded
    EXPECT_EQ(rtr_workers_pick(&g.r), b);
    b->in_flight = 4;  // full
    EXPECT_EQ(rtr_workers_pick(&g.r), a);
    a->in_flight = 2;
    EXPECT_EQ(rtr_workers_pick(&g.r), nullptr);
    a->in_flight = 0;
    a->reachable = false;  // a send to it failed
    EXPECT_EQ(rtr_workers_pick(&g.r), nullptr);
    EXPECT_EQ(rtr_workers_heard(&g.r, "w0", 1.0), a);  // heard again: reachable
    EXPECT_EQ(rtr_workers_pick(&g.r), a);
}

TEST(RouterWorkers, SilentWorkerDiesAndHelloRevivesIt) {
    Reg g;
    rtr_worker *a = hello(&g.r, "w0", Hello(0, 8), 100.0);
    hello(&g.r, "w1", Hello(1, 8), 100.0);
    a->in_flight = 5;
    rtr_worker *dead[MT_WIRE_WORKERS_MAX];
    EXPECT_EQ(rtr_workers_heard(&g.r, "w1", 102.0)->id, 1u);
    EXPECT_EQ(rtr_workers_expire(&g.r, 102.5, dead, MT_WIRE_WORKERS_MAX), 0u);  // exactly 2.5 s: still alive
    ASSERT_EQ(rtr_workers_expire(&g.r, 102.6, dead, MT_WIRE_WORKERS_MAX), 1u);
    EXPECT_EQ(dead[0], a);
    EXPECT_FALSE(a->alive);
    EXPECT_EQ(a->in_flight, 0u);
    EXPECT_EQ(rtr_workers_live(&g.r), 1u);
    EXPECT_EQ(rtr_workers_heard(&g.r, "w0", 103.0), nullptr);  // dead until it speaks up properly
    EXPECT_EQ(rtr_workers_heard(&g.r, "w9", 103.0), nullptr);  // unknown
    EXPECT_EQ(g.r.restarts, 0u);
    EXPECT_EQ(hello(&g.r, "w0", Hello(0, 8), 104.0), a);  // same entry
    EXPECT_TRUE(a->alive);
    EXPECT_EQ(g.r.restarts, 1u);
    EXPECT_EQ(rtr_workers_live(&g.r), 2u);
}

TEST(RouterWorkers, GoneWorkerIsDeadAtOnceAndItsHelloRevivesIt) {
    Reg g;
    rtr_worker *a = hello(&g.r, "w0", Hello(0, 8), 100.0);
    hello(&g.r, "w1", Hello(1, 8), 100.0);
    a->in_flight = 3;
    a->stats.live_sequences = 3;
    a->gone = true;  // a send found its connection closed
    rtr_workers_mark_dead(a);
    EXPECT_FALSE(a->alive);
    EXPECT_EQ(a->in_flight, 0u);
    EXPECT_EQ(a->stats.live_sequences, 0u);
    EXPECT_EQ(rtr_workers_live(&g.r), 1u);
    EXPECT_EQ(rtr_workers_pick(&g.r)->id, 1u);  // never picked while dead
    EXPECT_EQ(hello(&g.r, "w0", Hello(0, 8), 101.0), a);  // the group started again
    EXPECT_TRUE(a->alive);
    EXPECT_FALSE(a->gone);
    EXPECT_EQ(g.r.restarts, 1u);
}

TEST(RouterWorkers, LimitsAreTheTightestLiveOnes) {
    Reg g;
    hello(&g.r, "w0", Hello(0, 8, 300, 4096), 0);
    hello(&g.r, "w1", Hello(1, 8, 500, 1024), 0);
    rtr_model_limits lim;
    ASSERT_TRUE(rtr_workers_limits(&g.r, &lim));
    EXPECT_EQ(lim.vocab_size, 300u);
    EXPECT_EQ(lim.max_context, 1024u);
    rtr_worker *dead[MT_WIRE_WORKERS_MAX];
    EXPECT_EQ(rtr_workers_expire(&g.r, 10, dead, MT_WIRE_WORKERS_MAX), 2u);
    ASSERT_TRUE(rtr_workers_limits(&g.r, &lim));  // none live: the last Hello's
    EXPECT_EQ(lim.vocab_size, 500u);
    EXPECT_EQ(rtr_workers_any_live(&g.r), nullptr);
}

TEST(RouterWorkers, StatsAreCopied) {
    Reg g;
    rtr_worker *a = hello(&g.r, "w7", Hello(7, 8));
    Metrale__V1__WorkerStats s = METRALE__V1__WORKER_STATS__INIT;
    s.worker_id = 99;  // the registry's id wins
    s.live_sequences = 3;
    s.cache_bytes_in_use = 1234;
    s.cache_bytes_baseline = 1000;
    s.slots_prefix = 5;
    s.pages_prefix = 11;
    rtr_workers_set_stats(a, &s);
    EXPECT_EQ(a->stats.slots_prefix, 5u);
    EXPECT_EQ(a->stats.pages_prefix, 11u);
    EXPECT_EQ(a->stats.worker_id, 7u);
    EXPECT_EQ(a->stats.live_sequences, 3u);
    EXPECT_EQ(a->stats.cache_bytes_in_use, 1234u);
    EXPECT_EQ(a->stats.cache_bytes_baseline, 1000u);
}

TEST(RouterWorkers, KeepsTheTokenizerFlagsAndItsOwnEosList) {
    Reg g;
    {
        Hello h(1, 2);
        std::vector<uint32_t> eos{6000, 6007};
        h.m.n_eos_token_ids = eos.size();
        h.m.eos_token_ids = eos.data();
        h.m.has_tokenizer = true;
        h.m.has_chat_template = true;
        hello(&g.r, "w1", std::move(h));
        eos.assign(2, 0);  // the Hello's memory goes; the entry's copy stays
    }
    rtr_worker *w = rtr_workers_find(&g.r, "w1");
    ASSERT_NE(w, nullptr);
    ASSERT_EQ(w->model.n_eos_token_ids, 2u);
    EXPECT_EQ(w->model.eos_token_ids[0], 6000u);
    EXPECT_EQ(w->model.eos_token_ids[1], 6007u);
    rtr_model_limits lim;
    ASSERT_TRUE(rtr_workers_limits(&g.r, &lim));
    EXPECT_TRUE(lim.has_tokenizer);
    EXPECT_TRUE(lim.has_chat_template);
    // a second worker without a chat template: messages are no longer served
    Hello h2(2, 2);
    h2.m.has_tokenizer = true;
    hello(&g.r, "w2", std::move(h2));
    ASSERT_TRUE(rtr_workers_limits(&g.r, &lim));
    EXPECT_TRUE(lim.has_tokenizer);
    EXPECT_FALSE(lim.has_chat_template);
    // a restart of w1 without eos ids replaces (and frees) the old list
    hello(&g.r, "w1", Hello(1, 2));
    EXPECT_EQ(w->model.n_eos_token_ids, 0u);
    EXPECT_EQ(w->model.eos_token_ids, nullptr);
    ASSERT_TRUE(rtr_workers_limits(&g.r, &lim));
    EXPECT_FALSE(lim.has_tokenizer);
    // pick_any ignores room
    w->in_flight = 2;
    rtr_workers_find(&g.r, "w2")->in_flight = 2;
    EXPECT_EQ(rtr_workers_pick(&g.r), nullptr);
    EXPECT_NE(rtr_workers_pick_any(&g.r), nullptr);
}
