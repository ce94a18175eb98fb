// tests/kernels_cuda_attn_test.cc: the CUDA backend's attention-side ops (KDA: conv1d_silu,
// conv1d_silu_l2norm, kda_gate, kda_recurrent, kda_chunked, gated_rmsnorm; DSA over paged caches:
// dsa_pool_keys(_at), dsa_select, mla_sparse, the cache writes and the rows forms) against the CPU
// backend, their reference, on fresh random inputs over a grid of shapes that includes the real
// model's (64 KDA heads of 128; MLA kv_lora 512 with 64 heads of 256/256 over ~3000 positions;
// indexer 32 heads of 128, kpool 16, 128 pools).
//
// Tolerances: fp32 math in both, summed in different orders, so ||gpu - cpu|| / ||cpu|| <= 1e-4
// for every float output (the conv state is a copy and must match exactly). Selections: counts
// equal; the tail identical; the selected pools identical as sets, where a difference is allowed
// only between pools whose scores (recomputed in double) tie to 1e-5 of the row's largest score,
// and the GPU's pool order must be the CPU's up to such ties.
//
// Skips when no CUDA device is usable (CI and dev hosts have the toolkit but no GPU).
#include <gtest/gtest.h>

#include "tests/cuda_test_util.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

extern "C" {
#include "common/mt.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
}

namespace {

const mt_cuda_params kExact = ExactParams();

constexpr double kRelTol = 1e-4;


// A buffer in one backend's memory, freed with it.
template <typename T>
class Buf {
  public:
    Buf(mt_backend *be, const std::vector<T> &host) : be_(be), n_(host.size()) {
        p_ = (T *)be_->ops->alloc(be_, bytes());
        if (p_) be_->ops->upload(be_, p_, host.data(), bytes());
    }
    ~Buf() { be_->ops->free(be_, p_); }
    Buf(const Buf &) = delete;
    Buf &operator=(const Buf &) = delete;
    T *get() const { return p_; }
    std::vector<T> Get() const {
        std::vector<T> h(n_);
        be_->ops->download(be_, h.data(), p_, bytes());
        return h;
    }
    void Put(const std::vector<T> &host) { be_->ops->upload(be_, p_, host.data(), n_ * sizeof(T)); }

