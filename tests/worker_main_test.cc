// metrale-worker, the real binary, driven from a raw ZeroMQ ROUTER socket in this test (the
// router's side of worker.proto): Hello, streamed Tokens equal to the model's greedy tokens,
// Finished after the last Tokens, Abort, heartbeats with stats back at baseline, malformed and
// unexpected messages dropped without harm, Shutdown, SIGTERM and router silence.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "common/mt.h"
#include "common/wire_limits.h"
#include "kernels/backend.h"
#include "proto/metrale/internal/v1/worker.pb-c.h"
#include "worker/model/glm/glm_model.h"
#include "worker/text/tokenizer.h"

namespace {

const char *kModel = "tests/fixtures/tiny_a";  // vocab 300, 4 layers, hidden 64, no EOS
const char *kWorker = "worker/metrale-worker";

typedef Metrale__Internal__V1__Envelope Env;

std::vector<int32_t> DirectGreedy(const std::vector<int32_t> &prompt, int n) {
    mt_backend *be = mt_cpu_backend_new(1);
    glm_model *m = nullptr;
    glm_seq *s = nullptr;
    EXPECT_EQ(glm_model_load(kModel, be, nullptr, &m, nullptr), MT_OK);
    const int V = glm_model_config(m)->vocab_size;
    EXPECT_EQ(glm_seq_new(m, (int)prompt.size() + n, &s, nullptr), MT_OK);
    std::vector<float> l(V);
    EXPECT_EQ(glm_prefill(m, s, prompt.data(), (int)prompt.size(), l.data(), false, nullptr), MT_OK);
    std::vector<int32_t> out;
    for (int i = 0; i < n; i++) {
        out.push_back(glm_argmax(l.data(), V));
        if (i + 1 < n) {
            EXPECT_EQ(glm_decode(m, s, out.back(), l.data(), nullptr), MT_OK);
        }
    }
    glm_seq_free(s);
    glm_model_free(m);
    mt_backend_free(be);
    return out;
}

// The router side: a ROUTER socket bound to a private ipc endpoint, and the worker process.
class WorkerProc {
  public:
    explicit WorkerProc(std::vector<std::string> extra = {}, uint32_t max_context = 256, const char *model = kModel)
        : max_context_(max_context) {
        char tmpl[] = "/tmp/worker_main_test_XXXXXX";
        dir_ = mkdtemp(tmpl);
        endpoint_ = "ipc://" + dir_ + "/w.sock";
        ctx_ = zmq_ctx_new();
        sock_ = zmq_socket(ctx_, ZMQ_ROUTER);
        int one = 1, zero = 0;
        zmq_setsockopt(sock_, ZMQ_ROUTER_MANDATORY, &one, sizeof one);
        zmq_setsockopt(sock_, ZMQ_LINGER, &zero, sizeof zero);
        EXPECT_EQ(zmq_bind(sock_, endpoint_.c_str()), 0) << zmq_strerror(zmq_errno());
        std::vector<std::string> args = { kWorker, "--model", model, "--router", endpoint_, "--id", "3",
                                          "--threads", "1", "--max-sequences", "4", "--max-context",
                                          std::to_string(max_context) };
        args.insert(args.end(), extra.begin(), extra.end());
        pid_ = fork();
        if (pid_ == 0) {
            std::vector<char *> argv;
            for (auto &a : args) argv.push_back(const_cast<char *>(a.c_str()));
            argv.push_back(nullptr);
            execv(argv[0], argv.data());
            _exit(127);
        }
    }
    ~WorkerProc() {
        if (pid_ > 0 && !exited_) {
            kill(pid_, SIGKILL);
            waitpid(pid_, nullptr, 0);
        }
        zmq_close(sock_);
        zmq_ctx_term(ctx_);
        unlink((dir_ + "/w.sock").c_str());
        rmdir(dir_.c_str());
    }

