/* lab/bw_probe.cu: how fast can a kernel only READ device memory, beside the copy bandwidth
 * (cudaMemcpy D2D, read + write) that the benches take as their reference? The decode GEMVs and
 * the MoE experts only read their weights, so this is their ceiling; the gap between it and the
 * copy figure says how far above "100% of copy" a weight stream could go.
 *
 * Read kernel: a grid of B blocks a multiprocessor of 256 threads, grid-stride over a 1 GiB
 * buffer, each thread issuing U 16-byte loads (ld.global.nc.L1::no_allocate) before summing them
 * (U x 16 bytes in flight per thread). One line per (B, U), then the best; all timed with events
 * over reps after a warm-up, the buffer far beyond the 60 MB L2.
 *   bw_probe [--mib N] [--reps R] */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "bw_probe: %s: %s\n", #x, cudaGetErrorString(e_));                 \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

static __device__ __forceinline__ float4 ld_stream(const float4 *p) {
    float4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.f32 {%0,%1,%2,%3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p));
    return v;
}

/* n4 float4 of x, grid-stride, U loads in flight a thread; sink keeps the loads alive (written
 * only if the impossible sum appears). PDL: the dependent-launch wait first (the chain study). */
template <int U, bool PDL = false>
static __global__ void __launch_bounds__(256) read_kernel(const float4 *x, size_t n4, float *sink) {
    if (PDL) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;");
    }
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    float acc = 0.f;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride * U) {
        float4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) v[u] = i + u * stride < n4 ? ld_stream(x + i + u * stride) : make_float4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < U; u++) acc += v[u].x + v[u].y + v[u].z + v[u].w;
    }
    if (acc == 1.2345e-30f) *sink = acc;
}

/* One-shot form (as the decode GEMV's blocks): thread t of the grid loads its U vectors once,
 * vector t + u * stride, and exits; the grid covers the buffer. PDL: waits for the previous kernel
 * (griddepcontrol.wait) after issuing its loads' L2 prefetches, as the GEMV does. */
template <int U, bool PDL>
static __global__ void __launch_bounds__(256) read_once_kernel(const float4 *x, size_t n4, float *sink) {
    const size_t stride = (size_t)gridDim.x * blockDim.x, i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (PDL) {
        if (i < n4) asm volatile("prefetch.global.L2 [%0];" ::"l"(x + i));
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;");
    }
    float4 v[U];
#pragma unroll
    for (int u = 0; u < U; u++) v[u] = i + u * stride < n4 ? ld_stream(x + i + u * stride) : make_float4(0, 0, 0, 0);
    float acc = 0.f;
#pragma unroll
    for (int u = 0; u < U; u++) acc += v[u].x + v[u].y + v[u].z + v[u].w;
    if (acc == 1.2345e-30f) *sink = acc;
}

/* The decode GEMV's access pattern and work, in steps, to find which part of it costs the gap
 * between the GEMV (cuda_dense.cu gemv_kernel) and a plain read at the same size: a bf16 weight
 * [rows, cols]; a warp owns 2 rows and every ks-th chunk of 32 x 16 bytes of them (ks warps a row
 * pair, 8 / ks pairs a block of 256), U = 4 chunks x 2 rows of 16-byte loads in flight a lane,
 * issued after an L2 prefetch of the first step and the PDL wait, as there. STEP 0: only the
 * loads (their bits summed); 1: + x (fp32, __ldg) and the bf16 -> fp32 FMAs; 2: + the K-split
 * sums through shared memory behind a block barrier and y written: the whole GEMV. SPREAD: the
 * block's local row q is row q * gridDim.x + blockIdx.x (its rows far apart) instead of
 * 4 blockIdx.x + q (adjacent). */
