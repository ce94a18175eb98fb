// tests/kernels_cuda_moe_grouped_test.cc: cu_moe_experts_grouped (kernels/cuda/cuda_moe_grouped.cu),
// the routed experts grouped by expert on the device, against the CPU backend's moe_experts (the
// reference) on the same random data: small shapes over every weight dtype, duplicate and
// all-same expert choices, the real model's shapes (hidden 4096, 288 experts of 2048, top-8), a
// call captured in a CUDA graph and replayed with other indices in the same buffers. Then timings
// at the real shapes against the backend's moe_experts, with the bytes of the touched experts.
// Skips when no CUDA device is usable (CI and dev hosts have the toolkit but no GPU).
//
// Tolerance, ||cuda - cpu|| / ||cpu|| over the whole output: 1e-5 (every dot product is an fp32
// sum on both sides, in another order; K up to 4096). Expert weights: the GPU's weight_random, the
// CPU viewing a copy of the same bytes.
#include <gtest/gtest.h>

#include "tests/cuda_test_util.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_ops.h"

namespace {

const mt_cuda_params kExact = ExactParams();

constexpr double kTol = 1e-5;


uint64_t g_seed = 777;
uint64_t NextSeed() { return g_seed++; }

std::vector<float> Rand(size_t n, float lo = -1.f, float hi = 1.f) {
    Rng r(NextSeed());
    std::vector<float> v(n);
    for (float &f : v) f = r.Uniform(lo, hi);
    return v;
}


class CudaMoeGrouped : public ::testing::Test {
  protected:
    static void SetUpTestSuite() {
        if (!NoGpuReason().empty()) return;
        mt_error err{};
        gpu_ = mt_cuda_backend_new(0, &kExact, &err);
        if (!gpu_) gpu_err_ = err.msg;
        cpu_ = mt_cpu_backend_new(0);
    }
    static void TearDownTestSuite() {
        if (gpu_) cu_moe_grouped_free((cu_backend *)gpu_);
        mt_backend_free(gpu_);
        mt_backend_free(cpu_);
        gpu_ = cpu_ = nullptr;
    }
    void SetUp() override {
        std::string why = NoGpuReason();
        if (!why.empty()) GTEST_SKIP() << "no CUDA GPU on this host (" << why << "); skipping";
        ASSERT_NE(gpu_, nullptr) << "mt_cuda_backend_new: " << gpu_err_;
        ASSERT_NE(cpu_, nullptr);
    }
    void TearDown() override {
        if (gpu_) {
            EXPECT_EQ(((cu_backend *)gpu_)->sticky, MT_OK) << "a CUDA op failed (see the log)";
        }
    }

    // E experts cycling over `distinct` weight triples made by the GPU's weight_random; the CPU
    // gets a copy of the same bytes (its own weight_random can differ in an ulp of the normal
    // sample, which after bf16 rounding moved results by ~1e-5). cpu == false: the GPU's only
    // (timing). ex.cpu / ex.gpu are the host tables.
    struct Experts {
        std::vector<mt_weight> gw;                // gate, up, down per distinct expert
        std::vector<std::vector<uint8_t>> bytes;  // the CPU's views point here
        std::vector<mt_expert> cpu, gpu;
        ~Experts() {
            for (mt_weight &w : gw) gpu_->ops->weight_free(gpu_, &w);
        }
    };
    static std::unique_ptr<Experts> MakeExperts(mt_dtype dt, int E, int distinct, int H, int I, bool cpu = true) {
        auto ex = std::make_unique<Experts>();
        std::vector<mt_weight> cw;
        for (int d = 0; d < distinct; d++) {
            for (int m = 0; m < 3; m++) {
                const int64_t rows = m < 2 ? I : H, cols = m < 2 ? H : I;
                const float std_ = 1.f / std::sqrt((float)cols);
                mt_weight g{}, c{};
                EXPECT_EQ(gpu_->ops->weight_random(gpu_, dt, rows, cols, NextSeed() * 7919, 0.f, std_, &g), MT_OK);
                ex->gw.push_back(g);
                if (cpu) {
                    ex->bytes.emplace_back((size_t)rows * cols * mt_dtype_size(dt));
                    gpu_->ops->download(gpu_, ex->bytes.back().data(), g.data, ex->bytes.back().size());
                    EXPECT_EQ(cpu_->ops->weight(cpu_, ex->bytes.back().data(), dt, rows, cols, &c), MT_OK);
                    cw.push_back(c);
                }
            }
        }
        for (int e = 0; e < E; e++) {
            const int d = (e * 7) % distinct;
            ex->gpu.push_back({ex->gw[3 * d], ex->gw[3 * d + 1], ex->gw[3 * d + 2]});
            if (cpu) ex->cpu.push_back({cw[3 * d], cw[3 * d + 1], cw[3 * d + 2]});
        }
        return ex;
    }