    // Next envelope from the worker within timeout_ms, or nullptr. Heartbeats are recorded and
    // skipped unless want_heartbeat.
    Env *Recv(int timeout_ms, bool want_heartbeat = false) {
        const double end = mt_now() + timeout_ms / 1000.0;
        for (;;) {
            const double left = end - mt_now();
            if (left <= 0) return nullptr;
            zmq_pollitem_t it = { sock_, 0, ZMQ_POLLIN, 0 };
            if (zmq_poll(&it, 1, (long)(left * 1000) + 1) <= 0) continue;
            zmq_msg_t id, body;
            zmq_msg_init(&id);
            zmq_msg_init(&body);
            zmq_msg_recv(&id, sock_, 0);
            peer_.assign((const char *)zmq_msg_data(&id), zmq_msg_size(&id));
            zmq_msg_recv(&body, sock_, 0);
            Env *e = metrale__internal__v1__envelope__unpack(nullptr, zmq_msg_size(&body),
                                                             (const uint8_t *)zmq_msg_data(&body));
            zmq_msg_close(&id);
            zmq_msg_close(&body);
            EXPECT_NE(e, nullptr) << "undecodable message from the worker";
            if (!e) continue;
            EXPECT_EQ(e->version, 1u);
            if (e->body_case == METRALE__INTERNAL__V1__ENVELOPE__BODY_HEARTBEAT) {
                heartbeats_++;
                if (e->heartbeat->stats) {
                    last_stats_ = *e->heartbeat->stats;
                    have_stats_ = true;
                }
                if (!want_heartbeat) {
                    metrale__internal__v1__envelope__free_unpacked(e, nullptr);
                    continue;
                }
            }
            return e;
        }
    }
    void SendRaw(const void *data, size_t n) {
        ASSERT_EQ(zmq_send(sock_, "w3", 2, ZMQ_SNDMORE), 2);
        ASSERT_EQ(zmq_send(sock_, data, n, 0), (int)n);
    }
    void Send(Env *e, uint32_t version = 1) {
        e->version = version;
        std::vector<uint8_t> buf(metrale__internal__v1__envelope__get_packed_size(e));
        metrale__internal__v1__envelope__pack(e, buf.data());
        SendRaw(buf.data(), buf.size());
    }
    void Heartbeat(bool hello_wanted = false) {
        Metrale__Internal__V1__Heartbeat hb = METRALE__INTERNAL__V1__HEARTBEAT__INIT;
        hb.hello_wanted = hello_wanted;
        Env e = METRALE__INTERNAL__V1__ENVELOPE__INIT;
        e.body_case = METRALE__INTERNAL__V1__ENVELOPE__BODY_HEARTBEAT;
        e.heartbeat = &hb;
        Send(&e);
    }
    void Submit(uint64_t id, const std::vector<uint32_t> &prompt, uint32_t max_new,
                std::vector<uint32_t> stops = {}, bool logprobs = false, uint32_t top = 0) {
        Metrale__V1__StoppingCriteria st = METRALE__V1__STOPPING_CRITERIA__INIT;
        st.max_new_tokens = max_new;
        st.n_stop_token_ids = stops.size();
        st.stop_token_ids = stops.data();
        Metrale__V1__GenerateRequest g = METRALE__V1__GENERATE_REQUEST__INIT;
        g.request_id = (char *)"t";
        g.n_prompt_token_ids = prompt.size();
        g.prompt_token_ids = const_cast<uint32_t *>(prompt.data());
        g.stopping = &st;
        g.logprobs = logprobs;
        g.top_logprobs = top;
        Metrale__Internal__V1__Submit s = METRALE__INTERNAL__V1__SUBMIT__INIT;
        s.id = id;
        s.request = &g;
        Env e = METRALE__INTERNAL__V1__ENVELOPE__INIT;
        e.body_case = METRALE__INTERNAL__V1__ENVELOPE__BODY_SUBMIT;
        e.submit = &s;
        Send(&e);
    }
    void SubmitRequest(uint64_t id, Metrale__V1__GenerateRequest *g) {
        Metrale__Internal__V1__Submit s = METRALE__INTERNAL__V1__SUBMIT__INIT;
        s.id = id;
        s.request = g;
        Env e = METRALE__INTERNAL__V1__ENVELOPE__INIT;
        e.body_case = METRALE__INTERNAL__V1__ENVELOPE__BODY_SUBMIT;
        e.submit = &s;
        Send(&e);
    }
    void Abort(uint64_t id) {
        Metrale__Internal__V1__Abort a = METRALE__INTERNAL__V1__ABORT__INIT;
        a.id = id;
        a.reason = METRALE__V1__FINISH_REASON__FINISH_REASON_CANCELLED;
        Env e = METRALE__INTERNAL__V1__ENVELOPE__INIT;
        e.body_case = METRALE__INTERNAL__V1__ENVELOPE__BODY_ABORT;
        e.abort = &a;
        Send(&e);
    }
    void Shutdown() {
        Metrale__Internal__V1__Shutdown sd = METRALE__INTERNAL__V1__SHUTDOWN__INIT;
        Env e = METRALE__INTERNAL__V1__ENVELOPE__INIT;
        e.body_case = METRALE__INTERNAL__V1__ENVELOPE__BODY_SHUTDOWN;
        e.shutdown = &sd;
        Send(&e);
    }
    // Waits for the Hello and returns it (the caller frees it).
    Env *Hello() {
        Env *e = Recv(30000);
        EXPECT_NE(e, nullptr) << "no Hello";
        if (e) {
            EXPECT_EQ(e->body_case, METRALE__INTERNAL__V1__ENVELOPE__BODY_HELLO);
        }
        return e;
    }
    // Waits for the Hello; checks what it says.
    void ExpectHello() {
        Env *e = Recv(30000);
        ASSERT_NE(e, nullptr) << "no Hello";
        ASSERT_EQ(e->body_case, METRALE__INTERNAL__V1__ENVELOPE__BODY_HELLO);
        EXPECT_EQ(peer_, "w3");
        EXPECT_EQ(e->hello->worker_id, 3u);
        EXPECT_EQ(e->hello->max_sequences, 4u);
        ASSERT_NE(e->hello->model, nullptr);
        EXPECT_STREQ(e->hello->model->model_type, "glm5_next");
        EXPECT_EQ(e->hello->model->vocab_size, 300u);
        EXPECT_EQ(e->hello->model->max_context, max_context_);
        EXPECT_EQ(e->hello->model->num_layers, 4u);
        EXPECT_EQ(e->hello->model->hidden_size, 64u);
        EXPECT_EQ(e->hello->model->eos_token_id, -1);
        EXPECT_STREQ(e->hello->model->backend, "cpu");
        metrale__internal__v1__envelope__free_unpacked(e, nullptr);
    }
    // Exit status within timeout_s, or -1.
    int Wait(double timeout_s) {
        const double end = mt_now() + timeout_s;
        while (mt_now() < end) {
            int st;
            if (waitpid(pid_, &st, WNOHANG) == pid_) {
                exited_ = true;
                return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
            }
            usleep(20000);
        }
        return -1;
    }
    pid_t pid_ = -1;
    bool exited_ = false;
    uint32_t max_context_;
    int heartbeats_ = 0;
    bool have_stats_ = false;
    Metrale__V1__WorkerStats last_stats_ = METRALE__V1__WORKER_STATS__INIT;

