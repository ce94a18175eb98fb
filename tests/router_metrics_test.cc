// router/metrics: the exposition text (families, labels, histogram buckets), worker counters
// summed by increase across restarts, only live workers' gauges, and the HTTP endpoint.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <sstream>
#include <string>

extern "C" {
#include "router/metrics.h"
}

namespace {

struct Metrics {
    rtr_metrics *m;
    explicit Metrics(const char *version = "1.2.3") {
        mt_error err{};
        m = rtr_metrics_create(version, &err);
        EXPECT_NE(m, nullptr) << err.msg;
    }
    ~Metrics() { rtr_metrics_free(m); }
    std::string text() {
        size_t len = 0;
        char *s = rtr_metrics_render(m, &len);
        EXPECT_NE(s, nullptr);
        std::string out(s, len);
        free(s);
        return out;
    }
    // sample line ("name{labels}") -> value
    std::map<std::string, std::string> samples() {
        std::map<std::string, std::string> out;
        std::istringstream in(text());
        std::string line;
        while (std::getline(in, line)) {
            if (line.empty() || line[0] == '#') continue;
            size_t sp = line.rfind(' ');
            out[line.substr(0, sp)] = line.substr(sp + 1);
        }
        return out;
    }
};

struct Reg {
    rtr_workers r;
    Reg() { rtr_workers_init(&r, rtr_workers_default_params()); }
    ~Reg() { rtr_workers_free(&r); }
    rtr_worker *hello(uint32_t id) {
        Metrale__V1__ModelInfo mi = METRALE__V1__MODEL_INFO__INIT;
        mi.model_type = (char *)"glm5_next";
        mi.backend = (char *)"cpu";
        mi.vocab_size = 300;
        mi.max_context = 4096;
        Metrale__Internal__V1__Hello h = METRALE__INTERNAL__V1__HELLO__INIT;
        h.worker_id = id;
        h.model = &mi;
        h.max_sequences = 4;
        char peer[MT_WIRE_PEER_MAX];
        mt_wire_identity(id, peer);
        rtr_worker *w = nullptr;
        mt_error err{};
        EXPECT_EQ(rtr_workers_hello(&r, peer, &h, 0, &w, &err), MT_OK) << err.msg;
        return w;
    }
};

void heartbeat(rtr_worker *w, uint64_t hits, uint64_t misses, uint64_t drafts, uint32_t pages_free) {
    Metrale__V1__WorkerStats s = METRALE__V1__WORKER_STATS__INIT;
    s.prefix_hits = hits;
    s.prefix_misses = misses;
    s.draft_tokens = drafts;
    s.cache_pages_free = pages_free;
    s.cache_pages_total = 100;
    s.slots_free = 3;
    s.slots_total = 8;
    s.cache_bytes_in_use = 1000;
    s.prefix_cache_bytes = 24;
    rtr_workers_set_stats(w, &s);
}

const rtr_metrics_load kLoad = {2, 3, 1};

}  // namespace

TEST(RouterMetrics, EveryFamilyHasHelpAndType) {
    Metrics m("v\"1\\");
    const std::string t = m.text();
    EXPECT_NE(t.find("metrale_build_info{version=\"v\\\"1\\\\\"} 1\n"), std::string::npos) << t;
    for (const char *fam :
         {"metrale_num_requests_waiting gauge", "metrale_num_requests_running gauge", "metrale_requests_total counter",
          "metrale_request_success_total counter", "metrale_generation_tokens_total counter",
          "metrale_time_to_first_token_seconds histogram", "metrale_inter_token_latency_seconds histogram",
          "metrale_e2e_request_latency_seconds histogram", "metrale_request_queue_time_seconds histogram",
          "metrale_num_preemptions_total counter", "metrale_spec_decode_num_accepted_tokens_total counter",
          "metrale_kv_cache_usage_perc gauge"}) {
        EXPECT_NE(t.find(std::string("# TYPE ") + fam + "\n"), std::string::npos) << fam;
        EXPECT_NE(t.find(std::string("# HELP ") + std::string(fam).substr(0, std::string(fam).find(' '))),
                  std::string::npos)
            << fam;
    }
    auto s = m.samples();
    EXPECT_EQ(s["metrale_requests_total{code=\"OK\"}"], "0");  // shown from zero
    EXPECT_EQ(s.count("metrale_requests_total{code=\"INTERNAL\"}"), 0u);
    EXPECT_EQ(s["metrale_request_success_total{finished_reason=\"abort\"}"], "0");
}

