/* common/wire.c: see wire.h. One envelope per ZeroMQ message; a ROUTER message is two frames
 * (peer identity, envelope bytes), a DEALER message one frame. */
#include "common/wire.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/ipc.h"

#define ZAP_ENDPOINT "inproc://zeromq.zap.01" /* where libzmq looks for a ZAP handler (RFC 27) */
#define EVENTS_ENDPOINT "inproc://mt-wire-events"
#define LOG_EVERY_S 1.0 /* handshake failures and refused keys: one log line a second at most */

struct mt_wire_sock {
    void *ctx;           /* owned: one context per socket keeps ownership simple */
    void *sock;
    mt_wire_kind kind;
    /* ROUTER: the socket monitor's events (PAIR), and failed handshakes whose disconnect has
     * not been seen yet (a failed handshake closes its connection too; that one is no peer's). */
    void *events;
    int unmatched_failures;
    double last_failure_log;
    /* ROUTER with curve_clients: the ZAP handler, its socket owned by zap_thread. */
    void *zap;
    pthread_t zap_thread;
    bool zap_running;
    uint8_t (*clients)[32];
    size_t n_clients;
};

mt_wire_params mt_wire_default_params(void) { return (mt_wire_params){ 0 }; }

/* ipc://, inproc://, and tcp://127.0.0.1:PORT with nothing after the port (a connect endpoint
 * "tcp://127.0.0.1:0;HOST:PORT" would reach another host from a loopback source address). */
static bool endpoint_internal(const char *ep) {
    if (!strncmp(ep, "ipc://", 6) || !strncmp(ep, "inproc://", 9)) return true;
    static const char lo[] = "tcp://127.0.0.1:";
    if (strncmp(ep, lo, sizeof lo - 1)) return false;
    const char *port = ep + sizeof lo - 1;
    if (!strcmp(port, "*")) return true;
    if (!*port || strlen(port) > 5) return false;
    for (const char *c = port; *c; c++)
        if (*c < '0' || *c > '9') return false;
    return true;
}

/* A ROUTER's ipc:// endpoint: a path in a private folder (made when missing), with a stale
 * socket there removed (common/ipc.h). */
static mt_status ipc_prepare(const char *endpoint, mt_error *err) {
    const char *path = endpoint + 6;
    if (!*path || *path == '@' || !strcmp(path, "*"))
        return mt_errorf(err, MT_ERR_INVALID,
                         "wire: endpoint \"%s\": name a socket path (an abstract or wildcard ipc socket has no "
                         "folder to keep it private)", endpoint);
    char dir[PATH_MAX];
    if (strlen(path) >= sizeof dir) return mt_errorf(err, MT_ERR_INVALID, "wire: endpoint \"%s\" is too long", endpoint);
    strcpy(dir, path);
    char *slash = strrchr(dir, '/');
    if (!slash) strcpy(dir, ".");
    else if (slash == dir) dir[1] = 0; /* "/name": the root folder (refused below: not ours) */
    else *slash = 0;
    mt_status st = mt_ipc_dir_private(dir, err);
    return st ? st : mt_ipc_clear_stale(path, err);
}

/* A z85 key of MT_WIRE_KEY_Z85 characters that decodes into bin[32] (NULL: only checked). */
static bool key_ok(const char *z85, uint8_t *bin) {
    uint8_t tmp[32];
    return z85 && strlen(z85) == MT_WIRE_KEY_Z85 && zmq_z85_decode(bin ? bin : tmp, z85) != NULL;
}

/* ---- ZAP: admits the CURVE clients whose public key is listed ---- */

/* Receives one multi-frame request into f[] (up to cap frames; extra frames are dropped). The
 * frame count kept, or -1 when the context is shutting down. */
static int zap_recv(void *rep, zmq_msg_t *f, int cap) {
    int n = 0, more = 1;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, rep, 0) < 0) {
            zmq_msg_close(&m);
            if (zmq_errno() == EINTR) continue;
            for (int i = 0; i < n && i < cap; i++) zmq_msg_close(&f[i]);
            return -1; /* ETERM: mt_wire_close shut the context down */
        }
        more = zmq_msg_more(&m);
        if (n < cap) f[n] = m;
        else zmq_msg_close(&m);
        n++;
    }
    return n < cap ? n : cap;
}

