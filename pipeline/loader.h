/* pipeline/loader.h — chunk KV read from the disk and Redis tiers on a
 * thread of its own, so that a slow disk or Redis never stops the engine
 * thread's steps.
 *
 * The engine thread finds a chunk's row (rk_store_locate) or decides that
 * Redis is worth asking, takes a reference on the PENDING entry for the load
 * (rk_chunk_index_hold), marks it loading and submits it. The loader thread
 * reads and checks the payload file (rk_store_read), or runs the Redis
 * lookup (rk_redis_lookup on its own connection: get, the compute lock, the
 * bounded wait for another replica's value), one load at a time in
 * submission order, and starts a read only while the bytes it has read and
 * not yet handed over stay within max_bytes (one load larger than that still
 * runs alone). Each step the engine thread takes the finished loads, places
 * their KV into the entries' blocks and drops the loads' references; a
 * queued load whose entry nobody else holds any more is cancelled before it
 * is read.
 *
 * The writer is the same machinery with RK_LOAD_WRITE jobs: the engine
 * thread begins a disk-tier put (rk_store_put_begin), the writer thread
 * writes the payload file (rk_store_put_write) and the engine thread ends
 * it (commits the row) when it takes the job back; stats count writes.
 *
 * Threads: rk_loader_free and every call below but rk_loader_stats_get from
 * the thread that owns the entries (the engine thread); rk_loader_stats_get
 * from any thread. The loader thread touches only the load itself (never the
 * entry or the store handle) and, for Redis, the tier's loader connection. */
#ifndef RK_LOADER_H
#define RK_LOADER_H

#include <stdint.h>

#include "chunkcache/chunk_index.h"
#include "store/redis.h"
#include "store/store.h"

/* What a job does: a read (the loader) or a disk-tier write (the writer,
 * a second instance, so that a write's fsync never delays a read). */
typedef enum rk_load_tier { RK_LOAD_DISK = 0, RK_LOAD_REDIS = 1, RK_LOAD_WRITE = 2 } rk_load_tier;

typedef struct rk_load {
    rk_chunk_entry *entry; /* what it fills; the load holds one reference (NULL: a write) */
    rk_load_tier tier;
    uint64_t bytes;       /* what it reads or writes, at most (the bound on bytes in flight) */
    rk_store_located loc; /* RK_LOAD_DISK: the row and file */
    /* RK_LOAD_REDIS: rk_redis_lookup's arguments; tokens are the held
     * entry's, never written while it is PENDING. */
    rk_redis *redis;
    char key[RK_STORE_KEY_LEN + 1];
    const int32_t *tokens;
    int n_tokens;
    rk_store_layout layout;
    uint64_t body_size;
    int wait_ms;
    /* RK_LOAD_WRITE: the put under way, run by rk_store_put_write, and what
     * the engine thread hands on once it ends (persist.c): the token and
     * body copies it reads, the Redis value whose body it is (NULL: body is
     * the write's own) and the compute lock that value releases. */
    rk_store_write *write;
    int32_t *write_tokens;
    void *write_body;
    rk_redis_value *value;
    rk_redis_lock release;
    int has_release;
    /* Set by the loader thread once read: */
    rk_store_payload payload;
    rk_status st;
    rk_redis_found found; /* RK_LOAD_REDIS: a value, our compute lock (lock), or nothing */
    rk_redis_lock lock;
    char why[256];  /* the error message when st != RK_OK */
    double seconds; /* the read's wall time */
    struct rk_load *next;
} rk_load;

typedef struct rk_loader_stats {
    uint64_t loads;           /* reads finished (whatever their result) */
    uint64_t failed;          /* of those, reads that gave no usable payload */
    uint64_t cancelled;       /* queued loads dropped before being read */
    uint64_t bytes;           /* payload bytes read */
    double seconds;           /* summed wall time of the reads */
    uint64_t bytes_in_flight; /* being read or read and not yet taken */
    uint64_t bytes_queued;    /* of the loads submitted and not yet started */
    int queued;               /* submitted, not yet started */
} rk_loader_stats;

typedef struct rk_loader rk_loader; /* opaque */

/* Start the loader thread; max_bytes bounds the bytes in flight. */
rk_status rk_loader_create(uint64_t max_bytes, rk_loader **out);

/* Stop the thread once its current read ends, hand every load it still has
 * (queued, or read and not taken) to drop, then free it; accepts NULL. */
void rk_loader_free(rk_loader *l, void (*drop)(void *ctx, rk_load *ld), void *ctx);

/* Queue ld (allocated by the caller, who gets it back from rk_loader_take). */
void rk_loader_submit(rk_loader *l, rk_load *ld);

/* A finished load, oldest first, or NULL when none is. */
rk_load *rk_loader_take(rk_loader *l);

/* Remove the queued loads (not yet started) for which unwanted() says 1, and
 * return them as a list through next (NULL when none). */
rk_load *rk_loader_cancel(rk_loader *l, int (*unwanted)(const rk_load *ld));

/* Loads submitted and not yet taken. */
int rk_loader_pending(rk_loader *l);

/* Block until a load has finished or max_s seconds have passed. */
void rk_loader_wait(rk_loader *l, double max_s);

void rk_loader_stats_get(rk_loader *l, rk_loader_stats *out);

#endif
