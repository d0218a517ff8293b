/* config/config.c — status strings, the thread-local error slot, logging and
 * the configuration defaults. */
#include "config/config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

const char *rk_status_str(rk_status st) {
    switch (st) {
    case RK_OK: return "ok";
    case RK_ERR_NOMEM: return "out of memory";
    case RK_ERR_IO: return "i/o error";
    case RK_ERR_FORMAT: return "malformed data";
    case RK_ERR_INVALID: return "invalid argument";
    case RK_ERR_UNSUPPORTED: return "unsupported";
    case RK_ERR_NOT_FOUND: return "not found";
    case RK_ERR_EXHAUSTED: return "resource exhausted";
    case RK_ERR_LIMIT: return "limit exceeded";
    case RK_ERR_BUSY: return "busy";
    case RK_ERR_DEVICE: return "device error";
    case RK_ERR_INTERNAL: return "internal error";
    case RK_ERR_CONTEXT: return "context length exceeded";
    }
    return "unknown status";
}

/* ---------------------------------------------------------------- errors */

static _Thread_local char g_error[512];

void rk_error_setf(const char *fmt, ...) {
    char buf[sizeof g_error]; /* the arguments may point into g_error itself */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    memcpy(g_error, buf, sizeof buf);
}

const char *rk_error_message(void) { return g_error; }

void rk_error_clear(void) { g_error[0] = '\0'; }

/* ---------------------------------------------------------------- logging */

static rk_log_level g_log_level = RK_LOG_WARN;

void rk_log_set_level(rk_log_level level) { g_log_level = level; }

rk_log_level rk_log_get_level(void) { return g_log_level; }

void rk_log(rk_log_level level, const char *func, const char *fmt, ...) {
    static const char *names[] = {"debug", "info", "warn", "error"};
    if (level < g_log_level || level >= RK_LOG_OFF) return;
    char line[1024];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    int n = snprintf(line, sizeof line,
                     "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %-5s %s: ", tm.tm_year + 1900,
                     tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                     ts.tv_nsec / 1000000, names[level], func);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof line) vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s\n", line); /* one write per line keeps threads from interleaving */
}

double rk_time_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int rk_parse_long(const char *s, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

int rk_parse_double(const char *s, double lo, double hi, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi)) return -1;
    *out = v;
    return 0;
}

int rk_repair_parse(const char *s, int *out_k, float *out_ratio, int *out_query) {
    long k = 0;
    double ratio = 0;
    int query = 0;
    if (!strcmp(s, "none")) {
    } else if (!strncmp(s, "first_k:", 8)) {
        if (rk_parse_long(s + 8, 1, 1 << 20, &k)) return -1;
    } else if (!strncmp(s, "deviation:", 10)) {
        if (rk_parse_double(s + 10, 0, 1, &ratio) || !(ratio > 0)) return -1;
    } else if (!strncmp(s, "query:", 6)) {
        if (rk_parse_double(s + 6, 0, 1, &ratio) || !(ratio > 0)) return -1;
        query = 1;
    } else {
        return -1;
    }
    *out_k = (int)k;
    *out_ratio = (float)ratio;
    *out_query = query;
    return 0;
}

/* ---------------------------------------------------------------- memory */

/* The number after `key` in a "Key:   N kB" line of a /proc/meminfo file, in
 * bytes; 0 when absent or unreadable. */
static uint64_t meminfo_bytes(const char *path, const char *key) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char line[256];
    size_t n = strlen(key);
    uint64_t v = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long long kb;
        if (!strncmp(line, key, n) && line[n] == ':' && sscanf(line + n + 1, "%llu", &kb) == 1) {
            v = (uint64_t)kb * 1024;
            break;
        }
    }
    fclose(f);
    return v;
}

/* A file holding one number (a cgroup limit or usage); 0 when absent,
 * unreadable or "max" (no limit). */
static uint64_t file_number(const char *dir, const char *name) {
    char path[1100];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    unsigned long long v = 0;
    if (fscanf(f, "%llu", &v) != 1) v = 0;
    fclose(f);
    return (uint64_t)v;
}

rk_status rk_memory_detect(const char *meminfo, const char *cgroup_dir, rk_memory_info *out) {
    *out = (rk_memory_info){.source = "MemAvailable"};
    if (!meminfo) meminfo = "/proc/meminfo";
    if (!cgroup_dir) cgroup_dir = "/sys/fs/cgroup";
    out->available = meminfo_bytes(meminfo, "MemAvailable");
    /* v2 first; a v1 hierarchy has no limit when it reports a huge number. */
    uint64_t limit = file_number(cgroup_dir, "memory.max"), used = 0;
    if (limit)
        used = file_number(cgroup_dir, "memory.current");
    else if ((limit = file_number(cgroup_dir, "memory/memory.limit_in_bytes")) != 0)
        used = file_number(cgroup_dir, "memory/memory.usage_in_bytes");
    if (limit >= (uint64_t)1 << 60) limit = 0;
    if (limit) out->cgroup = limit > used ? limit - used : 1;
    out->bytes = out->available;
    if (out->cgroup && (!out->bytes || out->cgroup < out->bytes)) {
        out->bytes = out->cgroup;
        out->source = "cgroup";
    }
    if (!out->bytes)
        return rk_errorf(RK_ERR_IO,
                         "cannot tell the available memory (no MemAvailable in %s, "
                         "no cgroup limit): set kv_memory_mb or memory_limit_mb",
                         meminfo);
    return RK_OK;
}

/* ---------------------------------------------------------------- config */

