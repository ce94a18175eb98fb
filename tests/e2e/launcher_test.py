"""metrale-serve, the README's one-line start, as a user runs it: it finds the router and worker
binaries beside its own folder in bazel-bin, starts them, and the service answers; a worker
killed with SIGKILL is started again (the router counts a restart, in GetStats and on its --metrics
endpoint, which metrale-serve passes on); SIGTERM drains and stops everything with exit status 0,
leaving no process behind."""

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import unittest

import grpc

from harness import (LAUNCHER_BIN, MODEL_DIR, SERVING, children, cmdline, health_pb2, health_pb2_grpc,
                     metrale_pb2, metrale_pb2_grpc, parse_metrics, path, request, scrape, wait_for)


class LauncherTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="metrale-launcher-")
        self.log_path = os.path.join(self.dir, "serve.log")
        with open(self.log_path, "wb") as log:
            # Port 0: the router binds a free port and logs it; the launcher's children share its stderr.
            self.serve = subprocess.Popen([path(LAUNCHER_BIN), "--model", path(MODEL_DIR), "--listen", "127.0.0.1:0",
                                           "--workers", "1", "--threads", "1", "--backend", "cpu",
                                           "--metrics", "127.0.0.1:0"],
                                          stdout=log, stderr=subprocess.STDOUT)
        self.channel = None

    def tearDown(self):
        if self.channel is not None:
            self.channel.close()
        if self.serve.poll() is None:
            for pid in children(self.serve.pid):
                os.kill(pid, signal.SIGKILL)
            self.serve.kill()
            self.serve.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def log(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def port(self):
        if self.serve.poll() is not None:
            raise AssertionError("metrale-serve exited with %d at start:\n%s" % (self.serve.returncode, self.log()))
        m = re.search(r"listening on port (\d+)", self.log())
        return int(m.group(1)) if m else None

    def generate(self, rid):
        toks = []
        for resp in self.gen.Generate(request(rid, [1, 2, 3], 8), timeout=30):
            toks += [t.token_id for t in resp.tokens]
            if resp.HasField("final"):
                self.assertEqual(resp.final.finish_reason, metrale_pb2.FINISH_REASON_LENGTH)
        return toks

    def live_workers(self):
        return [w for w in self.gen.GetStats(metrale_pb2.StatsRequest(), timeout=5).workers if w.alive]

    def test_serves_restarts_a_killed_worker_and_drains(self):
        try:
            port = wait_for(self.port, 20, "the router to log its port")
            self.channel = grpc.insecure_channel("127.0.0.1:%d" % port)
            self.gen = metrale_pb2_grpc.GenerationStub(self.channel)
            health = health_pb2_grpc.HealthStub(self.channel)
            wait_for(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == SERVING, 20,
                     "SERVING")
            first = self.generate("launcher-1")
            self.assertEqual(len(first), 8)

            kids = children(self.serve.pid)
            workers = [p for p in kids if any(a.endswith("metrale-worker") for a in cmdline(p)[:1])]
            routers = [p for p in kids if any(a.endswith("metrale-router") for a in cmdline(p)[:1])]
            self.assertEqual((len(workers), len(routers)), (1, 1), "children: %s" % kids)
            os.kill(workers[0], signal.SIGKILL)
            wait_for(lambda: self.gen.GetStats(metrale_pb2.StatsRequest(), timeout=5).worker_restarts >= 1, 30,
                     "the launcher to start the killed worker again")
            wait_for(lambda: len(self.live_workers()) == 1, 10, "one live worker")
            self.assertEqual(self.generate("launcher-2"), first)
            metrics_port = int(re.search(r"metrics on port (\d+)", self.log()).group(1))
            m = parse_metrics(scrape("127.0.0.1:%d" % metrics_port))
            self.assertEqual(m["metrale_worker_restarts_total"], {frozenset(): 1.0})
            self.assertEqual(m["metrale_requests_total"][frozenset({("code", "OK")})], 2.0)

            kids = children(self.serve.pid)
            self.serve.send_signal(signal.SIGTERM)
            self.assertEqual(self.serve.wait(30), 0)
            self.assertIn("metrale-serve: stopped", self.log())
            time.sleep(0.2)
            left = [p for p in kids if os.path.exists("/proc/%d" % p) and cmdline(p)]
            self.assertEqual(left, [], "children left running")
        except BaseException:
            print("---- metrale-serve ----\n" + self.log()[-8000:])
            raise


class LauncherOptionsTest(unittest.TestCase):
    """Options that only make sense together are refused before anything starts."""

    def test_expert_parts_need_sites(self):
        r = subprocess.run([path(LAUNCHER_BIN), "--model", path(MODEL_DIR), "--backend", "cpu",
                            "--prefill-expert-parts", "2"], capture_output=True, timeout=30)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn(b"--prefill-expert-parts needs --prefill-sites", r.stderr)


if __name__ == "__main__":
    unittest.main()
