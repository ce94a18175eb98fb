// worker/dist host communicator: groups of 1, 2 and 4 forked processes on fresh names; the
// collectives against results computed here (all_reduce_sum bit for bit, in rank order), chunked
// buffers, many calls in a row, a peer killed mid-run, a peer that leaves, timeouts, forming the
// group (stale files, nothing left behind, mismatched shapes) and argument checks.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <new>
#include <string>
#include <vector>

#include "worker/dist/comm_host.h"

namespace {

// A fresh group name per call: random bits drawn once per process (pids repeat across the PID
// namespaces of sandboxed test runs, which share /dev/shm), a tag and a counter.
std::string FreshName(const char *tag) {
    static const uint64_t nonce = [] {
        uint64_t v = 0;
        if (getrandom(&v, sizeof v, 0) != (ssize_t)sizeof v) v = (uint64_t)getpid() ^ (uint64_t)(mt_now() * 1e9);
        return v;
    }();
    static int n = 0;
    char hex[17];
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)nonce);
    return std::string("mt-test-") + hex + "-" + tag + "-" + std::to_string(n++);
}

bool ShmExists(const std::string &name) {
    struct stat sb;
    return stat(("/dev/shm/" + name).c_str(), &sb) == 0;
}

// Memory shared by the test and its forked ranks (MAP_SHARED before the fork).
template <typename T> struct Shared {
    T *p;
    Shared() {
        void *m = mmap(nullptr, sizeof(T), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) abort();
        p = new (m) T();
    }
    ~Shared() { munmap(p, sizeof(T)); }
    T *operator->() { return p; }
};

// What each rank reports back: a message on failure.
enum { MAXR = 8, MSG = 512 };
struct Report {
    char msg[MAXR][MSG];
};

// Runs body(rank) in `n` forked processes and waits for them (at most limit_s, then kills the
// rest). Returns each rank's exit code (0 ok; 100 + signal when killed, -1 when it hung).
std::vector<int> RunRanks(int n, const std::function<int(int)> &body, double limit_s = 8.0,
                          std::vector<pid_t> *pids_out = nullptr, const std::function<void()> &meanwhile = nullptr) {
    std::vector<pid_t> pids(n);
    for (int r = 0; r < n; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
            int code = 99;
            code = body(r);
            fflush(stdout);
            fflush(stderr);
            _exit(code);
        }
    }
    if (pids_out) *pids_out = pids;
    if (meanwhile) meanwhile();
    std::vector<int> codes(n, -1);
    const double deadline = mt_now() + limit_s;
    int left = n;
    while (left > 0 && mt_now() < deadline) {
        for (int r = 0; r < n; r++) {
            if (codes[r] != -1 || pids[r] == 0) continue;
            int ws = 0;
            if (waitpid(pids[r], &ws, WNOHANG) == pids[r]) {
                codes[r] = WIFEXITED(ws) ? WEXITSTATUS(ws) : 100 + WTERMSIG(ws);
                left--;
            }
        }
        usleep(2000);
    }
    for (int r = 0; r < n; r++)
        if (codes[r] == -1) {
            kill(pids[r], SIGKILL);
            waitpid(pids[r], nullptr, 0);
        }
    return codes;
}

mt_comm_host_params Params(size_t slot_bytes = 4096, double timeout_s = 5.0) {
    mt_comm_host_params p = mt_comm_host_default_params();
    p.slot_bytes = slot_bytes;
    p.timeout_s = timeout_s;
    return p;
}

