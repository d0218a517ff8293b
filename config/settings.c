/* config/settings.c — the settings tables' parser: text (flags, environment),
 * the JSON config file, the effective settings as JSON and the help lines;
 * and the table of rk_config's fields. */
#include "config/settings.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define CFG_OFF(m) offsetof(rk_config, m)
#define CFG_STR(m) CFG_OFF(m), sizeof(((rk_config *)0)->m)

const rk_setting rk_config_settings[] = {
    {"backend", "backend", RK_SET_STR, CFG_STR(backend), 0, 0, 0, 0,
     "cpu|cuda  compute backend (default: cpu)"},
    {"n_threads", "threads", RK_SET_INT, CFG_OFF(n_threads), 0, 0, 1024, 0, 0,
     "N  compute threads (default: 0 = one per core)"},
    {"block_size", "block-size", RK_SET_INT, CFG_OFF(block_size), 0, 1, 1 << 20, 0, 0,
     "N  tokens per KV block, power of two 8..64 (default: 16)"},
    {"kv_dtype", "kv-dtype", RK_SET_STR, CFG_STR(kv_dtype), 0, 0, 0, 0,
     "T  KV storage type: f32, f16 or bf16 (default: f32)"},
    {"kv_memory_mb", "kv-memory-mb", RK_SET_INT, CFG_OFF(kv_memory_mb), 0, 1, 1 << 24, 0, 0,
     "N  KV cache budget in MiB (default: 1024)"},
    {"share_live", "share-live", RK_SET_FLOAT, CFG_OFF(share_live), 0, 0, 1, 0, 0,
     "F  budget share of requests in flight (default: 0.4)"},
    {"share_prefix", "share-prefix", RK_SET_FLOAT, CFG_OFF(share_prefix), 0, 0, 1, 0, 0,
     "F  budget share of the system-prompt cache (default: 0.1)"},
    {"share_chunk", "share-chunk", RK_SET_FLOAT, CFG_OFF(share_chunk), 0, 0, 1, 0, 0,
     "F  budget share of the chunk cache (default: 0.5)"},
    {"live_blocks", "live-blocks", RK_SET_INT, CFG_OFF(live_blocks), 0, 0, 1 << 30, 0, 0,
     "N  live pool blocks (overrides the share)"},
    {"prefix_blocks", "prefix-blocks", RK_SET_INT, CFG_OFF(prefix_blocks), 0, 0, 1 << 30, 0, 0,
     "N  prefix pool blocks (overrides the share)"},
    {"chunk_blocks", "chunk-blocks", RK_SET_INT, CFG_OFF(chunk_blocks), 0, 0, 1 << 30, 0, 0,
     "N  chunk pool blocks (overrides the share)"},
    {"kv_poison", "kv-poison", RK_SET_BOOL, CFG_OFF(kv_poison), 0, 0, 1, 0, 0,
     "  fill freed KV blocks with NaN (debugging)"},
    {"prefix_cache", "no-prefix-cache", RK_SET_BOOL, CFG_OFF(prefix_cache), 0, 0, 1, 1, 0,
     "  do not cache system prompts in the radix tree"},
    {"chunk_entries", "chunk-entries", RK_SET_INT, CFG_OFF(chunk_entries), 0, 1, 1 << 30, 0, 0,
     "N  chunks the index holds at most (default: 100000)"},
    {"max_chunks", "max-chunks", RK_SET_INT, CFG_OFF(max_chunks), 0, 0, 1 << 20, 0, 0,
     "N  chunks per request (default: 64; more: 422)"},
    {"max_chunk_tokens", "max-chunk-tokens", RK_SET_INT, CFG_OFF(max_chunk_tokens), 0, 1, 1 << 30,
     0, 0, "N  tokens per chunk (default: 4096; more: 422)"},
    {"max_context", "max-context", RK_SET_INT, CFG_OFF(max_context), 0, 0, 1 << 30, 0, 0,
     "N  tokens per request, prompt + max_tokens (default: 0 = the model's)"},
    {"max_tokens", "max-tokens", RK_SET_INT, CFG_OFF(max_tokens), 0, 1, 1 << 30, 0, 0,
     "N  largest max_tokens a request may ask (default: 4096)"},
    {"store_dir", "store", RK_SET_STR, CFG_STR(store_dir), 0, 0, 0, 0,
     "DIR  persistent chunk store: the disk tier (default: none)"},
    {"store_budget_mb", "store-budget-mb", RK_SET_INT, CFG_OFF(store_budget_mb), 0, 0, 1 << 30, 0,
     0, "N  payload MiB kept in the store (default: 0 = unlimited)"},
    {"store_verify", "no-store-verify", RK_SET_BOOL, CFG_OFF(store_verify), 0, 0, 1, 1, 0,
     "  check sizes and headers only when the store opens (no checksums)"},
    {"redis", "redis", RK_SET_STR, CFG_STR(redis_url), 0, 0, 0, RK_SECRET_URL,
     "URL  shared chunk tier redis://[user:password@]HOST:PORT[/DB] (default: none)"},
    {"redis_prefix", "redis-prefix", RK_SET_STR, CFG_STR(redis_prefix), 0, 0, 0, 0,
     "P  first part of every Redis key, [A-Za-z0-9_.-] (default: ragkv)"},
    {"redis_timeout_ms", "redis-timeout-ms", RK_SET_INT, CFG_OFF(redis_timeout_ms), 0, 1, 60000, 0,
     0, "MS  Redis connect and command timeout (default: 200)"},
    {"redis_min_tokens", "redis-min-tokens", RK_SET_INT, CFG_OFF(redis_min_tokens), 0, 1, 1 << 30,
     0, 0, "N  chunks shorter than this skip Redis (default: 32)"},
    {"redis_wait_ms", "redis-wait-ms", RK_SET_INT, CFG_OFF(redis_wait_ms), 0, 0, 60000, 0, 0,
     "MS  longest wait for a chunk another replica computes (default: 300)"},
};
const size_t rk_config_n_settings = sizeof rk_config_settings / sizeof rk_config_settings[0];

