// tests/kernels_cuda_dense_test.cc: the CUDA backend's dense, MoE and hyper-connection ops against
// the CPU backend (the reference) over a grid of shapes that includes the real model's (hidden
// 4096, 288 experts of 2048 with top-8 and n_group 1, vocab 154880, hc_mult 4). Inputs are fresh
// random values per check (never zero). Skips when no CUDA device is usable (CI and dev hosts have
// the toolkit but no GPU).
//
// Tolerances, as ||cuda - cpu|| / ||cpu|| over the whole output:
//   embed, argmax, router indices              exact
//   norms, elementwise, hc_post, hc_head       1e-6 (same formula; expf and fma differ by an ulp);
//     l2norm beyond d = 4096: 4e-6 (fp32 sum of squares, the CPU's sequential one drifts with d)
//   matmul, moe_experts, hc_pre (dot products) 1e-5 (fp32 sums in another order; K up to 16384)
//     on the fp32 paths: n <= 8 (GEMV), F32 weights, matmul outputs narrower than 512 rows; the
//     GEMV of bf16 weights of >= 1024 rows at n = 3..8 runs on the tensor cores with x in three
//     bf16 parts (24 significant bits, as fp32), under the same 1e-5
//   matmul, moe_experts on the tensor cores    1e-4 (n > 8 on bf16/fp16 weights; x enters as two
//     16-bit parts hi + lo, 16 significant bits: typically ~3e-6 for bf16)
//   the same with MT_NUMERICS_BF16             1e-2 (x rounded once: typically ~1.5e-3 for bf16);
//     matmul also against the CPU fed the same rounded x: 1e-4 (only the fp32 sums differ)
//   router weights                             1e-6
// Each test prints the worst error it saw ("[ metric ]" lines), and a few ops print GPU timings.
#include <gtest/gtest.h>

#include "tests/cuda_test_util.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_ops.h" // cu_moe_experts_grouped (DecodeTimings)

