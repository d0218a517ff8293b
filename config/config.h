/* config/ — the lowest layer of ragkv: status codes, error messages, logging,
 * and the single rk_config struct that every other module reads.
 *
 * Every fallible function in ragkv returns an rk_status (RK_OK == 0). The
 * function that detects a failure records a one-line message with
 * rk_errorf(); callers higher up may read it with rk_error_message() to show
 * the user what went wrong and where. The message is thread-local. */
#ifndef RK_CONFIG_H
#define RK_CONFIG_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

typedef enum rk_status {
    RK_OK = 0,
    RK_ERR_NOMEM,       /* an allocation failed */
    RK_ERR_IO,          /* a read, write, open or mmap failed */
    RK_ERR_FORMAT,      /* a file or payload is malformed (bad magic, truncated, ...) */
    RK_ERR_INVALID,     /* bad argument or bad user input */
    RK_ERR_UNSUPPORTED, /* well-formed but not handled (unknown architecture, type) */
    RK_ERR_NOT_FOUND,   /* a key, tensor or entry does not exist */
    RK_ERR_EXHAUSTED,   /* a pool or budget has no room left */
    RK_ERR_LIMIT,       /* a configured limit was exceeded */
    RK_ERR_BUSY,        /* the resource is in use (referenced, locked) */
    RK_ERR_DEVICE,      /* the accelerator reported an error */
    RK_ERR_INTERNAL,    /* an invariant broke: a bug */
    RK_ERR_CONTEXT,     /* a request needs more KV than the whole budget holds */
} rk_status;

/* Return a short constant description of a status ("out of memory"). */
const char *rk_status_str(rk_status st);

/* Record a formatted message describing the current failure in this thread's
 * error slot. */
void rk_error_setf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Record a message and evaluate to st, so a failure site reads
 * `return rk_errorf(RK_ERR_FORMAT, "%s: bad magic", path);`. A macro rather
 * than a function so the compiler sees the status returned is the constant
 * given (which keeps its flow analysis precise). */
#define rk_errorf(st, ...) (rk_error_setf(__VA_ARGS__), (st))

/* Return this thread's last recorded error message ("" if none). The pointer
 * stays valid until the next rk_errorf() in this thread. */
const char *rk_error_message(void);

/* Clear this thread's error message. */
void rk_error_clear(void);

/* ---------------------------------------------------------------- logging */

typedef enum rk_log_level {
    RK_LOG_DEBUG = 0,
    RK_LOG_INFO,
    RK_LOG_WARN,
    RK_LOG_ERROR,
    RK_LOG_OFF,
} rk_log_level;

/* Set the minimum level written to stderr (default RK_LOG_WARN). */
void rk_log_set_level(rk_log_level level);
rk_log_level rk_log_get_level(void);