    // Distinct random experts per row, from [0, E).
    static std::vector<int32_t> RandIdx(int n, int k, int E) { return DistinctIdx(NextSeed(), n, k, E); }

    template <class T> static T *Put(mt_backend *be, const std::vector<T> &h) {
        T *p = (T *)be->ops->alloc(be, h.size() * sizeof(T));
        EXPECT_NE(p, nullptr);
        be->ops->upload(be, p, h.data(), h.size() * sizeof(T));
        return p;
    }
    template <class T> static std::vector<T> Get(mt_backend *be, const T *p, size_t n) {
        std::vector<T> h(n);
        be->ops->download(be, h.data(), p, n * sizeof(T));
        return h;
    }
    static void Drop(mt_backend *be, const void *p) { be->ops->free(be, (void *)p); }

    // out += experts(x) by cu_moe_experts_grouped and by the CPU's moe_experts on the same fresh
    // x, weights, out and the given idx; the relative error.
    static double Check(const Experts &ex, const std::vector<int32_t> &idx, int n, int k, int H, int I, float L) {
        std::vector<float> x = Rand((size_t)n * H), wts = Rand((size_t)n * k, 0.05f, 1.f);
        std::vector<float> want = Rand((size_t)n * H);
        float *gx = Put(gpu_, x), *gw = Put(gpu_, wts), *go = Put(gpu_, want);
        int32_t *gi = Put(gpu_, idx);
        cpu_->ops->moe_experts(cpu_, want.data(), x.data(), idx.data(), wts.data(), ex.cpu.data(), n, k, H, I, L);
        cu_moe_experts_grouped(gpu_, go, gx, gi, gw, ex.gpu.data(), n, k, H, I, L);
        const double e = RelErr(Get(gpu_, go, want.size()), want);
        for (const void *p : {(const void *)gx, (const void *)gw, (const void *)go, (const void *)gi}) Drop(gpu_, p);
        return e;
    }

    static double Seconds() {
        return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    }
    // Mean seconds per call of f (after one warm-up call), f enqueueing on gpu_.
    template <class F> static double TimeGpu(F f, int reps) {
        f();
        gpu_->ops->sync(gpu_);
        const double t0 = Seconds();
        for (int r = 0; r < reps; r++) f();
        gpu_->ops->sync(gpu_);
        return (Seconds() - t0) / reps;
    }