  private:
    size_t bytes() const { return n_ * sizeof(T) > 0 ? n_ * sizeof(T) : sizeof(T); }
    mt_backend *be_;
    size_t n_;
    T *p_ = nullptr;
};

class CudaAttn : public ::testing::Test {
  protected:
    void SetUp() override {
        std::string why = NoGpuReason();
        if (!why.empty()) GTEST_SKIP() << "no CUDA GPU on this host (" << why << "); skipping";
        mt_error err = {};
        gpu_ = mt_cuda_backend_new(0, &kExact, &err);
        ASSERT_NE(gpu_, nullptr) << "mt_cuda_backend_new: " << err.msg;
        cpu_ = mt_cpu_backend_new(0);
        ASSERT_NE(cpu_, nullptr);
    }
    void TearDown() override {
        mt_backend_free(gpu_);
        mt_backend_free(cpu_);
    }
    // Normal(0, scale), never exactly zero.
    std::vector<float> Rand(size_t n, float scale = 1.f) {
        std::normal_distribution<float> d(0.f, scale);
        std::vector<float> v(n);
        for (auto &x : v) {
            do x = d(rng_); while (x == 0.f);
        }
        return v;
    }
    // KDA delta-rule inputs as the model makes them: q, k l2-normalised (q * dk^-0.5), g <= 0,
    // beta in (0, 1).
    struct DeltaIn {
        std::vector<float> q, k, v, g, beta, state;
    };
    DeltaIn MakeDelta(int n, int nh, int dk, float gscale) {
        const size_t T = (size_t)n * nh * dk;
        DeltaIn in{Rand(T), Rand(T), Rand(T), Rand(T), Rand((size_t)n * nh), Rand((size_t)nh * dk * dk, 0.1f)};
        for (auto &x : in.g) x = -std::fabs(x) * gscale;
        for (auto &x : in.beta) x = 1.f / (1.f + std::exp(-x));
        cpu_->ops->l2norm(cpu_, in.q.data(), (int64_t)n * nh, dk, 1e-6f, 1.f / std::sqrt((float)dk));
        cpu_->ops->l2norm(cpu_, in.k.data(), (int64_t)n * nh, dk, 1e-6f, 1.f);
        return in;
    }
    // Runs the recurrent (chunked = false) or chunked delta rule on both backends; the state
    // carries over `calls` consecutive calls of n steps each. Bound: ||gpu - cpu|| / ||cpu|| <= tol.
    void CheckDelta(bool chunked, int n, int nh, int dk, float gscale, int calls, double tol = kRelTol) {
        DeltaIn in0 = MakeDelta(n, nh, dk, gscale);
        std::vector<float> st_cpu = in0.state;
        Buf<float> st_gpu(gpu_, in0.state);
        for (int call = 0; call < calls; call++) {
            DeltaIn in = call == 0 ? in0 : MakeDelta(n, nh, dk, gscale);
            const size_t T = (size_t)n * nh * dk;
            std::vector<float> o_cpu(T);
            auto cpu_op = chunked ? cpu_->ops->kda_chunked : cpu_->ops->kda_recurrent;
            auto gpu_op = chunked ? gpu_->ops->kda_chunked : gpu_->ops->kda_recurrent;
            cpu_op(cpu_, o_cpu.data(), in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(),
                   st_cpu.data(), n, nh, dk);
            Buf<float> q(gpu_, in.q), k(gpu_, in.k), v(gpu_, in.v), g(gpu_, in.g), beta(gpu_, in.beta);
            Buf<float> o(gpu_, Rand(T));
            const double t_start = mt_now();
            gpu_op(gpu_, o.get(), q.get(), k.get(), v.get(), g.get(), beta.get(), st_gpu.get(), n, nh, dk);
            gpu_->ops->sync(gpu_);
            const double ms = (mt_now() - t_start) * 1e3;
            const double eo = RelErr(o.Get(), o_cpu), es = RelErr(st_gpu.Get(), st_cpu);
            std::printf("[%s] n=%d nh=%d dk=%d gscale=%g call %d: o rel %.2e, state rel %.2e (%.3f ms)\n",
                        chunked ? "kda_chunked" : "kda_recurrent", n, nh, dk, gscale, call, eo, es, ms);
            EXPECT_LE(eo, tol) << "o, n=" << n << " nh=" << nh << " dk=" << dk << " call " << call;
            EXPECT_LE(es, tol) << "state, n=" << n << " nh=" << nh << " dk=" << dk << " call " << call;
        }
    }
    // Runs an idempotent op once (its result is what the test checks), then times 10 more calls
    // back to back; milliseconds per call.
    template <typename F>
    double WarmMs(F run) {
        run();
        gpu_->ops->sync(gpu_);
        const int reps = 10;
        const double t_start = mt_now();
        for (int r = 0; r < reps; r++) run();
        gpu_->ops->sync(gpu_);
        return (mt_now() - t_start) * 1e3 / reps;
    }
    // f() with gpu_ replaced by a CUDA backend made with p, synchronised after (buffers of the
    // default gpu_ are device memory of the same device, so the other backend uses them as they are).
    template <typename F>
    void WithParams(const mt_cuda_params &p, F f) {
        mt_error err = {};
        mt_backend *be = mt_cuda_backend_new(0, &p, &err);
        ASSERT_NE(be, nullptr) << "mt_cuda_backend_new: " << err.msg;
        std::swap(be, gpu_);
        f();
        gpu_->ops->sync(gpu_);
        std::swap(be, gpu_);
        mt_backend_free(be);
    }
    mt_backend *cpu_ = nullptr, *gpu_ = nullptr;
    std::mt19937 rng_{20240611};
};

// ---------------------------------------------------------------------------------------------
// KDA

TEST_F(CudaAttn, Conv1dSiluMatchesCpuAndCarriesState) {
    struct Shape { int C, K; };
    // The real model's q/k/v conv (64 heads of 128, K = 4), odd channel counts, K from 2 to 8.
    for (Shape s : {Shape{8192, 4}, Shape{37, 3}, Shape{300, 8}, Shape{65, 2}}) {
        std::vector<float> w = Rand((size_t)s.C * s.K, 0.5f), st0 = Rand((size_t)s.C * (s.K - 1));
        std::vector<float> st_cpu = st0;
        Buf<float> dw(gpu_, w), st_gpu(gpu_, st0);
        // Consecutive calls; n < K-1 keeps part of the old state.
        for (int n : {1, 63, 200, 2, 1, 130}) {
            std::vector<float> x = Rand((size_t)n * s.C), out_cpu((size_t)n * s.C);
            cpu_->ops->conv1d_silu(cpu_, out_cpu.data(), x.data(), st_cpu.data(), w.data(), n, s.C, s.K);
            Buf<float> dx(gpu_, x), dout(gpu_, Rand((size_t)n * s.C));
            gpu_->ops->conv1d_silu(gpu_, dout.get(), dx.get(), st_gpu.get(), dw.get(), n, s.C, s.K);
            const double eo = RelErr(dout.Get(), out_cpu);
            const std::vector<float> st_got = st_gpu.Get();
            std::printf("[conv1d_silu] C=%d K=%d n=%d: out rel %.2e\n", s.C, s.K, n, eo);
            EXPECT_LE(eo, kRelTol) << "C=" << s.C << " K=" << s.K << " n=" << n;
            EXPECT_EQ(st_got, st_cpu) << "state, C=" << s.C << " K=" << s.K << " n=" << n;
        }
    }
}

// conv1d_silu_l2norm (the q and k of a prefill): against the CPU's conv1d_silu then l2norm, over
// consecutive calls so the state carries (n < K-1 keeps part of it; stretches of 32 steps, the
// last partial): the real heads, small heads of 16, 20, 32 and 64, K from 2 to 4, both scales;
// a head wider than the kernel takes (256) is refused and leaves out and the state alone.
TEST_F(CudaAttn, Conv1dSiluL2normMatchesCpuComposition) {
    ASSERT_TRUE(gpu_->ops->conv1d_silu_l2norm);
    struct Shape { int C, K, dk; };
    for (Shape s : {Shape{8192, 4, 128}, Shape{96, 3, 32}, Shape{48, 4, 16}, Shape{60, 3, 20}, Shape{256, 2, 64}}) {
        std::vector<float> w = Rand((size_t)s.C * s.K, 0.5f), st0 = Rand((size_t)s.C * (s.K - 1));
        std::vector<float> st_cpu = st0;
        Buf<float> dw(gpu_, w), st_gpu(gpu_, st0);
        int call = 0;
        for (int n : {1, 63, 200, 2, 1, 130}) {
            const float scale = call++ % 2 ? 1.f : 1.f / std::sqrt((float)s.dk);
            std::vector<float> x = Rand((size_t)n * s.C), want((size_t)n * s.C);
            cpu_->ops->conv1d_silu(cpu_, want.data(), x.data(), st_cpu.data(), w.data(), n, s.C, s.K);
            cpu_->ops->l2norm(cpu_, want.data(), (int64_t)n * (s.C / s.dk), s.dk, 1e-6f, scale);
            Buf<float> dx(gpu_, x), dout(gpu_, Rand((size_t)n * s.C));
            ASSERT_TRUE(gpu_->ops->conv1d_silu_l2norm(gpu_, dout.get(), dx.get(), st_gpu.get(), dw.get(), n, s.C, s.K,
                                                       s.dk, 1e-6f, scale));
            const double eo = RelErr(dout.Get(), want);
            std::printf("[conv1d_silu_l2norm] C=%d K=%d dk=%d n=%d: out rel %.2e\n", s.C, s.K, s.dk, n, eo);
            EXPECT_LE(eo, kRelTol) << "C=" << s.C << " K=" << s.K << " dk=" << s.dk << " n=" << n;
            EXPECT_EQ(st_gpu.Get(), st_cpu) << "state, C=" << s.C << " K=" << s.K << " n=" << n;
        }
    }
    {
        const int C = 512, K = 4, dk = 256, n = 40;
        const std::vector<float> st0 = Rand((size_t)C * (K - 1)), out0 = Rand((size_t)n * C);
        Buf<float> dw(gpu_, Rand((size_t)C * K, 0.5f)), st(gpu_, st0), dx(gpu_, Rand((size_t)n * C)), dout(gpu_, out0);
        EXPECT_FALSE(gpu_->ops->conv1d_silu_l2norm(gpu_, dout.get(), dx.get(), st.get(), dw.get(), n, C, K, dk, 1e-6f, 1.f));
        EXPECT_EQ(dout.Get(), out0);
        EXPECT_EQ(st.Get(), st0);
    }
}

// kda_conv3_rows (the rows form's three conv steps and q, k l2norms in one launch) against the
// CPU's conv1d_silu per row and l2norm, each row on its own states (pointer tables on the GPU),
// over consecutive steps so the states carry; the second step in place (out = x).
TEST_F(CudaAttn, KdaConv3RowsMatchesCpuComposition) {
    ASSERT_TRUE(gpu_->ops->kda_conv3_rows);
    struct Shape { int C, K, dk, n; };
    for (Shape s : {Shape{8192, 4, 128, 1}, Shape{8192, 4, 128, 3}, Shape{96, 3, 32, 2}, Shape{256, 2, 64, 5}, Shape{48, 4, 16, 3}, Shape{60, 3, 20, 2}}) {
        const int C = s.C, K = s.K, n = s.n, P = K - 1;
        std::vector<std::vector<float>> w(3), st_cpu(3 * n);
        std::vector<std::unique_ptr<Buf<float>>> dw, dst;
        for (int j = 0; j < 3; j++) {
            w[j] = Rand((size_t)C * K, 0.5f);
            dw.push_back(std::make_unique<Buf<float>>(gpu_, w[j]));
        }
        std::vector<float *> tab[3];
        for (int j = 0; j < 3; j++)
            for (int i = 0; i < n; i++) {
                st_cpu[j * n + i] = Rand((size_t)C * P);
                dst.push_back(std::make_unique<Buf<float>>(gpu_, st_cpu[j * n + i]));
                tab[j].push_back(dst.back()->get());
            }
        Buf<float *> t0(gpu_, tab[0]), t1(gpu_, tab[1]), t2(gpu_, tab[2]);
        for (int step = 0; step < 3; step++) {
            std::vector<std::vector<float>> x(3), want(3, std::vector<float>((size_t)n * C));
            std::vector<std::unique_ptr<Buf<float>>> dx, dout;
            const bool in_place = step == 1; /* out[j] == x[j], as the model's rows form calls it */
            for (int j = 0; j < 3; j++) {
                x[j] = Rand((size_t)n * C);
                dx.push_back(std::make_unique<Buf<float>>(gpu_, x[j]));
                dout.push_back(std::make_unique<Buf<float>>(gpu_, in_place ? x[j] : Rand((size_t)n * C)));
                for (int i = 0; i < n; i++)
                    cpu_->ops->conv1d_silu(cpu_, want[j].data() + (size_t)i * C, x[j].data() + (size_t)i * C,
                                           st_cpu[j * n + i].data(), w[j].data(), 1, C, K);
            }
            const float qs = 1.f / std::sqrt((float)s.dk);
            cpu_->ops->l2norm(cpu_, want[0].data(), (int64_t)n * (C / s.dk), s.dk, 1e-6f, qs);
            cpu_->ops->l2norm(cpu_, want[1].data(), (int64_t)n * (C / s.dk), s.dk, 1e-6f, 1.f);
            mt_kda_conv3 cv;
            float *const *tabs[3] = {t0.get(), t1.get(), t2.get()};
            for (int j = 0; j < 3; j++) {
                cv.out[j] = dout[j]->get();
                cv.x[j] = in_place ? dout[j]->get() : dx[j]->get();
                cv.states[j] = tabs[j];
                cv.w[j] = dw[j]->get();
            }
            gpu_->ops->kda_conv3_rows(gpu_, &cv, n, C, K, s.dk, 1e-6f, qs);
            for (int j = 0; j < 3; j++) {
                const double e = RelErr(dout[j]->Get(), want[j]);
                EXPECT_LE(e, kRelTol) << "C=" << C << " K=" << K << " n=" << n << " j=" << j << " step " << step;
                for (int i = 0; i < n; i++)
                    EXPECT_EQ(dst[j * n + i]->Get(), st_cpu[j * n + i]) << "state j=" << j << " row " << i << " step " << step;
            }
        }
    }
}

TEST_F(CudaAttn, KdaGateMatchesCpu) {
    for (bool lb : {false, true})
        for (int n : {1, 63, 200}) {
            mt_kda_gate_params p = {64, 128, lb, -5.f};
            const size_t D = (size_t)p.nh * p.dk;
            std::vector<float> f = Rand(n * D, 4.f), bias = Rand(D), A = Rand(p.nh);  // f > 20 occurs
            std::vector<float> g_cpu(n * D);
            cpu_->ops->kda_gate(cpu_, g_cpu.data(), f.data(), bias.data(), A.data(), &p, n);
            Buf<float> df(gpu_, f), db(gpu_, bias), dA(gpu_, A), dg(gpu_, Rand(n * D));
            gpu_->ops->kda_gate(gpu_, dg.get(), df.get(), db.get(), dA.get(), &p, n);
            // In place (g aliases f), as the model may call it.
            gpu_->ops->kda_gate(gpu_, df.get(), df.get(), db.get(), dA.get(), &p, n);
            const double e = RelErr(dg.Get(), g_cpu), ea = RelErr(df.Get(), g_cpu);
            std::printf("[kda_gate] lower_bound=%d n=%d: rel %.2e, in place rel %.2e\n", lb, n, e, ea);
            EXPECT_LE(e, kRelTol);
            EXPECT_LE(ea, kRelTol);
        }
}

// kda_gates (the decay gate's and the output gate's projections, fused at decode) against the CPU
// composition matmul, kda_gate, matmul: the real shapes (K = 128 -> 64 x 128) at 1 and 2 rows
// (one fused launch) and 5 rows (the unfused path), with and without the lower bound.
TEST_F(CudaAttn, KdaGatesMatchCpuComposition) {
    ASSERT_NE(gpu_->ops->kda_gates, nullptr);
    const int K = 128;
    for (bool lb : {false, true})
        for (int n : {1, 2, 5}) {
            mt_kda_gate_params p = {64, 128, lb, -5.f};
            const int D = p.nh * p.dk;
            std::vector<float> wf = Rand((size_t)D * K, 0.3f), wg = Rand((size_t)D * K, 0.3f);
            std::vector<uint16_t> hf(wf.size()), hg(wg.size());
            for (size_t i = 0; i < wf.size(); i++) {
                hf[i] = mt_f32_to_bf16(wf[i]);
                hg[i] = mt_f32_to_bf16(wg[i]);
            }
            mt_weight cf, cg, gf, gg;
            ASSERT_EQ(cpu_->ops->weight(cpu_, hf.data(), MT_BF16, D, K, &cf), MT_OK);
            ASSERT_EQ(cpu_->ops->weight(cpu_, hg.data(), MT_BF16, D, K, &cg), MT_OK);
            ASSERT_EQ(gpu_->ops->weight(gpu_, hf.data(), MT_BF16, D, K, &gf), MT_OK);
            ASSERT_EQ(gpu_->ops->weight(gpu_, hg.data(), MT_BF16, D, K, &gg), MT_OK);
            std::vector<float> fin = Rand((size_t)n * K), gin = Rand((size_t)n * K), bias = Rand(D), A = Rand(p.nh);
            std::vector<float> f_cpu((size_t)n * D), g_cpu((size_t)n * D), gate_cpu((size_t)n * D);
            cpu_->ops->matmul(cpu_, f_cpu.data(), fin.data(), &cf, n);
            cpu_->ops->kda_gate(cpu_, g_cpu.data(), f_cpu.data(), bias.data(), A.data(), &p, n);
            cpu_->ops->matmul(cpu_, gate_cpu.data(), gin.data(), &cg, n);
            Buf<float> dfin(gpu_, fin), dgin(gpu_, gin), db(gpu_, bias), dA(gpu_, A);
            Buf<float> dg(gpu_, Rand((size_t)n * D)), dgate(gpu_, Rand((size_t)n * D));
            gpu_->ops->kda_gates(gpu_, dg.get(), dgate.get(), dfin.get(), dgin.get(), &gf, &gg, db.get(), dA.get(), &p, n);
            const double eg = RelErr(dg.Get(), g_cpu), et = RelErr(dgate.Get(), gate_cpu);
            std::printf("[kda_gates] lower_bound=%d n=%d: g rel %.2e, gate rel %.2e\n", lb, n, eg, et);
            EXPECT_LE(eg, kRelTol);
            EXPECT_LE(et, kRelTol);
            // beside_previous (the model's rows form after in-place convs): the same results, with
            // an unrelated kernel (an l2norm on other memory) just before it.
            Buf<float> dg2(gpu_, Rand((size_t)n * D)), dgate2(gpu_, Rand((size_t)n * D)), other(gpu_, Rand(4096));
            gpu_->ops->l2norm(gpu_, other.get(), 32, 128, 1e-6f, 1.f);
            mt_kda_gate_params pb = p;
            pb.beside_previous = true;
            gpu_->ops->kda_gates(gpu_, dg2.get(), dgate2.get(), dfin.get(), dgin.get(), &gf, &gg, db.get(), dA.get(), &pb, n);
            EXPECT_EQ(dg2.Get(), dg.Get()) << "beside_previous n=" << n;
            EXPECT_EQ(dgate2.Get(), dgate.Get()) << "beside_previous n=" << n;
            cpu_->ops->weight_free(cpu_, &cf);
            cpu_->ops->weight_free(cpu_, &cg);
            gpu_->ops->weight_free(gpu_, &gf);
            gpu_->ops->weight_free(gpu_, &gg);
        }
}

// The real model's heads (64 of 128); decode carries the state over several calls. Decode of
// 320 and 2048 heads (5 and 32 sequences' worth) runs the decode kernel in several waves.
TEST_F(CudaAttn, KdaRecurrentRealShapes) {
    for (int n : {1, 63, 200}) CheckDelta(false, n, 64, 128, 1.f, n == 1 ? 3 : 1);
    CheckDelta(false, 1, 320, 128, 1.f, 3);
    CheckDelta(false, 1, 2048, 128, 1.f, 2);
}

// kda_recurrent_rows: each row one step on its own state (pointer table on the GPU) against the
// CPU's kda_recurrent with n = 1 per row, over consecutive steps so the states carry: 1 to 33
// rows of the real heads (up to 17 waves of the decode kernel), and dk = 64 and 100 (one and two
// value-column blocks, the second partial).
TEST_F(CudaAttn, KdaRecurrentRowsMatchCpu) {
    ASSERT_TRUE(gpu_->ops->kda_recurrent_rows);
    struct Shape { int n, nh, dk; };
    for (Shape sh : {Shape{1, 64, 128}, Shape{3, 64, 128}, Shape{5, 64, 128}, Shape{33, 64, 128},
                     Shape{9, 40, 64}, Shape{7, 45, 100}}) {
        const int n = sh.n, nh = sh.nh, dk = sh.dk;
        const size_t per = (size_t)nh * dk * dk;
        std::vector<std::vector<float>> st_cpu(n);
        std::vector<std::unique_ptr<Buf<float>>> st_gpu;
        std::vector<float *> tab;
        for (int r = 0; r < n; r++) {
            st_cpu[r] = Rand(per, 0.1f);
            st_gpu.push_back(std::make_unique<Buf<float>>(gpu_, st_cpu[r]));
            tab.push_back(st_gpu.back()->get());
        }
        Buf<float *> dtab(gpu_, tab);
        for (int step = 0; step < 2; step++) {
            DeltaIn in = MakeDelta(n, nh, dk, 1.f);
            const size_t T = (size_t)n * nh * dk;
            std::vector<float> o_cpu(T);
            for (int r = 0; r < n; r++) {
                const size_t at = (size_t)r * nh * dk;
                cpu_->ops->kda_recurrent(cpu_, o_cpu.data() + at, in.q.data() + at, in.k.data() + at,
                                         in.v.data() + at, in.g.data() + at, in.beta.data() + (size_t)r * nh,
                                         st_cpu[r].data(), 1, nh, dk);
            }
            Buf<float> q(gpu_, in.q), k(gpu_, in.k), v(gpu_, in.v), g(gpu_, in.g), beta(gpu_, in.beta);
            Buf<float> o(gpu_, Rand(T));
            gpu_->ops->kda_recurrent_rows(gpu_, o.get(), q.get(), k.get(), v.get(), g.get(), beta.get(), dtab.get(),
                                          n, nh, dk);
            gpu_->ops->sync(gpu_);
            const double eo = RelErr(o.Get(), o_cpu);
            double es = 0;
            for (int r = 0; r < n; r++) es = std::max(es, RelErr(st_gpu[r]->Get(), st_cpu[r]));
            std::printf("[kda_recurrent_rows] n=%d nh=%d dk=%d step %d: o rel %.2e, worst state rel %.2e\n", n, nh,
                        dk, step, eo, es);
            EXPECT_LE(eo, kRelTol) << "o, n=" << n << " nh=" << nh << " dk=" << dk << " step " << step;
            EXPECT_LE(es, kRelTol) << "states, n=" << n << " nh=" << nh << " dk=" << dk << " step " << step;
        }
    }
}

TEST_F(CudaAttn, KdaRecurrentSmallShapes) {
    CheckDelta(false, 37, 3, 16, 4.f, 2);  // small head, strong decay
    CheckDelta(false, 20, 2, 48, 0.2f, 1); // a head dim that is not a multiple of 32
    // n == 1 (decode kernel): partial column blocks and rows; dk = 50 takes the general kernel
    CheckDelta(false, 1, 3, 16, 4.f, 2);
    CheckDelta(false, 1, 2, 48, 0.2f, 2);
    CheckDelta(false, 1, 5, 100, 1.f, 3);
    CheckDelta(false, 1, 2, 50, 1.f, 2);
    // many heads (several waves) of small, odd-sized and non-power-of-two head dims
    CheckDelta(false, 1, 600, 16, 4.f, 2);
    CheckDelta(false, 1, 300, 100, 1.f, 2);
    CheckDelta(false, 1, 270, 48, 0.2f, 2);
}

// kda_chunked runs on the tensor cores by default (two-part bf16 operands, cuda_kda_chunk.cu).
TEST_F(CudaAttn, KdaChunkedRealShapes) {
    for (int n : {1, 63, 200}) CheckDelta(true, n, 64, 128, 1.f, 2);
    CheckDelta(true, 64, 64, 128, 0.2f, 1);  // exactly one chunk, weak decay
    // decay too strong for the factored 16-step sub-blocks (e^-32 a step): the exact fp32 A and B
    CheckDelta(true, 200, 64, 128, 40.f, 1);
}

TEST_F(CudaAttn, KdaChunkedSmallShapes) {
    CheckDelta(true, 130, 3, 16, 4.f, 2);    // small head, strong decay, a partial last chunk
    CheckDelta(true, 70, 2, 48, 1.f, 1);     // head dim not a multiple of 64
    CheckDelta(true, 129, 1, 100, 1.f, 1);
    CheckDelta(true, 100, 2, 50, 1.f, 1);    // dk % 4 != 0: scalar q/k/g loads
    CheckDelta(true, 90, 2, 37, 1.f, 2);     // odd dk: scalar v loads and o stores
    CheckDelta(true, 64 * 64 + 100, 2, 128, 1.f, 1); // more chunks than one segment of records
}

// The other precisions of kda_chunked, chosen by the backend's numerics: MT_NUMERICS_FP32 = the
// fp32 kernel (bound 1e-4); MT_NUMERICS_BF16 keeps the two-part products by default
// (kda_chunk_exact, bound 1e-4) and with kda_chunk_exact off rounds once on the tensor cores
// (~4e-3; bound 2e-2).
TEST_F(CudaAttn, KdaChunkedPrecisionModes) {
    for (int mode = 0; mode < 3; mode++) {
        mt_cuda_params p = ExactParams();
        p.numerics = mode == 0 ? MT_NUMERICS_FP32 : MT_NUMERICS_BF16;
        p.kda_chunk_exact = mode != 2;
        std::printf("[kda_chunked] numerics %s%s\n", mt_numerics_name(p.numerics), mode == 2 ? ", one rounding" : "");
        const double tol = mode == 2 ? 2e-2 : kRelTol;
        WithParams(p, [&] {
            CheckDelta(true, 200, 8, 128, 1.f, 2, tol);
            CheckDelta(true, 70, 2, 37, 4.f, 1, tol);
        });
    }
}

TEST_F(CudaAttn, GatedRmsnormMatchesCpu) {
    struct Shape { int64_t rows; int d; };
    for (Shape s : {Shape{64, 128}, Shape{63 * 64, 128}, Shape{200 * 64, 128}, Shape{7, 50}, Shape{3, 1000}}) {
        std::vector<float> o = Rand(s.rows * s.d, 3.f), gate = Rand(s.rows * s.d), w = Rand(s.d);
        std::vector<float> out_cpu(s.rows * s.d);
        cpu_->ops->gated_rmsnorm(cpu_, out_cpu.data(), o.data(), gate.data(), w.data(), s.rows, s.d, 1e-5f);
        Buf<float> dout(gpu_, Rand(s.rows * s.d)), dO(gpu_, o), dg(gpu_, gate), dw(gpu_, w);
        gpu_->ops->gated_rmsnorm(gpu_, dout.get(), dO.get(), dg.get(), dw.get(), s.rows, s.d, 1e-5f);
        const double e = RelErr(dout.Get(), out_cpu);
        std::printf("[gated_rmsnorm] rows=%lld d=%d: rel %.2e\n", (long long)s.rows, s.d, e);
        EXPECT_LE(e, kRelTol);
    }
}

// ---------------------------------------------------------------------------------------------
// DSA. The caches are paged (kernels/backend.h mt_paged): every test lays its rows over pages of
// 64 positions in a shuffled order, runs the paged op on both backends, and checks the paged result
// against the same op on a contiguous copy with the identity block table (the unpaged reference).

constexpr int kPage = 64;

// A block table of `blocks` blocks over n_pages pages: a shuffled choice, or the identity.
std::vector<int32_t> MakeBt(std::mt19937 &rng, int blocks, int n_pages, bool shuffle) {
    std::vector<int32_t> perm(n_pages);
    std::iota(perm.begin(), perm.end(), 0);
    if (shuffle) std::shuffle(perm.begin(), perm.end(), rng);
    return std::vector<int32_t>(perm.begin(), perm.begin() + blocks);
}

// A pool [n_pages, page, row] holding the contiguous rows [count, row] through bt; rows no position
// maps keep what `fill` holds there (pass noise so that reading a wrong row shows; zeros past its
// end).
std::vector<float> Scatter(const std::vector<float> &rows, int page, int64_t row, const std::vector<int32_t> &bt,
                           int n_pages, std::vector<float> fill) {
    fill.resize((size_t)n_pages * page * row);
    const mt_paged c = {fill.data(), page, row};
    for (int64_t t = 0; t < (int64_t)rows.size() / row; t++)
        std::copy(rows.begin() + t * row, rows.begin() + (t + 1) * row, mt_paged_at(c, bt.data(), t));
    return fill;
}

// Positions [0, count) of a pool gathered through bt into [count, row].
std::vector<float> Gather(const std::vector<float> &pool, int page, int64_t row, const std::vector<int32_t> &bt,
                          int64_t count) {
    std::vector<float> out((size_t)(count * row));
    const mt_paged c = {const_cast<float *>(pool.data()), page, row};
    for (int64_t t = 0; t < count; t++)
        std::copy(mt_paged_at(c, bt.data(), t), mt_paged_at(c, bt.data(), t) + row, out.begin() + t * row);
    return out;
}

template <typename T>
std::vector<T> Slice(const std::vector<T> &v, size_t from, size_t to) {
    return std::vector<T>(v.begin() + from, v.begin() + to);
}

TEST_F(CudaAttn, DsaPoolKeysMatchesCpu) {
    struct Case { int p0, p1, kpool, id; };
    for (Case c : {Case{0, 187, 16, 128}, Case{100, 101, 16, 128}, Case{3, 40, 4, 12}, Case{5, 70, 8, 32}}) {
        const int ppp = kPage / c.kpool, count = c.p1 * c.kpool, blocks = (count + kPage - 1) / kPage;
        const int n_pages = blocks + 3;
        std::vector<float> ki = Rand((size_t)count * c.id), gs = Rand((size_t)count * c.id, 2.f), ape = Rand((size_t)c.kpool * c.id);
        const std::vector<int32_t> bt = MakeBt(rng_, blocks, n_pages, true), id_bt = MakeBt(rng_, blocks, blocks, false);
        const std::vector<float> kip = Scatter(ki, kPage, c.id, bt, n_pages, Rand((size_t)n_pages * kPage * c.id)),
                                gsp = Scatter(gs, kPage, c.id, bt, n_pages, Rand((size_t)n_pages * kPage * c.id));
        const std::vector<float> pk0 = Rand((size_t)n_pages * ppp * c.id);  // rows outside [p0, p1) must stay
        std::vector<float> pk_cpu = pk0, kic = kip, gsc = gsp;
        cpu_->ops->dsa_pool_keys(cpu_, {pk_cpu.data(), ppp, c.id}, {kic.data(), kPage, c.id}, {gsc.data(), kPage, c.id},
                                 bt.data(), ape.data(), c.p0, c.p1, c.kpool);
        Buf<float> dpk(gpu_, pk0), dki(gpu_, kip), dgs(gpu_, gsp), dape(gpu_, ape);
        Buf<int32_t> dbt(gpu_, bt);
        const mt_paged gpk = {dpk.get(), ppp, c.id}, gki = {dki.get(), kPage, c.id}, ggs = {dgs.get(), kPage, c.id};
        gpu_->ops->dsa_pool_keys(gpu_, gpk, gki, ggs, dbt.get(), dape.get(), c.p0, c.p1, c.kpool);
        const std::vector<float> got = dpk.Get();
        const double e = RelErr(got, pk_cpu);
        // Unpaged reference on each backend: contiguous rows, identity block table.
        std::vector<float> ki_id = Scatter(ki, kPage, c.id, id_bt, blocks, {}), gs_id = Scatter(gs, kPage, c.id, id_bt, blocks, {});
        std::vector<float> pk_id((size_t)blocks * ppp * c.id, 0.f);
        Buf<float> dki_id(gpu_, ki_id), dgs_id(gpu_, gs_id), dpk_id(gpu_, pk_id);
        Buf<int32_t> did_bt(gpu_, id_bt);
        cpu_->ops->dsa_pool_keys(cpu_, {pk_id.data(), ppp, c.id}, {ki_id.data(), kPage, c.id}, {gs_id.data(), kPage, c.id},
                                 id_bt.data(), ape.data(), c.p0, c.p1, c.kpool);
        gpu_->ops->dsa_pool_keys(gpu_, {dpk_id.get(), ppp, c.id}, {dki_id.get(), kPage, c.id}, {dgs_id.get(), kPage, c.id},
                                 did_bt.get(), dape.get(), c.p0, c.p1, c.kpool);
        const size_t r0 = (size_t)c.p0 * c.id, r1 = (size_t)c.p1 * c.id;
        EXPECT_EQ(Slice(Gather(pk_cpu, ppp, c.id, bt, c.p1), r0, r1), Slice(pk_id, r0, r1)) << "cpu paged vs contiguous";
        EXPECT_EQ(Slice(Gather(got, ppp, c.id, bt, c.p1), r0, r1), Slice(dpk_id.Get(), r0, r1)) << "gpu paged vs contiguous";
        std::printf("[dsa_pool_keys] pools [%d, %d) kpool=%d id=%d, paged: rel %.2e\n", c.p0, c.p1, c.kpool, c.id, e);
        EXPECT_LE(e, kRelTol);
        // Every pool-key row the range does not map to is untouched.
        std::vector<bool> written((size_t)n_pages * ppp, false);
        for (int p = c.p0; p < c.p1; p++) written[(size_t)bt[p / ppp] * ppp + p % ppp] = true;
        for (size_t r = 0; r < written.size(); r++) {
            if (written[r]) continue;
            for (int d = 0; d < c.id; d++) ASSERT_EQ(got[r * c.id + d], pk0[r * c.id + d]) << "pool row " << r << " changed";
        }
        // The graph form: the position completing pool p1-1 gives the same key; one completing
        // nothing writes nothing.
        if (c.p1 - c.p0 == 1) {
            Buf<float> dpk2(gpu_, pk0);
            Buf<int32_t> dpos(gpu_, {c.p1 * c.kpool - 1}), dpos_no(gpu_, {c.p1 * c.kpool - 2});
            const mt_paged gpk2 = {dpk2.get(), ppp, c.id};
            gpu_->ops->dsa_pool_keys_at(gpu_, gpk2, gki, ggs, dbt.get(), dape.get(), dpos_no.get(), c.kpool);
            EXPECT_EQ(dpk2.Get(), pk0) << "dsa_pool_keys_at wrote for a position completing no pool";
            gpu_->ops->dsa_pool_keys_at(gpu_, gpk2, gki, ggs, dbt.get(), dape.get(), dpos.get(), c.kpool);
            EXPECT_EQ(dpk2.Get(), got) << "dsa_pool_keys_at";
        }
    }
}

// Pool score of query row i, in double (for judging near-ties); pool is contiguous [pools, id].
double PoolScore(const std::vector<float> &qi, const std::vector<float> &w, const std::vector<float> &pool,
                 int i, int c, const mt_dsa_select_params &p) {
    double s = 0;
    for (int h = 0; h < p.ih; h++) {
        double d = 0;
        for (int j = 0; j < p.id; j++) d += (double)qi[((size_t)i * p.ih + h) * p.id + j] * pool[(size_t)c * p.id + j];
        d /= std::sqrt((double)p.id);
        s += (double)w[(size_t)i * p.ih + h] / std::sqrt((double)p.ih) * (d > 0 ? d : 0);
    }
    return s;
}

struct SelectCase { int ih, id, kpool, max_pools; bool tail; int t0, n; };

// Runs dsa_select on both backends and compares (see the tolerances at the top).
class CudaAttnSelect : public CudaAttn {
  protected:
    void Check(const std::vector<SelectCase> &cases);
};

TEST_F(CudaAttnSelect, DsaSelectRealShapes) {
    Check({
        {32, 128, 16, 128, true, 0, 200},      // the real indexer, few pools: all kept, ascending
        {32, 128, 16, 128, true, 2040, 30},    // crossing 128 complete pools: top-k starts at t = 2063
        {32, 128, 16, 128, true, 2900, 100},   // ~187 candidates, top 128
        {32, 128, 16, 128, false, 3000, 17},
        {32, 128, 16, 128, true, 2999, 1},     // decode
    });
}

TEST_F(CudaAttnSelect, DsaSelectSmallShapes) {
    Check({
        {3, 6, 4, 5, false, 0, 60},            // unaligned head dim, nothing selected for t < 3
        {40, 8, 4, 3, true, 50, 20},           // more heads than a warp
        {4, 32, 8, 6, true, 300, 40},          // kpool 8: 8 pools a page
    });
}

void CudaAttnSelect::Check(const std::vector<SelectCase> &cases) {
    for (const SelectCase &c : cases) {
        mt_dsa_select_params p = {};
        p.ih = c.ih; p.id = c.id; p.kpool = c.kpool; p.max_pools = c.max_pools; p.tail = c.tail;
        p.max_sel = c.max_pools * c.kpool + (c.tail ? c.kpool - 1 : 0);
        const int npool = std::max((c.t0 + c.n) / c.kpool, 1), ppp = kPage / c.kpool;
        const int blocks = (npool + ppp - 1) / ppp, n_pages = blocks + 3;
        std::vector<float> qi = Rand((size_t)c.n * c.ih * c.id), w = Rand((size_t)c.n * c.ih);
        std::vector<float> pool = Rand((size_t)npool * c.id);  // contiguous, by pool index
        const std::vector<int32_t> bt = MakeBt(rng_, blocks, n_pages, true), id_bt = MakeBt(rng_, blocks, blocks, false);
        std::vector<float> pg = Scatter(pool, ppp, c.id, bt, n_pages, Rand((size_t)n_pages * ppp * c.id)), pg_id = Scatter(pool, ppp, c.id, id_bt, blocks, {});
        std::vector<int32_t> sel_cpu((size_t)c.n * p.max_sel, -1), nsel_cpu(c.n, -1), sel_id = sel_cpu, nsel_id = nsel_cpu;
        cpu_->ops->dsa_select(cpu_, sel_cpu.data(), nsel_cpu.data(), qi.data(), w.data(), {pg.data(), ppp, c.id}, bt.data(),
                              c.t0, c.n, &p);
        cpu_->ops->dsa_select(cpu_, sel_id.data(), nsel_id.data(), qi.data(), w.data(), {pg_id.data(), ppp, c.id},
                              id_bt.data(), c.t0, c.n, &p);
        EXPECT_EQ(sel_cpu, sel_id) << "cpu paged vs contiguous";
        EXPECT_EQ(nsel_cpu, nsel_id) << "cpu paged vs contiguous";
        Buf<float> dqi(gpu_, qi), dw(gpu_, w), dpg(gpu_, pg), dpg_id(gpu_, pg_id);
        Buf<int32_t> dbt(gpu_, bt), did_bt(gpu_, id_bt);
        Buf<int32_t> dsel(gpu_, std::vector<int32_t>((size_t)c.n * p.max_sel, -1)), dnsel(gpu_, std::vector<int32_t>(c.n, -1));
        Buf<int32_t> dsel_id(gpu_, std::vector<int32_t>((size_t)c.n * p.max_sel, -1)), dnsel_id(gpu_, std::vector<int32_t>(c.n, -1));
        auto run = [&] {
            gpu_->ops->dsa_select(gpu_, dsel.get(), dnsel.get(), dqi.get(), dw.get(), {dpg.get(), ppp, c.id}, dbt.get(),
                                  c.t0, c.n, &p);
        };
        const double ms = WarmMs(run);
        gpu_->ops->dsa_select(gpu_, dsel_id.get(), dnsel_id.get(), dqi.get(), dw.get(), {dpg_id.get(), ppp, c.id},
                              did_bt.get(), c.t0, c.n, &p);
        const std::vector<int32_t> sel = dsel.Get(), nsel = dnsel.Get();
        EXPECT_EQ(sel, dsel_id.Get()) << "gpu paged vs contiguous";
        EXPECT_EQ(nsel, dnsel_id.Get()) << "gpu paged vs contiguous";
        int identical = 0, near_tie_rows = 0;
        for (int i = 0; i < c.n; i++) {
            ASSERT_EQ(nsel[i], nsel_cpu[i]) << "row " << i << " t=" << c.t0 + i;
            const int32_t *a = &sel[(size_t)i * p.max_sel], *b = &sel_cpu[(size_t)i * p.max_sel];
            if (std::equal(a, a + nsel[i], b)) {
                identical++;
                continue;
            }
            const int t = c.t0 + i, ntail = c.tail ? (t + 1) % c.kpool : 0, npos = nsel[i] - ntail;
            ASSERT_TRUE(std::equal(a + npos, a + nsel[i], b + npos)) << "tail differs, row " << i;
            // Pools in order; each pool's members ascending.
            std::vector<int> pa, pb;
            for (int m = 0; m < npos; m += c.kpool) {
                for (int j = 0; j < c.kpool; j++) {
                    ASSERT_EQ(a[m + j], a[m] + j) << "pool members, row " << i;
                    ASSERT_EQ(a[m] % c.kpool, 0) << "pool start, row " << i;
                }
                pa.push_back(a[m] / c.kpool);
                pb.push_back(b[m] / c.kpool);
            }
            double smax = 0;
            for (int pc = 0; pc < (t + 1) / c.kpool; pc++) smax = std::max(smax, std::fabs(PoolScore(qi, w, pool, i, pc, p)));
            const double tol = 1e-5 * smax;
            // Position by position, the two orders may differ only where the scores tie.
            for (size_t k = 0; k < pa.size(); k++) {
                const double sa = PoolScore(qi, w, pool, i, pa[k], p), sb = PoolScore(qi, w, pool, i, pb[k], p);
                ASSERT_LE(std::fabs(sa - sb), tol) << "row " << i << " rank " << k << ": gpu pool " << pa[k]
                                                   << " (" << sa << ") vs cpu pool " << pb[k] << " (" << sb << ")";
            }
            std::set<int> sa(pa.begin(), pa.end()), sb(pb.begin(), pb.end());
            ASSERT_EQ(sa.size(), pa.size()) << "a pool selected twice, row " << i;
            near_tie_rows++;
        }
        std::printf("[dsa_select] ih=%d id=%d kpool=%d max_pools=%d tail=%d t0=%d n=%d, paged: %d/%d rows identical, "
                    "%d differ only by near-ties (%.3f ms a call, warm)\n",
                    c.ih, c.id, c.kpool, c.max_pools, c.tail, c.t0, c.n, identical, c.n, near_tie_rows, ms);
    }
}

// Random selections of distinct positions <= t, up to max_sel of them; some rows empty.
void RandomSelection(std::mt19937 &rng, int t0, int n, int max_sel, bool allow_empty,
                     std::vector<int32_t> *sel, std::vector<int32_t> *nsel) {
    sel->assign((size_t)n * max_sel, 0);
    nsel->assign(n, 0);
    for (int i = 0; i < n; i++) {
        const int t = t0 + i;
        std::vector<int32_t> all(t + 1);
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng);
        int m = std::min(t + 1, max_sel);
        if (allow_empty && i % 3 == 1) m = 0;
        else if (i % 2 == 0) m = std::max(1, (int)(rng() % (unsigned)m) + 1);
        (*nsel)[i] = m;
        std::copy(all.begin(), all.begin() + m, sel->begin() + (size_t)i * max_sel);
    }
}