  private:
    std::string dir_, endpoint_, peer_;
    void *ctx_, *sock_;
};

struct Stream {
    std::vector<uint32_t> tokens;
    std::vector<size_t> batch_sizes;
    std::vector<float> logprobs;
    std::vector<size_t> n_top;
    bool finished = false;
    Metrale__V1__FinishReason reason = METRALE__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED;
    uint32_t prompt_tokens = 0, completion_tokens = 0;
    std::string error;
    std::string text;                      // Tokens.text pieces, then Finished.text
    std::vector<std::string> pieces;
    std::vector<std::string> bytes;        // each token's bytes
    std::vector<uint32_t> echo_ids;        // prompt_logprobs
    std::vector<float> echo_lp;
    std::vector<std::string> echo_bytes;
    std::string stop_string;
    int64_t stop_token = -1;
    bool invalid = false;
};

// Collects Tokens and Finished until every id in want has finished (or the time is up).
void Collect(WorkerProc &w, std::map<uint64_t, Stream> &out, const std::vector<uint64_t> &want, int timeout_ms,
             bool keep_heartbeats_flowing = true) {
    const double end = mt_now() + timeout_ms / 1000.0;
    auto done = [&] {
        for (uint64_t id : want)
            if (!out[id].finished) return false;
        return true;
    };
    double next_hb = 0;
    while (!done() && mt_now() < end) {
        if (keep_heartbeats_flowing && mt_now() >= next_hb) {
            w.Heartbeat();
            next_hb = mt_now() + 0.5;
        }
        Env *e = w.Recv(100);
        if (!e) continue;
        if (e->body_case == METRALE__INTERNAL__V1__ENVELOPE__BODY_TOKENS) {
            Stream &s = out[e->tokens->id];
            EXPECT_FALSE(s.finished) << "Tokens after Finished for " << e->tokens->id;
            s.batch_sizes.push_back(e->tokens->n_tokens);
            for (size_t i = 0; i < e->tokens->n_tokens; i++) {
                const Metrale__V1__GeneratedToken *t = e->tokens->tokens[i];
                s.tokens.push_back(t->token_id);
                s.logprobs.push_back(t->logprob);
                s.n_top.push_back(t->n_top_logprobs);
                s.bytes.emplace_back((const char *)t->bytes.data, t->bytes.len);
            }
            const std::string piece = e->tokens->text ? e->tokens->text : "";
            s.text += piece;
            s.pieces.push_back(piece);
            for (size_t i = 0; i < e->tokens->n_prompt_logprobs; i++) {
                const Metrale__V1__GeneratedToken *t = e->tokens->prompt_logprobs[i];
                s.echo_ids.push_back(t->token_id);
                s.echo_lp.push_back(t->logprob);
                s.echo_bytes.emplace_back((const char *)t->bytes.data, t->bytes.len);
            }
        } else if (e->body_case == METRALE__INTERNAL__V1__ENVELOPE__BODY_FINISHED) {
            Stream &s = out[e->finished->id];
            EXPECT_FALSE(s.finished) << "second Finished for " << e->finished->id;
            s.finished = true;
            s.text += e->finished->text ? e->finished->text : "";
            s.invalid = e->finished->invalid_argument;
            if (e->finished->final) {
                const Metrale__V1__Final *f = e->finished->final;
                if (f->stop_reason_case == METRALE__V1__FINAL__STOP_REASON_STOP_STRING) s.stop_string = f->stop_string;
                if (f->stop_reason_case == METRALE__V1__FINAL__STOP_REASON_STOP_TOKEN_ID) s.stop_token = f->stop_token_id;
                s.reason = e->finished->final->finish_reason;
                s.error = e->finished->final->error_message ? e->finished->final->error_message : "";
                if (e->finished->final->usage) {
                    s.prompt_tokens = e->finished->final->usage->prompt_tokens;
                    s.completion_tokens = e->finished->final->usage->completion_tokens;
                }
            }
        } else {
            ADD_FAILURE() << "unexpected message from the worker, body " << e->body_case;
        }
        metrale__internal__v1__envelope__free_unpacked(e, nullptr);
    }
}

std::vector<uint32_t> U(const std::vector<int32_t> &v) { return std::vector<uint32_t>(v.begin(), v.end()); }
std::vector<int32_t> Prompt(int n, int salt) {
    std::vector<int32_t> p;
    for (int i = 0; i < n; i++) p.push_back((i * 31 + salt * 17 + 5) % 300);
    return p;
}

// Waits for a heartbeat whose stats satisfy pred.
template <class F> bool WaitStats(WorkerProc &w, F pred, int timeout_ms) {
    const double end = mt_now() + timeout_ms / 1000.0;
    while (mt_now() < end) {
        w.Heartbeat();
        Env *e = w.Recv(600, true);
        if (!e) continue;
        const bool hb = e->body_case == METRALE__INTERNAL__V1__ENVELOPE__BODY_HEARTBEAT;
        metrale__internal__v1__envelope__free_unpacked(e, nullptr);
        if (hb && w.have_stats_ && pred(w.last_stats_)) return true;
    }
    return false;
}

TEST(WorkerMain, StreamsGreedyTokensAndFinishes) {
    const std::vector<int32_t> p1 = Prompt(7, 1), p2 = Prompt(12, 2), p3 = Prompt(3, 3);
    const std::vector<int32_t> g1 = DirectGreedy(p1, 10), g2 = DirectGreedy(p2, 6), g3 = DirectGreedy(p3, 8);
    WorkerProc w;
    w.ExpectHello();
    w.Submit(101, U(p1), 10, {}, true, 3);
    w.Submit(102, U(p2), 6);
    // a stop token: the 3rd greedy token (or its first occurrence)
    size_t first = 0;
    while (g3[first] != g3[2]) first++;
    w.Submit(103, U(p3), 8, { 299, (uint32_t)g3[2] });
    std::map<uint64_t, Stream> got;
    Collect(w, got, { 101, 102, 103 }, 30000);
    EXPECT_EQ(got[101].tokens, U(g1));
    EXPECT_EQ(got[101].reason, METRALE__V1__FINISH_REASON__FINISH_REASON_LENGTH);
    EXPECT_EQ(got[101].prompt_tokens, 7u);
    EXPECT_EQ(got[101].completion_tokens, 10u);
    for (size_t i = 0; i < got[101].tokens.size(); i++) {
        EXPECT_LT(got[101].logprobs[i], 0.0f);
        EXPECT_EQ(got[101].n_top[i], 3u);
    }
    EXPECT_EQ(got[102].tokens, U(g2));
    EXPECT_EQ(got[102].n_top[0], 0u);
    EXPECT_EQ(got[102].logprobs[0], 0.0f);
    EXPECT_EQ(got[103].tokens, U(std::vector<int32_t>(g3.begin(), g3.begin() + first + 1)));
    EXPECT_EQ(got[103].reason, METRALE__V1__FINISH_REASON__FINISH_REASON_STOP);
    for (auto &kv : got)
        for (size_t n : kv.second.batch_sizes) EXPECT_EQ(n, 1u);  // one token per sequence per step
    EXPECT_TRUE(WaitStats(w, [](const Metrale__V1__WorkerStats &s) {
        return s.live_sequences == 0 && s.cache_bytes_in_use == 0 && s.sequences_finished == 3;
    }, 5000));
    EXPECT_EQ(w.last_stats_.worker_id, 3u);
    EXPECT_TRUE(w.last_stats_.alive);
    w.Shutdown();
    EXPECT_EQ(w.Wait(10), 0);
}

// A worker that warms up before its Hello (--warmup-tokens) serves the same tokens and counts
// only the router's requests.
TEST(WorkerMain, WarmUpRunsBeforeHelloAndIsNotCounted) {
    const std::vector<int32_t> p1 = Prompt(9, 4);
    const std::vector<int32_t> g1 = DirectGreedy(p1, 6);
    WorkerProc w({ "--warmup-tokens", "100", "--separate-steps" });
    w.ExpectHello();
    w.Submit(7, U(p1), 6);
    std::map<uint64_t, Stream> got;
    Collect(w, got, { 7 }, 30000);
    EXPECT_EQ(got[7].tokens, U(g1));
    EXPECT_TRUE(WaitStats(w, [](const Metrale__V1__WorkerStats &s) {
        return s.live_sequences == 0 && s.sequences_finished == 1;
    }, 5000));
    EXPECT_EQ(w.last_stats_.sequences_aborted, 0u);
    EXPECT_EQ(w.last_stats_.prefix_misses, 1u);  // the request's admission, not the warm-up's
    w.Shutdown();
    EXPECT_EQ(w.Wait(10), 0);
}

// Long enough that no sequence ends on its own while a test looks at it.
const uint32_t kLongContext = 60000, kLong = 50000;

TEST(WorkerMain, AbortFreesStateAndAnswersFinished) {
    WorkerProc w({}, kLongContext);
    w.ExpectHello();
    for (uint64_t id = 1; id <= 6; id++) w.Submit(id, U(Prompt(5, (int)id)), kLong);  // 4 run, 2 wait
    EXPECT_TRUE(WaitStats(w, [](const Metrale__V1__WorkerStats &s) {
        return s.live_sequences == 6 && s.cache_bytes_in_use > 0;
    }, 10000));
    for (uint64_t id = 1; id <= 6; id++) w.Abort(id);
    w.Abort(999);  // unknown: no answer
    std::map<uint64_t, Stream> got;
    Collect(w, got, { 1, 2, 3, 4, 5, 6 }, 10000);
    for (uint64_t id = 1; id <= 6; id++) {
        EXPECT_TRUE(got[id].finished) << id;
        EXPECT_EQ(got[id].reason, METRALE__V1__FINISH_REASON__FINISH_REASON_CANCELLED) << id;
        EXPECT_LT(got[id].tokens.size(), kLong);
    }
    EXPECT_EQ(got.count(999), 0u);
    EXPECT_TRUE(WaitStats(w, [](const Metrale__V1__WorkerStats &s) {
        return s.live_sequences == 0 && s.cache_bytes_in_use == 0 && s.sequences_aborted == 6;
    }, 5000));
    kill(w.pid_, SIGTERM);
    EXPECT_EQ(w.Wait(10), 0);
}

TEST(WorkerMain, BadMessagesAreDroppedAndTheWorkerKeepsServing) {
    const std::vector<int32_t> p = Prompt(6, 9);
    const std::vector<int32_t> want = DirectGreedy(p, 5);
    WorkerProc w;
    w.ExpectHello();
    const char garbage[] = "\xff\xff\xff\xff not a protobuf";
    w.SendRaw(garbage, sizeof garbage);
    w.SendRaw("", 0);  // an empty frame is an empty envelope: no body
    {
        Env e = METRALE__INTERNAL__V1__ENVELOPE__INIT;  // wrong version
        Metrale__Internal__V1__Shutdown sd = METRALE__INTERNAL__V1__SHUTDOWN__INIT;
        e.body_case = METRALE__INTERNAL__V1__ENVELOPE__BODY_SHUTDOWN;
        e.shutdown = &sd;
        w.Send(&e, 7);
    }
    {
        Env e = METRALE__INTERNAL__V1__ENVELOPE__INIT;  // a worker -> router message
        Metrale__Internal__V1__Finished f = METRALE__INTERNAL__V1__FINISHED__INIT;
        e.body_case = METRALE__INTERNAL__V1__ENVELOPE__BODY_FINISHED;
        e.finished = &f;
        w.Send(&e);
    }
    {
        Env e = METRALE__INTERNAL__V1__ENVELOPE__INIT;  // Submit without a request
        Metrale__Internal__V1__Submit s = METRALE__INTERNAL__V1__SUBMIT__INIT;
        s.id = 50;
        e.body_case = METRALE__INTERNAL__V1__ENVELOPE__BODY_SUBMIT;
        e.submit = &s;
        w.Send(&e);
    }
    w.Submit(51, { 1, 300 }, 4);                    // token outside the vocabulary
    w.Submit(52, U(p), 0);                          // no max_new_tokens
    w.Submit(53, U(p), 251);                        // past max_context 256
    w.Submit(54, {}, 4);                            // empty prompt
    w.Submit(55, U(p), 4, { 4000000000u });         // stop id above INT32_MAX
    w.Submit(56, U(p), 4, {}, true, 21);            // top_logprobs above 20
    w.Submit(57, U(p), 5);                          // valid
    w.Submit(57, U(p), 5);                          // duplicate live id: dropped, 57 unharmed
    std::map<uint64_t, Stream> got;
    Collect(w, got, { 50, 51, 52, 53, 54, 55, 56, 57 }, 30000);
    const std::map<uint64_t, const char *> says = {
        { 50, "without a request" }, { 51, "outside the vocabulary" }, { 52, "max_new_tokens" },
        { 53, "context limit" },     { 54, "prompt is empty" },        { 55, "outside the vocabulary" },
        { 56, "top_logprobs" },
    };
    for (auto &kv : says) {
        EXPECT_EQ(got[kv.first].reason, METRALE__V1__FINISH_REASON__FINISH_REASON_ERROR) << kv.first;
        EXPECT_NE(got[kv.first].error.find(kv.second), std::string::npos) << kv.first << ": " << got[kv.first].error;
        EXPECT_TRUE(got[kv.first].tokens.empty());
    }
    EXPECT_EQ(got[57].tokens, U(want));
    EXPECT_EQ(got[57].reason, METRALE__V1__FINISH_REASON__FINISH_REASON_LENGTH);
    EXPECT_EQ(w.Wait(0.1), -1) << "the worker exited";
    w.Shutdown();
    EXPECT_EQ(w.Wait(10), 0);
}

TEST(WorkerMain, HelloWantedDropsSequencesAndSaysHelloOnce) {
    WorkerProc w({}, kLongContext);
    w.ExpectHello();
    w.Submit(7, U(Prompt(5, 7)), kLong);
    EXPECT_TRUE(WaitStats(w, [](const Metrale__V1__WorkerStats &s) { return s.live_sequences == 1; }, 10000));
    usleep(2200 * 1000);  // past the window in which hello_wanted is taken for the echo of a Hello
    w.Heartbeat(true);    // a restarted router: it does not know this worker
    w.Heartbeat(true);    // the echo while the Hello travels: no second Hello
    int hellos = 0, finished = 0;
    const double end = mt_now() + 3.0;
    while (mt_now() < end) {
        Env *e = w.Recv(200);
        if (!e) continue;
        hellos += e->body_case == METRALE__INTERNAL__V1__ENVELOPE__BODY_HELLO;
        finished += e->body_case == METRALE__INTERNAL__V1__ENVELOPE__BODY_FINISHED;
        metrale__internal__v1__envelope__free_unpacked(e, nullptr);
        if (hellos) w.Heartbeat();
    }
    EXPECT_EQ(hellos, 1);
    EXPECT_EQ(finished, 0);  // the old router's stream is gone: nothing to tell
    EXPECT_TRUE(WaitStats(w, [](const Metrale__V1__WorkerStats &s) {
        return s.live_sequences == 0 && s.cache_bytes_in_use == 0 && s.sequences_aborted == 1;
    }, 5000));
    w.Shutdown();
    EXPECT_EQ(w.Wait(10), 0);
}

TEST(WorkerMain, HeartbeatsFlowWhileIdle) {
    WorkerProc w;
    w.ExpectHello();
    const double t0 = mt_now();
    int n = 0;
    while (mt_now() - t0 < 2.2) {
        w.Heartbeat();
        Env *e = w.Recv(300, true);
        if (e) {
            n += e->body_case == METRALE__INTERNAL__V1__ENVELOPE__BODY_HEARTBEAT;
            metrale__internal__v1__envelope__free_unpacked(e, nullptr);
        }
    }
    EXPECT_GE(n, 3);  // every 500 ms
    EXPECT_LE(n, 6);
    EXPECT_TRUE(w.have_stats_);
    EXPECT_EQ(w.last_stats_.live_sequences, 0u);
    w.Shutdown();
    EXPECT_EQ(w.Wait(10), 0);
}

// The start-up memory plan sizes the pools from --cache-budget-mb: the heartbeat's stats show them
// (slots for its 4 running sequences, 2 kept prefixes and the graph pad; pages all free when idle),
// and a budget that cannot hold one full-context sequence is an error at start, not later.
TEST(WorkerMain, MemoryPlanSizesThePools) {
    WorkerProc w({ "--cache-budget-mb", "1" });  // --max-sequences 4, --max-context 256
    w.ExpectHello();
    EXPECT_TRUE(WaitStats(w, [](const Metrale__V1__WorkerStats &s) {
        return s.slots_total == 4 + 2 + 1 && s.cache_pages_total > 4 && s.cache_pages_free == s.cache_pages_total &&
               s.slots_free == s.slots_total;
    }, 5000)) << "slots " << w.last_stats_.slots_total << " pages " << w.last_stats_.cache_pages_total;
    w.Shutdown();
    EXPECT_EQ(w.Wait(10), 0);
    pid_t pid = fork();
    if (pid == 0) {
        const char *argv[] = { kWorker, "--model", kModel, "--router", "ipc:///tmp/metrale-plan-x", "--id", "1",
                               "--cache-budget-mb", "1", "--max-context", "1000000", nullptr };
        if (!freopen("/dev/null", "w", stderr)) _exit(126);
        execv(argv[0], const_cast<char **>(argv));
        _exit(127);
    }
    int st;
    waitpid(pid, &st, 0);
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == MT_WIRE_EXIT_STARTUP);
}

