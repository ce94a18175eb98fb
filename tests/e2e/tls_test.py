"""Security on the gRPC port, with certificates made here by the openssl command.

A router with --tls-cert/--tls-key, --auth-token-file and --health-listen: a client that trusts
the CA streams a Generate over TLS; one that does not trust it, or speaks plaintext, never gets a
call through; a missing or wrong bearer token gets UNAUTHENTICATED and the right one works, while
grpc.health.v1 needs none; the health port answers SERVING in plaintext and serves nothing else.
SIGHUP after new certificate files: new connections are served the new certificate (its serial
and subject, read with Python's ssl), a connection already open keeps working, and files that
fail their checks (a key that is not the certificate's) leave the current certificate in place.

metrale-serve with --tls-client-ca (mutual TLS) passes the options to its router: a client
without a certificate, or with one of another CA, is refused, one with a certificate the CA
signed gets its Generate through; the health port answers in plaintext; SIGHUP to metrale-serve
reaches the router."""

import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import unittest

import grpc

from harness import (SERVING, Cluster, Collector, Launcher, health_pb2, health_pb2_grpc, metrale_pb2,
                     metrale_pb2_grpc, request, wait_for)

TOKEN = "t0k3n-for-the-test"
NAME = "localhost"  # the server certificates' name (and 127.0.0.1 as an IP address)


class Certs:
    """A CA, two server certificates it signed (serials 0x1001, 0x2002), a client certificate it
    signed, and a stranger CA with a client certificate of its own, in PEM files under dir."""

    def __init__(self, dir):
        self.dir = dir
        self.ca = self._ca("ca", "metrale test CA")
        self.stranger_ca = self._ca("stranger-ca", "another CA")
        ext = self.path("server.ext")
        with open(ext, "w") as f:
            f.write("subjectAltName=DNS:%s,IP:127.0.0.1\n" % NAME)
        self.server1 = self._leaf("server1", "/CN=%s" % NAME, "ca", 0x1001, ext)
        self.server2 = self._leaf("server2", "/O=metrale second/CN=%s" % NAME, "ca", 0x2002, ext)
        self.client = self._leaf("client", "/CN=a client", "ca", 0x3003)
        self.stranger = self._leaf("stranger", "/CN=a stranger", "stranger-ca", 0x4004)

    def path(self, name):
        return os.path.join(self.dir, name)

    def _openssl(self, *args):
        subprocess.run(["openssl"] + list(args), check=True, capture_output=True)

    def _ca(self, name, cn):
        self._openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                      "-keyout", self.path(name + ".key"), "-out", self.path(name + ".crt"), "-days", "2",
                      "-subj", "/CN=" + cn)
        return self.path(name + ".crt")

    def _leaf(self, name, subject, ca, serial, ext=None):
        key, csr, crt = (self.path(name + x) for x in (".key", ".csr", ".crt"))
        self._openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", key,
                      "-out", csr, "-subj", subject)
        self._openssl("x509", "-req", "-in", csr, "-CA", self.path(ca + ".crt"), "-CAkey", self.path(ca + ".key"),
                      "-set_serial", str(serial), "-days", "2", "-out", crt, *(["-extfile", ext] if ext else []))
        return crt, key

    def read(self, path):
        with open(path, "rb") as f:
            return f.read()

    def credentials(self, ca=True, client=None):
        """Channel credentials trusting our CA (or the system's roots), with a client pair."""
        pair = (self.read(client[1]), self.read(client[0])) if client else (None, None)
        return grpc.ssl_channel_credentials(self.read(self.ca) if ca else None, *pair)


def secure(addr, creds):
    return grpc.secure_channel(addr, creds, options=[("grpc.ssl_target_name_override", NAME)])


