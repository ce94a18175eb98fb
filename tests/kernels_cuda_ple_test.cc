// tests/kernels_cuda_ple_test.cc: the CUDA backend's PLE ops (ple_inject, copy_rows_from, copy_rows_ptr) against
// the CPU backend, their reference, on fresh random inputs: one sequence's rows (a decode row on
// a fresh state, a prefill longer than the conv's look-back), one row for each of several
// sequences (the rows form), segments of several sequences mixing fresh and used states, runs
// longer than the kernel's look-back stride, no conv state (K = 1), and the real model's width.
// Each case runs several calls in a row, so the state each call leaves is what the next one reads.
//
// Tolerance: fp32 math in both with the norms' and the gate's sums in double, products in other
// orders, so ||gpu - cpu|| / ||cpu|| <= 1e-4 for the highway rows and the conv states (the signed
// square root of the gate magnifies an error near 0, hence not 1e-6). copy_rows_from and
// ple_gather_rows (the hash and gather of decode rows from device ids, from a table in device or
// page-locked host memory) are exact.
//
// Skips when no CUDA device is usable.
#include <gtest/gtest.h>

#include "tests/cuda_test_util.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

extern "C" {
#include "common/mt.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
}

namespace {

const mt_cuda_params kExact = ExactParams();
constexpr double kRelTol = 1e-4;

// A buffer of n T in one backend's memory, freed with it.
template <typename T>
class Dev {
  public:
    Dev(mt_backend *be, const std::vector<T> &host) : be_(be), n_(host.size()) {
        p_ = (T *)be_->ops->alloc(be_, bytes());
        if (p_ && n_) be_->ops->upload(be_, p_, host.data(), bytes());
    }
    ~Dev() { be_->ops->free(be_, p_); }
    Dev(const Dev &) = delete;
    Dev &operator=(const Dev &) = delete;
    T *get() const { return p_; }
    std::vector<T> Get() const {
        std::vector<T> h(n_);
        if (n_) be_->ops->download(be_, h.data(), p_, bytes());
        return h;
    }

