/* lab/probe_check.h: CK(call), the development probes' check of a CUDA runtime call: on an
 * error, prints file:line, the call and the error, and exits (the probes have nothing to unwind).
 * Owner: lab (fp8_probe.cu, kda_dec_probe.cu, tma_stream_probe.cu). */
#ifndef MT_TOOLS_DEV_PROBE_CHECK_H
#define MT_TOOLS_DEV_PROBE_CHECK_H

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CK(x)                                                                               \
    do {                                                                                    \
        cudaError_t e_ = (x);                                                               \
        if (e_ != cudaSuccess) {                                                            \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                        \
        }                                                                                   \
    } while (0)

#endif /* MT_TOOLS_DEV_PROBE_CHECK_H */
