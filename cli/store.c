/* cli/store.c — `ragkv prewarm` and `cache`: fill the chunk store offline,
 * read it offline. */
#include <errno.h>
#include <jansson.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "pipeline/persist.h"

/* ---------------------------------------------------------------- prewarm / cache */

/* One progress line on a terminal: done/total, rate, ETA. */
static void progress(size_t done, size_t total, double t0) {
    double dt = rk_time_now() - t0, rate = dt > 0 ? done / dt : 0;
    double eta = rate > 0 ? (total - done) / rate : 0;
    int width = 30, fill = total ? (int)(width * done / total) : width;
    fprintf(stderr, "\r[%.*s%*s] %zu/%zu chunks  %.1f chunks/s  ETA %d:%02d ", fill,
            "==============================", width - fill, "", done, total, rate, (int)eta / 60,
            (int)eta % 60);
    fflush(stderr);
}

typedef struct prewarm_args {
    char input[4096];
    long long batch;
    char redis[sizeof(((rk_config *)0)->redis_url)];
    char redis_secret_file[sizeof(((rk_config *)0)->redis_secret_file)];
    char tenant[64];
    char salt[RK_CACHE_SALT_MAX + 1];
} prewarm_args;

static const rk_setting k_prewarm_settings[] = {
    {"input", "input", RK_SET_STR, offsetof(prewarm_args, input),
     sizeof(((prewarm_args *)0)->input), 0, 0, 0, 0,
     "F.jsonl  the chunks, one JSON object per line"},
    {"batch", "batch", RK_SET_LONG, offsetof(prewarm_args, batch), 0, 1, 100000, 0, 0,
     "N  chunks per engine call (default: 64)"},
    {"redis", "redis", RK_SET_STR, offsetof(prewarm_args, redis),
     sizeof(((prewarm_args *)0)->redis), 0, 0, 0, RK_SECRET_URL,
     "URL  also share the chunks through this Redis (then --store is optional)"},
    {"redis_secret_file", "redis-secret-file", RK_SET_STR,
     offsetof(prewarm_args, redis_secret_file), sizeof(((prewarm_args *)0)->redis_secret_file), 0,
     0, 0, 0,
     "F  file holding the secret that authenticates Redis values (default: "
     "RAGKV_REDIS_SECRET)"},
    {"tenant", "tenant", RK_SET_STR, offsetof(prewarm_args, tenant),
     sizeof(((prewarm_args *)0)->tenant), 0, 0, 0, 0,
     "NAME  compute the chunks in this tenant's cache (its salt: NAME unless --salt)"},
    {"salt", "salt", RK_SET_STR, offsetof(prewarm_args, salt), sizeof(((prewarm_args *)0)->salt), 0,
     0, 0, 0, "S  the tenant's salt (with --tenant), or a request's cache_salt (without)"},
};

typedef struct prewarm_counts {
    size_t computed, cached, failed;
} prewarm_counts;

/* Count a batch's outcomes (saying why for each failed chunk) and free its
 * documents. */
static void count_batch(const rk_prewarm_item *items, json_t **docs, int n, int tty,
                        prewarm_counts *cnt) {
    for (int i = 0; i < n; i++) {
        const char *stt = items[i].status;
        if (!strcmp(stt, "computed"))
            cnt->computed++;
        else if (!strcmp(stt, "cached"))
            cnt->cached++;
        else {
            cnt->failed++;
            fprintf(stderr, "%sragkv prewarm: chunk %s: %s\n", tty ? "\n" : "",
                    items[i].doc_id ? items[i].doc_id : "(no id)", items[i].error);
        }
        json_decref(docs[i]);
    }
}

/* One input line as an item that points into the returned document; NULL
 * when the line is malformed, with why in jerr->text. */
static json_t *parse_item(const char *line, size_t len, rk_prewarm_item *item, json_error_t *jerr) {
    json_t *doc = json_loadb(line, len, 0, jerr);
    json_t *text = doc ? json_object_get(doc, "text") : NULL;
    json_t *id = doc ? json_object_get(doc, "id") : NULL;
    if (!doc || !json_is_object(doc) || !json_is_string(text) || (id && !json_is_string(id))) {
        if (doc)
            snprintf(jerr->text, sizeof jerr->text, "expected {\"id\": string, \"text\": string}");
        json_decref(doc);
        return NULL;
    }
    *item = (rk_prewarm_item){.text = json_string_value(text),
                              .len = json_string_length(text),
                              .doc_id = id ? json_string_value(id) : NULL};
    return doc;
}

/* The non-empty lines of f, which is rewound. */
static size_t count_lines(FILE *f, char **line, size_t *cap) {
    size_t total = 0;
    ssize_t len;
    while ((len = getline(line, cap, f)) >= 0)
        if (len > 1 || (len == 1 && (*line)[0] != '\n')) total++;
    rewind(f);
    return total;
}