// splitmix64 floats of widely varying magnitude, so the order of a sum shows in its bits.
std::vector<float> RankData(uint64_t seed, int rank, size_t count) {
    uint64_t s = seed * 1000003u + (uint64_t)rank * 7919u + 1;
    std::vector<float> v(count);
    for (size_t i = 0; i < count; i++) {
        uint64_t z = (s += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        const float u = (float)((z >> 40) * (1.0 / 16777216.0)) * 2.f - 1.f;
        v[i] = std::ldexp(u, (int)((z >> 8) % 21) - 10);
    }
    return v;
}

// The rank-order sum, computed here: ((x0 + x1) + x2) + ... in fp32.
std::vector<float> RankOrderSum(uint64_t seed, int n, size_t count) {
    std::vector<float> acc = RankData(seed, 0, count);
    for (int r = 1; r < n; r++) {
        std::vector<float> x = RankData(seed, r, count);
        for (size_t i = 0; i < count; i++) acc[i] += x[i];
    }
    return acc;
}

// Child-side check: on failure writes the message for the parent and returns false.
#define CHILD_CHECK(rep, rank, cond, ...)                                                     \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            snprintf((rep)->msg[rank], MSG, "%s:%d: %s: ", __FILE__, __LINE__, #cond);        \
            size_t l_ = strlen((rep)->msg[rank]);                                             \
            snprintf((rep)->msg[rank] + l_, MSG - l_, __VA_ARGS__);                           \
            return 1;                                                                         \
        }                                                                                     \
    } while (0)

void ExpectAllOk(const std::vector<int> &codes, Report *rep, const char *what) {
    for (size_t r = 0; r < codes.size(); r++)
        EXPECT_EQ(codes[r], 0) << what << ": rank " << r << ": " << rep->msg[r];
}

const int kSizes[] = {1, 2, 4};

TEST(DistCommHost, SizeOneIsTrivial) {
    const std::string name = FreshName("one");
    mt_error err{};
    mt_comm_host_params p = Params();
    mt_comm *c = mt_comm_host_new(name.c_str(), 0, 1, &p, &err);
    ASSERT_NE(c, nullptr) << err.msg;
    EXPECT_FALSE(ShmExists(name));
    EXPECT_EQ(c->rank, 0);
    EXPECT_EQ(c->size, 1);
    EXPECT_FALSE(c->queued);
    std::vector<float> x = RankData(1, 0, 5000), y = x, g(5000, 0.f);
    EXPECT_EQ(mt_comm_all_reduce_sum(c, y.data(), y.size()), MT_OK);
    EXPECT_EQ(0, memcmp(x.data(), y.data(), x.size() * 4));
    EXPECT_EQ(mt_comm_all_gather(c, x.data(), g.data(), x.size()), MT_OK);
    EXPECT_EQ(0, memcmp(x.data(), g.data(), x.size() * 4));
    EXPECT_EQ(mt_comm_broadcast(c, y.data(), 4 * y.size(), 0), MT_OK);
    EXPECT_EQ(0, memcmp(x.data(), y.data(), x.size() * 4));
    EXPECT_EQ(mt_comm_broadcast(c, y.data(), 4, 1), MT_ERR_INVALID);
    EXPECT_EQ(mt_comm_barrier(c), MT_OK);
    EXPECT_EQ(mt_comm_check(c), MT_OK);
    mt_comm_free(c);
    mt_comm_free(nullptr);
}

TEST(DistCommHost, AllReduceIsRankOrderSumOnEveryRank) {
    // 1, 1000 (under a chunk of 1024 floats), 3500 (3.4 chunks) and 4096 (exactly 4).
    const size_t counts[] = {1, 1000, 3500, 4096};
    for (int n : kSizes) {
        struct Out : Report {
            float got[MAXR][4096];
        };
        for (size_t count : counts) {
            Shared<Out> out;
            const std::string name = FreshName("ar");
            const uint64_t seed = 17 + count + (uint64_t)n;
            auto codes = RunRanks(n, [&](int rank) {
                mt_error err{};
                mt_comm_host_params p = Params();
                mt_comm *c = mt_comm_host_new(name.c_str(), rank, n, &p, &err);
                CHILD_CHECK(out.p, rank, c, "%s", err.msg);
                std::vector<float> x = RankData(seed, rank, count);
                mt_status st = mt_comm_all_reduce_sum(c, x.data(), count);
                CHILD_CHECK(out.p, rank, st == MT_OK, "%s", c->err.msg);
                memcpy(out->got[rank], x.data(), count * 4);
                mt_comm_free(c);
                return 0;
            });
            ExpectAllOk(codes, out.p, "all_reduce_sum");
            const std::vector<float> want = RankOrderSum(seed, n, count);
            for (int r = 0; r < n; r++)
                EXPECT_EQ(0, memcmp(out->got[r], want.data(), count * 4))
                    << "n=" << n << " count=" << count << " rank " << r << " differs from the rank-order sum";
            EXPECT_FALSE(ShmExists(name));
        }
    }
}

