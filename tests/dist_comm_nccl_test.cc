// worker/dist NCCL communicator. On any host: the id's hex form and the argument checks. On a GPU
// (skipped with the reason elsewhere): a size-1 group, whose all-reduce of a device buffer is the
// identity and whose all_gather and broadcast copy, eagerly and replayed from a CUDA graph
// captured on the backend's stream; and the watchdog aborting a collective stuck on the device.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/cuda_test_util.h"
#include "worker/dist/comm_nccl.h"

namespace {

TEST(DistCommNcclId, HexRoundTripAndErrors) {
    std::string hex;
    mt_comm_nccl_id want;
    for (int i = 0; i < MT_COMM_NCCL_ID_BYTES; i++) {
        want.bytes[i] = (unsigned char)(i * 37 + 5);
        char two[3];
        snprintf(two, sizeof two, i % 2 ? "%02x" : "%02X", want.bytes[i]);  // either case
        hex += two;
    }
    mt_comm_nccl_id got;
    mt_error err{};
    ASSERT_EQ(mt_comm_nccl_id_parse(hex.c_str(), &got, &err), MT_OK) << err.msg;
    EXPECT_EQ(0, memcmp(got.bytes, want.bytes, sizeof got.bytes));

    mt_comm_nccl_id kept = got;
    EXPECT_EQ(mt_comm_nccl_id_parse(hex.substr(1).c_str(), &got, &err), MT_ERR_INVALID);
    EXPECT_TRUE(strstr(err.msg, "expected 256 hex digits")) << err.msg;
    std::string bad = hex;
    bad[10] = 'g';
    EXPECT_EQ(mt_comm_nccl_id_parse(bad.c_str(), &got, &err), MT_ERR_INVALID);
    EXPECT_TRUE(strstr(err.msg, "not hex")) << err.msg;
    EXPECT_EQ(mt_comm_nccl_id_parse(nullptr, &got, &err), MT_ERR_INVALID);
    EXPECT_EQ(0, memcmp(got.bytes, kept.bytes, sizeof got.bytes)) << "a failed parse changed the id";

    char small[16];
    EXPECT_EQ(mt_comm_nccl_id_new(small, sizeof small, &err), MT_ERR_INVALID);
}

TEST(DistCommNcclId, NeedsACudaBackend) {
    mt_backend *cpu = mt_cpu_backend_new(1);
    ASSERT_NE(cpu, nullptr);
    mt_comm_nccl_id id{};
    mt_error err{};
    EXPECT_EQ(mt_comm_nccl_new(&id, 0, 1, cpu, nullptr, &err), nullptr);
    EXPECT_TRUE(strstr(err.msg, "CUDA backend")) << err.msg;
    EXPECT_EQ(mt_comm_nccl_new(&id, 1, 1, cpu, nullptr, &err), nullptr);
    EXPECT_EQ(mt_comm_nccl_new(nullptr, 0, 1, cpu, nullptr, &err), nullptr);
    mt_backend_free(cpu);
}

class DistCommNccl : public ::testing::Test {
  protected:
    void SetUp() override {
        const std::string why = NoGpuReason();
        if (!why.empty()) GTEST_SKIP() << "no GPU: " << why;
        mt_error err{};
        be_ = mt_cuda_backend_new(0, NULL, &err);
        ASSERT_NE(be_, nullptr) << err.msg;
    }
    void TearDown() override { mt_backend_free(be_); }

    // A size-1 communicator on be_.
    mt_comm *One(const mt_comm_nccl_params *p = nullptr) {
        char hex[MT_COMM_NCCL_ID_HEX];
        mt_error err{};
        EXPECT_EQ(mt_comm_nccl_id_new(hex, sizeof hex, &err), MT_OK) << err.msg;
        mt_comm_nccl_id id;
        EXPECT_EQ(mt_comm_nccl_id_parse(hex, &id, &err), MT_OK) << err.msg;
        mt_comm *c = mt_comm_nccl_new(&id, 0, 1, be_, p, &err);
        EXPECT_NE(c, nullptr) << err.msg;
        return c;
    }
    float *Dev(const std::vector<float> &h) {
        float *d = (float *)be_->ops->alloc(be_, h.size() * 4);
        be_->ops->upload(be_, d, h.data(), h.size() * 4);
        return d;
    }
    std::vector<float> Host(const float *d, size_t n) {
        std::vector<float> h(n);
        be_->ops->download(be_, h.data(), d, n * 4);
        return h;
    }
    std::vector<float> Data(uint64_t seed, size_t n) {
        Rng r(seed);
        std::vector<float> v(n);
        for (auto &x : v) x = r.Uniform(-3.f, 3.f);
        return v;
    }