namespace {

const mt_cuda_params kExact = ExactParams();


uint64_t g_seed = 12345;
uint64_t NextSeed() { return g_seed++; }

std::vector<float> Rand(size_t n, float lo = -1.f, float hi = 1.f) {
    std::vector<float> v(n);
    const size_t chunk = 1 << 20;
    const uint64_t seed = NextSeed();
#pragma omp parallel for schedule(static)
    for (size_t c = 0; c < (n + chunk - 1) / chunk; c++) {
        Rng r(seed * 1000003 + c);
        for (size_t i = c * chunk; i < std::min(n, (c + 1) * chunk); i++) v[i] = r.Uniform(lo, hi);
    }
    return v;
}


class CudaOps : public ::testing::Test {
  protected:
    static void SetUpTestSuite() {
        if (!NoGpuReason().empty()) return;
        mt_error err{};
        gpu_ = mt_cuda_backend_new(0, &kExact, &err);
        if (!gpu_) gpu_err_ = err.msg;
        cpu_ = mt_cpu_backend_new(0);
    }
    static void TearDownTestSuite() {
        vocab_.reset();
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

    // A weight held on the host (the CPU backend's view) and on the device.
    struct Weight {
        mt_dtype dt;
        int64_t rows, cols;
        std::vector<uint16_t> h16;
        std::vector<float> h32;
        mt_weight cpu{}, gpu{};
        ~Weight() {
            if (gpu.data) gpu_->ops->weight_free(gpu_, &gpu);
        }
    };
    // Values uniform in +-amp, fresh per call.
    static std::unique_ptr<Weight> MakeWeight(mt_dtype dt, int64_t rows, int64_t cols, float amp = 1.f) {
        auto w = std::make_unique<Weight>();
        w->dt = dt;
        w->rows = rows;
        w->cols = cols;
        const size_t n = (size_t)rows * cols;
        std::vector<float> f = Rand(n, -amp, amp);
        const void *host;
        if (dt == MT_F32) {
            w->h32 = std::move(f);
            host = w->h32.data();
        } else {
            w->h16.resize(n);
#pragma omp parallel for schedule(static)
            for (size_t i = 0; i < n; i++) w->h16[i] = dt == MT_BF16 ? mt_f32_to_bf16(f[i]) : mt_f32_to_f16(f[i]);
            host = w->h16.data();
        }
        EXPECT_EQ(cpu_->ops->weight(cpu_, host, dt, rows, cols, &w->cpu), MT_OK);
        EXPECT_EQ(gpu_->ops->weight(gpu_, host, dt, rows, cols, &w->gpu), MT_OK);
        return w;
    }
    // The real model's vocab-sized bf16 matrix [154880, 4096] (lm_head / embeddings), made once.
    static const Weight &Vocab() {
        if (!vocab_) vocab_ = MakeWeight(MT_BF16, 154880, 4096, 0.05f);
        return *vocab_;
    }

    // A buffer on backend be holding host data.
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

    static double Seconds() {
        return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    }
    // Mean GPU seconds per call of f (after one warm-up call), f enqueueing on be (default gpu_).
    template <class F> static double TimeGpu(F f, int reps, mt_backend *be = nullptr) {
        if (!be) be = gpu_;
        f();
        be->ops->sync(be);
        const double t0 = Seconds();
        for (int r = 0; r < reps; r++) f();
        be->ops->sync(be);
        return (Seconds() - t0) / reps;
    }

    // The device copy bandwidth (GB/s, read + write, as decode_bench measures it), measured on
    // gpu_ once per process and printed then.
    static double CopyGbs() {
        static double gbs = 0;
        if (gbs > 0) return gbs;
        mt_backend *be = gpu_;
        const size_t bytes = (size_t)1 << 30;
        void *a = be->ops->alloc(be, bytes), *b = be->ops->alloc(be, bytes);
        EXPECT_TRUE(a && b);
        if (!a || !b) return 1.0;
        be->ops->copy(be, b, a, bytes);
        be->ops->sync(be);
        const double t0 = Seconds();
        for (int r = 0; r < 10; r++) be->ops->copy(be, r & 1 ? a : b, r & 1 ? b : a, bytes);
        be->ops->sync(be);
        gbs = 2.0 * bytes * 10 / (Seconds() - t0) / 1e9;
        Drop(be, a);
        Drop(be, b);
        std::printf("[ timing   ] decode: device copy bandwidth %.0f GB/s (read + write)\n", gbs);
        return gbs;
    }
    // Seconds per call of f(k), k = 0 .. reps - 1, replayed on be as one graph (after an eager
    // pass that sizes every scratch buffer).
    template <class F> static double GraphTime(mt_backend *be, int reps, F f) {
        for (int k = 0; k < reps; k++) f(k);
        be->ops->sync(be);
        EXPECT_EQ(be->ops->graph_begin(be), MT_OK);
        for (int k = 0; k < reps; k++) f(k);
        mt_graph *g = nullptr;
        EXPECT_EQ(be->ops->graph_end(be, &g), MT_OK);
        if (!g) return 0.0;
        EXPECT_EQ(be->ops->graph_launch(be, g), MT_OK);
        be->ops->sync(be);
        const int launches = 5;
        const double t0 = Seconds();
        for (int l = 0; l < launches; l++) be->ops->graph_launch(be, g);
        be->ops->sync(be);
        const double t = (Seconds() - t0) / (launches * reps);
        be->ops->graph_free(be, g);
        return t;
    }
    static void ReportTiming(const std::string &what, double t, double bytes) {
        std::printf("[ timing   ] decode %-44s %8.1f us %6.0f GB/s %5.1f%% of copy\n", what.c_str(), t * 1e6,
                    bytes / t / 1e9, 100.0 * bytes / t / 1e9 / CopyGbs());
    }

    static mt_backend *gpu_, *cpu_;
    static std::string gpu_err_;
    static std::unique_ptr<Weight> vocab_;
};
mt_backend *CudaOps::gpu_ = nullptr;
mt_backend *CudaOps::cpu_ = nullptr;
std::string CudaOps::gpu_err_;
std::unique_ptr<CudaOps::Weight> CudaOps::vocab_;

const char *DtName(mt_dtype dt) { return mt_dtype_name(dt); }

TEST(CudaBackendNew, SaysWhyWithoutGpu) {
    if (NoGpuReason().empty()) GTEST_SKIP() << "a GPU is present; this checks the no-GPU path";
    mt_error err{};
    mt_backend *be = mt_cuda_backend_new(0, &kExact, &err);
    EXPECT_EQ(be, nullptr);
    EXPECT_NE(std::string(err.msg), "");
    mt_backend_free(be);
}

TEST_F(CudaOps, TableAndMemory) {
    EXPECT_STREQ(gpu_->ops->name, "cuda");
    // Every slot is filled.
    const void *const *slot = (const void *const *)gpu_->ops;
    for (size_t i = 1; i < sizeof(mt_backend_ops) / sizeof(void *); i++) EXPECT_NE(slot[i], nullptr) << "slot " << i;
    // alloc zeroes; upload, copy, zero, download.
    const size_t n = 1000003;
    float *a = (float *)gpu_->ops->alloc(gpu_, n * sizeof(float));
    float *b = (float *)gpu_->ops->alloc(gpu_, n * sizeof(float));
    ASSERT_TRUE(a && b);
    std::vector<float> z = Get(gpu_, a, n);
    EXPECT_TRUE(std::all_of(z.begin(), z.end(), [](float v) { return v == 0.f; }));
    std::vector<float> h = Rand(n);
    gpu_->ops->upload(gpu_, a, h.data(), n * sizeof(float));
    gpu_->ops->copy(gpu_, b, a, n * sizeof(float));
    EXPECT_EQ(Get(gpu_, b, n), h);
    gpu_->ops->zero(gpu_, b + 10, 5 * sizeof(float));
    std::vector<float> g = Get(gpu_, b, n);
    for (int i = 0; i < 20; i++) EXPECT_EQ(g[i], i >= 10 && i < 15 ? 0.f : h[i]);
    Drop(gpu_, a);
    Drop(gpu_, b);
    Drop(gpu_, nullptr);
}

// upload_async: the host buffer may be rewritten as soon as the call returns (pageable memory is
// staged before it returns; page-locked memory takes upload's wait), and the ops after it see the
// data, at a decode table's size and at 4 MB.
TEST_F(CudaOps, UploadAsyncKeepsWhatTheHostHadAtTheCall) {
    ASSERT_NE(gpu_->ops->upload_async, nullptr);
    for (size_t n : {(size_t)40, (size_t)1 << 20}) {
        for (bool pinned : {false, true}) {
            float *h = nullptr;
            std::vector<float> pageable;
            if (pinned) {
                ASSERT_EQ(cudaMallocHost((void **)&h, n * sizeof(float)), cudaSuccess);
            } else {
                pageable.resize(n);
                h = pageable.data();
            }
            const std::vector<float> want = Rand(n);
            std::copy(want.begin(), want.end(), h);
            float *a = (float *)gpu_->ops->alloc(gpu_, n * sizeof(float));
            float *b = (float *)gpu_->ops->alloc(gpu_, n * sizeof(float));
            ASSERT_TRUE(a && b);
            gpu_->ops->upload_async(gpu_, a, h, n * sizeof(float));
            std::fill(h, h + n, -1.f); /* reused at once */
            gpu_->ops->copy(gpu_, b, a, n * sizeof(float));
            EXPECT_EQ(Get(gpu_, b, n), want) << "n=" << n << (pinned ? " page-locked" : " pageable");
            Drop(gpu_, a);
            Drop(gpu_, b);
            if (pinned) cudaFreeHost(h);
        }
    }
}

// A ticket holds what src had when it was queued (later work may overwrite src), stays readable
// for MT_TICKETS begins and any number of reads, and is refused after.
TEST_F(CudaOps, DownloadTicketsKeepTheirBytes) {
    const int n = 1000;
    int32_t *d = (int32_t *)gpu_->ops->alloc(gpu_, sizeof(int32_t) * n);
    ASSERT_NE(d, nullptr);
    std::vector<int64_t> tickets;
    std::vector<std::vector<int32_t>> want;
    for (int k = 0; k < MT_TICKETS + 2; k++) {
        std::vector<int32_t> v(n);
        for (int i = 0; i < n; i++) v[i] = k * 100000 + i;
        gpu_->ops->upload_async(gpu_, d, v.data(), sizeof(int32_t) * n);
        tickets.push_back(gpu_->ops->download_begin(gpu_, d, sizeof(int32_t) * n));
        want.push_back(v);
    }
    std::vector<int32_t> got(n);
    for (int k = 0; k < MT_TICKETS + 2; k++) {
        const mt_status st = gpu_->ops->download_end(gpu_, tickets[k], got.data(), sizeof(int32_t) * n);
        if (k < 2) {
            EXPECT_EQ(st, MT_ERR_STATE) << "ticket " << k;
            continue;
        }
        ASSERT_EQ(st, MT_OK) << "ticket " << k;
        EXPECT_EQ(got, want[k]) << "ticket " << k;
        ASSERT_EQ(gpu_->ops->download_end(gpu_, tickets[k], got.data(), sizeof(int32_t) * n), MT_OK);
        EXPECT_EQ(got, want[k]) << "ticket " << k << ", read again";
    }
    EXPECT_EQ(gpu_->ops->download_end(gpu_, tickets.back() + 1, got.data(), 4), MT_ERR_STATE);
    Drop(gpu_, d);
}

// download_end waits for its own copy and for nothing queued after it: a ticket begun behind ~20
// prefill matmuls still returns the bytes uploaded just before it (so the end waited for the copy),
// and a ticket read while such work is queued behind it leaves that work running (the stream is
// not drained).
TEST_F(CudaOps, DownloadEndWaitsForItsCopyOnly) {
    const int n = 256, rows = 4096;
    auto w = MakeWeight(MT_BF16, 12288, 4096, 0.01f);
    float *x = Put(gpu_, Rand((size_t)rows * 4096));
    float *y = (float *)gpu_->ops->alloc(gpu_, sizeof(float) * (size_t)rows * 12288);
    int32_t *d = (int32_t *)gpu_->ops->alloc(gpu_, sizeof(int32_t) * n);
    ASSERT_TRUE(x && y && d);
    gpu_->ops->matmul(gpu_, y, x, &w->gpu, rows); /* sizes the scratch (a first call may synchronise) */
    gpu_->ops->sync(gpu_);
    std::vector<int32_t> v(n), got(n, -1);
    auto queue_work = [&] {
        for (int k = 0; k < 20; k++) gpu_->ops->matmul(gpu_, y, x, &w->gpu, rows);
    };
    // behind the work: the end must wait for this copy
    queue_work();
    for (int i = 0; i < n; i++) v[i] = 7 * i + 1;
    gpu_->ops->upload_async(gpu_, d, v.data(), sizeof(int32_t) * n);
    int64_t t = gpu_->ops->download_begin(gpu_, d, sizeof(int32_t) * n);
    ASSERT_EQ(gpu_->ops->download_end(gpu_, t, got.data(), sizeof(int32_t) * n), MT_OK);
    EXPECT_EQ(got, v);
    // before the work: the end must not wait for it
    for (int i = 0; i < n; i++) v[i] = 3 * i + 2;
    gpu_->ops->upload_async(gpu_, d, v.data(), sizeof(int32_t) * n);
    t = gpu_->ops->download_begin(gpu_, d, sizeof(int32_t) * n);
    queue_work();
    ASSERT_EQ(gpu_->ops->download_end(gpu_, t, got.data(), sizeof(int32_t) * n), MT_OK);
    EXPECT_EQ(got, v);
    EXPECT_EQ(cudaStreamQuery(cu_stream(gpu_)), cudaErrorNotReady) << "download_end drained the work queued after it";
    (void)cudaGetLastError(); /* "not ready" is no failure of the backend's later checks */
    gpu_->ops->sync(gpu_);
    Drop(gpu_, x);
    Drop(gpu_, y);
    Drop(gpu_, d);
}

TEST_F(CudaOps, Embed) {
    Worst worst{"embed"};
    for (mt_dtype dt : {MT_BF16, MT_F16, MT_F32}) {
        auto t = MakeWeight(dt, 1000, 4096);
        for (int n : {1, 5, 1300, 4500}) {  // 4500: two launches of up to 4096 rows
            std::vector<int32_t> ids(n);
            Rng r(NextSeed());
            for (auto &v : ids) v = (int32_t)(r.Next() % 1000);
            ids[0] = 999;
            std::vector<float> want((size_t)n * 4096);
            cpu_->ops->embed(cpu_, want.data(), &t->cpu, ids.data(), n);
            float *out = (float *)gpu_->ops->alloc(gpu_, want.size() * sizeof(float));
            gpu_->ops->embed(gpu_, out, &t->gpu, ids.data(), n);
            const double e = RelErr(Get(gpu_, out, want.size()), want);
            worst.See(e, Shape({{"n", n}}) + " " + DtName(dt));
            EXPECT_EQ(e, 0.0) << DtName(dt) << " n=" << n;
            Drop(gpu_, out);
        }
    }
    const Weight &v = Vocab();
    std::vector<int32_t> ids = {0, 154879, 77777};
    std::vector<float> want(3 * 4096);
    cpu_->ops->embed(cpu_, want.data(), &v.cpu, ids.data(), 3);
    float *out = (float *)gpu_->ops->alloc(gpu_, want.size() * sizeof(float));
    gpu_->ops->embed(gpu_, out, &v.gpu, ids.data(), 3);
    EXPECT_EQ(RelErr(Get(gpu_, out, want.size()), want), 0.0) << "vocab 154880";
    Drop(gpu_, out);
}

// The CUDA backend's matmul path for n rows on w (kernels/cuda/cuda_dense.cu, matmul_use_tc):
// tensor cores for n > 8 on bf16/fp16 weights of at least 512 rows; fp32 otherwise.
bool MatmulOnTensorCores(const mt_weight &w, int n) { return n > 8 && w.dtype != MT_F32 && w.rows >= 512; }

// x rounded through dtype dt (bf16 or fp16), as the one-part tensor-core path feeds it.
std::vector<float> RoundTo16(std::vector<float> x, mt_dtype dt) {
    for (float &v : x) v = dt == MT_BF16 ? mt_bf16_to_f32(mt_f32_to_bf16(v)) : mt_f16_to_f32(mt_f32_to_f16(v));
    return x;
}

// A CUDA backend made with params p.
mt_backend *BackendWith(const mt_cuda_params &p) {
    mt_error err{};
    mt_backend *be = mt_cuda_backend_new(0, &p, &err);
    EXPECT_NE(be, nullptr) << err.msg;
    return be;
}

// The exact params with numerics v (MT_NUMERICS_BF16: x rounded once; MT_NUMERICS_FP32: the fp32
// kernels only).
mt_cuda_params WithNumerics(mt_numerics v) {
    mt_cuda_params p = ExactParams();
    p.numerics = v;
    return p;
}

// y on both backends for one weight and n fresh input rows: the relative error against the CPU
// (fp32 x) and, when err16 is given, against the CPU fed x rounded to the weight's 16-bit type.
double MatmulErr(mt_backend *cpu, mt_backend *gpu, const mt_weight &wc, const mt_weight &wg, int n,
                 double *err16 = nullptr) {
    std::vector<float> x = Rand((size_t)n * wc.cols);
    std::vector<float> want((size_t)n * wc.rows);
    cpu->ops->matmul(cpu, want.data(), x.data(), &wc, n);
    float *dx = (float *)gpu->ops->alloc(gpu, x.size() * sizeof(float));
    float *dy = (float *)gpu->ops->alloc(gpu, want.size() * sizeof(float));
    gpu->ops->upload(gpu, dx, x.data(), x.size() * sizeof(float));
    gpu->ops->matmul(gpu, dy, dx, &wg, n);
    std::vector<float> got(want.size());
    gpu->ops->download(gpu, got.data(), dy, got.size() * sizeof(float));
    gpu->ops->free(gpu, dx);
    gpu->ops->free(gpu, dy);
    if (err16) {
        std::vector<float> xr = RoundTo16(x, wc.dtype), want16(want.size());
        cpu->ops->matmul(cpu, want16.data(), xr.data(), &wc, n);
        *err16 = RelErr(got, want16);
    }
    return RelErr(got, want);
}

TEST_F(CudaOps, Matmul) {
    Worst worst{"matmul"}, worst_tc{"matmul tc"};
    struct S { int rows, cols; };
    // Real projections (4096x4096, expert/shared 2048x4096 and 4096x2048, router 288x4096, hc fn
    // 24x16384), and odd sizes that take the element-wise (unvectorised) paths and edge tiles;
    // at most 32 rows (17, 32, 8 here) take the narrow kernel for n > 8.
    // Rows of 2..16 load vectors (KDA gates' K = 128, 64, 16, 48) take the short-row GEMV at n <= 2;
    // on the tensor cores K <= 512 with n >= K takes one GEMM over (hi | lo) and a doubled weight.
    const S shapes[] = {{4096, 4096}, {2048, 4096}, {4096, 2048}, {288, 4096}, {24, 16384},
                        {37, 100}, {130, 36}, {3000, 1537}, {600, 36}, {17, 1001}, {32, 300}, {8, 4100},
                        {8192, 128}, {4096, 64}, {1000, 16}, {777, 48}, {5, 128}};
    for (mt_dtype dt : {MT_BF16, MT_F16, MT_F32}) {
        for (const S &s : shapes) {
            auto w = MakeWeight(dt, s.rows, s.cols, 2.f / std::sqrt((float)s.cols));
            for (int n : {1, 2, 3, 5, 8, 9, 33, 130}) {
                if ((double)n * s.rows * s.cols > 6e8) continue;
                const double e = MatmulErr(cpu_, gpu_, w->cpu, w->gpu, n);
                const std::string where = Shape({{"n", n}, {"rows", s.rows}, {"cols", s.cols}}) + " " + DtName(dt);
                const bool tc = MatmulOnTensorCores(w->gpu, n);
                (tc ? worst_tc : worst).See(e, where);
                EXPECT_LE(e, tc ? 1e-4 : 1e-5) << where;
            }
        }
    }
    // The narrow kernel's 4-rows-per-warp form (n >= 2048), with a partial last block.
    for (mt_dtype dt : {MT_BF16, MT_F32}) {
        for (const S &s : {S{24, 400}, S{13, 1001}}) {
            auto w = MakeWeight(dt, s.rows, s.cols, 2.f / std::sqrt((float)s.cols));
            const int n = 2051;
            const double e = MatmulErr(cpu_, gpu_, w->cpu, w->gpu, n);
            const std::string where = Shape({{"n", n}, {"rows", s.rows}, {"cols", s.cols}}) + " " + DtName(dt);
            worst.See(e, where);
            EXPECT_LE(e, 1e-5) << where;
        }
    }
    // The bench-4L decode projections the GEMV's grid choice specialises on (K split over 1-8
    // warps, a tall or a 1-chunk-wide weight), bf16 at 1, 3 and 8 rows (the tensor-core GEMV at 3
    // and 8 from 1024 rows: K split over 1, 4 or 8 warps), then shapes that give the tensor-core GEMV a
    // partial last 16-row tile, a partial 32-column k-block (cols % 32 == 8: one lane of four
    // in range) and a partial chunk (cols 200: 6 of 8 k-blocks; 8: one lane of one k-block).
    for (const S &s : {S{8192, 4096}, S{4096, 8192}, S{4096, 12288}, S{16384, 1536}, S{8192, 128},
                       S{1536, 4096}, S{512, 4096}, S{128, 4096}, S{64, 4096}, S{32, 4096},
                       S{2050, 4104}, S{1030, 200}, S{1031, 8}, S{37, 1000}}) {
        auto w = MakeWeight(MT_BF16, s.rows, s.cols, 2.f / std::sqrt((float)s.cols));
        for (int n : {1, 3, 8}) {
            const double e = MatmulErr(cpu_, gpu_, w->cpu, w->gpu, n);
            const std::string where = Shape({{"n", n}, {"rows", s.rows}, {"cols", s.cols}}) + " BF16";
            worst.See(e, where);
            EXPECT_LE(e, 1e-5) << where;
        }
    }
    // The GEMV sums in an order fixed by the shape: the same call twice gives the same bits (n = 1
    // on the fp32 GEMV, n = 8 on the tensor cores from 1024 rows).
    for (const S &s : {S{4096, 4096}, S{8192, 128}, S{288, 4096}}) {
        auto w = MakeWeight(MT_BF16, s.rows, s.cols, 2.f / std::sqrt((float)s.cols));
        for (int n : {1, 8}) {
            std::vector<float> xh = Rand((size_t)n * s.cols);
            float *x = Put(gpu_, xh);
            float *y = (float *)gpu_->ops->alloc(gpu_, sizeof(float) * (size_t)n * s.rows);
            gpu_->ops->matmul(gpu_, y, x, &w->gpu, n);
            const std::vector<float> a = Get(gpu_, y, (size_t)n * s.rows);
            gpu_->ops->matmul(gpu_, y, x, &w->gpu, n);
            const std::vector<float> b = Get(gpu_, y, (size_t)n * s.rows);
            EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
                << "GEMV not deterministic: " << Shape({{"n", n}, {"rows", s.rows}, {"cols", s.cols}});
            Drop(gpu_, x);
            Drop(gpu_, y);
        }
    }
    const Weight &v = Vocab();
    for (int n : {1, 4, 8, 20}) {
        const double e = MatmulErr(cpu_, gpu_, v.cpu, v.gpu, n);
        const std::string where = Shape({{"n", n}, {"rows", 154880}, {"cols", 4096}}) + " BF16";
        const bool tc = MatmulOnTensorCores(v.gpu, n);
        (tc ? worst_tc : worst).See(e, where);
        EXPECT_LE(e, tc ? 1e-4 : 1e-5) << where;
    }
}

// matmul_multi: several weights sharing x in one launch (the fp32 GEMV rows) or one matmul each,
// a sigmoid on the outputs of a mask; every output against the CPU's matmul (and sigmoid). Sets of the decode shapes (a KDA layer's
// q/k/v and f_a/b/g_a, the DSA projections of h, a dense gate/up) and odd sizes (partial tiles,
// the element-wise path, rows of 1), at 1, 2 rows (one launch), 3 (one matmul each) and 9, 40
// (16-bit weights on the tensor cores: x split once for the whole set).
TEST_F(CudaOps, MatmulMultiMatchesCpu) {
    Worst worst{"matmul_multi"};
    ASSERT_TRUE(gpu_->ops->matmul_multi);
    struct Set { std::vector<int> rows; int cols; mt_dtype dt; };
    const Set sets[] = {{{8192, 8192, 8192}, 4096, MT_BF16}, {{128, 64, 128}, 4096, MT_BF16},
                        {{1536, 576, 128, 64, 32}, 4096, MT_BF16}, {{12288, 12288}, 4096, MT_BF16},
                        {{37, 1, 130, 17}, 100, MT_F32}, {{3, 5}, 36, MT_BF16}, {{600, 2}, 1537, MT_F16},
                        {{24, 24, 24, 24, 24, 24}, 400, MT_BF16}};
    // packed: the set's weights moved into one allocation first (weights_pack), so 9..512 rows
    // take the packed product; a set the backend does not pack (fp32, a part off 16 bytes) is
    // refused and left as it was
    for (const Set &set : sets) for (bool packed : {false, true}) {
        const int count = (int)set.rows.size(), cols = set.cols;
        std::vector<std::unique_ptr<Weight>> ws;
        for (int r : set.rows) ws.push_back(MakeWeight(set.dt, r, cols, 2.f / std::sqrt((float)cols)));
        if (packed) {
            std::vector<mt_weight *> pw;
            std::vector<const void *> before;
            for (auto &w : ws) {
                pw.push_back(&w->gpu);
                before.push_back(w->gpu.data);
            }
            bool fits = set.dt != MT_F32;
            for (int j = 0; j + 1 < count; j++) fits = fits && (int64_t)set.rows[j] * cols * 2 % 16 == 0;
            const mt_status st = gpu_->ops->weights_pack(gpu_, pw.data(), count);
            ASSERT_EQ(st, fits ? MT_OK : MT_ERR_UNSUPPORTED) << DtName(set.dt) << " cols " << cols;
            if (!fits) {
                for (int j = 0; j < count; j++) EXPECT_EQ(ws[j]->gpu.data, before[j]);
                continue;
            }
            for (int j = 1; j < count; j++)
                ASSERT_EQ((const char *)ws[j]->gpu.data,
                          (const char *)ws[j - 1]->gpu.data + (size_t)set.rows[j - 1] * cols * 2);
        }
        for (int n : packed ? std::vector<int>{1, 9, 40, 300} : std::vector<int>{1, 2, 3, 9, 40}) {
            std::vector<float> x = Rand((size_t)n * cols);
            float *gx = Put(gpu_, x);
            std::vector<float *> gy;
            std::vector<const mt_weight *> gw;
            for (int j = 0; j < count; j++) {
                gy.push_back((float *)gpu_->ops->alloc(gpu_, sizeof(float) * (size_t)n * set.rows[j]));
                gw.push_back(&ws[j]->gpu);
            }
            const unsigned mask = (n + count) % 2 ? 0x2u : 0x5u; /* sigmoid on some outputs */
            gpu_->ops->matmul_multi(gpu_, gy.data(), gx, gw.data(), count, n, mask);
            for (int j = 0; j < count; j++) {
                std::vector<float> want((size_t)n * set.rows[j]);
                cpu_->ops->matmul(cpu_, want.data(), x.data(), &ws[j]->cpu, n);
                if (mask >> j & 1u) cpu_->ops->sigmoid(cpu_, want.data(), (int64_t)want.size());
                const double e = RelErr(Get(gpu_, gy[j], want.size()), want);
                const std::string where = Shape({{"n", n}, {"count", count}, {"j", j}, {"rows", set.rows[j]}, {"cols", cols}}) +
                                          " " + DtName(set.dt) + (packed ? " packed" : "");
                const bool tc = MatmulOnTensorCores(ws[j]->gpu, n);
                worst.See(e, where);
                EXPECT_LE(e, tc ? 1e-4 : 1e-5) << where;
                Drop(gpu_, gy[j]);
            }
            Drop(gpu_, gx);
        }
    }
}

// MT_NUMERICS_BF16: x rounded once to the weight's type. 1e-2 against the CPU's fp32 x, 1e-4
// against the CPU fed the rounded x (this pins the GEMM's layout: only the sums' order differs).
// MT_NUMERICS_FP32: the fp32 kernels, 1e-5 at any n. A numerics outside the enum is refused.
TEST_F(CudaOps, MatmulTermsKnob) {
    Worst worst1{"matmul tc1"}, worst1r{"matmul tc1/16"}, worst0{"matmul fp32"};
    mt_backend *one = BackendWith(WithNumerics(MT_NUMERICS_BF16));
    mt_backend *fp32 = BackendWith(WithNumerics(MT_NUMERICS_FP32));
    ASSERT_TRUE(one && fp32);
    struct S { int rows, cols; };
    for (mt_dtype dt : {MT_BF16, MT_F16}) {
        for (const S &s : {S{4096, 4096}, S{3000, 1537}, S{600, 36}}) {
            auto w = MakeWeight(dt, s.rows, s.cols, 2.f / std::sqrt((float)s.cols)); // gpu_'s memory, same device
            for (int n : {9, 130}) {
                const std::string where = Shape({{"n", n}, {"rows", s.rows}, {"cols", s.cols}}) + " " + DtName(dt);
                double e16;
                const double e1 = MatmulErr(cpu_, one, w->cpu, w->gpu, n, &e16);
                worst1.See(e1, where);
                worst1r.See(e16, where);
                EXPECT_LE(e1, 1e-2) << where;
                EXPECT_LE(e16, 1e-4) << where << " (against the rounded x)";
                const double e0 = MatmulErr(cpu_, fp32, w->cpu, w->gpu, n);
                worst0.See(e0, where);
                EXPECT_LE(e0, 1e-5) << where;
            }
        }
    }
    mt_backend_free(one);
    mt_backend_free(fp32);
    const mt_cuda_params bad_p = WithNumerics((mt_numerics)3);
    mt_error err{};
    mt_backend *bad = mt_cuda_backend_new(0, &bad_p, &err);
    EXPECT_EQ(bad, nullptr);
    EXPECT_NE(std::string(err.msg).find("numerics"), std::string::npos) << err.msg;
    mt_backend_free(bad);
}

// MT_NUMERICS_BF16 with exact_classes: a weight of a named class (the router's, a KDA gate's)
// keeps the two-part product (1e-4 against the CPU's fp32 x) while a projection's x is rounded once
// (1e-4 against the CPU fed the rounded x, and further than that from the fp32 x): alone, in one
// matmul_multi split beside each other, and on the low-K form (K <= 512, n >= K). Bits past the
// classes are refused.
TEST_F(CudaOps, MatmulExactClasses) {
    mt_cuda_params p = WithNumerics(MT_NUMERICS_BF16);
    EXPECT_EQ(p.exact_classes, (unsigned)MT_CUDA_EXACT_CLASSES);
    mt_backend *one = BackendWith(p);
    ASSERT_TRUE(one);
    struct S { int rows, cols, n; };
    for (const S &s : {S{288, 4096, 40}, S{8192, 128, 300}, S{600, 36, 130}}) {
        auto gate = MakeWeight(MT_BF16, s.rows, s.cols, 2.f / std::sqrt((float)s.cols));
        auto proj = MakeWeight(MT_BF16, s.rows, s.cols, 2.f / std::sqrt((float)s.cols));
        gate->gpu.cls = gate->cpu.cls = MT_WCLS_ROUTER;
        proj->gpu.cls = proj->cpu.cls = MT_WCLS_ATTN;
        const std::string where = Shape({{"n", s.n}, {"rows", s.rows}, {"cols", s.cols}});
        double e16;
        EXPECT_LE(MatmulErr(cpu_, one, gate->cpu, gate->gpu, s.n), 1e-4) << where << " router alone";
        const double e1 = MatmulErr(cpu_, one, proj->cpu, proj->gpu, s.n, &e16);
        EXPECT_LE(e16, 1e-4) << where << " projection alone, against the rounded x";
        EXPECT_GT(e1, 1e-4) << where << " projection alone: x was not rounded";

        std::vector<float> x = Rand((size_t)s.n * s.cols), xr = RoundTo16(x, MT_BF16);
        float *gx = Put(one, x);
        float *gy[2] = {(float *)one->ops->alloc(one, sizeof(float) * (size_t)s.n * s.rows),
                        (float *)one->ops->alloc(one, sizeof(float) * (size_t)s.n * s.rows)};
        const mt_weight *gw[2] = {&proj->gpu, &gate->gpu};
        one->ops->matmul_multi(one, gy, gx, gw, 2, s.n, 0);
        std::vector<float> want_p((size_t)s.n * s.rows), want_g(want_p.size());
        cpu_->ops->matmul(cpu_, want_p.data(), xr.data(), &proj->cpu, s.n);
        cpu_->ops->matmul(cpu_, want_g.data(), x.data(), &gate->cpu, s.n);
        EXPECT_LE(RelErr(Get(one, gy[0], want_p.size()), want_p), 1e-4) << where << " multi: projection";
        EXPECT_LE(RelErr(Get(one, gy[1], want_g.size()), want_g), 1e-4) << where << " multi: router";
        Drop(one, gy[0]);
        Drop(one, gy[1]);
        // packed: two one-part weights of other widths (x rounded once, no tail), then the same
        // two with the two-part weight after them (x.hi over all three, x.lo over the tail, with
        // the sigmoid on the tail); in the other order the group is not a packed run and goes apart
        auto proj2 = MakeWeight(MT_BF16, s.rows / 2, s.cols, 2.f / std::sqrt((float)s.cols));
        proj2->gpu.cls = proj2->cpu.cls = MT_WCLS_ATTN;
        std::vector<float> want_2((size_t)s.n * (s.rows / 2));
        cpu_->ops->matmul(cpu_, want_2.data(), xr.data(), &proj2->cpu, s.n);
        cpu_->ops->sigmoid(cpu_, want_g.data(), (int64_t)want_g.size());
        const std::vector<float> *want[3] = {&want_p, &want_2, &want_g};
        const char *name[3] = {"projection", "second projection", "router"};
        mt_weight *pw[3] = {&proj->gpu, &proj2->gpu, &gate->gpu};
        ASSERT_EQ(one->ops->weights_pack(one, pw, 3), MT_OK);
        const mt_weight *order[2][3] = {{&proj->gpu, &proj2->gpu, &gate->gpu}, {&gate->gpu, &proj->gpu, &proj2->gpu}};
        const int where_of[2][3] = {{0, 1, 2}, {2, 0, 1}};
        for (int o = 0; o < 2; o++)
            for (int count : {2, 3}) {
                if (o == 1 && count == 2) continue;
                float *y[3];
                for (int j = 0; j < count; j++) y[j] = (float *)one->ops->alloc(one, sizeof(float) * want[where_of[o][j]]->size());
                unsigned mask = 0;
                for (int j = 0; j < count; j++) mask |= (where_of[o][j] == 2 ? 1u : 0u) << j;
                one->ops->matmul_multi(one, y, gx, order[o], count, s.n, mask);
                for (int j = 0; j < count; j++) {
                    const std::vector<float> &w = *want[where_of[o][j]];
                    EXPECT_LE(RelErr(Get(one, y[j], w.size()), w), 1e-4)
                        << where << " packed, " << count << " weights, order " << o << ": " << name[where_of[o][j]];
                    Drop(one, y[j]);
                }
            }
        Drop(one, gx);
    }
    mt_backend_free(one);
    p.exact_classes = 1u << MT_WCLS_N;
    mt_error err{};
    mt_backend *bad = mt_cuda_backend_new(0, &p, &err);
    EXPECT_EQ(bad, nullptr);
    EXPECT_NE(std::string(err.msg).find("exact_classes"), std::string::npos) << err.msg;
    mt_backend_free(bad);
}

// Timings of the backend's path (tensor cores, x in two parts, for n > 8) and, for n > 8, of the
// one-part tensor-core path (MT_NUMERICS_BF16) and the fp32 kernels (MT_NUMERICS_FP32: narrow or
// tiled). Outputs narrower than 512 rows also on the tensor cores in two parts (the default path)
// and, at most 32 rows, on the tiled fp32 kernel instead of the narrow one (params.narrow false).
TEST_F(CudaOps, MatmulTimings) {
    mt_backend *one = BackendWith(WithNumerics(MT_NUMERICS_BF16));
    mt_backend *fp32 = BackendWith(WithNumerics(MT_NUMERICS_FP32));
    ASSERT_TRUE(one && fp32);
    mt_cuda_params tiled_p = WithNumerics(MT_NUMERICS_FP32);
    tiled_p.narrow = false;
    mt_backend *tcall = BackendWith(ExactParams()), *tiled = BackendWith(tiled_p);
    ASSERT_TRUE(tcall && tiled);
    struct S { int n, rows, cols; };
    const S shapes[] = {{1, 154880, 4096}, {1, 4096, 4096}, {1, 2048, 4096}, {8, 4096, 4096},
                        {9, 4096, 4096}, {16, 4096, 4096}, {32, 4096, 4096}, {64, 4096, 4096},
                        {128, 4096, 4096}, {512, 4096, 4096}, {4096, 4096, 4096}, {512, 12288, 4096},
                        {4096, 12288, 4096}, {512, 2048, 4096}, {512, 4096, 2048}, {512, 154880, 4096},
                        {16, 512, 4096}, {512, 512, 4096}, {512, 288, 4096}, {512, 24, 16384},
                        {4096, 288, 4096}, {4096, 128, 4096}, {4096, 64, 4096}, {4096, 24, 16384}};
    for (const S &s : shapes) {
        std::unique_ptr<Weight> own;
        const Weight *w;
        if (s.rows == 154880) {
            w = &Vocab();
        } else {
            own = MakeWeight(MT_BF16, s.rows, s.cols, 0.05f);
            w = own.get();
        }
        float *x = Put(gpu_, Rand((size_t)s.n * s.cols));
        float *y = (float *)gpu_->ops->alloc(gpu_, (size_t)s.n * s.rows * sizeof(float));
        const double t = TimeGpu([&] { gpu_->ops->matmul(gpu_, y, x, &w->gpu, s.n); }, 20);
        const double bytes = 2.0 * s.rows * s.cols, flops = 2.0 * s.n * s.rows * s.cols;
        const bool tc = MatmulOnTensorCores(w->gpu, s.n);
        std::printf("[ timing   ] matmul bf16 n=%d %dx%d (%s): %.1f us, %.0f GB/s weight, %.2f TFLOP/s\n", s.n,
                    s.rows, s.cols, tc ? "tensor cores, 2 parts" : "fp32", t * 1e6, bytes / t / 1e9,
                    flops / t / 1e12);
        if (tc) {
            const double t1 = TimeGpu([&] { one->ops->matmul(one, y, x, &w->gpu, s.n); }, 20, one);
            std::printf("[ timing   ]   1 part (MT_NUMERICS_BF16): %.1f us, %.2f TFLOP/s\n", t1 * 1e6,
                        flops / t1 / 1e12);
        }
        if (s.n > 8 && (double)s.n * s.rows * s.cols <= 1.1e11) {
            const double t32 = TimeGpu([&] { fp32->ops->matmul(fp32, y, x, &w->gpu, s.n); }, 3, fp32);
            std::printf("[ timing   ]   fp32 kernel (MT_NUMERICS_FP32): %.1f us, %.2f TFLOP/s\n", t32 * 1e6,
                        flops / t32 / 1e12);
        }
        if (s.n > 8 && !tc) {
            const double ttc = TimeGpu([&] { tcall->ops->matmul(tcall, y, x, &w->gpu, s.n); }, 5, tcall);
            std::printf("[ timing   ]   tensor cores, 2 parts (default): %.1f us, %.2f TFLOP/s\n",
                        ttc * 1e6, flops / ttc / 1e12);
            if (s.rows <= 32) {
                const double tt = TimeGpu([&] { tiled->ops->matmul(tiled, y, x, &w->gpu, s.n); }, 3, tiled);
                std::printf("[ timing   ]   tiled fp32 kernel (MT_NUMERICS_FP32, narrow off): %.1f us, %.2f TFLOP/s\n",
                            tt * 1e6, flops / tt / 1e12);
            }
        }
        Drop(gpu_, x);
        Drop(gpu_, y);
    }
    mt_backend_free(one);
    mt_backend_free(fp32);
    mt_backend_free(tcall);
    mt_backend_free(tiled);
}

// d % 4 == 0 up to 16384 takes the register-resident kernels (a warp per row up to 512, a block
// per row beyond: 516, 1536, 4096, 16384); 7 and 16388 the scalar ones. l2norm sums x^2 in fp32,
// as the CPU does but in another order; the CPU's sequential fp32 sum drifts with d (both GPU
// kernels land ~1.5-2e-6 from it at d = 16384, seen on an H200), so beyond 4096 it gets 4e-6.
TEST_F(CudaOps, Norms) {
    Worst worst{"norms"};
    for (int d : {4096, 1536, 516, 512, 128, 100, 7, 16384, 16388}) {
        for (int n : {1, 3, 64}) {
            if (d > 4096 && n == 64) continue;
            const size_t sz = (size_t)n * d;
            std::vector<float> w = Rand(d, 0.5f, 1.5f), b = Rand(d);
            float *gw = Put(gpu_, w), *gb = Put(gpu_, b);
            for (int kind = 0; kind < 5; kind++) { // rms, rms without w, layernorm, l2norm, rms in place
                std::vector<float> x = Rand(sz, -3.f, 3.f), want(sz);
                float *gx = Put(gpu_, x), *gout = (float *)gpu_->ops->alloc(gpu_, sz * sizeof(float));
                float *dst = gout;
                const char *name = "";
                switch (kind) {
                case 0:
                    name = "rmsnorm";
                    cpu_->ops->rmsnorm(cpu_, want.data(), x.data(), w.data(), n, d, 1e-6f);
                    gpu_->ops->rmsnorm(gpu_, gout, gx, gw, n, d, 1e-6f);
                    break;
                case 1:
                    name = "rmsnorm(w=NULL)";
                    cpu_->ops->rmsnorm(cpu_, want.data(), x.data(), nullptr, n, d, 1e-5f);
                    gpu_->ops->rmsnorm(gpu_, gout, gx, nullptr, n, d, 1e-5f);
                    break;
                case 2:
                    name = "layernorm";
                    cpu_->ops->layernorm(cpu_, want.data(), x.data(), w.data(), b.data(), n, d, 1e-5f);
                    gpu_->ops->layernorm(gpu_, gout, gx, gw, gb, n, d, 1e-5f);
                    break;
                case 3:
                    name = "l2norm";
                    want = x;
                    cpu_->ops->l2norm(cpu_, want.data(), n, d, 1e-6f, 0.37f);
                    gpu_->ops->l2norm(gpu_, gx, n, d, 1e-6f, 0.37f);
                    dst = gx;
                    break;
                case 4:
                    name = "rmsnorm(in place)";
                    cpu_->ops->rmsnorm(cpu_, want.data(), x.data(), w.data(), n, d, 1e-6f);
                    gpu_->ops->rmsnorm(gpu_, gx, gx, gw, n, d, 1e-6f);
                    dst = gx;
                    break;
                }
                const double e = RelErr(Get(gpu_, dst, sz), want);
                const std::string where = std::string(name) + " " + Shape({{"n", n}, {"d", d}});
                worst.See(e, where);
                // l2norm sums in float (as the CPU does), in another order: from d = 4096 on the
                // difference reaches ~1e-6 on some data (1.04e-6 seen at n=1 d=4096).
                EXPECT_LE(e, kind == 3 && d >= 4096 ? 4e-6 : 1e-6) << where;
                Drop(gpu_, gx);
                Drop(gpu_, gout);
            }
            Drop(gpu_, gw);
            Drop(gpu_, gb);
        }
    }
}

TEST_F(CudaOps, SwigluAndSigmoid) {
    Worst worst{"elementwise"};
    for (int n : {1, 7, 300}) {
        for (int I : {2048, 33}) {
            for (float L : {10.f, 1.f}) {
                const size_t sz = (size_t)n * I;
                std::vector<float> g = Rand(sz, -15.f, 15.f), u = Rand(sz, -15.f, 15.f), want(sz);
                cpu_->ops->swiglu(cpu_, want.data(), g.data(), u.data(), n, I, L);
                float *gg = Put(gpu_, g), *gu = Put(gpu_, u);
                gpu_->ops->swiglu(gpu_, gg, gg, gu, n, I, L); // out aliases gate
                const double e = RelErr(Get(gpu_, gg, sz), want);
                const std::string where = "swiglu " + Shape({{"n", n}, {"I", I}}) + " L=" + std::to_string(L);
                worst.See(e, where);
                EXPECT_LE(e, 1e-6) << where;
                Drop(gpu_, gg);
                Drop(gpu_, gu);
            }
        }
    }
    for (int64_t count : {(int64_t)1, (int64_t)1000, (int64_t)(1 << 20) + 3}) {
        std::vector<float> x = Rand((size_t)count, -20.f, 20.f), want = x;
        cpu_->ops->sigmoid(cpu_, want.data(), count);
        float *gx = Put(gpu_, x);
        gpu_->ops->sigmoid(gpu_, gx, count);
        const double e = RelErr(Get(gpu_, gx, (size_t)count), want);
        worst.See(e, "sigmoid count=" + std::to_string(count));
        EXPECT_LE(e, 1e-6) << "sigmoid count=" << count;
        Drop(gpu_, gx);
    }
}

TEST_F(CudaOps, Argmax) {
    struct S { int n, V; int ties; };
    for (const S &s : {S{1, 154880, 0}, S{3, 154880, 3}, S{7, 1000, 2}, S{5, 33, 0}, S{2, 9000, 4}}) {
        std::vector<float> l = Rand((size_t)s.n * s.V, -10.f, 10.f);
        Rng r(NextSeed());
        for (int i = 0; i < s.n; i++) {
            // Several equal maxima in one row: the lowest index wins; or the max at the last index.
            if (s.ties) {
                for (int t = 0; t < s.ties; t++) l[(size_t)i * s.V + r.Next() % s.V] = 11.f;
            } else if (i % 2 == 0) {
                l[(size_t)i * s.V + s.V - 1] = 12.f;
            }
        }
        std::vector<int32_t> want(s.n), got(s.n, -1);
        cpu_->ops->argmax(cpu_, want.data(), l.data(), s.n, s.V);
        float *gl = Put(gpu_, l);
        gpu_->ops->argmax(gpu_, got.data(), gl, s.n, s.V);
        EXPECT_EQ(got, want) << Shape({{"n", s.n}, {"V", s.V}});
        // argmax_dev: the same indices, each written rep times, left on the device; read back
        // through a download ticket
        for (int rep : {1, 4}) {
            int32_t *d = (int32_t *)gpu_->ops->alloc(gpu_, sizeof(int32_t) * (size_t)s.n * rep);
            ASSERT_NE(d, nullptr);
            gpu_->ops->argmax_dev(gpu_, d, rep, gl, s.n, s.V);
            const int64_t t = gpu_->ops->download_begin(gpu_, d, sizeof(int32_t) * (size_t)s.n * rep);
            std::vector<int32_t> table((size_t)s.n * rep, -1);
            ASSERT_EQ(gpu_->ops->download_end(gpu_, t, table.data(), table.size() * sizeof(int32_t)), MT_OK);
            for (int i = 0; i < s.n; i++)
                for (int j = 0; j < rep; j++)
                    EXPECT_EQ(table[(size_t)i * rep + j], want[i]) << Shape({{"n", s.n}, {"V", s.V}, {"rep", rep}});
            Drop(gpu_, d);
        }
        Drop(gpu_, gl);
    }
    float *gl = Put(gpu_, Rand(154880));
    int32_t o;
    const double t = TimeGpu([&] { gpu_->ops->argmax(gpu_, &o, gl, 1, 154880); }, 50);
    std::printf("[ timing   ] argmax n=1 V=154880 (with the download): %.1f us\n", t * 1e6);
    Drop(gpu_, gl);
}

TEST_F(CudaOps, MoeRoute) {
    Worst worst{"moe_route"};
    const mt_router_params cfgs[] = {
        {288, 1, 1, 8, true, 2.5f},   // the real model
        {16, 4, 2, 4, false, 1.f},
        {64, 8, 4, 6, true, 1.5f},
        {256, 8, 4, 8, true, 2.5f},
        // Beyond 512 experts the picks scan shared memory instead of registers; every group kept
        // (topk_group == n_group, as the real model's single group) skips the group scores.
        {1024, 8, 4, 8, true, 2.5f},  // large groups (128): the warp-merged group top-2
        {1024, 4, 4, 8, false, 1.f},
        {256, 8, 8, 40, true, 1.f},   // more picks than lanes
    };
    for (const mt_router_params &p : cfgs) {
        for (int n : {1, 5, 130}) {
            const int E = p.n_experts, k = p.top_k;
            std::vector<float> logits = Rand((size_t)n * E, -4.f, 4.f), bias = Rand(E, -0.1f, 0.1f);
            std::vector<int32_t> widx((size_t)n * k);
            std::vector<float> ww((size_t)n * k);
            cpu_->ops->moe_route(cpu_, widx.data(), ww.data(), logits.data(), bias.data(), &p, n);
            float *gl = Put(gpu_, logits), *gb = Put(gpu_, bias);
            int32_t *gi = (int32_t *)gpu_->ops->alloc(gpu_, widx.size() * sizeof(int32_t));
            float *gw = (float *)gpu_->ops->alloc(gpu_, ww.size() * sizeof(float));
            gpu_->ops->moe_route(gpu_, gi, gw, gl, gb, &p, n);
            const std::string where = Shape({{"E", E}, {"groups", p.n_group}, {"top_k", k}, {"n", n}});
            EXPECT_EQ(Get(gpu_, gi, widx.size()), widx) << where;
            const double e = RelErr(Get(gpu_, gw, ww.size()), ww);
            worst.See(e, where);
            EXPECT_LE(e, 1e-6) << where;
            // a part of the experts kept (moe_keep_experts) from the same picks on both backends, in
            // place and then, for the rest, from a copy of the picks
            const std::vector<float> gw0 = Get(gpu_, gw, ww.size());
            const std::vector<int32_t> gi0 = Get(gpu_, gi, widx.size());
            std::vector<float> cw = gw0;
            std::vector<int32_t> ci = gi0;
            cpu_->ops->moe_keep_experts(cpu_, ci.data(), cw.data(), nullptr, nullptr, n, k, E / 4, E / 2);
            gpu_->ops->moe_keep_experts(gpu_, gi, gw, nullptr, nullptr, n, k, E / 4, E / 2);
            EXPECT_EQ(Get(gpu_, gi, widx.size()), ci) << where << " kept";
            EXPECT_EQ(Get(gpu_, gw, ww.size()), cw) << where << " kept";
            int32_t *fi = Put(gpu_, gi0);
            float *fw = Put(gpu_, gw0);
            cpu_->ops->moe_keep_experts(cpu_, ci.data(), cw.data(), gi0.data(), gw0.data(), n, k, E / 2, E);
            gpu_->ops->moe_keep_experts(gpu_, gi, gw, fi, fw, n, k, E / 2, E);
            EXPECT_EQ(Get(gpu_, gi, widx.size()), ci) << where << " kept from the picks";
            EXPECT_EQ(Get(gpu_, gw, ww.size()), cw) << where << " kept from the picks";
            Drop(gpu_, fi);
            Drop(gpu_, fw);
            Drop(gpu_, gl);
            Drop(gpu_, gb);
            Drop(gpu_, gi);
            Drop(gpu_, gw);
        }
    }
}

class CudaMoe : public CudaOps {
  protected:
    // A set of expert weights and the host tables of both backends, E entries cycling over
    // `distinct` weight triples (the real model's 288 experts of 2048 would need 14 GB).
    struct Experts {
        std::vector<std::unique_ptr<Weight>> w; // gate, up, down per distinct expert
        std::vector<mt_expert> cpu, gpu;
    };
    static Experts MakeExperts(mt_dtype dt, int E, int distinct, int H, int I) {
        Experts ex;
        for (int d = 0; d < distinct; d++) {
            ex.w.push_back(MakeWeight(dt, I, H, 2.f / std::sqrt((float)H)));
            ex.w.push_back(MakeWeight(dt, I, H, 2.f / std::sqrt((float)H)));
            ex.w.push_back(MakeWeight(dt, H, I, 2.f / std::sqrt((float)I)));
        }
        for (int e = 0; e < E; e++) {
            const int d = (e * 7) % distinct;
            ex.cpu.push_back({ex.w[3 * d]->cpu, ex.w[3 * d + 1]->cpu, ex.w[3 * d + 2]->cpu});
            ex.gpu.push_back({ex.w[3 * d]->gpu, ex.w[3 * d + 1]->gpu, ex.w[3 * d + 2]->gpu});
        }
        return ex;
    }
    // Distinct random experts per row.
    static std::vector<int32_t> RandIdx(int n, int k, int E) { return DistinctIdx(NextSeed(), n, k, E); }
    // out += experts on both backends from the same idx/weights (uploaded); relative error.
    // On the CUDA backend gpu (default gpu_; another one shares gpu_'s memory: same device).
    static double Run(const Experts &ex, const std::vector<int32_t> &idx, int n, int k, int H, int I, float L,
                      mt_backend *gpu = nullptr) {
        if (!gpu) gpu = gpu_;
        std::vector<float> x = Rand((size_t)n * H), wts = Rand((size_t)n * k, 0.05f, 1.f);
        std::vector<float> want = Rand((size_t)n * H);
        float *gx = Put(gpu_, x), *gw = Put(gpu_, wts), *go = Put(gpu_, want);
        int32_t *gi = Put(gpu_, idx);
        cpu_->ops->moe_experts(cpu_, want.data(), x.data(), idx.data(), wts.data(), ex.cpu.data(), n, k, H, I, L);
        gpu->ops->moe_experts(gpu, go, gx, gi, gw, ex.gpu.data(), n, k, H, I, L);
        const double e = RelErr(Get(gpu, go, want.size()), want);
        Drop(gpu_, gx);
        Drop(gpu_, gw);
        Drop(gpu_, go);
        Drop(gpu_, gi);
        return e;
    }
    // out += experts on two CUDA backends (sharing gpu_'s memory) from the same inputs: the
    // relative error of a's output against b's.
    static double Between(const Experts &ex, const std::vector<int32_t> &idx, int n, int k, int H, int I, float L,
                          mt_backend *a, mt_backend *b) {
        const std::vector<float> x = Rand((size_t)n * H), wts = Rand((size_t)n * k, 0.05f, 1.f);
        const std::vector<float> o = Rand((size_t)n * H);
        float *gx = Put(gpu_, x), *gw = Put(gpu_, wts), *ga = Put(gpu_, o), *gb = Put(gpu_, o);
        int32_t *gi = Put(gpu_, idx);
        a->ops->moe_experts(a, ga, gx, gi, gw, ex.gpu.data(), n, k, H, I, L);
        b->ops->moe_experts(b, gb, gx, gi, gw, ex.gpu.data(), n, k, H, I, L);
        const double e = RelErr(Get(a, ga, o.size()), Get(b, gb, o.size()));
        for (void *p : {(void *)gx, (void *)gw, (void *)ga, (void *)gb, (void *)gi}) Drop(gpu_, p);
        return e;
    }
    // The same with indices from the CUDA backend's own router over `logits` [n, E] (so
    // moe_experts may skip reading them back); the CPU then runs on the indices and weights it
    // chose, read back.
    static double RunRouted(const Experts &ex, const std::vector<float> &logits, int n, int k, int E, int H, int I) {
        const mt_router_params rp = {E, 1, 1, k, true, 2.5f};
        std::vector<float> bias = Rand(E, -0.1f, 0.1f), x = Rand((size_t)n * H), want = Rand((size_t)n * H);
        float *gl = Put(gpu_, logits), *gb = Put(gpu_, bias), *gx = Put(gpu_, x), *go = Put(gpu_, want);
        int32_t *gi = (int32_t *)gpu_->ops->alloc(gpu_, (size_t)n * k * sizeof(int32_t));
        float *gw = (float *)gpu_->ops->alloc(gpu_, (size_t)n * k * sizeof(float));
        gpu_->ops->moe_route(gpu_, gi, gw, gl, gb, &rp, n);
        gpu_->ops->moe_experts(gpu_, go, gx, gi, gw, ex.gpu.data(), n, k, H, I, 10.f);
        std::vector<int32_t> idx = Get(gpu_, gi, (size_t)n * k);
        std::vector<float> wts = Get(gpu_, gw, (size_t)n * k);
        cpu_->ops->moe_experts(cpu_, want.data(), x.data(), idx.data(), wts.data(), ex.cpu.data(), n, k, H, I, 10.f);
        const double e = RelErr(Get(gpu_, go, want.size()), want);
        for (void *p : {(void *)gl, (void *)gb, (void *)gx, (void *)go, (void *)gi, (void *)gw}) Drop(gpu_, p);
        return e;
    }
};

// The grouped (n > 8) path on bf16/fp16 experts runs on the tensor cores (cuda_moe.cu).
bool MoeOnTensorCores(mt_dtype dt, int n) { return n > 8 && dt != MT_F32; }
// Tolerance of moe_experts on a backend of numerics v.
double MoeTol(mt_dtype dt, int n, mt_numerics v = MT_NUMERICS_EXACT) {
    return !MoeOnTensorCores(dt, n) || v == MT_NUMERICS_FP32 ? 1e-5 : v == MT_NUMERICS_EXACT ? 1e-4 : 1e-2;
}

TEST_F(CudaMoe, ExpertsSmallShapes) {
    Worst worst{"moe_experts"}, worst_tc{"moe tc"}, worst_tc1{"moe tc1"};
    mt_backend *one = BackendWith(WithNumerics(MT_NUMERICS_BF16));
    mt_backend *fp32 = BackendWith(WithNumerics(MT_NUMERICS_FP32));
    ASSERT_TRUE(one && fp32);
    struct S { int E, k, H, I; };
    // H, I multiples of 8 take the 16-byte paths; 36/20 the element-wise ones. 8 experts at 300
    // rows: ~150 pairs an expert, so the batched path's size classes fall on both sides of its
    // second stream's cut (cuda_moe.cu, moe_on_side); the others alternate between the streams.
    for (const S &s : {S{16, 4, 64, 32}, S{16, 4, 36, 20}, S{40, 8, 256, 96}, S{8, 4, 64, 32}}) {
        for (mt_dtype dt : {MT_BF16, MT_F16, MT_F32}) {
            Experts ex = MakeExperts(dt, s.E, s.E, s.H, s.I);
            for (int n : {1, 3, 8, 9, 40, 300}) {
                for (float L : {10.f, 0.5f}) {
                    const double e = Run(ex, RandIdx(n, s.k, s.E), n, s.k, s.H, s.I, L);
                    const std::string where = Shape({{"E", s.E}, {"k", s.k}, {"H", s.H}, {"I", s.I}, {"n", n}}) +
                                              " L=" + std::to_string(L) + " " + DtName(dt);
                    (MoeOnTensorCores(dt, n) ? worst_tc : worst).See(e, where);
                    EXPECT_LE(e, MoeTol(dt, n)) << where;
                    if (n == 40 || n == 300) { // the other numerics
                        for (mt_numerics v : {MT_NUMERICS_BF16, MT_NUMERICS_FP32}) {
                            const bool bf16 = v == MT_NUMERICS_BF16;
                            const double et = Run(ex, RandIdx(n, s.k, s.E), n, s.k, s.H, s.I, L, bf16 ? one : fp32);
                            const std::string wv = where + " numerics=" + mt_numerics_name(v);
                            (bf16 ? worst_tc1 : worst).See(et, wv);
                            EXPECT_LE(et, MoeTol(dt, n, v)) << wv;
                        }
                    }
                }
            }
        }
    }
    mt_backend_free(one);
    mt_backend_free(fp32);
}

// moe_experts_shared: out = shared expert + routed sum. The CUDA backend fuses the shared expert
// into the GEMV kernels for 1..4 rows (it must take those); elsewhere it declines and the caller's
// composition runs. Against the CPU composition (shared expert's matmuls + swiglu, then
// moe_experts accumulating), as glm_mlp.c runs it.
TEST_F(CudaMoe, ExpertsWithSharedMatchCpu) {
    Worst worst{"moe_experts_shared"};
    ASSERT_TRUE(gpu_->ops->moe_experts_shared);
    struct S { int E, k, H, I, distinct; mt_dtype dt; };
    for (const S &s : {S{16, 4, 64, 32, 16, MT_BF16}, S{16, 4, 64, 32, 16, MT_F16}, S{16, 4, 64, 32, 16, MT_F32},
                       S{40, 8, 256, 96, 40, MT_BF16}, S{288, 8, 4096, 2048, 6, MT_BF16}}) {
        Experts ex = MakeExperts(s.dt, s.E, s.distinct, s.H, s.I), sh = MakeExperts(s.dt, 1, 1, s.H, s.I);
        for (int n : {1, 2, 3, 4, 8, 24}) {
            const int k = s.k, H = s.H, I = s.I;
            const float L = 10.f;
            std::vector<int32_t> idx = RandIdx(n, k, s.E);
            std::vector<float> x = Rand((size_t)n * H), wts = Rand((size_t)n * k, 0.05f, 1.f);
            std::vector<float> want((size_t)n * H), g((size_t)n * I), u((size_t)n * I);
            cpu_->ops->matmul(cpu_, g.data(), x.data(), &sh.cpu[0].gate, n);
            cpu_->ops->matmul(cpu_, u.data(), x.data(), &sh.cpu[0].up, n);
            cpu_->ops->swiglu(cpu_, g.data(), g.data(), u.data(), n, I, L);
            cpu_->ops->matmul(cpu_, want.data(), g.data(), &sh.cpu[0].down, n);
            cpu_->ops->moe_experts(cpu_, want.data(), x.data(), idx.data(), wts.data(), ex.cpu.data(), n, k, H, I, L);
            float *gx = Put(gpu_, x), *gw = Put(gpu_, wts), *go = Put(gpu_, Rand((size_t)n * H));
            int32_t *gi = Put(gpu_, idx);
            const bool fused = gpu_->ops->moe_experts_shared(gpu_, go, gx, gi, gw, ex.gpu.data(), &sh.gpu[0], n, k, H, I, L);
            if (n <= 4) {
                EXPECT_TRUE(fused) << "n=" << n << ": the GEMV path must take the shared expert";
            }
            if (!fused) {
                float *gg = (float *)gpu_->ops->alloc(gpu_, sizeof(float) * (size_t)n * I);
                float *gu = (float *)gpu_->ops->alloc(gpu_, sizeof(float) * (size_t)n * I);
                gpu_->ops->matmul(gpu_, gg, gx, &sh.gpu[0].gate, n);
                gpu_->ops->matmul(gpu_, gu, gx, &sh.gpu[0].up, n);
                gpu_->ops->swiglu(gpu_, gg, gg, gu, n, I, L);
                gpu_->ops->matmul(gpu_, go, gg, &sh.gpu[0].down, n);
                gpu_->ops->moe_experts(gpu_, go, gx, gi, gw, ex.gpu.data(), n, k, H, I, L);
                Drop(gpu_, gg);
                Drop(gpu_, gu);
            }
            const double e = RelErr(Get(gpu_, go, want.size()), want);
            const std::string where = Shape({{"E", s.E}, {"k", k}, {"H", H}, {"I", I}, {"n", n}}) + " " + DtName(s.dt) +
                                      (fused ? " fused" : " composed");
            worst.See(e, where);
            EXPECT_LE(e, MoeTol(s.dt, n)) << where;
            for (void *p : {(void *)gx, (void *)gw, (void *)go, (void *)gi}) Drop(gpu_, p);
        }
        // A shared expert of another width is declined, nothing written.
        if (s.E == 16 && s.dt == MT_BF16) {
            Experts wide = MakeExperts(s.dt, 1, 1, s.H, 2 * s.I);
            std::vector<float> before = Rand(s.H);
            float *gx = Put(gpu_, Rand(s.H)), *go = Put(gpu_, before), *gw = Put(gpu_, Rand(s.k, 0.1f, 1.f));
            int32_t *gi = Put(gpu_, RandIdx(1, s.k, s.E));
            EXPECT_FALSE(gpu_->ops->moe_experts_shared(gpu_, go, gx, gi, gw, ex.gpu.data(), &wide.gpu[0], 1, s.k, s.H,
                                                       s.I, 10.f));
            EXPECT_EQ(Get(gpu_, go, before.size()), before);
            for (void *p : {(void *)gx, (void *)gw, (void *)go, (void *)gi}) Drop(gpu_, p);
        }
    }
}

// The wgmma form of a prefill's experts (cuda_moe_wg.cu: sm_90, bf16, more than 64 rows,
// H % 128 == 0, I % 64 == 0) beside the batched cuBLAS form it replaced (params.moe_wg false), both
// against the CPU, with x in two parts (the default) and rounded once (MT_NUMERICS_BF16: against
// the CPU at that rounding's tolerance, and against the batched form rounding at the same points
// to 1e-4, which no misplaced row or column passes). Row tiles of every kind: experts with no
// pairs and with one (256 experts, 200 pairs), 8 experts all taken by each row (2n rows an expert: down tiles of 208 .. 256 rows,
// gate/up ones of two halves), an expert of 600 rows cut in three (down) or five (gate/up), I = 64
// and 192 (a last gate/up tile of 64 columns), the real widths with 64 k-stages (the ring wraps 16
// times), both swiglu clamps; the wide down tiles (mt_cuda_params.moe_wg_wide_down: 256 weight
// rows against at most 128 token rows, so H = 128 and 384 end in half a tile) against the default ones
// in both numerics, where only the tiling differs: each sum runs the same k-steps, so the outputs
// agree to 1e-6; then one set with each expert's gate and up exchanged (up below gate
// in memory), and indices straight from the GPU router (sorted on the device, never read back).
TEST_F(CudaMoe, ExpertsWgmmaMatchCpu) {
    int major = 0;
    ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
    if (major != 9) GTEST_SKIP() << "the wgmma path is for sm_90 (this device: sm_" << major << "x)";
    Worst worst{"moe_experts wgmma"}, worst_old{"moe_experts batched"}, worst1{"moe_experts wgmma, 1 term"},
        worst1_old{"moe_experts wgmma, 1 term, against batched"}, worst_wide{"moe_experts wide down, against default"};
    mt_cuda_params old_p = ExactParams(), old1_p = WithNumerics(MT_NUMERICS_BF16);
    old_p.moe_wg = old1_p.moe_wg = false;
    mt_backend *old = BackendWith(old_p), *old1 = BackendWith(old1_p);
    mt_backend *one = BackendWith(WithNumerics(MT_NUMERICS_BF16));
    mt_cuda_params wide_p = ExactParams(), wide1_p = WithNumerics(MT_NUMERICS_BF16);
    wide_p.moe_wg_wide_down = wide1_p.moe_wg_wide_down = true;
    mt_backend *wide = BackendWith(wide_p), *wide1 = BackendWith(wide1_p);
    ASSERT_TRUE(old && old1 && one && wide && wide1);
    struct S { int E, k, H, I, n; };
    for (const S &s : {S{256, 2, 256, 128, 100}, S{64, 4, 256, 128, 100}, S{16, 4, 256, 128, 100},
                       S{16, 4, 128, 64, 300}, S{8, 8, 128, 192, 104}, S{8, 8, 128, 64, 112}, S{8, 8, 256, 128, 120},
                       S{8, 8, 256, 128, 128}, S{8, 8, 128, 64, 300}, S{8, 8, 384, 128, 120},
                       S{8, 8, 4096, 2048, 140}}) {
        Experts ex = MakeExperts(MT_BF16, s.E, s.E, s.H, s.I);
        for (float L : {10.f, 0.5f}) {
            if (s.H == 4096 && L != 10.f) continue;
            const std::vector<int32_t> idx = RandIdx(s.n, s.k, s.E);
            const std::string where = Shape({{"E", s.E}, {"k", s.k}, {"H", s.H}, {"I", s.I}, {"n", s.n}}) +
                                      " L=" + std::to_string(L);
            const double e = Run(ex, idx, s.n, s.k, s.H, s.I, L), eo = Run(ex, idx, s.n, s.k, s.H, s.I, L, old);
            worst.See(e, where);
            worst_old.See(eo, where);
            EXPECT_LE(e, MoeTol(MT_BF16, s.n)) << where;
            EXPECT_LE(eo, MoeTol(MT_BF16, s.n)) << where << " batched";
            const double e1 = Run(ex, idx, s.n, s.k, s.H, s.I, L, one);
            const double d1 = Between(ex, idx, s.n, s.k, s.H, s.I, L, one, old1);
            worst1.See(e1, where);
            worst1_old.See(d1, where);
            EXPECT_LE(e1, MoeTol(MT_BF16, s.n, MT_NUMERICS_BF16)) << where << " 1 term";
            EXPECT_LE(d1, 1e-4) << where << " 1 term, against the batched form";
            const double dw = Between(ex, idx, s.n, s.k, s.H, s.I, L, wide, gpu_);
            const double dw1 = Between(ex, idx, s.n, s.k, s.H, s.I, L, wide1, one);
            worst_wide.See(std::max(dw, dw1), where);
            EXPECT_LE(dw, 1e-6) << where << " wide down tiles, 2 terms";
            EXPECT_LE(dw1, 1e-6) << where << " wide down tiles, 1 term";
        }
    }
    {
        const int E = 16, k = 4, H = 128, I = 64, n = 300;
        Experts ex = MakeExperts(MT_BF16, E, E, H, I);
        for (int e = 0; e < E; e++) {
            std::swap(ex.cpu[e].gate, ex.cpu[e].up);
            std::swap(ex.gpu[e].gate, ex.gpu[e].up);
        }
        const std::vector<int32_t> idx = RandIdx(n, k, E);
        const double e = Run(ex, idx, n, k, H, I, 0.5f), d1 = Between(ex, idx, n, k, H, I, 0.5f, one, old1);
        worst.See(e, "gate/up exchanged");
        worst1_old.See(d1, "gate/up exchanged");
        EXPECT_LE(e, MoeTol(MT_BF16, n)) << "gate/up exchanged";
        EXPECT_LE(d1, 1e-4) << "gate/up exchanged, 1 term, against the batched form";
    }
    // Indices straight from the GPU router: the wgmma path then sorts them on the device without
    // reading them back.
    {
        const int E = 64, k = 8, H = 256, I = 128, n = 300;
        Experts ex = MakeExperts(MT_BF16, E, E, H, I);
        const double e = RunRouted(ex, Rand((size_t)n * E, -4.f, 4.f), n, k, E, H, I);
        worst.See(e, "routed n=300");
        EXPECT_LE(e, MoeTol(MT_BF16, n)) << "routed n=300";
    }
    mt_backend_free(old);
    mt_backend_free(old1);
    mt_backend_free(one);
    mt_backend_free(wide);
    mt_backend_free(wide1);
}

TEST_F(CudaMoe, ExpertsRealShapes) {
    Worst worst{"moe_experts"};
    const int E = 288, k = 8, H = 4096, I = 2048;
    Experts ex = MakeExperts(MT_BF16, E, 10, H, I);
    for (int n : {1, 4, 8, 24}) { // 1, 4: per-pair GEMV kernels; 8, 24: grouped device kernels
        const double e = Run(ex, RandIdx(n, k, E), n, k, H, I, 10.f);
        const std::string where = Shape({{"E", E}, {"k", k}, {"H", H}, {"I", I}, {"n", n}});
        worst.See(e, where);
        EXPECT_LE(e, MoeTol(MT_BF16, n)) << where;
    }
    // Indices straight from the GPU router (moe_experts then skips reading them back), then the
    // same experts table with two entries swapped: the cached device copy must follow.
    for (int n : {1, 3, 12}) {
        for (int swap = 0; swap < 2; swap++) {
            if (swap) std::swap(ex.gpu[0], ex.gpu[287]), std::swap(ex.cpu[0], ex.cpu[287]);
            std::vector<float> logits = Rand((size_t)n * E, -4.f, 4.f);
            // Make expert 0 and 287 likely picks.
            for (int i = 0; i < n; i++) logits[(size_t)i * E] = logits[(size_t)i * E + 287] = 8.f;
            const double e = RunRouted(ex, logits, n, k, E, H, I);
            const std::string where = "routed " + Shape({{"n", n}, {"swap", swap}});
            worst.See(e, where);
            EXPECT_LE(e, MoeTol(MT_BF16, n)) << where;
        }
    }
    // Decode timing: one row, 8 experts of 3 x 4096 x 2048 bf16.
    {
        std::vector<int32_t> idx = RandIdx(1, k, E);
        float *gx = Put(gpu_, Rand(H)), *gw = Put(gpu_, Rand(k, 0.1f, 1.f)), *go = Put(gpu_, Rand(H));
        int32_t *gi = Put(gpu_, idx);
        const double t = TimeGpu([&] { gpu_->ops->moe_experts(gpu_, go, gx, gi, gw, ex.gpu.data(), 1, k, H, I, 10.f); }, 20);
        std::printf("[ timing   ] moe_experts n=1 top-8 4096x2048 bf16 (idx read back): %.1f us, %.0f GB/s\n",
                    t * 1e6, 8.0 * 3 * H * I * 2 / t / 1e9);
        for (void *p : {(void *)gx, (void *)gw, (void *)go, (void *)gi}) Drop(gpu_, p);
    }
    // Prefill timing: 512 rows over all 288 experts (10 distinct weight sets, each expert's
    // still read from memory: 3 x 16.8 MB per expert does not stay in L2), on the default path
    // (tensor cores, x in 2 parts, batched GEMMs), MT_NUMERICS_BF16 and the fp32 grouped kernel;
    // then the default path against one GEMM per expert (params.moe_batched false, checked at 24
    // rows) at 512 and 4096 rows.
    mt_cuda_params loop_p = ExactParams();
    loop_p.moe_batched = false;
    mt_backend *loop = BackendWith(loop_p);
    ASSERT_TRUE(loop);
    {
        const double el = Run(ex, RandIdx(24, k, E), 24, k, H, I, 10.f, loop);
        worst.See(el, "one GEMM per expert n=24");
        EXPECT_LE(el, MoeTol(MT_BF16, 24)) << "one GEMM per expert n=24";
    }
    mt_cuda_params batched_p = ExactParams();
    batched_p.moe_wg = false;
    mt_backend *batched = BackendWith(batched_p);
    ASSERT_TRUE(batched);
    // Seconds per moe_experts call of n fresh rows on each of bes (reps[b] timed calls each).
    auto time3 = [&](int n, mt_backend *const (&bes)[3], const int (&reps)[3], double (&t)[3]) {
        std::vector<int32_t> idx = RandIdx(n, k, E);
        float *gx = Put(gpu_, Rand((size_t)n * H)), *gw = Put(gpu_, Rand((size_t)n * k, 0.1f, 1.f));
        float *go = Put(gpu_, Rand((size_t)n * H));
        int32_t *gi = Put(gpu_, idx);
        for (int b = 0; b < 3; b++)
            t[b] = TimeGpu([&] { bes[b]->ops->moe_experts(bes[b], go, gx, gi, gw, ex.gpu.data(), n, k, H, I, 10.f); },
                           reps[b], bes[b]);
        for (void *p : {(void *)gx, (void *)gw, (void *)go, (void *)gi}) Drop(gpu_, p);
    };
    for (int n : {512, 4096}) {
        const double flops = 2.0 * n * k * 3 * H * I;
        double t[3];
        time3(n, {gpu_, batched, loop}, {3, 3, 3}, t);
        std::printf("[ timing   ] moe_experts n=%d top-8 of 288, 4096x2048 bf16, 2 parts: wgmma %.2f ms (%.1f TFLOP/s), "
                    "batched GEMMs %.2f ms (%.1f TFLOP/s), one GEMM per expert %.2f ms (%.1f TFLOP/s)\n",
                    n, t[0] * 1e3, flops / t[0] / 1e12, t[1] * 1e3, flops / t[1] / 1e12, t[2] * 1e3, flops / t[2] / 1e12);
    }
    mt_backend_free(batched);
    mt_backend_free(loop);
    {
        const int n = 512;
        mt_backend *one = BackendWith(WithNumerics(MT_NUMERICS_BF16));
        mt_backend *fp32 = BackendWith(WithNumerics(MT_NUMERICS_FP32));
        ASSERT_TRUE(one && fp32);
        const double flops = 2.0 * n * k * 3 * H * I;
        double t[3];
        time3(n, {gpu_, one, fp32}, {5, 5, 2}, t);
        std::printf("[ timing   ] moe_experts n=%d top-8 of 288, 4096x2048 bf16: tensor cores 2 parts %.2f ms "
                    "(%.1f TFLOP/s), 1 part %.2f ms (%.1f TFLOP/s), fp32 kernel %.2f ms (%.1f TFLOP/s)\n",
                    n, t[0] * 1e3, flops / t[0] / 1e12, t[1] * 1e3, flops / t[1] / 1e12, t[2] * 1e3,
                    flops / t[2] / 1e12);
        mt_backend_free(one);
        mt_backend_free(fp32);
    }
}

TEST_F(CudaOps, HyperConnections) {
    Worst worst{"hc"};
    struct S { int S_, H; };
    // hc_pre: n <= 4 with S <= 4 and S*H a multiple of 8 load vectors takes the one-cluster
    // kernel (4 x 4096, 2 x 64, 3 x 256, 1 x 512); S*H = 400, n > 4 and S = 6 the GEMV + one-block
    // form: the row in registers for S <= 4 (hc_pre_rows_kernel; n = 20, 29: the mix's second
    // 16-row tile of a warp partly filled; n = 300: many blocks; n = 2150: the mix's k-slices do
    // not divide S*H evenly on 132 multiprocessors), S = 6 the
    // older kernel with its block-wide Sinkhorn (S*S > 32). hc_post: float4 accesses for S <= 4 (every
    // shape here but S = 6, which takes the scalar kernel).
    for (const S &s : {S{4, 4096}, S{2, 64}, S{4, 100}, S{3, 256}, S{1, 512}, S{6, 20}}) {
        const int Sn = s.S_, H = s.H, mix = (2 + Sn) * Sn, SH = Sn * H;
        const mt_hc_params p = {Sn, H, 1e-6f, 1e-6f, 20};
        for (mt_dtype dt : {MT_BF16, MT_F32}) {
            auto fn = MakeWeight(dt, mix, SH, 2.f / std::sqrt((float)SH));
            for (int n : {1, 2, 3, 4, 5, 9, 20, 29, 40, 300, 2150}) {
                std::vector<float> X = Rand((size_t)n * SH, -2.f, 2.f), base = Rand(mix), scale = Rand(3, 0.5f, 1.5f);
                std::vector<float> y((size_t)n * H), post((size_t)n * Sn), comb((size_t)n * Sn * Sn);
                cpu_->ops->hc_pre(cpu_, y.data(), post.data(), comb.data(), X.data(), &fn->cpu, base.data(),
                                  scale.data(), &p, n);
                float *gX = Put(gpu_, X), *gb = Put(gpu_, base), *gs = Put(gpu_, scale);
                float *gy = (float *)gpu_->ops->alloc(gpu_, y.size() * 4);
                float *gp = (float *)gpu_->ops->alloc(gpu_, post.size() * 4);
                float *gc = (float *)gpu_->ops->alloc(gpu_, comb.size() * 4);
                gpu_->ops->hc_pre(gpu_, gy, gp, gc, gX, &fn->gpu, gb, gs, &p, n);
                const std::string where = Shape({{"S", Sn}, {"H", H}, {"n", n}}) + " " + DtName(dt);
                const double ey = RelErr(Get(gpu_, gy, y.size()), y);
                const double ep = RelErr(Get(gpu_, gp, post.size()), post);
                const double ec = RelErr(Get(gpu_, gc, comb.size()), comb);
                worst.See(std::max({ey, ep, ec}), "hc_pre " + where);
                EXPECT_LE(ey, 1e-5) << "hc_pre y " << where;
                EXPECT_LE(ep, 1e-5) << "hc_pre post " << where;
                EXPECT_LE(ec, 1e-5) << "hc_pre comb " << where;

                // hc_pre_norm (the input norm fused: one cluster kernel for the decode shapes)
                // against the CPU's hc_pre + rmsnorm.
                {
                    std::vector<float> nw = Rand(H, 0.5f, 1.5f), h((size_t)n * H);
                    cpu_->ops->rmsnorm(cpu_, h.data(), y.data(), nw.data(), n, H, p.rms_eps);
                    float *gnw = Put(gpu_, nw), *gh = (float *)gpu_->ops->alloc(gpu_, h.size() * 4);
                    ASSERT_TRUE(gpu_->ops->hc_pre_norm);
                    gpu_->ops->hc_pre_norm(gpu_, gh, gy, gp, gc, gX, &fn->gpu, gb, gs, gnw, &p, n);
                    const double eh = RelErr(Get(gpu_, gh, h.size()), h);
                    const double ep2 = RelErr(Get(gpu_, gp, post.size()), post);
                    const double ec2 = RelErr(Get(gpu_, gc, comb.size()), comb);
                    worst.See(std::max({eh, ep2, ec2}), "hc_pre_norm " + where);
                    EXPECT_LE(eh, 1e-5) << "hc_pre_norm h " << where;
                    EXPECT_LE(ep2, 1e-5) << "hc_pre_norm post " << where;
                    EXPECT_LE(ec2, 1e-5) << "hc_pre_norm comb " << where;
                    Drop(gpu_, gnw);
                    Drop(gpu_, gh);
                }

                // hc_post_pre_norm (the split kernel's POST form for the decode shapes) against the
                // CPU's hc_post, hc_pre and rmsnorm: X', h, post and comb.
                {
                    std::vector<float> a = Rand((size_t)n * H), po = Rand((size_t)n * Sn, 0.f, 2.f);
                    std::vector<float> cm = Rand((size_t)n * Sn * Sn, 0.f, 1.f), Xc = X, nw = Rand(H, 0.5f, 1.5f);
                    std::vector<float> yc((size_t)n * H), hc((size_t)n * H), pc = po, cc = cm;
                    cpu_->ops->hc_post(cpu_, Xc.data(), a.data(), po.data(), cm.data(), &p, n);
                    cpu_->ops->hc_pre(cpu_, yc.data(), pc.data(), cc.data(), Xc.data(), &fn->cpu, base.data(),
                                      scale.data(), &p, n);
                    cpu_->ops->rmsnorm(cpu_, hc.data(), yc.data(), nw.data(), n, H, p.rms_eps);
                    float *gX2 = Put(gpu_, X), *ga = Put(gpu_, a), *gpo = Put(gpu_, po), *gcm = Put(gpu_, cm);
                    float *gnw = Put(gpu_, nw), *gh = (float *)gpu_->ops->alloc(gpu_, hc.size() * 4);
                    ASSERT_TRUE(gpu_->ops->hc_post_pre_norm);
                    gpu_->ops->hc_post_pre_norm(gpu_, gX2, ga, gh, gy, gpo, gcm, &fn->gpu, gb, gs, gnw, &p, n);
                    const double eX = RelErr(Get(gpu_, gX2, Xc.size()), Xc);
                    const double eh = RelErr(Get(gpu_, gh, hc.size()), hc);
                    const double ep3 = RelErr(Get(gpu_, gpo, pc.size()), pc);
                    const double ec3 = RelErr(Get(gpu_, gcm, cc.size()), cc);
                    worst.See(std::max({eX, eh, ep3, ec3}), "hc_post_pre_norm " + where);
                    EXPECT_LE(eX, 1e-6) << "hc_post_pre_norm X " << where;
                    EXPECT_LE(eh, 1e-5) << "hc_post_pre_norm h " << where;
                    EXPECT_LE(ep3, 1e-5) << "hc_post_pre_norm post " << where;
                    EXPECT_LE(ec3, 1e-5) << "hc_post_pre_norm comb " << where;
                    for (void *q : {(void *)gX2, (void *)ga, (void *)gpo, (void *)gcm, (void *)gnw, (void *)gh})
                        Drop(gpu_, q);
                }

                // hc_post in place from fresh a/post/comb, then hc_head.
                std::vector<float> a = Rand((size_t)n * H), po = Rand((size_t)n * Sn, 0.f, 2.f);
                std::vector<float> cm = Rand((size_t)n * Sn * Sn, 0.f, 1.f), Xw = X;
                cpu_->ops->hc_post(cpu_, Xw.data(), a.data(), po.data(), cm.data(), &p, n);
                float *ga = Put(gpu_, a), *gpo = Put(gpu_, po), *gcm = Put(gpu_, cm);
                gpu_->ops->hc_post(gpu_, gX, ga, gpo, gcm, &p, n);
                const double eh = RelErr(Get(gpu_, gX, Xw.size()), Xw);
                worst.See(eh, "hc_post " + where);
                EXPECT_LE(eh, 1e-6) << "hc_post " << where;
                std::vector<float> z((size_t)n * H);
                cpu_->ops->hc_head(cpu_, z.data(), Xw.data(), n, Sn, H);
                gpu_->ops->hc_head(gpu_, gy, gX, n, Sn, H);
                const double ez = RelErr(Get(gpu_, gy, z.size()), z);
                worst.See(ez, "hc_head " + where);
                EXPECT_LE(ez, 1e-6) << "hc_head " << where;
                {   // hc_head_norm against the CPU's hc_head + rmsnorm
                    std::vector<float> nw = Rand(H, 0.5f, 1.5f), zn((size_t)n * H);
                    cpu_->ops->rmsnorm(cpu_, zn.data(), z.data(), nw.data(), n, H, p.rms_eps);
                    float *gnw = Put(gpu_, nw);
                    ASSERT_TRUE(gpu_->ops->hc_head_norm);
                    gpu_->ops->hc_head_norm(gpu_, gy, gX, gnw, n, Sn, H, p.rms_eps);
                    const double en = RelErr(Get(gpu_, gy, zn.size()), zn);
                    worst.See(en, "hc_head_norm " + where);
                    EXPECT_LE(en, 1e-6) << "hc_head_norm " << where;
                    Drop(gpu_, gnw);
                }
                for (void *q : {(void *)gX, (void *)gb, (void *)gs, (void *)gy, (void *)gp, (void *)gc, (void *)ga,
                                (void *)gpo, (void *)gcm})
                    Drop(gpu_, q);
            }
        }
    }
}

// Decode-shaped ops, the bench-4L shapes (bench/decode_bench: hidden 4096, KDA 64 x 128, DSA,
// hc_mult 4, vocab 154880): the matmuls at 1, 2, 4 and 8 rows (batched decode), norms and mHC
// at one row (the experts: CudaMoe.DecodeTimings). Each op runs `reps` times inside one CUDA
// graph made through the backend's graph slots, so the gaps between kernels are those of a
// decode graph (and consecutive kernels overlap as they would there); weights cycle over copies
// of at least 256 MB in all, beyond the 60 MB L2, so they come from memory as in a real step.
// Prints microseconds per call and weight bytes per second against the device copy bandwidth
// (read + write, as decode_bench measures it). Checks only that every graph was made and ran.
TEST_F(CudaOps, DecodeTimings) {
    mt_backend *be = gpu_;
    ASSERT_NE(be->ops->graph_begin, nullptr);
    const double copy_gbs = CopyGbs();
    auto graph_time = [&](int reps, auto f) -> double { return GraphTime(be, reps, f); };
    // Copies of a bf16 [rows, cols] weight: at least 256 MB in all (at most 256 copies).
    auto copies_of = [&](int64_t rows, int64_t cols, std::vector<mt_weight> &ws) {
        const double bytes = 2.0 * rows * cols;
        ws.resize((size_t)std::min(256, std::max(1, (int)std::ceil(256e6 / bytes))));
        for (size_t c = 0; c < ws.size(); c++)
            ASSERT_EQ(be->ops->weight_random(be, MT_BF16, rows, cols, 7000 + c, 0.f, 0.02f, &ws[c]), MT_OK);
    };
    auto report = [&](const std::string &what, double t, double bytes) { ReportTiming(what, t, bytes); };

    struct M { const char *what; int rows, cols; };
    const M mats[] = {{"lm_head", 154880, 4096},     {"dense gate/up", 12288, 4096}, {"dense down", 4096, 12288},
                      {"kda q/k/v", 8192, 4096},     {"kda o", 4096, 8192},          {"dsa o", 4096, 16384},
                      {"dsa q_b", 16384, 1536},      {"shared gate/up", 2048, 4096}, {"shared down", 4096, 2048},
                      {"dsa q_a", 1536, 4096},       {"dsa kv_a", 512, 4096},        {"router", 288, 4096},
                      {"kda f_a/g_a", 128, 4096},    {"kda f_b/g_b", 8192, 128},     {"kda b", 64, 4096}};
    const int ns[] = {1, 2, 4, 8};
    double sum_t[4] = {0, 0, 0, 0}, sum_bytes = 0;
    for (const M &m : mats) {
        std::vector<mt_weight> ws;
        copies_of(m.rows, m.cols, ws);
        const int nc = (int)ws.size(), reps = nc * std::max(1, (8 + nc - 1) / nc);
        const double bytes = 2.0 * m.rows * m.cols;
        char line[256];
        int at = std::snprintf(line, sizeof line, "decode matmul %-14s %6dx%-5d", m.what, m.rows, m.cols);
        for (int q = 0; q < 4; q++) {
            const int n = ns[q];
            float *x = Put(be, Rand((size_t)n * m.cols));
            float *y = (float *)be->ops->alloc(be, sizeof(float) * (size_t)n * m.rows);
            const double t = graph_time(reps, [&](int k) { be->ops->matmul(be, y, x, &ws[k % nc], n); });
            sum_t[q] += t;
            at += std::snprintf(line + at, sizeof line - at, " | n=%d %7.1f us %5.1f%%", n, t * 1e6,
                                100.0 * bytes / t / 1e9 / copy_gbs);
            Drop(be, x);
            Drop(be, y);
        }
        sum_bytes += bytes;
        std::printf("[ timing   ] %s\n", line);
        for (mt_weight &w : ws) be->ops->weight_free(be, &w);
    }
    std::printf("[ timing   ] decode matmul sum of one call of each shape (%.0f MB):", sum_bytes / 1e6);
    for (int q = 0; q < 4; q++)
        std::printf(" n=%d %.1f us (%.1f%%)", ns[q], sum_t[q] * 1e6, 100.0 * sum_bytes / sum_t[q] / 1e9 / copy_gbs);
    std::printf("\n");

    for (int d : {4096, 1536, 512}) {
        float *x = Put(be, Rand(d)), *w = Put(be, Rand(d, 0.5f, 1.5f));
        float *o = (float *)be->ops->alloc(be, sizeof(float) * d);
        const double t = graph_time(64, [&](int) { be->ops->rmsnorm(be, o, x, w, 1, d, 1e-5f); });
        report("rmsnorm 1 x " + std::to_string(d), t, 8.0 * d);
        for (void *q : {(void *)x, (void *)w, (void *)o}) Drop(be, q);
    }
    {
        float *x = Put(be, Rand(64 * 128));
        const double t = graph_time(64, [&](int) { be->ops->l2norm(be, x, 64, 128, 1e-6f, 1.f); });
        report("l2norm 64 x 128", t, 8.0 * 64 * 128);
        Drop(be, x);
    }

    {
        const int S = 4, H = 4096, mix = (2 + S) * S;
        const mt_hc_params hp = {S, H, 1e-5f, 1e-6f, 20};
        std::vector<mt_weight> fns;
        copies_of(mix, S * H, fns);
        const int nc = (int)fns.size();
        float *X = Put(be, Rand((size_t)S * H, -2.f, 2.f)), *base = Put(be, Rand(mix)), *scale = Put(be, Rand(3, 0.5f, 1.5f));
        float *y = (float *)be->ops->alloc(be, sizeof(float) * H), *post = (float *)be->ops->alloc(be, sizeof(float) * S);
        float *comb = (float *)be->ops->alloc(be, sizeof(float) * S * S);
        const double t = graph_time(nc, [&](int k) { be->ops->hc_pre(be, y, post, comb, X, &fns[k], base, scale, &hp, 1); });
        report("hc_pre S=4 H=4096 (fn 24x16384)", t, 2.0 * mix * S * H + 4.0 * S * H);
        float *a = Put(be, Rand(H));
        const double tp = graph_time(64, [&](int) { be->ops->hc_post(be, X, a, post, comb, &hp, 1); });
        report("hc_post S=4 H=4096", tp, 4.0 * (2 * S * H + H));
        for (mt_weight &w : fns) be->ops->weight_free(be, &w);
        for (void *q : {(void *)X, (void *)base, (void *)scale, (void *)y, (void *)post, (void *)comb, (void *)a})
            Drop(be, q);
    }
}

// The routed experts at 1, 2, 4 and 8 rows (batched decode, top-8 of 288, 4096 x 2048 bf16), as
// graphs (see CudaOps.DecodeTimings): the backend's path (per (row, slot) GEMV kernels below
// params.moe_grouped_min_rows rows) and the grouped kernels (cu_moe_experts_grouped) on the same
// routing; bytes are those of the distinct experts the rows chose (the floor). Also the router.
TEST_F(CudaMoe, DecodeTimings) {
    mt_backend *be = gpu_;
    ASSERT_NE(be->ops->graph_begin, nullptr);
    // The copy bandwidth first: measuring it allocates, and an allocation makes the backend forget
    // the router's last output, after which moe_experts reads idx back, which no capture allows
    // (run alone, this test failed so at its first report).
    (void)CopyGbs();
    auto graph_time = [&](int reps, auto f) -> double { return GraphTime(be, reps, f); };
    auto report = [&](const std::string &what, double t, double bytes) { ReportTiming(what, t, bytes); };
    {
        // Every expert its own weights (14.5 GB), as in the model: rows that choose different
        // experts never share bytes through L2.
        const int E = 288, k = 8, H = 4096, I = 2048;
        const mt_router_params rp = {E, 1, 1, k, true, 2.5f};
        std::vector<mt_weight> w(3 * E);
        for (int e = 0; e < E; e++)
            for (int j = 0; j < 3; j++)
                ASSERT_EQ(be->ops->weight_random(be, MT_BF16, j < 2 ? I : H, j < 2 ? H : I, 9000 + 3 * e + j, 0.f, 0.02f,
                                                 &w[3 * e + j]),
                          MT_OK);
        std::vector<mt_expert> ex(E);
        for (int e = 0; e < E; e++) ex[e] = {w[3 * e], w[3 * e + 1], w[3 * e + 2]};
        for (int n : {1, 2, 4, 8}) {
            float *logits = Put(be, Rand((size_t)n * E, -4.f, 4.f)), *bias = Put(be, Rand(E, -0.1f, 0.1f));
            float *x = Put(be, Rand((size_t)n * H)), *out = Put(be, Rand((size_t)n * H));
            int32_t *idx = (int32_t *)be->ops->alloc(be, sizeof(int32_t) * n * k);
            float *wts = (float *)be->ops->alloc(be, sizeof(float) * n * k);
            const double tr = graph_time(64, [&](int) { be->ops->moe_route(be, idx, wts, logits, bias, &rp, n); });
            if (n == 1) report("moe_route 288 experts top-8", tr, 8.0 * E);
            std::vector<int32_t> hi = Get(be, idx, (size_t)n * k);
            std::sort(hi.begin(), hi.end());
            const int distinct = (int)(std::unique(hi.begin(), hi.end()) - hi.begin());
            const double bytes = 2.0 * distinct * 3 * H * I;
            // The last route stands; both paths then know idx's bound without reading it back.
            const double te = graph_time(8, [&](int) { be->ops->moe_experts(be, out, x, idx, wts, ex.data(), n, k, H, I, 10.f); });
            report("moe_experts n=" + std::to_string(n) + " (" + std::to_string(distinct) + " experts), backend path", te,
                   bytes);
            const double tg = graph_time(8, [&](int) { cu_moe_experts_grouped(be, out, x, idx, wts, ex.data(), n, k, H, I, 10.f); });
            report("moe_experts n=" + std::to_string(n) + " (" + std::to_string(distinct) + " experts), grouped", tg, bytes);
            for (void *q : {(void *)logits, (void *)bias, (void *)x, (void *)out, (void *)idx, (void *)wts}) Drop(be, q);
        }
        for (mt_weight &q : w) be->ops->weight_free(be, &q);
    }
}

}  // namespace
