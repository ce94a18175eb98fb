// common/wire over real ZeroMQ sockets: envelopes round-trip ROUTER <-> DEALER, ROUTER_MANDATORY
// reports an unknown peer, foreign versions and garbage frames are refused without harm, and only
// internal endpoints are accepted without CURVE. The message builders fill every field they are
// given. A closed connection shows as a connection event, after which a send to its peer fails.
// CURVE: a worker with the router's key gets through, one without it or with a wrong one never
// delivers a message, and with authorized keys only the listed workers do.
#include <gtest/gtest.h>
#include <zmq.h>

#include <string>

#include <unistd.h>

extern "C" {
#include "common/wire.h"
}

namespace {

std::string Endpoint() {
    char tmpl[] = "/tmp/mt_wire_XXXXXX";
    return std::string("ipc://") + mkdtemp(tmpl) + "/r.sock";
}

TEST(Wire, RoundTripBothWays) {
    const std::string ep = Endpoint();
    mt_wire_sock *r = nullptr, *d = nullptr;
    mt_error err{};
    ASSERT_EQ(mt_wire_open(MT_WIRE_ROUTER, ep.c_str(), nullptr, &r, &err), MT_OK) << err.msg;
    char identity[MT_WIRE_PEER_MAX];
    mt_wire_identity(7, identity);
    mt_wire_params dp = mt_wire_default_params();
    dp.identity = identity;
    ASSERT_EQ(mt_wire_open(MT_WIRE_DEALER, ep.c_str(), &dp, &d, &err), MT_OK) << err.msg;

    mt_wire_msg hello;
    ASSERT_EQ(mt_wire_send(d, nullptr, mt_wire_hello(&hello, 7, 32, nullptr), &err), MT_OK) << err.msg;
    char peer[MT_WIRE_PEER_MAX];
    mt_envelope *got = nullptr;
    ASSERT_EQ(mt_wire_recv(r, 2000, peer, &got, &err), MT_OK) << err.msg;
    EXPECT_STREQ(peer, "w7");
    ASSERT_EQ(got->body_case, METRALE__INTERNAL__V1__ENVELOPE__BODY_HELLO);
    EXPECT_EQ(got->hello->worker_id, 7u);
    EXPECT_EQ(got->hello->max_sequences, 32u);
    EXPECT_EQ(got->version, (uint32_t)MT_WIRE_VERSION);
    mt_wire_free(got);

    mt_wire_msg abort_msg;
    mt_envelope *back = mt_wire_abort(&abort_msg, 42, METRALE__V1__FINISH_REASON__FINISH_REASON_CANCELLED);
    ASSERT_EQ(mt_wire_send(r, "w7", back, &err), MT_OK) << err.msg;
    ASSERT_EQ(mt_wire_recv(d, 2000, nullptr, &got, &err), MT_OK) << err.msg;
    ASSERT_EQ(got->body_case, METRALE__INTERNAL__V1__ENVELOPE__BODY_ABORT);
    EXPECT_EQ(got->abort->id, 42u);
    EXPECT_EQ(got->abort->reason, METRALE__V1__FINISH_REASON__FINISH_REASON_CANCELLED);
    mt_wire_free(got);

    // ROUTER_MANDATORY: an unknown peer is an error, not a silent drop.
    EXPECT_EQ(mt_wire_send(r, "w99", back, &err), MT_ERR_NOT_FOUND);
    EXPECT_NE(std::string(err.msg).find("w99"), std::string::npos) << err.msg;
    // Nothing waiting: a timeout, not an error.
    EXPECT_EQ(mt_wire_recv(d, 10, nullptr, &got, &err), MT_ERR_NOT_FOUND);
    mt_wire_close(d);
    mt_wire_close(r);
}

TEST(Wire, RefusesForeignVersionsAndGarbageThenKeepsWorking) {
    const std::string ep = Endpoint();
    mt_wire_sock *r = nullptr;
    mt_error err{};
    ASSERT_EQ(mt_wire_open(MT_WIRE_ROUTER, ep.c_str(), nullptr, &r, &err), MT_OK) << err.msg;
    // A raw DEALER that sends whatever it likes.
    void *ctx = zmq_ctx_new(), *raw = zmq_socket(ctx, ZMQ_DEALER);
    zmq_setsockopt(raw, ZMQ_ROUTING_ID, "w1", 2);
    ASSERT_EQ(zmq_connect(raw, ep.c_str()), 0);
    const char junk[] = "\xff\xff\xff not a protobuf";
    zmq_send(raw, junk, sizeof junk, 0);
    Metrale__Internal__V1__Shutdown sd = METRALE__INTERNAL__V1__SHUTDOWN__INIT;
    mt_envelope env = METRALE__INTERNAL__V1__ENVELOPE__INIT;
    env.body_case = METRALE__INTERNAL__V1__ENVELOPE__BODY_SHUTDOWN;
    env.shutdown = &sd;
    env.version = 2;
    uint8_t buf[64];
    size_t n = metrale__internal__v1__envelope__pack(&env, buf);
    zmq_send(raw, buf, n, 0);
    env.version = MT_WIRE_VERSION;
    n = metrale__internal__v1__envelope__pack(&env, buf);
    zmq_send(raw, buf, n, 0);

    char peer[MT_WIRE_PEER_MAX];
    mt_envelope *got = nullptr;
    EXPECT_EQ(mt_wire_recv(r, 2000, peer, &got, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("undecodable"), std::string::npos) << err.msg;
    EXPECT_EQ(mt_wire_recv(r, 2000, peer, &got, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("version 2"), std::string::npos) << err.msg;
    ASSERT_EQ(mt_wire_recv(r, 2000, peer, &got, &err), MT_OK) << err.msg;
    EXPECT_EQ(got->body_case, METRALE__INTERNAL__V1__ENVELOPE__BODY_SHUTDOWN);
    mt_wire_free(got);
    zmq_close(raw);
    zmq_ctx_term(ctx);
    mt_wire_close(r);
}

// Packs env as mt_wire_send would and decodes it again.
mt_envelope *Reencode(mt_envelope *env) {
    env->version = MT_WIRE_VERSION;
    std::string buf(metrale__internal__v1__envelope__get_packed_size(env), '\0');
    metrale__internal__v1__envelope__pack(env, reinterpret_cast<uint8_t *>(&buf[0]));
    return metrale__internal__v1__envelope__unpack(nullptr, buf.size(), reinterpret_cast<const uint8_t *>(buf.data()));
}

TEST(Wire, BuildersFillEveryField) {
    mt_wire_msg m;
    char peer[MT_WIRE_PEER_MAX];
    mt_wire_identity(4294967295u, peer);
    EXPECT_STREQ(peer, "w4294967295");

    Metrale__V1__ModelInfo mi = METRALE__V1__MODEL_INFO__INIT;
    mi.vocab_size = 300;
    mi.backend = const_cast<char *>("cpu");
    mt_envelope *e = Reencode(mt_wire_hello(&m, 3, 16, &mi));
    ASSERT_NE(e, nullptr);
    ASSERT_EQ(e->body_case, METRALE__INTERNAL__V1__ENVELOPE__BODY_HELLO);
    EXPECT_EQ(e->hello->worker_id, 3u);
    EXPECT_EQ(e->hello->max_sequences, 16u);
    ASSERT_NE(e->hello->model, nullptr);
    EXPECT_EQ(e->hello->model->vocab_size, 300u);
    EXPECT_STREQ(e->hello->model->backend, "cpu");
    mt_wire_free(e);

    Metrale__V1__WorkerStats ws = METRALE__V1__WORKER_STATS__INIT;
    ws.live_sequences = 5;
    e = Reencode(mt_wire_heartbeat(&m, 9, &ws, false));
    ASSERT_EQ(e->body_case, METRALE__INTERNAL__V1__ENVELOPE__BODY_HEARTBEAT);
    EXPECT_EQ(e->heartbeat->seq, 9u);
    ASSERT_NE(e->heartbeat->stats, nullptr);
    EXPECT_EQ(e->heartbeat->stats->live_sequences, 5u);
    EXPECT_FALSE(e->heartbeat->hello_wanted);
    mt_wire_free(e);
    e = Reencode(mt_wire_heartbeat(&m, 10, nullptr, true));
    EXPECT_EQ(e->heartbeat->stats, nullptr);
    EXPECT_TRUE(e->heartbeat->hello_wanted);
    mt_wire_free(e);

    Metrale__V1__GenerateRequest req = METRALE__V1__GENERATE_REQUEST__INIT;
    req.request_id = const_cast<char *>("r1");
    e = Reencode(mt_wire_submit(&m, 77, &req, 1234));
    ASSERT_EQ(e->body_case, METRALE__INTERNAL__V1__ENVELOPE__BODY_SUBMIT);
    EXPECT_EQ(e->submit->id, 77u);
    EXPECT_EQ(e->submit->deadline_unix_ms, 1234u);
    ASSERT_NE(e->submit->request, nullptr);
    EXPECT_STREQ(e->submit->request->request_id, "r1");
    mt_wire_free(e);

    Metrale__V1__GeneratedToken t0 = METRALE__V1__GENERATED_TOKEN__INIT, t1 = METRALE__V1__GENERATED_TOKEN__INIT;
    t0.token_id = 11;
    t1.token_id = 12;
    Metrale__V1__GeneratedToken *toks[] = {&t0, &t1};
    e = Reencode(mt_wire_tokens(&m, 78, toks, 2, "h\xc3\xa9", toks, 1));
    ASSERT_EQ(e->body_case, METRALE__INTERNAL__V1__ENVELOPE__BODY_TOKENS);
    EXPECT_EQ(e->tokens->id, 78u);
    ASSERT_EQ(e->tokens->n_tokens, 2u);
    EXPECT_EQ(e->tokens->tokens[1]->token_id, 12u);
    EXPECT_STREQ(e->tokens->text, "h\xc3\xa9");
    ASSERT_EQ(e->tokens->n_prompt_logprobs, 1u);
    EXPECT_EQ(e->tokens->prompt_logprobs[0]->token_id, 11u);
    mt_wire_free(e);

    mt_wire_end end = mt_wire_end_of(METRALE__V1__FINISH_REASON__FINISH_REASON_ERROR);
    end.prompt_tokens = 4;
    end.completion_tokens = 2;
    end.message = "out of pages";
    e = Reencode(mt_wire_finished(&m, 79, &end));
    ASSERT_EQ(e->body_case, METRALE__INTERNAL__V1__ENVELOPE__BODY_FINISHED);
    EXPECT_EQ(e->finished->id, 79u);
    ASSERT_NE(e->finished->final, nullptr);
    EXPECT_EQ(e->finished->final->finish_reason, METRALE__V1__FINISH_REASON__FINISH_REASON_ERROR);
    EXPECT_STREQ(e->finished->final->error_message, "out of pages");
    ASSERT_NE(e->finished->final->usage, nullptr);
    EXPECT_EQ(e->finished->final->usage->prompt_tokens, 4u);
    EXPECT_EQ(e->finished->final->usage->completion_tokens, 2u);
    EXPECT_EQ(e->finished->final->stop_reason_case, METRALE__V1__FINAL__STOP_REASON__NOT_SET);
    mt_wire_free(e);
    end = mt_wire_end_of(METRALE__V1__FINISH_REASON__FINISH_REASON_STOP);
    end.text = "tail";
    end.stop_string = "\n\n";
    end.invalid_argument = true;
    e = Reencode(mt_wire_finished(&m, 80, &end));
    EXPECT_STREQ(e->finished->final->error_message, "");
    EXPECT_STREQ(e->finished->text, "tail");
    EXPECT_TRUE(e->finished->invalid_argument);
    ASSERT_EQ(e->finished->final->stop_reason_case, METRALE__V1__FINAL__STOP_REASON_STOP_STRING);
    EXPECT_STREQ(e->finished->final->stop_string, "\n\n");
    mt_wire_free(e);
    end = mt_wire_end_of(METRALE__V1__FINISH_REASON__FINISH_REASON_STOP);
    end.stop_token_id = 0;
    e = Reencode(mt_wire_finished(&m, 81, &end));
    ASSERT_EQ(e->finished->final->stop_reason_case, METRALE__V1__FINAL__STOP_REASON_STOP_TOKEN_ID);
    EXPECT_EQ(e->finished->final->stop_token_id, 0u);
    mt_wire_free(e);

    Metrale__V1__TokenizeRequest treq = METRALE__V1__TOKENIZE_REQUEST__INIT;
    treq.text = (char *)"hello";
    e = Reencode(mt_wire_tokenize_call(&m, 82, &treq));
    ASSERT_EQ(e->body_case, METRALE__INTERNAL__V1__ENVELOPE__BODY_TOKENIZE_CALL);
    EXPECT_EQ(e->tokenize_call->id, 82u);
    EXPECT_STREQ(e->tokenize_call->request->text, "hello");
    mt_wire_free(e);
    e = Reencode(mt_wire_tokenized(&m, 83, nullptr, "not valid UTF-8"));
    ASSERT_EQ(e->body_case, METRALE__INTERNAL__V1__ENVELOPE__BODY_TOKENIZED);
    EXPECT_STREQ(e->tokenized->error, "not valid UTF-8");
    mt_wire_free(e);

    e = Reencode(mt_wire_shutdown(&m));
    EXPECT_EQ(e->body_case, METRALE__INTERNAL__V1__ENVELOPE__BODY_SHUTDOWN);
    mt_wire_free(e);
}

TEST(Wire, OnlyInternalEndpointsWithoutCurve) {
    mt_wire_sock *s = nullptr;
    mt_error err{};
    EXPECT_EQ(mt_wire_open(MT_WIRE_ROUTER, "tcp://0.0.0.0:5555", nullptr, &s, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("not internal"), std::string::npos) << err.msg;
    mt_wire_params dp = mt_wire_default_params();
    dp.identity = "";
    EXPECT_EQ(mt_wire_open(MT_WIRE_DEALER, "ipc:///tmp/x.sock", &dp, &s, &err), MT_ERR_INVALID);
    EXPECT_EQ(s, nullptr);
    if (!mt_wire_has_curve()) GTEST_SKIP() << "this libzmq has no CURVE";
    char pub[MT_WIRE_KEY_Z85 + 1], sec[MT_WIRE_KEY_Z85 + 1];
    ASSERT_EQ(mt_wire_keypair(pub, sec, &err), MT_OK) << err.msg;
    mt_wire_params rp = mt_wire_default_params();
    rp.curve_secret_key = sec;
    ASSERT_EQ(mt_wire_open(MT_WIRE_ROUTER, "tcp://0.0.0.0:*", &rp, &s, &err), MT_OK) << err.msg;
    char ep[256];
    mt_wire_endpoint(s, ep, sizeof ep);
    EXPECT_EQ(std::string(ep).rfind("tcp://0.0.0.0:", 0), 0u) << ep;
    EXPECT_EQ(std::string(ep).find('*'), std::string::npos) << ep;
    mt_wire_close(s);
    rp.curve_secret_key = "not a key";
    EXPECT_EQ(mt_wire_open(MT_WIRE_ROUTER, "tcp://0.0.0.0:*", &rp, &s, &err), MT_ERR_INVALID);
    EXPECT_EQ(s, nullptr);
}

// Sends a Hello from d; whether the router r receives it within ms.
bool HelloGetsThrough(mt_wire_sock *d, mt_wire_sock *r, int ms) {
    mt_wire_msg hello;
    mt_error err{};
    mt_wire_send(d, nullptr, mt_wire_hello(&hello, 7, 4, nullptr), &err);
    char peer[MT_WIRE_PEER_MAX];
    mt_envelope *got = nullptr;
    if (mt_wire_recv(r, ms, peer, &got, &err) != MT_OK) return false;
    mt_wire_free(got);
    return true;
}

TEST(Wire, ConnectionClosedShowsAsAnEventAndSendsFail) {
    const std::string ep = Endpoint();
    mt_wire_sock *r = nullptr, *d = nullptr;
    mt_error err{};
    ASSERT_EQ(mt_wire_open(MT_WIRE_ROUTER, ep.c_str(), nullptr, &r, &err), MT_OK) << err.msg;
    EXPECT_GE(mt_wire_event_fd(r), 0);
    mt_wire_params dp = mt_wire_default_params();
    dp.identity = "w7";
    ASSERT_EQ(mt_wire_open(MT_WIRE_DEALER, ep.c_str(), &dp, &d, &err), MT_OK) << err.msg;
    EXPECT_EQ(mt_wire_event_fd(d), -1);
    ASSERT_TRUE(HelloGetsThrough(d, r, 2000));
    EXPECT_EQ(mt_wire_take_disconnects(r), 0);
    mt_wire_msg m;
    EXPECT_EQ(mt_wire_send(r, "w7", mt_wire_heartbeat(&m, 1, nullptr, false), &err), MT_OK) << err.msg;
    const double t0 = mt_now();
    mt_wire_close(d);
    int closed = 0;
    while (closed == 0 && mt_now() - t0 < 2) {
        closed += mt_wire_take_disconnects(r);
        usleep(1000);
    }
    EXPECT_EQ(closed, 1);
    mt_status st = MT_OK;
    while (st == MT_OK && mt_now() - t0 < 2) {
        st = mt_wire_send(r, "w7", mt_wire_heartbeat(&m, 2, nullptr, false), &err);
        if (st == MT_OK) usleep(1000);
    }
    EXPECT_EQ(st, MT_ERR_NOT_FOUND);
    EXPECT_LT(mt_now() - t0, 0.5) << "the closed connection took this long to show";
    mt_wire_close(r);
}

TEST(Wire, KeysWriteReadAndDerive) {
    if (!mt_wire_has_curve()) GTEST_SKIP() << "this libzmq has no CURVE";
    char pub[MT_WIRE_KEY_Z85 + 1], sec[MT_WIRE_KEY_Z85 + 1], derived[MT_WIRE_KEY_Z85 + 1], back[MT_WIRE_KEY_Z85 + 1];
    mt_error err{};
    ASSERT_EQ(mt_wire_keypair(pub, sec, &err), MT_OK) << err.msg;
    ASSERT_EQ(mt_wire_key_public(sec, derived, &err), MT_OK) << err.msg;
    EXPECT_STREQ(derived, pub);
    char tmpl[] = "/tmp/mt_keys_XXXXXX";
    const std::string dir = mkdtemp(tmpl);
    const std::string a = dir + "/a.pub", b = dir + "/b.pub", other = dir + "/a.key";
    FILE *f = fopen(a.c_str(), "w");
    fprintf(f, "  %s\n", pub);
    fclose(f);
    ASSERT_EQ(mt_wire_key_read(a.c_str(), back, &err), MT_OK) << err.msg;
    EXPECT_STREQ(back, pub);
    f = fopen(other.c_str(), "w");
    fprintf(f, "%s\n", sec);
    fclose(f);
    char (*keys)[MT_WIRE_KEY_Z85 + 1] = nullptr;
    size_t n = 0;
    ASSERT_EQ(mt_wire_keys_read_dir(dir.c_str(), &keys, &n, &err), MT_OK) << err.msg;
    ASSERT_EQ(n, 1u);  // only *.pub files
    EXPECT_STREQ(keys[0], pub);
    free(keys);
    f = fopen(b.c_str(), "w");
    fprintf(f, "too short\n");
    fclose(f);
    EXPECT_EQ(mt_wire_keys_read_dir(dir.c_str(), &keys, &n, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("b.pub"), std::string::npos) << err.msg;
    EXPECT_EQ(keys, nullptr);
    EXPECT_EQ(mt_wire_key_read((dir + "/none").c_str(), back, &err), MT_ERR_IO);
    unlink(a.c_str());
    unlink(b.c_str());
    unlink(other.c_str());
    EXPECT_EQ(mt_wire_keys_read_dir(dir.c_str(), &keys, &n, &err), MT_ERR_NOT_FOUND);
    rmdir(dir.c_str());
}

struct KeyPair {
    char pub[MT_WIRE_KEY_Z85 + 1], sec[MT_WIRE_KEY_Z85 + 1];
    KeyPair() {
        mt_error err{};
        EXPECT_EQ(mt_wire_keypair(pub, sec, &err), MT_OK) << err.msg;
    }
};

// A CURVE router on tcp://127.0.0.1:* with `clients` (nullptr: any); its bound endpoint in ep.
mt_wire_sock *CurveRouter(const KeyPair &k, const char *const *clients, size_t n, std::string *ep) {
    mt_wire_params rp = mt_wire_default_params();
    rp.curve_secret_key = k.sec;
    rp.curve_clients = clients;
    rp.n_curve_clients = n;
    mt_wire_sock *r = nullptr;
    mt_error err{};
    EXPECT_EQ(mt_wire_open(MT_WIRE_ROUTER, "tcp://127.0.0.1:*", &rp, &r, &err), MT_OK) << err.msg;
    char buf[256] = "";
    if (r) mt_wire_endpoint(r, buf, sizeof buf);
    *ep = buf;
    return r;
}

mt_wire_sock *Dealer(const std::string &ep, const char *server_key, const char *secret) {
    mt_wire_params dp = mt_wire_default_params();
    dp.identity = "w7";
    dp.curve_server_key = server_key;
    dp.curve_secret_key = secret;
    mt_wire_sock *d = nullptr;
    mt_error err{};
    EXPECT_EQ(mt_wire_open(MT_WIRE_DEALER, ep.c_str(), &dp, &d, &err), MT_OK) << err.msg;
    return d;
}

TEST(Wire, CurveAdmitsOnlyTheRightKeys) {
    if (!mt_wire_has_curve()) GTEST_SKIP() << "this libzmq has no CURVE";
    KeyPair router, worker, stranger;
    std::string ep;
    mt_wire_sock *r = CurveRouter(router, nullptr, 0, &ep);
    ASSERT_NE(r, nullptr);
    mt_wire_sock *good = Dealer(ep, router.pub, worker.sec);
    EXPECT_TRUE(HelloGetsThrough(good, r, 3000));
    mt_wire_close(good);
    mt_wire_sock *plain = Dealer(ep, nullptr, nullptr);
    EXPECT_FALSE(HelloGetsThrough(plain, r, 500)) << "a worker without keys got through";
    mt_wire_close(plain);
    mt_wire_sock *wrong = Dealer(ep, stranger.pub, worker.sec);
    EXPECT_FALSE(HelloGetsThrough(wrong, r, 500)) << "a worker with a wrong router key got through";
    mt_wire_close(wrong);
    // The failed handshakes closed their connections too; those do not count as a peer's.
    usleep(100 * 1000);
    EXPECT_EQ(mt_wire_take_disconnects(r), 1) << "only the first worker's connection was a peer's";
    good = Dealer(ep, router.pub, worker.sec);
    EXPECT_TRUE(HelloGetsThrough(good, r, 3000));
    mt_wire_close(good);
    int closed = 0;
    for (int i = 0; i < 1000 && !closed; i++) {
        closed = mt_wire_take_disconnects(r);
        usleep(1000);
    }
    EXPECT_EQ(closed, 1);
    mt_wire_close(r);
}

TEST(Wire, CurveAuthorizedKeysAdmitOnlyThoseWorkers) {
    if (!mt_wire_has_curve()) GTEST_SKIP() << "this libzmq has no CURVE";
    KeyPair router, worker, stranger;
    const char *clients[] = { worker.pub };
    std::string ep;
    mt_wire_sock *r = CurveRouter(router, clients, 1, &ep);
    ASSERT_NE(r, nullptr);
    mt_wire_sock *listed = Dealer(ep, router.pub, worker.sec);
    EXPECT_TRUE(HelloGetsThrough(listed, r, 3000));
    mt_wire_close(listed);
    mt_wire_sock *unlisted = Dealer(ep, router.pub, stranger.sec);
    EXPECT_FALSE(HelloGetsThrough(unlisted, r, 500)) << "a worker whose key is not listed got through";
    mt_wire_close(unlisted);
    mt_wire_close(r);  // joins the ZAP thread
}

}  // namespace