TEST(DistCommHost, AllGatherInRankOrder) {
    const size_t count = 2500;  // 2.4 chunks
    for (int n : kSizes) {
        struct Out : Report {
            float got[MAXR][4][2500];
            float inplace[MAXR][4][2500];
        };
        Shared<Out> out;
        const std::string name = FreshName("ag");
        auto codes = RunRanks(n, [&](int rank) {
            mt_error err{};
            mt_comm_host_params p = Params();
            mt_comm *c = mt_comm_host_new(name.c_str(), rank, n, &p, &err);
            CHILD_CHECK(out.p, rank, c, "%s", err.msg);
            std::vector<float> x = RankData(5, rank, count), recv((size_t)n * count, -1.f);
            mt_status st = mt_comm_all_gather(c, x.data(), recv.data(), count);
            CHILD_CHECK(out.p, rank, st == MT_OK, "%s", c->err.msg);
            memcpy(out->got[rank], recv.data(), recv.size() * 4);
            // In place: this rank's part already sits at recv + rank * count.
            std::vector<float> buf((size_t)n * count, -2.f);
            memcpy(buf.data() + (size_t)rank * count, x.data(), count * 4);
            st = mt_comm_all_gather(c, buf.data() + (size_t)rank * count, buf.data(), count);
            CHILD_CHECK(out.p, rank, st == MT_OK, "%s", c->err.msg);
            memcpy(out->inplace[rank], buf.data(), buf.size() * 4);
            mt_comm_free(c);
            return 0;
        });
        ExpectAllOk(codes, out.p, "all_gather");
        for (int r = 0; r < n; r++)
            for (int q = 0; q < n; q++) {
                const std::vector<float> want = RankData(5, q, count);
                EXPECT_EQ(0, memcmp(&out->got[r][0][0] + (size_t)q * count, want.data(), count * 4))
                    << "n=" << n << " rank " << r << " part " << q;
                EXPECT_EQ(0, memcmp(&out->inplace[r][0][0] + (size_t)q * count, want.data(), count * 4))
                    << "in place: n=" << n << " rank " << r << " part " << q;
            }
    }
}

TEST(DistCommHost, BroadcastFromEveryRoot) {
    const size_t bytes = 40001;  // odd, and more than one set of 4 slots of 4096 bytes
    for (int n : kSizes) {
        struct Out : Report {
            unsigned char got[MAXR][4][40001];
        };
        Shared<Out> out;
        const std::string name = FreshName("bc");
        auto fill = [](int rank, std::vector<unsigned char> &b) {
            for (size_t i = 0; i < b.size(); i++) b[i] = (unsigned char)(i * 31 + rank * 101 + (i >> 8));
        };
        auto codes = RunRanks(n, [&](int rank) {
            mt_error err{};
            mt_comm_host_params p = Params();
            mt_comm *c = mt_comm_host_new(name.c_str(), rank, n, &p, &err);
            CHILD_CHECK(out.p, rank, c, "%s", err.msg);
            for (int root = 0; root < n; root++) {
                std::vector<unsigned char> b(bytes);
                fill(rank, b);
                mt_status st = mt_comm_broadcast(c, b.data(), bytes, root);
                CHILD_CHECK(out.p, rank, st == MT_OK, "root %d: %s", root, c->err.msg);
                memcpy(out->got[rank][root], b.data(), bytes);
            }
            CHILD_CHECK(out.p, rank, mt_comm_broadcast(c, out->got[rank][0], 1, n) == MT_ERR_INVALID, "root %d", n);
            mt_comm_free(c);
            return 0;
        });
        ExpectAllOk(codes, out.p, "broadcast");
        for (int root = 0; root < n; root++) {
            std::vector<unsigned char> want(bytes);
            fill(root, want);
            for (int r = 0; r < n; r++)
                EXPECT_EQ(0, memcmp(out->got[r][root], want.data(), bytes)) << "n=" << n << " root " << root << " rank " << r;
        }
    }
}

