/* worker/dist/comm_host.c: the host communicator (comm_host.h) over a shared-memory file.
 *
 * The file: a header page (hc_shared) then two sets of `size` slots of slot_bytes. Every
 * collective is a sequence of rounds of one central barrier (arrival counter + generation word,
 * futex on the generation). Round p's data goes into set p % 2: a rank writes set p % 2 only after
 * it passed round p - 1, which every rank enters only after it finished reading round p - 2's
 * data from that set, so one barrier per chunk suffices (no second barrier after the reads).
 */
#include "worker/dist/comm_host.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <stdalign.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

enum {
    HC_MAGIC = 0x6f63746d,   /* "mtco" */
    HC_VERSION = 1,
    HC_HDR_BYTES = 16384,    /* header page(s); slots start here */
    HC_NAME_MAX = 100,
    HC_MSG = 400,
};

/* The shared header. Written by rank 0 before the file gets its name; the atomics after. */
typedef struct hc_shared {
    uint32_t magic, version;
    uint32_t size;
    int32_t creator_pid;
    uint64_t slot_bytes;
    alignas(64) _Atomic uint32_t joined;             /* ranks that joined; futex word */
    _Atomic int32_t pid[MT_COMM_HOST_MAX_RANKS];     /* 0 until rank r joins */
    _Atomic uint32_t left[MT_COMM_HOST_MAX_RANKS];   /* rank r destroyed its communicator */
    _Atomic uint64_t rounds[MT_COMM_HOST_MAX_RANKS]; /* rounds rank r has entered (messages) */
    alignas(64) _Atomic uint32_t arrived;            /* ranks in the current round */
    alignas(64) _Atomic uint32_t gen;                /* rounds completed; futex word */
    alignas(64) _Atomic uint32_t failed;             /* set once, after fail_msg is written */
    _Atomic uint32_t fail_claim;                     /* the rank that writes fail_msg, plus 1 */
    char fail_msg[HC_MSG];
} hc_shared;

_Static_assert(sizeof(hc_shared) <= HC_HDR_BYTES, "header must fit its page");

typedef struct hc_comm {
    mt_comm base;
    mt_comm_host_params p;
    char name[HC_NAME_MAX + 1];
    hc_shared *sh;          /* the mapping; NULL for size 1 */
    size_t map_bytes;
    uint64_t rounds;        /* rounds this rank entered */
    bool broken;
    char cause[HC_MSG];     /* the failure that broke the group */
    int pidfd[MT_COMM_HOST_MAX_RANKS]; /* per peer, -1 where pidfd_open is unavailable */
} hc_comm;

static hc_comm *hc_of(mt_comm *c) { return (hc_comm *)c; }

/* ---- futex, time, processes ---- */