    mt_backend *be_ = nullptr;
};

TEST_F(DistCommNccl, SizeOneIsIdentityEagerAndInAGraph) {
    mt_comm *c = One();
    ASSERT_NE(c, nullptr);
    EXPECT_TRUE(c->queued);
    EXPECT_EQ(c->size, 1);
    const size_t n = 100003;
    std::vector<float> x = Data(1, n);
    float *buf = Dev(x), *out = Dev(std::vector<float>(n, 0.f));

    // Eager.
    ASSERT_EQ(mt_comm_all_reduce_sum(c, buf, n), MT_OK) << c->err.msg;
    ASSERT_EQ(mt_comm_all_gather(c, buf, out, n), MT_OK) << c->err.msg;
    ASSERT_EQ(mt_comm_broadcast(c, buf, n * 4, 0), MT_OK) << c->err.msg;
    ASSERT_EQ(mt_comm_barrier(c), MT_OK) << c->err.msg;
    EXPECT_EQ(0, memcmp(Host(buf, n).data(), x.data(), n * 4)) << "all_reduce_sum of one rank changed the buffer";
    EXPECT_EQ(0, memcmp(Host(out, n).data(), x.data(), n * 4)) << "all_gather of one rank did not copy";
    EXPECT_EQ(mt_comm_broadcast(c, buf, 4, 1), MT_ERR_INVALID);

    // Captured on the backend's stream, then replayed on new data.
    ASSERT_EQ(be_->ops->graph_begin(be_), MT_OK);
    mt_status st_ar = mt_comm_all_reduce_sum(c, buf, n);
    mt_status st_ag = mt_comm_all_gather(c, buf, out, n);
    mt_status st_bar = mt_comm_barrier(c);  // refused inside a capture, without breaking it
    mt_graph *g = nullptr;
    ASSERT_EQ(be_->ops->graph_end(be_, &g), MT_OK);
    ASSERT_NE(g, nullptr);
    ASSERT_EQ(st_ar, MT_OK) << c->err.msg;
    ASSERT_EQ(st_ag, MT_OK) << c->err.msg;
    EXPECT_EQ(st_bar, MT_ERR_STATE);
    for (int rep = 0; rep < 3; rep++) {
        std::vector<float> y = Data(10 + rep, n);
        be_->ops->upload(be_, buf, y.data(), n * 4);
        be_->ops->zero(be_, out, n * 4);
        ASSERT_EQ(be_->ops->graph_launch(be_, g), MT_OK);
        EXPECT_EQ(0, memcmp(Host(buf, n).data(), y.data(), n * 4)) << "replay " << rep;
        EXPECT_EQ(0, memcmp(Host(out, n).data(), y.data(), n * 4)) << "replay " << rep;
    }
    usleep(300 * 1000);  // the watchdog reads the event recorded by the replays
    EXPECT_EQ(mt_comm_barrier(c), MT_OK) << c->err.msg;
    EXPECT_EQ(mt_comm_check(c), MT_OK) << c->err.msg;
    be_->ops->graph_free(be_, g);
    mt_comm_free(c);
    be_->ops->free(be_, buf);
    be_->ops->free(be_, out);
}

// A host function that holds the stream for a while: the collective queued behind it stays
// pending on the device as if a peer never came.
void CUDART_CB HoldStream(void *) { usleep(1500 * 1000); }

TEST_F(DistCommNccl, WatchdogAbortsACollectiveStuckOnTheDevice) {
    mt_comm_nccl_params p = mt_comm_nccl_default_params();
    p.timeout_s = 0.3;
    p.poll_s = 0.05;
    mt_comm *c = One(&p);
    ASSERT_NE(c, nullptr);
    float *buf = Dev(Data(2, 1024));
    ASSERT_EQ(cudaLaunchHostFunc(mt_cuda_backend_stream(be_), HoldStream, nullptr), cudaSuccess);
    const double t0 = mt_now();
    ASSERT_EQ(mt_comm_all_reduce_sum(c, buf, 1024), MT_OK) << c->err.msg;  // queued
    EXPECT_LT(mt_now() - t0, 0.2) << "the call waited for the device";
    be_->ops->sync(be_);  // the host function ends; the aborted collective does nothing
    const double took = mt_now() - t0;
    EXPECT_EQ(mt_comm_check(c), MT_ERR_STATE);
    EXPECT_EQ(mt_comm_all_reduce_sum(c, buf, 1024), MT_ERR_STATE);
    EXPECT_TRUE(strstr(c->err.msg, "pending on the device")) << c->err.msg;
    EXPECT_LT(took, 5.0);
    mt_comm_free(c);
    be_->ops->free(be_, buf);
}

}  // namespace