TEST(DistCommHost, BarrierWaitsForEveryRank) {
    for (int n : kSizes) {
        struct Out : Report {
            volatile int entered[8][MAXR];
        };
        Shared<Out> out;
        const std::string name = FreshName("bar");
        auto codes = RunRanks(n, [&](int rank) {
            mt_error err{};
            mt_comm_host_params p = Params();
            mt_comm *c = mt_comm_host_new(name.c_str(), rank, n, &p, &err);
            CHILD_CHECK(out.p, rank, c, "%s", err.msg);
            for (int k = 0; k < 8; k++) {
                usleep((useconds_t)(((rank + k) % n) * 3000));  // a different rank arrives last each time
                __atomic_store_n(&out->entered[k][rank], 1, __ATOMIC_SEQ_CST);
                mt_status st = mt_comm_barrier(c);
                CHILD_CHECK(out.p, rank, st == MT_OK, "%s", c->err.msg);
                for (int q = 0; q < n; q++)
                    CHILD_CHECK(out.p, rank, __atomic_load_n(&out->entered[k][q], __ATOMIC_SEQ_CST) == 1,
                                "barrier %d passed before rank %d entered", k, q);
            }
            mt_comm_free(c);
            return 0;
        });
        ExpectAllOk(codes, out.p, "barrier");
    }
}

TEST(DistCommHost, ManyCallsInARow) {
    const int n = 4, calls = 2000;
    Shared<Report> rep;
    const std::string name = FreshName("many");
    const double t0 = mt_now();
    auto codes = RunRanks(n, [&](int rank) {
        mt_error err{};
        mt_comm_host_params p = Params();
        mt_comm *c = mt_comm_host_new(name.c_str(), rank, n, &p, &err);
        CHILD_CHECK(rep.p, rank, c, "%s", err.msg);
        float x[7];
        float g[4];
        for (int k = 0; k < calls; k++) {
            for (int i = 0; i < 7; i++) x[i] = (float)(rank * 1000 + k + i);  // exact in fp32
            mt_status st = mt_comm_all_reduce_sum(c, x, 7);
            CHILD_CHECK(rep.p, rank, st == MT_OK, "call %d: %s", k, c->err.msg);
            for (int i = 0; i < 7; i++)
                CHILD_CHECK(rep.p, rank, x[i] == (float)(6000 + 4 * (k + i)), "call %d elem %d: %g", k, i, x[i]);
            if (k % 100 == 0) {  // other ops interleaved
                const float mine = (float)(rank + k);
                st = mt_comm_all_gather(c, &mine, g, 1);
                CHILD_CHECK(rep.p, rank, st == MT_OK, "%s", c->err.msg);
                for (int q = 0; q < n; q++) CHILD_CHECK(rep.p, rank, g[q] == (float)(q + k), "gather %d", q);
            }
        }
        mt_comm_free(c);
        return 0;
    });
    ExpectAllOk(codes, rep.p, "many calls");
    printf("[ info     ] %d all-reduces on 4 ranks: %.2f s (with fork and forming)\n", calls, mt_now() - t0);
}