rk_status rk_setting_parse(void *base, const rk_setting *f, const char *s) {
    char *p = (char *)base + f->off, *end;
    errno = 0;
    switch (f->type) {
    case RK_SET_INT:
    case RK_SET_LONG: {
        long long v = strtoll(s, &end, 10);
        if (errno || end == s || *end || v < (long long)f->lo || v > (long long)f->hi)
            return rk_errorf(RK_ERR_INVALID, "%s must be an integer from %.0f to %.0f, got '%s'",
                             f->name, f->lo, f->hi, s);
        if (f->type == RK_SET_INT)
            *(int *)p = (int)v;
        else
            *(long long *)p = v;
        return RK_OK;
    }
    case RK_SET_FLOAT:
    case RK_SET_DOUBLE: {
        double v;
        if (rk_parse_double(s, f->lo, f->hi, &v))
            return rk_errorf(RK_ERR_INVALID, "%s must be a number from %g to %g, got '%s'", f->name,
                             f->lo, f->hi, s);
        if (f->type == RK_SET_FLOAT)
            *(float *)p = (float)v;
        else
            *(double *)p = v;
        return RK_OK;
    }
    case RK_SET_BOOL:
        if (!strcmp(s, "1") || !strcmp(s, "true") || !strcmp(s, "yes"))
            *(int *)p = 1;
        else if (!strcmp(s, "0") || !strcmp(s, "false") || !strcmp(s, "no"))
            *(int *)p = 0;
        else
            return rk_errorf(RK_ERR_INVALID, "%s must be true or false, got '%s'", f->name, s);
        return RK_OK;
    case RK_SET_STR:
        if (strlen(s) >= f->size)
            return rk_errorf(RK_ERR_INVALID, "%s is longer than %zu bytes", f->name, f->size - 1);
        snprintf(p, f->size, "%s", s);
        return RK_OK;
    }
    return rk_errorf(RK_ERR_INVALID, "%s: bad setting type %d", f->name, (int)f->type);
}

const rk_setting *rk_settings_find(const rk_settings *tabs, int n_tabs, const char *name,
                                   void **base) {
    for (int t = 0; t < n_tabs; t++)
        for (size_t i = 0; i < tabs[t].n; i++)
            if (!strcmp(tabs[t].fields[i].name, name)) {
                if (base) *base = tabs[t].base;
                return &tabs[t].fields[i];
            }
    return NULL;
}

/* Set f from a JSON value: through its text form, so the same ranges apply. */
static rk_status parse_json(void *base, const rk_setting *f, json_t *v) {
    char buf[64];
    switch (f->type) {
    case RK_SET_INT:
    case RK_SET_LONG:
        if (!json_is_integer(v)) break;
        snprintf(buf, sizeof buf, "%lld", (long long)json_integer_value(v));
        return rk_setting_parse(base, f, buf);
    case RK_SET_FLOAT:
    case RK_SET_DOUBLE:
        if (!json_is_number(v)) break;
        snprintf(buf, sizeof buf, "%.17g", json_number_value(v));
        return rk_setting_parse(base, f, buf);
    case RK_SET_BOOL:
        if (!json_is_boolean(v) && !json_is_integer(v)) break;
        return rk_setting_parse(base, f, json_is_true(v) || json_integer_value(v) ? "1" : "0");
    case RK_SET_STR:
        if (!json_is_string(v)) break;
        return rk_setting_parse(base, f, json_string_value(v));
    }
    return rk_errorf(RK_ERR_INVALID, "%s has the wrong type (want %s)", f->name,
                     f->type == RK_SET_STR                             ? "a string"
                     : f->type == RK_SET_BOOL                          ? "true or false"
                     : f->type == RK_SET_INT || f->type == RK_SET_LONG ? "an integer"
                                                                       : "a number");
}