static void *zap_main(void *arg) {
    mt_wire_sock *s = arg;
    double last_log = 0;
    for (;;) {
        /* version, request id, domain, address, identity, mechanism, credentials... */
        zmq_msg_t f[8];
        const int n = zap_recv(s->zap, f, 8);
        if (n < 0) break;
        const char *status = "400", *text = "public key not authorized";
        if (n >= 7 && zmq_msg_size(&f[5]) == 5 && !memcmp(zmq_msg_data(&f[5]), "CURVE", 5) &&
            zmq_msg_size(&f[6]) == 32) {
            for (size_t i = 0; i < s->n_clients; i++) {
                if (!memcmp(zmq_msg_data(&f[6]), s->clients[i], 32)) {
                    status = "200";
                    text = "OK";
                }
            }
            if (*status != '2' && mt_now() - last_log >= LOG_EVERY_S) {
                char z85[MT_WIRE_KEY_Z85 + 1];
                zmq_z85_encode(z85, zmq_msg_data(&f[6]), 32);
                mt_log(MT_LOG_WARN, "wire: refused a worker connection with CURVE key %s (not an authorized key)", z85);
                last_log = mt_now();
            }
        } else {
            status = "500";
            text = "not a CURVE request";
        }
        /* reply: version, request id, status code, status text, user id, metadata */
        const char *frames[6] = { "1.0", NULL, status, text, "", "" };
        for (int i = 0; i < 6; i++) {
            const int flags = i < 5 ? ZMQ_SNDMORE : 0;
            if (i == 1) zmq_send(s->zap, n > 1 ? zmq_msg_data(&f[1]) : "", n > 1 ? zmq_msg_size(&f[1]) : 0, flags);
            else zmq_send(s->zap, frames[i], strlen(frames[i]), flags);
        }
        for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
    }
    zmq_close(s->zap);
    return NULL;
}

/* Binds the ZAP handler with the clients' keys and starts its thread. */
static mt_status zap_start(mt_wire_sock *s, const mt_wire_params *p, mt_error *err) {
    if (!(s->clients = calloc(p->n_curve_clients ? p->n_curve_clients : 1, sizeof *s->clients)))
        return mt_errorf(err, MT_ERR_NOMEM, "wire: out of memory for %zu keys", p->n_curve_clients);
    for (size_t i = 0; i < p->n_curve_clients; i++)
        if (!key_ok(p->curve_clients[i], s->clients[i]))
            return mt_errorf(err, MT_ERR_INVALID, "wire: authorized key %zu is not a %d-character z85 key", i + 1,
                             MT_WIRE_KEY_Z85);
    s->n_clients = p->n_curve_clients;
    int zero = 0;
    if (!(s->zap = zmq_socket(s->ctx, ZMQ_REP)) || zmq_setsockopt(s->zap, ZMQ_LINGER, &zero, sizeof zero) ||
        zmq_bind(s->zap, ZAP_ENDPOINT))
        return mt_errorf(err, MT_ERR_IO, "wire: ZAP handler: %s", zmq_strerror(zmq_errno()));
    if (pthread_create(&s->zap_thread, NULL, zap_main, s))
        return mt_errorf(err, MT_ERR_IO, "wire: cannot start the ZAP thread");
    s->zap_running = true; /* the thread owns s->zap from here on */
    return MT_OK;
}

/* ---- sockets ---- */

/* ROUTER: the monitor of connection closes and failed handshakes, read with a PAIR socket. */
static mt_status events_start(mt_wire_sock *s, mt_error *err) {
    const int events = ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                       ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH;
    int zero = 0;
    if (zmq_socket_monitor(s->sock, EVENTS_ENDPOINT, events) || !(s->events = zmq_socket(s->ctx, ZMQ_PAIR)) ||
        zmq_setsockopt(s->events, ZMQ_LINGER, &zero, sizeof zero) || zmq_connect(s->events, EVENTS_ENDPOINT))
        return mt_errorf(err, MT_ERR_IO, "wire: socket monitor: %s", zmq_strerror(zmq_errno()));
    return MT_OK;
}