void rk_config_defaults(rk_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    snprintf(cfg->backend, sizeof cfg->backend, "cpu");
    cfg->n_threads = 0;
    cfg->block_size = 16;
    snprintf(cfg->kv_dtype, sizeof cfg->kv_dtype, "auto");
    snprintf(cfg->pooling, sizeof cfg->pooling, "auto");
    cfg->kv_memory_mb = 0; /* auto */
    cfg->share_live = 0.4f;
    cfg->share_prefix = 0.1f;
    cfg->share_chunk = 0.5f;
    cfg->prefix_cache = 1;
    snprintf(cfg->reindex, sizeof cfg->reindex, "zero-copy");
    cfg->step_tokens = 64; /* docs/benchmarks.md, "Cold arrival" */
    snprintf(cfg->repair, sizeof cfg->repair, "none");
    cfg->chunk_entries = 100000;
    cfg->max_chunks = 64;
    cfg->max_chunk_tokens = 4096;
    cfg->max_context = 0;
    cfg->max_tokens = 4096;
    cfg->store_verify = 1;
    cfg->load_mb = 256;
    cfg->kv_poison = 0;
    snprintf(cfg->redis_prefix, sizeof cfg->redis_prefix, "ragkv");
    cfg->redis_timeout_ms = 200;
    cfg->redis_min_tokens = 32;
    cfg->redis_wait_ms = 300;
}

rk_status rk_config_validate(const rk_config *cfg) {
    if (strcmp(cfg->backend, "cpu") != 0 && strcmp(cfg->backend, "cuda") != 0)
        return rk_errorf(RK_ERR_INVALID, "config: backend must be \"cpu\" or \"cuda\", got \"%s\"",
                         cfg->backend);
    if (cfg->n_threads < 0 || cfg->n_threads > 1024)
        return rk_errorf(RK_ERR_INVALID, "config: n_threads must be 0 (auto) to 1024, got %d",
                         cfg->n_threads);
    int bs = cfg->block_size;
    if (bs < 8 || bs > 64 || (bs & (bs - 1)) != 0)
        return rk_errorf(RK_ERR_INVALID,
                         "config: block_size must be a power of two from 8 to 64, got %d", bs);
    if (strcmp(cfg->pooling, "auto") && strcmp(cfg->pooling, "none") &&
        strcmp(cfg->pooling, "mean") && strcmp(cfg->pooling, "cls") && strcmp(cfg->pooling, "last"))
        return rk_errorf(RK_ERR_INVALID,
                         "config: pooling must be auto, none, mean, cls or last, got \"%s\"",
                         cfg->pooling);
    if (strcmp(cfg->kv_dtype, "auto") && strcmp(cfg->kv_dtype, "f32") &&
        strcmp(cfg->kv_dtype, "f16") && strcmp(cfg->kv_dtype, "bf16") &&
        strcmp(cfg->kv_dtype, "q8_0"))
        return rk_errorf(RK_ERR_INVALID,
                         "config: kv_dtype must be auto, f32, f16, bf16 or q8_0, got \"%s\"",
                         cfg->kv_dtype);
    if (strcmp(cfg->reindex, "zero-copy") && strcmp(cfg->reindex, "copy"))
        return rk_errorf(RK_ERR_INVALID, "config: reindex must be zero-copy or copy, got \"%s\"",
                         cfg->reindex);
    int k, query;
    float ratio;
    if (rk_repair_parse(cfg->repair, &k, &ratio, &query))
        return rk_errorf(RK_ERR_INVALID,
                         "config: repair must be none, first_k:K (K >= 1), deviation:R or "
                         "query:R (0 < R <= 1), got \"%s\"",
                         cfg->repair);
    if (cfg->kv_memory_mb < 0 || cfg->kv_memory_mb > (1 << 24))
        return rk_errorf(RK_ERR_INVALID,
                         "config: kv_memory_mb must be auto (0) or 1 to 16777216, got %d",
                         cfg->kv_memory_mb);
    if (cfg->memory_limit_mb < 0 || cfg->memory_limit_mb > (1 << 30))
        return rk_errorf(RK_ERR_INVALID,
                         "config: memory_limit_mb must be 0 (detect) to 1073741824, got %d",
                         cfg->memory_limit_mb);
    float shares[3] = {cfg->share_live, cfg->share_prefix, cfg->share_chunk};
    if (!(shares[0] > 0) || !(shares[1] >= 0) || !(shares[2] >= 0) ||
        shares[0] + shares[1] + shares[2] > 1.0001f)
        return rk_errorf(RK_ERR_INVALID,
                         "config: pool shares must be >= 0 (live > 0) and add up to at most 1, "
                         "got live=%g prefix=%g chunk=%g",
                         shares[0], shares[1], shares[2]);
    if (cfg->chunk_entries < 1 || cfg->max_chunks < 0 || cfg->max_chunk_tokens < 1 ||
        cfg->max_context < 0 || cfg->max_tokens < 1)
        return rk_errorf(RK_ERR_INVALID,
                         "config: chunk_entries, max_chunk_tokens and max_tokens must be >= 1, "
                         "max_chunks and max_context >= 0");
    if (cfg->live_blocks < 0 || cfg->prefix_blocks < 0 || cfg->chunk_blocks < 0)
        return rk_errorf(RK_ERR_INVALID,
                         "config: pool block counts must be >= 0, got live=%d prefix=%d chunk=%d",
                         cfg->live_blocks, cfg->prefix_blocks, cfg->chunk_blocks);
    return RK_OK;
}
