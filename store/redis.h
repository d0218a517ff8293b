/* store/redis.h — the shared chunk tier: chunk KV payloads in Redis, so that
 * replicas of one model compute each chunk once for the whole fleet.
 *
 * Lookup order on a chunk miss: arena -> disk store -> this tier -> compute.
 *
 * Scope: one endpoint that speaks RESP — a Redis, Valkey or KeyDB server, or a
 * proxy in front of a cluster (the keys of one chunk must reach one node; the
 * tier uses GET/SET/MGET/DEL/UNLINK/EXISTS/SCAN/EVAL, nothing cluster-aware).
 *
 * Layout, for model fingerprint FP (32 hex) and chunk key K (32 hex):
 *
 *   PREFIX:FP:K        the value: exactly the bytes of a disk payload file
 *                      (store/payload.c, version 2: 512-byte header with
 *                      magic, version, fingerprint, key, token count, KV
 *                      layout and dtype, body size, XXH3-128 checksum,
 *                      policy, creation time, document id; then token ids,
 *                      then body), followed, when the tier has a secret, by
 *                      a 32-byte tag: HMAC-SHA-256 under the secret of every
 *                      byte before it
 *   PREFIX:FP:K:meta   the commit marker, written after the value:
 *                      "V N_TOKENS N_BYTES CHECKSUM_HEX CREATED_UNIX", V = 1
 *                      for a value without a tag, 2 for one with a tag
 *                      (N_BYTES counts the tag)
 *   PREFIX:FP:K:lock   the fleet-wide compute lock (SET NX PX), value a
 *                      random token of its holder
 *
 * Trust. XXH3 checksums find accidents, not forgeries: without a secret
 * anyone who can write to Redis can change what every replica answers, so
 * Redis must then be trusted (rk_redis_open logs that once). With a secret,
 * a reader accepts only version-2 values whose tag verifies (compared in
 * constant time); any other value (forged, written without the secret or
 * under another one) is deleted, counted in auth_failures and reported as a
 * miss. A reader without a secret accepts both versions (the tag unchecked).
 *
 * A reader fetches, in one round trip, the marker, the value's length and at
 * most the bytes a value of the expected size can have (GETRANGE), so a value
 * planted too large is never downloaded. It trusts a value only when its
 * marker exists and agrees with it; then it checks the tag (with a secret),
 * the size, header, fingerprint, key, token ids, checksum and the body check
 * (finite KV). A value that fails any check is deleted (value and marker),
 * counted in dropped_corrupt (and in size_refused when it was refused by
 * its size unread) and reported as a miss, so the caller computes the chunk.
 * A value without a marker is a miss and left alone (its write may be in
 * progress); one for another layout is a miss and kept.
 *
 * Failure is never an outage: every call is bounded by the configured timeout
 * (connect and command), and after breaker_failures consecutive failures the
 * circuit breaker opens: reads and locks return at once (a miss, lock
 * "unavailable") until a back-off has passed (doubling on each failed probe,
 * capped), then the next call probes Redis again. Writes are not dropped
 * while it is open: they wait in the writer's queue (within its bounds), and
 * the writer thread, while writes wait, probes Redis with a PING past the
 * back-off, at once and then every breaker_backoff_ms; the first PING
 * answered closes the breaker for every call, and the writer writes what
 * waited, in order. A write is tried at most three times. A call whose connection
 * fails other than by a timeout (the server restarted and closed it) is
 * retried once on a new connection before it counts. Errors are counted; a log
 * line is written when the breaker opens and when it closes, not per call.
 * Writing to a closed socket raises SIGPIPE: the process must ignore it (the
 * HTTP server does).
 *
 * Threads. An rk_redis handle holds three hiredis connections, which are not
 * thread-safe:
 *   - the engine connection, used by rk_redis_get, rk_redis_poll,
 *     rk_redis_wait_for, rk_redis_try_lock, rk_redis_unlock,
 *     rk_redis_lookup with RK_REDIS_CONN_ENGINE, and by
 *     rk_redis_put/rk_redis_put_value to release the lock passed with a write
 *     they drop: call these from ONE thread (the engine thread), never
 *     concurrently;
 *   - the writer connection, owned by the writer thread that rk_redis_open
 *     starts; a put only enqueues the value for it;
 *   - the loader connection, used by rk_redis_lookup with
 *     RK_REDIS_CONN_LOADER from one other thread (the pipeline's loader).
 * rk_redis_put and rk_redis_put_value without a lock, rk_redis_value_new and
 * _free, rk_redis_stats, rk_redis_worth_fetching, rk_redis_wait_idle are
 * safe from any thread. rk_redis_list and rk_redis_flush open a connection of their own
 * for the call and are safe from any thread (an admin endpoint may call them
 * directly). rk_redis_open and rk_redis_close: the owner, once.
 *
 * Wiring at a chunk miss (after the arena and the disk store missed), with
 * KEY the chunk key in hex (rk_chunk_key_hex) and LAYOUT the record
 * rk_persist_write stores (the running model and arena, the entry's base
 * position; or NULL, then compare p.layout as rk_persist_load does):
 *
 *   if (rk_redis_worth_fetching(r, n_tokens, rk_redis_value_bytes(n_tokens,
 *                               kv_bytes), prefill_tokens_per_s) &&
 *       rk_redis_get(r, KEY, tokens, n_tokens, &LAYOUT, kv_bytes, &p) == RK_OK)
 *       -> upload p.body into the entry's blocks as rk_persist_load does,
 *          source "redis" (and write it to the disk store if there is one)
 *   else switch (rk_redis_try_lock(r, KEY, &lk, &state), state):
 *     ACQUIRED:    compute; then rk_redis_put(r, &args, &lk) with the same
 *                  rk_store_put_args the disk store gets (the writer releases
 *                  lk after the marker); if computing fails, rk_redis_unlock.
 *                  Without a copy: rk_redis_value_new, download the KV into
 *                  its body, rk_store_put with that body, rk_redis_put_value
 *     HELD:        park the request; rk_redis_poll once per scheduler step:
 *                  READY -> upload as above; GONE -> compute (without a
 *                  lock); give up and compute after about lock_ttl_ms
 *     UNAVAILABLE: compute, then rk_redis_put(r, &args, NULL)
 *
 * A chunk computed while Redis was unavailable is still offered with
 * rk_redis_put: it waits in the queue and is written when Redis answers. */