static mt_status set_curve(mt_wire_sock *s, const mt_wire_params *p, mt_error *err) {
    if (!mt_wire_has_curve())
        return mt_errorf(err, MT_ERR_STATE, "wire: CURVE keys given, but this libzmq has no CURVE");
    if (!key_ok(p->curve_secret_key, NULL))
        return mt_errorf(err, MT_ERR_INVALID, "wire: the CURVE secret key is not a %d-character z85 key",
                         MT_WIRE_KEY_Z85);
    const size_t klen = MT_WIRE_KEY_Z85 + 1; /* z85 text with its NUL */
    if (s->kind == MT_WIRE_ROUTER) {
        int one = 1;
        if (zmq_setsockopt(s->sock, ZMQ_CURVE_SERVER, &one, sizeof one) ||
            zmq_setsockopt(s->sock, ZMQ_CURVE_SECRETKEY, p->curve_secret_key, klen))
            return mt_errorf(err, MT_ERR_IO, "wire: CURVE server: %s", zmq_strerror(zmq_errno()));
        if (!p->curve_clients) return MT_OK; /* no ZAP handler: libzmq admits every CURVE client */
        if (zmq_setsockopt(s->sock, ZMQ_ZAP_DOMAIN, "metrale", 7))
            return mt_errorf(err, MT_ERR_IO, "wire: ZAP domain: %s", zmq_strerror(zmq_errno()));
        return zap_start(s, p, err);
    }
    if (!key_ok(p->curve_server_key, NULL))
        return mt_errorf(err, MT_ERR_INVALID, "wire: the router's CURVE public key is %s",
                         p->curve_server_key ? "not a 40-character z85 key" : "missing");
    char pub[MT_WIRE_KEY_Z85 + 1];
    mt_status st = mt_wire_key_public(p->curve_secret_key, pub, err);
    if (st) return st;
    if (zmq_setsockopt(s->sock, ZMQ_CURVE_SERVERKEY, p->curve_server_key, klen) ||
        zmq_setsockopt(s->sock, ZMQ_CURVE_PUBLICKEY, pub, klen) ||
        zmq_setsockopt(s->sock, ZMQ_CURVE_SECRETKEY, p->curve_secret_key, klen))
        return mt_errorf(err, MT_ERR_IO, "wire: CURVE client: %s", zmq_strerror(zmq_errno()));
    return MT_OK;
}

mt_status mt_wire_open(mt_wire_kind kind, const char *endpoint, const mt_wire_params *params, mt_wire_sock **out,
                       mt_error *err) {
    *out = NULL;
    const mt_wire_params p = params ? *params : mt_wire_default_params();
    const bool curve = p.curve_secret_key != NULL;
    if (!endpoint || !(endpoint_internal(endpoint) || (curve && !strncmp(endpoint, "tcp://", 6))))
        return mt_errorf(err, MT_ERR_INVALID,
                         "wire: endpoint \"%s\" is not internal (ipc:// or tcp://127.0.0.1:); another host's "
                         "tcp:// endpoint needs CURVE keys", endpoint ? endpoint : "(null)");
    if (kind == MT_WIRE_DEALER && (!p.identity || !*p.identity || strlen(p.identity) >= MT_WIRE_PEER_MAX))
        return mt_errorf(err, MT_ERR_INVALID, "wire: a DEALER needs an identity of 1..%d bytes", MT_WIRE_PEER_MAX - 1);
    if (kind == MT_WIRE_ROUTER && !strncmp(endpoint, "ipc://", 6)) {
        mt_status st = ipc_prepare(endpoint, err);
        if (st) return st;
    }
    mt_wire_sock *s = calloc(1, sizeof *s);
    if (!s) return mt_errorf(err, MT_ERR_NOMEM, "wire: out of memory");
    s->kind = kind;
    mt_status st = MT_ERR_IO;
    if (!(s->ctx = zmq_ctx_new())) goto fail;
    if (!(s->sock = zmq_socket(s->ctx, kind == MT_WIRE_ROUTER ? ZMQ_ROUTER : ZMQ_DEALER))) goto fail;
    int hwm = MT_WIRE_HWM, zero = 0, one = 1;
    if (zmq_setsockopt(s->sock, ZMQ_SNDHWM, &hwm, sizeof hwm) || zmq_setsockopt(s->sock, ZMQ_RCVHWM, &hwm, sizeof hwm) ||
        zmq_setsockopt(s->sock, ZMQ_LINGER, &zero, sizeof zero))
        goto fail;
    if (curve && (st = set_curve(s, &p, err)) != MT_OK) {
        mt_wire_close(s);
        return st;
    }
    st = MT_ERR_IO;
    if (kind == MT_WIRE_ROUTER) {
        if (zmq_setsockopt(s->sock, ZMQ_ROUTER_MANDATORY, &one, sizeof one)) goto fail;
        if ((st = events_start(s, err)) != MT_OK) {
            mt_wire_close(s);
            return st;
        }
        st = MT_ERR_IO;
        if (zmq_bind(s->sock, endpoint)) goto fail;
    } else {
        /* A DEALER send waits up to MT_WIRE_DEALER_SEND_MS for the connection (right after
         * connect, or while the router restarts) instead of failing at once. */
        int snd_ms = MT_WIRE_DEALER_SEND_MS;
        if (zmq_setsockopt(s->sock, ZMQ_ROUTING_ID, p.identity, strlen(p.identity)) ||
            zmq_setsockopt(s->sock, ZMQ_IMMEDIATE, &one, sizeof one) ||
            zmq_setsockopt(s->sock, ZMQ_SNDTIMEO, &snd_ms, sizeof snd_ms))
            goto fail;
        if (zmq_connect(s->sock, endpoint)) goto fail;
    }
    *out = s;
    return MT_OK;
fail:
    st = mt_errorf(err, st, "wire: %s %s: %s", kind == MT_WIRE_ROUTER ? "bind" : "connect", endpoint,
                   zmq_strerror(zmq_errno()));
    mt_wire_close(s);
    return st;
}

