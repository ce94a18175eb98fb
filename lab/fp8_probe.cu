/* lab/fp8_probe.cu: can the low part of a two-part prefill GEMM run in fp8 on this GPU, and
 * what does it cost and give? For x fp32 [M, K] and a bf16 weight W [N, K] (prefill shapes of
 * bench-4L), in one run:
 *   - reference: y = x . W^T by cuBLAS SGEMM in fp32 (W widened exactly), the pedantic math mode;
 *   - bf16 x1: x rounded to bf16 once (MT_CUDA_TC_TERMS=1);
 *   - bf16 x2: x = hi + lo, both bf16, two GEMMs (the backend's default);
 *   - bf16 + e4m3: hi in bf16, lo = x - hi in e4m3 with a scale per row of x, against an e4m3 copy
 *     of W with a scale per row of W (cuBLASLt, CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F), added
 *     into the hi product (beta = 1).
 * Prints, per shape and form, the median ms of 20 runs, TFLOP/s of one M x N x K product, and the
 * worst |y - ref| / (|x_row| |W_row|) (the error relative to the product's scale).
 *   fp8_probe [--m 4096] */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "lab/probe_check.h"

#define CB(x)                                                                                      \
    do {                                                                                           \
        cublasStatus_t s_ = (x);                                                                   \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                         \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cublasGetStatusString(s_)); \
            return false;                                                                          \
        }                                                                                          \
    } while (0)

static __global__ void fill_kernel(float *x, size_t n, unsigned seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
        const float u = (h & 0xffffff) / 16777216.f - 0.5f;
        x[i] = scale * u * (1.f + 3.f * ((h >> 24) == 7)); /* some larger entries */
    }
}

static __global__ void to_bf16_kernel(__nv_bfloat16 *o, const float *x, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        o[i] = __float2bfloat16_rn(x[i]);
}

static __global__ void bf16_to_f32_kernel(float *o, const __nv_bfloat16 *x, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        o[i] = __bfloat162float(x[i]);
}

/* The block's max |.| (mx) and sum of squares (ss) of a row over its threads' parts: s[r] = the
 * e4m3 scale max / 448 (1 for a zero row), rowmag[r] = the row's norm; returns s[r]. */
static __device__ float row_scale(float mx, float ss, int r, float *s, float *rowmag) {
    __shared__ float red[2][32];
    for (int o = 16; o; o >>= 1) {
        mx = fmaxf(mx, __shfl_xor_sync(~0u, mx, o));
        ss += __shfl_xor_sync(~0u, ss, o);
    }
    if ((threadIdx.x & 31) == 0) { red[0][threadIdx.x >> 5] = mx; red[1][threadIdx.x >> 5] = ss; }
    __syncthreads();
    mx = 0.f; ss = 0.f;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) { mx = fmaxf(mx, red[0][w]); ss += red[1][w]; }
    const float sc = mx > 0.f ? mx / 448.f : 1.f;
    if (threadIdx.x == 0) { s[r] = sc; rowmag[r] = sqrtf(ss); }
    return sc;
}

/* One block a row: hi = bf16(x); lo = x - hi, as bf16 (lo16) and as e4m3 of lo / s (lo8) with s =
 * max|lo| / 448 (s[r], 1 when the row's lo is 0); rowmag[r] = |x_row|. */
static __global__ void split_kernel(__nv_bfloat16 *hi, __nv_bfloat16 *lo16, __nv_fp8_e4m3 *lo8, float *s,
                                    float *rowmag, const float *x, int K) {
    const int r = blockIdx.x;
    const float *xr = x + (size_t)r * K;
    float mx = 0.f, ss = 0.f;
    for (int j = threadIdx.x; j < K; j += blockDim.x) {
        const float v = xr[j];
        const __nv_bfloat16 h = __float2bfloat16_rn(v);
        const float l = v - __bfloat162float(h);
        hi[(size_t)r * K + j] = h;
        lo16[(size_t)r * K + j] = __float2bfloat16_rn(l);
        mx = fmaxf(mx, fabsf(l));
        ss += v * v;
    }
    const float sc = row_scale(mx, ss, r, s, rowmag);
    for (int j = threadIdx.x; j < K; j += blockDim.x) {
        const float l = xr[j] - __bfloat162float(hi[(size_t)r * K + j]);
        lo8[(size_t)r * K + j] = __nv_fp8_e4m3(l / sc);
    }
}