#ifndef RK_REDIS_H
#define RK_REDIS_H

#include <stddef.h>
#include <stdint.h>

#include "config/config.h"
#include "store/store.h"

#define RK_REDIS_HOST_MAX   255
#define RK_REDIS_USER_MAX   127
#define RK_REDIS_PASS_MAX   255
#define RK_REDIS_PREFIX_MAX 64
#define RK_REDIS_TAG_BYTES  32   /* HMAC-SHA-256 tag after an authenticated value */
#define RK_REDIS_SECRET_MIN 16   /* bytes of a secret, at least */
#define RK_REDIS_SECRET_MAX 1024 /* and at most */

typedef struct rk_redis rk_redis; /* opaque */

/* A parsed redis://[user:password@]host:port[/db] URL. An empty user with a
 * password (redis://:pw@h:p) authenticates as the default user. */
typedef struct rk_redis_url {
    char host[RK_REDIS_HOST_MAX + 1];
    int port; /* 1..65535 */
    int db;   /* 0 when no /db */
    char user[RK_REDIS_USER_MAX + 1];
    char password[RK_REDIS_PASS_MAX + 1];
    int has_password;
} rk_redis_url;

typedef struct rk_redis_config {
    const char *url;            /* redis://[user:password@]host:port[/db]; required */
    const char *prefix;         /* key prefix, [A-Za-z0-9_.-]{1,64}; default "ragkv" */
    int timeout_ms;             /* connect and per-command timeout; default 200 */
    int min_tokens;             /* chunks shorter than this are neither fetched nor
                                   written; default 32 */
    int queue_max;              /* writes waiting for the writer thread; default 256 */
    size_t queue_max_bytes;     /* and their bytes (one larger write still goes alone);
                                   default 256 MiB */
    int lock_ttl_ms;            /* a compute lock expires after this; default 30000 */
    int ttl_s;                  /* expiry of payload and marker; 0 = none (default;
                                   let Redis's maxmemory policy evict) */
    int breaker_failures;       /* consecutive failures that open the breaker; default 3 */
    int breaker_backoff_ms;     /* first back-off; default 500 */
    int breaker_backoff_max_ms; /* back-off cap; default 30000 */
    const void *secret;         /* key of the values' HMAC-SHA-256 (copied by rk_redis_open),
                                   RK_REDIS_SECRET_MIN..MAX bytes; NULL (default) = none:
                                   values are unauthenticated and Redis is trusted */
    size_t secret_len;
    rk_store_body_check body_check; /* run on every loaded body (finite KV); NULL = none */
} rk_redis_config;

