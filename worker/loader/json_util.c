/* worker/loader/json_util.c: see json_util.h. */
#include "worker/loader/json_util.h"

const char *ld_json_kind(json_object *v) {
    switch (json_object_get_type(v)) {
    case json_type_null: return "null";
    case json_type_boolean: return "a boolean";
    case json_type_double: return "a float";
    case json_type_int: return "an integer";
    case json_type_object: return "an object";
    case json_type_array: return "a list";
    case json_type_string: return "a string";
    }
    return "?";
}
