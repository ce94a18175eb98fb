"""Cancellation, deadlines and a dying worker, through the real router and workers.

- 200 streams cancelled mid-flight (some before their first token, most after a few; a fifth with
  prompts long enough to keep a prefix): afterwards no sequence is live, every worker's cache is
  back at its baseline, and every slot and page is free or a kept prefix's (GetStats).
- A deadline that passes mid-stream ends it DEADLINE_EXCEEDED, and the worker frees the sequence.
- kill -9 of one of two workers under load: its streams end UNAVAILABLE within 3 s, the other
  worker's streams all complete, health stays SERVING; a restarted worker counts as a restart.
"""

import signal
import subprocess
import sys
import textwrap
import time
import unittest

import grpc

from harness import SERVING, Cluster, Collector, metrale_pb2, request, wait_for


HEARTBEAT_S = 0.5  # MT_WIRE_HEARTBEAT_S (common/wire_limits.h)


def accounted(w):
    """Every slot and page of an idle CPU worker is free or held by a kept prefix (no leak)."""
    return (w.slots_free + w.slots_prefix == w.slots_total and w.slots_total > 0 and
            w.cache_pages_free + w.pages_prefix == w.cache_pages_total and w.cache_pages_total > 0)


def settled(cluster):
    """All live workers report no sequence, their cache at baseline and every slot and page free
    or a kept prefix's. Worker stats arrive with heartbeats; callers that just changed something
    first wait for fresh ones (settle())."""
    st = cluster.stats()
    ws = [w for w in st.workers if w.alive]
    ok = ws and st.active_streams == 0 and st.queued == 0 and all(
        w.live_sequences == 0 and w.cache_bytes_in_use == w.cache_bytes_baseline and accounted(w) for w in ws)
    return st if ok else None


def settle(cluster, what):
    time.sleep(2.2 * HEARTBEAT_S)  # stats from before now have been replaced
    return wait_for(lambda: settled(cluster), 10, what)


class CancelTest(unittest.TestCase):
    def test_cancel_200_streams_frees_everything(self):
        with Cluster(workers=2) as c:
            base = wait_for(lambda: settled(c), 10, "idle workers")
            max_ctx = c.gen.GetModelInfo(metrale_pb2.ModelInfoRequest()).max_context
            max_new = min(256, max_ctx - 8)
            streams = []
            for i in range(200):
                # i % 4 == 0: cancelled at once (most are still queued); others after 1..3 tokens.
                after = None if i % 4 == 0 else 1 + i % 3
                prompt = [1 + i % 50, 2, 3] + ([4 + i % 7] * (64 + i % 40) if i % 5 == 0 else [])
                streams.append(Collector(c.gen, request("cancel-%d" % i, prompt, max_new),
                                         cancel_after=after))
                if after is None:
                    streams[-1].call.cancel()
            for s in streams:
                s.wait(60)
            for s in streams:
                self.assertEqual(s.code, grpc.StatusCode.CANCELLED, "%s: %s %s" % (s.req.request_id, s.code, s.details))
                self.assertLess(len(s.tokens), max_new, s.req.request_id)
            st = settle(c, "no live sequence and the cache at baseline after 200 cancels")
            for w in st.workers:
                self.assertEqual(w.live_sequences, 0)
                self.assertEqual(w.cache_bytes_in_use, w.cache_bytes_baseline)
                self.assertTrue(accounted(w), w)
            self.assertGreater(sum(w.slots_prefix for w in st.workers), 0, "no prefix was kept")
            self.assertGreater(sum(w.pages_prefix for w in st.workers), 0, "no prefix holds a page")
            aborted = sum(w.sequences_aborted for w in st.workers) - sum(w.sequences_aborted for w in base.workers)
            self.assertGreater(aborted, 0, "no sequence was aborted on a worker: nothing was mid-flight")
            self.assertEqual(st.worker_restarts, 0)
            # The service still works.
            s = Collector(c.gen, request("after", [5, 6, 7], 4)).wait(30)
            self.assertEqual((s.code, len(s.tokens)), (grpc.StatusCode.OK, 4), s.details)

    def test_client_killed_mid_stream_frees_everything(self):
        """A client process that dies (its connection drops, no RST_STREAM per call) is a cancel too."""
        with Cluster(workers=2) as c:
            wait_for(lambda: settled(c), 10, "idle workers")
            client = textwrap.dedent("""
                import os, sys
                from harness import Collector, request, metrale_pb2_grpc
                import grpc
                stub = metrale_pb2_grpc.GenerationStub(grpc.insecure_channel(sys.argv[1]))
                streams = [Collector(stub, request("doomed-%d" % i, [i + 1, 2, 3], 2000)) for i in range(24)]
                for s in streams:
                    s.first_token.wait(30)
                print("streaming", flush=True)
                os.kill(os.getpid(), 9)
            """)
            p = subprocess.run([sys.executable, "-c", client, c.addr], capture_output=True, text=True, timeout=60)
            self.assertIn("streaming", p.stdout, p.stderr)
            self.assertEqual(p.returncode, -signal.SIGKILL)
            settle(c, "no live sequence after the client died")
            self.assertEqual(c.stats().worker_restarts, 0)

    def test_deadline_exceeded_stops_the_worker(self):
        with Cluster(workers=1) as c:
            wait_for(lambda: settled(c), 10, "idle worker")
            max_ctx = c.gen.GetModelInfo(metrale_pb2.ModelInfoRequest()).max_context
            # Long enough to outlive a 0.3 s deadline.
            streams = [Collector(c.gen, request("dl-%d" % i, [9, 8, 7], max_ctx - 3), timeout=0.3) for i in range(4)]
            for s in streams:
                s.wait(30)
                self.assertEqual(s.code, grpc.StatusCode.DEADLINE_EXCEEDED, s.details)
            settle(c, "the worker freed the expired sequences")