void mt_wire_close(mt_wire_sock *s) {
    if (!s) return;
    if (s->sock) zmq_close(s->sock);
    if (s->events) zmq_close(s->events);
    if (s->zap_running) {
        zmq_ctx_shutdown(s->ctx); /* the ZAP thread's receive fails with ETERM; it closes its socket */
        pthread_join(s->zap_thread, NULL);
    } else if (s->zap) {
        zmq_close(s->zap);
    }
    if (s->ctx) zmq_ctx_term(s->ctx);
    free(s->clients);
    free(s);
}

void mt_wire_endpoint(mt_wire_sock *s, char *out, size_t len) {
    if (!len) return;
    size_t n = len;
    if (zmq_getsockopt(s->sock, ZMQ_LAST_ENDPOINT, out, &n)) out[0] = 0;
    out[len - 1] = 0;
}

int mt_wire_event_fd(mt_wire_sock *s) {
    int fd = -1;
    size_t len = sizeof fd;
    if (!s->events || zmq_getsockopt(s->events, ZMQ_FD, &fd, &len)) return -1;
    return fd;
}

int mt_wire_take_disconnects(mt_wire_sock *s) {
    if (!s->events) return 0;
    int closed = 0;
    for (;;) {
        /* an event is two frames: 6 bytes (uint16 event, uint32 value), then the endpoint */
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, s->events, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            break;
        }
        uint16_t event = 0;
        if (zmq_msg_size(&m) >= 2) memcpy(&event, zmq_msg_data(&m), 2);
        const bool more = zmq_msg_more(&m);
        zmq_msg_close(&m);
        if (more) {
            zmq_msg_init(&m);
            zmq_msg_recv(&m, s->events, 0); /* the second frame follows the first at once */
            zmq_msg_close(&m);
        }
        if (event == ZMQ_EVENT_DISCONNECTED) {
            if (s->unmatched_failures > 0) s->unmatched_failures--;
            else closed++;
        } else {
            s->unmatched_failures++;
            const double now = mt_now();
            if (now - s->last_failure_log >= LOG_EVERY_S) {
                const bool auth = event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH;
                mt_log(MT_LOG_WARN, "wire: a worker connection failed its handshake (%s)",
                       auth ? "its CURVE key is not authorized" : "missing or wrong CURVE keys, or not a metrale worker");
                s->last_failure_log = now;
            }
        }
    }
    return closed;
}

/* ---- keys ---- */

bool mt_wire_has_curve(void) { return zmq_has("curve") != 0; }