/* Breaker states, as rk_redis_counters.breaker reports them. */
typedef enum rk_redis_breaker {
    RK_REDIS_CLOSED = 0, /* calls go to Redis */
    RK_REDIS_OPEN = 1,   /* calls are skipped until the back-off ends */
} rk_redis_breaker;

/* Counters since open; a consistent snapshot from rk_redis_stats. */
typedef struct rk_redis_counters {
    uint64_t hits, misses;        /* rk_redis_get/poll outcomes (a skipped call is a miss) */
    uint64_t errors;              /* failed Redis calls (connect, I/O, timeout, error reply) */
    uint64_t skipped;             /* calls not made because the breaker was open */
    uint64_t dropped_corrupt;     /* payloads deleted: bad size, header, checksum, model,
                                     key, token ids or body check */
    uint64_t size_refused;        /* of those, refused by their length without being read */
    uint64_t auth_failures;       /* values deleted because their tag did not verify (or they
                                     had none) while the tier has a secret */
    uint64_t layout_mismatch;     /* good payloads for another KV layout (kept; a miss) */
    uint64_t writes;              /* payloads committed (payload and marker written) */
    uint64_t write_drops;         /* puts dropped: queue full, write failed three times, or
                                     Redis away at close (not those under min_tokens) */
    uint64_t queued;              /* puts waiting for the writer now */
    uint64_t queued_bytes;        /* their bytes */
    uint64_t bytes_in, bytes_out; /* payload bytes loaded / written */
    uint64_t get_count;           /* Redis round trips of gets (hit or not) */
    double get_seconds;           /* their total time: mean = get_seconds / get_count */
    uint64_t put_count;           /* committed writes timed */
    double put_seconds;           /* their total time */
    uint64_t locks_acquired, locks_busy;
    double load_bytes_per_s; /* moving average of load throughput; 0 = none yet */
    int breaker;             /* rk_redis_breaker */
    uint64_t breaker_opened; /* times the breaker opened */
} rk_redis_counters;

/* Outcome of rk_redis_try_lock. */
typedef enum rk_redis_lock_state {
    RK_REDIS_LOCK_ACQUIRED = 0,    /* we compute; release with rk_redis_put or rk_redis_unlock */
    RK_REDIS_LOCK_HELD = 1,        /* another replica computes: poll or wait for the value */
    RK_REDIS_LOCK_UNAVAILABLE = 2, /* Redis not reachable (or breaker open): compute locally */
} rk_redis_lock_state;

/* A lock we hold: the chunk key and the random token stored as its value. */
typedef struct rk_redis_lock {
    char key[RK_STORE_KEY_LEN + 1];
    char token[RK_STORE_KEY_LEN + 1];
} rk_redis_lock;

/* Outcome of rk_redis_poll. */
typedef enum rk_redis_poll_state {
    RK_REDIS_READY = 0,   /* the payload was loaded into *out */
    RK_REDIS_PENDING = 1, /* no payload yet and the lock is still held: poll again later */
    RK_REDIS_GONE = 2,    /* no payload and no lock (holder failed or gave up), or Redis
                             unavailable: compute it */
} rk_redis_poll_state;