struct MlaCase { int Hq, dn, dv, kvl, t0, n, max_sel; mt_dtype dt; bool allow_empty; };

class CudaAttnMla : public CudaAttn {
  protected:
    void Check(const std::vector<MlaCase> &cases, double tol = kRelTol);
};

// Single rounding, the backend's default numerics (mt_cuda_default_params): at kv_lora 512 with
// heads in 64s the prefill's query, latent rows, P and the latent output enter the tensor cores
// rounded to bf16 once (one part, cuda_dsa_mla_wg.cu and the cuBLAS absorb and output over kv_b
// itself); the other shapes keep two parts. ~3e-3 relative against the fp32 CPU. The same with the
// wgmma attend's tiles of 64 selected rows (mt_cuda_params.mla_attend_rows): the random selection
// lengths (up to t + 1) end in partial tiles, and a selection of 50 or 90 fills less than one.
constexpr double kOneRoundingTol = 1.5e-2;

TEST_F(CudaAttnMla, MlaSparseOneRounding) {
    for (int rows : {32, 64}) {
        mt_cuda_params p = mt_cuda_default_params();
        p.mla_attend_rows = rows;
        std::printf("[mla_sparse] one rounding, wgmma tiles of %d selected rows\n", rows);
        WithParams(p, [&] {
            Check({
                {64, 256, 256, 512, 2000, 48, 2063, MT_BF16, true},  // the real model, prefill-sized
                {64, 32, 64, 512, 100, 200, 90, MT_BF16, true},      // splits merged into the output's A
                {128, 16, 16, 512, 60, 33, 50, MT_BF16, true},       // two head groups, rows short of a tile
                {64, 8, 8, 512, 30, 1100, 100, MT_BF16, true},       // two passes, one split: the attend writes the output's A
                {32, 32, 64, 256, 40, 37, 30, MT_BF16, true},        // mma.sync's shape: two parts still
            }, kOneRoundingTol);
        });
    }
}

