"""Recovery from a dead worker group, through the real router and workers (bare, and under
metrale-serve), with the times printed:

- kill -9 of the only worker group: health of metrale.v1.Generation turns NOT_SERVING, and the
  streams it ran end UNAVAILABLE naming the worker, both within DEATH_BOUND_S of the kill (the
  router's socket monitor sees the connection close; heartbeats alone would take 2.5 s); new
  requests are UNAVAILABLE until the group is back, then SERVING again;
- kill -9 of one of two groups: its stream that had tokens ends UNAVAILABLE and its stream still
  in prefill (no token yet) moves to the other group and completes, both within DEATH_BOUND_S;
- kill -9 of the router under metrale-serve: metrale-serve stops its workers (one of them frozen,
  so that only SIGKILL ends it) and exits non-zero within 1.5 s (so that an orchestrator restarts
  the pod), leaving no socket file and no process.
"""

import os
import signal
import threading
import time
import unittest

import grpc

from harness import (NOT_SERVING, SERVING, Cluster, Collector, Launcher, children, cmdline, health_pb2,
                     metrale_pb2, request, wait_for)

DEATH_BOUND_S = 0.2   # kill -9 to NOT_SERVING, to UNAVAILABLE, to a stream moved
LONG_PROMPT = 3000    # tokens of a prompt still in its prefill at the kill (~0.6 s alone on one core)
GEN = "metrale.v1.Generation"


class TimedWatcher:
    """A Watch stream; each status with the time.monotonic() it arrived."""

    def __init__(self, health, service=GEN):
        self.seen = []
        self.call = health.Watch(health_pb2.HealthCheckRequest(service=service))
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        try:
            for r in self.call:
                self.seen.append((r.status, time.monotonic()))
        except grpc.RpcError:
            pass

    def last(self):
        return self.seen[-1][0] if self.seen else None

    def wait_status(self, status, timeout):
        wait_for(lambda: self.last() == status, timeout, "watch status %d (have %s)" % (status, self.seen),
                 step=0.002)
        return self.seen[-1][1]


def long_prompt(seed):
    """A prompt no worker has seen (no kept prefix shortens its prefill)."""
    return [(i * 7 + seed * 13 + i * i % 11) % 300 for i in range(LONG_PROMPT)]


class SingleGroupMixin:
    """The only worker group dies; svc has gen, health, and kill() that SIGKILLs its worker."""

    def check_single_group_death(self, svc, kill, tag):
        w = TimedWatcher(svc.health)
        w.wait_status(SERVING, 10)
        ctx = svc.gen.GetModelInfo(metrale_pb2.ModelInfoRequest(), timeout=5).max_context
        streams = [Collector(svc.gen, request("%s-%d" % (tag, i), [1 + i, 2, 3], ctx - 4)) for i in range(3)]
        for s in streams:
            self.assertTrue(s.first_token.wait(30), "no first token")
        killed_at = time.monotonic()
        kill()
        ns_at = w.wait_status(NOT_SERVING, 5)
        for s in streams:
            s.wait(10)
            self.assertEqual(s.code, grpc.StatusCode.UNAVAILABLE, s.details)
            self.assertIn("w0", s.details)
        end_s = max(s.ended_at for s in streams) - killed_at
        ns_s = ns_at - killed_at
        with self.assertRaises(grpc.RpcError) as e:
            list(svc.gen.Generate(request(tag + "-none-live", [1, 2], 2), timeout=5))
        self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE)
        print("\n%s: kill -9 of the only worker: NOT_SERVING after %.1f ms, its %d streams UNAVAILABLE after "
              "%.1f ms" % (tag, ns_s * 1e3, len(streams), end_s * 1e3), flush=True)
        self.assertLess(ns_s, DEATH_BOUND_S)
        self.assertLess(end_s, DEATH_BOUND_S)
        return w


