/* worker/model/model.c: the model registry: config.json's model_type chooses the architecture
 * that loads a checkpoint. A new architecture is one folder under worker/model/ and one line in
 * kArchs. */
#include "worker/model/model.h"

#include <stdio.h>
#include <string.h>

#include <json-c/json.h>

#include "worker/model/glm/glm_model.h"

typedef struct mt_arch {
    const char *model_type;
    mt_status (*open)(const char *dir, mt_backend *be, const mt_model_params *p, mt_model **out, mt_error *err);
    /* A model of a named preset's shapes with random weights (NULL: none). */
    mt_status (*open_random)(const char *preset, mt_backend *be, const mt_model_params *p, mt_model **out,
                             mt_error *err);
} mt_arch;

static const mt_arch kArchs[] = {
    { "glm5_next", glm_model_open, glm_model_open_random },
    { "glm5_next_text", glm_model_open, glm_model_open_random }, /* its text model's config alone */
};

/* config.json's model_type into out[cap]. */
static mt_status read_model_type(const char *dir, char *out, size_t cap, mt_error *err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    json_object *root = json_object_from_file(path);
    if (!root) return mt_errorf(err, MT_ERR_IO, "%s: cannot read or parse it", path);
    json_object *t = NULL;
    mt_status st = MT_OK;
    if (!json_object_object_get_ex(root, "model_type", &t) || !json_object_is_type(t, json_type_string))
        st = mt_errorf(err, MT_ERR_INVALID, "%s: no string model_type", path);
    else
        snprintf(out, cap, "%s", json_object_get_string(t));
    json_object_put(root);
    return st;
}

mt_status mt_model_load(const char *dir, mt_backend *be, const mt_model_params *params, mt_model **out,
                        mt_error *err) {
    *out = NULL;
    const size_t n = sizeof kArchs / sizeof kArchs[0];
    if (!strncmp(dir, "random:", 7)) /* the first architecture's presets (benchmarks) */
        return kArchs[0].open_random(dir + 7, be, params, out, err);
    char type[128];
    mt_status st = read_model_type(dir, type, sizeof type, err);
    if (st != MT_OK) return st;
    for (size_t i = 0; i < n; i++)
        if (!strcmp(type, kArchs[i].model_type)) return kArchs[i].open(dir, be, params, out, err);
    return mt_errorf(err, MT_ERR_UNSUPPORTED, "%s/config.json: model_type \"%s\" is not served (this build serves %s)",
                     dir, type, kArchs[0].model_type);
}