TEST(WorkerMain, ExitsWhenTheRouterFallsSilent) {
    WorkerProc w({ "--router-timeout", "1.5" });
    w.ExpectHello();
    const double t0 = mt_now();
    const int rc = w.Wait(15);
    EXPECT_EQ(rc, 1);
    EXPECT_GE(mt_now() - t0, 1.0);
}

TEST(WorkerMain, BadArgumentsExitTwo) {
    auto run = [](std::vector<std::string> args) {
        pid_t pid = fork();
        if (pid == 0) {
            std::vector<char *> argv = { const_cast<char *>(kWorker) };
            for (auto &a : args) argv.push_back(const_cast<char *>(a.c_str()));
            argv.push_back(nullptr);
            if (!freopen("/dev/null", "w", stderr)) _exit(126);
            execv(argv[0], argv.data());
            _exit(127);
        }
        int st;
        waitpid(pid, &st, 0);
        return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    };
    EXPECT_EQ(run({ "--model", kModel }), 2);
    EXPECT_EQ(run({ "--model", kModel, "--router", "ipc:///tmp/x", "--id", "x" }), 2);
    EXPECT_EQ(run({ "--model", kModel, "--router", "ipc:///tmp/x", "--id", "1", "--backend", "tpu" }), 2);
    EXPECT_EQ(run({ "--model", kModel, "--router", "ipc:///tmp/x", "--id", "1", "--bogus", "1" }), 2);
    EXPECT_EQ(run({ "--model", kModel, "--router", "ipc:///tmp/x", "--id", "1", "--layered-max-waiting", "-1" }), 2);
    EXPECT_EQ(run({ "--model", kModel, "--router", "ipc:///tmp/x", "--id", "1", "--curve-server-key", "/no/such" }),
              2);
    EXPECT_EQ(run({ "--model", kModel, "--router", "ipc:///tmp/x", "--id", "1", "--tp", "2", "--rank", "2",
                    "--group", "g" }), 2);
    // Start-up failures: MT_WIRE_EXIT_STARTUP, so a launcher does not restart them without end.
    EXPECT_EQ(run({ "--model", "/no/such/dir", "--router", "ipc:///tmp/x", "--id", "1" }), MT_WIRE_EXIT_STARTUP);
    // Another host's tcp:// endpoint without CURVE keys is refused.
    EXPECT_EQ(run({ "--model", kModel, "--router", "tcp://10.1.2.3:5555", "--id", "1" }), MT_WIRE_EXIT_STARTUP);
    EXPECT_EQ(run({ "--help" }), 0);
}


