// tests/kernels_cuda_attn_test.cc: the CUDA backend's attention-side ops (KDA: conv1d_silu,
// kda_gate, kda_recurrent, kda_chunked, gated_rmsnorm; DSA: dsa_pool_keys, dsa_select,
// mla_sparse) against the CPU backend, their reference, on fresh random inputs over a grid of
// shapes that includes the real model's (64 KDA heads of 128; MLA kv_lora 512 with 64 heads of
// 256/256 over ~3000 positions; indexer 32 heads of 128, kpool 16, 128 pools).
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
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

extern "C" {
#include "common/mt.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
}

namespace {

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
        gpu_ = mt_cuda_backend_new(0, &err);
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

// The real model's heads (64 of 128); decode carries the state over several calls.
TEST_F(CudaAttn, KdaRecurrentRealShapes) {
    for (int n : {1, 63, 200}) CheckDelta(false, n, 64, 128, 1.f, n == 1 ? 3 : 1);
}

TEST_F(CudaAttn, KdaRecurrentSmallShapes) {
    CheckDelta(false, 37, 3, 16, 4.f, 2);  // small head, strong decay
    CheckDelta(false, 20, 2, 48, 0.2f, 1); // a head dim that is not a multiple of 32
    // n == 1 (decode kernel): partial column blocks and rows; dk = 50 takes the general kernel
    CheckDelta(false, 1, 3, 16, 4.f, 2);
    CheckDelta(false, 1, 2, 48, 0.2f, 2);
    CheckDelta(false, 1, 5, 100, 1.f, 3);
    CheckDelta(false, 1, 2, 50, 1.f, 2);
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

// The other precisions of kda_chunked, chosen by MT_CUDA_TC_TERMS at backend creation: 0 = the
// fp32 kernel (bound 1e-4), 1 = single bf16 rounding on the tensor cores (~4e-3; bound 2e-2).
TEST_F(CudaAttn, KdaChunkedPrecisionModes) {
    const char *prev = getenv("MT_CUDA_TC_TERMS");
    const std::string saved = prev ? prev : "";
    for (const char *mode : {"0", "1"}) {
        setenv("MT_CUDA_TC_TERMS", mode, 1);
        mt_error err = {};
        mt_backend *be = mt_cuda_backend_new(0, &err);
        ASSERT_NE(be, nullptr) << "mt_cuda_backend_new: " << err.msg;
        std::swap(be, gpu_);
        std::printf("[kda_chunked] MT_CUDA_TC_TERMS=%s\n", mode);
        CheckDelta(true, 200, 8, 128, 1.f, 2, mode[0] == '0' ? kRelTol : 2e-2);
        CheckDelta(true, 70, 2, 37, 4.f, 1, mode[0] == '0' ? kRelTol : 2e-2);
        std::swap(be, gpu_);
        mt_backend_free(be);
    }
    if (prev) setenv("MT_CUDA_TC_TERMS", saved.c_str(), 1);
    else unsetenv("MT_CUDA_TC_TERMS");
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
// DSA

TEST_F(CudaAttn, DsaPoolKeysMatchesCpu) {
    struct Case { int p0, p1, kpool, id; };
    for (Case c : {Case{0, 187, 16, 128}, Case{100, 101, 16, 128}, Case{3, 40, 4, 12}}) {
        const size_t rows = (size_t)c.p1 * c.kpool;
        std::vector<float> ki = Rand(rows * c.id), gs = Rand(rows * c.id, 2.f), ape = Rand((size_t)c.kpool * c.id);
        std::vector<float> pk = Rand((size_t)c.p1 * c.id);  // rows outside [p0, p1) must stay
        std::vector<float> pk_cpu = pk;
        cpu_->ops->dsa_pool_keys(cpu_, pk_cpu.data(), ki.data(), gs.data(), ape.data(), c.p0, c.p1, c.kpool, c.id);
        Buf<float> dpk(gpu_, pk), dki(gpu_, ki), dgs(gpu_, gs), dape(gpu_, ape);
        gpu_->ops->dsa_pool_keys(gpu_, dpk.get(), dki.get(), dgs.get(), dape.get(), c.p0, c.p1, c.kpool, c.id);
        const std::vector<float> got = dpk.Get();
        const double e = RelErr(got, pk_cpu);
        std::printf("[dsa_pool_keys] pools [%d, %d) kpool=%d id=%d: rel %.2e\n", c.p0, c.p1, c.kpool, c.id, e);
        EXPECT_LE(e, kRelTol);
        for (size_t i = 0; i < (size_t)c.p0 * c.id; i++) ASSERT_EQ(got[i], pk[i]) << "row outside the range changed";
    }
}

// Pool score of query row i, in double (for judging near-ties).
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
    });
}

