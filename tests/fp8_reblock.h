// tests/fp8_reblock.h: an FP8 checkpoint re-blocked to 128 x 128 (the block size of GLM's FP8
// checkpoints and of the GPU's FP8 weights), for the tests of the FP8 load path
// (model_fp8_test.cc, CPU) and of the FP8 GEMMs in the model (model_fp8_cuda_test.cc).
#ifndef MT_TESTS_FP8_REBLOCK_H
#define MT_TESTS_FP8_REBLOCK_H

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

extern "C" {
#include "common/mt.h"
#include "worker/loader/glm_config.h"
#include "worker/loader/safetensors.h"
}

namespace fp8_test {

constexpr int kB = 128;

// The FP8 checkpoint in src with every FP8 tensor dequantised (with src's own blocks) and quantised
// again to 128 x 128 blocks (scale = block amax / 448, nearest-even e4m3), written with its config
// into dir.
inline void Reblock128(const std::string &src, const std::string &dir) {
    mt_error err{};
    glm_config cfg;
    ASSERT_EQ(glm_config_load((src + "/config.json").c_str(), &cfg, &err), MT_OK) << err.msg;
    ASSERT_TRUE(cfg.quant.fp8);
    st_archive *ar = nullptr;
    ASSERT_EQ(st_open_dir(src.c_str(), &ar, &err), MT_OK) << err.msg;
    st_writer *w = st_writer_new();
    for (size_t i = 0; i < st_count(ar); i++) {
        const st_tensor *t = st_at(ar, i);
        const std::string name = t->name;
        if (name.size() > 10 && name.compare(name.size() - 10, 10, "_scale_inv") == 0) continue;
        if (t->dtype != MT_F8E4M3) {
            ASSERT_EQ(st_writer_add(w, t->name, t->dtype, t->ndim, t->shape, t->data, &err), MT_OK) << err.msg;
            continue;
        }
        const st_tensor *tw, *sc;
        ASSERT_EQ(st_get_weight(ar, t->name, t->ndim, t->shape, cfg.quant.block_rows, cfg.quant.block_cols, &tw, &sc,
                                &err), MT_OK) << err.msg;
        const int64_t R = t->shape[0], C = t->shape[1], rb = (R + kB - 1) / kB, cb = (C + kB - 1) / kB;
        std::vector<float> f((size_t)(R * C));
        ASSERT_EQ(st_dequant_fp8(tw, sc, cfg.quant.block_rows, cfg.quant.block_cols, 0, R, 0, C, MT_F32, f.data(),
                                 &err), MT_OK) << err.msg;
        std::vector<uint8_t> q((size_t)(R * C));  // st_writer_add copies
        std::vector<float> s((size_t)(rb * cb));
        for (int64_t bi = 0; bi < rb; bi++)
            for (int64_t bj = 0; bj < cb; bj++) {
                float amax = 0.f;
                for (int64_t r = bi * kB; r < R && r < (bi + 1) * kB; r++)
                    for (int64_t c = bj * kB; c < C && c < (bj + 1) * kB; c++) amax = std::fmax(amax, std::fabs(f[r * C + c]));
                const float sv = amax > 0.f ? amax / 448.f : 1.f;
                s[bi * cb + bj] = sv;
                for (int64_t r = bi * kB; r < R && r < (bi + 1) * kB; r++)
                    for (int64_t c = bj * kB; c < C && c < (bj + 1) * kB; c++) q[r * C + c] = mt_f32_to_f8e4m3(f[r * C + c] / sv);
            }
        ASSERT_EQ(st_writer_add(w, t->name, MT_F8E4M3, 2, t->shape, q.data(), &err), MT_OK) << err.msg;
        const int64_t sshape[2] = {rb, cb};
        ASSERT_EQ(st_writer_add(w, (name + "_scale_inv").c_str(), MT_F32, 2, sshape, s.data(), &err), MT_OK) << err.msg;
    }
    ASSERT_EQ(st_writer_save(w, dir.c_str(), 0, &err), MT_OK) << err.msg;
    st_writer_free(w);
    st_close(ar);
    cfg.quant.block_rows = cfg.quant.block_cols = kB;
    ASSERT_EQ(glm_config_save(&cfg, (dir + "/config.json").c_str(), &err), MT_OK) << err.msg;
}

}  // namespace fp8_test

#endif  // MT_TESTS_FP8_REBLOCK_H