// ---- text: a random model of the glm_tok fixture's vocabulary, with that tokenizer ----

// Writes a random checkpoint of tests/fixtures/text_tiny/config.json (vocab 6016) with the
// glm_tok tokenizer files (GLM-style added tokens, a chat template, eos ids 6000 and 6007) into a
// fresh folder; returns it.
std::string TextModel() {
    char tmpl[] = "/tmp/worker_text_model_XXXXXX";
    const std::string dir = mkdtemp(tmpl);
    const std::string cmd = "tools/mkckpt --config tests/fixtures/text_tiny/config.json --out " + dir +
                            " >/dev/null && cp tests/fixtures/glm_tok/*.json " + dir;
    EXPECT_EQ(system(cmd.c_str()), 0) << cmd;
    return dir;
}

struct Tokenizer {
    Tokenizer(const std::string &dir) {
        mt_error err;
        EXPECT_EQ(tok_load(dir.c_str(), &t, &err), MT_OK) << err.msg;
        e = tok_encoder_new(t);
    }
    ~Tokenizer() {
        tok_encoder_free(e);
        tok_free(t);
    }
    std::vector<uint32_t> Encode(const std::string &s, bool special) {
        tok_ids ids = {};
        mt_error err;
        EXPECT_EQ(tok_encode(e, s.data(), s.size(), special, &ids, &err), MT_OK) << err.msg;
        std::vector<uint32_t> out(ids.ids, ids.ids + ids.n);
        tok_ids_free(&ids);
        return out;
    }
    std::string Decode(const std::vector<uint32_t> &u, bool skip = true) {
        std::vector<int32_t> v(u.begin(), u.end());
        tok_text out = {};
        mt_error err;
        EXPECT_EQ(tok_decode(t, v.data(), v.size(), skip, &out, &err), MT_OK);
        std::string r(out.s ? out.s : "", out.n);
        tok_text_free(&out);
        return r;
    }
    std::string Bytes(uint32_t id) {
        size_t n = 0;
        const uint8_t *b = tok_id_to_bytes(t, (int32_t)id, &n);
        return b ? std::string((const char *)b, n) : std::string();
    }
    tok_tokenizer *t = nullptr;
    tok_encoder *e = nullptr;
};

