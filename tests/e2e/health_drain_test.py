"""grpc.health.v1 Check and Watch through the router's life: NOT_SERVING with no worker, SERVING
once one says Hello, NOT_SERVING when the only worker dies, SERVING when it comes back; SIGTERM:
NOT_SERVING at once, new requests UNAVAILABLE, running streams finish, then the router and its
workers exit 0; streams that outlive --drain-timeout end with a final message (CANCELLED, their
token counts) and OK."""

import signal
import threading
import time
import unittest

import grpc

from harness import (NOT_SERVING, SERVING, Cluster, Collector, health_pb2, metrale_pb2, request,
                     wait_for)

UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class Watcher:
    """Records every status a Watch stream delivers."""

    def __init__(self, cluster, service=""):
        self.statuses = []
        self.ended = threading.Event()
        self.call = cluster.health.Watch(health_pb2.HealthCheckRequest(service=service))
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        try:
            for r in self.call:
                self.statuses.append(r.status)
        except grpc.RpcError:
            pass
        self.ended.set()

    def last(self):
        return self.statuses[-1] if self.statuses else None

    def wait_status(self, status, timeout):
        wait_for(lambda: self.last() == status, timeout, "watch status %d (have %s)" % (status, self.statuses))


class HealthTest(unittest.TestCase):
    def test_transitions_with_worker_life(self):
        with Cluster(workers=0) as c:
            for svc in ("", "metrale.v1.Generation"):
                self.assertEqual(c.check(svc), NOT_SERVING)
            w = Watcher(c)
            w_gen = Watcher(c, "metrale.v1.Generation")
            w_unknown = Watcher(c, "no.such.Service")
            w.wait_status(NOT_SERVING, 5)
            w_unknown.wait_status(UNKNOWN, 5)
            with self.assertRaises(grpc.RpcError) as e:
                list(c.gen.Generate(request("early", [1, 2], 2), timeout=5))
            self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE)
            with self.assertRaises(grpc.RpcError) as e:
                c.gen.GetModelInfo(metrale_pb2.ModelInfoRequest(), timeout=5)
            self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE)

            c.start_worker(0)
            w.wait_status(SERVING, 20)
            w_gen.wait_status(SERVING, 5)
            self.assertEqual(c.check(), SERVING)
            info = c.gen.GetModelInfo(metrale_pb2.ModelInfoRequest(), timeout=5)
            self.assertEqual((info.model_type, info.workers), ("glm5_next", 1))
            self.assertGreater(info.vocab_size, 0)

            killed_at = time.monotonic()
            c.kill_worker(0, signal.SIGKILL)
            w.wait_status(NOT_SERVING, 3.5)
            self.assertLess(time.monotonic() - killed_at, 3.5)
            self.assertEqual(c.check("metrale.v1.Generation"), NOT_SERVING)
            with self.assertRaises(grpc.RpcError) as e:
                list(c.gen.Generate(request("none-live", [1, 2], 2), timeout=5))
            self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE)

            c.start_worker(0)
            w.wait_status(SERVING, 20)
            self.assertEqual(c.stats().worker_restarts, 1)
            s = Collector(c.gen, request("back", [1, 2, 3], 4)).wait(30)
            self.assertEqual(s.code, grpc.StatusCode.OK, s.details)
            self.assertEqual(w.statuses, [NOT_SERVING, SERVING, NOT_SERVING, SERVING])
            self.assertEqual(w_unknown.statuses, [UNKNOWN])


