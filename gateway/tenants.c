/* gateway/tenants.c — the keys file (tenants.h). */
#include "gateway/tenants.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/pipeline.h"

typedef struct key_row {
    char *key;
    int tenant; /* 1.. */
} key_row;

struct rk_tenants {
    key_row *keys;
    int n_keys;
    char **names, **salts; /* (n_tenants) */
    int n_tenants;
};

int rk_key_equal(const char *given, const char *want) {
    size_t a = strlen(given), b = strlen(want);
    unsigned diff = (unsigned)(a ^ b);
    for (size_t i = 0; i < b; i++)
        diff |= (unsigned char)(i < a ? given[i] : 0) ^ (unsigned char)want[i];
    return diff == 0;
}

void rk_tenants_free(rk_tenants *t) {
    if (!t) return;
    for (int i = 0; i < t->n_keys; i++) {
        if (t->keys[i].key) memset(t->keys[i].key, 0, strlen(t->keys[i].key));
        free(t->keys[i].key);
    }
    for (int i = 0; i < t->n_tenants; i++) {
        free(t->names[i]);
        free(t->salts[i]);
    }
    free(t->keys);
    free(t->names);
    free(t->salts);
    free(t);
}

/* The string field name of entry i: NULL with an error set when it is not a
 * string of lo..hi bytes without NUL (absent: NULL and no error when
 * optional). */
static const char *field(json_t *e, int i, const char *name, size_t lo, size_t hi, int optional,
                         rk_status *st) {
    json_t *v = json_object_get(e, name);
    if (!v && optional) return NULL;
    const char *s = json_string_value(v);
    size_t n = s ? json_string_length(v) : 0;
    if (!s || n != strlen(s) || n < lo || n > hi) {
        *st = rk_errorf(RK_ERR_INVALID, "keys[%d].%s: %s a string of %zu to %zu bytes", i, name,
                        v ? "must be" : "missing; it must be", lo, hi);
        return NULL;
    }
    return s;
}

static int name_ok(const char *s) {
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') ||
              *s == '.' || *s == '_' || *s == '-'))
            return 0;
    return 1;
}

static int key_ok(const char *s) {
    for (; *s; s++)
        if ((unsigned char)*s <= ' ' || *s == 0x7f) return 0;
    return 1;
}

/* Add entry i (its fields checked) to t. */
static rk_status add_entry(rk_tenants *t, json_t *e, int i) {
    rk_status st = RK_OK;
    if (!json_is_object(e)) return rk_errorf(RK_ERR_INVALID, "keys[%d]: must be an object", i);
    const char *key = field(e, i, "key", 1, RK_TENANT_KEY_MAX, 0, &st);
    if (st) return st;
    if (!key_ok(key))
        return rk_errorf(RK_ERR_INVALID,
                         "keys[%d].key: must hold no white space or control characters", i);
    const char *name = field(e, i, "tenant", 1, RK_TENANT_NAME_MAX, 0, &st);
    if (st) return st;
    if (!name_ok(name))
        return rk_errorf(RK_ERR_INVALID,
                         "keys[%d].tenant: must be letters, digits, '.', '_' or '-'", i);
    if (!strcmp(name, "default") || !strcmp(name, "other"))
        return rk_errorf(RK_ERR_INVALID, "keys[%d].tenant: \"%s\" is reserved (statistics use it)",
                         i, name);
    const char *salt = field(e, i, "salt", 1, RK_CACHE_SALT_MAX, 1, &st);
    if (st) return st;
    json_t *extra;
    const char *fname;
    json_object_foreach(e, fname, extra) {
        if (strcmp(fname, "key") && strcmp(fname, "tenant") && strcmp(fname, "salt"))
            return rk_errorf(RK_ERR_INVALID, "keys[%d].%s: unknown field", i, fname);
    }
    if (!salt) salt = name;
    for (int k = 0; k < t->n_keys; k++)
        if (!strcmp(t->keys[k].key, key))
            return rk_errorf(RK_ERR_INVALID, "keys[%d].key: repeats the key of keys[%d]", i, k);
    int id = rk_tenants_by_name(t, name);
    if (id && strcmp(t->salts[id - 1], salt))
        return rk_errorf(RK_ERR_INVALID,
                         "keys[%d].salt: differs from the salt an earlier key gave tenant %s", i,
                         name);
    for (int k = 0; !id && k < t->n_tenants; k++)
        if (!strcmp(t->salts[k], salt))
            return rk_errorf(
                RK_ERR_INVALID,
                "keys[%d].salt: tenant %s has it already (tenants would share a cache)", i,
                t->names[k]);
    if (!id) {
        char *nm = rk_strdup(name), *sl = rk_strdup(salt);
        if (!nm || !sl) {
            free(nm);
            free(sl);
            return rk_errorf(RK_ERR_NOMEM, "keys[%d]: out of memory", i);
        }
        t->names[t->n_tenants] = nm;
        t->salts[t->n_tenants] = sl;
        id = ++t->n_tenants;
    }
    char *k = rk_strdup(key);
    if (!k) return rk_errorf(RK_ERR_NOMEM, "keys[%d]: out of memory", i);
    t->keys[t->n_keys++] = (key_row){k, id};
    return RK_OK;
}