mt_status mt_wire_keypair(char *pub, char *secret, mt_error *err) {
    if (!mt_wire_has_curve() || zmq_curve_keypair(pub, secret))
        return mt_errorf(err, MT_ERR_STATE, "wire: this libzmq cannot make CURVE keys (%s)", zmq_strerror(zmq_errno()));
    return MT_OK;
}

mt_status mt_wire_key_public(const char *secret, char *pub, mt_error *err) {
    if (!mt_wire_has_curve()) return mt_errorf(err, MT_ERR_STATE, "wire: this libzmq has no CURVE");
    if (!key_ok(secret, NULL) || zmq_curve_public(pub, secret))
        return mt_errorf(err, MT_ERR_INVALID, "wire: not a %d-character z85 secret key", MT_WIRE_KEY_Z85);
    return MT_OK;
}

mt_status mt_wire_key_read(const char *path, char *key, mt_error *err) {
    FILE *f = fopen(path, "r");
    if (!f) return mt_errorf(err, MT_ERR_IO, "wire: key file %s: %s", path, strerror(errno));
    char buf[256];
    const size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *a = buf;
    while (*a == ' ' || *a == '\t' || *a == '\n' || *a == '\r') a++;
    size_t len = strlen(a);
    while (len && (a[len - 1] == ' ' || a[len - 1] == '\t' || a[len - 1] == '\n' || a[len - 1] == '\r')) len--;
    if (len != MT_WIRE_KEY_Z85)
        return mt_errorf(err, MT_ERR_INVALID, "wire: key file %s: not one %d-character z85 key", path, MT_WIRE_KEY_Z85);
    memcpy(key, a, len);
    key[len] = 0;
    if (!key_ok(key, NULL))
        return mt_errorf(err, MT_ERR_INVALID, "wire: key file %s: not a z85 key", path);
    return MT_OK;
}

static int name_cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

mt_status mt_wire_keys_read_dir(const char *dir, char (**keys)[MT_WIRE_KEY_Z85 + 1], size_t *n, mt_error *err) {
    *keys = NULL;
    *n = 0;
    DIR *d = opendir(dir);
    if (!d) return mt_errorf(err, MT_ERR_IO, "wire: key folder %s: %s", dir, strerror(errno));
    char **names = NULL;
    size_t count = 0, cap = 0;
    mt_status st = MT_OK;
    struct dirent *e;
    while ((e = readdir(d))) {
        const size_t len = strlen(e->d_name);
        if (len <= 4 || strcmp(e->d_name + len - 4, ".pub")) continue;
        if (count == cap) {
            char **more = realloc(names, (cap = cap ? 2 * cap : 8) * sizeof *names);
            if (!more) { st = MT_ERR_NOMEM; break; }
            names = more;
        }
        if (!(names[count] = strdup(e->d_name))) { st = MT_ERR_NOMEM; break; }
        count++;
    }
    closedir(d);
    char (*out)[MT_WIRE_KEY_Z85 + 1] = NULL;
    if (st) {
        mt_errorf(err, st, "wire: out of memory reading %s", dir);
    } else if (!count) {
        st = mt_errorf(err, MT_ERR_NOT_FOUND, "wire: key folder %s holds no *.pub key", dir);
    } else if (!(out = calloc(count, sizeof *out))) {
        st = mt_errorf(err, MT_ERR_NOMEM, "wire: out of memory reading %s", dir);
    } else {
        qsort(names, count, sizeof *names, name_cmp);
        for (size_t i = 0; i < count && !st; i++) {
            char path[4096];
            snprintf(path, sizeof path, "%s/%s", dir, names[i]);
            st = mt_wire_key_read(path, out[i], err);
        }
    }
    for (size_t i = 0; i < count; i++) free(names[i]);
    free(names);
    if (st) {
        free(out);
        return st;
    }
    *keys = out;
    *n = count;
    return MT_OK;
}