template <int STEP, bool SPREAD = false, bool PF = true>
static __global__ void __launch_bounds__(256) gemv_like_kernel(const uint4 *w, const float *x, float *y, int rows, int cols,
                                                               int ks) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, per_block = 8 / ks, s = warp % ks;
    const int nv = cols / 8, nch = nv / 32;
    const int row0 = (blockIdx.x * per_block + warp / ks) * 2;
    /* the row of local pair member r */
    auto rowof = [&](int r) { return SPREAD ? ((warp / ks) * 2 + r) * (int)gridDim.x + (int)blockIdx.x : row0 + r; };
    if (PF) {
        const int u = lane >> 3, r = (lane >> 2) & 1, v = (s + u * ks) * 32 + 8 * (lane & 3);
        if (rowof(r) < rows && s + u * ks < nch)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(w + (size_t)rowof(r) * nv + v));
    }
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    float acc[2] = {0.f, 0.f};
    for (int c0 = s; c0 < nch; c0 += 4 * ks) {
        uint4 wr[4][2];
#pragma unroll
        for (int u = 0; u < 4; u++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int v = (c0 + u * ks) * 32 + lane;
                if (c0 + u * ks < nch && rowof(r) < rows)
                    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                                 : "=r"(wr[u][r].x), "=r"(wr[u][r].y), "=r"(wr[u][r].z), "=r"(wr[u][r].w)
                                 : "l"(w + (size_t)rowof(r) * nv + v));
                else
                    wr[u][r] = make_uint4(0, 0, 0, 0);
            }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int v = (c0 + u * ks) * 32 + lane;
            if (STEP == 0) {
#pragma unroll
                for (int r = 0; r < 2; r++) acc[r] += __uint_as_float(wr[u][r].x ^ wr[u][r].y ^ wr[u][r].z ^ wr[u][r].w);
                continue;
            }
            if (c0 + u * ks >= nch) continue;
            const float4 xa = __ldg((const float4 *)(x + (size_t)v * 8)), xb = __ldg((const float4 *)(x + (size_t)v * 8 + 4));
            const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const uint32_t q[4] = {wr[u][r].x, wr[u][r].y, wr[u][r].z, wr[u][r].w};
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    acc[r] = fmaf(__uint_as_float(q[j] << 16), xv[2 * j], acc[r]);
                    acc[r] = fmaf(__uint_as_float(q[j] & 0xffff0000u), xv[2 * j + 1], acc[r]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; r++)
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
    if (STEP < 2) {
        if (acc[0] == 1.2345e-30f) y[0] = acc[1];
        return;
    }
    __shared__ float red[8][2];
    if (lane < 2) red[warp][lane] = acc[lane];
    __syncthreads();
    if (threadIdx.x < per_block * 2) {
        const int g = threadIdx.x / 2, r = threadIdx.x % 2,
                  row = SPREAD ? (g * 2 + r) * (int)gridDim.x + (int)blockIdx.x : (blockIdx.x * per_block + g) * 2 + r;
        float sum = 0.f;
        for (int q = 0; q < ks; q++) sum += red[g * ks + q][r];
        if (row < rows) y[row] = sum;
    }
}

/* The same GEMV laid out as the plain read: block b owns rows 4b..4b+3 (32 KB of bf16 at cols
 * 4096) and thread t loads vectors t + 256 u (u < 8) of that region, so each load instruction of
 * the block covers 4 KB contiguous; thread t's vectors of row u / 2 need the x vectors t and
 * 256 + t only (16 floats for all 4 rows). Rows reduce over the block (shuffles, then shared
 * memory). PF: the L2 prefetch of the thread's first line before the wait, as read_once does. */
template <bool PF>
static __global__ void __launch_bounds__(256) gemv_lin_kernel(const uint4 *w, const float *x, float *y, int rows) {
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const uint4 *wb = w + (size_t)blockIdx.x * 2048; /* 4 rows x 512 vectors */
    if (PF) asm volatile("prefetch.global.L2 [%0];" ::"l"(wb + t));
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; u++)
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                     : "l"(wb + t + 256 * u));
    float xv[2][8];
#pragma unroll
    for (int hlf = 0; hlf < 2; hlf++) {
        const float4 a = __ldg((const float4 *)(x + (size_t)(hlf * 256 + t) * 8));
        const float4 b = __ldg((const float4 *)(x + (size_t)(hlf * 256 + t) * 8 + 4));
        xv[hlf][0] = a.x; xv[hlf][1] = a.y; xv[hlf][2] = a.z; xv[hlf][3] = a.w;
        xv[hlf][4] = b.x; xv[hlf][5] = b.y; xv[hlf][6] = b.z; xv[hlf][7] = b.w;
    }
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int u = 0; u < 8; u++) {
        const uint32_t q[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            acc[u >> 1] = fmaf(__uint_as_float(q[j] << 16), xv[u & 1][2 * j], acc[u >> 1]);
            acc[u >> 1] = fmaf(__uint_as_float(q[j] & 0xffff0000u), xv[u & 1][2 * j + 1], acc[u >> 1]);
        }
    }
    __shared__ float red[8][4];
#pragma unroll
    for (int r = 0; r < 4; r++) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
        if (lane == 0) red[warp][r] = acc[r];
    }
    __syncthreads();
    if (t < 4 && (int)blockIdx.x * 4 + t < rows) {
        float sum = 0.f;
        for (int q = 0; q < 8; q++) sum += red[q][t];
        y[blockIdx.x * 4 + t] = sum;
    }
}

