"""Tensor-parallel worker groups through metrale-serve --tp 2 --workers 2 (CPU, tests/fixtures/tiny_a):

- greedy tokens through the router equal metrale-generate's (one process), one stream at a time
  and many at once across both groups;
- a rank killed with SIGKILL mid-stream (a follower, rank 1, of one group; later rank 0 of the
  other): of the dead group's streams, those that had received no token yet complete normally on
  the other group (the router puts them back in the queue), those that had end UNAVAILABLE, both
  within 1 s of the kill (asserted < 1.5 s); the other group's streams are unaffected; the launcher
  starts the whole group again and it serves. The figures are printed;
- a group size that does not divide the model: every start fails, the launcher gives the group up
  after 3 tries and exits 1, saying why.
"""

import os
import signal
import subprocess
import threading
import time
import unittest

import grpc

from harness import GENERATE_BIN, MODEL_DIR, Collector, Launcher, metrale_pb2, path, request, wait_for

MAX_NEW = 24
PROMPTS = [[1, 2, 3], [42], [5, 17, 99, 123, 250, 7, 7, 7, 64, 1, 2, 3], [299, 0, 150], [200, 100, 50, 25, 12, 6]]
LONG_DECODE = 400   # tokens of a stream that is still running when the rank dies
LONG_PROMPT = 3000  # tokens of a prompt still in its prefill when the rank dies (~0.6 s alone here)


