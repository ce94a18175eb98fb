"""The demo model's held-out perplexity computed by the service equals transformers' within 0.5%.

models/glm5-next-demo/heldout_ppl.json holds transformers' figure (tools/train/eval_ppl.py: fp32,
per-window NLL) and the definition of its windows. Here, through the real router and a CPU
worker: the held-out documents are tokenized with the Tokenize call and must give the recorded
stream exactly; each window is scored with echo (prompt logprobs), and the NLL of every window
and the perplexity of all must agree with transformers' within 0.5%."""

import json
import math
import os
import unittest
from concurrent.futures import ThreadPoolExecutor

import grpc

from harness import Cluster, Collector, metrale_pb2, path

MODEL = "models/glm5-next-demo"
TOLERANCE = 0.005


class HeldoutPerplexityTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(path(os.path.join(MODEL, "heldout_ppl.json"))) as f:
            cls.ref = json.load(f)
        cls.cluster = Cluster(workers=1, model=path(MODEL))

    @classmethod
    def tearDownClass(cls):
        cls.cluster.close()

    def tokenize(self, text):
        r = self.cluster.gen.Tokenize(metrale_pb2.TokenizeRequest(text=text), timeout=30)
        return list(r.token_ids)

    def stream(self):
        """The held-out stream as the definition says: each document with the special tokens
        the tokenizer adds, then <|endoftext|>."""
        with open(path(os.path.join(MODEL, "heldout.txt")), encoding="utf-8", newline="") as f:
            docs = f.read().split("\n\f\n")
        eot = self.ref["stream_ids"][-1]
        out = []
        for d in docs:
            out += self.tokenize(d) + [eot]
        return out

    def window_nll(self, i, win):
        req = metrale_pb2.GenerateRequest(
            request_id="w%d" % i, prompt_token_ids=win, echo=True,
            stopping=metrale_pb2.StoppingCriteria(max_new_tokens=1, ignore_eos=True))
        s = Collector(self.cluster.gen, req, timeout=300).wait(300)
        if s.code != grpc.StatusCode.OK:
            self.cluster.dump_logs()
        self.assertEqual(s.code, grpc.StatusCode.OK, s.details)
        plp = [t for r in s.responses for t in r.prompt_logprobs]  # positions 1..len-1
        self.assertEqual([t.token_id for t in plp], win[1:])
        prefix = len(self.ref["windows"]["prefix_ids"])
        return -sum(t.logprob for t in plp[prefix - 1:]), len(plp) - (prefix - 1)

    def test_perplexity_equals_transformers(self):
        ref = self.ref
        stream = self.stream()
        self.assertEqual(len(stream), len(ref["stream_ids"]))
        self.assertEqual(stream, ref["stream_ids"], "the Tokenize call gives the recorded stream")

        w = ref["windows"]
        piece = w["seq"] - len(w["prefix_ids"])
        windows = [w["prefix_ids"] + stream[i:i + piece] for i in range(0, len(stream), piece)]
        self.assertEqual([len(x) for x in windows], w["lengths"])

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda a: self.window_nll(*a), enumerate(windows)))
        for i, ((nll, n), r) in enumerate(zip(got, w["per_window"])):
            self.assertEqual(n, r["scored"], "window %d" % i)
            self.assertLess(abs(nll - r["nll"]) / r["nll"], TOLERANCE,
                            "window %d: NLL %.3f here, %.3f by transformers" % (i, nll, r["nll"]))
        nll = sum(x for x, _ in got)
        n = sum(k for _, k in got)
        self.assertEqual(n, ref["scored_tokens"])
        ppl = math.exp(nll / n)
        rel = abs(ppl - ref["perplexity"]) / ref["perplexity"]
        print("held-out perplexity: %.4f here, %.4f by transformers (%s); relative difference %.2e "
              "over %d tokens" % (ppl, ref["perplexity"], ref["computed_by"].split(",")[0], rel, n))
        self.assertLess(rel, TOLERANCE)


if __name__ == "__main__":
    unittest.main(verbosity=2)