void CudaAttnSelect::Check(const std::vector<SelectCase> &cases) {
    for (const SelectCase &c : cases) {
        mt_dsa_select_params p = {};
        p.ih = c.ih; p.id = c.id; p.kpool = c.kpool; p.max_pools = c.max_pools; p.tail = c.tail;
        p.max_sel = c.max_pools * c.kpool + (c.tail ? c.kpool - 1 : 0);
        const int npool = (c.t0 + c.n) / c.kpool;
        std::vector<float> qi = Rand((size_t)c.n * c.ih * c.id), w = Rand((size_t)c.n * c.ih);
        std::vector<float> pool = Rand((size_t)std::max(npool, 1) * c.id);
        std::vector<int32_t> sel_cpu((size_t)c.n * p.max_sel, -1), nsel_cpu(c.n, -1);
        cpu_->ops->dsa_select(cpu_, sel_cpu.data(), nsel_cpu.data(), qi.data(), w.data(), pool.data(), c.t0, c.n, &p);
        Buf<float> dqi(gpu_, qi), dw(gpu_, w), dpool(gpu_, pool);
        Buf<int32_t> dsel(gpu_, std::vector<int32_t>((size_t)c.n * p.max_sel, -1)), dnsel(gpu_, std::vector<int32_t>(c.n, -1));
        auto run = [&] {
            gpu_->ops->dsa_select(gpu_, dsel.get(), dnsel.get(), dqi.get(), dw.get(), dpool.get(), c.t0, c.n, &p);
        };
        const double ms = WarmMs(run);
        const std::vector<int32_t> sel = dsel.Get(), nsel = dnsel.Get();
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
        std::printf("[dsa_select] ih=%d id=%d kpool=%d max_pools=%d tail=%d t0=%d n=%d: %d/%d rows identical, "
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
    void Check(const std::vector<MlaCase> &cases);
};

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
        {2, 8, 8, 32, 0, 300, 20, MT_F32, true},     // more rows than one pass (256)
        // the wide fp32 attend kernel (Hq % 32 == 0, kvl 256 or 512, 2 .. 15 rows)
        {64, 16, 16, 512, 70, 5, 64, MT_F32, true},
        {32, 16, 16, 256, 40, 9, 30, MT_F32, true},
        // the tensor-core prefill attend kernel (the same shapes, >= 16 rows)
        {32, 16, 16, 256, 40, 37, 30, MT_F32, true},   // splits, partial tiles, uniform rows
        {32, 8, 8, 256, 0, 300, 20, MT_F16, true},     // two passes, the second of 44 rows
        {64, 16, 16, 512, 70, 20, 64, MT_BF16, true},  // 2 head groups, many splits, some empty
        {96, 8, 8, 512, 5, 40, 200, MT_F32, true},     // 3 head groups, rows < a tile (t < 32)
        // with it the tensor-core absorb and output (bf16 kv_b, dn % 32, dv % 64 == 0)
        {32, 32, 64, 256, 40, 37, 30, MT_BF16, true},    // one K step, a partial row tile
        {64, 64, 128, 512, 100, 70, 90, MT_BF16, true},  // two row tiles, the second partial
    });
}