class BareTest(SingleGroupMixin, unittest.TestCase):
    def test_the_only_worker_killed(self):
        with Cluster(workers=1) as c:
            w = self.check_single_group_death(c, lambda: c.kill_worker(0, signal.SIGKILL), "bare")
            c.start_worker(0)
            w.wait_status(SERVING, 20)
            self.assertEqual(c.stats().worker_restarts, 1)
            s = Collector(c.gen, request("bare-back", [1, 2, 3], 4)).wait(30)
            self.assertEqual(s.code, grpc.StatusCode.OK, s.details)

    def test_one_of_two_killed_moves_its_fresh_stream(self):
        with Cluster(workers=2, worker_args=["--prefill-budget", "8192"]) as c:
            ctx = c.gen.GetModelInfo(metrale_pb2.ModelInfoRequest(), timeout=5).max_context
            st0 = c.stats()

            def submit(req):  # once the router has sent the stream before to a worker
                before = c.stats().active_streams
                s = Collector(c.gen, req)
                wait_for(lambda: c.stats().active_streams > before or s.done.is_set(), 10, "a submit", step=0.005)
                return s

            # One decoding stream and one long prompt on each worker (least-loaded placement).
            decode = [submit(request("dec-%d" % i, [1 + i, 2, 3], ctx - 4)) for i in range(2)]
            for s in decode:
                self.assertTrue(s.first_token.wait(30), "no first token")
            fresh = [submit(request("fresh-%d" % i, long_prompt(i), 8)) for i in range(2)]
            self.assertFalse(any(s.tokens for s in fresh), "a long prompt finished its prefill before the kill")
            killed_at = time.monotonic()
            c.kill_worker(1, signal.SIGKILL)
            requeued_at = wait_for(lambda: c.stats().streams_requeued > st0.streams_requeued and time.monotonic(),
                                   5, "a stream put back in the queue", step=0.002)
            wait_for(lambda: any(s.done.is_set() for s in decode), 5, "a started stream to end", step=0.002)
            lost = [s for s in decode if s.done.is_set()]
            for s in fresh:
                s.wait(60)
                self.assertEqual(s.code, grpc.StatusCode.OK, s.details)
                self.assertEqual(len(s.tokens), 8)
            self.assertEqual(len(lost), 1, [(s.code, s.details) for s in decode])
            self.assertEqual(lost[0].code, grpc.StatusCode.UNAVAILABLE, lost[0].details)
            self.assertIn("w1", lost[0].details)
            self.assertEqual(c.stats().streams_requeued - st0.streams_requeued, 1)
            for s in decode:  # the survivor's stream runs on
                if s is not lost[0]:
                    self.assertIsNone(s.code)
                    s.call.cancel()
            lost_s, requeue_s = lost[0].ended_at - killed_at, requeued_at - killed_at
            print("\nbare, one of two workers killed: its started stream UNAVAILABLE after %.1f ms, its fresh "
                  "stream back in the queue by %.1f ms" % (lost_s * 1e3, requeue_s * 1e3), flush=True)
            self.assertLess(lost_s, DEATH_BOUND_S)
            self.assertLess(requeue_s, DEATH_BOUND_S)


class LauncherTest(SingleGroupMixin, unittest.TestCase):
    def test_the_only_group_killed_under_metrale_serve(self):
        with Launcher(["--workers", "1", "--threads", "1"]) as svc:
            svc.connect(1)
            pid = svc.ranks()[(0, 0)]
            w = self.check_single_group_death(svc, lambda: os.kill(pid, signal.SIGKILL), "metrale-serve")
            w.wait_status(SERVING, 20)  # the launcher starts the group again
            self.assertEqual(svc.stats().worker_restarts, 1)
            s = Collector(svc.gen, request("serve-back", [1, 2, 3], 4)).wait(30)
            self.assertEqual(s.code, grpc.StatusCode.OK, s.details)

    def test_a_dead_router_ends_metrale_serve(self):
        with Launcher(["--workers", "2", "--threads", "1"]) as svc:
            svc.connect(2)
            ctx = svc.gen.GetModelInfo(metrale_pb2.ModelInfoRequest(), timeout=5).max_context
            busy = Collector(svc.gen, request("doomed", [1, 2, 3], ctx - 4))  # a worker with a live sequence
            self.assertTrue(busy.first_token.wait(30))
            kids = children(svc.proc.pid)
            router = [p for p in kids if cmdline(p)[:1] and cmdline(p)[0].endswith("metrale-router")]
            self.assertEqual(len(router), 1, kids)
            args = cmdline(router[0])
            sock = args[args.index("--workers-endpoint") + 1][len("ipc://"):]
            self.assertTrue(os.path.exists(sock), sock)
            # One worker cannot act on a SIGTERM (as one stuck in a long step): it must be killed.
            os.kill(svc.ranks()[(1, 0)], signal.SIGSTOP)
            killed_at = time.monotonic()
            os.kill(router[0], signal.SIGKILL)
            code = svc.proc.wait(10)
            exit_s = time.monotonic() - killed_at
            print("\nmetrale-serve: kill -9 of the router: exited %d after %.0f ms" % (code, exit_s * 1e3),
                  flush=True)
            self.assertNotEqual(code, 0)
            self.assertLess(exit_s, 1.5)
            self.assertIn("the router died", svc.log())
            self.assertFalse(os.path.exists(sock), "the router's socket file is left behind")
            left = [p for p in kids if os.path.exists("/proc/%d" % p) and cmdline(p)]
            self.assertEqual(left, [], "children left running")
            busy.wait(10)
            self.assertEqual(busy.code, grpc.StatusCode.UNAVAILABLE)


if __name__ == "__main__":
    unittest.main(verbosity=2)