/* W bf16 [N, K] -> e4m3 of W / s with s = max|W_row| / 448 per row; rowmag = |W_row|. */
static __global__ void w8_kernel(__nv_fp8_e4m3 *w8, float *s, float *rowmag, const __nv_bfloat16 *w, int K) {
    const int r = blockIdx.x;
    float mx = 0.f, ss = 0.f;
    for (int j = threadIdx.x; j < K; j += blockDim.x) {
        const float v = __bfloat162float(w[(size_t)r * K + j]);
        mx = fmaxf(mx, fabsf(v));
        ss += v * v;
    }
    const float sc = row_scale(mx, ss, r, s, rowmag);
    for (int j = threadIdx.x; j < K; j += blockDim.x)
        w8[(size_t)r * K + j] = __nv_fp8_e4m3(__bfloat162float(w[(size_t)r * K + j]) / sc);
}

/* worst |y - ref| / (xmag[m] * wmag[n]) over [M, N] (y row-major [M, N]) */
static __global__ void err_kernel(float *out, const float *y, const float *ref, const float *xmag,
                                  const float *wmag, int M, int N) {
    float e = 0.f;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)M * N; i += (size_t)gridDim.x * blockDim.x) {
        const int m = (int)(i / N), n = (int)(i % N);
        const float d = fabsf(y[i] - ref[i]) / fmaxf(xmag[m] * wmag[n], 1e-30f);
        e = fmaxf(e, d);
    }
    for (int o = 16; o; o >>= 1) e = fmaxf(e, __shfl_xor_sync(~0u, e, o));
    if ((threadIdx.x & 31) == 0) atomicMax((int *)out, __float_as_int(e)); /* e >= 0: int order */
}

struct Probe {
    cublasHandle_t blas;
    cublasLtHandle_t lt;
    void *ws;
    size_t ws_bytes = (size_t)32 << 20;
};

/* y[M, N] (row-major) = x16[M, K] . w[N, K]^T, beta into y */
static bool gemm16(Probe &P, float *y, const void *x16, const void *w, int M, int N, int K, float beta) {
    const float one = 1.f;
    CB(cublasGemmEx(P.blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, w, CUDA_R_16BF, K, x16, CUDA_R_16BF, K, &beta,
                    y, CUDA_R_32F, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return true;
}

/* y += (sw[n] sx[m]) w8[N, K] . x8[M, K]^T through cuBLASLt (TN, fp32 out, outer-vector scales) */
static bool gemm8(Probe &P, float *y, const void *x8, const float *sx, const void *w8, const float *sw, int M, int N,
                  int K, cublasLtMatmulAlgo_t *algo, bool *have_algo) {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
    CB(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    CB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    const int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    CB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof mode));
    CB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof mode));
    CB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sw, sizeof sw));
    CB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sx, sizeof sx));
    CB(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, K, N, K));
    CB(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, K, M, K));
    CB(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, N, M, N));
    if (!*have_algo) {
        cublasLtMatmulPreference_t pref = nullptr;
        CB(cublasLtMatmulPreferenceCreate(&pref));
        CB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &P.ws_bytes,
                                                sizeof P.ws_bytes));
        cublasLtMatmulHeuristicResult_t r{};
        int n = 0;
        CB(cublasLtMatmulAlgoGetHeuristic(P.lt, op, la, lb, lc, lc, pref, 1, &r, &n));
        cublasLtMatmulPreferenceDestroy(pref);
        if (n < 1) {
            fprintf(stderr, "fp8_probe: no cuBLASLt algorithm for e4m3 x e4m3 -> fp32 with outer-vector scales\n");
            return false;
        }
        *algo = r.algo;
        *have_algo = true;
    }
    const float one = 1.f;
    CB(cublasLtMatmul(P.lt, op, &one, w8, la, x8, lb, &one, y, lc, y, lc, algo, P.ws, P.ws_bytes, 0));
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(op);
    return true;
}

template <class F> static double median_ms(F f, int reps = 20) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    std::vector<float> ms;
    for (int r = -2; r < reps; r++) {
        cudaEventRecord(a);
        if (!f()) return -1;
        cudaEventRecord(b);
        cudaEventSynchronize(b);
        float t = 0;
        cudaEventElapsedTime(&t, a, b);
        if (r >= 0) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return ms[ms.size() / 2];
}

