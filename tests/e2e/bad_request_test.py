"""Malformed requests, table-driven, mixed into valid traffic: each bad one is answered with the
right code and a message naming the field, every valid stream completes, no worker restarts.
Also: a full admission queue answers RESOURCE_EXHAUSTED while the admitted streams complete;
bytes that are not a request, an unknown method and an unknown health service get their codes;
and a call with no request message or two is UNIMPLEMENTED (gRPC's cardinality rule)."""

import math
import random
import threading
import unittest

import grpc

from harness import Cluster, Collector, metrale_pb2, request, wait_for

INVALID = grpc.StatusCode.INVALID_ARGUMENT
S = metrale_pb2.SamplingParams
STOP = metrale_pb2.StoppingCriteria
M = metrale_pb2.ChatMessage


def bad_cases(vocab, ctx):
    """(name, request, code, text the message must contain)."""
    ok_stop = STOP(max_new_tokens=4)
    R = lambda **kw: metrale_pb2.GenerateRequest(**{"request_id": "bad", "prompt_token_ids": [1, 2, 3],
                                                    "stopping": ok_stop, **kw})
    return [
        ("empty request_id", R(request_id=""), INVALID, "request_id"),
        ("request_id of 129 chars", R(request_id="x" * 129), INVALID, "request_id"),
        ("request_id with a control char", R(request_id="a\x01b"), INVALID, "request_id"),
        ("request_id not ASCII", R(request_id="caf\u00e9"), INVALID, "request_id"),
        ("empty prompt", R(prompt_token_ids=[]), INVALID, "prompt_token_ids"),
        ("ids and prompt_text", R(prompt_text="hello"), INVALID, "prompt_token_ids and prompt_text are set"),
        ("ids and messages", R(messages=[M(role="user", content="hi")]), INVALID, "prompt_token_ids and messages"),
        ("token == vocab", R(prompt_token_ids=[1, vocab]), INVALID, "prompt_token_ids[1]"),
        ("token 2^32-1", R(prompt_token_ids=[2 ** 32 - 1]), INVALID, "vocab_size"),
        ("prompt longer than context", R(prompt_token_ids=[1] * (ctx + 1)), INVALID, "max_context"),
        ("prompt + max_new over context", R(stopping=STOP(max_new_tokens=ctx)), INVALID, "max_context"),
        ("no stopping", R(stopping=None), INVALID, "stopping.max_new_tokens"),
        ("max_new_tokens 0", R(stopping=STOP(max_new_tokens=0, ignore_eos=True)), INVALID, "stopping.max_new_tokens"),
        ("stop token == vocab", R(stopping=STOP(max_new_tokens=4, stop_token_ids=[5, vocab])), INVALID,
         "stopping.stop_token_ids[1]"),
        ("65 stop tokens", R(stopping=STOP(max_new_tokens=4, stop_token_ids=[1] * 65)), INVALID,
         "stopping.stop_token_ids"),
        ("temperature -1", R(sampling=S(temperature=-1)), INVALID, "sampling.temperature"),
        ("temperature 101", R(sampling=S(temperature=101)), INVALID, "sampling.temperature"),
        ("temperature NaN", R(sampling=S(temperature=math.nan)), INVALID, "sampling.temperature"),
        ("temperature inf", R(sampling=S(temperature=math.inf)), INVALID, "sampling.temperature"),
        ("top_p 1.5", R(sampling=S(top_p=1.5)), INVALID, "sampling.top_p"),
        ("top_p -0.1", R(sampling=S(top_p=-0.1)), INVALID, "sampling.top_p"),
        ("top_k -1", R(sampling=S(top_k=-1)), INVALID, "sampling.top_k"),
        ("min_p 1.5", R(sampling=S(min_p=1.5)), INVALID, "sampling.min_p"),
        ("repetition_penalty 11", R(sampling=S(repetition_penalty=11)), INVALID, "sampling.repetition_penalty"),
        ("repetition_penalty -1", R(sampling=S(repetition_penalty=-1)), INVALID, "sampling.repetition_penalty"),
        ("presence_penalty 3", R(sampling=S(presence_penalty=3)), INVALID, "sampling.presence_penalty"),
        ("frequency_penalty -2.5", R(sampling=S(frequency_penalty=-2.5)), INVALID, "sampling.frequency_penalty"),
        ("seed without has_seed", R(sampling=S(temperature=1, seed=7)), INVALID, "sampling.has_seed"),
        ("top_logprobs 21", R(logprobs=True, top_logprobs=21), INVALID, "top_logprobs"),
        ("top_logprobs without logprobs", R(top_logprobs=5), INVALID, "logprobs"),
        # tests/fixtures/tiny_a has no tokenizer: ids only
        ("prompt_text without a tokenizer", R(prompt_token_ids=[], prompt_text="hello"), INVALID,
         "the model has no tokenizer"),
        ("messages without a tokenizer", R(prompt_token_ids=[], messages=[M(role="user", content="hi")]), INVALID,
         "no tokenizer"),
        ("stop string without a tokenizer", R(stopping=STOP(max_new_tokens=4, stop=["x"])), INVALID,
         "stopping.stop: the model has no tokenizer"),
        ("17 stop strings", R(stopping=STOP(max_new_tokens=4, stop=["x"] * 17)), INVALID, "stopping.stop has 17"),
        ("empty role", R(prompt_token_ids=[], messages=[M(role="", content="hi")]), INVALID, "messages[0].role"),
    ]


