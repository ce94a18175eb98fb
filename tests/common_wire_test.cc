// common/wire over real ZeroMQ sockets: envelopes round-trip ROUTER <-> DEALER, ROUTER_MANDATORY
// reports an unknown peer, foreign versions and garbage frames are refused without harm, and only
// internal endpoints are accepted.
#include <gtest/gtest.h>
#include <zmq.h>

#include <string>

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
    ASSERT_EQ(mt_wire_open(MT_WIRE_DEALER, ep.c_str(), "w7", &d, &err), MT_OK) << err.msg;

    Metrale__Internal__V1__Hello hello = METRALE__INTERNAL__V1__HELLO__INIT;
    hello.worker_id = 7;
    hello.max_sequences = 32;
    mt_envelope env = METRALE__INTERNAL__V1__ENVELOPE__INIT;
    env.body_case = METRALE__INTERNAL__V1__ENVELOPE__BODY_HELLO;
    env.hello = &hello;
    ASSERT_EQ(mt_wire_send(d, nullptr, &env, &err), MT_OK) << err.msg;
    char peer[MT_WIRE_PEER_MAX];
    mt_envelope *got = nullptr;
    ASSERT_EQ(mt_wire_recv(r, 2000, peer, &got, &err), MT_OK) << err.msg;
    EXPECT_STREQ(peer, "w7");
    ASSERT_EQ(got->body_case, METRALE__INTERNAL__V1__ENVELOPE__BODY_HELLO);
    EXPECT_EQ(got->hello->worker_id, 7u);
    EXPECT_EQ(got->hello->max_sequences, 32u);
    EXPECT_EQ(got->version, (uint32_t)MT_WIRE_VERSION);
    mt_wire_free(got);

    Metrale__Internal__V1__Abort abort_msg = METRALE__INTERNAL__V1__ABORT__INIT;
    abort_msg.id = 42;
    mt_envelope back = METRALE__INTERNAL__V1__ENVELOPE__INIT;
    back.body_case = METRALE__INTERNAL__V1__ENVELOPE__BODY_ABORT;
    back.abort = &abort_msg;
    ASSERT_EQ(mt_wire_send(r, "w7", &back, &err), MT_OK) << err.msg;
    ASSERT_EQ(mt_wire_recv(d, 2000, nullptr, &got, &err), MT_OK) << err.msg;
    ASSERT_EQ(got->body_case, METRALE__INTERNAL__V1__ENVELOPE__BODY_ABORT);
    EXPECT_EQ(got->abort->id, 42u);
    mt_wire_free(got);

    // ROUTER_MANDATORY: an unknown peer is an error, not a silent drop.
    EXPECT_EQ(mt_wire_send(r, "w99", &back, &err), MT_ERR_NOT_FOUND);
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

TEST(Wire, OnlyInternalEndpoints) {
    mt_wire_sock *s = nullptr;
    mt_error err{};
    EXPECT_EQ(mt_wire_open(MT_WIRE_ROUTER, "tcp://0.0.0.0:5555", nullptr, &s, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("not internal"), std::string::npos) << err.msg;
    EXPECT_EQ(mt_wire_open(MT_WIRE_DEALER, "ipc:///tmp/x.sock", "", &s, &err), MT_ERR_INVALID);
    EXPECT_EQ(s, nullptr);
}

}  // namespace