extern "C" int fp8_probe_main(int argc, char **argv) {
    int M = 4096;
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--m")) M = atoi(argv[i + 1]);
    Probe P;
    if (cublasCreate(&P.blas) != CUBLAS_STATUS_SUCCESS || cublasLtCreate(&P.lt) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "fp8_probe: no cuBLAS\n");
        return 1;
    }
    CK(cudaMalloc(&P.ws, P.ws_bytes));
    cublasSetWorkspace(P.blas, P.ws, P.ws_bytes);
    struct Shape { const char *name; int N, K; };
    const Shape shapes[] = { {"dense gate/up", 12288, 4096}, {"dense down", 4096, 12288}, {"kda q/k/v", 8192, 4096},
                             {"dsa o", 4096, 16384} };
    printf("fp8_probe: M = %d rows; median of 20; err = worst |y - ref| / (|x_row| |W_row|)\n", M);
    int rc = 0;
    for (const Shape &s : shapes) {
        const int N = s.N, K = s.K;
        float *x, *wf, *ref, *y, *sx, *sw, *xmag, *wmag, *err;
        __nv_bfloat16 *w, *hi, *lo16;
        __nv_fp8_e4m3 *lo8, *w8;
        CK(cudaMalloc(&x, sizeof(float) * M * K));
        CK(cudaMalloc(&wf, sizeof(float) * (size_t)N * K));
        CK(cudaMalloc(&w, 2 * (size_t)N * K));
        CK(cudaMalloc(&w8, (size_t)N * K));
        CK(cudaMalloc(&hi, 2 * (size_t)M * K));
        CK(cudaMalloc(&lo16, 2 * (size_t)M * K));
        CK(cudaMalloc(&lo8, (size_t)M * K));
        CK(cudaMalloc(&ref, sizeof(float) * (size_t)M * N));
        CK(cudaMalloc(&y, sizeof(float) * (size_t)M * N));
        CK(cudaMalloc(&sx, sizeof(float) * M));
        CK(cudaMalloc(&xmag, sizeof(float) * M));
        CK(cudaMalloc(&sw, sizeof(float) * N));
        CK(cudaMalloc(&wmag, sizeof(float) * N));
        CK(cudaMalloc(&err, sizeof(float)));
        fill_kernel<<<1024, 256>>>(x, (size_t)M * K, 11u + N, 2.f);
        fill_kernel<<<1024, 256>>>(wf, (size_t)N * K, 77u + K, 0.05f);
        to_bf16_kernel<<<1024, 256>>>(w, wf, (size_t)N * K);
        bf16_to_f32_kernel<<<1024, 256>>>(wf, w, (size_t)N * K);
        w8_kernel<<<N, 256>>>(w8, sw, wmag, w, K);
        cublasSetMathMode(P.blas, CUBLAS_PEDANTIC_MATH);
        const float one = 1.f, zero = 0.f;
        if (cublasSgemm(P.blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, wf, K, x, K, &zero, ref, N) !=
            CUBLAS_STATUS_SUCCESS) {
            fprintf(stderr, "fp8_probe: SGEMM failed\n");
            return 1;
        }
        cublasSetMathMode(P.blas, CUBLAS_DEFAULT_MATH);
        CK(cudaDeviceSynchronize());
        auto check = [&](const char *form, double ms) {
            CK(cudaMemset(err, 0, sizeof(float)));
            err_kernel<<<1024, 256>>>(err, y, ref, xmag, wmag, M, N);
            float e = 0;
            CK(cudaMemcpy(&e, err, sizeof e, cudaMemcpyDeviceToHost));
            printf("  %-14s N=%5d K=%5d  %-13s %8.3f ms  %6.1f TFLOP/s  err %.2e\n", s.name, N, K, form, ms,
                   ms > 0 ? 2.0 * M * N * K / (ms * 1e-3) / 1e12 : 0.0, e);
        };
        auto split = [&] {
            split_kernel<<<M, 256>>>(hi, lo16, lo8, sx, xmag, x, K);
            return cudaGetLastError() == cudaSuccess;
        };
        split();
        double ms = median_ms([&] { return gemm16(P, y, hi, w, M, N, K, 0.f); });
        check("bf16 x1", ms);
        ms = median_ms([&] { return gemm16(P, y, hi, w, M, N, K, 0.f) && gemm16(P, y, lo16, w, M, N, K, 1.f); });
        check("bf16 x2", ms);
        cublasLtMatmulAlgo_t algo;
        bool have = false;
        ms = median_ms([&] { return gemm16(P, y, hi, w, M, N, K, 0.f) && gemm8(P, y, lo8, sx, w8, sw, M, N, K, &algo, &have); });
        if (ms < 0) {
            printf("  %-14s bf16 + e4m3: cuBLASLt refused (see above)\n", s.name);
            rc = 2;
        } else {
            check("bf16 + e4m3", ms);
            const double ms8 = median_ms([&] { return gemm8(P, y, lo8, sx, w8, sw, M, N, K, &algo, &have); });
            printf("  %-14s the e4m3 product alone %.3f ms (%.1f TFLOP/s); the split kernel %.3f ms\n", s.name, ms8,
                   2.0 * M * N * K / (ms8 * 1e-3) / 1e12, median_ms(split));
        }
        cudaFree(x); cudaFree(wf); cudaFree(w); cudaFree(w8); cudaFree(hi); cudaFree(lo16); cudaFree(lo8);
        cudaFree(ref); cudaFree(y); cudaFree(sx); cudaFree(sw); cudaFree(xmag); cudaFree(wmag); cudaFree(err);
    }
    return rc;
}