// The real prefill shape (one pass of 256 rows, ~2063 selected each): the tensor-core attend
// kernel against the fp32 wide one (MT_MLA_ATTEND=wide), GPU against GPU (the CPU reference would
// take too long); both times printed.
TEST_F(CudaAttnMla, MlaSparsePrefillOldVsNew) {
    const int Hq = 64, dn = 256, dv = 256, kvl = 512, t0 = 3000, n = 256, max_sel = 2063;
    mt_mla_params p = {Hq, dn, dv, kvl, 1.f / std::sqrt((float)dn)};
    const int64_t rows = (int64_t)Hq * (dn + dv);
    std::vector<float> wf = Rand((size_t)rows * kvl, 1.f / std::sqrt((float)kvl));
    std::vector<uint16_t> wh(wf.size());
    for (size_t i = 0; i < wf.size(); i++) wh[i] = mt_f32_to_bf16(wf[i]);
    std::vector<float> q = Rand((size_t)n * Hq * dn), lat = Rand((size_t)(t0 + n) * kvl);
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
    Buf<int32_t> dsel(gpu_, sel), dnsel(gpu_, nsel);
    auto run = [&] {
        gpu_->ops->mla_sparse(gpu_, dout.get(), dq.get(), dlat.get(), &w_gpu, dsel.get(), dnsel.get(), max_sel, t0,
                              n, &p);
    };
    const char *prev = getenv("MT_MLA_ATTEND");
    const std::string saved = prev ? prev : "";
    setenv("MT_MLA_ATTEND", "wide", 1);
    const double ms_old = WarmMs(run);
    const std::vector<float> out_old = dout.Get();
    unsetenv("MT_MLA_ATTEND");
    const double ms_new = WarmMs(run);
    const std::vector<float> out_new = dout.Get();
    // The three kernels apart (absorb, attend, output), each synchronised: one profiled call each.
    setenv("MT_MLA_ATTEND", "wide", 1);
    mt_cuda_profile(gpu_, true, "mla_sparse prefill, fp32 wide attend");
    run();
    mt_cuda_profile(gpu_, false, "mla_sparse prefill, fp32 wide attend");
    unsetenv("MT_MLA_ATTEND");
    mt_cuda_profile(gpu_, true, "mla_sparse prefill, tensor-core attend");
    run();
    mt_cuda_profile(gpu_, false, "mla_sparse prefill, tensor-core attend");
    if (prev) setenv("MT_MLA_ATTEND", saved.c_str(), 1);
    const double e = RelErr(out_new, out_old);
    std::printf("[mla_sparse prefill] Hq=%d kvl=%d t0=%d n=%d sel=%d: fp32 wide %.3f ms, tensor cores %.3f ms "
                "(%.1fx), rel %.2e\n", Hq, kvl, t0, n, max_sel, ms_old, ms_new, ms_old / ms_new, e);
    EXPECT_LE(e, kRelTol);
    gpu_->ops->weight_free(gpu_, &w_gpu);
}

void CudaAttnMla::Check(const std::vector<MlaCase> &cases) {
    for (const MlaCase &c : cases) {
        mt_mla_params p = {c.Hq, c.dn, c.dv, c.kvl, 1.f / std::sqrt((float)c.dn)};
        const int T = c.t0 + c.n;
        const int64_t rows = (int64_t)c.Hq * (c.dn + c.dv);
        std::vector<float> wf = Rand((size_t)rows * c.kvl, 1.f / std::sqrt((float)c.kvl));
        std::vector<uint16_t> wh(wf.size());
        for (size_t i = 0; i < wf.size(); i++) wh[i] = c.dt == MT_BF16 ? mt_f32_to_bf16(wf[i]) : mt_f32_to_f16(wf[i]);
        const void *host_w = c.dt == MT_F32 ? (const void *)wf.data() : (const void *)wh.data();
        std::vector<float> q = Rand((size_t)c.n * c.Hq * c.dn), lat = Rand((size_t)T * c.kvl);
        std::vector<int32_t> sel, nsel;
        RandomSelection(rng_, c.t0, c.n, c.max_sel, c.allow_empty, &sel, &nsel);

        mt_weight w_cpu, w_gpu;
        ASSERT_EQ(cpu_->ops->weight(cpu_, host_w, c.dt, rows, c.kvl, &w_cpu), MT_OK);
        ASSERT_EQ(gpu_->ops->weight(gpu_, host_w, c.dt, rows, c.kvl, &w_gpu), MT_OK);
        std::vector<float> out_cpu((size_t)c.n * c.Hq * c.dv);
        cpu_->ops->mla_sparse(cpu_, out_cpu.data(), q.data(), lat.data(), &w_cpu, sel.data(), nsel.data(), c.max_sel,
                              c.t0, c.n, &p);
        Buf<float> dq(gpu_, q), dlat(gpu_, lat), dout(gpu_, Rand(out_cpu.size()));
        Buf<int32_t> dsel(gpu_, sel), dnsel(gpu_, nsel);
        auto run = [&] {
            gpu_->ops->mla_sparse(gpu_, dout.get(), dq.get(), dlat.get(), &w_gpu, dsel.get(), dnsel.get(),
                                  c.max_sel, c.t0, c.n, &p);
        };
        const double ms = WarmMs(run);
        const double e = RelErr(dout.Get(), out_cpu);
        std::printf("[mla_sparse] Hq=%d dn=%d dv=%d kvl=%d t0=%d n=%d max_sel=%d %s: rel %.2e (%.3f ms a call, warm)\n", c.Hq, c.dn,
                    c.dv, c.kvl, c.t0, c.n, c.max_sel, mt_dtype_name(c.dt), e, ms);
        EXPECT_LE(e, kRelTol) << "Hq=" << c.Hq << " kvl=" << c.kvl << " n=" << c.n;
        gpu_->ops->weight_free(gpu_, &w_gpu);
        cpu_->ops->weight_free(cpu_, &w_cpu);
    }
}

}  // namespace
