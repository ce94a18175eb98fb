// common/ipc and the ROUTER's ipc:// endpoint: the socket's folder must be this user's alone
// (made 0700 when missing; one others may enter is refused), a stale socket file is replaced, a
// live router's socket is not, and a file that is not a socket is never touched. Loopback tcp://
// without CURVE means 127.0.0.1:PORT and nothing more.
#include <gtest/gtest.h>

#include <cstdio>
#include <ctime>
#include <string>

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

extern "C" {
#include "common/ipc.h"
#include "common/wire.h"
}

namespace {

std::string TempDir() {
    char tmpl[] = "/tmp/mt_ipc_XXXXXX";
    return mkdtemp(tmpl);
}

// A socket file with nobody listening, as a killed process leaves it.
void MakeStaleSocket(const std::string &path) {
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    snprintf(a.sun_path, sizeof a.sun_path, "%s", path.c_str());
    ASSERT_EQ(bind(fd, (sockaddr *)&a, sizeof a), 0);
    close(fd);  // bound, never listened: the file stays, connects are refused
}

mt_status OpenRouter(const std::string &ep, mt_wire_sock **s, mt_error *err) {
    return mt_wire_open(MT_WIRE_ROUTER, ep.c_str(), nullptr, s, err);
}

}  // namespace

TEST(Ipc, FolderIsMadePrivateOrRefused) {
    const std::string dir = TempDir();
    const std::string sub = dir + "/sockets";
    mt_error err{};
    EXPECT_EQ(mt_ipc_dir_private(sub.c_str(), &err), MT_OK) << err.msg;
    struct stat st;
    ASSERT_EQ(stat(sub.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0700u);
    EXPECT_EQ(mt_ipc_dir_private(sub.c_str(), &err), MT_OK) << err.msg;  // again: fine

    chmod(sub.c_str(), 0750);
    EXPECT_EQ(mt_ipc_dir_private(sub.c_str(), &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("0750"), std::string::npos) << err.msg;
    mt_wire_sock *s = nullptr;
    EXPECT_EQ(OpenRouter("ipc://" + sub + "/r.sock", &s, &err), MT_ERR_INVALID);
    EXPECT_EQ(s, nullptr);
    EXPECT_EQ(OpenRouter("ipc:///tmp/r.sock", &s, &err), MT_ERR_INVALID);  // /tmp: everyone's
    EXPECT_NE(std::string(err.msg).find("/tmp"), std::string::npos) << err.msg;
    EXPECT_EQ(OpenRouter("ipc://@abstract", &s, &err), MT_ERR_INVALID);

    chmod(sub.c_str(), 0700);
    const std::string fresh = dir + "/made-by-the-router";
    ASSERT_EQ(OpenRouter("ipc://" + fresh + "/r.sock", &s, &err), MT_OK) << err.msg;
    ASSERT_EQ(stat(fresh.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0700u);
    mt_wire_close(s);
    rmdir(fresh.c_str());
    rmdir(sub.c_str());
    rmdir(dir.c_str());
}

TEST(Ipc, StaleSocketsGoLiveOnesStay) {
    const std::string dir = TempDir();
    const std::string path = dir + "/r.sock", ep = "ipc://" + path;
    MakeStaleSocket(path);
    mt_error err{};
    mt_wire_sock *a = nullptr, *b = nullptr;
    ASSERT_EQ(OpenRouter(ep, &a, &err), MT_OK) << err.msg;  // the stale file is replaced
    EXPECT_EQ(OpenRouter(ep, &b, &err), MT_ERR_STATE);     // a live router's is not
    EXPECT_NE(std::string(err.msg).find("in use"), std::string::npos) << err.msg;
    EXPECT_EQ(b, nullptr);
    mt_wire_close(a);

    const std::string file = dir + "/plain";
    FILE *f = fopen(file.c_str(), "w");
    fputs("data", f);
    fclose(f);
    EXPECT_EQ(OpenRouter("ipc://" + file, &b, &err), MT_ERR_INVALID);
    struct stat st;
    EXPECT_EQ(stat(file.c_str(), &st), 0);  // untouched
    unlink(file.c_str());

    // the folder sweep: old stale sockets with the prefix go, others stay
    MakeStaleSocket(dir + "/serve-1.sock");
    MakeStaleSocket(dir + "/other.sock");
    EXPECT_EQ(mt_ipc_clear_stale_dir(dir.c_str(), "serve-"), 0);  // too young to judge
    struct timespec old[2] = {{time(nullptr) - 60, 0}, {time(nullptr) - 60, 0}};
    utimensat(AT_FDCWD, (dir + "/serve-1.sock").c_str(), old, AT_SYMLINK_NOFOLLOW);
    utimensat(AT_FDCWD, (dir + "/other.sock").c_str(), old, AT_SYMLINK_NOFOLLOW);
    EXPECT_EQ(mt_ipc_clear_stale_dir(dir.c_str(), "serve-"), 1);
    EXPECT_NE(stat((dir + "/serve-1.sock").c_str(), &st), 0);
    EXPECT_EQ(stat((dir + "/other.sock").c_str(), &st), 0);
    unlink((dir + "/other.sock").c_str());
    rmdir(dir.c_str());
}

TEST(Ipc, LoopbackTcpWithoutCurveIsAddressAndPortOnly) {
    mt_wire_params dp = mt_wire_default_params();
    dp.identity = "w1";
    mt_wire_sock *s = nullptr;
    mt_error err{};
    // a loopback source address in front of another host's address
    EXPECT_EQ(mt_wire_open(MT_WIRE_DEALER, "tcp://127.0.0.1:0;10.1.2.3:5555", &dp, &s, &err), MT_ERR_INVALID);
    EXPECT_EQ(mt_wire_open(MT_WIRE_DEALER, "tcp://127.0.0.1:", &dp, &s, &err), MT_ERR_INVALID);
    EXPECT_EQ(mt_wire_open(MT_WIRE_DEALER, "tcp://127.0.0.10:5555", &dp, &s, &err), MT_ERR_INVALID);
    EXPECT_EQ(mt_wire_open(MT_WIRE_DEALER, "tcp://localhost:5555", &dp, &s, &err), MT_ERR_INVALID);
    ASSERT_EQ(mt_wire_open(MT_WIRE_DEALER, "tcp://127.0.0.1:5555", &dp, &s, &err), MT_OK) << err.msg;
    mt_wire_close(s);
    ASSERT_EQ(mt_wire_open(MT_WIRE_ROUTER, "tcp://127.0.0.1:*", nullptr, &s, &err), MT_OK) << err.msg;
    mt_wire_close(s);
}