mt_status mt_wire_send(mt_wire_sock *s, const char *peer, mt_envelope *env, mt_error *err) {
    env->version = MT_WIRE_VERSION;
    size_t n = metrale__internal__v1__envelope__get_packed_size(env);
    uint8_t stackbuf[4096], *buf = n <= sizeof stackbuf ? stackbuf : malloc(n);
    if (!buf) return mt_errorf(err, MT_ERR_NOMEM, "wire: out of memory for a %zu-byte message", n);
    metrale__internal__v1__envelope__pack(env, buf);
    mt_status st = MT_OK;
    if (s->kind == MT_WIRE_ROUTER) {
        if (!peer || zmq_send(s->sock, peer, strlen(peer), ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) {
            const int e = peer ? zmq_errno() : EHOSTUNREACH;
            st = mt_errorf(err, e == EAGAIN ? MT_ERR_FULL : MT_ERR_NOT_FOUND, "wire: send to %s: %s",
                           peer ? peer : "(no peer)", zmq_strerror(e));
            goto done;
        }
    }
    /* The router never blocks; a worker's DEALER waits up to its send timeout. */
    if (zmq_send(s->sock, buf, n, s->kind == MT_WIRE_ROUTER ? ZMQ_DONTWAIT : 0) < 0) {
        const int e = zmq_errno();
        st = mt_errorf(err, e == EAGAIN ? MT_ERR_FULL : MT_ERR_IO, "wire: send: %s", zmq_strerror(e));
    }
done:
    if (buf != stackbuf) free(buf);
    return st;
}

/* Receives one frame into msg; returns bytes or -1 (errno in zmq_errno). */
static int recv_frame(void *sock, zmq_msg_t *msg, int flags) {
    zmq_msg_init(msg);
    int n = zmq_msg_recv(msg, sock, flags);
    if (n < 0) zmq_msg_close(msg);
    return n;
}

static void drain_more(void *sock) {
    int more = 0;
    size_t len = sizeof more;
    while (!zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &len) && more) {
        zmq_msg_t m;
        if (recv_frame(sock, &m, 0) < 0) return;
        zmq_msg_close(&m);
    }
}

mt_status mt_wire_recv(mt_wire_sock *s, int timeout_ms, char *peer, mt_envelope **env, mt_error *err) {
    *env = NULL;
    zmq_pollitem_t it = { s->sock, 0, ZMQ_POLLIN, 0 };
    int rc = zmq_poll(&it, 1, timeout_ms);
    if (rc < 0) return zmq_errno() == EINTR ? MT_ERR_NOT_FOUND : mt_errorf(err, MT_ERR_IO, "wire: poll: %s", zmq_strerror(zmq_errno()));
    if (rc == 0) return MT_ERR_NOT_FOUND;
    zmq_msg_t m;
    if (s->kind == MT_WIRE_ROUTER) {
        int n = recv_frame(s->sock, &m, ZMQ_DONTWAIT);
        if (n < 0) return zmq_errno() == EAGAIN ? MT_ERR_NOT_FOUND : mt_errorf(err, MT_ERR_IO, "wire: recv: %s", zmq_strerror(zmq_errno()));
        size_t k = (size_t)n < MT_WIRE_PEER_MAX - 1 ? (size_t)n : MT_WIRE_PEER_MAX - 1;
        if (peer) {
            memcpy(peer, zmq_msg_data(&m), k);
            peer[k] = 0;
        }
        zmq_msg_close(&m);
    }
    int n = recv_frame(s->sock, &m, s->kind == MT_WIRE_ROUTER ? 0 : ZMQ_DONTWAIT);
    if (n < 0) return zmq_errno() == EAGAIN ? MT_ERR_NOT_FOUND : mt_errorf(err, MT_ERR_IO, "wire: recv: %s", zmq_strerror(zmq_errno()));
    drain_more(s->sock); /* a peer sending extra frames must not desynchronise us */
    mt_envelope *e = metrale__internal__v1__envelope__unpack(NULL, (size_t)n, zmq_msg_data(&m));
    zmq_msg_close(&m);
    if (!e) return mt_errorf(err, MT_ERR_INVALID, "wire: undecodable %d-byte message from %s", n, peer && *peer ? peer : "peer");
    if (e->version != MT_WIRE_VERSION) {
        mt_status st = mt_errorf(err, MT_ERR_INVALID, "wire: message of version %u from %s, this side speaks %d",
                                 e->version, peer && *peer ? peer : "peer", MT_WIRE_VERSION);
        mt_wire_free(e);
        return st;
    }
    *env = e;
    return MT_OK;
}