/* One entry of rk_redis_list, from its commit marker. */
typedef struct rk_redis_entry {
    char key[RK_STORE_KEY_LEN + 1];
    int32_t n_tokens;
    uint64_t n_bytes; /* payload value size */
    double created;   /* unix seconds */
} rk_redis_entry;

/* Fill cfg with the defaults above (url NULL). */
void rk_redis_config_default(rk_redis_config *cfg);

/* Parse url strictly into *out: scheme redis://, optional user:password@
 * (both may be percent-free text without '@', ':' in the user or '/'), a
 * host name or IPv4 address, a port (required), an optional /db (0..65535).
 * RK_ERR_INVALID with a message naming the bad part (never the password). */
rk_status rk_redis_url_parse(const char *url, rk_redis_url *out);

/* Read the tier's secret: the file at path (one trailing newline dropped)
 * when path is not empty, else env_value (the RAGKV_REDIS_SECRET variable;
 * may be NULL). *out_len = 0 when neither is set. RK_ERR_IO when the file
 * cannot be read, RK_ERR_INVALID when the secret is shorter than
 * RK_REDIS_SECRET_MIN or longer than RK_REDIS_SECRET_MAX bytes; the messages
 * never include the secret. */
rk_status rk_redis_secret_load(const char *path, const char *env_value,
                               uint8_t out[RK_REDIS_SECRET_MAX], size_t *out_len);

/* Validate cfg, connect the engine connection (AUTH and SELECT when the URL
 * asks), start the writer thread and return the handle in *out (free with
 * rk_redis_close). model_fingerprint is 32 lowercase hex. An unreachable
 * server is not an error (the tier starts with its breaker counting failures
 * and sharing begins when Redis answers); a bad configuration, a rejected
 * password or database is RK_ERR_INVALID with a clear message, so the
 * service can refuse to start. Without a secret it logs one warning that
 * Redis must be trusted. */
rk_status rk_redis_open(const rk_redis_config *cfg, const char *model_fingerprint, rk_redis **out);

/* Stop the writer thread after it has written (or, with Redis unreachable,
 * dropped) what was queued, close both connections and free r. With Redis
 * gone this takes about two timeouts (the write in progress, then one probe
 * that fails and drops the rest at once). Locks held by the caller are not released (they
 * expire). Accepts NULL. */
void rk_redis_close(rk_redis *r);

/* Engine thread. Load chunk key for these token ids into *out (release with
 * rk_store_payload_free; out->meta carries key, model, checksum, n_tokens,
 * n_bytes). layout may be NULL; otherwise a payload computed for another
 * layout (dtype, block size, base position, shape) is a miss and kept, since
 * another kind of replica may use it. body_size is the KV bytes a value for
 * this layout holds: no more than that value's size is ever read, and a value
 * of another size is refused unread. 0 (or no layout): unknown; then the
 * read is bounded only by the commit marker (one more round trip). Returns RK_OK on a hit and
 * RK_ERR_NOT_FOUND on any miss: absent, no commit marker, bad payload
 * (deleted), Redis unreachable or breaker open, fewer than min_tokens tokens.
 * RK_ERR_INVALID for a bad key, RK_ERR_NOMEM. Never waits longer than the
 * timeout (two round trips when a bad payload is deleted). */
rk_status rk_redis_get(rk_redis *r, const char *key, const int32_t *tokens, int32_t n_tokens,
                       const rk_store_layout *layout, uint64_t body_size, rk_store_payload *out);