static void hc_futex_wait(_Atomic uint32_t *w, uint32_t val, double seconds) {
    if (seconds <= 0) return;
    struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    /* Shared (not _PRIVATE): the word is in a mapping of several processes. EINTR, EAGAIN (the
     * word changed) and ETIMEDOUT all send the caller back to its checks. */
    (void)syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void hc_futex_wake(_Atomic uint32_t *w) {
    (void)syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static void hc_sleep(double seconds) {
    struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    (void)nanosleep(&ts, NULL);
}

/* Whether pid names a live (not zombie) process, without a pidfd. */
static bool hc_pid_alive(pid_t pid) {
    if (pid <= 0) return false;
    if (kill(pid, 0) != 0 && errno == ESRCH) return false;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return true; /* no /proc: kill's answer stands */
    const size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *rp = strrchr(buf, ')'); /* the state follows the command name in parentheses */
    if (!rp || rp[1] != ' ') return true;
    return rp[2] != 'Z' && rp[2] != 'X';
}

/* Whether peer r is gone: its pidfd became readable (it exited, reaped or not), or without one,
 * its pid is not a live process. */
static bool hc_peer_dead(const hc_comm *c, int r) {
    if (c->pidfd[r] >= 0) {
        struct pollfd pf = {.fd = c->pidfd[r], .events = POLLIN};
        return poll(&pf, 1, 0) > 0;
    }
    return !hc_pid_alive(atomic_load(&c->sh->pid[r]));
}

/* ---- failure ---- */

/* Records a failure this rank found (st, message naming the operation), logs it, and marks the
 * group failed so the peers' waits end. Returns st. */
static mt_status hc_break(hc_comm *c, mt_status st, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static mt_status hc_break(hc_comm *c, mt_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char msg[HC_MSG];
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    mt_errorf(&c->base.err, st, "comm host %s rank %d: %s", c->name, c->base.rank, msg);
    mt_log(MT_LOG_ERROR, "%s", c->base.err.msg);
    snprintf(c->cause, sizeof c->cause, "%s", c->base.err.msg);
    c->broken = true;
    hc_shared *h = c->sh;
    if (h) {
        uint32_t none = 0;
        if (atomic_compare_exchange_strong(&h->fail_claim, &none, (uint32_t)c->base.rank + 1)) {
            snprintf(h->fail_msg, sizeof h->fail_msg, "%s", c->base.err.msg);
            atomic_store(&h->failed, 1);
        }
        hc_futex_wake(&h->gen);
        hc_futex_wake(&h->joined);
    }
    return st;
}

/* The group was marked failed by another rank while this one waited in `op`. */
static mt_status hc_failed_by_peer(hc_comm *c, const char *op) {
    char msg[HC_MSG];
    snprintf(msg, sizeof msg, "%s", c->sh->fail_msg);
    mt_errorf(&c->base.err, MT_ERR_BACKEND, "comm host %s rank %d: %s: the group failed: %s", c->name,
              c->base.rank, op, msg);
    mt_log(MT_LOG_ERROR, "%s", c->base.err.msg);
    snprintf(c->cause, sizeof c->cause, "%s", msg);
    c->broken = true;
    return MT_ERR_BACKEND;
}

/* The checks at the start of every call: the group is whole. */
static mt_status hc_enter(hc_comm *c, const char *op) {
    if (!c->broken && c->sh && atomic_load(&c->sh->failed)) {
        snprintf(c->cause, sizeof c->cause, "%s", c->sh->fail_msg);
        c->broken = true;
    }
    if (c->broken)
        return mt_errorf(&c->base.err, MT_ERR_STATE, "comm host %s rank %d: %s: the group failed earlier: %s",
                         c->name, c->base.rank, op, c->cause);
    return MT_OK;
}

/* Looks for a dead or departed peer; MT_OK when none. */
static mt_status hc_check_peers(hc_comm *c, const char *op) {
    hc_shared *h = c->sh;
    for (int r = 0; r < c->base.size; r++) {
        if (r == c->base.rank) continue;
        if (atomic_load(&h->left[r])) {
            /* a rank that left a failed group left because of it: name the first cause */
            if (atomic_load(&h->failed)) return hc_failed_by_peer(c, op);
            return hc_break(c, MT_ERR_BACKEND, "%s: rank %d (pid %d) left the group", op, r,
                            (int)atomic_load(&h->pid[r]));
        }
        if (hc_peer_dead(c, r))
            return hc_break(c, MT_ERR_BACKEND, "%s: rank %d (pid %d) died", op, r, (int)atomic_load(&h->pid[r]));
    }
    return MT_OK;
}

/* ", rank 2 (pid 41), rank 3 (pid 42)" of the ranks that have not entered this rank's round. */
static void hc_laggards(const hc_comm *c, char *out, size_t cap) {
    size_t n = 0;
    out[0] = 0;
    for (int r = 0; r < c->base.size && n + 1 < cap; r++) {
        if (r == c->base.rank || atomic_load(&c->sh->rounds[r]) >= c->rounds) continue;
        int k = snprintf(out + n, cap - n, "%s%d (pid %d)", n ? ", " : "", r, (int)atomic_load(&c->sh->pid[r]));
        if (k < 0) break;
        n += (size_t)k;
    }
}

/* ---- rounds ---- */

/* One round of the central barrier: returns once every rank has entered it. */
static mt_status hc_round(hc_comm *c, const char *op) {
    hc_shared *h = c->sh;
    const uint32_t g = atomic_load(&h->gen); /* before arriving: the round cannot end earlier */
    atomic_store(&h->rounds[c->base.rank], ++c->rounds);
    if (atomic_fetch_add(&h->arrived, 1) + 1 == (uint32_t)c->base.size) {
        atomic_store(&h->arrived, 0);
        atomic_fetch_add(&h->gen, 1);
        hc_futex_wake(&h->gen);
        return MT_OK;
    }
    const double t0 = mt_now(), deadline = t0 + c->p.timeout_s;
    double next_check = t0 + c->p.poll_s;
    for (;;) {
        if (atomic_load(&h->gen) != g) return MT_OK;
        if (atomic_load(&h->failed)) return hc_failed_by_peer(c, op);
        const double now = mt_now();
        if (now >= next_check) {
            mt_status st = hc_check_peers(c, op);
            if (st != MT_OK) return st;
            next_check = now + c->p.poll_s;
        }
        if (now >= deadline) {
            if (atomic_load(&h->gen) != g) return MT_OK;
            char who[256];
            hc_laggards(c, who, sizeof who);
            return hc_break(c, MT_ERR_BACKEND, "%s: timed out after %.1f s waiting for rank %s", op,
                            c->p.timeout_s, who[0] ? who : "(none: the round ended as it timed out)");
        }
        const double until = next_check < deadline ? next_check : deadline;
        hc_futex_wait(&h->gen, g, until - now);
        /* A wake without a new generation (a peer left or marked failure) checks at once. */
        if (atomic_load(&h->gen) == g) next_check = mt_now();
    }
}

/* Slot r of set s: [slot_bytes] in the mapping. */
static unsigned char *hc_slot(const hc_comm *c, unsigned s, int r) {
    return (unsigned char *)c->sh + HC_HDR_BYTES + ((size_t)s * (size_t)c->base.size + (size_t)r) * c->p.slot_bytes;
}

/* The set the next round's data goes into. */
static unsigned hc_next_set(const hc_comm *c) { return (unsigned)((c->rounds + 1) & 1); }

/* ---- collectives ---- */

static mt_status hc_all_reduce_sum(mt_comm *cm, float *buf, size_t count) {
    hc_comm *c = hc_of(cm);
    mt_status st = hc_enter(c, "all_reduce_sum");
    if (st != MT_OK || c->base.size == 1 || count == 0) return st;
    const size_t per = c->p.slot_bytes / sizeof(float);
    const int N = c->base.size;
    for (size_t off = 0; off < count; off += per) {
        const size_t n = count - off < per ? count - off : per;
        const unsigned s = hc_next_set(c);
        memcpy(hc_slot(c, s, c->base.rank), buf + off, n * sizeof(float));
        if ((st = hc_round(c, "all_reduce_sum")) != MT_OK) return st;
        /* Rank order, element by element: out = ((x0 + x1) + x2) + ..., in tiles that stay in L1. */
        enum { TILE = 2048 };
        for (size_t t = 0; t < n; t += TILE) {
            const size_t m = n - t < TILE ? n - t : TILE;
            float *out = buf + off + t;
            memcpy(out, (const float *)hc_slot(c, s, 0) + t, m * sizeof(float));
            for (int r = 1; r < N; r++) {
                const float *x = (const float *)hc_slot(c, s, r) + t;
                for (size_t i = 0; i < m; i++) out[i] += x[i];
            }
        }
    }
    return MT_OK;
}

static mt_status hc_all_gather(mt_comm *cm, const float *send, float *recv, size_t count) {
    hc_comm *c = hc_of(cm);
    mt_status st = hc_enter(c, "all_gather");
    if (st != MT_OK || count == 0) return st;
    if (c->base.size == 1) {
        if (recv != send) memmove(recv, send, count * sizeof(float));
        return MT_OK;
    }
    const size_t per = c->p.slot_bytes / sizeof(float);
    for (size_t off = 0; off < count; off += per) {
        const size_t n = count - off < per ? count - off : per;
        const unsigned s = hc_next_set(c);
        memcpy(hc_slot(c, s, c->base.rank), send + off, n * sizeof(float));
        if ((st = hc_round(c, "all_gather")) != MT_OK) return st;
        /* In place (send == recv + rank * count), rank `rank`'s copy rewrites the same values and
         * the others land outside send. */
        for (int r = 0; r < c->base.size; r++)
            memcpy(recv + (size_t)r * count + off, hc_slot(c, s, r), n * sizeof(float));
    }
    return MT_OK;
}

static mt_status hc_broadcast(mt_comm *cm, void *buf, size_t bytes, int root) {
    hc_comm *c = hc_of(cm);
    if (root < 0 || root >= c->base.size)
        return mt_errorf(&c->base.err, MT_ERR_INVALID, "comm host %s: broadcast: root %d not in [0, %d)", c->name,
                         root, c->base.size);
    mt_status st = hc_enter(c, "broadcast");
    if (st != MT_OK || c->base.size == 1 || bytes == 0) return st;
    /* A round carries a whole set (every slot of it, contiguous) from the root. */
    const size_t per = c->p.slot_bytes * (size_t)c->base.size;
    unsigned char *b = (unsigned char *)buf;
    for (size_t off = 0; off < bytes; off += per) {
        const size_t n = bytes - off < per ? bytes - off : per;
        const unsigned s = hc_next_set(c);
        if (c->base.rank == root) memcpy(hc_slot(c, s, 0), b + off, n);
        if ((st = hc_round(c, "broadcast")) != MT_OK) return st;
        if (c->base.rank != root) memcpy(b + off, hc_slot(c, s, 0), n);
    }
    return MT_OK;
}

static mt_status hc_barrier(mt_comm *cm) {
    hc_comm *c = hc_of(cm);
    mt_status st = hc_enter(c, "barrier");
    if (st != MT_OK || c->base.size == 1) return st;
    return hc_round(c, "barrier");
}

/* The known failure, or one found now among the peers (a dead or departed rank). */
static mt_status hc_check(mt_comm *cm) {
    hc_comm *c = hc_of(cm);
    mt_status st = hc_enter(c, "check");
    if (st != MT_OK || c->base.size == 1) return st;
    return hc_check_peers(c, "check");
}

static void hc_destroy(mt_comm *cm) {
    hc_comm *c = hc_of(cm);
    if (!c) return;
    if (c->sh) {
        /* Peers waiting for this rank fail at once instead of at their timeout. */
        atomic_store(&c->sh->left[c->base.rank], 1);
        hc_futex_wake(&c->sh->gen);
        hc_futex_wake(&c->sh->joined);
        munmap(c->sh, c->map_bytes);
    }
    for (int r = 0; r < MT_COMM_HOST_MAX_RANKS; r++)
        if (c->pidfd[r] >= 0) close(c->pidfd[r]);
    free(c);
}

static const mt_comm_ops hc_ops = {
    .name = "host",
    .destroy = hc_destroy,
    .all_reduce_sum = hc_all_reduce_sum,
    .all_gather = hc_all_gather,
    .broadcast = hc_broadcast,
    .barrier = hc_barrier,
    .check = hc_check,
};

/* ---- forming the group ---- */

mt_comm_host_params mt_comm_host_default_params(void) {
    return (mt_comm_host_params){
        .dir = "/dev/shm",
        .timeout_s = 30.0,
        .poll_s = 0.1,
        .slot_bytes = (size_t)1 << 20,
    };
}

static bool hc_name_ok(const char *name) {
    const size_t n = strlen(name);
    if (n == 0 || n > HC_NAME_MAX || name[0] == '.') return false;
    for (size_t i = 0; i < n; i++) {
        const char ch = name[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '.' ||
              ch == '_' || ch == '-'))
            return false;
    }
    return true;
}

/* Removes <dir>/<name>.tmp.<pid> files whose creator is gone (killed between making the file and
 * renaming it). */
static void hc_remove_dead_temps(const char *dir, const char *name) {
    DIR *d = opendir(dir);
    if (!d) return;
    char prefix[HC_NAME_MAX + 8];
    snprintf(prefix, sizeof prefix, "%s.tmp.", name);
    const size_t pl = strlen(prefix);
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, prefix, pl)) continue;
        char *end = NULL;
        const long pid = strtol(e->d_name + pl, &end, 10);
        if (!end || *end || pid <= 0 || hc_pid_alive((pid_t)pid)) continue;
        char path[PATH_MAX];
        if (snprintf(path, sizeof path, "%s/%s", dir, e->d_name) < (int)sizeof path) (void)unlink(path);
    }
    closedir(d);
}

