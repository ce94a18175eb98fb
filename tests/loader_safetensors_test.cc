// tests/loader_safetensors_test.cc: the safetensors reader and writer
// (worker/loader/safetensors.h), the manifest, and tools/mkckpt, with real files in a temp dir.
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <json-c/json.h>

#include "tests/loader_test_util.h"
#include "worker/loader/glm_config.h"
#include "worker/loader/glm_manifest.h"
#include "worker/loader/safetensors.h"

using loader_test::Exists;
using loader_test::MkckptPath;
using loader_test::ReadFile;
using loader_test::TempDir;
using loader_test::WriteFile;

namespace {

bool Contains(const std::string &s, const std::string &needle) { return s.find(needle) != std::string::npos; }

// A safetensors file from a literal header and a data section.
std::string RawFile(const std::string &header, const std::string &data) {
    std::string out(8, '\0');
    uint64_t n = header.size();
    for (int i = 0; i < 8; i++) out[i] = (char)(n >> (8 * i));
    return out + header + data;
}

// Opens dir (or a file) expecting failure; returns the message.
std::string OpenDirFails(const std::string &dir, mt_status want) {
    st_archive *ar = (st_archive *)0x1;  // must stay untouched
    mt_error err = {};
    mt_status st = st_open_dir(dir.c_str(), &ar, &err);
    EXPECT_EQ(st, want) << err.msg;
    EXPECT_EQ(ar, (st_archive *)0x1);
    EXPECT_EQ(std::string(err.msg).find('\n'), std::string::npos);
    return err.msg;
}

std::string OpenFileFails(const std::string &path, mt_status want) {
    st_archive *ar = nullptr;
    mt_error err = {};
    mt_status st = st_open_file(path.c_str(), &ar, &err);
    EXPECT_EQ(st, want) << err.msg;
    EXPECT_EQ(ar, nullptr);
    return err.msg;
}

struct TestTensor {
    std::string name;
    mt_dtype dtype;
    std::vector<int64_t> shape;
    std::string bytes;
};

TestTensor Make(const std::string &name, mt_dtype dt, std::vector<int64_t> shape, unsigned seed) {
    TestTensor t{ name, dt, shape, "" };
    size_t n = mt_dtype_size(dt);
    for (int64_t d : shape) n *= (size_t)d;
    t.bytes.resize(n);
    for (size_t i = 0; i < n; i++) t.bytes[i] = (char)((i * 131 + seed * 17 + 7) & 0xff);
    return t;
}

std::vector<TestTensor> SampleTensors() {
    return {
        Make("model.embed.weight", MT_BF16, { 16, 8 }, 1),
        Make("a/b.weight", MT_F32, { 2, 3 }, 2),  // '/' must survive the JSON round trip
        Make("conv", MT_F32, { 6, 1, 4 }, 3),
        Make("half", MT_F16, { 2, 2, 2, 2 }, 4),
        Make("ids", MT_I32, { 5 }, 5),
        Make("big_ids", MT_I64, { 3 }, 6),
        Make("mask", MT_U8, { 7 }, 7),
        Make("scalar", MT_F32, {}, 8),
        Make("empty", MT_BF16, { 0, 5 }, 9),
        Make("odd", MT_BF16, { 3 }, 10),  // 6 bytes: the next tensor starts unaligned
        Make("after_odd", MT_F32, { 3 }, 11),
    };
}

void AddAll(st_writer *w, const std::vector<TestTensor> &ts) {
    mt_error err = {};
    for (const TestTensor &t : ts)
        ASSERT_EQ(st_writer_add(w, t.name.c_str(), t.dtype, (int)t.shape.size(), t.shape.data(),
                                t.bytes.data(), &err),
                  MT_OK)
            << err.msg;
}

void ExpectHolds(const st_archive *ar, const std::vector<TestTensor> &ts) {
    ASSERT_EQ(st_count(ar), ts.size());
    for (const TestTensor &t : ts) {
        const st_tensor *x = st_find(ar, t.name.c_str());
        ASSERT_NE(x, nullptr) << t.name;
        EXPECT_STREQ(x->name, t.name.c_str());
        EXPECT_EQ(x->dtype, t.dtype) << t.name;
        ASSERT_EQ(x->ndim, (int)t.shape.size()) << t.name;
        for (size_t d = 0; d < t.shape.size(); d++) EXPECT_EQ(x->shape[d], t.shape[d]) << t.name;
        ASSERT_EQ(x->nbytes, t.bytes.size()) << t.name;
        EXPECT_EQ(memcmp(x->data, t.bytes.data(), x->nbytes), 0) << t.name;
    }
}

TEST(Safetensors, RoundTripSingleFile) {
    TempDir dir;
    std::vector<TestTensor> ts = SampleTensors();
    st_writer *w = st_writer_new();
    AddAll(w, ts);
    EXPECT_EQ(st_writer_count(w), ts.size());
    mt_error err = {};
    ASSERT_EQ(st_writer_save(w, dir.path().c_str(), 0, &err), MT_OK) << err.msg;
    st_writer_free(w);
    EXPECT_TRUE(Exists(dir.file("model.safetensors")));
    EXPECT_FALSE(Exists(dir.file("model.safetensors.index.json")));

    // Header padded with spaces to a multiple of 8; data follows.
    std::string raw = ReadFile(dir.file("model.safetensors"));
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | (uint8_t)raw[i];
    EXPECT_EQ(hlen % 8, 0u);
    EXPECT_EQ(raw[8], '{');
    EXPECT_TRUE(Contains(raw.substr(8, hlen), "\"a/b.weight\""));

    st_archive *ar = nullptr;
    ASSERT_EQ(st_open_dir(dir.path().c_str(), &ar, &err), MT_OK) << err.msg;
    ExpectHolds(ar, ts);
    for (size_t i = 0; i < ts.size(); i++) EXPECT_EQ(st_at(ar, i)->name, ts[i].name) << "file order";
    EXPECT_EQ(st_at(ar, ts.size()), nullptr);
    EXPECT_EQ(st_find(ar, "__metadata__"), nullptr);
    EXPECT_TRUE(Contains(st_find(ar, "conv")->file, "model.safetensors"));
    // Tensors are 8-byte aligned in the file when their predecessors' sizes allow it.
    EXPECT_EQ((uintptr_t)st_find(ar, "model.embed.weight")->data % 8, 0u);

    const st_tensor *t = nullptr;
    int64_t shape[3] = { 6, 1, 4 };
    EXPECT_EQ(st_get(ar, "conv", 3, shape, &t, &err), MT_OK) << err.msg;
    EXPECT_EQ(t, st_find(ar, "conv"));
    EXPECT_EQ(st_get(ar, "scalar", 0, nullptr, &t, &err), MT_OK) << err.msg;
    int64_t ids_shape[1] = { 5 };
    EXPECT_EQ(st_get(ar, "ids", 1, ids_shape, &t, &err), MT_ERR_INVALID);
    EXPECT_TRUE(Contains(err.msg, "ids")) << err.msg;
    EXPECT_TRUE(Contains(err.msg, "dtype I32")) << err.msg;
    st_close(ar);

    // st_open_file on the same file gives the same view.
    ASSERT_EQ(st_open_file(dir.file("model.safetensors").c_str(), &ar, &err), MT_OK) << err.msg;
    ExpectHolds(ar, ts);
    st_close(ar);
    st_close(nullptr);
}

std::vector<TestTensor> ManyTensors(int n) {
    std::vector<TestTensor> ts;
    for (int i = 0; i < n; i++)
        ts.push_back(Make("layers." + std::to_string(i) + ".w", i % 3 ? MT_BF16 : MT_F32,
                          { 8, 4 + i % 5 }, (unsigned)i));
    return ts;
}

TEST(Safetensors, RoundTripSharded) {
    TempDir dir;
    std::vector<TestTensor> ts = ManyTensors(40);
    uint64_t total = 0;
    for (const TestTensor &t : ts) total += t.bytes.size();
    st_writer *w = st_writer_new();
    AddAll(w, ts);
    mt_error err = {};
    const size_t shard = 1024;
    ASSERT_EQ(st_writer_save(w, dir.path().c_str(), shard, &err), MT_OK) << err.msg;
    st_writer_free(w);

    // The index: metadata.total_size and every tensor mapped to an existing shard.
    std::string idx = ReadFile(dir.file("model.safetensors.index.json"));
    json_object *root = json_tokener_parse(idx.c_str());
    ASSERT_NE(root, nullptr) << idx;
    json_object *meta = nullptr, *ts_obj = nullptr, *wm = nullptr;
    ASSERT_TRUE(json_object_object_get_ex(root, "metadata", &meta));
    ASSERT_TRUE(json_object_object_get_ex(meta, "total_size", &ts_obj));
    EXPECT_EQ((uint64_t)json_object_get_int64(ts_obj), total);
    ASSERT_TRUE(json_object_object_get_ex(root, "weight_map", &wm));
    EXPECT_EQ((size_t)json_object_object_length(wm), ts.size());
    std::map<std::string, uint64_t> shard_bytes;
    for (const TestTensor &t : ts) {
        json_object *f = nullptr;
        ASSERT_TRUE(json_object_object_get_ex(wm, t.name.c_str(), &f)) << t.name;
        shard_bytes[json_object_get_string(f)] += t.bytes.size();
    }
    json_object_put(root);
    const size_t nshards = shard_bytes.size();
    EXPECT_GT(nshards, 3u);
    int k = 1;
    for (const auto &kv : shard_bytes) {
        char want[64];
        snprintf(want, sizeof want, "model-%05d-of-%05zu.safetensors", k++, nshards);
        EXPECT_EQ(kv.first, want);
        EXPECT_LE(kv.second, shard);
        EXPECT_TRUE(Exists(dir.file(kv.first)));
    }
    EXPECT_FALSE(Exists(dir.file("model.safetensors")));

    st_archive *ar = nullptr;
    ASSERT_EQ(st_open_dir(dir.path().c_str(), &ar, &err), MT_OK) << err.msg;
    ExpectHolds(ar, ts);
    for (const TestTensor &t : ts) {
        EXPECT_TRUE(Contains(st_find(ar, t.name.c_str())->file, "-of-")) << t.name;
    }
    st_close(ar);
}

TEST(Safetensors, ShardLargerTensorGetsItsOwnShard) {
    TempDir dir;
    std::vector<TestTensor> ts = { Make("small0", MT_F32, { 4 }, 1), Make("huge", MT_F32, { 1000 }, 2),
                                   Make("small1", MT_F32, { 4 }, 3) };
    st_writer *w = st_writer_new();
    AddAll(w, ts);
    mt_error err = {};
    ASSERT_EQ(st_writer_save(w, dir.path().c_str(), 100, &err), MT_OK) << err.msg;
    st_writer_free(w);
    EXPECT_TRUE(Exists(dir.file("model-00003-of-00003.safetensors")));
    st_archive *ar = nullptr;
    ASSERT_EQ(st_open_dir(dir.path().c_str(), &ar, &err), MT_OK) << err.msg;
    ExpectHolds(ar, ts);
    EXPECT_TRUE(Contains(st_find(ar, "huge")->file, "model-00002-of-00003"));
    st_close(ar);
}

TEST(Safetensors, SingleSaveRemovesStaleIndex) {
    TempDir dir;
    std::vector<TestTensor> a = ManyTensors(6), b = { Make("only", MT_F32, { 2 }, 1) };
    mt_error err = {};
    st_writer *w = st_writer_new();
    AddAll(w, a);
    ASSERT_EQ(st_writer_save(w, dir.path().c_str(), 64, &err), MT_OK) << err.msg;
    st_writer_free(w);
    w = st_writer_new();
    AddAll(w, b);
    ASSERT_EQ(st_writer_save(w, dir.path().c_str(), 0, &err), MT_OK) << err.msg;
    st_writer_free(w);
    EXPECT_FALSE(Exists(dir.file("model.safetensors.index.json")));
    st_archive *ar = nullptr;
    ASSERT_EQ(st_open_dir(dir.path().c_str(), &ar, &err), MT_OK) << err.msg;
    ExpectHolds(ar, b);
    st_close(ar);
}

TEST(Safetensors, GetMissingTensorNamesIt) {
    TempDir dir;
    st_writer *w = st_writer_new();
    AddAll(w, SampleTensors());
    mt_error err = {};
    ASSERT_EQ(st_writer_save(w, dir.path().c_str(), 0, &err), MT_OK);
    st_writer_free(w);
    st_archive *ar = nullptr;
    ASSERT_EQ(st_open_dir(dir.path().c_str(), &ar, &err), MT_OK) << err.msg;
    const st_tensor *t = (const st_tensor *)0x1;
    int64_t shape[1] = { 4 };
    EXPECT_EQ(st_get(ar, "lm_head.weight", 1, shape, &t, &err), MT_ERR_NOT_FOUND);
    EXPECT_EQ(t, (const st_tensor *)0x1);
    EXPECT_TRUE(Contains(err.msg, "lm_head.weight is missing")) << err.msg;
    EXPECT_TRUE(Contains(err.msg, dir.path())) << err.msg;
    EXPECT_EQ(st_find(ar, "lm_head.weight"), nullptr);
    st_close(ar);
}

TEST(Safetensors, GetWrongShapeNamesBothShapes) {
    TempDir dir;
    st_writer *w = st_writer_new();
    AddAll(w, SampleTensors());
    mt_error err = {};
    ASSERT_EQ(st_writer_save(w, dir.path().c_str(), 0, &err), MT_OK);
    st_writer_free(w);
    st_archive *ar = nullptr;
    ASSERT_EQ(st_open_dir(dir.path().c_str(), &ar, &err), MT_OK) << err.msg;
    const st_tensor *t = nullptr;
    int64_t wrong[2] = { 3, 2 };
    EXPECT_EQ(st_get(ar, "a/b.weight", 2, wrong, &t, &err), MT_ERR_INVALID);
    EXPECT_EQ(t, nullptr);
    EXPECT_TRUE(Contains(err.msg, "a/b.weight has shape [2, 3], expected [3, 2]")) << err.msg;
    EXPECT_TRUE(Contains(err.msg, "model.safetensors")) << err.msg;
    int64_t flat[1] = { 6 };
    EXPECT_EQ(st_get(ar, "a/b.weight", 1, flat, &t, &err), MT_ERR_INVALID);
    EXPECT_TRUE(Contains(err.msg, "has shape [2, 3], expected [6]")) << err.msg;
    int64_t more[3] = { 2, 3, 1 };
    EXPECT_EQ(st_get(ar, "a/b.weight", 3, more, &t, &err), MT_ERR_INVALID);
    EXPECT_TRUE(Contains(err.msg, "expected [2, 3, 1]")) << err.msg;
    st_close(ar);
}

// Writes a valid two-tensor file and returns its path.
std::string ValidFile(const TempDir &dir) {
    std::vector<TestTensor> ts = { Make("first", MT_F32, { 4, 4 }, 1), Make("last.weight", MT_BF16, { 64 }, 2) };
    st_writer *w = st_writer_new();
    AddAll(w, ts);
    mt_error err = {};
    EXPECT_EQ(st_writer_save(w, dir.path().c_str(), 0, &err), MT_OK) << err.msg;
    st_writer_free(w);
    return dir.file("model.safetensors");
}

TEST(Safetensors, TruncatedFileNamesFileAndTensor) {
    TempDir dir;
    std::string path = ValidFile(dir);
    std::string raw = ReadFile(path);
    WriteFile(path, raw.substr(0, raw.size() - 10));
    std::string msg = OpenDirFails(dir.path(), MT_ERR_IO);
    EXPECT_TRUE(Contains(msg, path)) << msg;
    EXPECT_TRUE(Contains(msg, "last.weight")) << msg;
    EXPECT_TRUE(Contains(msg, "run past")) << msg;
}

TEST(Safetensors, HeaderLengthLargerThanFile) {
    TempDir dir;
    std::string path = ValidFile(dir);
    std::string raw = ReadFile(path);
    uint64_t lie = raw.size();  // 8 + lie > file size
    for (int i = 0; i < 8; i++) raw[i] = (char)(lie >> (8 * i));
    WriteFile(path, raw);
    std::string msg = OpenDirFails(dir.path(), MT_ERR_IO);
    EXPECT_TRUE(Contains(msg, path + ": header length " + std::to_string(lie) + " exceeds the file")) << msg;
    // A huge length must not overflow the check.
    for (int i = 0; i < 8; i++) raw[i] = (char)0xff;
    WriteFile(path, raw);
    msg = OpenDirFails(dir.path(), MT_ERR_IO);
    EXPECT_TRUE(Contains(msg, "header length 18446744073709551615")) << msg;
}

TEST(Safetensors, FileTooShortForHeader) {
    TempDir dir;
    WriteFile(dir.file("model.safetensors"), "abc");
    std::string msg = OpenDirFails(dir.path(), MT_ERR_IO);
    EXPECT_TRUE(Contains(msg, "too short")) << msg;
    WriteFile(dir.file("model.safetensors"), "");
    msg = OpenDirFails(dir.path(), MT_ERR_IO);
    EXPECT_TRUE(Contains(msg, "0 bytes")) << msg;
}

TEST(Safetensors, OffsetsOutOfRange) {
    TempDir dir;
    // Consistent with its shape (250 * 4 bytes) but the data section holds 24 bytes.
    std::string path = dir.file("model.safetensors");
    WriteFile(path, RawFile("{\"w\":{\"dtype\":\"F32\",\"shape\":[250],\"data_offsets\":[0,1000]}}",
                            std::string(24, 'x')));
    std::string msg = OpenDirFails(dir.path(), MT_ERR_IO);
    EXPECT_TRUE(Contains(msg, path + ": tensor w: data_offsets [0, 1000] run past the 24-byte data section"))
        << msg;
    // Offsets near 2^63 must not wrap around.
    WriteFile(path, RawFile("{\"w\":{\"dtype\":\"U8\",\"shape\":[4],"
                            "\"data_offsets\":[9223372036854775800,9223372036854775804]}}",
                            std::string(24, 'x')));
    msg = OpenDirFails(dir.path(), MT_ERR_IO);
    EXPECT_TRUE(Contains(msg, "tensor w: data_offsets")) << msg;
}

TEST(Safetensors, OffsetsInconsistentWithShape) {
    TempDir dir;
    std::string path = dir.file("model.safetensors");
    WriteFile(path, RawFile("{\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,20]}}",
                            std::string(24, 'x')));
    std::string msg = OpenDirFails(dir.path(), MT_ERR_INVALID);
    EXPECT_TRUE(Contains(msg, path + ": tensor w: data_offsets [0, 20] hold 20 bytes but F32 [2, 3] needs 24"))
        << msg;
    WriteFile(path, RawFile("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[16,8]}}",
                            std::string(24, 'x')));
    msg = OpenDirFails(dir.path(), MT_ERR_INVALID);
    EXPECT_TRUE(Contains(msg, "tensor w: data_offsets [16, 8] end before they begin")) << msg;
}

TEST(Safetensors, OverlappingTensors) {
    TempDir dir;
    WriteFile(dir.file("model.safetensors"),
              RawFile("{\"a\":{\"dtype\":\"F32\",\"shape\":[6],\"data_offsets\":[0,24]},"
                      "\"b\":{\"dtype\":\"F32\",\"shape\":[6],\"data_offsets\":[16,40]}}",
                      std::string(40, 'x')));
    std::string msg = OpenDirFails(dir.path(), MT_ERR_INVALID);
    EXPECT_TRUE(Contains(msg, "tensors a and b overlap")) << msg;
}

TEST(Safetensors, BadHeaders) {
    TempDir dir;
    std::string path = dir.file("model.safetensors");
    struct {
        std::string header;
        mt_status st;
        const char *needle;
    } cases[] = {
        { "{not json at all", MT_ERR_INVALID, ": header: not valid JSON" },
        { "{\"w\":{}} junk", MT_ERR_INVALID, "trailing data" },
        { "[1,2,3]", MT_ERR_INVALID, "header is a list, expected a JSON object" },
        { "{\"w\":3}", MT_ERR_INVALID, "tensor w: header entry is an integer" },
        { "{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}", MT_ERR_INVALID, "tensor w: dtype is null" },
        { "{\"w\":{\"dtype\":\"F8_E5M2\",\"shape\":[1],\"data_offsets\":[0,1]}}", MT_ERR_UNSUPPORTED,
          "tensor w: dtype F8_E5M2 is not supported" },
        { "{\"w\":{\"dtype\":\"F32\",\"shape\":\"1\",\"data_offsets\":[0,4]}}", MT_ERR_INVALID,
          "tensor w: shape is a string" },
        { "{\"w\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}",
          MT_ERR_UNSUPPORTED, "tensor w: 9 dims" },
        { "{\"w\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", MT_ERR_INVALID,
          "tensor w: shape[0] is not a non-negative integer" },
        { "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", MT_ERR_INVALID,
          "tensor w: data_offsets must be two non-negative integers" },
        { "{\"w\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,4]}}",
          MT_ERR_INVALID, "tensor w: shape is too large" },
        { "{\"__metadata__\":[1]}", MT_ERR_INVALID, "__metadata__ is a list" },
    };
    for (const auto &c : cases) {
        std::string h = c.header;
        while (h.size() % 8) h += ' ';
        WriteFile(path, RawFile(h, std::string(8, 'x')));
        std::string msg = OpenFileFails(path, c.st);
        EXPECT_TRUE(Contains(msg, c.needle)) << "header: " << c.header << "\nmessage: " << msg;
        EXPECT_TRUE(Contains(msg, path)) << msg;
    }
}

TEST(Safetensors, MetadataIsSkipped) {
    TempDir dir;
    std::string path = dir.file("model.safetensors");
    WriteFile(path, RawFile("{\"__metadata__\":{\"format\":\"pt\"},"
                            "\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}   ",
                            std::string(8, 'x')));
    st_archive *ar = nullptr;
    mt_error err = {};
    ASSERT_EQ(st_open_file(path.c_str(), &ar, &err), MT_OK) << err.msg;
    EXPECT_EQ(st_count(ar), 1u);
    EXPECT_NE(st_find(ar, "w"), nullptr);
    st_close(ar);
}

TEST(Safetensors, EmptyDirectoryAndMissingDirectory) {
    TempDir dir;
    std::string msg = OpenDirFails(dir.path(), MT_ERR_NOT_FOUND);
    EXPECT_TRUE(Contains(msg, dir.path() + ": holds neither model.safetensors nor")) << msg;
    msg = OpenDirFails(dir.file("nope"), MT_ERR_NOT_FOUND);
    EXPECT_TRUE(Contains(msg, "nope: no such directory")) << msg;
}

// A sharded checkpoint of ManyTensors(12): 3 shards of several tensors each; returns the index.
std::string ShardedCheckpoint(const TempDir &dir) {
    st_writer *w = st_writer_new();
    AddAll(w, ManyTensors(12));
    mt_error err = {};
    EXPECT_EQ(st_writer_save(w, dir.path().c_str(), 600, &err), MT_OK) << err.msg;
    EXPECT_TRUE(Exists(dir.file("model-00003-of-00003.safetensors")));
    st_writer_free(w);
    return ReadFile(dir.file("model.safetensors.index.json"));
}

TEST(Safetensors, IndexNamesMissingShardFile) {
    TempDir dir;
    ShardedCheckpoint(dir);
    // Remove the second shard.
    std::vector<std::string> shards;
    for (int i = 1; i <= 99; i++) {
        for (int n = 1; n <= 99; n++) {
            char fn[64];
            snprintf(fn, sizeof fn, "model-%05d-of-%05d.safetensors", i, n);
            if (Exists(dir.file(fn))) shards.push_back(fn);
        }
    }
    ASSERT_GE(shards.size(), 2u);
    ASSERT_EQ(unlink(dir.file(shards[1]).c_str()), 0);
    std::string msg = OpenDirFails(dir.path(), MT_ERR_NOT_FOUND);
    EXPECT_TRUE(Contains(msg, dir.file(shards[1]) + ": cannot open")) << msg;
    EXPECT_TRUE(Contains(msg, "listed in model.safetensors.index.json")) << msg;
}

TEST(Safetensors, IndexTensorMissingFromShard) {
    TempDir dir;
    std::string idx = ShardedCheckpoint(dir);
    // Point layers.0.w at the last shard, which does not hold it.
    json_object *root = json_tokener_parse(idx.c_str());
    ASSERT_NE(root, nullptr);
    json_object *wm = nullptr, *f = nullptr;
    ASSERT_TRUE(json_object_object_get_ex(root, "weight_map", &wm));
    ASSERT_TRUE(json_object_object_get_ex(wm, "layers.11.w", &f));
    std::string last = json_object_get_string(f);
    ASSERT_TRUE(json_object_object_get_ex(wm, "layers.0.w", &f));
    std::string first = json_object_get_string(f);
    ASSERT_NE(first, last);
    json_object_object_add(wm, "layers.0.w", json_object_new_string(last.c_str()));
    WriteFile(dir.file("model.safetensors.index.json"), json_object_to_json_string(root));
    std::string msg = OpenDirFails(dir.path(), MT_ERR_NOT_FOUND);
    EXPECT_TRUE(Contains(msg, "tensor layers.0.w is listed in shard " + last + " but that shard does not hold it"))
        << msg;
    EXPECT_TRUE(Contains(msg, "found in")) << msg;

    json_object_object_add(wm, "layers.0.w", json_object_new_string(first.c_str()));
    // A tensor that no shard holds.
    json_object_object_add(wm, "ghost.weight", json_object_new_string(last.c_str()));
    WriteFile(dir.file("model.safetensors.index.json"), json_object_to_json_string(root));
    json_object_put(root);
    msg = OpenDirFails(dir.path(), MT_ERR_NOT_FOUND);
    EXPECT_TRUE(Contains(msg, "tensor ghost.weight is listed in shard " + last)) << msg;
    EXPECT_FALSE(Contains(msg, "found in")) << msg;
}

TEST(Safetensors, DuplicateTensorAcrossShards) {
    TempDir dir;
    std::vector<TestTensor> a = { Make("x", MT_F32, { 2 }, 1), Make("dup", MT_F32, { 2 }, 2) };
    std::vector<TestTensor> b = { Make("dup", MT_F32, { 2 }, 3), Make("y", MT_F32, { 2 }, 4) };
    TempDir da, db;
    for (auto *p : { &a, &b }) {
        st_writer *w = st_writer_new();
        AddAll(w, *p);
        mt_error err = {};
        ASSERT_EQ(st_writer_save(w, (p == &a ? da : db).path().c_str(), 0, &err), MT_OK);
        st_writer_free(w);
    }
    WriteFile(dir.file("s1.safetensors"), ReadFile(da.file("model.safetensors")));
    WriteFile(dir.file("s2.safetensors"), ReadFile(db.file("model.safetensors")));
    WriteFile(dir.file("model.safetensors.index.json"),
              "{\"metadata\": {}, \"weight_map\": {\"x\": \"s1.safetensors\", \"dup\": \"s1.safetensors\","
              " \"y\": \"s2.safetensors\"}}");
    std::string msg = OpenDirFails(dir.path(), MT_ERR_INVALID);
    EXPECT_TRUE(Contains(msg, "tensor dup appears twice")) << msg;
    EXPECT_TRUE(Contains(msg, "s1.safetensors") && Contains(msg, "s2.safetensors")) << msg;
}

TEST(Safetensors, BadIndexFiles) {
    TempDir dir;
    std::string path = dir.file("model.safetensors.index.json");
    WriteFile(path, "{\"weight_map\": ");
    std::string msg = OpenDirFails(dir.path(), MT_ERR_INVALID);
    EXPECT_TRUE(Contains(msg, path + ": not valid JSON")) << msg;
    WriteFile(path, "{\"metadata\": {}}");
    msg = OpenDirFails(dir.path(), MT_ERR_INVALID);
    EXPECT_TRUE(Contains(msg, "weight_map is missing")) << msg;
    WriteFile(path, "{\"weight_map\": {\"w\": 3}}");
    msg = OpenDirFails(dir.path(), MT_ERR_INVALID);
    EXPECT_TRUE(Contains(msg, "weight_map[\"w\"] is an integer")) << msg;
    WriteFile(path, "{\"weight_map\": {\"w\": \"../etc/model.safetensors\"}}");
    msg = OpenDirFails(dir.path(), MT_ERR_INVALID);
    EXPECT_TRUE(Contains(msg, "is not a file name in the checkpoint directory")) << msg;
}

TEST(Safetensors, WriterRejectsBadTensors) {
    st_writer *w = st_writer_new();
    mt_error err = {};
    float data[8] = { 0 };
    int64_t shape[ST_MAX_DIMS + 1] = { 2 };
    for (int i = 1; i <= ST_MAX_DIMS; i++) shape[i] = 1;
    ASSERT_EQ(st_writer_add(w, "w", MT_F32, 1, shape, data, &err), MT_OK);
    EXPECT_EQ(st_writer_add(w, "w", MT_F32, 1, shape, data, &err), MT_ERR_INVALID);
    EXPECT_TRUE(Contains(err.msg, "tensor w added twice")) << err.msg;
    EXPECT_EQ(st_writer_add(w, "deep", MT_F32, ST_MAX_DIMS + 1, shape, data, &err), MT_ERR_INVALID);
    EXPECT_TRUE(Contains(err.msg, "deep: ndim " + std::to_string(ST_MAX_DIMS + 1))) << err.msg;
    EXPECT_EQ(st_writer_add(w, "five", MT_F32, 5, shape, data, &err), MT_OK) << err.msg;  // 5-D is fine
    int64_t neg[1] = { -2 };
    EXPECT_EQ(st_writer_add(w, "neg", MT_F32, 1, neg, data, &err), MT_ERR_INVALID);
    EXPECT_TRUE(Contains(err.msg, "neg: bad shape")) << err.msg;
    EXPECT_EQ(st_writer_add(w, "", MT_F32, 1, shape, data, &err), MT_ERR_INVALID);
    EXPECT_EQ(st_writer_add(w, "__metadata__", MT_F32, 1, shape, data, &err), MT_ERR_INVALID);
    EXPECT_EQ(st_writer_add(w, "nodata", MT_F32, 1, shape, nullptr, &err), MT_ERR_INVALID);
    EXPECT_EQ(st_writer_add(w, "dt", (mt_dtype)42, 1, shape, data, &err), MT_ERR_INVALID);
    EXPECT_EQ(st_writer_count(w), 2u);
    st_writer_free(w);
    st_writer_free(nullptr);
}

TEST(Safetensors, WriterManyNames) {
    // The duplicate check is a hash set: thousands of names stay fast and exact.
    st_writer *w = st_writer_new();
    mt_error err = {};
    float v = 1.f;
    int64_t shape[1] = { 1 };
    for (int i = 0; i < 20000; i++)
        ASSERT_EQ(st_writer_add(w, ("t" + std::to_string(i)).c_str(), MT_F32, 1, shape, &v, &err), MT_OK);
    EXPECT_EQ(st_writer_add(w, "t12345", MT_F32, 1, shape, &v, &err), MT_ERR_INVALID);
    st_writer_free(w);
}

TEST(Safetensors, SaveIntoUnwritablePlace) {
    TempDir dir;
    WriteFile(dir.file("plain"), "x");
    st_writer *w = st_writer_new();
    AddAll(w, ManyTensors(3));
    mt_error err = {};
    std::string bad = dir.file("plain/sub");
    EXPECT_EQ(st_writer_save(w, bad.c_str(), 0, &err), MT_ERR_IO);
    EXPECT_TRUE(Contains(err.msg, bad)) << err.msg;
    st_writer_free(w);
}

// Deferred tensors: pieces arrive in order, multi-chunk tensors work, a failing fill aborts the
// save and removes what was written.
struct FillLog {
    std::vector<std::pair<uint64_t, size_t>> calls;
    bool fail_second_tensor = false;
};

mt_status FillPattern(void *user, size_t index, uint64_t offset, void *dst, size_t nbytes, mt_error *err) {
    FillLog *log = (FillLog *)user;
    if (log->fail_second_tensor && index == 1) return mt_errorf(err, MT_ERR_IO, "fill failed on purpose");
    if (index == 0) log->calls.push_back({ offset, nbytes });
    uint32_t *p = (uint32_t *)dst;
    for (size_t i = 0; i < nbytes / 4; i++) p[i] = (uint32_t)(offset / 4 + i) ^ (uint32_t)(index * 0x9e3779b9u);
    return MT_OK;
}

TEST(Safetensors, DeferredTensorsStreamInChunks) {
    TempDir dir;
    st_writer *w = st_writer_new();
    mt_error err = {};
    FillLog log;
    const int64_t big = (int64_t)(ST_WRITER_CHUNK / 4) + 3;  // two chunks, the second 12 bytes
    int64_t s0[1] = { big }, s1[2] = { 3, 5 };
    ASSERT_EQ(st_writer_add_deferred(w, "big", MT_F32, 1, s0, FillPattern, &log, &err), MT_OK);
    ASSERT_EQ(st_writer_add_deferred(w, "small", MT_I32, 2, s1, FillPattern, &log, &err), MT_OK);
    float one = 1.f;
    int64_t s2[1] = { 1 };
    ASSERT_EQ(st_writer_add(w, "copied", MT_F32, 1, s2, &one, &err), MT_OK);
    EXPECT_EQ(st_writer_add_deferred(w, "nofill", MT_F32, 1, s2, nullptr, nullptr, &err), MT_ERR_INVALID);
    ASSERT_EQ(st_writer_save(w, dir.path().c_str(), 0, &err), MT_OK) << err.msg;
    ASSERT_EQ(log.calls.size(), 2u);
    EXPECT_EQ(log.calls[0].first, 0u);
    EXPECT_EQ(log.calls[0].second, ST_WRITER_CHUNK);
    EXPECT_EQ(log.calls[1].first, ST_WRITER_CHUNK);
    EXPECT_EQ(log.calls[1].second, 12u);

    st_archive *ar = nullptr;
    ASSERT_EQ(st_open_dir(dir.path().c_str(), &ar, &err), MT_OK) << err.msg;
    const st_tensor *t = st_find(ar, "big");
    ASSERT_NE(t, nullptr);
    const uint32_t *p = (const uint32_t *)t->data;
    bool ok = true;
    for (int64_t i = 0; i < big && ok; i++) ok = p[i] == (uint32_t)i;
    EXPECT_TRUE(ok);
    const uint32_t *q = (const uint32_t *)st_find(ar, "small")->data;
    for (int i = 0; i < 15; i++) EXPECT_EQ(q[i], (uint32_t)i ^ 0x9e3779b9u);
    st_close(ar);

    // A failing fill: the save fails with its message and leaves no checkpoint behind.
    TempDir dir2;
    log.fail_second_tensor = true;
    EXPECT_EQ(st_writer_save(w, dir2.path().c_str(), 0, &err), MT_ERR_IO);
    EXPECT_TRUE(Contains(err.msg, "fill failed on purpose")) << err.msg;
    EXPECT_FALSE(Exists(dir2.file("model.safetensors")));
    EXPECT_EQ(st_writer_save(w, dir2.path().c_str(), 100, &err), MT_ERR_IO);
    EXPECT_FALSE(Exists(dir2.file("model-00001-of-00003.safetensors")));
    EXPECT_FALSE(Exists(dir2.file("model.safetensors.index.json")));
    st_writer_free(w);
}

// ---------------------------------------------------------------------------------------------
// The manifest through the writer and the reader (what tools/mkckpt does).

struct ManifestBuild {
    st_writer *w;
    mt_error err;
    int failures;
    std::vector<glm_tensor_spec> specs;
};

void AddSpec(const glm_tensor_spec *s, void *user) {
    ManifestBuild *b = (ManifestBuild *)user;
    b->specs.push_back(*s);
    size_t n = 1;
    for (int i = 0; i < s->ndim; i++) n *= (size_t)s->shape[i];
    std::vector<float> f(n);
    for (size_t i = 0; i < n; i++) f[i] = s->mean + s->std * (float)((int)(i % 7) - 3) / 3.f;
    std::vector<uint16_t> h(n);
    const void *data = f.data();
    if (s->dtype == MT_BF16) {
        for (size_t i = 0; i < n; i++) h[i] = mt_f32_to_bf16(f[i]);
        data = h.data();
    }
    if (st_writer_add(b->w, s->name, s->dtype, s->ndim, s->shape, data, &b->err) != MT_OK) b->failures++;
}

void CheckManifestCheckpoint(const glm_config &cfg, const std::string &dir,
                             const std::vector<glm_tensor_spec> &specs, bool any_dtype) {
    st_archive *ar = nullptr;
    mt_error err = {};
    ASSERT_EQ(st_open_dir(dir.c_str(), &ar, &err), MT_OK) << err.msg;
    EXPECT_EQ(st_count(ar), specs.size());
    uint64_t bytes = 0;
    for (const glm_tensor_spec &s : specs) {
        const st_tensor *t = nullptr;
        ASSERT_EQ(st_get(ar, s.name, s.ndim, s.shape, &t, &err), MT_OK) << err.msg;
        if (!any_dtype) {
            EXPECT_EQ(t->dtype, s.dtype) << s.name;
        } else if (s.dtype == MT_F32) {
            EXPECT_EQ(t->dtype, MT_F32) << s.name;
        }
        bytes += t->nbytes;
    }
    if (!any_dtype) {
        EXPECT_EQ(bytes, glm_manifest_bytes(&cfg));
    }
    st_close(ar);
}

TEST(Manifest, TinyPresetWritesAndLoadsEveryTensor) {
    glm_config cfg;
    mt_error err = {};
    ASSERT_EQ(glm_config_preset("tiny", &cfg, &err), MT_OK) << err.msg;
    for (size_t shard : { (size_t)0, (size_t)256 << 10 }) {
        TempDir dir;
        ManifestBuild b = { st_writer_new(), {}, 0, {} };
        int n = glm_manifest_foreach(&cfg, AddSpec, &b);
        ASSERT_EQ(b.failures, 0) << b.err.msg;
        ASSERT_EQ((size_t)n, b.specs.size());
        // Every layer kind of the tiny preset is present.
        auto has = [&](const char *name) {
            for (const auto &s : b.specs)
                if (!strcmp(s.name, name)) return true;
            return false;
        };
        EXPECT_TRUE(has("lm_head.weight"));
        EXPECT_TRUE(has("model.language_model.layers.0.self_attn.A_log"));
        EXPECT_TRUE(has("model.language_model.layers.1.self_attn.indexer.wq_b.weight"));
        EXPECT_FALSE(has("model.language_model.layers.2.self_attn.indexer.wq_b.weight"));  // shared
        EXPECT_TRUE(has("model.language_model.layers.2.self_attn.kv_b_proj.weight"));
        EXPECT_TRUE(has("model.language_model.layers.0.mlp.gate_proj.weight"));
        EXPECT_TRUE(has("model.language_model.layers.3.mlp.experts.15.down_proj.weight"));
        EXPECT_TRUE(has("model.language_model.layers.3.mlp.gate.e_score_correction_bias"));
        ASSERT_EQ(st_writer_save(b.w, dir.path().c_str(), shard, &err), MT_OK) << err.msg;
        st_writer_free(b.w);
        EXPECT_EQ(Exists(dir.file("model.safetensors.index.json")), shard != 0);
        CheckManifestCheckpoint(cfg, dir.path(), b.specs, false);
    }
}

TEST(Manifest, TiedEmbeddingsHaveNoLmHead) {
    glm_config cfg;
    mt_error err = {};
    ASSERT_EQ(glm_config_preset("tiny", &cfg, &err), MT_OK);
    cfg.tie_word_embeddings = true;
    ManifestBuild b = { st_writer_new(), {}, 0, {} };
    glm_manifest_foreach(&cfg, AddSpec, &b);
    for (const auto &s : b.specs) EXPECT_STRNE(s.name, "lm_head.weight");
    st_writer_free(b.w);
}

// ---------------------------------------------------------------------------------------------
// tools/mkckpt end to end (a data dependency of this test: runfiles path tools/mkckpt).

std::vector<glm_tensor_spec> Specs(const glm_config &cfg) {
    std::vector<glm_tensor_spec> v;
    glm_manifest_foreach(
        &cfg, [](const glm_tensor_spec *s, void *u) { ((std::vector<glm_tensor_spec> *)u)->push_back(*s); },
        &v);
    return v;
}

TEST(Mkckpt, TinyPresetEndToEnd) {
    std::string bin = MkckptPath();
    if (bin.empty()) GTEST_SKIP() << "tools/mkckpt not in runfiles";
    TempDir dir;
    std::string out = dir.file("ck/tiny");
    std::string cmd = bin + " --preset tiny --seed 7 --shard-mb 1 --out " + out + " 2>/dev/null";
    ASSERT_EQ(system(cmd.c_str()), 0) << cmd;

    glm_config cfg, preset;
    mt_error err = {};
    ASSERT_EQ(glm_config_load((out + "/config.json").c_str(), &cfg, &err), MT_OK) << err.msg;
    ASSERT_EQ(glm_config_preset("tiny", &preset, &err), MT_OK);
    EXPECT_EQ(memcmp(&cfg, &preset, sizeof cfg), 0);
    std::vector<glm_tensor_spec> specs = Specs(cfg);
    CheckManifestCheckpoint(cfg, out, specs, false);

    // Values follow the manifest's mean/std.
    st_archive *ar = nullptr;
    ASSERT_EQ(st_open_dir(out.c_str(), &ar, &err), MT_OK) << err.msg;
    const st_tensor *emb = st_find(ar, "model.language_model.embed_tokens.weight");
    ASSERT_NE(emb, nullptr);
    size_t n = emb->nbytes / 2;
    std::vector<float> f(n);
    mt_to_f32(f.data(), emb->data, emb->dtype, n);
    double s = 0, s2 = 0;
    size_t nonfinite = 0;
    for (float x : f) {
        nonfinite += !std::isfinite(x);
        s += x;
        s2 += (double)x * x;
    }
    EXPECT_EQ(nonfinite, 0u);
    double mean = s / n, sd = sqrt(s2 / n - mean * mean);
    EXPECT_NEAR(mean, 0.0, 0.05);
    EXPECT_NEAR(sd, 1.0, 0.05);
    const st_tensor *nw = st_find(ar, "model.language_model.norm.weight");
    std::vector<float> g(nw->nbytes / 2);
    mt_to_f32(g.data(), nw->data, nw->dtype, g.size());
    double gm = 0;
    for (float x : g) gm += x;
    EXPECT_NEAR(gm / g.size(), 1.0, 0.1);

    // Same seed: identical bytes; another seed: different bytes; f32 storage: same values.
    std::string again = dir.file("again"), other = dir.file("other"), wide = dir.file("wide");
    ASSERT_EQ(system((bin + " --preset tiny --seed 7 --out " + again + " 2>/dev/null").c_str()), 0);
    ASSERT_EQ(system((bin + " --preset tiny --seed 8 --out " + other + " 2>/dev/null").c_str()), 0);
    ASSERT_EQ(system((bin + " --preset tiny --seed 7 --dtype f32 --out " + wide + " 2>/dev/null").c_str()), 0);
    st_archive *a2 = nullptr, *a3 = nullptr, *a4 = nullptr;
    ASSERT_EQ(st_open_dir(again.c_str(), &a2, &err), MT_OK) << err.msg;
    ASSERT_EQ(st_open_dir(other.c_str(), &a3, &err), MT_OK) << err.msg;
    ASSERT_EQ(st_open_dir(wide.c_str(), &a4, &err), MT_OK) << err.msg;
    CheckManifestCheckpoint(cfg, wide, specs, true);
    for (const glm_tensor_spec &sp : specs) {
        const st_tensor *x = st_find(ar, sp.name), *y = st_find(a2, sp.name), *z = st_find(a3, sp.name),
                        *w = st_find(a4, sp.name);
        ASSERT_TRUE(x && y && z && w) << sp.name;
        ASSERT_EQ(x->nbytes, y->nbytes);
        EXPECT_EQ(memcmp(x->data, y->data, x->nbytes), 0) << sp.name;
        if (x->nbytes > 8) {
            EXPECT_NE(memcmp(x->data, z->data, x->nbytes), 0) << sp.name;
        }
        EXPECT_EQ(w->dtype, MT_F32);
        if (sp.dtype == MT_BF16) {  // bf16 of the f32 value == the bf16 checkpoint's value
            const float *wf = (const float *)w->data;
            const uint16_t *xb = (const uint16_t *)x->data;
            size_t bad = 0;
            for (size_t i = 0; i < x->nbytes / 2; i++) bad += mt_f32_to_bf16(wf[i]) != xb[i];
            EXPECT_EQ(bad, 0u) << sp.name;
        }
    }
    st_close(ar);
    st_close(a2);
    st_close(a3);
    st_close(a4);
}

TEST(Mkckpt, LayersAndConfigOptions) {
    std::string bin = MkckptPath();
    if (bin.empty()) GTEST_SKIP() << "tools/mkckpt not in runfiles";
    TempDir dir;
    // --config + --layers: the first layers of the tiny config, re-saved and loadable.
    glm_config tiny;
    mt_error err = {};
    ASSERT_EQ(glm_config_preset("tiny", &tiny, &err), MT_OK);
    std::string cfg_path = dir.file("tiny.json");
    ASSERT_EQ(glm_config_save(&tiny, cfg_path.c_str(), &err), MT_OK);
    std::string out = dir.file("two");
    ASSERT_EQ(system((bin + " --config " + cfg_path + " --layers 2 --out " + out + " 2>/dev/null").c_str()), 0);
    glm_config two;
    ASSERT_EQ(glm_config_load((out + "/config.json").c_str(), &two, &err), MT_OK) << err.msg;
    EXPECT_EQ(two.num_hidden_layers, 2);
    EXPECT_EQ(two.layer_types[1], GLM_MIXER_DSA);
    EXPECT_EQ(two.mlp_layer_types[1], GLM_MLP_SPARSE);
    CheckManifestCheckpoint(two, out, Specs(two), false);

    // --layers past the config's end: the extra layers follow the default pattern (layer 7 DSA).
    std::string eight = dir.file("eight");
    ASSERT_EQ(system((bin + " --preset tiny --layers 8 --out " + eight + " 2>/dev/null").c_str()), 0);
    glm_config e8;
    ASSERT_EQ(glm_config_load((eight + "/config.json").c_str(), &e8, &err), MT_OK) << err.msg;
    EXPECT_EQ(e8.num_hidden_layers, 8);
    EXPECT_EQ(e8.layer_types[2], GLM_MIXER_DSA);
    EXPECT_EQ(e8.indexer_types[2], GLM_INDEXER_SHARED);
    EXPECT_EQ(e8.layer_types[7], GLM_MIXER_DSA);
    EXPECT_EQ(e8.layer_types[6], GLM_MIXER_KDA);
    CheckManifestCheckpoint(e8, eight, Specs(e8), false);

    // Bad usage exits non-zero and writes nothing.
    EXPECT_NE(system((bin + " --preset nope --out " + dir.file("x") + " 2>/dev/null").c_str()), 0);
    EXPECT_NE(system((bin + " --preset tiny --dtype f8 --out " + dir.file("y") + " 2>/dev/null").c_str()), 0);
    EXPECT_NE(system((bin + " --preset tiny --layers 0 --out " + dir.file("z") + " 2>/dev/null").c_str()), 0);
    EXPECT_NE(system((bin + " --preset tiny 2>/dev/null").c_str()), 0);
    EXPECT_FALSE(Exists(dir.file("x")));
    EXPECT_FALSE(Exists(dir.file("y")));
    EXPECT_FALSE(Exists(dir.file("z")));
}

// ------------------------------------------------------------------------------------------
// Block-scaled FP8 (docs/MODEL.md, "FP8 checkpoints")

// Writes w [rows, cols] as F8_E4M3 codes with its scale tensor (named and shaped as given) into
// dir/model.safetensors, beside a bf16 tensor "plain" [2, 2]; opens it.
st_archive *Fp8Archive(const TempDir &dir, const std::vector<uint8_t> &codes, std::vector<int64_t> shape,
                       const std::vector<float> &scale, std::vector<int64_t> sshape,
                       const char *sname = "w.weight_scale_inv", mt_dtype sdt = MT_F32) {
    st_writer *w = st_writer_new();
    mt_error err = {};
    EXPECT_EQ(st_writer_add(w, "w.weight", MT_F8E4M3, (int)shape.size(), shape.data(), codes.data(), &err), MT_OK)
        << err.msg;
    if (sname) {
        std::vector<uint16_t> half(scale.size());
        for (size_t i = 0; i < scale.size(); i++) half[i] = mt_f32_to_bf16(scale[i]);
        const void *data = sdt == MT_F32 ? (const void *)scale.data() : (const void *)half.data();
        EXPECT_EQ(st_writer_add(w, sname, sdt, (int)sshape.size(), sshape.data(), data, &err), MT_OK) << err.msg;
    }
    const int64_t ps[2] = { 2, 2 };
    const uint16_t pv[4] = { 0x3f80, 0x4000, 0x4040, 0x4080 };
    EXPECT_EQ(st_writer_add(w, "plain", MT_BF16, 2, ps, pv, &err), MT_OK);
    EXPECT_EQ(st_writer_save(w, dir.path().c_str(), 0, &err), MT_OK) << err.msg;
    st_writer_free(w);
    st_archive *ar = nullptr;
    EXPECT_EQ(st_open_dir(dir.path().c_str(), &ar, &err), MT_OK) << err.msg;
    return ar;
}

// Codes that cover the range (no NaN), deterministic.
std::vector<uint8_t> Codes(size_t n) {
    std::vector<uint8_t> c(n);
    for (size_t i = 0; i < n; i++) {
        c[i] = (uint8_t)((i * 73 + 11) & 0xff);
        if ((c[i] & 0x7f) == 0x7f) c[i] ^= 0x01;
    }
    return c;
}

TEST(SafetensorsFp8, DequantUsesEachBlocksScaleIncludingPartialBlocks) {
    TempDir dir;
    const int64_t R = 5, C = 7, bm = 2, bn = 3;  // blocks of 2 x 3: the last row and column blocks partial
    std::vector<float> scale;
    for (int i = 0; i < 3 * 3; i++) scale.push_back(0.5f + 0.37f * i);
    const std::vector<uint8_t> codes = Codes(R * C);
    st_archive *ar = Fp8Archive(dir, codes, { R, C }, scale, { 3, 3 });
    ASSERT_NE(ar, nullptr);
    mt_error err = {};
    const st_tensor *t = nullptr, *sc = nullptr;
    const int64_t shape[2] = { R, C };
    ASSERT_EQ(st_get_weight(ar, "w.weight", 2, shape, bm, bn, &t, &sc, &err), MT_OK) << err.msg;
    ASSERT_NE(sc, nullptr);
    EXPECT_EQ(t->dtype, MT_F8E4M3);
    std::vector<float> f(R * C);
    ASSERT_EQ(st_dequant_fp8(t, sc, bm, bn, 0, R, 0, C, MT_F32, f.data(), &err), MT_OK) << err.msg;
    for (int64_t i = 0; i < R; i++)
        for (int64_t j = 0; j < C; j++)
            EXPECT_EQ(f[i * C + j], mt_f8e4m3_to_f32(codes[i * C + j]) * scale[(i / bm) * 3 + j / bn]) << i << "," << j;
    // bf16: the fp32 product rounded once
    std::vector<uint16_t> h(R * C);
    ASSERT_EQ(st_dequant_fp8(t, sc, bm, bn, 0, R, 0, C, MT_BF16, h.data(), &err), MT_OK);
    for (size_t k = 0; k < h.size(); k++) EXPECT_EQ(h[k], mt_f32_to_bf16(f[k])) << k;
    // any rectangle (a tensor-parallel shard cutting through blocks) is the same part of the whole
    for (int64_t r0 : { 0, 1, 3 })
        for (int64_t c0 : { 0, 2, 4 }) {
            const int64_t nr = R - r0 - (r0 == 1), nc = C - c0 - (c0 == 2);
            std::vector<float> part(nr * nc);
            ASSERT_EQ(st_dequant_fp8(t, sc, bm, bn, r0, nr, c0, nc, MT_F32, part.data(), &err), MT_OK) << err.msg;
            for (int64_t i = 0; i < nr; i++)
                for (int64_t j = 0; j < nc; j++) EXPECT_EQ(part[i * nc + j], f[(r0 + i) * C + c0 + j]);
        }
    float one;
    EXPECT_EQ(st_dequant_fp8(t, sc, bm, bn, 4, 2, 0, 1, MT_F32, &one, &err), MT_ERR_INVALID);
    EXPECT_TRUE(Contains(err.msg, "outside [5, 7]")) << err.msg;
    EXPECT_EQ(st_dequant_fp8(t, sc, bm, bn, 0, 1, 0, 1, MT_I32, &one, &err), MT_ERR_INVALID);
    // a float tensor comes back as st_get gives it, without scales
    const int64_t ps[2] = { 2, 2 };
    sc = (const st_tensor *)0x1;
    ASSERT_EQ(st_get_weight(ar, "plain", 2, ps, bm, bn, &t, &sc, &err), MT_OK) << err.msg;
    EXPECT_EQ(sc, nullptr);
    EXPECT_EQ(t->dtype, MT_BF16);
    st_close(ar);
}

TEST(SafetensorsFp8, ScalesMayBeBf16) {
    TempDir dir;
    st_archive *ar = Fp8Archive(dir, Codes(4 * 4), { 4, 4 }, { 0.25f, 3.f }, { 1, 2 }, "w.weight_scale_inv", MT_BF16);
    mt_error err = {};
    const st_tensor *t, *sc;
    const int64_t shape[2] = { 4, 4 };
    ASSERT_EQ(st_get_weight(ar, "w.weight", 2, shape, 4, 2, &t, &sc, &err), MT_OK) << err.msg;
    float f[16];
    ASSERT_EQ(st_dequant_fp8(t, sc, 4, 2, 0, 4, 0, 4, MT_F32, f, &err), MT_OK);
    EXPECT_EQ(f[1], mt_f8e4m3_to_f32(t->nbytes ? ((const uint8_t *)t->data)[1] : 0) * 0.25f);
    EXPECT_EQ(f[2], mt_f8e4m3_to_f32(((const uint8_t *)t->data)[2]) * 3.f);
    st_close(ar);
}

TEST(SafetensorsFp8, BadCheckpointsAreRefusedByName) {
    const int64_t shape[2] = { 5, 7 };
    mt_error err = {};
    const st_tensor *t = (const st_tensor *)0x1, *sc = (const st_tensor *)0x1;
    {  // the scales are missing
        TempDir dir;
        st_archive *ar = Fp8Archive(dir, Codes(35), { 5, 7 }, {}, {}, nullptr);
        EXPECT_EQ(st_get_weight(ar, "w.weight", 2, shape, 2, 3, &t, &sc, &err), MT_ERR_NOT_FOUND);
        EXPECT_TRUE(Contains(err.msg, "tensor w.weight is F8_E4M3 but its block scales w.weight_scale_inv are missing"))
            << err.msg;
        // plain st_get refuses an FP8 tensor, saying why
        EXPECT_EQ(st_get(ar, "w.weight", 2, shape, &t, &err), MT_ERR_INVALID);
        EXPECT_TRUE(Contains(err.msg, "has dtype F8_E4M3, expected F32, F16 or BF16 (only linear weights may be FP8)"))
            << err.msg;
        st_close(ar);
    }
    {  // scales of the wrong shape: blocks of 2 x 3 over [5, 7] need [3, 3]
        TempDir dir;
        st_archive *ar = Fp8Archive(dir, Codes(35), { 5, 7 }, std::vector<float>(6, 1.f), { 2, 3 });
        EXPECT_EQ(st_get_weight(ar, "w.weight", 2, shape, 2, 3, &t, &sc, &err), MT_ERR_INVALID);
        EXPECT_TRUE(Contains(err.msg, "w.weight_scale_inv has shape [2, 3], but w.weight [5, 7] in blocks of 2 x 3 "
                                      "(quantization_config.weight_block_size) needs [3, 3]"))
            << err.msg;
        // the same file read with a block size that fits it is fine
        const st_tensor *t2, *s2;
        EXPECT_EQ(st_get_weight(ar, "w.weight", 2, shape, 4, 3, &t2, &s2, &err), MT_OK) << err.msg;
        // no block size known: the config has no quantization_config
        EXPECT_EQ(st_get_weight(ar, "w.weight", 2, shape, 0, 0, &t, &sc, &err), MT_ERR_INVALID);
        EXPECT_TRUE(Contains(err.msg, "F8_E4M3 but config.json has no FP8 quantization_config")) << err.msg;
        // wrong weight shape is reported as for any tensor
        const int64_t other[2] = { 7, 5 };
        EXPECT_EQ(st_get_weight(ar, "w.weight", 2, other, 2, 3, &t, &sc, &err), MT_ERR_INVALID);
        EXPECT_TRUE(Contains(err.msg, "has shape [5, 7], expected [7, 5]")) << err.msg;
        st_close(ar);
    }
    {  // a scale that is not finite
        TempDir dir;
        std::vector<float> s(9, 1.f);
        s[4] = INFINITY;
        st_archive *ar = Fp8Archive(dir, Codes(35), { 5, 7 }, s, { 3, 3 });
        EXPECT_EQ(st_get_weight(ar, "w.weight", 2, shape, 2, 3, &t, &sc, &err), MT_ERR_INVALID);
        EXPECT_TRUE(Contains(err.msg, "w.weight_scale_inv holds inf at [1, 1]")) << err.msg;
        st_close(ar);
    }
    {  // an FP8 NaN inside the weight is named where it is
        TempDir dir;
        std::vector<uint8_t> codes = Codes(35);
        codes[2 * 7 + 5] = 0xff;
        st_archive *ar = Fp8Archive(dir, codes, { 5, 7 }, std::vector<float>(9, 1.f), { 3, 3 });
        const st_tensor *w, *ws;
        ASSERT_EQ(st_get_weight(ar, "w.weight", 2, shape, 2, 3, &w, &ws, &err), MT_OK) << err.msg;
        std::vector<float> f(35);
        EXPECT_EQ(st_dequant_fp8(w, ws, 2, 3, 0, 5, 0, 7, MT_F32, f.data(), &err), MT_ERR_INVALID);
        EXPECT_TRUE(Contains(err.msg, "holds an FP8 NaN (0xff) at [2, 5]")) << err.msg;
        EXPECT_EQ(st_dequant_fp8(w, ws, 2, 3, 0, 2, 0, 7, MT_F32, f.data(), &err), MT_OK) << "rows without it";
        st_close(ar);
    }
    EXPECT_EQ(t, (const st_tensor *)0x1);  // failed calls leave the outputs alone
    EXPECT_EQ(sc, (const st_tensor *)0x1);
}

// mkckpt --dtype fp8 from a config with a quantization_config: the linear weights not in
// modules_to_not_convert are F8_E4M3 with scales, the rest as in a bf16 checkpoint, and the
// values are the bf16 checkpoint's values to within fp8 rounding.
TEST(Mkckpt, Fp8CheckpointKeepsTheQuantizationConfig) {
    std::string bin = MkckptPath();
    if (bin.empty()) GTEST_SKIP() << "tools/mkckpt not in runfiles";
    TempDir dir;
    glm_config tiny;
    mt_error err = {};
    ASSERT_EQ(glm_config_preset("tiny", &tiny, &err), MT_OK);
    tiny.quant.fp8 = true;
    tiny.quant.block_rows = 16;
    tiny.quant.block_cols = 32;
    tiny.quant.n_skip = 1;
    memcpy(tiny.quant.skip, "mlp.gate", sizeof "mlp.gate");
    const std::string cfg_path = dir.file("q.json"), fp8 = dir.file("fp8"), bf16 = dir.file("bf16");
    ASSERT_EQ(glm_config_save(&tiny, cfg_path.c_str(), &err), MT_OK) << err.msg;
    ASSERT_EQ(system((bin + " --config " + cfg_path + " --dtype fp8 --out " + fp8 + " 2>/dev/null").c_str()), 0);
    ASSERT_EQ(system((bin + " --config " + cfg_path + " --out " + bf16 + " 2>/dev/null").c_str()), 0);
    glm_config back;
    ASSERT_EQ(glm_config_load((fp8 + "/config.json").c_str(), &back, &err), MT_OK) << err.msg;
    EXPECT_EQ(memcmp(&back, &tiny, sizeof back), 0);
    ASSERT_EQ(glm_config_load((bf16 + "/config.json").c_str(), &back, &err), MT_OK) << err.msg;
    EXPECT_EQ(memcmp(&back, &tiny, sizeof back), 0) << "a bf16 checkpoint keeps the config's quantization_config";
    st_archive *a8 = nullptr, *ab = nullptr;
    ASSERT_EQ(st_open_dir(fp8.c_str(), &a8, &err), MT_OK) << err.msg;
    ASSERT_EQ(st_open_dir(bf16.c_str(), &ab, &err), MT_OK) << err.msg;
    int n_fp8 = 0;
    for (const glm_tensor_spec &sp : Specs(tiny)) {
        const st_tensor *x = nullptr, *sc = nullptr, *ref = st_find(ab, sp.name);
        ASSERT_EQ(st_get_weight(a8, sp.name, sp.ndim, sp.shape, 16, 32, &x, &sc, &err), MT_OK) << err.msg;
        ASSERT_NE(ref, nullptr);
        const bool want_fp8 = sp.linear && !glm_quant_skips(&tiny.quant, sp.name);
        ASSERT_EQ(x->dtype == MT_F8E4M3, want_fp8) << sp.name;
        if (!want_fp8) {
            EXPECT_EQ(x->nbytes, ref->nbytes);
            EXPECT_EQ(memcmp(x->data, ref->data, x->nbytes), 0) << sp.name;
            continue;
        }
        n_fp8++;
        const size_t n = (size_t)(sp.shape[0] * sp.shape[1]);
        std::vector<float> deq(n), want(n);
        ASSERT_EQ(st_dequant_fp8(x, sc, 16, 32, 0, sp.shape[0], 0, sp.shape[1], MT_F32, deq.data(), &err), MT_OK);
        mt_to_f32(want.data(), ref->data, ref->dtype, n);
        const float unit = *(const float *)sc->data;  // one scale for the whole tensor
        double worst = 0;
        for (size_t i = 0; i < n; i++)
            worst = std::fmax(worst, std::fabs(deq[i] - want[i]) - (std::fabs(want[i]) / 15 + unit / 256));
        EXPECT_LE(worst, 0) << sp.name;
    }
    EXPECT_GT(n_fp8, 100);
    st_close(a8);
    st_close(ab);
}

}  // namespace