/* Any thread (see Threads above for a lock). Queue a copy of the chunk for the
 * writer thread and return at once; policy and doc_id go into the header as
 * on disk (a load returns them in out->meta). The writer stores the payload and then
 * its marker. When release is not NULL (a lock from rk_redis_try_lock) the
 * writer releases it after the marker, so replicas waiting on the lock find
 * the value as soon as the lock goes; if the write is dropped, the lock is
 * released at once on this thread (engine connection: then call it from the
 * engine thread). The copy is the only work done here: one memcpy of the KV.
 * Returns RK_OK when queued (also while the breaker is open: the write waits
 * for Redis); RK_ERR_LIMIT when dropped (queue full: counted in write_drops;
 * shorter than min_tokens: not counted), which
 * the caller may ignore; RK_ERR_INVALID, RK_ERR_NOMEM. */
rk_status rk_redis_put(rk_redis *r, const rk_store_put_args *args, const rk_redis_lock *release);

/* A value being built for rk_redis_put_value: the payload buffer with room
 * for the KV, so the caller can write the KV into it and hand it over without
 * a second copy. Opaque. */
typedef struct rk_redis_value rk_redis_value;

/* Any thread. Allocate a value for chunk key (32 lowercase hex) with these
 * token ids (copied), policy (1..RK_STORE_POLICY_MAX printable characters),
 * doc_id (NULL or up to RK_STORE_DOC_ID_MAX bytes) and layout, as
 * rk_store_put_args has them, and body_size bytes of KV that the caller
 * writes at *out_body (may be NULL when body_size is 0) before handing *out to
 * rk_redis_put_value (or freeing it with rk_redis_value_free). *out_body may
 * also serve as the body of an rk_store_put for the disk store, so one buffer
 * feeds both tiers. RK_ERR_INVALID, RK_ERR_NOMEM. */
rk_status rk_redis_value_new(const char *key, const char *policy, const char *doc_id,
                             const rk_store_layout *layout, const int32_t *tokens, int32_t n_tokens,
                             size_t body_size, rk_redis_value **out, void **out_body);

/* Free a value that was not handed to rk_redis_put_value; accepts NULL. */
void rk_redis_value_free(rk_redis_value *v);

/* As rk_redis_put, but takes ownership of v (always, also on failure) instead
 * of copying the chunk: the request path pays no copy at all. */
rk_status rk_redis_put_value(rk_redis *r, rk_redis_value *v, const rk_redis_lock *release);

/* Engine thread. Try to take the fleet-wide lock on computing key
 * (SET PREFIX:FP:K:lock TOKEN NX PX lock_ttl_ms). *out_state says what
 * happened; *out_lock is filled when it is RK_REDIS_LOCK_ACQUIRED. The lock
 * expires by itself if its holder dies. */
rk_status rk_redis_try_lock(rk_redis *r, const char *key, rk_redis_lock *out_lock,
                            rk_redis_lock_state *out_state);

/* Engine thread. Release lk if we still hold it (the token compares equal;
 * one EVAL, atomic), e.g. when the computation failed. Releasing a lock that
 * expired or that another replica now holds does nothing. RK_OK also when
 * Redis is unreachable (the lock then expires by itself). */
rk_status rk_redis_unlock(rk_redis *r, const rk_redis_lock *lk);

/* Engine thread, non-blocking: one attempt to load key (as rk_redis_get) and,
 * when absent, one check of its lock. For a scheduler that parks a request
 * whose chunk another replica computes and polls once per step. */
rk_status rk_redis_poll(rk_redis *r, const char *key, const int32_t *tokens, int32_t n_tokens,
                        const rk_store_layout *layout, uint64_t body_size, rk_store_payload *out,
                        rk_redis_poll_state *out_state);

/* Engine thread, blocking: rk_redis_poll until READY or GONE or bound_ms has
 * passed, sleeping 1 ms doubling to 50 ms between polls. Returns RK_OK with the
 * payload in *out, or RK_ERR_NOT_FOUND (compute it). It blocks the calling
 * thread: for offline jobs and callers that may wait; the scheduler should
 * use rk_redis_poll. */
rk_status rk_redis_wait_for(rk_redis *r, const char *key, const int32_t *tokens, int32_t n_tokens,
                            const rk_store_layout *layout, uint64_t body_size, int bound_ms,
                            rk_store_payload *out);

