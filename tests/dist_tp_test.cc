// Tensor parallelism on the CPU: groups of 1, 2 and 4 worker processes (forked here, one compute
// thread each, joined by the shared-memory host communicator) run one model replica, rank 0
// driving it through the leader model and the engine, the other ranks following. Every group must
// give the greedy tokens of the whole model in one process, and logits within 1e-5 of its largest
// logit, through prefill, chunked prefill, batched decode, prefix reuse, preemption and greedy
// steps run ahead of the host; and each
// rank must read about 1/N of the split tensors' bytes.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

extern "C" {
#include "kernels/backend.h"
#include "worker/dist/comm_host.h"
#include "worker/dist/tp_model.h"
#include "worker/engine/engine.h"
#include "worker/model/glm/glm_model.h"
#include "worker/model/model.h"
}

namespace {

std::string TestTmpDir() {
    const char *base = getenv("TEST_TMPDIR");
    return base && *base ? base : "/tmp";
}

// What a workload produced on rank 0 (or the single process).
struct Outcome {
    std::vector<float> logits;                  // direct model calls: prefill, then decode rows
    std::vector<std::vector<int32_t>> tokens;   // engine requests' greedy tokens
    uint64_t prefix_hits = 0, preemptions = 0, ahead_steps = 0;
};

void OnTokens(void *user, uint64_t id, const eng_sample_result *t, int n) {
    auto *o = static_cast<Outcome *>(user);
    for (int i = 0; i < n; i++) o->tokens[id].push_back(t[i].token);
}
void OnFinished(void *, uint64_t, const eng_finish_info *) {}

// The same calls on any model: direct forwards with logits (prefills, batched decode, a layered
// chunk beside a decode row), then an engine with a small prefill
// budget (prompts in chunks), prefix reuse of 16-token blocks and pools too small for every
// request at once (preemption). Returns false on any error (message on stderr).
bool Workload(mt_model *m, Outcome *o) {
    mt_error err{};
    const mt_model_info info = mt_model_describe(m);
    const int V = info.vocab_size;
    mt_seq *a = nullptr, *b = nullptr;
    if (mt_seq_new(m, 64, &a, &err) || mt_seq_new(m, 64, &b, &err)) return fprintf(stderr, "%s\n", err.msg), false;
    std::vector<int32_t> pa, pb;
    for (int i = 0; i < 21; i++) pa.push_back((i * 37 + 5) % V);
    for (int i = 0; i < 9; i++) pb.push_back((i * 11 + 3) % V);
    std::vector<float> la(V), lb(V), rows(2 * (size_t)V);
    mt_batch_part pre[2] = { { MT_PART_PREFILL, a, pa.data(), (int)pa.size(), la.data(), false, nullptr },
                             { MT_PART_PREFILL, b, pb.data(), (int)pb.size(), lb.data(), false, nullptr } };
    const mt_batch bp = { pre, 2 };
    if (mt_model_forward(m, &bp, &err)) return fprintf(stderr, "%s\n", err.msg), false;
    o->logits.insert(o->logits.end(), la.begin(), la.end());
    o->logits.insert(o->logits.end(), lb.begin(), lb.end());
    for (int t = 0; t < 6; t++) {  // batched decode of both
        int32_t ta = (int32_t)(std::max_element(la.begin(), la.end()) - la.begin());
        int32_t tb = (int32_t)(std::max_element(lb.begin(), lb.end()) - lb.begin());
        mt_batch_part dec[2] = { { MT_PART_DECODE, a, &ta, 1, rows.data(), false, nullptr },
                                 { MT_PART_DECODE, b, &tb, 1, rows.data() + V, false, nullptr } };
        const mt_batch bd = { dec, 2 };
        if (mt_model_forward(m, &bd, &err)) return fprintf(stderr, "%s\n", err.msg), false;
        la.assign(rows.begin(), rows.begin() + V);
        lb.assign(rows.begin() + V, rows.end());
        o->logits.insert(o->logits.end(), rows.begin(), rows.end());
    }
    // a layered chunk of c beside a's decode rows, one layer a call, until c's prompt completes
    mt_seq *c = nullptr;
    if (!info.layered_prefill || mt_seq_new(m, 64, &c, &err)) return fprintf(stderr, "layered: %s\n", err.msg), false;
    std::vector<int32_t> pc;
    for (int i = 0; i < 10; i++) pc.push_back((i * 23 + 2) % V);
    std::vector<float> lc(V);
    for (int call = 0; mt_seq_len(c) == 0; call++) {
        if (call == info.n_layers) return fprintf(stderr, "layered: no completion\n"), false;
        int32_t ta = (int32_t)(std::max_element(la.begin(), la.end()) - la.begin());
        mt_batch_part lay[2] = { { MT_PART_DECODE, a, &ta, 1, rows.data(), false, nullptr },
                                 { MT_PART_PREFILL, c, pc.data(), 10, lc.data(), false, nullptr, 1 } };
        const mt_batch bl = { lay, 2 };
        if (mt_model_forward(m, &bl, &err)) return fprintf(stderr, "%s\n", err.msg), false;
        la.assign(rows.begin(), rows.begin() + V);
        o->logits.insert(o->logits.end(), la.begin(), la.end());
    }
    o->logits.insert(o->logits.end(), lc.begin(), lc.end());
    mt_seq_free(a);
    mt_seq_free(b);
    mt_seq_free(c);

    // The engine: 6 requests of 52-62 tokens sharing a 50-token prefix (a kept prefix of 48), 12 new tokens each (past
    // a 64-position page), at most 4 running; pools of 5 pages (too few for 4 such sequences once
    // they cross the page) and 8 slots.
    if (mt_model_set_pools(m, 5, 8, &err)) return fprintf(stderr, "%s\n", err.msg), false;
    eng_params ep = eng_default_params();
    ep.max_sequences = 4;
    ep.max_context = 96;
    ep.prefill_budget = 16;
    ep.prefix_block = 16;
    ep.run_ahead = ENG_RUN_AHEAD_ALWAYS; /* greedy steps queued on the last step's device tokens */
    eng_callbacks cb = {};
    cb.user = o;
    cb.on_tokens = OnTokens;
    cb.on_finished = OnFinished;
    eng_engine *e = nullptr;
    if (eng_new(m, &ep, &cb, &e, &err)) return fprintf(stderr, "%s\n", err.msg), false;
    const int n_req = 6;
    o->tokens.assign(n_req, {});
    std::vector<int32_t> prompt;
    for (int q = 0; q < n_req; q++) {
        prompt.clear();
        for (int i = 0; i < 50; i++) prompt.push_back((i * 13 + 7) % V);
        for (int i = 0; i < 2 + 2 * q; i++) prompt.push_back((q * 29 + i * 5 + 1) % V);
        eng_request r = eng_default_request();
        r.prompt = prompt.data();
        r.n_prompt = (int)prompt.size();
        r.max_new_tokens = 12;
        r.ignore_eos = true;
        if (eng_submit(e, (uint64_t)q, &r, 0, &err)) return fprintf(stderr, "%s\n", err.msg), false;
        if (q == 0)  // the first one runs alone long enough to keep its prefix
            for (int k = 0; k < 4; k++) eng_step(e, nullptr);
    }
    for (int guard = 0; eng_has_work(e) && guard < 10000; guard++) eng_step(e, nullptr);
    eng_stats st;
    eng_get_stats(e, &st);
    o->prefix_hits = st.prefix_hits;
    o->preemptions = st.preemptions;
    o->ahead_steps = st.ahead_steps;
    eng_free(e);
    return true;
}

bool WriteOutcome(const std::string &path, const Outcome &o) {
    FILE *f = fopen(path.c_str(), "wb");
    if (!f) return false;
    size_t n = o.logits.size();
    fwrite(&n, sizeof n, 1, f);
    fwrite(o.logits.data(), sizeof(float), n, f);
    n = o.tokens.size();
    fwrite(&n, sizeof n, 1, f);
    for (const auto &t : o.tokens) {
        size_t k = t.size();
        fwrite(&k, sizeof k, 1, f);
        fwrite(t.data(), sizeof(int32_t), k, f);
    }
    fwrite(&o.prefix_hits, sizeof o.prefix_hits, 1, f);
    fwrite(&o.preemptions, sizeof o.preemptions, 1, f);
    fwrite(&o.ahead_steps, sizeof o.ahead_steps, 1, f);
    return fclose(f) == 0;
}

bool ReadOutcome(const std::string &path, Outcome *o) {
    FILE *f = fopen(path.c_str(), "rb");
    if (!f) return false;
    size_t n = 0;
    bool ok = fread(&n, sizeof n, 1, f) == 1;
    o->logits.resize(n);
    ok = ok && fread(o->logits.data(), sizeof(float), n, f) == n && fread(&n, sizeof n, 1, f) == 1;
    o->tokens.resize(ok ? n : 0);
    for (auto &t : o->tokens) {
        size_t k = 0;
        ok = ok && fread(&k, sizeof k, 1, f) == 1;
        t.resize(ok ? k : 0);
        ok = ok && fread(t.data(), sizeof(int32_t), k, f) == k;
    }
    ok = ok && fread(&o->prefix_hits, sizeof o->prefix_hits, 1, f) == 1 &&
         fread(&o->preemptions, sizeof o->preemptions, 1, f) == 1 &&
         fread(&o->ahead_steps, sizeof o->ahead_steps, 1, f) == 1;
    fclose(f);
    return ok;
}

// One rank of a group of n: joins the group, loads its shard, and leads or follows. Exit status
// 0 when everything held; 3 when this rank read not about 1/n of the split tensors.
int RankMain(const std::string &dir, const std::string &group, int rank, int n, const std::string &out) {
    mt_error err{};
    mt_comm *c = mt_comm_host_new(group.c_str(), rank, n, nullptr, &err);
    if (!c) return fprintf(stderr, "rank %d: %s\n", rank, err.msg), 1;
    mt_backend *be = mt_cpu_backend_new(1);
    glm_model_params mp = glm_model_default_params();
    mp.comm = c;
    glm_model *g = nullptr;
    if (glm_model_load(dir.c_str(), be, &mp, &g, &err)) return fprintf(stderr, "rank %d: %s\n", rank, err.msg), 1;
    size_t rd, total, repl;
    glm_model_load_bytes(g, &rd, &total, &repl);
    const double share = (double)rd / (double)total;
    if (std::fabs(share - 1.0 / n) > 0.02 / n) return fprintf(stderr, "rank %d read %.4f of the split bytes\n", rank, share), 3;
    int rc = 0;
    if (rank == 0) {
        mt_model *m = nullptr;
        if (mt_tp_leader_new(glm_model_as_model(g), c, &m, &err)) return 1;
        Outcome o;
        rc = Workload(m, &o) && WriteOutcome(out, o) ? 0 : 1;
        mt_model_free(m);  // tells the followers to stop
    } else {
        rc = mt_tp_follow(glm_model_as_model(g), c, &err) == MT_OK ? 0 : (fprintf(stderr, "%s\n", err.msg), 1);
        glm_model_free(g);
    }
    mt_comm_free(c);
    mt_backend_free(be);
    return rc;
}

class TpGroup : public ::testing::TestWithParam<const char *> {
  protected:
    std::string Dir() {
        const std::string name = GetParam();
        if (name != "wide") return "tests/fixtures/" + name;
        // a wider random model: real head sizes (KDA heads of 128, MLA heads of 256) at hidden 512
        static std::string dir;
        if (dir.empty()) {
            dir = TestTmpDir() + "/tp_wide";
            const std::string cmd = "tools/mkckpt --preset test-wide --out " + dir + " --dtype f32 > /dev/null";
            EXPECT_EQ(system(cmd.c_str()), 0) << cmd;
        }
        return dir;
    }
};

TEST_P(TpGroup, GivesTheTokensAndLogitsOfOneProcess) {
    const std::string dir = Dir();
    Outcome ref;
    {
        mt_backend *be = mt_cpu_backend_new(1);
        mt_model *m = nullptr;
        mt_error err{};
        ASSERT_EQ(mt_model_load(dir.c_str(), be, nullptr, &m, &err), MT_OK) << err.msg;
        ASSERT_TRUE(Workload(m, &ref));
        mt_model_free(m);
        mt_backend_free(be);
    }
    ASSERT_GT(ref.prefix_hits, 0u) << "the workload must reuse a prefix";
    ASSERT_GT(ref.preemptions, 0u) << "the workload must preempt";
    ASSERT_GT(ref.ahead_steps, 0u) << "the workload must run greedy steps ahead";
    double mx = 0;
    for (float v : ref.logits) mx = std::fmax(mx, std::fabs(v));
    for (int n : {1, 2, 4}) {
        // random bits, not the pid: sandboxed test runs share /dev/shm but not pid namespaces
        const std::string group = "mt_tp_test_" + std::to_string(std::random_device{}()) + "_" + std::to_string(n);
        const std::string out = TestTmpDir() + "/tp_out_" + std::to_string(n);
        std::vector<pid_t> pids;
        for (int r = 0; r < n; r++) {
            fflush(nullptr);
            pid_t p = fork();
            ASSERT_GE(p, 0);
            if (p == 0) _exit(RankMain(dir, group, r, n, out));
            pids.push_back(p);
        }
        for (int r = 0; r < n; r++) {
            int ws = 0;
            ASSERT_EQ(waitpid(pids[r], &ws, 0), pids[r]);
            ASSERT_TRUE(WIFEXITED(ws) && WEXITSTATUS(ws) == 0) << "rank " << r << " of " << n << " status " << ws;
        }
        Outcome got;
        ASSERT_TRUE(ReadOutcome(out, &got));
        EXPECT_EQ(got.tokens, ref.tokens) << GetParam() << " TP=" << n;
        EXPECT_EQ(got.prefix_hits, ref.prefix_hits);
        EXPECT_EQ(got.preemptions, ref.preemptions);
        EXPECT_EQ(got.ahead_steps, ref.ahead_steps);
        ASSERT_EQ(got.logits.size(), ref.logits.size());
        double worst = 0;
        for (size_t i = 0; i < ref.logits.size(); i++) worst = std::fmax(worst, std::fabs(got.logits[i] - ref.logits[i]));
        EXPECT_LE(worst / mx, 1e-5) << GetParam() << " TP=" << n;
        printf("%s TP=%d: %zu requests' tokens identical, worst |logit diff| / max|logit| %.2e, %llu prefix hits, "
               "%llu preemptions, %llu steps run ahead\n", GetParam(), n, got.tokens.size(), worst / mx,
               (unsigned long long)got.prefix_hits, (unsigned long long)got.preemptions,
               (unsigned long long)got.ahead_steps);
    }
}

INSTANTIATE_TEST_SUITE_P(Models, TpGroup, ::testing::Values("tiny_a", "tiny_c", "wide", "fp8_a"));

// Ranks whose models would run different collectives for one call (one loaded with layered_sites,
// the other not) are refused before any call: rank 0's leader names the options, the follower
// its numbers, and neither waits on the other.
int MismatchRank(const std::string &group, int rank) {
    alarm(60);  // a hang is a failure
    mt_error err{};
    mt_comm *c = mt_comm_host_new(group.c_str(), rank, 2, nullptr, &err);
    if (!c) return fprintf(stderr, "rank %d: %s\n", rank, err.msg), 1;
    mt_backend *be = mt_cpu_backend_new(1);
    glm_model_params mp = glm_model_default_params();
    mp.comm = c;
    mp.layered_sites = rank == 1;
    glm_model *g = nullptr;
    if (glm_model_load("tests/fixtures/tiny_a", be, &mp, &g, &err)) return fprintf(stderr, "rank %d: %s\n", rank, err.msg), 1;
    int rc = 1;
    if (rank == 0) {
        mt_model *m = nullptr;
        const mt_status st = mt_tp_leader_new(glm_model_as_model(g), c, &m, &err);  // frees g on error
        rc = st == MT_ERR_INVALID && !m && strstr(err.msg, "--prefill-sites") ? 0 : (fprintf(stderr, "%s\n", err.msg), 1);
        if (m) mt_model_free(m);
    } else {
        const mt_status st = mt_tp_follow(glm_model_as_model(g), c, &err);
        rc = st != MT_OK && strstr(err.msg, "rank 1's model runs 8 layered units") ? 0 : (fprintf(stderr, "%s\n", err.msg), 1);
        glm_model_free(g);
    }
    mt_comm_free(c);
    mt_backend_free(be);
    return rc;
}

TEST(TpGroupRefused, RanksMustShareTheLayeredUnits) {
    const std::string group = "mt_tp_mismatch_" + std::to_string(std::random_device{}());
    std::vector<pid_t> pids;
    for (int r = 0; r < 2; r++) {
        fflush(nullptr);
        pid_t p = fork();
        ASSERT_GE(p, 0);
        if (p == 0) _exit(MismatchRank(group, r));
        pids.push_back(p);
    }
    for (int r = 0; r < 2; r++) {
        int ws = 0;
        ASSERT_EQ(waitpid(pids[r], &ws, 0), pids[r]);
        EXPECT_TRUE(WIFEXITED(ws) && WEXITSTATUS(ws) == 0) << "rank " << r << " status " << ws;
    }
}

// A group whose size does not divide the model's split dimensions is refused with the numbers.
TEST(TpGroupRefused, SizeMustDivide) {
    mt_error err{};
    mt_comm *c = mt_comm_host_new(("mt_tp_refuse_" + std::to_string(std::random_device{}())).c_str(), 0, 1, nullptr, &err);
    ASSERT_NE(c, nullptr) << err.msg;
    c->size = 3;  // as a rank of a group of 3 would see it (no call is made before the refusal)
    mt_backend *be = mt_cpu_backend_new(1);
    glm_model_params mp = glm_model_default_params();
    mp.comm = c;
    glm_model *g = nullptr;
    EXPECT_EQ(glm_model_load("tests/fixtures/tiny_a", be, &mp, &g, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("is not a multiple of 3"), std::string::npos) << err.msg;
    c->size = 1;
    mt_comm_free(c);
    mt_backend_free(be);
}

}  // namespace