rk_status rk_tenants_parse(const char *text, size_t len, rk_tenants **out) {
    *out = NULL;
    json_error_t je;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return rk_errorf(RK_ERR_INVALID, "line %d, column %d: %s", je.line, je.column, je.text);
    json_t *keys = json_object_get(root, "keys");
    size_t n = json_is_array(keys) ? json_array_size(keys) : 0;
    rk_status st = RK_OK;
    if (!json_is_object(root) || !json_is_array(keys))
        st = rk_errorf(RK_ERR_INVALID, "keys: must be an array of {\"key\", \"tenant\", \"salt\"}");
    else if (n == 0 || n > RK_TENANTS_MAX)
        st = rk_errorf(RK_ERR_INVALID, "keys: must hold 1 to %d entries", RK_TENANTS_MAX);
    rk_tenants *t = NULL;
    if (!st) {
        t = calloc(1, sizeof *t);
        if (t) {
            t->keys = calloc(n, sizeof *t->keys);
            t->names = calloc(n, sizeof *t->names);
            t->salts = calloc(n, sizeof *t->salts);
        }
        if (!t || !t->keys || !t->names || !t->salts)
            st = rk_errorf(RK_ERR_NOMEM, "keys: out of memory");
    }
    for (size_t i = 0; i < n && !st; i++) st = add_entry(t, json_array_get(keys, i), (int)i);
    json_decref(root);
    if (st) {
        rk_tenants_free(t);
        return st;
    }
    *out = t;
    return RK_OK;
}

rk_status rk_tenants_load(const char *path, rk_tenants **out) {
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return rk_errorf(RK_ERR_IO, "%s: cannot open the keys file", path);
    char *buf = NULL;
    size_t len = 0, cap = 0;
    rk_status st = RK_OK;
    for (;;) {
        if (len == cap) {
            if (cap >= (16u << 20)) {
                st = rk_errorf(RK_ERR_LIMIT, "%s: the keys file is larger than 16 MiB", path);
                break;
            }
            char *nb = realloc(buf, cap ? cap * 2 : 4096);
            if (!nb) {
                st = rk_errorf(RK_ERR_NOMEM, "%s: out of memory", path);
                break;
            }
            buf = nb;
            cap = cap ? cap * 2 : 4096;
        }
        size_t got = fread(buf + len, 1, cap - len, f);
        len += got;
        if (got == 0) break;
    }
    if (!st && ferror(f)) st = rk_errorf(RK_ERR_IO, "%s: cannot read the keys file", path);
    fclose(f);
    if (!st && (st = rk_tenants_parse(buf, len, out))) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", rk_error_message());
        st = rk_errorf(st, "%s: %s", path, msg);
    }
    if (buf) memset(buf, 0, len);
    free(buf);
    return st;
}

int rk_tenants_find(const rk_tenants *t, const char *given) {
    if (!t || !given) return 0;
    int found = 0;
    for (int i = 0; i < t->n_keys; i++) {
        int eq = rk_key_equal(given, t->keys[i].key);
        found |= -eq & t->keys[i].tenant; /* no branch on the outcome */
    }
    return found;
}

int rk_tenants_count(const rk_tenants *t) { return t ? t->n_tenants : 0; }

const char *rk_tenants_name(const rk_tenants *t, int id) {
    return t && id >= 1 && id <= t->n_tenants ? t->names[id - 1] : NULL;
}

const char *rk_tenants_salt(const rk_tenants *t, int id) {
    return t && id >= 1 && id <= t->n_tenants ? t->salts[id - 1] : NULL;
}

int rk_tenants_by_name(const rk_tenants *t, const char *name) {
    for (int i = 0; t && name && i < t->n_tenants; i++)
        if (!strcmp(t->names[i], name)) return i + 1;
    return 0;
}

int rk_tenants_has_key(const rk_tenants *t, const char *key) {
    return rk_tenants_find(t, key) != 0;
}