TEST_F(CudaAttnMla, MlaSparseRealShapes) {
    Check({
        {64, 256, 256, 512, 2990, 1, 2063, MT_BF16, false},  // the real model, decode
        {64, 256, 256, 512, 2990, 4, 2063, MT_BF16, false},  // speculative decode
        {64, 256, 256, 512, 2000, 48, 2063, MT_BF16, true},  // prefill-sized, some rows uniform
        {64, 256, 256, 512, 3000, 2, 2063, MT_F16, false},
    });
}

TEST_F(CudaAttnMla, MlaSparseSmallShapes) {
    Check({
        {4, 24, 20, 72, 100, 50, 40, MT_F32, true},
        {6, 16, 8, 1000, 10, 9, 7, MT_BF16, true},   // 2 heads per block, wide latent
        {8, 16, 16, 64, 300, 3, 100, MT_F16, true},  // many splits, some of them empty
        {2, 8, 8, 32, 0, 1100, 20, MT_F32, true},    // more rows than one pass (1024)
        // the wide fp32 attend kernel (Hq % 32 == 0, kvl 256 or 512, 2 .. 15 rows)
        {64, 16, 16, 512, 70, 5, 64, MT_F32, true},
        {32, 16, 16, 256, 40, 9, 30, MT_F32, true},
        // the tensor-core prefill attend kernel (the same shapes, >= 16 rows)
        {32, 16, 16, 256, 40, 37, 30, MT_F32, true},   // splits, partial tiles, uniform rows
        {32, 8, 8, 256, 0, 1100, 20, MT_F16, true},    // two passes, the second of 76 rows
        {64, 16, 16, 512, 70, 20, 64, MT_BF16, true},  // 2 head groups, many splits, some empty
        {96, 8, 8, 512, 5, 40, 200, MT_F32, true},     // 3 head groups, rows < a tile (t < 32)
        // with it the absorb and output through cuBLAS (bf16 kv_b; odd dims on purpose)
        {32, 32, 64, 256, 40, 37, 30, MT_BF16, true},
        {64, 64, 128, 512, 100, 70, 90, MT_BF16, true},
        {32, 22, 40, 256, 40, 37, 30, MT_BF16, true},    // dn not a multiple of 4: the split's scalar form
        {32, 20, 12, 512, 0, 1100, 20, MT_BF16, true},   // two passes, the second of 76 rows
        {64, 32, 64, 512, 100, 200, 90, MT_BF16, true},  // splits merged into the output's A (132 SMs)
        // kvl 512 with heads in 64s runs the wgmma attend (cuda_dsa_mla_wg.cu); the cases above with
        // 64 heads and kvl 512 do too; these add a second head group and rows short of a tile
        {128, 8, 8, 512, 5, 40, 200, MT_F32, true},
        {128, 16, 16, 512, 60, 33, 50, MT_BF16, true},
        // and across two passes (1024 rows, then 76). A call of more than 1024 rows always plans
        // one split (mla_plan: its 1024 x heads / group blocks are already more than two a
        // multiprocessor), so no pass of such a call merges splits
        {64, 8, 8, 512, 30, 1100, 100, MT_BF16, true},
    });
}