  private:
    size_t bytes() const { return n_ ? n_ * sizeof(T) : sizeof(T); }
    mt_backend *be_;
    size_t n_;
    T *p_ = nullptr;
};

// A case: S streams of H, a conv of K taps dil apart, and the rows' sequences as runs of
// consecutive rows (runs[r] rows of sequence r, whose state starts at zero when fresh[r]).
struct PleCase {
    const char *what;
    int S, H, K, dil;
    std::vector<int> runs;
    std::vector<bool> fresh;
};

class CudaPle : public ::testing::Test {
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
    // mean + Normal(0, scale), never exactly zero.
    std::vector<float> Rand(size_t n, float scale = 1.f, float mean = 0.f) {
        std::normal_distribution<float> d(mean, scale);
        std::vector<float> v(n);
        for (auto &x : v) {
            do x = d(rng_); while (x == 0.f);
        }
        return v;
    }
    // `calls` calls of the case on both backends, fresh rows each call, the states carried over.
    void Check(const PleCase &c, int calls) {
        const int S = c.S, H = c.H, K = c.K, C = S * H, P = (K - 1) * c.dil, nseq = (int)c.runs.size();
        int n = 0;
        for (int r : c.runs) n += r;
        const std::vector<float> kn = Rand((size_t)C, 0.2f, 1.f), qn = Rand((size_t)C, 0.2f, 1.f),
                                 cn = Rand((size_t)C, 0.2f, 1.f), cw = Rand((size_t)C * K, 0.5f);
        Dev<float> kn_g(gpu_, kn), qn_g(gpu_, qn), cn_g(gpu_, cn), cw_g(gpu_, cw);
        // one state a sequence; the tables name each row's
        std::vector<std::vector<float>> st_c(nseq);
        std::vector<std::unique_ptr<Dev<float>>> st_g;
        std::vector<float *> tab_c, tab_g;
        for (int r = 0; r < nseq; r++) {
            st_c[r] = c.fresh[r] ? std::vector<float>((size_t)P * C, 0.f) : Rand((size_t)P * C, 0.5f);
            st_g.emplace_back(new Dev<float>(gpu_, st_c[r]));
            for (int i = 0; i < c.runs[r]; i++) {
                tab_c.push_back(P > 0 ? st_c[r].data() : nullptr);
                tab_g.push_back(P > 0 ? st_g[r]->get() : nullptr);
            }
        }
        Dev<float *> tab_gd(gpu_, tab_g);
        const mt_ple_params pp = { S, H, K, c.dil, 1e-5f };
        const std::string shape = Shape({ { "S", S }, { "H", H }, { "K", K }, { "dil", c.dil }, { "n", n }, { "seqs", nseq } });
        for (int call = 0; call < calls; call++) {
            std::vector<float> X = Rand((size_t)n * C, 2.f), keys = Rand((size_t)n * C), vals = Rand((size_t)n * H);
            Dev<float> X_g(gpu_, X), keys_g(gpu_, keys), vals_g(gpu_, vals);
            cpu_->ops->ple_inject(cpu_, X.data(), keys.data(), vals.data(), P > 0 ? tab_c.data() : nullptr, kn.data(),
                                  qn.data(), cn.data(), cw.data(), n, &pp);
            gpu_->ops->ple_inject(gpu_, X_g.get(), keys_g.get(), vals_g.get(), P > 0 ? tab_gd.get() : nullptr, kn_g.get(),
                                  qn_g.get(), cn_g.get(), cw_g.get(), n, &pp);
            gpu_->ops->sync(gpu_);
            const double ex = RelErr(X_g.Get(), X);
            double es = 0;
            for (int r = 0; r < nseq && P > 0; r++) es = std::max(es, RelErr(st_g[r]->Get(), st_c[r]));
            std::printf("[ple_inject] %s (%s) call %d: X rel %.2e, states rel %.2e\n", c.what, shape.c_str(), call, ex, es);
            EXPECT_LE(ex, kRelTol) << c.what << " " << shape << " call " << call;
            EXPECT_LE(es, kRelTol) << c.what << " " << shape << " call " << call;
        }
    }
    mt_backend *gpu_ = nullptr, *cpu_ = nullptr;
    std::mt19937 rng_{ 20261206 };
};

TEST_F(CudaPle, OneSequence) {
    Check({ "decode rows on a fresh state", 4, 64, 4, 3, { 1 }, { true } }, 12);  // past P = 9 rows
    Check({ "prefill longer than the look-back", 4, 64, 4, 3, { 37 }, { false } }, 2);
    Check({ "verify-sized rows", 4, 64, 4, 3, { 4 }, { false } }, 3);
}

TEST_F(CudaPle, RowsForm) {
    Check({ "one row a sequence", 4, 96, 4, 3, { 1, 1, 1, 1, 1 }, { true, false, false, true, false } }, 4);
}

TEST_F(CudaPle, Segments) {
    Check({ "segments, fresh and used", 4, 64, 4, 3, { 1, 1, 6, 13, 2 }, { false, true, false, true, false } }, 3);
    Check({ "runs shorter than the state", 4, 64, 4, 3, { 4, 2, 9 }, { false, false, true } }, 3);
    Check({ "taps next to each other", 2, 40, 2, 1, { 2, 5 }, { true, false } }, 3);
}

// Runs of hundreds of rows, as a prefill's: the conv of a row reads rows of its run far from both
// ends of the pass, and its run's start is found by a search over hundreds of rows.
TEST_F(CudaPle, LongRuns) {
    Check({ "long runs", 4, 300, 4, 3, { 300, 400, 1 }, { false, true, false } }, 2);
}

TEST_F(CudaPle, NoConvState) {
    Check({ "K = 1", 4, 64, 1, 3, { 5, 3 }, { true, false } }, 2);
}

TEST_F(CudaPle, RealWidth) {
    Check({ "real width", 4, 4096, 4, 3, { 3, 1, 1 }, { false, true, false } }, 2);
}

// Rows from a table of sources anywhere in memory (some repeated, some not 16-byte aligned).
TEST_F(CudaPle, CopyRowsFrom) {
    for (int w : { 1024, 1027, 3 }) {
        const int n = 7;
        const std::vector<float> src = Rand((size_t)(n + 2) * w + 8);
        const size_t off[n] = { 0, 1, (size_t)w + 4, 0, (size_t)3 * w + 2, (size_t)2 * w, (size_t)5 * w + 7 };
        Dev<float> src_g(gpu_, src), out_g(gpu_, std::vector<float>((size_t)n * w));
        std::vector<float *> tab;
        std::vector<float> want((size_t)n * w);
        for (int i = 0; i < n; i++) {
            tab.push_back(src_g.get() + off[i]);
            std::copy(src.begin() + off[i], src.begin() + off[i] + w, want.begin() + (size_t)i * w);
        }
        Dev<float *> tab_g(gpu_, tab);
        gpu_->ops->copy_rows_from(gpu_, out_g.get(), (const float *const *)tab_g.get(), n, w);
        EXPECT_EQ(out_g.Get(), want) << "w=" << w;
    }
}

// Rows between two tables (copy_rows_ptr): sources anywhere (some repeated, some not 16-byte
// aligned) into scattered destinations, one row skipped (NULL destination); the memory between
// destinations stays as it was.
TEST_F(CudaPle, CopyRowsPtr) {
    for (int w : { 1024, 1027, 3 }) {
        const int n = 5;
        const std::vector<float> src = Rand((size_t)(n + 2) * w + 8);
        const std::vector<float> before = Rand((size_t)(2 * n + 1) * w + 4);
        const size_t off[n] = { 0, 1, (size_t)w + 4, 0, (size_t)3 * w + 2 };
        const size_t at[n] = { (size_t)2 * w, 3, (size_t)6 * w + 1, (size_t)4 * w, (size_t)8 * w };
        Dev<float> src_g(gpu_, src), out_g(gpu_, before);
        std::vector<float *> dtab;
        std::vector<const float *> stab;
        std::vector<float> want = before;
        for (int i = 0; i < n; i++) { // row 3's destination NULL: skipped
            stab.push_back(src_g.get() + off[i]);
            dtab.push_back(i == 3 ? nullptr : out_g.get() + at[i]);
            if (i != 3) std::copy(src.begin() + off[i], src.begin() + off[i] + w, want.begin() + at[i]);
        }
        Dev<float *> dtab_g(gpu_, dtab);
        Dev<const float *> stab_g(gpu_, stab);
        gpu_->ops->copy_rows_ptr(gpu_, dtab_g.get(), stab_g.get(), n, w);
        EXPECT_EQ(out_g.Get(), want) << "w=" << w;
    }
}

// ple_gather_rows on a bf16 table in device memory and in page-locked host memory (weight_host,
// read at its host address), against the CPU's: runs of several sequences (fresh histories,
// short and full ones, runs longer than the history), ids read with a stride, three calls in a
// row so each reads the histories the last left. The gathered rows and the histories are exact.
TEST_F(CudaPle, GatherRowsFromDeviceAndHostTables) {
    const int N = 4, heads = 3, d = 40, ntab = (N - 1) * heads, stride = 3;
    mt_ple_hash h{};
    h.N = N;
    h.heads = heads;
    h.pad = 5;
    int64_t rows = 0;
    for (int t = 0; t < ntab; t++) {
        h.prime[t] = 101 + 6 * t + (t % 2);  // sizes need not be prime for the op
        h.off[t] = rows;
        rows += h.prime[t];
    }
    for (int k = 0; k < N; k++) h.mult[k] = 0x9e3779b97f4a7c15ull * (uint64_t)(k + 3) | 1u;
    std::vector<uint16_t> tab((size_t)rows * d);
    for (auto &x : tab) x = mt_f32_to_bf16(Rand(1)[0]);
    // the host copy lives page-aligned for weight_host
    void *host = nullptr;
    ASSERT_EQ(posix_memalign(&host, 4096, tab.size() * sizeof(uint16_t)), 0);
    std::copy(tab.begin(), tab.end(), (uint16_t *)host);
    mt_weight w_cpu{}, w_dev{}, w_host{};
    ASSERT_EQ(cpu_->ops->weight(cpu_, tab.data(), MT_BF16, rows, d, &w_cpu), MT_OK);
    ASSERT_EQ(gpu_->ops->weight(gpu_, tab.data(), MT_BF16, rows, d, &w_dev), MT_OK);
    ASSERT_NE(gpu_->ops->weight_host, nullptr);
    ASSERT_EQ(gpu_->ops->weight_host(gpu_, host, MT_BF16, rows, d, &w_host), MT_OK);
    mt_ple_hash *h_cpu = (mt_ple_hash *)cpu_->ops->alloc(cpu_, sizeof h);
    cpu_->ops->upload(cpu_, h_cpu, &h, sizeof h);
    Dev<mt_ple_hash> h_gpu(gpu_, std::vector<mt_ple_hash>{ h });
    const std::vector<int> runs = { 1, 5, 2, 1, 9 };
    const std::vector<std::vector<uint32_t>> start = { { 0 }, { 2, 7, 8 }, { 3, 1, 2, 3 }, { 1, 9 }, { 0 } };
    for (const mt_weight *wg : { &w_dev, &w_host }) {
        const char *what = wg == &w_dev ? "device table" : "host table";
        std::vector<std::vector<uint32_t>> hist_c;
        std::vector<std::unique_ptr<Dev<uint32_t>>> hist_g;
        std::vector<uint32_t *> tab_c, tab_g;
        int n = 0;
        for (size_t r = 0; r < runs.size(); r++) {
            std::vector<uint32_t> v(MT_PLE_MAX_ORDER, 0);
            std::copy(start[r].begin(), start[r].end(), v.begin());
            hist_c.push_back(v);
            hist_g.emplace_back(new Dev<uint32_t>(gpu_, v));
            n += runs[r];
        }
        for (size_t r = 0; r < runs.size(); r++)
            for (int i = 0; i < runs[r]; i++) {
                tab_c.push_back(hist_c[r].data());
                tab_g.push_back(hist_g[r]->get());
            }
        Dev<uint32_t *> tab_gd(gpu_, tab_g);
        for (int call = 0; call < 3; call++) {
            std::vector<int32_t> ids((size_t)n * stride);
            for (auto &x : ids) x = (int32_t)(rng_() % 1000);
            Dev<int32_t> ids_g(gpu_, ids);
            std::vector<float> emb_c((size_t)n * ntab * d);
            Dev<float> emb_g(gpu_, emb_c);
            cpu_->ops->ple_gather_rows(cpu_, emb_c.data(), &w_cpu, ids.data(), stride, tab_c.data(), h_cpu, N, ntab, n);
            gpu_->ops->ple_gather_rows(gpu_, emb_g.get(), wg, ids_g.get(), stride, tab_gd.get(), h_gpu.get(), N, ntab, n);
            gpu_->ops->sync(gpu_);
            EXPECT_EQ(emb_g.Get(), emb_c) << what << " call " << call;
            for (size_t r = 0; r < runs.size(); r++) EXPECT_EQ(hist_g[r]->Get(), hist_c[r]) << what << " call " << call << " run " << r;
        }
    }
    cpu_->ops->free(cpu_, h_cpu);
    cpu_->ops->weight_free(cpu_, &w_cpu);
    gpu_->ops->weight_free(gpu_, &w_dev);
    gpu_->ops->weight_free(gpu_, &w_host);
    free(host);
}

}  // namespace