/* Which connection a lookup uses: the engine thread's, or the loader
 * thread's own (opened on first use; one thread at a time, other than the
 * engine thread). */
typedef enum rk_redis_conn { RK_REDIS_CONN_ENGINE = 0, RK_REDIS_CONN_LOADER = 1 } rk_redis_conn;

/* What the lookup of a chunk miss found. */
typedef enum rk_redis_found {
    RK_REDIS_FOUND_NOTHING = 0, /* compute it, without a lock (Redis down or skipped, the
                                   lock taken by a replica whose value did not come in time) */
    RK_REDIS_FOUND_VALUE = 1,   /* *out holds a verified payload */
    RK_REDIS_FOUND_LOCK = 2,    /* nobody has it: the compute lock is ours (*out_lock), to
                                   pass with the write (rk_redis_put_value) or to unlock */
} rk_redis_found;

/* The whole lookup of a chunk the arena and the disk missed, on the
 * connection conn: get (as rk_redis_get); on a miss, take the compute lock
 * and look once more when it is ours; when another replica holds it, wait up
 * to wait_ms for its value (blocking the calling thread: the engine thread
 * should hand the lookup to the loader). A miss, hit or wait is counted once.
 * RK_ERR_INVALID, RK_ERR_NOMEM; Redis being down is no error. */
rk_status rk_redis_lookup(rk_redis *r, rk_redis_conn conn, const char *key, const int32_t *tokens,
                          int32_t n_tokens, const rk_store_layout *layout, uint64_t body_size,
                          int wait_ms, rk_store_payload *out, rk_redis_lock *out_lock,
                          rk_redis_found *out_found);

/* Bytes of the value for a chunk of n_tokens tokens and kv_bytes KV bytes
 * (header, token ids, KV): what rk_redis_worth_fetching should be given. */
uint64_t rk_redis_value_bytes(int32_t n_tokens, uint64_t kv_bytes);

/* Any thread. The cost gate: 1 when fetching a chunk of n_tokens tokens and
 * n_bytes payload bytes should beat recomputing it at prefill_tokens_per_s,
 * else 0. 0 below min_tokens and while the breaker is open; 1 while no load
 * has been measured yet or when prefill_tokens_per_s <= 0 (unknown). The
 * estimate is n_bytes / (moving average of load bytes/s). */
int rk_redis_worth_fetching(rk_redis *r, int32_t n_tokens, uint64_t n_bytes,
                            double prefill_tokens_per_s);

/* Any thread. Wait up to timeout_ms for the writer queue to empty (and the
 * write in progress to end); *out_idle is 1 when it did. */
rk_status rk_redis_wait_idle(rk_redis *r, int timeout_ms, int *out_idle);

/* Any thread (own connection). List this model's committed entries (SCAN
 * over markers, never KEYS), at most limit (<= 0: all), in SCAN order. *out
 * is malloc'ed (*out_n entries, NULL when 0); the caller frees it.
 * RK_ERR_IO when Redis cannot be reached. */
rk_status rk_redis_list(rk_redis *r, int limit, rk_redis_entry **out, int *out_n);

/* Any thread (own connection). Delete every key of this model (payloads,
 * markers, locks) with SCAN and UNLINK (Redis >= 4); *out_removed (may be
 * NULL) receives the number of payloads removed. Other models' keys
 * are kept. RK_ERR_IO when Redis cannot be reached. */
rk_status rk_redis_flush(rk_redis *r, uint64_t *out_removed);

/* Any thread. Fill *out with a snapshot of the counters. */
void rk_redis_stats(rk_redis *r, rk_redis_counters *out);

/* Any thread. The key prefix (owned by r), for reports. */
const char *rk_redis_prefix(const rk_redis *r);

/* Any thread. Copy the parsed endpoint into *out with the password cleared
 * (has_password still says whether one is used), for reports and logs. */
void rk_redis_endpoint(const rk_redis *r, rk_redis_url *out);

#endif
