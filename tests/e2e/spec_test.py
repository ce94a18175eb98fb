"""Speculative decoding end to end: metrale-serve with --speculative-tokens serving a checkpoint
with an MTP block (tests/fixtures/mtp_a), on the CPU, one worker and a tensor-parallel group of
two. Through real gRPC: greedy streams are token for token those of the same requests with
no_speculation and those of a server without speculation, also with mixed steps (the verifies in
one model call with the decode rows and prompt chunks); the final message reports the drafts and
the accepted ones; the worker stats count them."""

import unittest

from harness import Collector, Launcher, metrale_pb2, wait_for

MODEL = "tests/fixtures/mtp_a"
PROMPTS = [[(r * 31 + i * 7 + 3) % 300 for i in range(6 + r * 5)] for r in range(6)]
MAX_NEW = 40


def request(rid, prompt, **kw):
    return metrale_pb2.GenerateRequest(
        request_id=rid, prompt_token_ids=prompt,
        stopping=metrale_pb2.StoppingCriteria(max_new_tokens=MAX_NEW, ignore_eos=True), **kw)


def run_all(svc, tag, **kw):
    """The prompts at once; returns [(tokens, final)] in prompt order."""
    cs = [Collector(svc.gen, request("%s-%d" % (tag, i), p, **kw), timeout=120) for i, p in enumerate(PROMPTS)]
    out = []
    for c in cs:
        s = c.wait(120)
        assert s.code.name == "OK", (s.code, s.details)
        toks = [t.token_id for r in s.responses for t in r.tokens]
        final = [r.final for r in s.responses if r.HasField("final")][-1]
        out.append((toks, final))
    return out


class SpeculativeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with Launcher(["--workers", "1", "--threads", "1"], model=MODEL) as svc:
            svc.connect(1)
            cls.plain = [t for t, _ in run_all(svc, "plain")]

    def check_service(self, args, workers):
        with Launcher(args + ["--speculative-tokens", "3"], model=MODEL) as svc:
            svc.connect(workers)
            spec = run_all(svc, "spec")
            off = run_all(svc, "off", no_speculation=True)
            for i, ((toks, final), (toks_off, final_off)) in enumerate(zip(spec, off)):
                self.assertEqual(len(toks), MAX_NEW)
                self.assertEqual(toks, self.plain[i], "prompt %d with speculation" % i)
                self.assertEqual(toks_off, self.plain[i], "prompt %d opted out" % i)
                self.assertTrue(final.HasField("speculation"), "prompt %d" % i)
                sp = final.speculation
                self.assertGreater(sp.verify_steps, 0)
                self.assertLessEqual(sp.draft_tokens, 3 * sp.verify_steps)
                self.assertGreaterEqual(sp.draft_tokens, sp.verify_steps)
                self.assertLessEqual(sp.accepted_tokens, sp.draft_tokens)
                # the prefill's token, then accepted + 1 a verify step (the last token or two may
                # come from plain steps, where no draft fits before max_new_tokens)
                self.assertLessEqual(1 + sp.accepted_tokens + sp.verify_steps, MAX_NEW)
                self.assertGreaterEqual(1 + sp.accepted_tokens + sp.verify_steps + 2, MAX_NEW)
                self.assertFalse(final_off.HasField("speculation"))
            steps = sum(f.speculation.verify_steps for _, f in spec)
            # the stats come with the worker's heartbeats
            wait_for(lambda: sum(w.speculative_steps for w in svc.stats().workers) == steps, 10,
                     "the worker stats to count the speculative steps")
            ws = [w for w in svc.stats().workers if w.alive]
            self.assertEqual(len(ws), 1)
            self.assertEqual(ws[0].speculative_steps, steps)
            self.assertEqual(ws[0].draft_tokens, sum(f.speculation.draft_tokens for _, f in spec))
            self.assertEqual(ws[0].accepted_tokens, sum(f.speculation.accepted_tokens for _, f in spec))

    def test_one_worker(self):
        self.check_service(["--workers", "1", "--threads", "1"], 1)

    def test_tensor_parallel_group(self):
        self.check_service(["--workers", "1", "--tp", "2", "--threads", "1"], 1)

    # mixed steps with prompts fed 8 tokens a step: the verifies ride in one model call with the
    # decode rows and the chunks of the prompts admitted beside them, on every rank of a group
    def test_mixed_steps(self):
        self.check_service(["--workers", "1", "--threads", "1", "--mixed-steps", "--prefill-budget", "8"], 1)

    def test_tensor_parallel_group_mixed_steps(self):
        self.check_service(["--workers", "1", "--tp", "2", "--threads", "1", "--mixed-steps", "--prefill-budget", "8"],
                           1)


if __name__ == "__main__":
    unittest.main(verbosity=2)
