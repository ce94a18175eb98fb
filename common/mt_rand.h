/* common/mt_rand.h: counter-based random numbers shared by host and device code, so the CPU and
 * CUDA backends make bit-identical random weights from the same (key, index): element i of a
 * tensor is a pure function of its key and i, independent of threads, chunking and device. */
#ifndef MT_RAND_H
#define MT_RAND_H

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define MT_HD __host__ __device__
#else
#define MT_HD
#endif

static inline MT_HD uint64_t mt_splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* FNV-1a of a string: a tensor's key from its name and a seed. */
static inline uint64_t mt_rand_key(uint64_t seed, const char *name) {
    uint64_t h = 0xcbf29ce484222325ull ^ mt_splitmix64(seed);
    for (; *name; name++) h = (h ^ (uint8_t)*name) * 0x100000001b3ull;
    return mt_splitmix64(h);
}

/* A standard normal draw for element i of stream key (Box-Muller on two 24-bit uniforms). */
static inline MT_HD float mt_rand_normal(uint64_t key, uint64_t i) {
    uint64_t r = mt_splitmix64(key ^ mt_splitmix64(i));
    float u1 = ((float)(r >> 40) + 0.5f) * (1.0f / 16777216.0f);
    float u2 = (float)((r >> 16) & 0xffffff) * (1.0f / 16777216.0f);
    return sqrtf(-2.0f * logf(u1)) * cosf(6.28318530718f * u2);
}

#endif /* MT_RAND_H */