def served_certificate(port, certs, client=None):
    """(serial, subject) of the certificate a new TLS connection to port is served."""
    ctx = ssl.create_default_context(cafile=certs.ca)
    ctx.set_alpn_protocols(["h2"])
    if client:
        ctx.load_cert_chain(client[0], client[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        with ctx.wrap_socket(s, server_hostname=NAME) as t:
            c = t.getpeercert()
    return c["serialNumber"], dict(x[0] for x in c["subject"])


def refused(fn):
    """The status code fn's call fails with (None when it succeeds)."""
    try:
        fn()
        return None
    except grpc.RpcError as e:
        return e.code()


def health(channel, timeout=5):
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status


class TlsTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="metrale-tls-")
        self.certs = Certs(self.dir)
        self.cert, self.key = self.certs.path("tls.crt"), self.certs.path("tls.key")
        shutil.copy(self.certs.server1[0], self.cert)
        shutil.copy(self.certs.server1[1], self.key)
        self.token = self.certs.path("token")
        with open(self.token, "w") as f:
            f.write(TOKEN + "\n")
        self.channels = []

    def tearDown(self):
        for ch in self.channels:
            ch.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def channel(self, addr, creds=None):
        ch = secure(addr, creds) if creds else grpc.insecure_channel(addr)
        self.channels.append(ch)
        return ch

    def test_tls_token_health_port_and_reload(self):
        auth = [("authorization", "Bearer " + TOKEN)]
        args = ["--tls-cert", self.cert, "--tls-key", self.key, "--auth-token-file", self.token,
                "--health-listen", "127.0.0.1:0"]
        with Cluster(workers=1, router_args=args, connect=lambda a: secure(a, self.certs.credentials()),
                     metadata=auth) as c:
            # the request over TLS, with the CA and the token
            s = Collector(c.gen, request("tls", [1, 2, 3], 6)).wait(30)
            self.assertEqual(s.code, grpc.StatusCode.UNAUTHENTICATED, s.details)  # no token
            call = c.gen.Generate(request("tls", [1, 2, 3], 6), timeout=30, metadata=auth)
            self.assertEqual(sum(len(r.tokens) for r in call), 6)
            self.assertEqual(c.check(), SERVING)  # health needs no token
            # tokens: missing, wrong, another scheme: UNAUTHENTICATED; the right one works
            info = lambda md: c.gen.GetModelInfo(metrale_pb2.ModelInfoRequest(), timeout=5, metadata=md)
            for md in (None, [("authorization", "Bearer wrong")], [("authorization", "Bearer " + TOKEN + "x")],
                       [("authorization", "Basic " + TOKEN)], [("x-token", TOKEN)]):
                self.assertEqual(refused(lambda: info(md)), grpc.StatusCode.UNAUTHENTICATED, md)
            self.assertEqual(info([("authorization", "bearer " + TOKEN)]).model_type, "glm5_next")
            self.assertIn("no valid bearer token", c.router_log())

            # a client that does not trust the CA, and a plaintext one, get nothing through
            untrusting = self.channel(c.addr, self.certs.credentials(ca=False))
            self.assertEqual(refused(lambda: health(untrusting)), grpc.StatusCode.UNAVAILABLE)
            plain = self.channel(c.addr)
            self.assertEqual(refused(lambda: health(plain)), grpc.StatusCode.UNAVAILABLE)

            # the health port: plaintext, grpc.health.v1 only
            hp = c.health_port()
            self.assertIsNotNone(hp, "the router did not log its health port")
            probe = self.channel("127.0.0.1:%d" % hp)
            self.assertEqual(health(probe), SERVING)
            on_probe = metrale_pb2_grpc.GenerationStub(probe)
            self.assertEqual(refused(lambda: on_probe.GetModelInfo(metrale_pb2.ModelInfoRequest(), timeout=5,
                                                                   metadata=auth)),
                             grpc.StatusCode.UNIMPLEMENTED)
            tls_to_probe = self.channel("127.0.0.1:%d" % hp, self.certs.credentials())
            self.assertEqual(refused(lambda: health(tls_to_probe, 3)), grpc.StatusCode.UNAVAILABLE)

            # reload: a certificate whose key is not there yet is refused, the old one stays
            self.assertEqual(served_certificate(c.port, self.certs), ("1001", {"commonName": NAME}))
            shutil.copy(self.certs.server2[0], self.cert)
            c.router.send_signal(signal.SIGHUP)
            wait_for(lambda: "TLS files not reloaded" in c.router_log(), 5, "the refused reload")
            self.assertIn("does not belong", c.router_log())
            self.assertEqual(served_certificate(c.port, self.certs)[0], "1001")
            # with its key: new connections get the second certificate
            shutil.copy(self.certs.server2[1], self.key)
            c.router.send_signal(signal.SIGHUP)
            wait_for(lambda: "new connections get" in c.router_log(), 5, "the reload")
            serial, subject = served_certificate(c.port, self.certs)
            self.assertEqual((serial, subject), ("2002", {"organizationName": "metrale second", "commonName": NAME}))
            fresh = self.channel(c.addr, self.certs.credentials())
            self.assertEqual(health(fresh), SERVING)
            # the connection opened before the reload goes on
            call = c.gen.Generate(request("after-reload", [4, 5], 4), timeout=30, metadata=auth)
            self.assertEqual(sum(len(r.tokens) for r in call), 4)
            # the token is read again too
            with open(self.token, "w") as f:
                f.write("n3w-t0ken\n")
            c.router.send_signal(signal.SIGHUP)
            wait_for(lambda: len(re.findall("bearer token reloaded", c.router_log())) >= 3, 5, "the token reload")
            self.assertEqual(refused(lambda: info(auth)), grpc.StatusCode.UNAUTHENTICATED)
            self.assertEqual(info([("authorization", "Bearer n3w-t0ken")]).workers, 1)
            self.assertEqual(c.terminate_router(), 0)

    def test_mutual_tls_through_metrale_serve(self):
        args = ["--workers", "1", "--threads", "1", "--tls-cert", self.cert, "--tls-key", self.key,
                "--tls-client-ca", self.certs.ca, "--health-listen", "127.0.0.1:0"]
        with Launcher(args) as l:
            port = int(wait_for(lambda: re.search(r"listening on port (\d+)", l.log()), 20, "the router's port")[1])
            hp = int(wait_for(lambda: re.search(r"health port (\d+)", l.log()), 5, "the health port")[1])
            addr = "127.0.0.1:%d" % port
            probe = self.channel("127.0.0.1:%d" % hp)
            wait_for(lambda: health(probe) == SERVING, 30, "a live worker (health port)")
            self.assertIn("client certificate required", l.log())

            no_cert = self.channel(addr, self.certs.credentials())
            self.assertEqual(refused(lambda: health(no_cert)), grpc.StatusCode.UNAVAILABLE)
            stranger = self.channel(addr, self.certs.credentials(client=self.certs.stranger))
            self.assertEqual(refused(lambda: health(stranger)), grpc.StatusCode.UNAVAILABLE)
            good = self.channel(addr, self.certs.credentials(client=self.certs.client))
            self.assertEqual(health(good), SERVING)
            s = Collector(metrale_pb2_grpc.GenerationStub(good), request("mtls", [1, 2, 3], 6)).wait(30)
            self.assertEqual((s.code, len(s.tokens)), (grpc.StatusCode.OK, 6), s.details)

            # SIGHUP to metrale-serve reaches the router
            shutil.copy(self.certs.server2[0], self.cert)
            shutil.copy(self.certs.server2[1], self.key)
            l.proc.send_signal(signal.SIGHUP)
            wait_for(lambda: "new connections get" in l.log(), 5, "the router's reload")
            self.assertEqual(served_certificate(port, self.certs, self.certs.client)[0], "2002")
            self.assertEqual(health(self.channel(addr, self.certs.credentials(client=self.certs.client))), SERVING)


if __name__ == "__main__":
    unittest.main(verbosity=2)
