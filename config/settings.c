/* config/settings.c — the settings tables' parser: text (flags, environment),
 * the JSON config file, the effective settings as JSON and the help lines;
 * and the table of rk_config's fields. */
#include "config/settings.h"

#include <errno.h>
#include <getopt.h>
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
     "T  KV storage type: auto, f32, f16, bf16 or q8_0 (default: auto = f16)"},
    {"kv_memory_mb", "kv-memory-mb", RK_SET_AUTO, CFG_OFF(kv_memory_mb), 0, 1, 1 << 24, 0, 0,
     "N|auto  KV cache budget in MiB (default: auto = half the memory left after the weights, "
     "at least one full context in the live and chunk pools; see docs/operations.md)"},
    {"memory_limit_mb", "memory-limit-mb", RK_SET_INT, CFG_OFF(memory_limit_mb), 0, 0, 1 << 30, 0,
     0,
     "N  memory in MiB that an auto KV budget is sized from (default: 0 = MemAvailable, "
     "bounded by a cgroup limit)"},
    {"store_dir", "store", RK_SET_STR, CFG_STR(store_dir), 0, 0, 0, 0,
     "DIR  persistent chunk store: the disk tier (default: none)"},
    {"store_budget_mb", "store-budget-mb", RK_SET_INT, CFG_OFF(store_budget_mb), 0, 0, 1 << 30, 0,
     0, "N  payload MiB kept in the store (default: 0 = unlimited)"},
    /* Above: the RK_CONFIG_N_RUN_SETTINGS every model-running command takes. */
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
    {"reindex", "reindex", RK_SET_STR, CFG_STR(reindex), 0, 0, 0, 0,
     "MODE  cached chunks: zero-copy (attended in place; default) or copy"},
    {"pooling", "pooling", RK_SET_STR, CFG_STR(pooling), 0, 0, 0, 0,
     "P  embedding pooling: auto (the model file's), none, mean, cls or last (default: auto)"},
    {"step_tokens", "step-tokens", RK_SET_INT, CFG_OFF(step_tokens), 0, 0, 1 << 30, 0, 0,
     "N  prompt tokens per engine step next to decoding (chunk misses, repair runs and questions;"
     " default: 64; 0 = unlimited)"},
    {"repair", "repair", RK_SET_STR, CFG_STR(repair), 0, 0, 0, 0,
     "POLICY  repair of a request that names none or \"auto\": none (default), first_k:K, "
     "deviation:R or query:R"},
    {"repair_calibration", "repair-calibration", RK_SET_STR, CFG_STR(repair_calibration), 0, 0, 0,
     0, "FILE  calibration from `ragkv eval --calibrate`: its policy replaces --repair"},
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
    {"store_verify", "no-store-verify", RK_SET_BOOL, CFG_OFF(store_verify), 0, 0, 1, 1, 0,
     "  check sizes and headers only when the store opens (no checksums)"},
    {"store_read_delay_ms", "store-read-delay-ms", RK_SET_INT, CFG_OFF(store_read_delay_ms), 0, 0,
     60000, 0, 0, "MS  testing aid: delay every chunk read from the disk tier"},
    {"store_write_delay_ms", "store-write-delay-ms", RK_SET_INT, CFG_OFF(store_write_delay_ms), 0,
     0, 60000, 0, 0, "MS  testing aid: delay every chunk write to the disk tier"},
    {"load_mb", "load-mb", RK_SET_INT, CFG_OFF(load_mb), 0, 1, 1 << 20, 0, 0,
     "N  MiB of chunk KV read from the tiers and not yet placed, and MiB queued for disk writes,"
     " at most each (default: 256)"},
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
    {"redis_secret_file", "redis-secret-file", RK_SET_STR, CFG_STR(redis_secret_file), 0, 0, 0, 0,
     "F  file holding the secret that authenticates Redis values (HMAC-SHA-256; default: "
     "RAGKV_REDIS_SECRET, else none: Redis is trusted)"},
    /* The secret itself has no flag (a command line is visible to every user
     * of the host): only RAGKV_REDIS_SECRET or the config file set it. */
    {"redis_secret", NULL, RK_SET_STR, CFG_STR(redis_secret), 0, 0, 0, 1,
     "  the Redis values' secret (RAGKV_REDIS_SECRET)"},
};
const size_t rk_config_n_settings = sizeof rk_config_settings / sizeof rk_config_settings[0];

#define RUN_OFF(m) offsetof(rk_run_opts, m)
#define RUN_STR(m) RUN_OFF(m), sizeof(((rk_run_opts *)0)->m)

static const rk_setting k_run_settings[] = {
    {"model", "model", RK_SET_STR, RUN_STR(model), 0, 0, 0, 0,
     "F.gguf  model file (default: the embedded tiny model)"},
    {"log_level", "log-level", RK_SET_STR, RUN_STR(log_level), 0, 0, 0, 0,
     "L  debug|info|warn|error (default: warn)"},
};

