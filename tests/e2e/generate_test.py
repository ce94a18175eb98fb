"""Streamed tokens through router + worker equal metrale-generate's greedy tokens for the same
prompt (tests/fixtures/tiny_a, a real checkpoint): one stream at a time, then all prompts at once
across two workers (continuous batching must not change a sequence's tokens). Also checks the
stream's shape: request_id echoed on every message, one final message last, usage counts."""

import subprocess
import unittest

import grpc

from harness import GENERATE_BIN, MODEL_DIR, Cluster, Collector, metrale_pb2, path, request, wait_for

MAX_NEW = 24
PROMPTS = [
    [1, 2, 3],
    [42],
    [5, 17, 99, 123, 250, 7, 7, 7, 64, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
    [299, 0, 150],
    [i % 300 for i in range(3, 120, 3)],
    [200, 100, 50, 25, 12, 6, 3, 1],
]


def cli_greedy(prompt, max_new):
    out = subprocess.run([path(GENERATE_BIN), "--model", path(MODEL_DIR), "--prompt", ",".join(map(str, prompt)),
                          "--max-new", str(max_new), "--threads", "1"],
                         check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.startswith("generated:"):
            return [int(x) for x in line.split()[1:]]
    raise AssertionError("metrale-generate printed no 'generated:' line:\n" + out)


class GenerateTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.want = [cli_greedy(p, MAX_NEW) for p in PROMPTS]

    def check_stream(self, s, want):
        r = s.req
        self.assertEqual(s.code, grpc.StatusCode.OK, "%s: %s" % (r.request_id, s.details))
        self.assertEqual(s.tokens, want, "%s: streamed tokens differ from metrale-generate" % r.request_id)
        self.assertTrue(s.responses and all(x.request_id == r.request_id for x in s.responses))
        self.assertTrue(s.responses[-1].HasField("final"))
        self.assertFalse(any(x.HasField("final") for x in s.responses[:-1]))
        self.assertEqual(s.final.finish_reason, metrale_pb2.FINISH_REASON_LENGTH)
        self.assertEqual(s.final.usage.prompt_tokens, len(r.prompt_token_ids))
        self.assertEqual(s.final.usage.completion_tokens, MAX_NEW)

    def test_greedy_tokens_equal_the_cli(self):
        with Cluster(workers=2) as c:
            info = c.gen.GetModelInfo(metrale_pb2.ModelInfoRequest(), timeout=5)
            self.assertEqual((info.model_type, info.vocab_size, info.workers), ("glm5_next", 300, 2))
            for i, (p, want) in enumerate(zip(PROMPTS, self.want)):
                self.check_stream(Collector(c.gen, request("one-%d" % i, p, MAX_NEW)).wait(60), want)
            # All at once, twice over, spread across both workers.
            streams = [Collector(c.gen, request("many-%d-%d" % (k, i), p, MAX_NEW))
                       for k in range(2) for i, p in enumerate(PROMPTS)]
            for s, want in zip(streams, self.want * 2):
                self.check_stream(s.wait(60), want)
            self.assertEqual(c.stats().worker_restarts, 0)

    def test_shared_prefix_is_reused_and_reported(self):
        """Two prompts sharing a 100-token prefix, one after the other on one worker: the second
        reuses the first's kept prefix (GetStats shows the hit) and still streams the tokens
        metrale-generate computes from scratch."""
        shared = [(i * 37 + 11) % 300 for i in range(100)]
        a, b = shared + [1, 2, 3], shared + [250, 7]
        want_b = cli_greedy(b, MAX_NEW)
        with Cluster(workers=1) as c:
            self.check_stream(Collector(c.gen, request("prefix-a", a, MAX_NEW)).wait(60), cli_greedy(a, MAX_NEW))
            self.check_stream(Collector(c.gen, request("prefix-b", b, MAX_NEW)).wait(60), want_b)
            w = wait_for(lambda: next((x for x in c.stats().workers if x.prefix_hits >= 1 and x.live_sequences == 0),
                                      None), 5, "a prefix hit in GetStats, no sequence live")
            self.assertGreaterEqual(w.prefix_misses, 1)
            self.assertGreater(w.prefix_cache_bytes, 0)
            # the pools: the kept 64-token prefix holds one page and one slot, nothing else is held
            self.assertGreater(w.cache_pages_total, 0)
            self.assertEqual(w.cache_pages_free, w.cache_pages_total - 1)
            self.assertEqual(w.slots_free, w.slots_total - 1)
            self.assertEqual(w.preemptions, 0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