/* Rank 0: makes the file under a temporary name, fills the header, renames it into place. */
static mt_status hc_create(hc_comm *c, const char *path, mt_error *err) {
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid()) >= (int)sizeof tmp)
        return mt_errorf(err, MT_ERR_INVALID, "comm host: path %s too long", path);
    hc_remove_dead_temps(c->p.dir, c->name);
    mt_status st = MT_ERR_IO;
    int fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) return mt_errorf(err, MT_ERR_IO, "comm host: create %s: %s", tmp, strerror(errno));
    int e = posix_fallocate(fd, 0, (off_t)c->map_bytes);
    if (e) {
        mt_errorf(err, e == ENOSPC ? MT_ERR_NOMEM : MT_ERR_IO, "comm host: reserve %zu bytes in %s: %s", c->map_bytes,
                  c->p.dir, strerror(e));
        st = e == ENOSPC ? MT_ERR_NOMEM : MT_ERR_IO;
        goto fail;
    }
    void *m = mmap(NULL, c->map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        mt_errorf(err, MT_ERR_IO, "comm host: mmap %s: %s", tmp, strerror(errno));
        goto fail;
    }
    c->sh = (hc_shared *)m;
    hc_shared *h = c->sh;
    h->magic = HC_MAGIC;
    h->version = HC_VERSION;
    h->size = (uint32_t)c->base.size;
    h->creator_pid = (int32_t)getpid();
    h->slot_bytes = c->p.slot_bytes;
    atomic_store(&h->pid[0], (int32_t)getpid());
    atomic_store(&h->joined, 1);
    if (rename(tmp, path) != 0) {
        mt_errorf(err, MT_ERR_IO, "comm host: rename %s to %s: %s", tmp, path, strerror(errno));
        goto fail;
    }
    close(fd);
    return MT_OK;
