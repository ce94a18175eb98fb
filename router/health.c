/* router/health.c: see health.h. */
#include "router/health.h"

#include <stdlib.h>
#include <string.h>

#include "proto/grpc/health/v1/health.pb-c.h"

typedef Grpc__Health__V1__HealthCheckResponse__ServingStatus serving_status;

struct rtr_health_watch {
    rtr_call *call;
    bool known;           /* the service is one we serve */
    bool sent_any;
    serving_status sent;  /* last status sent */
    rtr_health_watch *prev, *next;
};

static const char *const SERVICES[] = {"", "metrale.v1.Generation"};

static bool service_known(const char *name) {
    for (size_t i = 0; i < sizeof SERVICES / sizeof SERVICES[0]; i++)
        if (!strcmp(name ? name : "", SERVICES[i])) return true;
    return false;
}

static serving_status current(const rtr_health *h, bool known) {
    if (!known) return GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN;
    return h->serving ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
                      : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
}

void rtr_health_init(rtr_health *h) { memset(h, 0, sizeof *h); }

void rtr_health_free(rtr_health *h) {
    if (!h) return;
    rtr_health_watch *w = h->watchers;
    while (w) {
        rtr_health_watch *next = w->next;
        rtr_call_set_watch(w->call, NULL);
        free(w);
        w = next;
    }
    h->watchers = NULL;
    h->nwatchers = 0;
}

/* Sends the current status if it differs from the last one sent and no send is in flight. */
static void watch_flush(rtr_health *h, rtr_health_watch *w) {
    serving_status now = current(h, w->known);
    if ((w->sent_any && w->sent == now) || rtr_call_send_busy(w->call) || rtr_call_finished(w->call)) return;
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    resp.status = now;
    if (rtr_call_send(w->call, &resp.base) == MT_OK) {
        w->sent = now;
        w->sent_any = true;
    }
}

void rtr_health_set_serving(rtr_health *h, bool serving) {
    if (h->serving == serving) return;
    h->serving = serving;
    for (rtr_health_watch *w = h->watchers; w; w = w->next) watch_flush(h, w);
}

static Grpc__Health__V1__HealthCheckRequest *parse(rtr_call *call, const uint8_t *data, size_t len) {
    Grpc__Health__V1__HealthCheckRequest *req = grpc__health__v1__health_check_request__unpack(NULL, len, data);
    if (!req) rtr_call_finish(call, GRPC_STATUS_INVALID_ARGUMENT, "request is not a HealthCheckRequest", NULL);
    return req;
}

void rtr_health_check(rtr_health *h, rtr_call *call, const uint8_t *data, size_t len) {
    Grpc__Health__V1__HealthCheckRequest *req = parse(call, data, len);
    if (!req) return;
    if (!service_known(req->service)) {
        rtr_call_finish(call, GRPC_STATUS_NOT_FOUND, "unknown service", NULL);
    } else {
        Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
        resp.status = current(h, true);
        rtr_call_finish(call, GRPC_STATUS_OK, NULL, &resp.base);
    }
    grpc__health__v1__health_check_request__free_unpacked(req, NULL);
}

void rtr_health_watch_start(rtr_health *h, rtr_call *call, const uint8_t *data, size_t len) {
    Grpc__Health__V1__HealthCheckRequest *req = parse(call, data, len);
    if (!req) return;
    rtr_health_watch *w = calloc(1, sizeof *w);
    if (!w) {
        rtr_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "router out of memory", NULL);
    } else {
        w->call = call;
        w->known = service_known(req->service);
        w->next = h->watchers;
        if (h->watchers) h->watchers->prev = w;
        h->watchers = w;
        h->nwatchers++;
        rtr_call_set_watch(call, w);
        watch_flush(h, w);
    }
    grpc__health__v1__health_check_request__free_unpacked(req, NULL);
}

void rtr_health_on_send_done(rtr_health *h, rtr_call *call, bool ok) {
    rtr_health_watch *w = rtr_call_watch(call);
    if (w && ok) watch_flush(h, w);
}

void rtr_health_on_done(rtr_health *h, rtr_call *call) {
    rtr_health_watch *w = rtr_call_watch(call);
    if (!w) return;
    if (w->prev) w->prev->next = w->next;
    else h->watchers = w->next;
    if (w->next) w->next->prev = w->prev;
    h->nwatchers--;
    rtr_call_set_watch(call, NULL);
    free(w);
}