def valid_requests(vocab, n):
    """Varied valid traffic: greedy, seeded sampling with every filter, logprobs, stop tokens."""
    out = []
    for i in range(n):
        kw = {}
        if i % 4 == 1:
            kw["sampling"] = S(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1,
                               presence_penalty=0.5, frequency_penalty=0.5, has_seed=True, seed=i)
        if i % 4 == 2:
            kw["logprobs"] = True
            kw["top_logprobs"] = 5
        if i % 4 == 3:
            kw["stopping"] = STOP(max_new_tokens=12, stop_token_ids=[(7 * i) % vocab], ignore_eos=True)
        out.append(request("valid-%d" % i, [(i * 13 + k) % vocab for k in range(1 + i % 7)], 12, **kw))
    return out


class BadRequestTest(unittest.TestCase):
    def test_malformed_requests_mixed_with_valid_traffic(self):
        with Cluster(workers=2) as c:
            info = c.gen.GetModelInfo(metrale_pb2.ModelInfoRequest(), timeout=5)
            vocab, ctx = info.vocab_size, info.max_context
            cases = bad_cases(vocab, ctx)
            self.assertGreaterEqual(len(cases), 20)
            before = c.stats()
            valid = valid_requests(vocab, 32)
            streams = []
            results = {}

            def send_bad(case):
                name, req, code, text = case
                try:
                    got = list(c.gen.Generate(req, timeout=10))
                    results[name] = (grpc.StatusCode.OK, "%d responses" % len(got))
                except grpc.RpcError as e:
                    results[name] = (e.code(), e.details())

            bad_threads = []
            for i in range(max(len(valid), len(cases))):  # interleave valid and bad
                if i < len(valid):
                    streams.append(Collector(c.gen, valid[i], timeout=60))
                if i < len(cases):
                    t = threading.Thread(target=send_bad, args=(cases[i],))
                    t.start()
                    bad_threads.append(t)
            for t in bad_threads:
                t.join(30)
            for name, req, code, text in cases:
                got_code, details = results[name]
                self.assertEqual(got_code, code, "%s: got %s (%s)" % (name, got_code, details))
                self.assertIn(text, details, name)
            for s in streams:
                s.wait(60)
                r = s.req
                self.assertEqual(s.code, grpc.StatusCode.OK, "%s: %s" % (r.request_id, s.details))
                self.assertIsNotNone(s.final, r.request_id)
                self.assertTrue(all(x.request_id == r.request_id for x in s.responses))
                self.assertEqual(s.final.usage.completion_tokens, len(s.tokens))
                self.assertEqual(s.final.usage.prompt_tokens, len(r.prompt_token_ids))
                if r.stopping.stop_token_ids and s.final.finish_reason == metrale_pb2.FINISH_REASON_STOP:
                    self.assertIn(s.tokens[-1], r.stopping.stop_token_ids)
                else:
                    self.assertEqual(len(s.tokens), r.stopping.max_new_tokens, r.request_id)
                    self.assertEqual(s.final.finish_reason, metrale_pb2.FINISH_REASON_LENGTH)
                if r.logprobs:
                    toks = [t for x in s.responses for t in x.tokens]
                    for t in toks:
                        self.assertLessEqual(t.logprob, 0.0)
                        self.assertEqual(len(t.top_logprobs), r.top_logprobs)
                        self.assertGreaterEqual(t.top_logprobs[0].logprob, t.logprob - 1e-6)
            after = c.stats()
            self.assertEqual(after.worker_restarts, 0)
            self.assertEqual(len([w for w in after.workers if w.alive]), 2)
            self.assertEqual(after.requests_rejected - before.requests_rejected, len(cases))
            self.assertEqual(after.requests_total - before.requests_total, len(cases) + len(valid))

    def test_undecodable_bytes_unknown_method_unknown_service(self):
        with Cluster(workers=1) as c:
            raw = c.channel.unary_stream("/metrale.v1.Generation/Generate", request_serializer=lambda b: b,
                                         response_deserializer=lambda b: b)
            with self.assertRaises(grpc.RpcError) as e:
                list(raw(b"\xff\xff\xff\xff", timeout=5))
            self.assertEqual(e.exception.code(), INVALID)
            nope = c.channel.unary_unary("/metrale.v1.Generation/Nope", request_serializer=lambda b: b,
                                         response_deserializer=lambda b: b)
            with self.assertRaises(grpc.RpcError) as e:
                nope(b"", timeout=5)
            self.assertEqual(e.exception.code(), grpc.StatusCode.UNIMPLEMENTED)
            with self.assertRaises(grpc.RpcError) as e:
                c.check("no.such.Service")
            self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
            # A body that is not the method's request message
            for method, name in [("GetModelInfo", "ModelInfoRequest"), ("GetStats", "StatsRequest")]:
                call = c.channel.unary_unary("/metrale.v1.Generation/" + method, request_serializer=lambda b: b,
                                             response_deserializer=lambda b: b)
                with self.assertRaises(grpc.RpcError) as e:
                    call(b"\xff\xff\xff\xff", timeout=5)
                self.assertEqual(e.exception.code(), INVALID, method)
                self.assertIn(name, e.exception.details())
            # Tokenize: refused by the router for a model without a tokenizer, or a request with
            # neither text nor messages
            for req, text in [(metrale_pb2.TokenizeRequest(text="hello"), "no tokenizer"),
                              (metrale_pb2.TokenizeRequest(), "neither text nor messages")]:
                with self.assertRaises(grpc.RpcError) as e:
                    c.gen.Tokenize(req, timeout=5)
                self.assertEqual(e.exception.code(), INVALID)
                self.assertIn(text, e.exception.details())
            # Random bytes and bit-flipped valid requests: any answer but a crash (or INTERNAL/UNKNOWN).
            rng = random.Random(4)
            valid = request("fuzz", [1, 2, 3, 4], 4, logprobs=True, top_logprobs=2).SerializeToString()
            payloads = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))) for _ in range(100)]
            for _ in range(100):
                b = bytearray(valid)
                for _ in range(rng.randrange(1, 4)):
                    b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
                payloads.append(bytes(b))
            calls = [raw(p, timeout=5) for p in payloads]
            seen = set()
            for call in calls:
                try:
                    for _ in call:
                        pass
                    seen.add(grpc.StatusCode.OK)
                except grpc.RpcError as e:
                    seen.add(e.code())
            self.assertTrue(seen <= {grpc.StatusCode.OK, INVALID, grpc.StatusCode.DEADLINE_EXCEEDED}, seen)
            self.assertIn(INVALID, seen)
            s = Collector(c.gen, request("still-fine", [1, 2, 3], 3)).wait(30)
            self.assertEqual(s.code, grpc.StatusCode.OK, s.details)
            self.assertEqual(c.stats().worker_restarts, 0)
            self.assertIsNone(c.router.poll())

    def test_request_cardinality_violations_are_unimplemented(self):
        """gRPC's doc/statuscodes.md: a method that takes one request but gets another number of them
        is UNIMPLEMENTED. A second request message on a running Generate ends it so (and the worker
        frees the sequence); none at all too; and on Health/Watch."""
        with Cluster(workers=1) as c:
            ctx = c.gen.GetModelInfo(metrale_pb2.ModelInfoRequest(), timeout=5).max_context
            gen2 = c.channel.stream_stream("/metrale.v1.Generation/Generate",
                                           request_serializer=metrale_pb2.GenerateRequest.SerializeToString,
                                           response_deserializer=metrale_pb2.GenerateResponse.FromString)
            first_token = threading.Event()

            def two_requests():
                yield request("twice", [1, 2, 3], ctx - 4)
                first_token.wait(30)  # the first request is running when the second comes
                yield request("twice-again", [4, 5, 6], 4)

            call = gen2(two_requests(), timeout=30)
            tokens = 0
            with self.assertRaises(grpc.RpcError) as e:
                for resp in call:
                    tokens += len(resp.tokens)
                    first_token.set()
            self.assertEqual(e.exception.code(), grpc.StatusCode.UNIMPLEMENTED, e.exception.details())
            self.assertIn("more than one request message", e.exception.details())
            self.assertGreater(tokens, 0)
            self.assertLess(tokens, ctx - 4)
            with self.assertRaises(grpc.RpcError) as e:
                list(gen2(iter(()), timeout=5))
            self.assertEqual(e.exception.code(), grpc.StatusCode.UNIMPLEMENTED)
            self.assertIn("no request message", e.exception.details())
            watch2 = c.channel.stream_stream("/grpc.health.v1.Health/Watch", request_serializer=lambda b: b,
                                             response_deserializer=lambda b: b)
            with self.assertRaises(grpc.RpcError) as e:
                list(watch2(iter([b"", b""]), timeout=5))
            self.assertEqual(e.exception.code(), grpc.StatusCode.UNIMPLEMENTED)
            # The cut stream's sequence is freed on the worker; the service goes on.
            wait_for(lambda: c.stats().active_streams == 0, 5, "the stream to end in the router")
            wait_for(lambda: all(w.live_sequences == 0 for w in c.live_workers()), 5, "the worker to free it")
            s = Collector(c.gen, request("once", [1, 2, 3], 3)).wait(30)
            self.assertEqual(s.code, grpc.StatusCode.OK, s.details)

    def test_full_queue_is_resource_exhausted(self):
        with Cluster(workers=1, queue=2, max_sequences=4) as c:
            ctx = c.gen.GetModelInfo(metrale_pb2.ModelInfoRequest(), timeout=5).max_context
            streams = [Collector(c.gen, request("q-%d" % i, [1, 2, 3], min(200, ctx - 4)), timeout=120)
                       for i in range(40)]
            for s in streams:
                s.wait(120)
            exhausted = [s for s in streams if s.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
            done = [s for s in streams if s.code == grpc.StatusCode.OK]
            self.assertTrue(exhausted, "no request was refused with a queue of 2")
            self.assertEqual(len(exhausted) + len(done), len(streams),
                             [(s.code, s.details) for s in streams if s not in exhausted and s not in done])
            self.assertGreaterEqual(len(done), 3)  # at least the queue plus one running
            for s in exhausted:
                self.assertIn("queue", s.details)
            wait_for(lambda: c.stats().active_streams == 0, 10, "streams to end")


if __name__ == "__main__":
    unittest.main(verbosity=2)