fail:
    close(fd);
    (void)unlink(tmp);
    return st;
}

/* Rank > 0: opens the file once it exists and its creator lives, checks it was made for this
 * group's shape, maps it and claims the rank. MT_ERR_NOT_FOUND: not there yet (retry). */
static mt_status hc_join_once(hc_comm *c, const char *path, mt_error *err) {
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT) return MT_ERR_NOT_FOUND;
        return mt_errorf(err, MT_ERR_IO, "comm host: open %s: %s", path, strerror(errno));
    }
    mt_status st = MT_ERR_NOT_FOUND;
    struct stat sb;
    void *m = MAP_FAILED;
    if (fstat(fd, &sb) != 0 || (size_t)sb.st_size < sizeof(hc_shared)) goto out;
    m = mmap(NULL, (size_t)sb.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        st = mt_errorf(err, MT_ERR_IO, "comm host: mmap %s: %s", path, strerror(errno));
        goto out;
    }
    hc_shared *h = (hc_shared *)m;
    /* A file whose maker is gone is a leftover: wait for the new rank 0 to replace it. */
    if (h->magic != HC_MAGIC || !hc_pid_alive(h->creator_pid)) goto out;
    if (h->version != HC_VERSION || h->size != (uint32_t)c->base.size || h->slot_bytes != c->p.slot_bytes ||
        (size_t)sb.st_size != c->map_bytes) {
        st = mt_errorf(err, MT_ERR_INVALID,
                       "comm host: group %s was made for %u ranks of %llu-byte slots (version %u), rank %d expects %d "
                       "of %zu (version %d)",
                       c->name, h->size, (unsigned long long)h->slot_bytes, h->version, c->base.rank, c->base.size,
                       c->p.slot_bytes, HC_VERSION);
        goto out;
    }
    int32_t none = 0;
    if (!atomic_compare_exchange_strong(&h->pid[c->base.rank], &none, (int32_t)getpid())) {
        st = mt_errorf(err, MT_ERR_INVALID, "comm host: rank %d of group %s is already taken by pid %d",
                       c->base.rank, c->name, (int)none);
        goto out;
    }
    atomic_fetch_add(&h->joined, 1);
    hc_futex_wake(&h->joined);
    c->sh = h;
    m = MAP_FAILED; /* kept */
    st = MT_OK;