// A quarter of a real prefill pass (256 of its 1024 rows, ~2063 selected each) over shuffled
// pages: the tensor-core attend kernels (wgmma by default, mma.sync with MT_CUDA_MLA_ATTEND_MMA)
// against the fp32 wide one (MT_CUDA_MLA_ATTEND_WIDE), GPU against GPU (the CPU reference would take
// too long); the three times printed.
TEST_F(CudaAttnMla, MlaSparsePrefillOldVsNew) {
    const int Hq = 64, dn = 256, dv = 256, kvl = 512, t0 = 3000, n = 256, max_sel = 2063;
    mt_mla_params p = {Hq, dn, dv, kvl, 1.f / std::sqrt((float)dn)};
    const int64_t rows = (int64_t)Hq * (dn + dv);
    std::vector<float> wf = Rand((size_t)rows * kvl, 1.f / std::sqrt((float)kvl));
    std::vector<uint16_t> wh(wf.size());
    for (size_t i = 0; i < wf.size(); i++) wh[i] = mt_f32_to_bf16(wf[i]);
    const int T = t0 + n, blocks = (T + kPage - 1) / kPage, n_pages = blocks + 3;
    std::vector<float> q = Rand((size_t)n * Hq * dn);
    const std::vector<int32_t> bt = MakeBt(rng_, blocks, n_pages, true);
    const std::vector<float> lat = Scatter(Rand((size_t)T * kvl), kPage, kvl, bt, n_pages, Rand((size_t)n_pages * kPage * kvl));
    std::vector<int32_t> sel((size_t)n * max_sel), nsel(n, max_sel);
    for (int i = 0; i < n; i++) {
        std::vector<int32_t> all(t0 + i + 1);
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng_);
        std::sort(all.begin(), all.begin() + max_sel);
        std::copy(all.begin(), all.begin() + max_sel, sel.begin() + (size_t)i * max_sel);
    }
    mt_weight w_gpu;
    ASSERT_EQ(gpu_->ops->weight(gpu_, wh.data(), MT_BF16, rows, kvl, &w_gpu), MT_OK);
    Buf<float> dq(gpu_, q), dlat(gpu_, lat), dout(gpu_, Rand((size_t)n * Hq * dv));
    Buf<int32_t> dsel(gpu_, sel), dnsel(gpu_, nsel), dbt(gpu_, bt);
    auto run = [&] {
        gpu_->ops->mla_sparse(gpu_, dout.get(), dq.get(), {dlat.get(), kPage, kvl}, dbt.get(), &w_gpu, dsel.get(),
                              dnsel.get(), max_sel, t0, n, &p);
    };
    // params.mla_attend: WIDE the fp32 kernel, MMA mla_attend_tc_kernel, AUTO (the test's exact
    // backend) the wgmma kernel, and AUTO in the default numerics (one rounding); each timed, then
    // its three kernels apart (absorb, attend, output), each synchronised: one profiled call.
    auto with = [&](mt_cuda_mla_attend mode, const char *name, double *ms, bool one = false, int rows = 32) {
        mt_cuda_params prm = one ? mt_cuda_default_params() : ExactParams();
        prm.mla_attend = mode;
        prm.mla_attend_rows = rows;
        auto measure = [&] {
            *ms = WarmMs(run);
            const std::string what = std::string("mla_sparse prefill, attend ") + name;
            mt_cuda_profile(gpu_, true, what.c_str());
            run();
            mt_cuda_profile(gpu_, false, what.c_str());
        };
        if (mode == MT_CUDA_MLA_ATTEND_AUTO && !one) measure();
        else WithParams(prm, measure);
        return dout.Get();
    };
    double ms_old, ms_mma, ms_new, ms_one, ms_one64;
    const std::vector<float> out_old = with(MT_CUDA_MLA_ATTEND_WIDE, "wide", &ms_old),
                             out_mma = with(MT_CUDA_MLA_ATTEND_MMA, "mma", &ms_mma),
                             out_new = with(MT_CUDA_MLA_ATTEND_AUTO, "wg", &ms_new),
                             out_one = with(MT_CUDA_MLA_ATTEND_AUTO, "wg, one rounding", &ms_one, true),
                             out_one64 = with(MT_CUDA_MLA_ATTEND_AUTO, "wg, one rounding, 64-row tiles", &ms_one64,
                                              true, 64);
    const double e = RelErr(out_new, out_old), e_mma = RelErr(out_mma, out_old), e_one = RelErr(out_one, out_old);
    const double e_one64 = RelErr(out_one64, out_old), d64 = RelErr(out_one64, out_one);
    std::printf("[mla_sparse prefill] Hq=%d kvl=%d t0=%d n=%d sel=%d, paged: fp32 wide %.3f ms, mma.sync %.3f ms "
                "(rel %.2e), wgmma %.3f ms (rel %.2e; %.2fx mma.sync), wgmma one rounding %.3f ms (rel %.2e; "
                "%.2fx two parts), with 64-row tiles %.3f ms (rel %.2e; %.2fx 32-row tiles; %.2e from them)\n",
                Hq, kvl, t0, n, max_sel, ms_old, ms_mma, e_mma, ms_new, e, ms_mma / ms_new, ms_one, e_one,
                ms_new / ms_one, ms_one64, e_one64, ms_one / ms_one64, d64);
    EXPECT_LE(e, kRelTol);
    EXPECT_LE(e_mma, kRelTol);
    EXPECT_LE(e_one, kOneRoundingTol);
    EXPECT_LE(e_one64, kOneRoundingTol);
    // the same products; the online softmax's tile boundaries move, and with them where P is
    // rounded against its running max: within the two tilings' own error of the fp32 kernel
    EXPECT_LE(d64, kOneRoundingTol / 2);
    gpu_->ops->weight_free(gpu_, &w_gpu);
}

