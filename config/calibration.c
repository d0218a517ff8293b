/* config/calibration.c — reading the repair calibration that `ragkv eval
 * --calibrate` writes (see config.h). */
#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "config/config.h"

rk_status rk_repair_calibration_load(const char *path, char *policy, size_t cap) {
    json_error_t err;
    json_t *root = json_load_file(path, 0, &err);
    if (!root)
        return rk_errorf(RK_ERR_IO, "repair calibration %s: %s (line %d)", path, err.text,
                         err.line);
    json_t *version = json_object_get(root, "ragkv_repair_calibration");
    const char *p = json_string_value(json_object_get(root, "policy"));
    int k, query;
    float ratio;
    rk_status st = RK_OK;
    if (!json_is_integer(version) || json_integer_value(version) != 1)
        st = rk_errorf(RK_ERR_INVALID,
                       "repair calibration %s: not a calibration file of version 1 (written by "
                       "`ragkv eval --task ... --calibrate`)",
                       path);
    else if (!p || rk_repair_parse(p, &k, &ratio, &query))
        st = rk_errorf(RK_ERR_INVALID, "repair calibration %s: \"policy\" is not a repair policy",
                       path);
    else if (strlen(p) >= cap)
        st = rk_errorf(RK_ERR_INVALID, "repair calibration %s: \"policy\" is too long", path);
    else
        snprintf(policy, cap, "%s", p);
    json_decref(root);
    return st;
}