out:
    if (m != MAP_FAILED) munmap(m, (size_t)sb.st_size);
    close(fd);
    return st;
}

/* Waits until every rank has joined; opens a pidfd of each peer. */
static mt_status hc_wait_joined(hc_comm *c, double deadline, mt_error *err) {
    hc_shared *h = c->sh;
    const uint32_t N = (uint32_t)c->base.size;
    for (;;) {
        const uint32_t j = atomic_load(&h->joined);
        if (j >= N) break;
        mt_status st = MT_OK;
        if (atomic_load(&h->failed)) {
            st = hc_failed_by_peer(c, "forming the group");
        } else {
            for (int r = 0; r < c->base.size && st == MT_OK; r++) {
                const pid_t pid = atomic_load(&h->pid[r]);
                if (r != c->base.rank && pid && !hc_pid_alive(pid))
                    st = hc_break(c, MT_ERR_BACKEND, "forming the group: rank %d (pid %d) died", r, (int)pid);
            }
        }
        if (st == MT_OK && mt_now() >= deadline) {
            char who[256] = "";
            size_t n = 0;
            for (int r = 0; r < c->base.size && n + 1 < sizeof who; r++)
                if (!atomic_load(&h->pid[r])) {
                    int k = snprintf(who + n, sizeof who - n, "%s%d", n ? ", " : "", r);
                    if (k < 0) break;
                    n += (size_t)k;
                }
            st = hc_break(c, MT_ERR_BACKEND, "forming the group: timed out after %.1f s waiting for rank %s to join",
                          c->p.timeout_s, who);
        }
        if (st != MT_OK) return mt_errorf(err, st, "%s", c->base.err.msg);
        const double left = deadline - mt_now();
        hc_futex_wait(&h->joined, j, left < c->p.poll_s ? left : c->p.poll_s);
    }
    for (int r = 0; r < c->base.size; r++) {
        if (r == c->base.rank) continue;
        const pid_t pid = atomic_load(&h->pid[r]);
        c->pidfd[r] = (int)syscall(SYS_pidfd_open, pid, 0);
        if (c->pidfd[r] < 0 && errno == ESRCH) {
            mt_status st = hc_break(c, MT_ERR_BACKEND, "forming the group: rank %d (pid %d) died", r, (int)pid);
            return mt_errorf(err, st, "%s", c->base.err.msg);
        }
    }
    return MT_OK;
}