Metrale__V1__GenerateRequest TextRequest(const char *text, Metrale__V1__StoppingCriteria *st) {
    Metrale__V1__GenerateRequest g = METRALE__V1__GENERATE_REQUEST__INIT;
    g.request_id = (char *)"t";
    g.prompt_text = (char *)text;
    g.stopping = st;
    return g;
}

bool ValidUtf8(const std::string &s) {
    for (size_t i = 0; i < s.size();) {
        const unsigned char c = s[i];
        const int n = c < 0x80 ? 1 : c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
        if (!n || i + n > s.size()) return false;
        for (int k = 1; k < n; k++)
            if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return false;
        i += n;
    }
    return true;
}

// Text prompts, streamed text, stop strings, eos ids, echo, Tokenize, and refusals, through the
// worker binary.
TEST(WorkerText, TextInTextOut) {
    const std::string dir = TextModel();
    Tokenizer tk(dir);
    WorkerProc w({}, 256, dir.c_str());
    Env *h = w.Hello();
    ASSERT_NE(h, nullptr);
    ASSERT_NE(h->hello->model, nullptr);
    EXPECT_TRUE(h->hello->model->has_tokenizer);
    EXPECT_TRUE(h->hello->model->has_chat_template);
    EXPECT_EQ(std::vector<uint32_t>(h->hello->model->eos_token_ids,
                                    h->hello->model->eos_token_ids + h->hello->model->n_eos_token_ids),
              (std::vector<uint32_t>{ 6000, 6007 }));
    EXPECT_EQ(h->hello->model->eos_token_id, 6000);
    metrale__internal__v1__envelope__free_unpacked(h, nullptr);

    const char *text = "The quick brown fox, 3.14159 — ünïcödé 日本語 ✨ \n\tjumps.";
    const std::vector<uint32_t> ids = tk.Encode(text, true);
    Metrale__V1__StoppingCriteria st = METRALE__V1__STOPPING_CRITERIA__INIT;
    st.max_new_tokens = 40;
    st.ignore_eos = true;
    Metrale__V1__GenerateRequest g = TextRequest(text, &st);
    w.SubmitRequest(1, &g);                       // text
    w.Submit(2, ids, 40);                         // the same ids (eos ids stop it)
    Metrale__V1__GenerateRequest e = TextRequest(text, &st);
    e.echo = true;
    e.top_logprobs = 2;
    w.SubmitRequest(3, &e);                       // prompt logprobs with bytes
    std::map<uint64_t, Stream> got;
    Collect(w, got, { 1, 2, 3 }, 30000);
    const Stream &a = got[1];
    EXPECT_EQ(a.prompt_tokens, ids.size());
    ASSERT_EQ(a.tokens.size(), 40u);
    EXPECT_EQ(a.reason, METRALE__V1__FINISH_REASON__FINISH_REASON_LENGTH);
    EXPECT_EQ(a.text, tk.Decode(a.tokens));
    for (const std::string &p : a.pieces) EXPECT_TRUE(ValidUtf8(p));
    EXPECT_TRUE(a.bytes[0].empty());              // no logprobs asked: no bytes
    // eos ids stop the request that does not ignore them; the tokens up to it are the same
    const Stream &b = got[2];
    ASSERT_FALSE(b.tokens.empty());
    EXPECT_EQ(b.tokens, std::vector<uint32_t>(a.tokens.begin(), a.tokens.begin() + b.tokens.size()));
    if (b.reason == METRALE__V1__FINISH_REASON__FINISH_REASON_STOP) {
        EXPECT_TRUE(b.tokens.back() == 6000 || b.tokens.back() == 6007);
        EXPECT_EQ(b.stop_token, (int64_t)b.tokens.back());
    } else {
        EXPECT_EQ(b.tokens, a.tokens);
    }
    const Stream &c = got[3];
    EXPECT_EQ(c.tokens, a.tokens);
    ASSERT_EQ(c.echo_ids, std::vector<uint32_t>(ids.begin() + 1, ids.end()));
    for (size_t i = 0; i < c.echo_ids.size(); i++) {
        EXPECT_LE(c.echo_lp[i], 0.0f);
        EXPECT_EQ(c.echo_bytes[i], tk.Bytes(c.echo_ids[i]));
    }
    for (size_t i = 0; i < c.tokens.size(); i++) EXPECT_EQ(c.bytes[i], tk.Bytes(c.tokens[i]));

    // a stop string from the middle of the text: the stream ends where it completes
    ASSERT_GE(a.text.size(), 8u);
    size_t at = a.text.size() / 2, len = 3;
    while (at > 0 && (static_cast<unsigned char>(a.text[at]) & 0xc0) == 0x80) at--;
    while (at + len < a.text.size() && (static_cast<unsigned char>(a.text[at + len]) & 0xc0) == 0x80) len++;
    const std::string stop = a.text.substr(at, len);
    const size_t first = a.text.find(stop);
    char *stops[] = { (char *)"never\x01", (char *)stop.c_str() };
    Metrale__V1__StoppingCriteria st2 = st;
    st2.n_stop = 2;
    st2.stop = stops;
    Metrale__V1__GenerateRequest s1 = TextRequest(text, &st2), s2 = TextRequest(text, &st2);
    w.SubmitRequest(4, &s1);
    Metrale__V1__StoppingCriteria st3 = st2;
    st3.include_stop_str = true;
    s2.stopping = &st3;
    w.SubmitRequest(5, &s2);
    Collect(w, got, { 4, 5 }, 30000);
    EXPECT_EQ(got[4].reason, METRALE__V1__FINISH_REASON__FINISH_REASON_STOP);
    EXPECT_EQ(got[4].stop_string, stop);
    EXPECT_EQ(got[4].text, a.text.substr(0, first));
    EXPECT_EQ(got[5].text, a.text.substr(0, first + stop.size()));
    EXPECT_EQ(got[4].tokens, std::vector<uint32_t>(a.tokens.begin(), a.tokens.begin() + got[4].tokens.size()));
    EXPECT_EQ(got[4].completion_tokens, got[4].tokens.size());
    // the token that completed it was the last one sent
    EXPECT_EQ(tk.Decode(std::vector<uint32_t>(got[4].tokens.begin(), got[4].tokens.end() - 1)).find(stop),
              std::string::npos);

    // refusals: invalid UTF-8, too long once tokenized, bad kwargs for a chat
    Metrale__V1__GenerateRequest bad = TextRequest("ok \xff\xfe", &st);
    w.SubmitRequest(6, &bad);
    std::string long_text;
    for (int i = 0; i < 400; i++) long_text += "word ";
    Metrale__V1__GenerateRequest big = TextRequest(long_text.c_str(), &st);
    w.SubmitRequest(7, &big);
    Metrale__V1__ChatMessage m1 = METRALE__V1__CHAT_MESSAGE__INIT;
    m1.role = (char *)"user";
    m1.content = (char *)"Hi";
    Metrale__V1__ChatMessage *msgs[] = { &m1 };
    Metrale__V1__GenerateRequest chat = TextRequest("", &st);
    chat.n_messages = 1;
    chat.messages = msgs;
    chat.chat_template_kwargs = (char *)"[1, 2]";
    w.SubmitRequest(8, &chat);
    Collect(w, got, { 6, 7, 8 }, 30000);
    for (uint64_t id : { 6, 7, 8 }) {
        EXPECT_TRUE(got[id].invalid) << id;
        EXPECT_TRUE(got[id].tokens.empty()) << id;
        EXPECT_EQ(got[id].reason, METRALE__V1__FINISH_REASON__FINISH_REASON_ERROR) << id;
    }
    EXPECT_NE(got[6].error.find("UTF-8"), std::string::npos) << got[6].error;
    EXPECT_NE(got[7].error.find("once tokenized"), std::string::npos) << got[7].error;
    EXPECT_NE(got[8].error.find("chat"), std::string::npos) << got[8].error;

    // Tokenize: messages give the rendered template's ids, no special tokens added
    Metrale__V1__TokenizeRequest tr = METRALE__V1__TOKENIZE_REQUEST__INIT;
    tr.n_messages = 1;
    tr.messages = msgs;
    Metrale__Internal__V1__TokenizeCall call = METRALE__INTERNAL__V1__TOKENIZE_CALL__INIT;
    call.id = 9;
    call.request = &tr;
    Env env = METRALE__INTERNAL__V1__ENVELOPE__INIT;
    env.body_case = METRALE__INTERNAL__V1__ENVELOPE__BODY_TOKENIZE_CALL;
    env.tokenize_call = &call;
    w.Send(&env);
    Env *r = nullptr;
    for (int i = 0; i < 50 && !r; i++) {
        r = w.Recv(200);
        if (r && r->body_case != METRALE__INTERNAL__V1__ENVELOPE__BODY_TOKENIZED) {
            metrale__internal__v1__envelope__free_unpacked(r, nullptr);
            r = nullptr;
        }
    }
    ASSERT_NE(r, nullptr) << "no Tokenized";
    EXPECT_EQ(r->tokenized->id, 9u);
    EXPECT_STREQ(r->tokenized->error, "");
    ASSERT_NE(r->tokenized->response, nullptr);
    const std::string rendered = r->tokenized->response->prompt_text;
    EXPECT_EQ(rendered.rfind("[gMASK]<sop><|user|>\nHi", 0), 0u) << rendered;
    EXPECT_EQ(std::vector<uint32_t>(r->tokenized->response->token_ids,
                                    r->tokenized->response->token_ids + r->tokenized->response->n_token_ids),
              tk.Encode(rendered, false));
    metrale__internal__v1__envelope__free_unpacked(r, nullptr);
    w.Shutdown();
    EXPECT_EQ(w.Wait(10), 0);
    EXPECT_EQ(system(("rm -rf " + dir).c_str()), 0);
}

// A model folder without tokenizer.json serves ids only: text is refused with the reason.
TEST(WorkerText, NoTokenizerRefusesText) {
    WorkerProc w;
    w.ExpectHello();
    Metrale__V1__StoppingCriteria st = METRALE__V1__STOPPING_CRITERIA__INIT;
    st.max_new_tokens = 4;
    Metrale__V1__GenerateRequest g = TextRequest("hello", &st);
    w.SubmitRequest(1, &g);
    std::map<uint64_t, Stream> got;
    Collect(w, got, { 1 }, 10000);
    EXPECT_TRUE(got[1].invalid);
    EXPECT_NE(got[1].error.find("no tokenizer"), std::string::npos) << got[1].error;
    w.Shutdown();
    EXPECT_EQ(w.Wait(10), 0);
}

}  // namespace