/* Put the tiers prewarm writes to into cfg (the Redis secret from
 * RAGKV_REDIS_SECRET); NULL, or what is wrong with the arguments. */
static const char *prewarm_tiers(const prewarm_args *pa, rk_config *cfg) {
    if (!pa->input[0]) return "--input is required";
    snprintf(cfg->redis_url, sizeof cfg->redis_url, "%s", pa->redis);
    snprintf(cfg->redis_secret_file, sizeof cfg->redis_secret_file, "%s", pa->redis_secret_file);
    const char *env_secret = getenv("RAGKV_REDIS_SECRET");
    if (env_secret && strlen(env_secret) >= sizeof cfg->redis_secret)
        return "RAGKV_REDIS_SECRET is longer than 1024 bytes";
    if (env_secret) snprintf(cfg->redis_secret, sizeof cfg->redis_secret, "%s", env_secret);
    if (!cfg->store_dir[0] && !cfg->redis_url[0]) return "--store or --redis is required";
    return NULL;
}

int rk_cli_prewarm(int argc, char **argv) {
    static const char *help =
        "usage: ragkv prewarm --input F.jsonl (--store DIR | --redis URL) [--model F.gguf]\n"
        "                     [options]\n"
        "Compute the KV of document chunks offline and write it to the store (and share it\n"
        "through Redis with --redis), without the HTTP server. Input lines are\n"
        "{\"id\": \"...\", \"text\": \"...\"}. Chunks already stored are skipped, so an\n"
        "interrupted run can be rerun. Malformed lines are reported with their line number\n"
        "and skipped; the exit status is then 1. With --tenant NAME the chunks go into that\n"
        "tenant's cache (the keys a server with --api-keys-file gives its requests).\n";
    rk_run_opts o;
    rk_run_opts_defaults(&o);
    prewarm_args pa = {.batch = 64};
    rk_settings own = {k_prewarm_settings, sizeof k_prewarm_settings / sizeof k_prewarm_settings[0],
                       &pa};
    rk_cmdline cl = {.cmd = "prewarm", .usage = help};
    int exit_code;
    if (rk_cli_parse_run(&cl, &o, &own, 1, argc, argv, &exit_code)) return exit_code;
    const char *input = pa.input;
    long batch = (long)pa.batch;
    const char *why = prewarm_tiers(&pa, &o.cfg);
    if (why) return usage_error("prewarm", "%s", why);
    /* The scope a server gives the tenant's requests (or a request's
     * cache_salt): the keys the server will look up. */
    rk_chunk_key salt = pa.tenant[0] ? rk_cache_scope(pa.salt[0] ? pa.salt : pa.tenant, NULL)
                                     : rk_cache_scope(NULL, pa.salt);
    FILE *f = fopen(input, "rb");
    if (!f) {
        rk_error_setf("%s: %s", input, strerror(errno));
        return fail("cannot read the input");
    }
    /* Count the lines first so progress can show a total. */
    char *line = NULL;
    size_t cap = 0;
    size_t total = count_lines(f, &line, &cap);
    ssize_t len;
    rk_service *svc;
    if (open_service(&o, &svc)) {
        free(line);
        fclose(f);
        return fail("cannot start");
    }
    rk_prewarm_item *items = calloc((size_t)batch, sizeof *items);
    json_t **docs = calloc((size_t)batch, sizeof *docs);
    size_t line_no = 0, done = 0, n_bad = 0;
    prewarm_counts cnt = {0};
    int n = 0, rc = 0, tty = isatty(STDERR_FILENO);
    double t0 = rk_time_now();
    if (!items || !docs) {
        rk_error_setf("out of memory");
        rc = fail("prewarm");
    }
    for (int eof = 0; !eof && rc == 0;) {
        len = getline(&line, &cap, f);
        eof = len < 0;
        if (!eof) {
            line_no++;
            while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = '\0';
            if (len == 0) continue;
            json_error_t jerr;
            if (!(docs[n] = parse_item(line, (size_t)len, &items[n], &jerr))) {
                fprintf(stderr, "%sragkv prewarm: %s:%zu: %s\n", tty ? "\n" : "", input, line_no,
                        jerr.text);
                n_bad++;
                done++;
                continue;
            }
            items[n].salt = salt;
            n++;
        }
        if (n == batch || (eof && n > 0)) {
            if (rk_pipeline_prewarm(svc, items, n, 1)) rc = fail("prewarm failed");
            count_batch(items, docs, n, tty, &cnt);
            done += (size_t)n;
            n = 0;
            if (tty) progress(done, total, t0);
        }
    }
    double dt = rk_time_now() - t0;
    if (tty) fputc('\n', stderr);
    rk_store_counters sc = {0};
    rk_store_stats(svc->store, &sc);
    fprintf(
        stderr,
        "ragkv prewarm: %zu chunks in %.1f s (%.1f chunks/s): %zu computed, %zu already cached, "
        "%zu failed, %zu malformed lines; store: %llu rows, %.1f MB\n",
        cnt.computed + cnt.cached + cnt.failed, dt, dt > 0 ? (cnt.computed + cnt.cached) / dt : 0.0,
        cnt.computed, cnt.cached, cnt.failed, n_bad, (unsigned long long)sc.rows, sc.bytes / 1e6);
    free(items);
    free(docs);
    free(line);
    fclose(f);
    rk_service_close(svc);
    return rc ? rc : (n_bad || cnt.failed) ? EXIT_FAILURE : 0;
}

