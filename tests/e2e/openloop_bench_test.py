"""bench/openloop_bench.py on the CPU with tests/fixtures/tiny_a, tiny settings: --goodput with SLOs
any rate meets (goodput within [lo, hi]) and with one no rate meets (none, lo missed), a shared
prefix the worker's prefix reuse hits, and --direct (bench/serving_direct's mix mode: every
request done). The bisection itself is checked against a made-up latency curve.

The figures are not checked (tiny model, shared CI cores); what is: every request gave the tokens
it asked for, the served rate does not exceed the offered one, p50 <= p99 and their ratio, and the
goodput verdicts. Binaries come from the runfiles through the driver's METRALE_*_BIN variables."""

import json
import os
import subprocess
import sys
import tempfile
import types
import unittest

from harness import path

sys.path.insert(0, os.path.abspath("bench"))
import openloop_bench  # noqa: E402

MIX = ["--requests", "40", "--prompt-mix", "16,32", "--new-mix", "8,16", "--max-sequences", "8"]
GOODPUT = ["--goodput", "--goodput-lo", "10", "--goodput-hi", "80", "--goodput-steps", "2"]


def bench(*args):
    """Runs openloop_bench.py with args; its --json result."""
    env = dict(os.environ, METRALE_ROUTER_BIN=os.path.abspath(path("router/metrale-router")),
               METRALE_WORKER_BIN=os.path.abspath(path("worker/metrale-worker")),
               METRALE_DIRECT_BIN=os.path.abspath(path("bench/serving_direct")))
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        p = subprocess.run([sys.executable, "bench/openloop_bench.py", "--model", "tests/fixtures/tiny_a",
                            "--json", out] + list(args), env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, universal_newlines=True, timeout=120)
        sys.stdout.write(p.stdout)
        if p.returncode != 0:
            raise AssertionError("openloop_bench exited %d" % p.returncode)
        with open(out) as f:
            return json.load(f), p.stdout


class OpenloopBench(unittest.TestCase):
    def check_rows(self, res):
        self.assertTrue(res["rows"])
        for r in res["rows"]:
            self.assertEqual(r["requests"], 40)
            self.assertEqual(r["completed"], r["requests"], r)
            self.assertEqual(r["tokens"], r["tokens_expected"], r)
            self.assertGreater(r["served_req_s"], 0)
            self.assertLessEqual(r["served_req_s"], r["offered_req_s"] * 1.5, r)
            self.assertLessEqual(r["ttft_p50_ms"], r["ttft_p99_ms"], r)
            self.assertLessEqual(r["itl_p50_ms"], r["itl_p99_ms"], r)
            self.assertAlmostEqual(r["itl_p99_over_p50"], r["itl_p99_ms"] / r["itl_p50_ms"], places=6)

    def check_direct(self, res):
        d = res["direct"]
        self.assertEqual(d["requests"], 40)
        self.assertEqual(d["requests_done"], d["requests"], d)
        self.assertEqual(d["tokens"], d["tokens_expected"], d)
        self.assertLessEqual(d["ttft_p50_ms"], d["ttft_p99_ms"], d)
        self.assertLessEqual(d["itl_p50_ms"], d["itl_p99_ms"], d)
        return d

    def test_goodput_met(self):
        res, out = bench(*(MIX + GOODPUT + ["--slo-ttft-ms", "60000", "--slo-itl-ms", "60000", "--direct"]))
        self.check_rows(res)
        self.assertIsNotNone(res["goodput_req_s"])
        self.assertTrue(10 <= res["goodput_req_s"] <= 80, res["goodput_req_s"])
        self.assertIn("goodput: ", out)
        self.assertTrue(all(r["meets_slo"] for r in res["rows"]))
        self.check_direct(res)

    def test_goodput_none(self):
        res, out = bench(*(MIX + GOODPUT + ["--slo-itl-ms", "0.001"]))
        self.check_rows(res)
        self.assertIsNone(res["goodput_req_s"])
        self.assertEqual(res["goodput_bound"], "none")
        self.assertEqual([r["rate"] for r in res["rows"]], [80, 10])  # hi, then lo: both missed
        self.assertIn("goodput: none: even 10 req/s misses", out)

    def test_shared_prefix(self):
        # 64: the worker keeps prefixes at multiples of its 64-token block, so a shorter shared
        # prefix is never reused. Usage has no cached-token count; the worker's prefix hits are.
        res, out = bench(*(MIX + ["--rates", "20", "--shared-prefix", "64", "--direct"]))
        self.check_rows(res)
        self.assertEqual(res["shared_prefix"], 64)
        self.assertGreater(res["rows"][0]["prefix_hits"], 0, res["rows"][0])
        self.assertIn("shared 64-token prefix", out)
        self.assertGreater(self.check_direct(res)["prefix_hits"], 0)

    def test_bisection(self):
        # A made-up service whose ITL p99 passes 25 ms at 12 req/s: probes hi, lo, then bisects.
        a = types.SimpleNamespace(slo_ttft_ms=250, slo_itl_ms=25, goodput_lo=1.0, goodput_hi=64.0, goodput_steps=6)
        probed = []

        def probe(rate):
            probed.append(rate)
            return {"ttft_p99_ms": 10.0, "itl_p99_ms": 25.0 * rate / 12}

        g = openloop_bench.find_goodput(probe, a)
        self.assertEqual(probed[:2], [64.0, 1.0])
        self.assertEqual(len(probed), 2 + 6)
        self.assertEqual(g["goodput_bound"], "bisected")
        self.assertLessEqual(g["goodput_req_s"], 12)
        self.assertGreater(g["goodput_miss_req_s"], 12)
        self.assertLess(g["goodput_miss_req_s"] / g["goodput_req_s"], 64 ** (1 / 2 ** 6) + 1e-9)
        self.assertEqual(openloop_bench.find_goodput(lambda r: {"ttft_p99_ms": 1, "itl_p99_ms": 1}, a),
                         {"goodput_req_s": 64.0, "goodput_bound": "lower", "goodput_miss_req_s": None})


if __name__ == "__main__":
    unittest.main(verbosity=2)
