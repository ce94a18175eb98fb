/* kernels/cuda/cuda_launch.h: how the CUDA backend's op files launch their kernels and check the
 * launches (internal to the backend; cuda_ops.h includes it): the launch checks that log a failure
 * and record it in the backend's sticky status (ops return void per the table), programmatic
 * dependent launch, dynamic shared memory beyond the default 48 KB, and grid sizing. Every launch
 * is followed by a check: cu_check_launch after <<<>>> or cu_launch_pdl_k, cu_op_status after a
 * launcher that returns a status (MT_CUDA_CHECK, cuda_check.h, inside it). */
#ifndef MT_CUDA_LAUNCH_H
#define MT_CUDA_LAUNCH_H

#include <cuda_runtime_api.h>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_check.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- launch checks (cuda_core.cu) ---- */

/* Records a launch/runtime failure (logged by the caller) so the model can notice at sync. */
void cu_fail(mt_backend *be, mt_status st);
/* Checks cudaGetLastError after a launch; logs with the op name and records failure. */
void cu_check_launch(mt_backend *be, const char *op);
/* Records a failed status from a launcher (already logged at the failing call) with the op name. */
void cu_op_status(mt_backend *be, const char *op, mt_status st);
/* Called after every op is issued: ends a gap of the device after a wait that left the stream
 * empty (mt_cuda_gap_seconds). Op timing (mt_cuda_profile): when on, synchronises the stream and
 * charges the time since the previous mark to `what`. cu_op_status and cu_check_launch mark with
 * their op name. The timing is off while the stream is being captured. */
void cu_prof_mark(mt_backend *be, const char *what);
/* cudaStreamSynchronize of the backend's stream, its time added to the backend's wait_s
 * (mt_cuda_wait_seconds). Every op and transfer that waits for the stream waits through it; the
 * op profile's own waits (cu_prof_mark) do not. */
cudaError_t cu_wait(mt_backend *be);
/* Books a wait that began at t0 (mt_now()) and has just ended: wait_s, and when `empty` (the
 * stream has nothing left queued) the start of a gap (mt_cuda_gap_seconds). */
void cu_waited(mt_backend *be, double t0, bool empty);
/* After the mark of an op that ends with a wait emptying the stream (a read-back): the device is
 * idle from here until the host's next op (that op's own mark closed the gap its wait began). */
void cu_gap_open(mt_backend *be);
/* bytes from device src into host dst (pageable or not) in the stream's order, waited for: the
 * copy and the wait both count in wait_s, since a copy into pageable memory itself blocks until
 * the stream reaches it and has run it. */
cudaError_t cu_copy_to_host(mt_backend *be, void *dst, const void *src, size_t bytes);

/* ---- programmatic dependent launch ---- */

/* A decode step is a chain of ~75 short kernels, and between two of them the GPU drains one grid
 * before it starts the next. The decode-path kernels (cuda_dense.cu, cuda_hc.cu, cuda_moe.cu; the
 * rows-form, KDA and MLA decode kernels through cu_launch_pdl_k, below) go through
 * cu_launch_pdl (programmatic dependent launch): such a kernel may start while the
 * previous kernel of the stream is still running. It first does what depends on no earlier
 * kernel (a GEMV issues its first weight loads), then cu_pdl_wait() (griddepcontrol.wait: every
 * earlier kernel has finished and its writes are visible) before it reads an activation or
 * writes anything, then cu_pdl_trigger() (griddepcontrol.launch_dependents) so that the next such
 * kernel may start in turn; every block passes both. (Exceptions read, before their wait, only
 * what kernels two or more back wrote, which the previous kernel's own wait made complete:
 * moe_gateup_kernel's shared-expert blocks and gemv_shortk_kernel's late_wait, which both wait
 * before exiting, and moe_down_kernel's first weight loads, found through the router's indices.)
 * Stream capture keeps the overlap as programmatic edges of the graph. */

/* kernel(*params) on s for PDL, one kernel taking one parameter struct by value (cuda_core.cu).
 * Returns the launch's error. */
cudaError_t cu_launch_pdl(const void *kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t s, void *params);

#ifdef __cplusplus
}
#endif

#ifdef __CUDACC__
/* A kernel started by cu_launch_pdl waits here before it reads an activation or writes anything,
 * and lets the next one start after. */
__device__ __forceinline__ void cu_pdl_wait(void) { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void cu_pdl_trigger(void) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

/* k<<<grid, block, smem, s>>>(p) launched for PDL: the kernel must cu_pdl_wait() before it reads
 * what an earlier kernel wrote, or writes anything. A launch error is left for cudaGetLastError
 * (cu_check_launch, MT_CUDA_CHECK_LAUNCH), as with <<<>>>. */
template <typename P>
static inline void cu_launch_pdl_k(void (*k)(P), dim3 grid, dim3 block, size_t smem, cudaStream_t s, P p) {
    (void)cu_launch_pdl((const void *)k, grid, block, smem, s, &p);
}

/* ---- dynamic shared memory ---- */

/* Dynamic shared memory above 48 KB needs the kernel's limit raised first. */
static inline mt_status cu_smem_opt_in(const void *kernel, size_t bytes) {
    if (bytes <= 48 * 1024) return MT_OK;
    MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    return MT_OK;
}

/* Largest dynamic shared memory a block may opt in to on the current device. */
static inline int cu_smem_max(void) {
    int dev = 0, v = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
        return 48 * 1024;
    return v;
}

/* ---- grid sizing ---- */

/* Blocks of `threads` threads for one thread an element over count elements, at most max_blocks
 * (0: no bound; the kernel then strides over the rest). */
static inline unsigned cu_grid_1d(int64_t count, int threads, int64_t max_blocks) {
    const int64_t b = (count + threads - 1) / threads;
    return (unsigned)(max_blocks > 0 && b > max_blocks ? max_blocks : b);
}
#endif /* __CUDACC__ */

#endif /* MT_CUDA_LAUNCH_H */