class DrainTest(unittest.TestCase):
    def _long_request(self, c, rid, seconds):
        """A request that runs for about `seconds` at the measured speed."""
        ctx = c.gen.GetModelInfo(metrale_pb2.ModelInfoRequest(), timeout=5).max_context
        t0 = time.monotonic()
        probe = Collector(c.gen, request("probe-" + rid, [4, 5, 6], 16)).wait(30)
        self.assertEqual(probe.code, grpc.StatusCode.OK, probe.details)
        per_tok = (time.monotonic() - t0) / 16
        return min(ctx - 4, max(8, int(seconds / max(per_tok, 1e-4))))

    def test_sigterm_finishes_running_streams_then_exits(self):
        with Cluster(workers=2, drain_timeout=30) as c:
            w = Watcher(c)
            w.wait_status(SERVING, 5)
            max_new = self._long_request(c, "drain", 0.6)  # long enough to still run at SIGTERM
            streams = [Collector(c.gen, request("drain-%d" % i, [7 + i, 8, 9], max_new)) for i in range(6)]
            for s in streams:
                self.assertTrue(s.first_token.wait(30))
            c.router.send_signal(signal.SIGTERM)
            w.wait_status(NOT_SERVING, 2)
            with self.assertRaises(grpc.RpcError) as e:
                list(c.gen.Generate(request("late", [1, 2], 2), timeout=5))
            self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE)
            for s in streams:
                s.wait(60)
                self.assertEqual(s.code, grpc.StatusCode.OK, s.details)
                self.assertEqual(len(s.tokens), max_new)
            self.assertEqual(c.router.wait(20), 0)
            for i, p in c.workers.items():
                self.assertEqual(p.wait(10), 0, "worker %d exit code" % i)
            self.assertTrue(w.ended.wait(5), "the watch did not end with the server")

    def test_streams_past_the_drain_timeout_end_cancelled_with_their_counts(self):
        with Cluster(workers=1, drain_timeout=0.5) as c:
            max_new = self._long_request(c, "slow", 20)
            prompts = [[1 + i, 2] + [3] * i for i in range(3)]
            streams = [Collector(c.gen, request("slow-%d" % i, p, max_new)) for i, p in enumerate(prompts)]
            for s in streams:
                self.assertTrue(s.first_token.wait(30))
            t0 = time.monotonic()
            c.router.send_signal(signal.SIGTERM)
            for s, p in zip(streams, prompts):
                s.wait(30)
                self.assertEqual(s.code, grpc.StatusCode.OK, s.details)
                self.assertLess(s.ended_at - t0, 3)
                self.assertIsNotNone(s.final, s.req.request_id)
                self.assertTrue(s.responses[-1].HasField("final"))
                self.assertEqual(s.final.finish_reason, metrale_pb2.FINISH_REASON_CANCELLED)
                self.assertEqual(s.final.usage.prompt_tokens, len(p))
                self.assertEqual(s.final.usage.completion_tokens, len(s.tokens))
                self.assertGreater(len(s.tokens), 0)
                self.assertLess(len(s.tokens), max_new)
            self.assertEqual(c.router.wait(20), 0)
            self.assertEqual(c.workers[0].wait(10), 0)

    def test_cut_streams_of_a_frozen_worker_get_the_routers_counts(self):
        """The worker does not answer the cut (SIGSTOP): after a grace of 1 s the router ends the
        streams itself, with the tokens it passed on."""
        with Cluster(workers=1, drain_timeout=0.5) as c:
            max_new = self._long_request(c, "frozen", 20)
            prompts = [[5 + i, 6, 7] for i in range(2)]
            streams = [Collector(c.gen, request("frozen-%d" % i, p, max_new)) for i, p in enumerate(prompts)]
            for s in streams:
                self.assertTrue(s.first_token.wait(30))
            c.workers[0].send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            c.router.send_signal(signal.SIGTERM)
            for s, p in zip(streams, prompts):
                s.wait(30)
                self.assertEqual(s.code, grpc.StatusCode.OK, s.details)
                self.assertEqual(s.final.finish_reason, metrale_pb2.FINISH_REASON_CANCELLED)
                self.assertEqual(s.final.usage.prompt_tokens, len(p))
                self.assertEqual(s.final.usage.completion_tokens, len(s.tokens))
                self.assertLess(s.ended_at - t0, 3)
            c.workers[0].send_signal(signal.SIGCONT)
            self.assertEqual(c.router.wait(20), 0)

if __name__ == "__main__":
    unittest.main(verbosity=2)