TEST(RouterMetrics, CountsRequestsAndTokens) {
    Metrics m;
    rtr_metrics_request_ended(m.m, GRPC_STATUS_OK);
    rtr_metrics_request_ended(m.m, GRPC_STATUS_OK);
    rtr_metrics_request_ended(m.m, GRPC_STATUS_INTERNAL);
    rtr_metrics_request_ended(m.m, (grpc_status_code)99);  // counted as UNKNOWN
    rtr_metrics_tokens(m.m, 1, true, 0.001);                 // le is inclusive
    rtr_metrics_tokens(m.m, 3, false, 0.004);
    rtr_metrics_tokens(m.m, 2, false, -1);                   // client gone: tokens only
    rtr_metrics_finish f = {METRALE__V1__FINISH_REASON__FINISH_REASON_CANCELLED, 7, 6, 0.5, 1e6};
    rtr_metrics_request_finished(m.m, &f);
    f.reason = METRALE__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED;
    rtr_metrics_request_finished(m.m, &f);
    auto s = m.samples();
    EXPECT_EQ(s["metrale_requests_total{code=\"OK\"}"], "2");
    EXPECT_EQ(s["metrale_requests_total{code=\"INTERNAL\"}"], "1");
    EXPECT_EQ(s["metrale_requests_total{code=\"UNKNOWN\"}"], "1");
    EXPECT_EQ(s["metrale_generation_tokens_total"], "6");
    EXPECT_EQ(s["metrale_prompt_tokens_total"], "14");
    EXPECT_EQ(s["metrale_request_success_total{finished_reason=\"abort\"}"], "1");
    EXPECT_EQ(s["metrale_request_success_total{finished_reason=\"error\"}"], "1");
    EXPECT_EQ(s["metrale_time_to_first_token_seconds_bucket{le=\"0.001\"}"], "1");
    EXPECT_EQ(s["metrale_time_to_first_token_seconds_count"], "1");
    EXPECT_EQ(s["metrale_inter_token_latency_seconds_bucket{le=\"0.0025\"}"], "0");
    EXPECT_EQ(s["metrale_inter_token_latency_seconds_bucket{le=\"0.005\"}"], "1");  // cumulative
    EXPECT_EQ(s["metrale_inter_token_latency_seconds_bucket{le=\"80\"}"], "1");
    EXPECT_EQ(s["metrale_inter_token_latency_seconds_count"], "1");
    EXPECT_EQ(s["metrale_e2e_request_latency_seconds_bucket{le=\"7680\"}"], "0");  // 1e6 s: +Inf only
    EXPECT_EQ(s["metrale_e2e_request_latency_seconds_bucket{le=\"+Inf\"}"], "2");
    EXPECT_EQ(s["metrale_request_queue_time_seconds_sum"], "1");
    EXPECT_EQ(s["metrale_request_generation_tokens_bucket{le=\"5\"}"], "0");
    EXPECT_EQ(s["metrale_request_generation_tokens_bucket{le=\"10\"}"], "2");
}