TEST(DistCommHost, KilledPeerFailsTheOthersQuickly) {
    const int n = 4, victim = 2;
    struct Out : Report {
        volatile int iters[MAXR];
        volatile double killed_at;
        volatile double failed_at[MAXR];
        volatile int status[MAXR];
        volatile int next_status[MAXR];
        volatile int check_status[MAXR];
        char why[MAXR][MSG];
    };
    Shared<Out> out;
    const std::string name = FreshName("kill");
    std::vector<pid_t> pids;
    auto codes = RunRanks(
        n,
        [&](int rank) {
            mt_error err{};
            mt_comm_host_params p = Params(4096, 30.0);  // the death, not the timeout, must end the wait
            mt_comm *c = mt_comm_host_new(name.c_str(), rank, n, &p, &err);
            CHILD_CHECK(out.p, rank, c, "%s", err.msg);
            std::vector<float> x(300);
            for (;;) {
                mt_status st = mt_comm_all_reduce_sum(c, x.data(), x.size());
                if (st != MT_OK) {
                    out->failed_at[rank] = mt_now();
                    out->status[rank] = st;
                    snprintf(out->why[rank], MSG, "%s", c->err.msg);
                    out->next_status[rank] = mt_comm_barrier(c);
                    out->check_status[rank] = mt_comm_check(c);
                    break;
                }
                __atomic_add_fetch(&out->iters[rank], 1, __ATOMIC_SEQ_CST);
            }
            mt_comm_free(c);
            return 0;
        },
        8.0, &pids,
        [&]() {
            const double until = mt_now() + 5.0;
            while (mt_now() < until && __atomic_load_n(&out->iters[0], __ATOMIC_SEQ_CST) < 50) usleep(1000);
            out->killed_at = mt_now();
            kill(pids[victim], SIGKILL);  // not reaped until the others are done: a zombie meanwhile
        });
    EXPECT_EQ(codes[victim], 100 + SIGKILL);
    for (int r = 0; r < n; r++) {
        if (r == victim) continue;
        ASSERT_EQ(codes[r], 0) << "rank " << r << " (-1: hung): " << out->msg[r];
        EXPECT_NE(out->status[r], MT_OK);
        const double after = out->failed_at[r] - out->killed_at;
        EXPECT_LT(after, 2.0) << "rank " << r;
        EXPECT_TRUE(strstr(out->why[r], "rank 2") != nullptr) << out->why[r];
        EXPECT_EQ(out->next_status[r], MT_ERR_STATE) << "rank " << r;
        EXPECT_EQ(out->check_status[r], MT_ERR_STATE) << "rank " << r;
        printf("[ info     ] rank %d failed %.3f s after the kill: %s\n", r, after, out->why[r]);
    }
    EXPECT_FALSE(ShmExists(name));
}

TEST(DistCommHost, PeerThatLeavesFailsTheOthers) {
    struct Out : Report {
        volatile int status;
        volatile double took;
        char why[MSG];
    };
    Shared<Out> out;
    const std::string name = FreshName("left");
    auto codes = RunRanks(2, [&](int rank) {
        mt_error err{};
        mt_comm_host_params p = Params(4096, 30.0);
        mt_comm *c = mt_comm_host_new(name.c_str(), rank, 2, &p, &err);
        CHILD_CHECK(out.p, rank, c, "%s", err.msg);
        CHILD_CHECK(out.p, rank, mt_comm_barrier(c) == MT_OK, "%s", c->err.msg);
        if (rank == 1) {
            mt_comm_free(c);
            usleep(600 * 1000);  // alive, but no longer in the group
            return 0;
        }
        const double t0 = mt_now();
        out->status = mt_comm_barrier(c);
        out->took = mt_now() - t0;
        snprintf(out->why, MSG, "%s", c->err.msg);
        mt_comm_free(c);
        return 0;
    });
    ExpectAllOk(codes, out.p, "leave");
    EXPECT_EQ(out->status, MT_ERR_BACKEND);
    EXPECT_LT(out->took, 1.0);
    EXPECT_TRUE(strstr(out->why, "left the group") != nullptr) << out->why;
}