static float *xg, *yg; /* the gemv-like chain's x [4096] and y (allocated before any capture) */

/* Back-to-back reads of `mb` MiB each, cycling over copies in 2 GiB (so each comes from memory),
 * captured in one graph of 64 kernels as a decode step is: the cost of a kernel boundary at the
 * decode projections' sizes. Modes: 0 one-shot grid (U = 8), plain launches; 1 the same with PDL;
 * 2 streaming grid of 4 blocks/SM (U = 4) with PDL; 3 one-shot with PDL at U = 4 (half the bytes
 * in flight a thread); 4 one-shot U = 8 with PDL held to 4 blocks a multiprocessor (48 KB of
 * unused dynamic shared memory a block), as the GEMV's registers hold it; 5-7 gemv_like STEP 0-2;
 * 8-9 gemv_like STEP 0 and 2 without the L2 prefetch; 10-11 gemv_lin with and without its line
 * prefetch; 12 gemv_like STEP 0 with the rows spread. */
static double chain_gbs(char *base, size_t copies, size_t mb, int mode, int n_sm, float *sink) {
    const size_t bytes = mb << 20, n4 = bytes / 16;
    const int count = 64;
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int c = 0; c < count; c++) {
        const float4 *x = (const float4 *)(base + (c % copies) * bytes);
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t cfg = {};
        cfg.blockDim = dim3(256);
        cfg.stream = st;
        cfg.attrs = attr;
        cfg.numAttrs = mode > 0 ? 1 : 0;
        void *args[3] = {(void *)&x, (void *)&n4, (void *)&sink};
        const void *k;
        if (mode == 2) {
            cfg.gridDim = dim3(4 * n_sm);
            k = (const void *)read_kernel<4, true>;
        } else if (mode == 3) {
            cfg.gridDim = dim3((unsigned)((n4 + 256 * 4 - 1) / (256 * 4)));
            k = (const void *)read_once_kernel<4, true>;
        } else if (mode >= 10 && mode < 12) { /* gemv_lin over [rows, 4096] bf16 */
            const int rows = (int)(bytes / 8192);
            cfg.gridDim = dim3((unsigned)(rows / 4));
            void *gargs[4] = {(void *)&x, (void *)&xg, (void *)&yg, (void *)&rows};
            k = mode == 10 ? (const void *)gemv_lin_kernel<true> : (const void *)gemv_lin_kernel<false>;
            CK(cudaLaunchKernelExC(&cfg, k, gargs));
            continue;
        } else if (mode >= 5) { /* gemv_like STEP mode - 5 over [rows, 4096] bf16, ks 4 */
            const int rows = (int)(bytes / 8192), cols = 4096, ks = 4;
            cfg.gridDim = dim3((unsigned)((rows / 2 + (8 / ks) - 1) / (8 / ks)));
            void *gargs[6] = {(void *)&x, (void *)&xg, (void *)&yg, (void *)&rows, (void *)&cols, (void *)&ks};
            k = mode == 5   ? (const void *)gemv_like_kernel<0>
                : mode == 6 ? (const void *)gemv_like_kernel<1>
                : mode == 7 ? (const void *)gemv_like_kernel<2>
                : mode == 8 ? (const void *)gemv_like_kernel<0, false, false>
                : mode == 9 ? (const void *)gemv_like_kernel<2, false, false>
                            : (const void *)gemv_like_kernel<0, true>;
            CK(cudaLaunchKernelExC(&cfg, k, gargs));
            continue;
        } else if (mode == 4) {
            cfg.gridDim = dim3((unsigned)((n4 + 256 * 8 - 1) / (256 * 8)));
            cfg.dynamicSmemBytes = 48 << 10;
            k = (const void *)read_once_kernel<8, true>;
        } else {
            cfg.gridDim = dim3((unsigned)((n4 + 256 * 8 - 1) / (256 * 8)));
            k = mode == 1 ? (const void *)read_once_kernel<8, true> : (const void *)read_once_kernel<8, false>;
        }
        CK(cudaLaunchKernelExC(&cfg, k, args));
    }
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphLaunch(ge, st));
    CK(cudaStreamSynchronize(st));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    const int reps = 5;
    CK(cudaEventRecord(a, st));
    for (int r = 0; r < reps; r++) CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(b, st));
    CK(cudaEventSynchronize(b));
    float ms = 0.f;
    CK(cudaEventElapsedTime(&ms, a, b));
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    CK(cudaStreamDestroy(st));
    return (double)bytes * count * reps / (ms * 1e-3) / 1e9;
}