rk_status rk_setting_parse(void *base, const rk_setting *f, const char *s) {
    char *p = (char *)base + f->off, *end;
    errno = 0;
    switch (f->type) {
    case RK_SET_AUTO:
        if (!strcmp(s, "auto")) {
            *(int *)p = 0;
            return RK_OK;
        }
        if (rk_parse_long(s, (long)f->lo, (long)f->hi, &(long){0})) /* checked, then set below */
            return rk_errorf(RK_ERR_INVALID,
                             "%s must be auto or an integer from %.0f to %.0f, "
                             "got '%s'",
                             f->name, f->lo, f->hi, s);
        *(int *)p = (int)strtol(s, NULL, 10);
        return RK_OK;
    case RK_SET_INT:
    case RK_SET_LONG: {
        long long v = strtoll(s, &end, 10);
        /* Compared as doubles: a bound of 2^63 - 1 does not survive a cast back. */
        if (errno || end == s || *end || (double)v < f->lo || (double)v > f->hi)
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
    case RK_SET_AUTO:
        if (json_is_string(v)) return rk_setting_parse(base, f, json_string_value(v));
        if (!json_is_integer(v)) break;
        snprintf(buf, sizeof buf, "%lld", (long long)json_integer_value(v));
        return rk_setting_parse(base, f, buf);
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
                     : f->type == RK_SET_AUTO                          ? "\"auto\" or an integer"
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
            case RK_SET_AUTO:
                v = *(const int *)p ? json_integer(*(const int *)p) : json_string("auto");
                break;
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

/* text from column `indent` on, broken at spaces before column `width`;
 * continuation lines indented to the same column. */
static void print_wrapped(FILE *out, const char *text, int indent, int width) {
    int col = indent;
    while (*text) {
        size_t word = strcspn(text, " ");
        if (col > indent && col + 1 + (int)word > width) {
            fprintf(out, "\n%*s", indent, "");
            col = indent;
        } else if (col > indent) {
            fputc(' ', out);
            col++;
        }
        fwrite(text, 1, word, out);
        col += (int)word;
        text += word;
        while (*text == ' ') text++;
    }
    fputc('\n', out);
}

void rk_settings_print_help(FILE *out, const rk_settings *tabs, int n_tabs) {
    for (int t = 0; t < n_tabs; t++) {
        for (size_t i = 0; i < tabs[t].n; i++) {
            const rk_setting *f = &tabs[t].fields[i];
            if (!f->flag) continue; /* set from the environment or the file only */
            /* help is "ARG  text" for a flag with a value, "  text" for a switch */
            const char *sp = strchr(f->help, ' ');
            int arglen = sp && f->help[0] != ' ' ? (int)(sp - f->help) : 0;
            char left[64];
            snprintf(left, sizeof left, "--%s%s%.*s", f->flag, arglen ? " " : "", arglen, f->help);
            const char *text = sp ? sp : f->help;
            while (*text == ' ') text++;
            fprintf(out, "  %-21s ", left);
            print_wrapped(out, text, 2 + 21 + 1, 80);
        }
    }
}

int rk_log_level_parse(const char *name) {
    static const char *names[] = {"debug", "info", "warn", "error"};
    for (int i = 0; i < 4; i++)
        if (!strcmp(name, names[i])) return i;
    return -1;
}

void rk_run_opts_defaults(rk_run_opts *o) {
    memset(o, 0, sizeof *o);
    rk_config_defaults(&o->cfg);
    snprintf(o->log_level, sizeof o->log_level, "warn");
}

void rk_run_bind(rk_run_opts *o, rk_settings tabs[RK_RUN_N_TABLES]) {
    tabs[0] = (rk_settings){k_run_settings, sizeof k_run_settings / sizeof k_run_settings[0], o};
    tabs[1] = (rk_settings){rk_config_settings, RK_CONFIG_N_RUN_SETTINGS, &o->cfg};
}

rk_status rk_run_opts_apply(const rk_run_opts *o) {
    int level = rk_log_level_parse(o->log_level);
    if (level < 0)
        return rk_errorf(RK_ERR_INVALID, "log_level must be debug, info, warn or error, got '%s'",
                         o->log_level);
    rk_status st = rk_config_validate(&o->cfg);
    if (st) return st;
    rk_log_set_level((rk_log_level)level);
    return RK_OK;
}

/* ================================================================ the command line */

enum { O_CONFIG = 2000, O_FIELD = 3000 };

static void print_cmdline_help(const rk_cmdline *cl) {
    fputs(cl->usage, stdout);
    if (cl->n_shared)
        fputs("  --config F.json       settings file (keys as the RAGKV_<NAME> variables, lower "
              "case)\n",
              stdout);
    rk_settings_print_help(stdout, cl->tabs, cl->n_tabs);
    if (cl->extra_help) fputs(cl->extra_help, stdout);
}

static int usage(const rk_cmdline *cl, int *out_exit, const char *what, const char *arg) {
    if (cl->prog)
        fprintf(stderr, "%s: %s%s (see %s --help)\n", cl->prog, what, arg, cl->prog);
    else
        fprintf(stderr, "ragkv %s: %s%s (see ragkv %s --help)\n", cl->cmd, what, arg, cl->cmd);
    *out_exit = 2;
    return -1;
}

/* Set a table field from its flag: a switch takes no value. */
static rk_status set_flag(void *base, const rk_setting *f, const char *arg) {
    if (f->type != RK_SET_BOOL) return rk_setting_parse(base, f, arg);
    *(int *)((char *)base + f->off) = !f->invert;
    return RK_OK;
}

int rk_cmdline_parse(const rk_cmdline *cl, int argc, char **argv, int *out_exit) {
    size_t n_fields = 0, n_extra = 0;
    for (int t = 0; t < cl->n_tabs; t++) n_fields += cl->tabs[t].n;
    while (cl->extra && cl->extra[n_extra].name) n_extra++;
    struct option *longs = calloc(n_fields + n_extra + 3, sizeof *longs);
    const rk_setting **fields = calloc(n_fields + 1, sizeof *fields);
    void **bases = calloc(n_fields + 1, sizeof *bases);
    char shorts[32];
    snprintf(shorts, sizeof shorts, "h%s", cl->shorts ? cl->shorts : "");
    int rc = -1;
    *out_exit = 2;
    if (!longs || !fields || !bases) {
        fprintf(stderr, "%s%s: out of memory\n", cl->prog ? "" : "ragkv ",
                cl->prog ? cl->prog : cl->cmd);
        *out_exit = 1;
        goto out;
    }
    size_t k = 0, nl = 0;
    for (int t = 0; t < cl->n_tabs; t++)
        for (size_t i = 0; i < cl->tabs[t].n; i++, k++) {
            fields[k] = &cl->tabs[t].fields[i];
            bases[k] = cl->tabs[t].base;
            if (!fields[k]->flag) continue; /* no flag: environment and file only */
            longs[nl++] = (struct option){
                fields[k]->flag, fields[k]->type == RK_SET_BOOL ? no_argument : required_argument,
                0, O_FIELD + (int)k};
        }
    k = nl;
    for (size_t i = 0; i < n_extra; i++) longs[k++] = cl->extra[i];
    if (cl->n_shared) longs[k++] = (struct option){"config", required_argument, 0, O_CONFIG};
    longs[k++] = (struct option){"help", no_argument, 0, 'h'};
    const char *config = NULL;
    int c;
    /* Pass 1: --help, --config and unknown options, before anything is set. */
    optind = cl->first;
    opterr = 0;
    while ((c = getopt_long(argc, argv, shorts, longs, NULL)) != -1) {
        if (c == 'h') {
            print_cmdline_help(cl);
            *out_exit = 0;
            goto out;
        }
        if (c == O_CONFIG) config = optarg;
        if (c == '?' || c == ':') {
            usage(cl, out_exit, "unknown option or missing value: ", argv[optind - 1]);
            goto out;
        }
    }
    /* The shared tables from the file and the environment; then every flag. */
    if ((config && rk_settings_load_file(cl->tabs, cl->n_shared, config)) ||
        rk_settings_load_env(cl->tabs, cl->n_shared)) {
        usage(cl, out_exit, rk_error_message(), "");
        goto out;
    }
    optind = cl->first;
    while ((c = getopt_long(argc, argv, shorts, longs, NULL)) != -1) {
        if (c >= O_FIELD && set_flag(bases[c - O_FIELD], fields[c - O_FIELD], optarg)) {
            char msg[256];
            snprintf(msg, sizeof msg, "--%s: %s", fields[c - O_FIELD]->flag, rk_error_message());
            usage(cl, out_exit, msg, "");
            goto out;
        }
        if (c < O_FIELD && c != O_CONFIG && cl->on_extra(cl->ctx, c, optarg)) {
            usage(cl, out_exit, rk_error_message(), "");
            goto out;
        }
    }
    rc = optind;
out:
    opterr = 1;
    free(longs);
    free(fields);
    free(bases);
    return rc;
}

int rk_run_parse(rk_cmdline *cl, rk_run_opts *run, const rk_settings *own, int n_own, int argc,
                 char **argv, int *out_exit) {
    rk_settings tabs[RK_RUN_N_TABLES + RK_RUN_MAX_OWN];
    if (n_own > RK_RUN_MAX_OWN) n_own = RK_RUN_MAX_OWN;
    rk_run_bind(run, tabs);
    for (int i = 0; i < n_own; i++) tabs[RK_RUN_N_TABLES + i] = own[i];
    cl->tabs = tabs;
    cl->n_tabs = RK_RUN_N_TABLES + n_own;
    cl->n_shared = RK_RUN_N_TABLES;
    cl->first = 1;
    int next = rk_cmdline_parse(cl, argc, argv, out_exit);
    cl->tabs = NULL;
    if (next < 0) return -1;
    if (next < argc) {
        usage(cl, out_exit, "unexpected argument: ", argv[next]);
        return -1;
    }
    return 0;
}