TEST(RouterMetrics, WorkerCountersAddUpAcrossRestarts) {
    Metrics m;
    Reg g;
    rtr_worker *w = g.hello(0);
    heartbeat(w, 2, 3, 10, 75);
    rtr_metrics_publish(m.m, &kLoad, &g.r);
    heartbeat(w, 4, 3, 12, 75);
    rtr_metrics_publish(m.m, &kLoad, &g.r);
    rtr_metrics_publish(m.m, &kLoad, &g.r);  // no heartbeat since: nothing added
    auto s = m.samples();
    EXPECT_EQ(s["metrale_prefix_cache_hits_total"], "4");
    EXPECT_EQ(s["metrale_prefix_cache_queries_total"], "7");
    EXPECT_EQ(s["metrale_spec_decode_num_draft_tokens_total"], "12");
    EXPECT_EQ(s["metrale_num_requests_waiting"], "2");
    EXPECT_EQ(s["metrale_num_requests_running"], "3");
    EXPECT_EQ(s["metrale_requests_requeued_total"], "1");
    EXPECT_EQ(s["metrale_num_workers_live"], "1");
    EXPECT_EQ(s["metrale_kv_cache_usage_perc{worker=\"0\"}"], "0.25");
    EXPECT_EQ(s["metrale_cache_pages_used{worker=\"0\"}"], "25");
    EXPECT_EQ(s["metrale_state_slots_used{worker=\"0\"}"], "5");
    EXPECT_EQ(s["metrale_cache_bytes{worker=\"0\",holder=\"sequences\"}"], "1000");
    EXPECT_EQ(s["metrale_cache_bytes{worker=\"0\",holder=\"prefixes\"}"], "24");

    // A new process says Hello and counts from zero: its counts add to the totals.
    w = g.hello(0);
    heartbeat(w, 1, 0, 5, 100);
    rtr_metrics_publish(m.m, &kLoad, &g.r);
    s = m.samples();
    EXPECT_EQ(s["metrale_prefix_cache_hits_total"], "5");
    EXPECT_EQ(s["metrale_spec_decode_num_draft_tokens_total"], "17");
    EXPECT_EQ(s["metrale_worker_restarts_total"], "1");

    // A dead worker keeps its totals and loses its gauges.
    rtr_workers_mark_dead(w);
    rtr_metrics_publish(m.m, &kLoad, &g.r);
    s = m.samples();
    EXPECT_EQ(s["metrale_num_workers_live"], "0");
    EXPECT_EQ(s.count("metrale_kv_cache_usage_perc{worker=\"0\"}"), 0u);
    EXPECT_EQ(s["metrale_prefix_cache_hits_total"], "5");
}

namespace {

// One HTTP/1.0 request to 127.0.0.1:port; the whole reply.
std::string http(int port, const char *request) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(connect(fd, (sockaddr *)&a, sizeof a), 0);
    EXPECT_EQ(write(fd, request, strlen(request)), (ssize_t)strlen(request));
    std::string out;
    char buf[4096];
    ssize_t n;
    while ((n = read(fd, buf, sizeof buf)) > 0) out.append(buf, (size_t)n);
    close(fd);
    return out;
}

}  // namespace

TEST(RouterMetrics, ServesOverHttp) {
    Metrics m;
    mt_error err{};
    int port = 0;
    EXPECT_EQ(rtr_metrics_serve(m.m, "127.0.0.1", &port, &err), MT_ERR_INVALID);
    EXPECT_EQ(rtr_metrics_serve(m.m, "127.0.0.1:99999", &port, &err), MT_ERR_INVALID);
    EXPECT_EQ(rtr_metrics_serve(m.m, ":80", &port, &err), MT_ERR_INVALID);
    ASSERT_EQ(rtr_metrics_serve(m.m, "127.0.0.1:0", &port, &err), MT_OK) << err.msg;
    ASSERT_GT(port, 0);
    EXPECT_EQ(rtr_metrics_serve(m.m, "127.0.0.1:0", &port, &err), MT_ERR_STATE);

    Metrics other;  // the port is taken
    int port2 = 0;
    const std::string taken = "127.0.0.1:" + std::to_string(port);
    EXPECT_EQ(rtr_metrics_serve(other.m, taken.c_str(), &port2, &err), MT_ERR_IO);

    rtr_metrics_request_ended(m.m, GRPC_STATUS_UNAVAILABLE);
    std::string r = http(port, "GET /metrics HTTP/1.0\r\n\r\n");
    EXPECT_EQ(r.substr(0, 7), "HTTP/1.");
    EXPECT_EQ(r.substr(8, 5), " 200 ") << r.substr(0, 200);
    EXPECT_NE(r.find("Content-Type: text/plain; version=0.0.4"), std::string::npos);
    EXPECT_NE(r.find("metrale_requests_total{code=\"UNAVAILABLE\"} 1\n"), std::string::npos);
    EXPECT_NE(http(port, "GET / HTTP/1.0\r\n\r\n").find(" 404 "), std::string::npos);
    EXPECT_NE(http(port, "DELETE /metrics HTTP/1.0\r\n\r\n").find(" 405 "), std::string::npos);
}