void CudaAttnMla::Check(const std::vector<MlaCase> &cases, double tol) {
    for (const MlaCase &c : cases) {
        mt_mla_params p = {c.Hq, c.dn, c.dv, c.kvl, 1.f / std::sqrt((float)c.dn)};
        const int T = c.t0 + c.n, blocks = (T + kPage - 1) / kPage, n_pages = blocks + 3;
        const int64_t rows = (int64_t)c.Hq * (c.dn + c.dv);
        std::vector<float> wf = Rand((size_t)rows * c.kvl, 1.f / std::sqrt((float)c.kvl));
        std::vector<uint16_t> wh(wf.size());
        for (size_t i = 0; i < wf.size(); i++) wh[i] = c.dt == MT_BF16 ? mt_f32_to_bf16(wf[i]) : mt_f32_to_f16(wf[i]);
        const void *host_w = c.dt == MT_F32 ? (const void *)wf.data() : (const void *)wh.data();
        std::vector<float> q = Rand((size_t)c.n * c.Hq * c.dn), lat = Rand((size_t)T * c.kvl);
        const std::vector<int32_t> bt = MakeBt(rng_, blocks, n_pages, true), id_bt = MakeBt(rng_, blocks, blocks, false);
        std::vector<float> pg = Scatter(lat, kPage, c.kvl, bt, n_pages, Rand((size_t)n_pages * kPage * c.kvl)), pg_id = Scatter(lat, kPage, c.kvl, id_bt, blocks, {});
        std::vector<int32_t> sel, nsel;
        RandomSelection(rng_, c.t0, c.n, c.max_sel, c.allow_empty, &sel, &nsel);

        mt_weight w_cpu, w_gpu;
        ASSERT_EQ(cpu_->ops->weight(cpu_, host_w, c.dt, rows, c.kvl, &w_cpu), MT_OK);
        ASSERT_EQ(gpu_->ops->weight(gpu_, host_w, c.dt, rows, c.kvl, &w_gpu), MT_OK);
        std::vector<float> out_cpu((size_t)c.n * c.Hq * c.dv);
        cpu_->ops->mla_sparse(cpu_, out_cpu.data(), q.data(), {pg.data(), kPage, c.kvl}, bt.data(), &w_cpu, sel.data(),
                              nsel.data(), c.max_sel, c.t0, c.n, &p);
        Buf<float> dq(gpu_, q), dpg(gpu_, pg), dpg_id(gpu_, pg_id), dout(gpu_, Rand(out_cpu.size())), dout_id(gpu_, Rand(out_cpu.size()));
        Buf<int32_t> dsel(gpu_, sel), dnsel(gpu_, nsel), dbt(gpu_, bt), did_bt(gpu_, id_bt);
        auto run = [&] {
            gpu_->ops->mla_sparse(gpu_, dout.get(), dq.get(), {dpg.get(), kPage, c.kvl}, dbt.get(), &w_gpu, dsel.get(),
                                  dnsel.get(), c.max_sel, c.t0, c.n, &p);
        };
        const double ms = WarmMs(run);
        gpu_->ops->mla_sparse(gpu_, dout_id.get(), dq.get(), {dpg_id.get(), kPage, c.kvl}, did_bt.get(), &w_gpu,
                              dsel.get(), dnsel.get(), c.max_sel, c.t0, c.n, &p);
        const std::vector<float> out = dout.Get(), out_id = dout_id.Get();
        const double e = RelErr(out, out_cpu), e_id = RelErr(out, out_id);
        std::printf("[mla_sparse] Hq=%d dn=%d dv=%d kvl=%d t0=%d n=%d max_sel=%d %s, paged: rel %.2e, vs contiguous "
                    "%.2e%s (%.3f ms a call, warm)\n", c.Hq, c.dn, c.dv, c.kvl, c.t0, c.n, c.max_sel,
                    mt_dtype_name(c.dt), e, e_id, out == out_id ? " (identical)" : "", ms);
        EXPECT_LE(e, tol) << "Hq=" << c.Hq << " kvl=" << c.kvl << " n=" << c.n;
        EXPECT_LE(e_id, 1e-6) << "paged vs contiguous, Hq=" << c.Hq << " kvl=" << c.kvl << " n=" << c.n;
        gpu_->ops->weight_free(gpu_, &w_gpu);
        cpu_->ops->weight_free(cpu_, &w_cpu);
    }
}