/* Write one structured line to stderr: `time level func: message`. */
void rk_log(rk_log_level level, const char *func, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define RK_LOG_DEBUG(...) rk_log(RK_LOG_DEBUG, __func__, __VA_ARGS__)
#define RK_LOG_INFO(...)  rk_log(RK_LOG_INFO, __func__, __VA_ARGS__)
#define RK_LOG_WARN(...)  rk_log(RK_LOG_WARN, __func__, __VA_ARGS__)
#define RK_LOG_ERROR(...) rk_log(RK_LOG_ERROR, __func__, __VA_ARGS__)

/* Monotonic clock in seconds, for timings. */
double rk_time_now(void);

/* Strict number parsing for flags and settings: the whole string must be a
 * number in [lo, hi]. 0 on success, -1 otherwise (*out untouched). */
int rk_parse_long(const char *s, long lo, long hi, long *out);
int rk_parse_double(const char *s, double lo, double hi, double *out);

/* ---------------------------------------------------------------- small helpers
 * The three every module needs, once (config/util.c). */

/* A copy of z (NULL when z is NULL or memory runs out); the caller frees it. */
char *rk_strdup(const char *z);

/* A growable zero-terminated string. Start it zeroed ({0}). An append that
 * cannot get memory sets oom and every later append does nothing, so a
 * builder checks once at the end. s is the caller's to free (or take). */
typedef struct rk_strbuf {
    char *s;    /* the text so far, zero-terminated; NULL before the first append */
    size_t len; /* bytes in s, the terminator excluded */
    size_t cap; /* bytes allocated */
    int oom;    /* an append failed */
} rk_strbuf;

void rk_strbuf_putn(rk_strbuf *b, const char *z, size_t n);
void rk_strbuf_puts(rk_strbuf *b, const char *z);
void rk_strbuf_printf(rk_strbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The text ("" when nothing was appended), or NULL when an append failed
 * (the buffer is freed then); the buffer is left empty. */
char *rk_strbuf_take(rk_strbuf *b);
void rk_strbuf_free(rk_strbuf *b);

/* A binary min-heap of fixed-size items ordered by before(a, b, ctx): "a
 * comes out before b". Start it zeroed with item_size, before and ctx set;
 * rk_heap_free frees the items. Pushing copies the item in. */
typedef struct rk_heap {
    size_t item_size;
    int (*before)(const void *a, const void *b, void *ctx);
    void *ctx;
    unsigned char *items; /* (cap, item_size) */
    size_t n, cap;
} rk_heap;

rk_status rk_heap_push(rk_heap *h, const void *item);
/* Copy the first item to out and remove it; 0 when the heap is empty. */
int rk_heap_pop(rk_heap *h, void *out);
void rk_heap_free(rk_heap *h);

/* A repair policy written "none", "first_k:K" (1 <= K <= 2^20),
 * "deviation:R" or "query:R" (0 < R <= 1): *out_k, *out_ratio and *out_query
 * (1 for query) as the request options take them (0 when off). 0 on success,
 * -1 otherwise (outputs untouched). */
int rk_repair_parse(const char *s, int *out_k, float *out_ratio, int *out_query);

/* Read the policy a calibration file (`ragkv eval --task ... --calibrate
 * FILE`) chose into policy (cap bytes, NUL-terminated): RK_ERR_IO when it
 * cannot be read, RK_ERR_INVALID when it is not a calibration (version 1)
 * with a policy rk_repair_parse accepts; policy is untouched then. */
rk_status rk_repair_calibration_load(const char *path, char *policy, size_t cap);

/* ---------------------------------------------------------------- config */

typedef struct rk_config {
    /* backend */
    char backend[16]; /* "cpu" (default) or "cuda" */
    int n_threads;    /* compute threads; 0 = number of online cores */

    /* KV arena: a memory budget split into pools by share; an explicit block
     * count (> 0) overrides the share for that pool. */
    int block_size;      /* tokens per KV block: a power of two in [8, 64]; default 16 */
    int kv_memory_mb;    /* KV budget in MiB; 0 = "auto" (default): see rk_kv_auto_budget */
    int memory_limit_mb; /* memory "auto" sizes from; 0 (default) = detected (rk_memory_detect) */
    float share_live;    /* fraction of the budget for requests in flight; default 0.4 */
    float share_prefix;  /* ... for the radix tree's sequences; default 0.1 */
    float share_chunk;   /* ... for the chunk cache; default 0.5 */
    int live_blocks;     /* 0 = from the share */
    int prefix_blocks;
    int chunk_blocks;
    int kv_poison;    /* fill freed blocks with NaN (debugging aid) */
    char kv_dtype[8]; /* KV storage: "auto" (default: f16), "f32", "f16", "bf16" or "q8_0" */
    int prefix_cache; /* cache system prompts in the radix tree; default 1 */
    /* How cached chunks reach a request: "zero-copy" (default: attended in
     * place, position-shifted, where the backend can) or "copy" (rotated into
     * the request's live blocks). */
    char reindex[12];
    /* Prompt tokens one engine step computes at most next to the decode
     * tokens (the rest goes on in the next steps); 0 = unlimited. Default 512. */
    int step_tokens;
    /* How /v1/embeddings pools a sequence: "auto" (default: the model file's
     * <arch>.pooling_type; none when it has no such key), "none", "mean",
     * "cls" or "last". */
    char pooling[8];
    /* The repair policy of a request that names none (or names "auto"):
     * "none" (default), "first_k:K", "deviation:R" or "query:R"
     * (rk_repair_parse). */
    char repair[24];
    /* A calibration file written by `ragkv eval --calibrate`; when set, its
     * chosen policy replaces `repair` (ragkv serve loads it). "" = none. */
    char repair_calibration[1024];

    /* chunk cache and request limits */
    int chunk_entries;    /* most chunks the index holds; default 100000 */
    int max_chunks;       /* chunks per request; default 64 */
    int max_chunk_tokens; /* tokens per chunk; default 4096 */
    int max_context;      /* tokens per request (prompt + generated); 0 = the model's context */
    int max_tokens;       /* generated tokens per request; default 4096 */

    /* persistent store (the disk tier) */
    char store_dir[1024];     /* "" = no store */
    int store_budget_mb;      /* payload bytes kept on disk; 0 = unlimited */
    int store_verify;         /* checksum every payload when the store opens; default 1 */
    int store_read_delay_ms;  /* testing aid: sleep before every payload read; default 0 */
    int store_write_delay_ms; /* testing aid: sleep before every payload write; default 0 */
    int load_mb; /* bytes read by the tier loader and not yet placed, at most; default 256 */

    /* shared Redis tier (store/redis.h) */
    char redis_url[640];   /* redis://[user:password@]HOST:PORT[/DB]; "" = no tier */
    char redis_prefix[65]; /* first part of every key; default "ragkv" */
    int redis_timeout_ms;  /* connect and per-command timeout; default 200 */
    int redis_min_tokens;  /* shorter chunks are neither fetched nor written; default 32 */
    int redis_wait_ms;     /* longest wait for a chunk another replica computes; default 300 */
    char redis_secret_file[1024]; /* file holding the values' HMAC secret; "" = none */
    char redis_secret[1025];      /* the secret itself (RAGKV_REDIS_SECRET, no flag); used when
                                     there is no file; "" = none */
} rk_config;

/* ---------------------------------------------------------------- memory */

/* The memory a process may still take, as `kv_memory_mb auto` sizes from. */
typedef struct rk_memory_info {
    uint64_t bytes;     /* available: the smaller of the two below that are known */
    uint64_t available; /* MemAvailable of /proc/meminfo (0 = unknown) */
    uint64_t cgroup;    /* cgroup limit minus usage (0 = no limit set) */
    const char *source; /* "MemAvailable", "cgroup" or "memory_limit_mb" */
} rk_memory_info;

/* Detect the available memory: MemAvailable from `meminfo`, bounded by the
 * cgroup (v2: memory.max - memory.current under `cgroup_dir`; v1:
 * memory/memory.limit_in_bytes - memory/memory.usage_in_bytes) when a limit
 * is set. NULL paths mean /proc/meminfo and /sys/fs/cgroup. RK_ERR_IO when
 * neither is readable. */
rk_status rk_memory_detect(const char *meminfo, const char *cgroup_dir, rk_memory_info *out);

/* Fill cfg with the defaults (which work on a laptop). */
void rk_config_defaults(rk_config *cfg);

/* Check every field; on failure record a message naming the field and return
 * RK_ERR_INVALID. */
rk_status rk_config_validate(const rk_config *cfg);

#endif
