"""The router's Prometheus endpoint (--metrics): a router and one CPU worker drafting with the
checkpoint's MTP block (tests/fixtures/mtp_a, --speculative-tokens 3), driven over real gRPC while
/metrics is fetched over HTTP. Every scrape must pass `promtool check metrics` (Debian's
prometheus package; scripts/install-deps.sh installs it, and the test fails without it). The
counters must match what was sent: requests by final status and by finish reason, the generated
tokens the client received, the prompt tokens the workers report, one latency observation per
finished request; the speculative and prefix-cache counters what the final messages and GetStats
report; and a killed worker counts as a restart without any counter going down."""

import shutil
import signal
import subprocess
import unittest
import urllib.error

import grpc

from harness import Cluster, Collector, metrale_pb2, request, scrape, wait_for

MODEL = "tests/fixtures/mtp_a"
CHART = "charts/metrale/Chart.yaml"
PROMPT = [5, 17, 29, 41, 53, 65, 77]
HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prompt_tokens", "request_generation_tokens"]


def value(m, name, **labels):
    """The sample name{labels} of a parsed scrape (0 when absent, as Prometheus reads a counter)."""
    return m.get("metrale_" + name, {}).get(frozenset(labels.items()), 0.0)


def promtool_check(text):
    """promtool check metrics on text; fails the test when promtool is missing or complains."""
    promtool = shutil.which("promtool")
    if promtool is None:
        raise AssertionError("promtool not found: install Debian's prometheus package (scripts/install-deps.sh)")
    p = subprocess.run([promtool, "check", "metrics"], input=text.encode(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, timeout=30)
    if p.returncode != 0 or p.stdout.strip():
        raise AssertionError("promtool check metrics:\n" + p.stdout.decode())


class MetricsTest(unittest.TestCase):
    def check_histograms(self, m):
        """Cumulative buckets, +Inf equal to _count; returns {short name: count}."""
        counts = {}
        for h in HISTOGRAMS:
            name = "metrale_" + h
            buckets = sorted(((float(dict(k)["le"]), v) for k, v in m[name + "_bucket"].items()))
            self.assertEqual(buckets[-1][0], float("inf"), name)
            for (_, a), (_, b) in zip(buckets, buckets[1:]):
                self.assertLessEqual(a, b, name + " buckets are cumulative")
            count = value(m, h + "_count")
            self.assertEqual(buckets[-1][1], count, name)
            counts[h] = count
        return counts

    def scrape_checked(self, c):
        text = scrape(c.metrics_addr)
        promtool_check(text)
        return c.metrics()

    def test_counters_follow_the_requests(self):
        with Cluster(workers=1, model=MODEL, worker_args=["--speculative-tokens", "3"], metrics=True) as c:
            # the worker's pools come with its first heartbeat, within 0.5 s of its Hello
            wait_for(lambda: value(c.metrics(), "cache_pages_capacity", worker="0") > 0, 5, "the first heartbeat")
            m = self.scrape_checked(c)
            with open(CHART) as f:
                app_version = [ln.split(":", 1)[1].strip().strip('"') for ln in f if ln.startswith("appVersion:")][0]
            self.assertEqual(m["metrale_build_info"], {frozenset({("version", app_version)}): 1.0})
            info = c.gen.GetModelInfo(metrale_pb2.ModelInfoRequest(), timeout=5)
            self.assertEqual(info.version, app_version)
            self.assertEqual(value(m, "num_workers_live"), 1)
            self.assertEqual(value(m, "requests_total", code="OK"), 0)
            self.assertGreater(value(m, "cache_pages_capacity", worker="0"), 0)
            self.assertGreater(value(m, "state_slots_capacity", worker="0"), 0)
            with self.assertRaises(urllib.error.HTTPError) as e:
                scrape(c.metrics_addr, "/")
            self.assertEqual(e.exception.code, 404)
            with self.assertRaises(urllib.error.HTTPError) as e:
                scrape(c.metrics_addr, "/metrics", method="POST")
            self.assertEqual(e.exception.code, 405)

            # One request ends by length, one at a stop token (the third token greedy decoding
            # gives that prompt): the counters are exact as soon as the client has its final
            # message, since the router counts before it sends.
            length = Collector(c.gen, request("length", PROMPT, 12)).wait(30)
            self.assertEqual(length.code, grpc.StatusCode.OK, length.details)
            self.assertEqual(length.final.finish_reason, metrale_pb2.FINISH_REASON_LENGTH)
            stop_at = length.tokens[2]
            stopping = metrale_pb2.StoppingCriteria(max_new_tokens=12, ignore_eos=True, stop_token_ids=[stop_at])
            stop = Collector(c.gen, request("stop", PROMPT, stopping=stopping)).wait(30)
            self.assertEqual(stop.code, grpc.StatusCode.OK, stop.details)
            self.assertEqual(stop.final.finish_reason, metrale_pb2.FINISH_REASON_STOP)
            done = [length, stop]
            streamed = sum(len(s.tokens) for s in done)
            prompt_tokens = sum(s.final.usage.prompt_tokens for s in done)
            self.assertEqual(prompt_tokens, 2 * len(PROMPT))

            m = self.scrape_checked(c)
            self.assertEqual(value(m, "requests_total", code="OK"), 2)
            self.assertEqual(value(m, "request_success_total", finished_reason="length"), 1)
            self.assertEqual(value(m, "request_success_total", finished_reason="stop"), 1)
            self.assertEqual(value(m, "generation_tokens_total"), streamed)
            self.assertEqual(value(m, "prompt_tokens_total"), prompt_tokens)
            counts = self.check_histograms(m)
            for h in ["time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "request_prompt_tokens", "request_generation_tokens"]:
                self.assertEqual(counts[h], 2, h)
            self.assertEqual(value(m, "request_generation_tokens_sum"), streamed)
            self.assertEqual(value(m, "request_prompt_tokens_sum"), prompt_tokens)
            # one inter-token latency per batch of tokens after the first (speculative steps bring several)
            self.assertGreaterEqual(counts["inter_token_latency_seconds"], 1)
            self.assertLessEqual(counts["inter_token_latency_seconds"], streamed - 2)
            self.assertLessEqual(value(m, "time_to_first_token_seconds_sum"),
                                 value(m, "e2e_request_latency_seconds_sum"))

            # The workers' own counters come with their heartbeats (every 0.5 s): the speculative
            # ones add up to the final messages' reports, the prefix-cache ones to GetStats'.
            sp = [s.final.speculation for s in done]
            self.assertGreater(sum(x.draft_tokens for x in sp), 0)

            def caught_up():
                m = c.metrics()
                ws = c.stats().workers
                want = {
                    "spec_decode_num_draft_tokens_total": sum(x.draft_tokens for x in sp),
                    "spec_decode_num_accepted_tokens_total": sum(x.accepted_tokens for x in sp),
                    "spec_decode_num_drafts_total": sum(x.verify_steps for x in sp),
                    "prefix_cache_hits_total": sum(w.prefix_hits for w in ws),
                    "prefix_cache_queries_total": sum(w.prefix_hits + w.prefix_misses for w in ws),
                    "num_requests_running": 0,
                }
                return m if all(value(m, k) == v for k, v in want.items()) else None
            m = wait_for(caught_up, 5, "the heartbeat counters to match the final messages and GetStats", step=0.1)
            self.assertEqual(value(m, "prefix_cache_queries_total"), 2)  # prefix reuse is on by default
            self.assertEqual(value(m, "num_preemptions_total"), 0)
            self.assertEqual(value(m, "num_requests_waiting"), 0)

            # A request the client cancels after two tokens: the worker's Finished (CANCELLED)
            # counts it as an abort, with the tokens it sent, streamed or not. Then a refused one.
            ctx = c.gen.GetModelInfo(metrale_pb2.ModelInfoRequest(), timeout=5).max_context
            max_new = ctx - len(PROMPT)
            cancelled = Collector(c.gen, request("cancel", PROMPT, max_new), cancel_after=2).wait(30)
            self.assertEqual(cancelled.code, grpc.StatusCode.CANCELLED)
            with self.assertRaises(grpc.RpcError) as e:
                list(c.gen.Generate(request("refused", PROMPT, 0), timeout=5))
            self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            m = wait_for(lambda: (lambda m: m if value(m, "request_success_total", finished_reason="abort") == 1
                                  and value(m, "requests_total", code="CANCELLED") == 1 else None)(c.metrics()),
                         5, "the cancelled request to be counted")
            self.assertEqual(value(m, "requests_total", code="INVALID_ARGUMENT"), 1)
            self.assertEqual(value(m, "requests_total", code="OK"), 2)
            self.assertEqual(sum(m["metrale_requests_total"].values()), 4)
            self.assertEqual(sum(m["metrale_request_success_total"].values()), 3)
            extra = value(m, "generation_tokens_total") - streamed
            self.assertGreaterEqual(extra, len(cancelled.tokens))
            self.assertLess(extra, max_new)
            counts = self.check_histograms(m)
            self.assertEqual(counts["e2e_request_latency_seconds"], 3)
            self.assertEqual(counts["time_to_first_token_seconds"], 3)
            self.assertEqual(value(m, "request_generation_tokens_sum"), value(m, "generation_tokens_total"))

            # A worker killed and started again: a restart, live again, no counter going down.
            before = m
            c.kill_worker(0, signal.SIGKILL)
            wait_for(lambda: value(c.metrics(), "num_workers_live") == 0, 5, "the dead worker to leave the gauge")
            self.assertNotIn("metrale_cache_pages_capacity", c.metrics())  # only live workers have samples
            c.start_worker(0)
            m = wait_for(lambda: (lambda m: m if value(m, "num_workers_live") == 1
                                  and value(m, "worker_restarts_total") == 1
                                  and value(m, "cache_pages_capacity", worker="0") > 0 else None)(c.metrics()),
                         20, "the worker to come back")
            for name, samples in before.items():
                if name.endswith("_total") or name.endswith("_count") or name.endswith("_bucket"):
                    for labels, v in samples.items():
                        self.assertGreaterEqual(m[name][labels], v, "%s%s" % (name, dict(labels)))
            promtool_check(scrape(c.metrics_addr))


if __name__ == "__main__":
    unittest.main(verbosity=2)