TEST(DistCommHost, CheckFindsADeadPeerBetweenCollectives) {
    struct Out : Report {
        volatile int first, second, checked;
        volatile double took;
        char why[MSG];
    };
    Shared<Out> out;
    const std::string name = FreshName("check");
    auto codes = RunRanks(2, [&](int rank) {
        mt_error err{};
        mt_comm_host_params p = Params(4096, 30.0);
        mt_comm *c = mt_comm_host_new(name.c_str(), rank, 2, &p, &err);
        CHILD_CHECK(out.p, rank, c, "%s", err.msg);
        CHILD_CHECK(out.p, rank, mt_comm_barrier(c) == MT_OK, "%s", c->err.msg);
        if (rank == 1) {
            while (!__atomic_load_n(&out->checked, __ATOMIC_SEQ_CST)) usleep(1000);
            _exit(0);  // gone without destroying its communicator, as a crash would
        }
        CHILD_CHECK(out.p, rank, mt_comm_check(c) == MT_OK, "%s", c->err.msg);
        __atomic_store_n(&out->checked, 1, __ATOMIC_SEQ_CST);
        const double t0 = mt_now();
        mt_status st;
        while ((st = mt_comm_check(c)) == MT_OK && mt_now() - t0 < 2.0) usleep(1000);
        out->took = mt_now() - t0;
        out->first = st;
        snprintf(out->why, MSG, "%s", c->err.msg);
        out->second = mt_comm_check(c);
        mt_comm_free(c);
        return 0;
    });
    ExpectAllOk(codes, out.p, "check");
    EXPECT_EQ(out->first, MT_ERR_BACKEND);
    EXPECT_LT(out->took, 1.0);
    EXPECT_TRUE(strstr(out->why, "rank 1") && strstr(out->why, "died")) << out->why;
    EXPECT_EQ(out->second, MT_ERR_STATE);
}

TEST(DistCommHost, TimeoutIsReported) {
    struct Out : Report {
        volatile int status[2];
        volatile double took[2];
        char why[2][MSG];
    };
    Shared<Out> out;
    const std::string name = FreshName("timeout");
    auto codes = RunRanks(2, [&](int rank) {
        mt_error err{};
        mt_comm_host_params p = Params(4096, 0.4);
        p.poll_s = 0.05;
        mt_comm *c = mt_comm_host_new(name.c_str(), rank, 2, &p, &err);
        CHILD_CHECK(out.p, rank, c, "%s", err.msg);
        if (rank == 1) usleep(1200 * 1000);  // alive but late
        const double t0 = mt_now();
        out->status[rank] = mt_comm_barrier(c);
        out->took[rank] = mt_now() - t0;
        snprintf(out->why[rank], MSG, "%s", c->err.msg);
        mt_comm_free(c);
        return 0;
    });
    ExpectAllOk(codes, out.p, "timeout");
    EXPECT_EQ(out->status[0], MT_ERR_BACKEND);
    EXPECT_GE(out->took[0], 0.35);
    EXPECT_LT(out->took[0], 1.0);
    EXPECT_TRUE(strstr(out->why[0], "timed out") && strstr(out->why[0], "rank 1")) << out->why[0];
    // The late rank finds the group failed at once.
    EXPECT_EQ(out->status[1], MT_ERR_STATE);
    EXPECT_LT(out->took[1], 0.1);
    EXPECT_TRUE(strstr(out->why[1], "timed out")) << out->why[1];
}

TEST(DistCommHost, FormingTimesOutAndLeavesNoFile) {
    const std::string name = FreshName("alone");
    mt_comm_host_params p = Params(4096, 0.3);
    for (int rank = 0; rank < 2; rank++) {
        mt_error err{};
        const double t0 = mt_now();
        mt_comm *c = mt_comm_host_new(name.c_str(), rank, 2, &p, &err);
        EXPECT_EQ(c, nullptr);
        EXPECT_LT(mt_now() - t0, 1.0);
        EXPECT_TRUE(strstr(err.msg, rank == 0 ? "waiting for rank 1 to join" : "waiting for rank 0")) << err.msg;
        EXPECT_FALSE(ShmExists(name));
    }
}