void mt_wire_free(mt_envelope *env) {
    if (env) metrale__internal__v1__envelope__free_unpacked(env, NULL);
}

int mt_wire_fd(mt_wire_sock *s) {
    int fd = -1;
    size_t len = sizeof fd;
    zmq_getsockopt(s->sock, ZMQ_FD, &fd, &len);
    return fd;
}

void mt_wire_identity(uint32_t worker_id, char out[MT_WIRE_PEER_MAX]) {
    snprintf(out, MT_WIRE_PEER_MAX, "w%u", worker_id);
}

/* ---- building messages ---- */

/* Starts m as an envelope of the given body, pointing at m->body's member for it. */
static mt_envelope *wrap(mt_wire_msg *m, Metrale__Internal__V1__Envelope__BodyCase body) {
    m->env = (mt_envelope)METRALE__INTERNAL__V1__ENVELOPE__INIT;
    m->env.body_case = body;
    switch (body) {
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_HELLO: m->env.hello = &m->body.hello; break;
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_HEARTBEAT: m->env.heartbeat = &m->body.heartbeat; break;
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_SUBMIT: m->env.submit = &m->body.submit; break;
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_ABORT: m->env.abort = &m->body.abort; break;
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_TOKENS: m->env.tokens = &m->body.tokens; break;
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_FINISHED: m->env.finished = &m->body.finished; break;
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_SHUTDOWN: m->env.shutdown = &m->body.shutdown; break;
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_TOKENIZE_CALL: m->env.tokenize_call = &m->body.tokenize_call; break;
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_TOKENIZED: m->env.tokenized = &m->body.tokenized; break;
    default: MT_ASSERT(!"an envelope body this side does not know");
    }
    return &m->env;
}

mt_envelope *mt_wire_hello(mt_wire_msg *m, uint32_t worker_id, uint32_t max_sequences,
                           Metrale__V1__ModelInfo *model) {
    Metrale__Internal__V1__Hello *h = &m->body.hello;
    *h = (Metrale__Internal__V1__Hello)METRALE__INTERNAL__V1__HELLO__INIT;
    h->worker_id = worker_id;
    h->model = model;
    h->max_sequences = max_sequences;
    return wrap(m, METRALE__INTERNAL__V1__ENVELOPE__BODY_HELLO);
}

mt_envelope *mt_wire_heartbeat(mt_wire_msg *m, uint64_t seq, Metrale__V1__WorkerStats *stats, bool hello_wanted) {
    Metrale__Internal__V1__Heartbeat *hb = &m->body.heartbeat;
    *hb = (Metrale__Internal__V1__Heartbeat)METRALE__INTERNAL__V1__HEARTBEAT__INIT;
    hb->seq = seq;
    hb->stats = stats;
    hb->hello_wanted = hello_wanted;
    return wrap(m, METRALE__INTERNAL__V1__ENVELOPE__BODY_HEARTBEAT);
}

mt_envelope *mt_wire_submit(mt_wire_msg *m, uint64_t id, Metrale__V1__GenerateRequest *request,
                            uint64_t deadline_unix_ms) {
    Metrale__Internal__V1__Submit *s = &m->body.submit;
    *s = (Metrale__Internal__V1__Submit)METRALE__INTERNAL__V1__SUBMIT__INIT;
    s->id = id;
    s->request = request;
    s->deadline_unix_ms = deadline_unix_ms;
    return wrap(m, METRALE__INTERNAL__V1__ENVELOPE__BODY_SUBMIT);
}

mt_envelope *mt_wire_abort(mt_wire_msg *m, uint64_t id, Metrale__V1__FinishReason reason) {
    Metrale__Internal__V1__Abort *a = &m->body.abort;
    *a = (Metrale__Internal__V1__Abort)METRALE__INTERNAL__V1__ABORT__INIT;
    a->id = id;
    a->reason = reason;
    return wrap(m, METRALE__INTERNAL__V1__ENVELOPE__BODY_ABORT);
}

/* protobuf-c's strings are char *; the builders only read them. */
static char *str_or_empty(const char *s) { return (char *)(s ? s : ""); }

