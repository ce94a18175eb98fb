/* router/main.c: the metrale-router process.
 *
 *   metrale-router --listen 127.0.0.1:PORT --workers-endpoint ipc:///tmp/dir/x.sock
 *                  [--queue N] [--drain-timeout S] [--metrics HOST:PORT]
 *                  [--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]]
 *                  [--auth-token-file FILE] [--health-listen HOST:PORT]
 *                  [--curve-secret-key FILE [--curve-authorized-keys DIR]]
 *                  [--log-format text|json] [--log-prompts]
 *
 * SIGTERM or SIGINT drains (router.h) and exits 0; SIGHUP reads the TLS files and the token file
 * again. Exit 2 on bad arguments, 1 when the router cannot start (a TLS or token file that fails
 * its checks included) or its loop fails. The only place that exits.
 */
#include <errno.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include "common/mt.h"
#include "common/wire.h"
#include "router/router.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: metrale-router --listen HOST:PORT --workers-endpoint ENDPOINT [--queue N] [--drain-timeout S]\n"
            "                      [--metrics HOST:PORT]\n"
            "                      [--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]]\n"
            "                      [--auth-token-file FILE] [--health-listen HOST:PORT]\n"
            "                      [--curve-secret-key FILE [--curve-authorized-keys DIR]]\n"
            "                      [--log-format text|json] [--log-prompts]\n"
            "  --listen HOST:PORT          gRPC address (port 0: any free port, printed at start)\n"
            "  --workers-endpoint ENDPOINT ZeroMQ endpoint the workers connect to: ipc://DIR/NAME (DIR private to\n"
            "                              this user: made mode 0700 if missing), tcp://127.0.0.1:PORT, or with\n"
            "                              CURVE any tcp://ADDRESS:PORT (port *: any free port, printed)\n"
            "  --tls-cert FILE             serve gRPC over TLS with this PEM certificate chain (server's first)\n"
            "  --tls-key FILE              ... and this PEM private key\n"
            "  --tls-client-ca FILE        mutual TLS: clients must present a certificate signed by a CA in FILE\n"
            "  --auth-token-file FILE      every call but grpc.health.v1's needs \"authorization: Bearer TOKEN\",\n"
            "                              TOKEN the first line of FILE; others get UNAUTHENTICATED\n"
            "  --health-listen HOST:PORT   also serve grpc.health.v1 alone, in plaintext, on this address (for\n"
            "                              probes that carry no client certificate or token)\n"
            "  SIGHUP reads the TLS files and the token file again: new connections and calls use them.\n"
            "  --queue N                   admitted requests that may wait for a worker (default 1024)\n"
            "  --drain-timeout S           seconds running streams may finish after SIGTERM (default 30)\n"
            "  --metrics HOST:PORT         serve Prometheus metrics over HTTP at http://HOST:PORT/metrics\n"
            "                              (port 0: any free port, printed at start)\n"
            "  --curve-secret-key FILE     encrypt the workers' link with ZeroMQ CURVE; FILE holds the router's\n"
            "                              secret key (metrale-keygen); workers need its public key\n"
            "  --curve-authorized-keys DIR admit only the workers whose public key is a *.pub file in DIR\n"
            "                              (default: any worker that has the router's public key)\n"
            "  --log-format text|json      log lines as text (default) or one JSON object a line (common/mt.h)\n"
            "  --log-prompts               put the prompts in the log's admitted records (default: never)\n");
}

static int parse_size(const char *s, size_t *out) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || s[0] == '-' || v > 1000000) return -1;
    *out = (size_t)v;
    return 0;
}

static int parse_seconds(const char *s, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= 0 && v <= 86400)) return -1;
    *out = v;
    return 0;
}