mt_comm *mt_comm_host_new(const char *name, int rank, int size, const mt_comm_host_params *params, mt_error *err) {
    const mt_comm_host_params p = params ? *params : mt_comm_host_default_params();
    if (!name || !hc_name_ok(name)) {
        mt_errorf(err, MT_ERR_INVALID, "comm host: group name \"%s\": expected 1..%d of [A-Za-z0-9._-], not starting "
                  "with '.'", name ? name : "(null)", HC_NAME_MAX);
        return NULL;
    }
    if (size < 1 || size > MT_COMM_HOST_MAX_RANKS || rank < 0 || rank >= size) {
        mt_errorf(err, MT_ERR_INVALID, "comm host %s: rank %d of %d: expected 0 <= rank < size <= %d", name, rank, size,
                  MT_COMM_HOST_MAX_RANKS);
        return NULL;
    }
    if (!(p.timeout_s > 0) || !(p.poll_s > 0) || p.slot_bytes < 64 || p.slot_bytes % 64 ||
        p.slot_bytes > ((size_t)1 << 34) / (size_t)size || !p.dir || !p.dir[0]) {
        mt_errorf(err, MT_ERR_INVALID, "comm host %s: params: timeout_s %g and poll_s %g must be > 0, slot_bytes %zu "
                  "a multiple of 64 (at most 16 GiB over all slots), dir set", name, p.timeout_s, p.poll_s, p.slot_bytes);
        return NULL;
    }
    hc_comm *c = (hc_comm *)calloc(1, sizeof *c);
    if (!c) {
        mt_errorf(err, MT_ERR_NOMEM, "comm host %s: out of memory", name);
        return NULL;
    }
    c->base.ops = &hc_ops;
    c->base.rank = rank;
    c->base.size = size;
    c->p = p;
    snprintf(c->name, sizeof c->name, "%s", name);
    for (int r = 0; r < MT_COMM_HOST_MAX_RANKS; r++) c->pidfd[r] = -1;
    if (size == 1) return &c->base;

    char path[PATH_MAX];
    bool created = false;
    if (snprintf(path, sizeof path, "%s/%s", p.dir, name) >= (int)sizeof path - 32) {
        mt_errorf(err, MT_ERR_INVALID, "comm host %s: folder %s too long", name, p.dir);
        goto fail;
    }
    c->map_bytes = HC_HDR_BYTES + 2 * (size_t)size * p.slot_bytes;
    const double deadline = mt_now() + p.timeout_s;
    if (rank == 0) {
        if (hc_create(c, path, err) != MT_OK) goto fail;
        created = true;
    } else {
        for (;;) {
            mt_status st = hc_join_once(c, path, err);
            if (st == MT_OK) break;
            if (st != MT_ERR_NOT_FOUND) goto fail;
            if (mt_now() >= deadline) {
                mt_errorf(err, MT_ERR_BACKEND, "comm host %s rank %d: forming the group: timed out after %.1f s "
                          "waiting for rank 0 to create %s", name, rank, p.timeout_s, path);
                goto fail;
            }
            hc_sleep(0.002);
        }
    }
    if (hc_wait_joined(c, deadline, err) != MT_OK) goto fail;
    if (rank == 0) (void)unlink(path); /* every rank has it mapped: nothing to leave behind */
    return &c->base;
fail:
    if (created) (void)unlink(path);
    hc_destroy(&c->base);
    return NULL;
}
