/* router/health.h: grpc.health.v1.Health (Check and Watch) for the services "" (the whole
 * server) and "metrale.v1.Generation". Both are SERVING exactly when the router is not draining
 * and at least one worker is live; the router says which through rtr_health_set_serving.
 *
 * Watch streams the current status at once and then every change (changes that happen while a
 * message is in flight collapse into the latest one). An unknown service is NOT_FOUND for Check
 * and a SERVICE_UNKNOWN message for Watch, per the protocol.
 *
 * Ownership: rtr_health owns its watch records; a record lives until the call's on_done
 * (rtr_health_on_done). Not thread-safe: the router's event-loop thread owns it.
 */
#ifndef RTR_HEALTH_H
#define RTR_HEALTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "router/grpc_server.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rtr_health_watch rtr_health_watch;

typedef struct rtr_health {
    bool serving;
    rtr_health_watch *watchers; /* owned list */
    size_t nwatchers;
} rtr_health;

void rtr_health_init(rtr_health *h); /* NOT_SERVING until told otherwise */
/* Frees the watch records. The calls themselves are the server's (it cancels them at shutdown). */
void rtr_health_free(rtr_health *h);

/* Sets the status; watchers get the new one when it changed. */
void rtr_health_set_serving(rtr_health *h, bool serving);

/* Handlers for the two methods; data/len is the serialized HealthCheckRequest. They answer or
 * attach the call; a malformed request is answered INVALID_ARGUMENT. */
void rtr_health_check(rtr_health *h, rtr_call *call, const uint8_t *data, size_t len);
void rtr_health_watch_start(rtr_health *h, rtr_call *call, const uint8_t *data, size_t len);

/* From the server's handlers, for calls whose rtr_call_watch() is set. */
void rtr_health_on_send_done(rtr_health *h, rtr_call *call, bool ok);
void rtr_health_on_done(rtr_health *h, rtr_call *call);

#ifdef __cplusplus
}
#endif
#endif /* RTR_HEALTH_H */