rk_status rk_settings_load_file(const rk_settings *tabs, int n_tabs, const char *path) {
    json_error_t je;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return rk_errorf(je.line < 0 ? RK_ERR_IO : RK_ERR_FORMAT, "%s:%d:%d: %s", path, je.line,
                         je.column, je.text);
    rk_status st = RK_OK;
    if (!json_is_object(root)) {
        st = rk_errorf(RK_ERR_FORMAT, "%s: the configuration must be a JSON object", path);
    } else {
        const char *key;
        json_t *v;
        json_object_foreach(root, key, v) {
            void *base;
            const rk_setting *f = rk_settings_find(tabs, n_tabs, key, &base);
            if (!f) {
                st = rk_errorf(RK_ERR_INVALID, "%s: unknown setting \"%s\"", path, key);
                break;
            }
            if ((st = parse_json(base, f, v)) != RK_OK) {
                char msg[256];
                snprintf(msg, sizeof msg, "%s", rk_error_message());
                st = rk_errorf(st, "%s: %s", path, msg);
                break;
            }
        }
    }
    json_decref(root);
    return st;
}

rk_status rk_settings_load_env(const rk_settings *tabs, int n_tabs) {
    for (int t = 0; t < n_tabs; t++) {
        for (size_t i = 0; i < tabs[t].n; i++) {
            const rk_setting *f = &tabs[t].fields[i];
            char name[64] = "RAGKV_";
            size_t n = 6;
            for (const char *p = f->name; *p && n + 1 < sizeof name; p++)
                name[n++] = (char)(*p >= 'a' && *p <= 'z' ? *p - 32 : *p);
            name[n] = '\0';
            const char *v = getenv(name);
            if (v && rk_setting_parse(tabs[t].base, f, v) != RK_OK) {
                char msg[256];
                snprintf(msg, sizeof msg, "%s", rk_error_message());
                return rk_errorf(RK_ERR_INVALID, "environment %s: %s", name, msg);
            }
        }
    }
    return RK_OK;
}

/* A URL with its password (the part between "user:" and "@") shown as "***",
 * so the endpoint can be read from --print-config without the secret. */
static json_t *url_masked(const char *url) {
    const char *scheme = strstr(url, "://");
    const char *auth = scheme ? scheme + 3 : url;
    const char *at = strrchr(auth, '@');
    const char *colon = at ? memchr(auth, ':', (size_t)(at - auth)) : NULL;
    if (!colon) return json_string(url);
    char buf[1024];
    snprintf(buf, sizeof buf, "%.*s***%s", (int)(colon + 1 - url), url, at);
    return json_string(buf);
}

json_t *rk_settings_json(const rk_settings *tabs, int n_tabs) {
    json_t *root = json_object();
    for (int t = 0; t < n_tabs && root; t++) {
        for (size_t i = 0; i < tabs[t].n; i++) {
            const rk_setting *f = &tabs[t].fields[i];
            const char *p = (const char *)tabs[t].base + f->off;
            json_t *v = NULL;
            switch (f->type) {
            case RK_SET_INT: v = json_integer(*(const int *)p); break;
            case RK_SET_LONG: v = json_integer(*(const long long *)p); break;
            case RK_SET_FLOAT: v = json_real(*(const float *)p); break;
            case RK_SET_DOUBLE: v = json_real(*(const double *)p); break;
            case RK_SET_BOOL: v = json_boolean(*(const int *)p); break;
            case RK_SET_STR:
                if (f->secret == RK_SECRET_URL)
                    v = url_masked(p);
                else
                    v = json_string(f->secret && *p ? "<set>" : p);
                break;
            }
            if (!v || json_object_set_new(root, f->name, v)) {
                json_decref(root);
                return NULL;
            }
        }
    }
    return root;
}

void rk_settings_print_help(FILE *out, const rk_settings *tabs, int n_tabs) {
    for (int t = 0; t < n_tabs; t++) {
        for (size_t i = 0; i < tabs[t].n; i++) {
            const rk_setting *f = &tabs[t].fields[i];
            /* help is "ARG  text" for a flag with a value, "  text" for a switch */
            const char *sp = strchr(f->help, ' ');
            int arglen = sp && f->help[0] != ' ' ? (int)(sp - f->help) : 0;
            char left[64];
            snprintf(left, sizeof left, "--%s%s%.*s", f->flag, arglen ? " " : "", arglen, f->help);
            const char *text = sp ? sp : f->help;
            while (*text == ' ') text++;
            fprintf(out, "  %-21s %s\n", left, text);
        }
    }
}
