/* tools/keygen.c: metrale-keygen, a ZeroMQ CURVE key pair for the router <-> worker link.
 *
 *   metrale-keygen --out DIR [--name NAME] [--force]
 *
 * Writes DIR/NAME.key (the secret key, mode 0600) and DIR/NAME.pub (the public key), each one z85
 * line of 40 characters; NAME defaults to "metrale". The router takes its secret key
 * (metrale-router --curve-secret-key) and the workers its public key (metrale-worker
 * --curve-server-key); each worker takes a secret key of its own (--curve-secret-key), and the
 * router may admit only the workers whose public keys sit in one folder (--curve-authorized-keys).
 * Existing files are kept unless --force. Exit status: 0, 1 when the keys cannot be made or
 * written, 2 on bad arguments.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/wire.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: metrale-keygen --out DIR [--name NAME] [--force]\n"
            "  Writes a ZeroMQ CURVE key pair: DIR/NAME.key (secret, mode 0600) and DIR/NAME.pub (public),\n"
            "  one z85 line each; NAME defaults to metrale. Existing files are kept unless --force.\n");
}

/* Writes line + "\n" to path with mode; false (said on stderr) on failure. */
static bool write_key(const char *path, const char *line, mode_t mode, bool force) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | (force ? 0 : O_EXCL), mode);
    if (fd < 0) {
        fprintf(stderr, "metrale-keygen: %s: %s%s\n", path, strerror(errno),
                errno == EEXIST ? " (--force replaces it)" : "");
        return false;
    }
    fchmod(fd, mode); /* an existing file replaced with --force keeps the mode asked for */
    char buf[MT_WIRE_KEY_Z85 + 2];
    const int n = snprintf(buf, sizeof buf, "%s\n", line);
    const bool ok = write(fd, buf, (size_t)n) == n;
    if (close(fd) != 0 || !ok) {
        fprintf(stderr, "metrale-keygen: writing %s: %s\n", path, strerror(errno));
        return false;
    }
    return true;
}

int main(int argc, char **argv) {
    const char *out = NULL, *name = "metrale";
    bool force = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--force")) {
            force = true;
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "metrale-keygen: %s needs a value (or is an unknown option)\n", a);
            usage(stderr);
            return 2;
        }
        const char *v = argv[++i];
        if (!strcmp(a, "--out")) out = v;
        else if (!strcmp(a, "--name")) name = v;
        else {
            fprintf(stderr, "metrale-keygen: unknown option %s\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (!out || !*name || strchr(name, '/')) {
        fprintf(stderr, "metrale-keygen: --out DIR is required, and NAME must be a plain file name\n");
        usage(stderr);
        return 2;
    }
    char pub[MT_WIRE_KEY_Z85 + 1], secret[MT_WIRE_KEY_Z85 + 1];
    mt_error err;
    if (mt_wire_keypair(pub, secret, &err) != MT_OK) {
        fprintf(stderr, "metrale-keygen: %s\n", err.msg);
        return 1;
    }
    if (mkdir(out, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "metrale-keygen: %s: %s\n", out, strerror(errno));
        return 1;
    }
    char key_path[4096], pub_path[4096];
    snprintf(key_path, sizeof key_path, "%s/%s.key", out, name);
    snprintf(pub_path, sizeof pub_path, "%s/%s.pub", out, name);
    if (!write_key(key_path, secret, 0600, force)) return 1;
    if (!write_key(pub_path, pub, 0644, force)) {
        unlink(key_path); /* no half pair left behind */
        return 1;
    }
    printf("metrale-keygen: wrote %s (secret) and %s (public: %s)\n", key_path, pub_path, pub);
    return 0;
}
