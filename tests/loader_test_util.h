// tests/loader_test_util.h: temp directories, file helpers and the path of tools/mkckpt, shared by
// the tests that write or make checkpoints.
#ifndef LOADER_TEST_UTIL_H
#define LOADER_TEST_UTIL_H

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <string>

#include <gtest/gtest.h>

namespace loader_test {

// A fresh directory under $TEST_TMPDIR (or /tmp), removed with its contents at destruction.
class TempDir {
  public:
    TempDir() {
        const char *base = getenv("TEST_TMPDIR");
        std::string tmpl = std::string(base && *base ? base : "/tmp") + "/loader.XXXXXX";
        char *p = mkdtemp(&tmpl[0]);
        if (!p) ADD_FAILURE() << "mkdtemp failed";
        path_ = tmpl;
    }
    ~TempDir() {
        nftw(path_.c_str(), [](const char *p, const struct stat *, int, struct FTW *) { return remove(p); },
             16, FTW_DEPTH | FTW_PHYS);
    }
    const std::string &path() const { return path_; }
    std::string file(const std::string &name) const { return path_ + "/" + name; }

  private:
    std::string path_;
};

inline void WriteFile(const std::string &path, const std::string &bytes) {
    FILE *f = fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr) << path;
    ASSERT_EQ(fwrite(bytes.data(), 1, bytes.size(), f), bytes.size());
    ASSERT_EQ(fclose(f), 0);
}

inline std::string ReadFile(const std::string &path) {
    std::string out;
    FILE *f = fopen(path.c_str(), "rb");
    if (!f) return out;
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
    fclose(f);
    return out;
}

inline bool Exists(const std::string &path) { return access(path.c_str(), F_OK) == 0; }

// tools/mkckpt: $MT_MKCKPT (a test binary run outside Bazel, e.g. on the GPU machine), else the
// runfiles (a data dependency of the test); "" when neither has it.
inline std::string MkckptPath() {
    if (const char *e = getenv("MT_MKCKPT")) return e;
    const char *dirs[] = { getenv("TEST_SRCDIR"), "." };
    for (const char *d : dirs) {
        if (!d) continue;
        for (const char *rel : { "/metrale/tools/mkckpt", "/tools/mkckpt" }) {
            std::string p = std::string(d) + rel;
            if (access(p.c_str(), X_OK) == 0) return p;
        }
    }
    return "";
}

}  // namespace loader_test

#endif  // LOADER_TEST_UTIL_H