template <int U> static double time_read(const float4 *x, size_t n4, float *sink, int blocks, int reps) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    read_kernel<U><<<blocks, 256>>>(x, n4, sink);
    CK(cudaGetLastError());
    CK(cudaEventRecord(a));
    for (int r = 0; r < reps; r++) read_kernel<U><<<blocks, 256>>>(x, n4, sink);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0.f;
    CK(cudaEventElapsedTime(&ms, a, b));
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return ms / reps;
}

extern "C" int bw_probe_main(int argc, char **argv) {
    size_t mib = 1024;
    int reps = 20;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--mib") && i + 1 < argc) mib = (size_t)atol(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bw_probe [--mib N] [--reps R]\n");
            return 2;
        }
    }
    if (mib < 64 || reps < 1) {
        fprintf(stderr, "bw_probe: --mib >= 64 and --reps >= 1\n");
        return 2;
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const size_t bytes = mib << 20, n4 = bytes / 16;
    void *x, *y;
    float *sink;
    CK(cudaMalloc(&x, 2 * bytes)); /* the chain study cycles over both halves */
    y = (char *)x + bytes;
    CK(cudaMalloc(&sink, 4));
    CK(cudaMemset(x, 0, 2 * bytes));

    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    CK(cudaMemcpy(y, x, bytes, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(a));
    for (int r = 0; r < reps; r++) CK(cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0.f;
    CK(cudaEventElapsedTime(&ms, a, b));
    const double copy_gbs = 2.0 * bytes / (ms / reps * 1e-3) / 1e9;
    printf("device %s, %d SMs, buffer %zu MiB\n", prop.name, prop.multiProcessorCount, mib);
    printf("copy (cudaMemcpy D2D, read + write): %.1f GB/s\n", copy_gbs);

    const int bpsm[] = {1, 2, 4, 8};
    double best = 0;
    int best_b = 0, best_u = 0;
    for (int bi = 0; bi < 4; bi++) {
        const int blocks = bpsm[bi] * prop.multiProcessorCount;
        const int us[] = {2, 4, 8, 16};
        for (int ui = 0; ui < 4; ui++) {
            const int U = us[ui];
            const double t = U == 2   ? time_read<2>((const float4 *)x, n4, sink, blocks, reps)
                             : U == 4 ? time_read<4>((const float4 *)x, n4, sink, blocks, reps)
                             : U == 8 ? time_read<8>((const float4 *)x, n4, sink, blocks, reps)
                                      : time_read<16>((const float4 *)x, n4, sink, blocks, reps);
            const double gbs = bytes / (t * 1e-3) / 1e9;
            printf("read: %d blocks/SM x 256 threads, %2d x 16 B in flight a thread: %.1f GB/s (%.1f%% of copy)\n",
                   bpsm[bi], U, gbs, 100.0 * gbs / copy_gbs);
            if (gbs > best) best = gbs, best_b = bpsm[bi], best_u = U;
        }
    }
    printf("best read: %.1f GB/s = %.1f%% of copy (%d blocks/SM, %d loads a thread)\n", best, 100.0 * best / copy_gbs,
           best_b, best_u);
    CK(cudaMalloc(&xg, 4096 * 4));
    CK(cudaMemset(xg, 0, 4096 * 4));
    CK(cudaMalloc(&yg, (size_t)1 << 20));
    /* the kernel boundary at the decode projections' sizes (x and y: 2 GiB of copies) */
    const size_t sizes[] = {4, 16, 64, 128};
    for (int si = 0; si < 4; si++) {
        const size_t mb = sizes[si], copies = (2 * bytes) / (mb << 20);
        printf("chain of 64 reads of %3zu MiB in a graph:", mb);
        const char *names[13] = {"one-shot", "one-shot+PDL", "streaming 4/SM+PDL", "one-shot+PDL U=4",
                                 "one-shot+PDL <=4/SM", "gemv loads", "gemv +x,fma", "gemv +ksum,y",
                                 "gemv loads, no L2 prefetch", "gemv whole, no L2 prefetch",
                                 "gemv block-linear +line PF", "gemv block-linear", "gemv loads, rows spread"};
        for (int mode = 0; mode < 13; mode++) {
            const double gbs = chain_gbs((char *)x, copies, mb, mode, prop.multiProcessorCount, sink);
            printf("  %s %.1f GB/s (%.1f%%)", names[mode], gbs, 100.0 * gbs / copy_gbs);
        }
        printf("\n");
    }
    CK(cudaFree(x));
    CK(cudaFree(sink));
    return 0;
}
