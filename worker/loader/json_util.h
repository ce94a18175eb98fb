/* worker/loader/json_util.h: json-c helpers shared by the loader's parsers (config.json,
 * safetensors headers and shard indexes). */
#ifndef LD_JSON_UTIL_H
#define LD_JSON_UTIL_H

#include <json-c/json.h>

/* "an integer", "a string", ... for messages that say what a field was instead of what it should
 * be. Never NULL. */
const char *ld_json_kind(json_object *v);

#endif /* LD_JSON_UTIL_H */