TEST(DistCommHost, StaleFileOfADeadGroupIsReplaced) {
    const std::string name = FreshName("stale");
    // A rank 0 killed while its group forms leaves its file behind.
    pid_t pid = fork();
    if (pid == 0) {
        mt_comm_host_params p = Params(4096, 30.0);
        mt_error err{};
        mt_comm_host_new(name.c_str(), 0, 3, &p, &err);
        _exit(1);
    }
    const double until = mt_now() + 5.0;
    while (!ShmExists(name) && mt_now() < until) usleep(1000);
    ASSERT_TRUE(ShmExists(name));
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    ASSERT_TRUE(ShmExists(name));
    // A new group of that name (another size, and rank 1 first, so it meets the stale file) forms.
    Shared<Report> rep;
    auto codes = RunRanks(2, [&](int rank) {
        if (rank == 0) usleep(50 * 1000);
        mt_error err{};
        mt_comm_host_params p = Params(4096, 5.0);
        mt_comm *c = mt_comm_host_new(name.c_str(), rank, 2, &p, &err);
        CHILD_CHECK(rep.p, rank, c, "%s", err.msg);
        float x = (float)rank + 1;
        CHILD_CHECK(rep.p, rank, mt_comm_all_reduce_sum(c, &x, 1) == MT_OK && x == 3.f, "%s", c->err.msg);
        mt_comm_free(c);
        return 0;
    });
    ExpectAllOk(codes, rep.p, "stale");
    EXPECT_FALSE(ShmExists(name));
}

TEST(DistCommHost, MismatchedSizeIsRefused) {
    struct Out : Report {
        volatile int status[2];
        char why[2][MSG];
    };
    Shared<Out> out;
    const std::string name = FreshName("mismatch");
    auto codes = RunRanks(2, [&](int rank) {
        mt_error err{};
        mt_comm_host_params p = Params(4096, 0.5);
        mt_comm *c = mt_comm_host_new(name.c_str(), rank, rank == 0 ? 2 : 3, &p, &err);
        out->status[rank] = c ? MT_OK : MT_ERR_INVALID;
        snprintf(out->why[rank], MSG, "%s", err.msg);
        mt_comm_free(c);
        return 0;
    });
    ExpectAllOk(codes, out.p, "mismatch");
    EXPECT_TRUE(strstr(out->why[1], "made for 2 ranks")) << out->why[1];
    EXPECT_TRUE(strstr(out->why[0], "timed out")) << out->why[0];
    EXPECT_FALSE(ShmExists(name));
}

TEST(DistCommHost, BadArgumentsAreRefused) {
    mt_error err{};
    mt_comm_host_params p = Params();
    EXPECT_EQ(mt_comm_host_new("", 0, 1, &p, &err), nullptr);
    EXPECT_EQ(mt_comm_host_new("a/b", 0, 1, &p, &err), nullptr);
    EXPECT_EQ(mt_comm_host_new(".hidden", 0, 1, &p, &err), nullptr);
    EXPECT_EQ(mt_comm_host_new(nullptr, 0, 1, &p, &err), nullptr);
    EXPECT_EQ(mt_comm_host_new("ok", 2, 2, &p, &err), nullptr);
    EXPECT_EQ(mt_comm_host_new("ok", -1, 2, &p, &err), nullptr);
    EXPECT_EQ(mt_comm_host_new("ok", 0, MT_COMM_HOST_MAX_RANKS + 1, &p, &err), nullptr);
    EXPECT_TRUE(strstr(err.msg, "rank 0 of 65")) << err.msg;
    p.slot_bytes = 100;
    EXPECT_EQ(mt_comm_host_new("ok", 0, 1, &p, &err), nullptr);
    EXPECT_TRUE(strstr(err.msg, "slot_bytes 100")) << err.msg;
    p = Params();
    p.timeout_s = 0;
    EXPECT_EQ(mt_comm_host_new("ok", 0, 1, &p, &err), nullptr);
}

}  // namespace
