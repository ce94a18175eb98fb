/* common/ipc.c: see ipc.h. */
#include "common/ipc.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define STALE_AFTER_S 10.0 /* mt_ipc_clear_stale_dir leaves younger sockets alone */

mt_status mt_ipc_dir_private(const char *dir, mt_error *err) {
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        return mt_errorf(err, MT_ERR_IO, "ipc: cannot make the socket folder %s: %s", dir, strerror(errno));
    struct stat st;
    if (stat(dir, &st) != 0)
        return mt_errorf(err, MT_ERR_IO, "ipc: socket folder %s: %s", dir, strerror(errno));
    if (!S_ISDIR(st.st_mode)) return mt_errorf(err, MT_ERR_INVALID, "ipc: %s is not a folder", dir);
    if (st.st_uid != geteuid())
        return mt_errorf(err, MT_ERR_INVALID,
                         "ipc: socket folder %s belongs to user %u, not to this user (%u); use a folder of your own",
                         dir, (unsigned)st.st_uid, (unsigned)geteuid());
    if (st.st_mode & 077)
        return mt_errorf(err, MT_ERR_INVALID,
                         "ipc: socket folder %s has mode %04o: other users may reach the socket; put it in a "
                         "folder of your own with mode 0700 (e.g. ipc:///tmp/NAME/workers.sock)",
                         dir, (unsigned)(st.st_mode & 07777));
    return MT_OK;
}

/* 1: a process listens at path; 0: connecting is refused (stale); -1: could not tell (errno). */
static int listening(const char *path) {
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof a.sun_path) {
        errno = ENAMETOOLONG;
        return -1;
    }
    strcpy(a.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    int rc = connect(fd, (struct sockaddr *)&a, sizeof a);
    int e = errno;
    close(fd);
    if (rc == 0) return 1;
    errno = e;
    return e == ECONNREFUSED ? 0 : -1;
}

mt_status mt_ipc_clear_stale(const char *path, mt_error *err) {
    struct stat st;
    if (lstat(path, &st) != 0) {
        if (errno == ENOENT) return MT_OK;
        return mt_errorf(err, MT_ERR_IO, "ipc: %s: %s", path, strerror(errno));
    }
    if (!S_ISSOCK(st.st_mode))
        return mt_errorf(err, MT_ERR_INVALID, "ipc: %s exists and is not a socket; not replacing it", path);
    switch (listening(path)) {
    case 1: return mt_errorf(err, MT_ERR_STATE, "ipc: %s is in use: another process listens on it", path);
    case 0:
        if (unlink(path) != 0 && errno != ENOENT)
            return mt_errorf(err, MT_ERR_IO, "ipc: cannot remove the stale socket %s: %s", path, strerror(errno));
        mt_log(MT_LOG_INFO, "ipc: removed the stale socket %s (its process is gone)", path);
        return MT_OK;
    default: return mt_errorf(err, MT_ERR_IO, "ipc: %s: %s", path, strerror(errno));
    }
}

int mt_ipc_clear_stale_dir(const char *dir, const char *prefix) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int removed = 0;
    const size_t np = strlen(prefix);
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, prefix, np) != 0) continue;
        char path[PATH_MAX];
        if (snprintf(path, sizeof path, "%s/%s", dir, e->d_name) >= (int)sizeof path) continue;
        struct stat st;
        if (lstat(path, &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
        /* a socket bound a moment ago may not listen yet: only old ones are judged */
        if (difftime(time(NULL), st.st_mtime) < STALE_AFTER_S) continue;
        if (listening(path) == 0 && unlink(path) == 0) removed++;
    }
    closedir(d);
    return removed;
}
