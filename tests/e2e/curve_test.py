"""The worker link over tcp:// with ZeroMQ CURVE: a router listening on tcp://127.0.0.1:PORT as a
CURVE server that admits one worker key (--curve-authorized-keys), a worker holding the router's
public key and an admitted key of its own serves a request; workers without keys, with a wrong
router key, or with a key the router does not list never get their Hello through (the router does
not list them) and exit when the router stays silent. metrale-serve --router starts a group of two
ranks for such a router, with the keys and --first-id, and stops it on SIGTERM. Keys come from
metrale-keygen."""

import os
import re
import shutil
import signal
import subprocess
import tempfile
import unittest

import grpc

from harness import (LAUNCHER_BIN, MODEL_DIR, ROUTER_BIN, WORKER_BIN, Collector, metrale_pb2, metrale_pb2_grpc,
                     path, request, wait_for)

KEYGEN_BIN = "tools/metrale-keygen"


class CurveTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="metrale-curve-")
        self.procs = []
        self.channel = None

    def tearDown(self):
        if self.channel is not None:
            self.channel.close()
        for p, _ in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def spawn(self, name, args):
        log = os.path.join(self.dir, name + ".log")
        with open(log, "wb") as f:
            p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT)
        self.procs.append((p, log))
        return p, log

    def keygen(self, folder, name):
        subprocess.run([path(KEYGEN_BIN), "--out", os.path.join(self.dir, folder), "--name", name], check=True,
                       capture_output=True)
        return os.path.join(self.dir, folder, name)

    def worker(self, wid, keys):
        args = [path(WORKER_BIN), "--model", path(MODEL_DIR), "--router", self.endpoint, "--id", str(wid),
                "--threads", "1", "--router-timeout", "2"]
        if keys:
            args += ["--curve-server-key", keys[0], "--curve-secret-key", keys[1]]
        return self.spawn("worker%d" % wid, args)

    def dump(self):
        for _, log in self.procs:
            with open(log, "rb") as f:
                print("---- %s ----\n%s" % (log, f.read()[-4000:].decode(errors="replace")))

    def test_only_workers_with_the_keys_get_through(self):
        try:
            self._run()
        except BaseException:
            self.dump()
            raise

    def start_router(self, router_key, authorized):
        args = [path(ROUTER_BIN), "--listen", "127.0.0.1:0", "--workers-endpoint", "tcp://127.0.0.1:*",
                "--curve-secret-key", router_key + ".key"]
        if authorized:
            args += ["--curve-authorized-keys", os.path.join(self.dir, authorized)]
        router, router_log = self.spawn("router", args)

        def endpoints():
            if router.poll() is not None:
                raise AssertionError("the router exited with %d" % router.returncode)
            with open(router_log) as f:
                m = re.search(r"listening on port (\d+), workers at (tcp://127\.0\.0\.1:\d+)", f.read())
            return m.groups() if m else None
        port, self.endpoint = wait_for(endpoints, 10, "the router to log its endpoints")
        self.channel = grpc.insecure_channel("127.0.0.1:" + port)
        return metrale_pb2_grpc.GenerationStub(self.channel), router_log

    def test_a_group_on_another_host(self):
        try:
            router_key = self.keygen("keys", "router")
            host_key = self.keygen("keys", "host")
            gen, _ = self.start_router(router_key, None)  # any worker with the router's key
            serve, _ = self.spawn("serve", [
                path(LAUNCHER_BIN), "--router", self.endpoint, "--first-id", "5", "--tp", "2", "--workers", "1",
                "--threads", "1", "--backend", "cpu", "--model", path(MODEL_DIR),
                "--curve-server-key", router_key + ".pub", "--curve-secret-key", host_key + ".key"])
            live = lambda: [w.worker_id for w in gen.GetStats(metrale_pb2.StatsRequest(), timeout=5).workers
                            if w.alive]
            wait_for(lambda: live() == [5], 20, "group 5 to say Hello through CURVE")
            s = Collector(gen, request("remote", [1, 2, 3], 8)).wait(30)
            self.assertEqual((s.code, len(s.tokens)), (grpc.StatusCode.OK, 8), s.details)
            serve.send_signal(signal.SIGTERM)
            self.assertEqual(serve.wait(20), 0)
            wait_for(lambda: live() == [], 5, "the router to see group 5 go")
        except BaseException:
            self.dump()
            raise

    def _run(self):
        router_key = self.keygen("keys", "router")
        worker_key = self.keygen("authorized", "worker")  # authorized/worker.pub is the one admitted key
        stranger_key = self.keygen("keys", "stranger")
        self.assertEqual(oct(os.stat(router_key + ".key").st_mode & 0o777), "0o600")
        gen, router_log = self.start_router(router_key, "authorized")

        good, _ = self.worker(0, (router_key + ".pub", worker_key + ".key"))
        wait_for(lambda: [w.worker_id for w in gen.GetStats(metrale_pb2.StatsRequest(), timeout=5).workers] == [0],
                 20, "worker 0 to say Hello through CURVE")
        s = Collector(gen, request("curve", [1, 2, 3], 8)).wait(30)
        self.assertEqual((s.code, len(s.tokens)), (grpc.StatusCode.OK, 8), s.details)

        bad = [self.worker(1, None)[0],                                           # no keys
               self.worker(2, (stranger_key + ".pub", worker_key + ".key"))[0],   # a wrong router key
               self.worker(3, (router_key + ".pub", stranger_key + ".key"))[0]]   # a key not admitted
        for p in bad:  # never heard from the router: each exits after its --router-timeout
            self.assertEqual(p.wait(20), 1)
        self.assertEqual([w.worker_id for w in gen.GetStats(metrale_pb2.StatsRequest(), timeout=5).workers], [0])
        with open(router_log) as f:
            log = f.read()
        self.assertIn("CURVE on the workers' link", log)
        self.assertIn("not an authorized key", log)
        self.assertNotRegex(log, r"worker w[123]")
        self.assertIsNone(good.poll(), "the admitted worker stopped")
        s = Collector(gen, request("curve-2", [4, 5], 4)).wait(30)
        self.assertEqual(s.code, grpc.StatusCode.OK, s.details)


if __name__ == "__main__":
    unittest.main(verbosity=2)