class KillTest(unittest.TestCase):
    def test_kill_9_one_worker_under_load(self):
        with Cluster(workers=2) as c:
            wait_for(lambda: settled(c), 10, "idle workers")
            max_ctx = c.gen.GetModelInfo(metrale_pb2.ModelInfoRequest()).max_context
            # Measure the speed to size streams that last ~2 s on the survivor.
            t0 = time.monotonic()
            probe = Collector(c.gen, request("probe", [3, 4, 5], 32)).wait(30)
            self.assertEqual(probe.code, grpc.StatusCode.OK, probe.details)
            per_tok = (time.monotonic() - t0) / 32
            n = 8
            max_new = max(16, min(max_ctx - 4, int(2.0 / max(per_tok, 1e-4) / 2)))
            streams = [Collector(c.gen, request("load-%d" % i, [10 + i, 11, 12], max_new)) for i in range(n)]
            for s in streams:
                self.assertTrue(s.first_token.wait(30), "no first token")
            # The load shows in the stats (this is what makes "back at baseline" mean something).
            wait_for(lambda: all(w.live_sequences > 0 and w.cache_bytes_in_use > w.cache_bytes_baseline
                                 for w in c.live_workers()), 2 * HEARTBEAT_S + 0.5, "both workers busy in GetStats")
            killed_at = time.monotonic()
            c.kill_worker(1, signal.SIGKILL)
            for s in streams:
                s.wait(60)
            lost = [s for s in streams if s.code != grpc.StatusCode.OK]
            done = [s for s in streams if s.code == grpc.StatusCode.OK]
            self.assertTrue(lost, "no stream was on the killed worker (least-loaded sharding should split them)")
            self.assertTrue(done, "no stream survived")
            for s in lost:
                self.assertEqual(s.code, grpc.StatusCode.UNAVAILABLE, s.details)
                self.assertIn("w1", s.details)
                self.assertLess(s.ended_at - killed_at, 3.0, "UNAVAILABLE came %.2f s after the kill" % (s.ended_at - killed_at))
            for s in done:
                self.assertEqual(len(s.tokens), max_new, s.req.request_id)
                self.assertIsNotNone(s.final)
            self.assertEqual(c.check(), SERVING)
            st = c.stats()
            self.assertEqual([w.worker_id for w in st.workers if w.alive], [0])
            # New traffic goes to the survivor.
            s = Collector(c.gen, request("after-kill", [1, 2], 4)).wait(30)
            self.assertEqual(s.code, grpc.StatusCode.OK, s.details)
            # The killed worker comes back: live again, one restart.
            c.start_worker(1)
            c.wait_workers(2)
            self.assertEqual(c.stats().worker_restarts, 1)


if __name__ == "__main__":
    unittest.main(verbosity=2)
