/* lab/gemm_algo_probe.cu: do other cuBLASLt algorithms run the prefill's two-part GEMMs
 * faster than cublasGemmEx's default choice, on a GPU that a prefill holds at its power cap
 * (docs/PERF.md, "Power")? For each bench-4L projection shape at M rows
 * (W bf16 [N, K], x split into bf16 hi and lo [M, K], y fp32 [M, N]), the backend's form
 * (cu_gemm_tc: y = W.hi, then y += W.lo, cublasGemmEx with CUBLAS_GEMM_DEFAULT) beside the same
 * pair of products through cublasLtMatmul with each of the top heuristic algorithms. Each form
 * runs REPS pairs back to back between two events (long enough for the clock to settle at the cap),
 * five times; the median ms of a pair is printed, with TFLOP/s of the two products.
 *   gemm_algo_probe [--m 4096] */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "lab/probe_check.h"

#define CBL(x)                                                                                     \
    do {                                                                                           \
        cublasStatus_t s_ = (x);                                                                   \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                         \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cublasGetStatusString(s_)); \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

enum { REPS = 30, ROUNDS = 5, ALGOS = 16 };
static const size_t WS_BYTES = (size_t)64 << 20;

static __global__ void fill_bf16_kernel(__nv_bfloat16 *x, size_t n, unsigned seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
        x[i] = __float2bfloat16_rn(scale * ((h & 0xffffff) / 16777216.f - 0.5f));
    }
}

template <class F> static float time_pairs(cudaStream_t s, F pair) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int i = 0; i < 3; i++) pair();
    std::vector<float> ms;
    for (int r = 0; r < ROUNDS; r++) {
        CK(cudaEventRecord(e0, s));
        for (int i = 0; i < REPS; i++) pair();
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float t;
        CK(cudaEventElapsedTime(&t, e0, e1));
        ms.push_back(t / REPS);
    }
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    std::sort(ms.begin(), ms.end());
    return ms[ROUNDS / 2];
}

extern "C" int gemm_algo_probe_main(int argc, char **argv) {
    int M = 4096;
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--m")) M = atoi(argv[i + 1]);
    struct shape { const char *name; int N, K; };
    const shape shapes[] = {
        {"dense gate/up", 12288, 4096}, {"dense down", 4096, 12288}, {"kda q/k/v", 8192, 4096},
        {"kda o", 4096, 8192},          {"mla q_a", 1536, 4096},     {"mla q_b", 16384, 1536},
        {"mla o", 4096, 16384},         {"shared gate/up", 2048, 4096}, {"shared down", 4096, 2048},
    };
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    cublasHandle_t blas;
    cublasLtHandle_t lt;
    CBL(cublasCreate(&blas));
    CBL(cublasSetStream(blas, s));
    CBL(cublasLtCreate(&lt));
    void *ws;
    CK(cudaMalloc(&ws, WS_BYTES));
    CBL(cublasSetWorkspace(blas, ws, WS_BYTES));
    printf("two-part GEMM pairs, M = %d: cublasGemmEx default beside cublasLt's top %d algorithms\n", M, ALGOS);
    for (const shape &sh : shapes) {
        const int N = sh.N, K = sh.K;
        __nv_bfloat16 *w, *x;
        float *y;
        CK(cudaMalloc(&w, sizeof(__nv_bfloat16) * (size_t)N * K));
        CK(cudaMalloc(&x, sizeof(__nv_bfloat16) * 2 * (size_t)M * K));
        CK(cudaMalloc(&y, sizeof(float) * (size_t)M * N));
        fill_bf16_kernel<<<1024, 256, 0, s>>>(w, (size_t)N * K, 1u, 0.05f);
        fill_bf16_kernel<<<1024, 256, 0, s>>>(x, 2 * (size_t)M * K, 2u, 1.f);
        const __nv_bfloat16 *hi = x, *lo = x + (size_t)M * K;
        const float one = 1.f, zero = 0.f;
        const double flop = 2.0 * 2.0 * M * N * K;
        /* the backend's form (cu_gemm_tc): column-major y^T [N, M] = W [N, K] . x^T */
        auto gemm_ex = [&] {
            CBL(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, w, CUDA_R_16BF, K, hi, CUDA_R_16BF, K, &zero, y,
                             CUDA_R_32F, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            CBL(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, w, CUDA_R_16BF, K, lo, CUDA_R_16BF, K, &one, y,
                             CUDA_R_32F, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        };
        const float t_ex = time_pairs(s, gemm_ex);
        printf("%-15s N %5d K %5d: cublasGemmEx default %.3f ms (%.0f TFLOP/s)\n", sh.name, N, K, t_ex, flop / t_ex / 1e9);

        cublasLtMatmulDesc_t op;
        CBL(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
        CBL(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
        CBL(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
        cublasLtMatrixLayout_t la, lb, lc;
        CBL(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, K, N, K));
        CBL(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, K, M, K));
        CBL(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, N, M, N));
        cublasLtMatmulPreference_t pref;
        CBL(cublasLtMatmulPreferenceCreate(&pref));
        CBL(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &WS_BYTES, sizeof WS_BYTES));
        cublasLtMatmulHeuristicResult_t res[ALGOS];
        int got = 0;
        CBL(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, ALGOS, res, &got));
        float best = 1e30f;
        int best_i = -1;
        for (int a = 0; a < got; a++) {
            const cublasLtMatmulAlgo_t *algo = &res[a].algo;
            auto pair = [&] {
                CBL(cublasLtMatmul(lt, op, &one, w, la, hi, lb, &zero, y, lc, y, lc, algo, ws, WS_BYTES, s));
                CBL(cublasLtMatmul(lt, op, &one, w, la, lo, lb, &one, y, lc, y, lc, algo, ws, WS_BYTES, s));
            };
            const float t = time_pairs(s, pair);
            int tile = -1, stages = -1, cluster = -1;
            size_t wr;
            cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &wr);
            cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages, &wr);
            cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof cluster, &wr);
            printf("    lt algo %2d (tile %3d stages %3d cluster %2d, ws %8zu): %.3f ms (%.0f TFLOP/s) %+.1f%%\n", a, tile,
                   stages, cluster, res[a].workspaceSize, t, flop / t / 1e9, 100.0 * (t - t_ex) / t_ex);
            if (t < best) best = t, best_i = a;
        }
        printf("  best: lt algo %d %.3f ms, %+.1f%% against the default\n", best_i, best, 100.0 * (best - t_ex) / t_ex);
        cublasLtMatmulPreferenceDestroy(pref);
        cublasLtMatrixLayoutDestroy(la);
        cublasLtMatrixLayoutDestroy(lb);
        cublasLtMatrixLayoutDestroy(lc);
        cublasLtMatmulDescDestroy(op);
        CK(cudaFree(w));
        CK(cudaFree(x));
        CK(cudaFree(y));
    }
    return 0;
}