// The cache writes (eager across a page boundary, and at a run-time position), pool keys at a
// run-time position, and the rows form of batched decode (cache writes, pool keys, selection,
// sparse MLA), GPU against CPU, on three sequences over shuffled pages: B's first two blocks are
// A's pages (a shared prompt prefix), C is short. The pools start as noise (old history).
TEST_F(CudaAttn, DsaPagedWritesAndRowsMatchCpu) {
    const int kp = 8, id = 32, kvl = 256, Hq = 32, dn = 16, dv = 16, ih = 4, ppp = kPage / kp, n_pages = 14;
    const std::vector<int32_t> perm = MakeBt(rng_, n_pages, n_pages, true);
    const std::vector<int32_t> btA = {perm[0], perm[1], perm[2], perm[3]}, btB = {perm[0], perm[1], perm[4], perm[5]},
                               btC = {perm[6], perm[7]};
    std::vector<float> lat = Rand((size_t)n_pages * kPage * kvl), ki = Rand((size_t)n_pages * kPage * id);
    std::vector<float> gs = Rand((size_t)n_pages * kPage * id, 2.f), pk = Rand((size_t)n_pages * ppp * id);
    const std::vector<float> ape = Rand((size_t)kp * id);
    Buf<float> dlat(gpu_, lat), dki(gpu_, ki), dgs(gpu_, gs), dpk(gpu_, pk), dape(gpu_, ape);
    Buf<int32_t> dbtA(gpu_, btA), dbtB(gpu_, btB), dbtC(gpu_, btC);
    const mt_paged cl = {lat.data(), kPage, kvl}, cki = {ki.data(), kPage, id}, cgs = {gs.data(), kPage, id},
                   cpk = {pk.data(), ppp, id};
    const mt_paged gl = {dlat.get(), kPage, kvl}, gki = {dki.get(), kPage, id}, ggs = {dgs.get(), kPage, id},
                   gpk = {dpk.get(), ppp, id};
    auto check_pools = [&](const char *what) {
        EXPECT_EQ(dlat.Get(), lat) << what << ": latent";
        EXPECT_EQ(dki.Get(), ki) << what << ": ki";
        EXPECT_EQ(dgs.Get(), gs) << what << ": gs";
        const double e = RelErr(dpk.Get(), pk);
        std::printf("[dsa paged] %s: caches identical, pool keys rel %.2e\n", what, e);
        EXPECT_LE(e, kRelTol) << what << ": pool keys";
    };

    // A's positions 60..69 (eager, blocks 0 and 1), B's 130 at a run-time position; pools 7, 8 of A
    // (positions 56..71) as a range, pool 16 of B at the position completing it (135).
    {
        const std::vector<float> rl = Rand((size_t)10 * kvl), rk = Rand((size_t)10 * id), rg = Rand((size_t)10 * id);
        Buf<float> drl(gpu_, rl), drk(gpu_, rk), drg(gpu_, rg);
        const int32_t at = 130, done = 135;
        Buf<int32_t> dat(gpu_, {at}), ddone(gpu_, {done});
        for (auto [c, g, src, dsrc] : {std::tuple{cl, gl, &rl, drl.get()}, {cki, gki, &rk, drk.get()}, {cgs, ggs, &rg, drg.get()}}) {
            cpu_->ops->copy_rows_at(cpu_, c, btA.data(), 60, nullptr, src->data(), 10);
            gpu_->ops->copy_rows_at(gpu_, g, dbtA.get(), 60, nullptr, dsrc, 10);
            cpu_->ops->copy_rows_at(cpu_, c, btB.data(), 0, &at, src->data() + 3 * c.row, 1);
            gpu_->ops->copy_rows_at(gpu_, g, dbtB.get(), 0, dat.get(), dsrc + 3 * c.row, 1);
        }
        cpu_->ops->dsa_pool_keys(cpu_, cpk, cki, cgs, btA.data(), ape.data(), 7, 9, kp);
        gpu_->ops->dsa_pool_keys(gpu_, gpk, gki, ggs, dbtA.get(), dape.get(), 7, 9, kp);
        cpu_->ops->dsa_pool_keys_at(cpu_, cpk, cki, cgs, btB.data(), ape.data(), &done, kp);
        gpu_->ops->dsa_pool_keys_at(gpu_, gpk, gki, ggs, dbtB.get(), dape.get(), ddone.get(), kp);
        check_pools("copy_rows_at, dsa_pool_keys(_at)");
    }

    // The rows form: A at 199 (completes pool 24), B at 190, C at 71 (completes pool 8).
    const int n = 3, t_cap = 256;
    const std::vector<int32_t> pos = {199, 190, 71};
    const std::vector<const int32_t *> bts = {btA.data(), btB.data(), btC.data()};
    Buf<int32_t> dpos(gpu_, pos);
    Buf<const int32_t *> dbts(gpu_, std::vector<const int32_t *>{dbtA.get(), dbtB.get(), dbtC.get()});
    const std::vector<float> rl = Rand((size_t)n * kvl), rk = Rand((size_t)n * id), rg = Rand((size_t)n * id);
    Buf<float> drl(gpu_, rl), drk(gpu_, rk), drg(gpu_, rg);
    // the GPU writes the three caches in one copy_rows_to_n, as the model does
    for (auto [c, src] : {std::pair{cl, &rl}, {cki, &rk}, {cgs, &rg}})
        cpu_->ops->copy_rows_to(cpu_, c, bts.data(), pos.data(), src->data(), n);
    ASSERT_NE(gpu_->ops->copy_rows_to_n, nullptr);
    const mt_paged gdst[3] = {gl, gki, ggs};
    const float *gsrc[3] = {drl.get(), drk.get(), drg.get()};
    gpu_->ops->copy_rows_to_n(gpu_, gdst, gsrc, 3, dbts.get(), dpos.get(), n);
    cpu_->ops->dsa_pool_keys_rows(cpu_, cpk, cki, cgs, bts.data(), ape.data(), pos.data(), n, kp);
    gpu_->ops->dsa_pool_keys_rows(gpu_, gpk, gki, ggs, dbts.get(), dape.get(), dpos.get(), n, kp);
    check_pools("copy_rows_to(_n), dsa_pool_keys_rows");
    // The GPU's pool keys from here on are the CPU's, so that both select over the same keys.
    dpk.Put(pk);

    mt_dsa_select_params sp = {};
    sp.ih = ih; sp.id = id; sp.kpool = kp; sp.max_pools = 6; sp.tail = true;
    sp.max_sel = sp.max_pools * kp + kp - 1;
    sp.t_cap = t_cap;
    const std::vector<float> qi = Rand((size_t)n * ih * id), w = Rand((size_t)n * ih);
    std::vector<int32_t> sel((size_t)n * sp.max_sel, -1), nsel(n, -1);
    cpu_->ops->dsa_select_rows(cpu_, sel.data(), nsel.data(), qi.data(), w.data(), cpk, bts.data(), pos.data(), n, &sp);
    Buf<float> dqi(gpu_, qi), dw(gpu_, w);
    Buf<int32_t> dsel(gpu_, std::vector<int32_t>(sel.size(), -1)), dnsel(gpu_, std::vector<int32_t>(n, -1));
    gpu_->ops->dsa_select_rows(gpu_, dsel.get(), dnsel.get(), dqi.get(), dw.get(), gpk, dbts.get(), dpos.get(), n, &sp);
    const std::vector<int32_t> gsel = dsel.Get(), gnsel = dnsel.Get();
    EXPECT_EQ(gnsel, nsel) << "dsa_select_rows counts";
    for (int i = 0; i < n; i++)
        EXPECT_EQ(Slice(gsel, (size_t)i * sp.max_sel, (size_t)i * sp.max_sel + nsel[i]),
                  Slice(sel, (size_t)i * sp.max_sel, (size_t)i * sp.max_sel + nsel[i])) << "dsa_select_rows row " << i;

    // Sparse MLA over the CPU's selection: all three rows (the wide kernel), then row 0 alone (the
    // one-row decode kernels), then with row 1 attending to everything (nsel 0).
    const int64_t wrows = (int64_t)Hq * (dn + dv);
    std::vector<float> wf = Rand((size_t)wrows * kvl, 1.f / std::sqrt((float)kvl));
    std::vector<uint16_t> wh(wf.size());
    for (size_t i = 0; i < wf.size(); i++) wh[i] = mt_f32_to_bf16(wf[i]);
    mt_weight w_cpu, w_gpu;
    ASSERT_EQ(cpu_->ops->weight(cpu_, wh.data(), MT_BF16, wrows, kvl, &w_cpu), MT_OK);
    ASSERT_EQ(gpu_->ops->weight(gpu_, wh.data(), MT_BF16, wrows, kvl, &w_gpu), MT_OK);
    mt_mla_params mp = {Hq, dn, dv, kvl, 1.f / std::sqrt((float)dn)};
    mp.t_cap = t_cap;
    const std::vector<float> q = Rand((size_t)n * Hq * dn);
    Buf<float> dq(gpu_, q), dout(gpu_, Rand((size_t)n * Hq * dv));
    for (int pass = 0; pass < 3; pass++) {
        const int rows = pass == 1 ? 1 : n;
        if (pass == 2) nsel[1] = 0;
        Buf<int32_t> ds(gpu_, sel), dns(gpu_, nsel);
        std::vector<float> out((size_t)rows * Hq * dv);
        cpu_->ops->mla_sparse_rows(cpu_, out.data(), q.data(), cl, bts.data(), &w_cpu, sel.data(), nsel.data(),
                                   sp.max_sel, pos.data(), rows, &mp);
        gpu_->ops->mla_sparse_rows(gpu_, dout.get(), dq.get(), gl, dbts.get(), &w_gpu, ds.get(), dns.get(), sp.max_sel,
                                   dpos.get(), rows, &mp);
        const double e = RelErr(Slice(dout.Get(), 0, out.size()), out);
        std::printf("[dsa paged] mla_sparse_rows, %d rows%s: rel %.2e\n", rows, pass == 2 ? ", one uniform" : "", e);
        EXPECT_LE(e, kRelTol) << "mla_sparse_rows pass " << pass;
    }
    gpu_->ops->weight_free(gpu_, &w_gpu);
    cpu_->ops->weight_free(cpu_, &w_cpu);
}

}  // namespace