mt_envelope *mt_wire_tokens(mt_wire_msg *m, uint64_t id, Metrale__V1__GeneratedToken **tokens, size_t n,
                            const char *text, Metrale__V1__GeneratedToken **prompt_lp, size_t n_prompt_lp) {
    Metrale__Internal__V1__Tokens *t = &m->body.tokens;
    *t = (Metrale__Internal__V1__Tokens)METRALE__INTERNAL__V1__TOKENS__INIT;
    t->id = id;
    t->n_tokens = n;
    t->tokens = tokens;
    t->text = str_or_empty(text);
    t->n_prompt_logprobs = n_prompt_lp;
    t->prompt_logprobs = n_prompt_lp ? prompt_lp : NULL;
    return wrap(m, METRALE__INTERNAL__V1__ENVELOPE__BODY_TOKENS);
}

mt_wire_end mt_wire_end_of(Metrale__V1__FinishReason reason) {
    return (mt_wire_end){ .reason = reason, .stop_token_id = -1 };
}

mt_envelope *mt_wire_finished(mt_wire_msg *m, uint64_t id, const mt_wire_end *e) {
    m->usage = (Metrale__V1__Usage)METRALE__V1__USAGE__INIT;
    m->usage.prompt_tokens = e->prompt_tokens;
    m->usage.completion_tokens = e->completion_tokens;
    m->final = (Metrale__V1__Final)METRALE__V1__FINAL__INIT;
    m->final.finish_reason = e->reason;
    m->final.usage = &m->usage;
    m->final.error_message = str_or_empty(e->message);
    if (e->stop_string) {
        m->final.stop_reason_case = METRALE__V1__FINAL__STOP_REASON_STOP_STRING;
        m->final.stop_string = str_or_empty(e->stop_string);
    } else if (e->stop_token_id >= 0) {
        m->final.stop_reason_case = METRALE__V1__FINAL__STOP_REASON_STOP_TOKEN_ID;
        m->final.stop_token_id = (uint32_t)e->stop_token_id;
    }
    if (e->verify_steps > 0) {
        m->spec = (Metrale__V1__Speculation)METRALE__V1__SPECULATION__INIT;
        m->spec.draft_tokens = e->draft_tokens;
        m->spec.accepted_tokens = e->accepted_tokens;
        m->spec.verify_steps = e->verify_steps;
        m->final.speculation = &m->spec;
    }
    Metrale__Internal__V1__Finished *f = &m->body.finished;
    *f = (Metrale__Internal__V1__Finished)METRALE__INTERNAL__V1__FINISHED__INIT;
    f->id = id;
    f->final = &m->final;
    f->text = str_or_empty(e->text);
    f->invalid_argument = e->invalid_argument;
    return wrap(m, METRALE__INTERNAL__V1__ENVELOPE__BODY_FINISHED);
}

mt_envelope *mt_wire_tokenize_call(mt_wire_msg *m, uint64_t id, Metrale__V1__TokenizeRequest *request) {
    Metrale__Internal__V1__TokenizeCall *c = &m->body.tokenize_call;
    *c = (Metrale__Internal__V1__TokenizeCall)METRALE__INTERNAL__V1__TOKENIZE_CALL__INIT;
    c->id = id;
    c->request = request;
    return wrap(m, METRALE__INTERNAL__V1__ENVELOPE__BODY_TOKENIZE_CALL);
}

mt_envelope *mt_wire_tokenized(mt_wire_msg *m, uint64_t id, Metrale__V1__TokenizeResponse *response,
                               const char *error) {
    Metrale__Internal__V1__Tokenized *t = &m->body.tokenized;
    *t = (Metrale__Internal__V1__Tokenized)METRALE__INTERNAL__V1__TOKENIZED__INIT;
    t->id = id;
    t->response = response;
    t->error = str_or_empty(error);
    return wrap(m, METRALE__INTERNAL__V1__ENVELOPE__BODY_TOKENIZED);
}

mt_envelope *mt_wire_shutdown(mt_wire_msg *m) {
    m->body.shutdown = (Metrale__Internal__V1__Shutdown)METRALE__INTERNAL__V1__SHUTDOWN__INIT;
    return wrap(m, METRALE__INTERNAL__V1__ENVELOPE__BODY_SHUTDOWN);
}