    static mt_backend *gpu_, *cpu_;
    static std::string gpu_err_;
};
mt_backend *CudaMoeGrouped::gpu_ = nullptr;
mt_backend *CudaMoeGrouped::cpu_ = nullptr;
std::string CudaMoeGrouped::gpu_err_;

TEST_F(CudaMoeGrouped, SmallShapes) {
    Worst worst{"grouped"};
    struct S { int E, k, H, I; };
    // H, I multiples of 8 take the 16-byte loads; 36/20 the element-wise ones.
    for (const S &s : {S{16, 4, 64, 32}, S{16, 4, 36, 20}, S{40, 8, 256, 96}}) {
        for (mt_dtype dt : {MT_BF16, MT_F16, MT_F32}) {
            auto ex = MakeExperts(dt, s.E, s.E, s.H, s.I);
            for (int n : {1, 3, 9, 16, 64, 130}) {
                for (float L : {10.f, 0.5f}) {
                    const double e = Check(*ex, RandIdx(n, s.k, s.E), n, s.k, s.H, s.I, L);
                    const std::string where = Shape({{"E", s.E}, {"k", s.k}, {"H", s.H}, {"I", s.I}, {"n", n}}) +
                                              " L=" + std::to_string(L) + " " + mt_dtype_name(dt);
                    worst.See(e, where);
                    EXPECT_LE(e, kTol) << where;
                }
            }
        }
    }
}

// Many rows per expert: every pass size (4, 3, 2, 1) and several passes per expert.
TEST_F(CudaMoeGrouped, DuplicateAndSameExperts) {
    Worst worst{"grouped dup"};
    const int E = 16, k = 4, H = 64, I = 32;
    auto ex = MakeExperts(MT_BF16, E, E, H, I);
    for (int n : {9, 16, 64, 130}) {
        // Every row picks 4 distinct experts of the first 5: ~0.8 n rows per expert.
        std::vector<int32_t> few = RandIdx(n, k, 5);
        // Every row the same experts.
        std::vector<int32_t> same((size_t)n * k);
        for (int i = 0; i < n; i++)
            for (int j = 0; j < k; j++) same[(size_t)i * k + j] = (int32_t)((5 + 6 * j) % E);
        // Expert 15 in every row, the others random: one long list and many short ones.
        std::vector<int32_t> hot = RandIdx(n, k, E);
        for (int i = 0; i < n; i++) {
            for (int j = 0; j < k; j++)
                if (hot[(size_t)i * k + j] == 15) hot[(size_t)i * k + j] = hot[(size_t)i * k];
            hot[(size_t)i * k] = 15;
        }
        // A row naming one expert twice (allowed by the contract; the router never does).
        std::vector<int32_t> twice((size_t)n * k);
        for (int i = 0; i < n; i++)
            for (int j = 0; j < k; j++) twice[(size_t)i * k + j] = (int32_t)(j < 2 ? i % 3 : 7);
        const std::pair<const char *, const std::vector<int32_t> *> cases[] = {
            {"few", &few}, {"same", &same}, {"hot", &hot}, {"twice", &twice}};
        for (auto &c : cases) {
            for (float L : {10.f, 0.5f}) {
                const double e = Check(*ex, *c.second, n, k, H, I, L);
                const std::string where = std::string(c.first) + " " + Shape({{"n", n}}) + " L=" + std::to_string(L);
                worst.See(e, where);
                EXPECT_LE(e, kTol) << where;
            }
        }
    }
}

TEST_F(CudaMoeGrouped, RealShapes) {
    Worst worst{"grouped real"};
    const int E = 288, k = 8, H = 4096, I = 2048, n = 64;
    auto ex = MakeExperts(MT_BF16, E, 10, H, I);
    {
        const double e = Check(*ex, RandIdx(n, k, E), n, k, H, I, 10.f);
        worst.See(e, "n=64 idx uploaded");
        EXPECT_LE(e, kTol) << "n=64 idx uploaded";
    }
    // Indices straight from the GPU router: no read-back, the table covers the router's E.
    const mt_router_params rp = {E, 1, 1, k, true, 2.5f};
    std::vector<float> logits = Rand((size_t)n * E, -4.f, 4.f), bias = Rand(E, -0.1f, 0.1f);
    std::vector<float> x = Rand((size_t)n * H), want = Rand((size_t)n * H);
    float *gl = Put(gpu_, logits), *gb = Put(gpu_, bias), *gx = Put(gpu_, x), *go = Put(gpu_, want);
    int32_t *gi = (int32_t *)gpu_->ops->alloc(gpu_, (size_t)n * k * sizeof(int32_t));
    float *gw = (float *)gpu_->ops->alloc(gpu_, (size_t)n * k * sizeof(float));
    gpu_->ops->moe_route(gpu_, gi, gw, gl, gb, &rp, n);
    cu_moe_experts_grouped(gpu_, go, gx, gi, gw, ex->gpu.data(), n, k, H, I, 10.f);
    std::vector<int32_t> idx = Get(gpu_, gi, (size_t)n * k);
    std::vector<float> wts = Get(gpu_, gw, (size_t)n * k);
    cpu_->ops->moe_experts(cpu_, want.data(), x.data(), idx.data(), wts.data(), ex->cpu.data(), n, k, H, I, 10.f);
    const double e = RelErr(Get(gpu_, go, want.size()), want);
    worst.See(e, "n=64 routed");
    EXPECT_LE(e, kTol) << "n=64 routed";
    for (const void *p : {(const void *)gl, (const void *)gb, (const void *)gx, (const void *)go, (const void *)gi,
                          (const void *)gw})
        Drop(gpu_, p);
}

// One call captured after a warm eager call, replayed with other contents in the same buffers.
TEST_F(CudaMoeGrouped, GraphCapture) {
    Worst worst{"grouped graph"};
    const int E = 40, k = 8, H = 256, I = 96, n = 64;
    auto ex = MakeExperts(MT_BF16, E, E, H, I);
    std::vector<float> x = Rand((size_t)n * H), wts = Rand((size_t)n * k, 0.05f, 1.f), out = Rand((size_t)n * H);
    std::vector<int32_t> idx = RandIdx(n, k, E);
    idx[0] = E - 1; // the warm call's table covers every expert the replays use
    float *gx = Put(gpu_, x), *gw = Put(gpu_, wts), *go = Put(gpu_, out);
    int32_t *gi = Put(gpu_, idx);
    {
        std::vector<float> want = out;
        cpu_->ops->moe_experts(cpu_, want.data(), x.data(), idx.data(), wts.data(), ex->cpu.data(), n, k, H, I, 10.f);
        cu_moe_experts_grouped(gpu_, go, gx, gi, gw, ex->gpu.data(), n, k, H, I, 10.f); // warm (eager)
        const double e = RelErr(Get(gpu_, go, want.size()), want);
        worst.See(e, "warm call");
        EXPECT_LE(e, kTol) << "warm call";
    }
    ASSERT_EQ(gpu_->ops->graph_begin(gpu_), MT_OK);
    cu_moe_experts_grouped(gpu_, go, gx, gi, gw, ex->gpu.data(), n, k, H, I, 10.f);
    mt_graph *g = nullptr;
    ASSERT_EQ(gpu_->ops->graph_end(gpu_, &g), MT_OK);
    ASSERT_NE(g, nullptr);
    for (int rep = 0; rep < 3; rep++) {
        x = Rand((size_t)n * H);
        wts = Rand((size_t)n * k, 0.05f, 1.f);
        out = Rand((size_t)n * H);
        if (rep == 0) idx = RandIdx(n, k, E);
        if (rep == 1) idx = RandIdx(n, k, 9);               // few experts, many rows each
        if (rep == 2)
            for (int q = 0; q < n * k; q++) idx[q] = (q % k) * 5; // every row the same experts
        for (auto &p : std::vector<std::pair<void *, std::pair<const void *, size_t>>>{
                 {gx, {x.data(), x.size() * 4}}, {gw, {wts.data(), wts.size() * 4}},
                 {go, {out.data(), out.size() * 4}}, {gi, {idx.data(), idx.size() * 4}}})
            gpu_->ops->upload(gpu_, p.first, p.second.first, p.second.second);
        ASSERT_EQ(gpu_->ops->graph_launch(gpu_, g), MT_OK);
        std::vector<float> want = out;
        cpu_->ops->moe_experts(cpu_, want.data(), x.data(), idx.data(), wts.data(), ex->cpu.data(), n, k, H, I, 10.f);
        const double e = RelErr(Get(gpu_, go, want.size()), want);
        const std::string where = "replay " + std::to_string(rep);
        worst.See(e, where);
        EXPECT_LE(e, kTol) << where;
    }
    gpu_->ops->graph_free(gpu_, g);

    // The engine's form: router and experts captured together (no read-back at capture), replayed
    // with new logits; compared on the indices and weights the replay produced.
    const int ER = 288;
    auto exr = MakeExperts(MT_BF16, ER, 12, H, I);
    const mt_router_params rp = {ER, 1, 1, k, true, 2.5f};
    std::vector<float> logits = Rand((size_t)n * ER, -4.f, 4.f), bias = Rand(ER, -0.1f, 0.1f);
    float *gl = Put(gpu_, logits), *gb = Put(gpu_, bias);
    int32_t *ri = (int32_t *)gpu_->ops->alloc(gpu_, (size_t)n * k * sizeof(int32_t));
    float *rw = (float *)gpu_->ops->alloc(gpu_, (size_t)n * k * sizeof(float));
    gpu_->ops->moe_route(gpu_, ri, rw, gl, gb, &rp, n);
    cu_moe_experts_grouped(gpu_, go, gx, ri, rw, exr->gpu.data(), n, k, H, I, 10.f); // warm
    ASSERT_EQ(gpu_->ops->graph_begin(gpu_), MT_OK);
    gpu_->ops->moe_route(gpu_, ri, rw, gl, gb, &rp, n);
    cu_moe_experts_grouped(gpu_, go, gx, ri, rw, exr->gpu.data(), n, k, H, I, 10.f);
    g = nullptr;
    ASSERT_EQ(gpu_->ops->graph_end(gpu_, &g), MT_OK);
    ASSERT_NE(g, nullptr);
    for (int rep = 0; rep < 2; rep++) {
        logits = Rand((size_t)n * ER, -4.f, 4.f);
        x = Rand((size_t)n * H);
        out = Rand((size_t)n * H);
        gpu_->ops->upload(gpu_, gl, logits.data(), logits.size() * 4);
        gpu_->ops->upload(gpu_, gx, x.data(), x.size() * 4);
        gpu_->ops->upload(gpu_, go, out.data(), out.size() * 4);
        ASSERT_EQ(gpu_->ops->graph_launch(gpu_, g), MT_OK);
        std::vector<int32_t> ridx = Get(gpu_, ri, (size_t)n * k);
        std::vector<float> rwts = Get(gpu_, rw, (size_t)n * k);
        std::vector<float> want = out;
        cpu_->ops->moe_experts(cpu_, want.data(), x.data(), ridx.data(), rwts.data(), exr->cpu.data(), n, k, H, I,
                               10.f);
        const double e = RelErr(Get(gpu_, go, want.size()), want);
        const std::string where = "routed replay " + std::to_string(rep);
        worst.See(e, where);
        EXPECT_LE(e, kTol) << where;
    }
    gpu_->ops->graph_free(gpu_, g);
    for (const void *p : {(const void *)gx, (const void *)gw, (const void *)go, (const void *)gi, (const void *)gl,
                          (const void *)gb, (const void *)ri, (const void *)rw})
        Drop(gpu_, p);

    // A capture before any eager call (no table, idx not from the router) fails cleanly, on a
    // backend of its own (the failure is sticky).
    mt_error err{};
    mt_backend *fresh = mt_cuda_backend_new(0, &kExact, &err);
    ASSERT_NE(fresh, nullptr) << err.msg;
    float *fx = (float *)fresh->ops->alloc(fresh, (size_t)n * H * 4), *fo = (float *)fresh->ops->alloc(fresh, (size_t)n * H * 4);
    float *fw = (float *)fresh->ops->alloc(fresh, (size_t)n * k * 4);
    int32_t *fi = (int32_t *)fresh->ops->alloc(fresh, (size_t)n * k * 4);
    ASSERT_EQ(fresh->ops->graph_begin(fresh), MT_OK);
    cu_moe_experts_grouped(fresh, fo, fx, fi, fw, ex->gpu.data(), n, k, H, I, 10.f);
    mt_graph *fg = nullptr;
    (void)fresh->ops->graph_end(fresh, &fg);
    fresh->ops->graph_free(fresh, fg);
    EXPECT_EQ(((cu_backend *)fresh)->sticky, MT_ERR_INVALID);
    for (const void *p : {(const void *)fx, (const void *)fo, (const void *)fw, (const void *)fi}) Drop(fresh, p);
    cu_moe_grouped_free((cu_backend *)fresh);
    mt_backend_free(fresh);
}

// The real shapes with 288 distinct experts (14.5 GB of bf16, far beyond L2): the grouped op
// eagerly and replayed from a graph, against the backend's moe_experts (n <= 8: GEMV kernels;
// n > 8: idx read back, batched tensor-core GEMMs), with the bytes of the experts the batch
// touches and the device's copy bandwidth (read + write bytes of a 2 GiB copy) for scale.
TEST_F(CudaMoeGrouped, TimingRealShapes) {
    const int E = 288, k = 8, H = 4096, I = 2048;
    auto ex = MakeExperts(MT_BF16, E, E, H, I, false);
    const size_t cbytes = (size_t)2 << 30;
    void *csrc = gpu_->ops->alloc(gpu_, cbytes), *cdst = gpu_->ops->alloc(gpu_, cbytes);
    ASSERT_TRUE(csrc && cdst);
    const double tc = TimeGpu([&] { gpu_->ops->copy(gpu_, cdst, csrc, cbytes); }, 5);
    const double copy_bw = 2.0 * cbytes / tc;
    std::printf("[ timing   ] device copy 2 GiB: %.3f ms, %.0f GB/s (read + write)\n", tc * 1e3, copy_bw / 1e9);
    Drop(gpu_, csrc);
    Drop(gpu_, cdst);

    for (int n : {8, 32, 64, 128}) {
        std::vector<int32_t> idx = RandIdx(n, k, E);
        const size_t touched = std::set<int32_t>(idx.begin(), idx.end()).size();
        const double bytes = (double)touched * 3 * H * I * 2;
        std::vector<float> out = Rand((size_t)n * H);
        float *gx = Put(gpu_, Rand((size_t)n * H)), *gw = Put(gpu_, Rand((size_t)n * k, 0.05f, 1.f));
        float *go = Put(gpu_, out), *go2 = Put(gpu_, out);
        int32_t *gi = Put(gpu_, idx);
        // Same result as moe_experts (which is within 1e-4 of the CPU on its tensor-core path).
        cu_moe_experts_grouped(gpu_, go, gx, gi, gw, ex->gpu.data(), n, k, H, I, 10.f);
        gpu_->ops->moe_experts(gpu_, go2, gx, gi, gw, ex->gpu.data(), n, k, H, I, 10.f);
        const double e = RelErr(Get(gpu_, go, out.size()), Get(gpu_, go2, out.size()));
        EXPECT_LE(e, 1e-4) << "grouped vs moe_experts n=" << n;

        // As if moe_route had written idx (the engine's case): the timed calls then never read idx
        // back (cu_backend.route_*; the backend's moe_experts reads it back anyway for n > 8).
        cu_backend *cub = (cu_backend *)gpu_;
        cub->route_idx = gi;
        cub->route_len = (int64_t)n * k;
        cub->route_experts = E;
        const int reps = 20;
        const double tg = TimeGpu([&] { cu_moe_experts_grouped(gpu_, go, gx, gi, gw, ex->gpu.data(), n, k, H, I, 10.f); },
                                  reps);
        ASSERT_EQ(gpu_->ops->graph_begin(gpu_), MT_OK);
        cu_moe_experts_grouped(gpu_, go, gx, gi, gw, ex->gpu.data(), n, k, H, I, 10.f);
        mt_graph *g = nullptr;
        ASSERT_EQ(gpu_->ops->graph_end(gpu_, &g), MT_OK);
        const double tr = TimeGpu([&] { gpu_->ops->graph_launch(gpu_, g); }, reps);
        gpu_->ops->graph_free(gpu_, g);
        const double tm = TimeGpu([&] { gpu_->ops->moe_experts(gpu_, go, gx, gi, gw, ex->gpu.data(), n, k, H, I, 10.f); },
                                  reps);
        std::printf("[ timing   ] n=%3d top-8 of 288, 4096x2048 bf16: %3zu experts touched, %.2f GB: grouped %.3f ms "
                    "(%.0f GB/s, %.0f%% of copy), graph replay %.3f ms (%.0f GB/s, %.0f%%), moe_experts %.3f ms "
                    "(%.0f GB/s); diff %.2g\n",
                    n, touched, bytes / 1e9, tg * 1e3, bytes / tg / 1e9, 100 * bytes / tg / copy_bw, tr * 1e3,
                    bytes / tr / 1e9, 100 * bytes / tr / copy_bw, tm * 1e3, bytes / tm / 1e9, e);
        if (n == 128) { // where the time goes, each kernel synchronised
            mt_cuda_profile(gpu_, true, nullptr);
            for (int r = 0; r < 5; r++) cu_moe_experts_grouped(gpu_, go, gx, gi, gw, ex->gpu.data(), n, k, H, I, 10.f);
            mt_cuda_profile(gpu_, false, "cu_moe_experts_grouped n=128 x5");
        }
        for (const void *p : {(const void *)gx, (const void *)gw, (const void *)go, (const void *)go2, (const void *)gi})
            Drop(gpu_, p);
    }
}

}  // namespace