typedef struct cache_args {
    char store[4096], sort[16];
    int limit;
} cache_args;

static const rk_setting k_cache_settings[] = {
    {"store", "store", RK_SET_STR, offsetof(cache_args, store), sizeof(((cache_args *)0)->store), 0,
     0, 0, 0, "DIR  the chunk store (required)"},
    {"sort", "sort", RK_SET_STR, offsetof(cache_args, sort), sizeof(((cache_args *)0)->sort), 0, 0,
     0, 0, "hits|recent  ls order: most hits or most recent access first (default: recent)"},
    {"limit", "limit", RK_SET_INT, offsetof(cache_args, limit), 0, 0, 1 << 30, 0, 0,
     "N  ls lines at most (default: 0 = all)"},
};

int rk_cli_cache(int argc, char **argv) {
    static const char *help =
        "usage: ragkv cache ls|stats|verify|rebuild --store DIR [--sort hits|recent] [--limit N]\n"
        "Read a chunk store offline (ls, stats and verify change nothing).\n"
        "  ls       one line per stored chunk (key, model, tokens, bytes, hits, last access)\n"
        "  stats    rows and bytes, per model\n"
        "  verify   re-check every payload's checksum; exit status 1 if any is bad\n"
        "  rebuild  set chunks.db aside (chunks.db.corrupt-TIME or .old-TIME) and rebuild it\n"
        "           from the payload files; bad payloads go to DIR/quarantine/. Only while\n"
        "           no server has the store open.\n";
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        fputs(help, argc < 2 ? stderr : stdout);
        return argc < 2 ? EXIT_USAGE : 0;
    }
    const char *sub = argv[1];
    cache_args ca = {.sort = "recent"};
    rk_settings tab = {k_cache_settings, sizeof k_cache_settings / sizeof k_cache_settings[0], &ca};
    rk_cmdline cl = {.cmd = "cache", .usage = help, .tabs = &tab, .n_tabs = 1, .first = 2};
    int exit_code, next = rk_cmdline_parse(&cl, argc, argv, &exit_code);
    if (next < 0) return exit_code;
    if (next < argc) return usage_error("cache", "unexpected argument '%s'", argv[next]);
    const char *dir = ca.store[0] ? ca.store : NULL;
    rk_store_sort sort = RK_STORE_SORT_RECENT;
    if (!strcmp(ca.sort, "hits"))
        sort = RK_STORE_SORT_HITS;
    else if (strcmp(ca.sort, "recent"))
        return usage_error("cache", "--sort is hits or recent, not '%s'", ca.sort);
    if (!dir) return usage_error("cache", "%s", "--store is required");
    if (strcmp(sub, "ls") && strcmp(sub, "stats") && strcmp(sub, "verify") &&
        strcmp(sub, "rebuild"))
        return usage_error("cache", "unknown subcommand '%s' (ls, stats, verify, rebuild)", sub);
    if (!strcmp(sub, "rebuild")) {
        rk_store_rebuild_result r;
        if (rk_store_rebuild(dir, &r)) return fail("cache rebuild");
        if (r.set_aside[0])
            printf("old database kept as %s/%s (%s)\n", dir, r.set_aside,
                   r.db_was_corrupt ? "corrupt" : "sound");
        printf("rebuilt %llu rows from the payload files; %llu quarantined, %llu unreadable, "
               "%llu temporary files removed\n",
               (unsigned long long)r.rows_rebuilt, (unsigned long long)r.quarantined,
               (unsigned long long)r.unreadable, (unsigned long long)r.tmp_removed);
        return 0;
    }
    rk_store *st;
    if (rk_store_open_readonly(dir, &st)) return fail("cannot open the store");
    rk_store_set_body_check(st, rk_persist_body_check); /* verify: finite KV too */
    int rc = 0;
    uint64_t bad = 0;
    rk_status s = !strcmp(sub, "ls")      ? rk_store_print_ls(st, stdout, sort, ca.limit)
                  : !strcmp(sub, "stats") ? rk_store_print_stats(st, stdout)
                                          : rk_store_print_verify(st, stdout, &bad);
    if (s)
        rc = fail("cache");
    else if (bad)
        rc = EXIT_FAILURE;
    rk_store_close(st);
    return rc;
}