def cli_greedy(prompt, max_new):
    out = subprocess.run([path(GENERATE_BIN), "--model", path(MODEL_DIR), "--prompt", ",".join(map(str, prompt)),
                          "--max-new", str(max_new), "--threads", "1"],
                         check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.startswith("generated:"):
            return [int(x) for x in line.split()[1:]]
    raise AssertionError("metrale-generate printed no 'generated:' line:\n" + out)


def long_prompt(seed):
    """A prompt no group has seen (no kept prefix shortens its prefill)."""
    return [(i * 7 + seed * 13 + i * i % 11) % 300 for i in range(LONG_PROMPT)]


class Comeback:
    """Watches, from the kill on, for the killed group to be live again in the router; then sends it
    a request at once (or two, one a group, when the other group is idle and could take the first)
    and waits for their first tokens."""

    def __init__(self, svc, victim, restarts):
        self.svc, self.victim, self.restarts = svc, victim, restarts
        self.alive_at = None
        self.streams = []
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            end = time.monotonic() + 20
            while time.monotonic() < end:
                st = self.svc.stats()
                if st.worker_restarts > self.restarts and all(w.alive for w in st.workers):
                    self.alive_at = time.monotonic()
                    break
                time.sleep(0.01)
            if self.alive_at is None:
                return
            # The other group busy (every active stream is its): the next request goes to the
            # restarted group, the least loaded. Both idle: one request a group.
            n = 1 if st.active_streams > 0 else 2
            for i in range(n):
                before = self.svc.stats().active_streams
                self.streams.append(Collector(self.svc.gen, request("comeback-%d" % i, PROMPTS[i], MAX_NEW)))
                wait_for(lambda: self.svc.stats().active_streams > before or self.streams[-1].done.is_set(), 10,
                         "the router to send a request", step=0.005)
            for s in self.streams:
                s.first_token.wait(30)
        except Exception as e:  # reported by the test thread
            self.error = repr(e)


class TpGroupTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.want = [cli_greedy(p, MAX_NEW) for p in PROMPTS]
        cls.want_long_decode = {p: cli_greedy([p, 2, 3], LONG_DECODE) for p in (1, 2, 3, 4)}

    def check_ok(self, s, want=None, n=None):
        self.assertEqual(s.code, grpc.StatusCode.OK, "%s: %s" % (s.req.request_id, s.details))
        self.assertEqual(s.final.finish_reason, metrale_pb2.FINISH_REASON_LENGTH, s.req.request_id)
        if want is not None:
            self.assertEqual(s.tokens, want, "%s: tokens differ from one process's" % s.req.request_id)
        if n is not None:
            self.assertEqual(len(s.tokens), n, s.req.request_id)

    def submit_in_order(self, svc, reqs):
        """Starts the streams one after the other, each once the router has sent the one before to a
        worker, so that least-loaded placement alternates between the groups."""
        streams = []
        for req in reqs:
            before = svc.stats().active_streams
            streams.append(Collector(svc.gen, req))
            wait_for(lambda: svc.stats().active_streams > before or streams[-1].done.is_set(), 10,
                     "the router to send %s to a worker" % req.request_id, step=0.005)
        return streams

    def kill_mid_stream(self, svc, victim, rank, tag, seeds):
        """Two decoding streams, then two long prompts (one of each a group); SIGKILL of `rank` of
        worker group `victim` while the prompts are in prefill."""
        st0 = svc.stats()
        self.assertEqual(st0.active_streams, 0)
        decode = []
        for i, p in enumerate((1, 2)):  # the second goes to the other group: the first is in flight
            decode += self.submit_in_order(svc, [request("%s-decode-%d" % (tag, i), [p, 2, 3], LONG_DECODE)])
            self.assertTrue(decode[-1].first_token.wait(30), "no first token")
        prompts = {seed: long_prompt(seed) for seed in seeds}
        fresh = self.submit_in_order(svc, [request("%s-prefill-%d" % (tag, s), prompts[s], 8) for s in seeds])
        pid = svc.ranks()[(victim, rank)]
        started = [s for s in decode + fresh if s.tokens]
        back = Comeback(svc, victim, st0.worker_restarts)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        back.thread.start()
        self.assertEqual(started, decode, "the long prompts must still be in prefill at the kill, and the "
                         "decoding streams running: make LONG_PROMPT longer")
        self.assertFalse(any(s.done.is_set() for s in decode), "a decoding stream ended before the kill")
        requeued_at = None
        while requeued_at is None and time.monotonic() - killed_at < 5:
            if svc.stats().streams_requeued > st0.streams_requeued:
                requeued_at = time.monotonic()
            else:
                time.sleep(0.005)
        for s in decode + fresh:
            s.wait(60)
        lost = [s for s in decode if s.code != grpc.StatusCode.OK]
        self.assertEqual(len(lost), 1, "one decoding stream was on each group: %s" % [(s.code, s.details) for s in decode])
        self.assertEqual(lost[0].code, grpc.StatusCode.UNAVAILABLE, lost[0].details)
        self.assertIn("w%d" % victim, lost[0].details)
        for s, p in zip(decode, (1, 2)):
            if s is not lost[0]:  # the other group's stream: all its tokens, as one process makes them
                self.check_ok(s, self.want_long_decode[p])
        for s in fresh:  # one of them moved to the surviving group
            self.check_ok(s, n=8)
        self.assertEqual(svc.stats().streams_requeued - st0.streams_requeued, 1)
        self.assertIsNotNone(requeued_at, "no stream was put back in the queue")
        lost_s = lost[0].ended_at - killed_at
        requeue_s = requeued_at - killed_at
        # The moved streams' tokens are what a fresh request of their prompt gets (a kept prefix
        # makes that one quick; it gives the same tokens).
        for s in fresh:
            again = Collector(svc.gen, request(s.req.request_id + "-again", list(s.req.prompt_token_ids), 8)).wait(60)
            self.check_ok(again, s.tokens)

        # The group came back: live again in the router, and serving.
        back.thread.join(30)
        self.assertIsNone(back.error, back.error)
        self.assertIsNotNone(back.alive_at, "group %d did not come back" % victim)
        alive_s = back.alive_at - killed_at
        first_s = max(s.first_token_at for s in back.streams) - killed_at
        for s, i in zip(back.streams, range(len(back.streams))):
            self.check_ok(s.wait(30), self.want[i])
        wait_for(lambda: any(w.worker_id == victim and w.alive and w.sequences_finished > 0 for w in svc.stats().workers),
                 5, "the restarted group %d to finish a sequence" % victim, step=0.05)
        print("\n%s: kill -9 of worker %d rank %d: streams put back in the queue %.3f s after the kill, the "
              "started stream ended UNAVAILABLE %.3f s after; group %d live again %.2f s after, serving a first "
              "token by %.2f s" % (tag, victim, rank, requeue_s, lost_s, victim, alive_s, first_s), flush=True)
        self.assertLess(requeue_s, 1.5)
        self.assertLess(lost_s, 1.5)

    def test_groups_serve_and_survive_a_dead_rank(self):
        # A prefill budget above two long prompts: each is prefilled whole, as when it is alone.
        with Launcher(["--tp", "2", "--workers", "2", "--threads", "1", "--prefill-budget", "8192"]) as svc:
            svc.connect(2)
            self.assertEqual(sorted(w.worker_id for w in svc.live_workers()), [0, 1])
            self.assertEqual(sorted(svc.ranks()), [(0, 0), (0, 1), (1, 0), (1, 1)])
            info = svc.gen.GetModelInfo(metrale_pb2.ModelInfoRequest(), timeout=5)
            self.assertEqual((info.model_type, info.workers), ("glm5_next", 2))
            for i, (p, want) in enumerate(zip(PROMPTS, self.want)):
                self.check_ok(Collector(svc.gen, request("one-%d" % i, p, MAX_NEW)).wait(60), want)
            streams = [Collector(svc.gen, request("many-%d-%d" % (k, i), p, MAX_NEW))
                       for k in range(2) for i, p in enumerate(PROMPTS)]
            for s, want in zip(streams, self.want * 2):
                self.check_ok(s.wait(60), want)
            wait_for(lambda: all(w.sequences_finished > 0 for w in svc.stats().workers), 5, "both groups to serve")

            self.kill_mid_stream(svc, victim=1, rank=1, tag="follower", seeds=(1, 2))
            self.kill_mid_stream(svc, victim=0, rank=0, tag="leader", seeds=(3, 4))

            svc.proc.send_signal(signal.SIGTERM)
            self.assertEqual(svc.proc.wait(30), 0)
            self.assertIn("metrale-serve: stopped", svc.log())

    def test_a_group_size_that_does_not_divide_the_model_is_given_up(self):
        t0 = time.monotonic()
        with Launcher(["--tp", "3", "--workers", "1", "--threads", "1"]) as svc:
            self.assertEqual(svc.proc.wait(30), 1)
            log = svc.log()
            self.assertIn("linear_num_heads (KDA heads) = 4 is not a multiple of 3", log)
            self.assertIn("worker group 0 failed to start 3 times in a row", log)
            self.assertIn("no worker group can serve", log)
            self.assertEqual(log.count("restarting worker group 0"), 2, log)
        self.assertLess(time.monotonic() - t0, 20)


if __name__ == "__main__":
    unittest.main(verbosity=2)