int main(int argc, char **argv) {
    rtr_router_params p = rtr_router_default_params();
    bool have_listen = false, have_ep = false;
    const char *secret_file = NULL, *clients_dir = NULL;
    mt_log_set_component("router", "router: ");
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--log-prompts")) { /* logging: a flag, the one option without a value */
            p.log_prompts = true;
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "metrale-router: %s needs a value (or is an unknown option)\n", a);
            usage(stderr);
            return 2;
        }
        const char *v = argv[++i];
        if (!strcmp(a, "--listen")) {
            p.listen = v;
            have_listen = true;
        } else if (!strcmp(a, "--workers-endpoint")) {
            p.workers_endpoint = v;
            have_ep = true;
        } else if (!strcmp(a, "--queue")) {
            if (parse_size(v, &p.queue_capacity)) {
                fprintf(stderr, "metrale-router: --queue %s: must be an integer in [0, 1000000]\n", v);
                return 2;
            }
        } else if (!strcmp(a, "--log-format")) {
            mt_log_format fmt;
            if (!mt_log_format_parse(v, &fmt)) {
                fprintf(stderr, "metrale-router: --log-format must be text or json, got %s\n", v);
                return 2;
            }
            mt_log_set_format(fmt);
        } else if (!strcmp(a, "--metrics")) {
            p.metrics_listen = v;
        } else if (!strcmp(a, "--tls-cert")) {
            p.tls_cert_file = v;
        } else if (!strcmp(a, "--tls-key")) {
            p.tls_key_file = v;
        } else if (!strcmp(a, "--tls-client-ca")) {
            p.tls_client_ca_file = v;
        } else if (!strcmp(a, "--auth-token-file")) {
            p.auth_token_file = v;
        } else if (!strcmp(a, "--health-listen")) {
            p.health_listen = v;
        } else if (!strcmp(a, "--curve-secret-key")) {
            secret_file = v;
        } else if (!strcmp(a, "--curve-authorized-keys")) {
            clients_dir = v;
        } else if (!strcmp(a, "--drain-timeout")) {
            if (parse_seconds(v, &p.drain_timeout_s)) {
                fprintf(stderr, "metrale-router: --drain-timeout %s: must be seconds in [0, 86400]\n", v);
                return 2;
            }
        } else {
            fprintf(stderr, "metrale-router: unknown option %s\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (!have_listen || !have_ep) {
        fprintf(stderr, "metrale-router: --listen and --workers-endpoint are required\n");
        usage(stderr);
        return 2;
    }
    if (!p.tls_cert_file != !p.tls_key_file) {
        fprintf(stderr, "metrale-router: --tls-cert and --tls-key go together\n");
        return 2;
    }
    if (p.tls_client_ca_file && !p.tls_cert_file) {
        fprintf(stderr, "metrale-router: --tls-client-ca needs --tls-cert and --tls-key\n");
        return 2;
    }
    if (clients_dir && !secret_file) {
        fprintf(stderr, "metrale-router: --curve-authorized-keys needs --curve-secret-key\n");
        return 2;
    }
    mt_error err;
    char secret[MT_WIRE_KEY_Z85 + 1], pub[MT_WIRE_KEY_Z85 + 1];
    char (*clients)[MT_WIRE_KEY_Z85 + 1] = NULL;
    const char **client_ptrs = NULL;
    size_t nclients = 0;
    if (secret_file) {
        if (mt_wire_key_read(secret_file, secret, &err) || mt_wire_key_public(secret, pub, &err) ||
            (clients_dir && mt_wire_keys_read_dir(clients_dir, &clients, &nclients, &err))) {
            fprintf(stderr, "metrale-router: %s\n", err.msg);
            return 2;
        }
        if (nclients && !(client_ptrs = calloc(nclients, sizeof *client_ptrs))) {
            fprintf(stderr, "metrale-router: out of memory\n");
            return 1;
        }
        for (size_t i = 0; i < nclients; i++) client_ptrs[i] = clients[i];
        p.curve_secret_key = secret;
        p.curve_clients = client_ptrs;
        p.n_curve_clients = nclients; /* a folder without keys was refused above */
    }

    /* Block the signals before any thread exists (gRPC starts some), so all of them inherit the
     * mask and the signals arrive only through the signalfds: SIGTERM and SIGINT drain, SIGHUP
     * reloads. */
    sigset_t drain_set, hup_set, all;
    sigemptyset(&drain_set);
    sigaddset(&drain_set, SIGTERM);
    sigaddset(&drain_set, SIGINT);
    sigemptyset(&hup_set);
    sigaddset(&hup_set, SIGHUP);
    all = drain_set;
    sigaddset(&all, SIGHUP);
    if (sigprocmask(SIG_BLOCK, &all, NULL)) {
        perror("metrale-router: sigprocmask");
        return 1;
    }
    signal(SIGPIPE, SIG_IGN);
    int sfd = signalfd(-1, &drain_set, SFD_NONBLOCK | SFD_CLOEXEC);
    int hfd = signalfd(-1, &hup_set, SFD_NONBLOCK | SFD_CLOEXEC);
    if (sfd < 0 || hfd < 0) {
        perror("metrale-router: signalfd");
        return 1;
    }
    p.drain_fd = sfd;
    p.reload_fd = hfd;

    rtr_router *r = rtr_router_create(&p, &err);
    free(client_ptrs);
    free(clients);
    if (!r) {
        mt_log(MT_LOG_ERROR, "router: cannot start: %s", err.msg);
        close(sfd);
        close(hfd);
        return 1;
    }
    char ep[512];
    rtr_router_workers_endpoint(r, ep, sizeof ep);
    mt_log(MT_LOG_INFO, "router: listening on port %d, workers at %s", rtr_router_port(r), ep);
    if (p.metrics_listen)
        mt_log(MT_LOG_INFO, "router: metrics on port %d (GET /metrics)", rtr_router_metrics_port(r));
    if (p.health_listen)
        mt_log(MT_LOG_INFO, "router: health port %d (grpc.health.v1 only, plaintext)", rtr_router_health_port(r));
    if (secret_file)
        mt_log(MT_LOG_INFO, "router: CURVE on the workers' link; router public key %s; %s", pub,
               clients_dir ? "only the workers with an authorized key are admitted"
                           : "any worker with this public key is admitted");
    mt_status st = rtr_router_run(r, &err);
    if (st) mt_log(MT_LOG_ERROR, "%s", err.msg); /* "router: ..." */
    rtr_router_free(r);
    close(sfd);
    close(hfd);
    if (!st) mt_log(MT_LOG_INFO, "router: stopped");
    return st ? 1 : 0;
}
