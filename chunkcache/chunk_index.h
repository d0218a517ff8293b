/* chunkcache/chunk_index.h — the position-independent chunk cache.
 *
 * Each document chunk's KV is computed once, at base positions (0 for the
 * `isolated` context, 1 after the BOS anchor for `anchor`, the system length
 * for `system`), into blocks of the arena's chunk pool, and kept under a
 * content key: XXH3-128 over the model fingerprint, the chunk policy
 * (context, KV dtype, RoPE parameters, the hash of the context tokens for
 * the `system` and `anchor` contexts, the cache salt when the request has
 * one) and the token ids. An entry stores its token ids and a hit verifies
 * them. In-flight requests hold references; only unreferenced entries are
 * evicted (LRU by a logical clock). Single flight: a key being computed is
 * PENDING, and later lookups of it share the one computation instead of
 * starting another (they may carry it on: see progress). A PENDING entry
 * that loses its last reference is removed when its holder says its
 * computation stopped (release with failed), so nothing half-computed
 * stays.
 *
 * Cached entries are never modified once READY. A request uses an entry's
 * KV where it is: on the zero-copy path (the default) its block table is a
 * run table (reindex.h, rk_runs) that lists the entry's blocks as they are,
 * and attention rotates their keys by the run's delta (live offset - base)
 * as it reads them; the entry's reference keeps the blocks until the
 * request leaves. Only the copy path (--reindex copy, the deviation and
 * query repair policies, the oracle, a backend without position-shifted
 * attention) and the blocks a `first_k` repair writes copy (and rotate) the
 * KV into the request's own live blocks (reindex.h, rk_copy_plan).
 *
 * Thread-safety: none inside; one thread at a time (the engine thread in
 * `ragkv serve`). An entry pointer stays valid while its holder keeps a
 * reference, or until the next call that may evict when it holds none.
 * Ownership: the index owns its entries, their token copies and their
 * chunk-pool blocks; the arena must outlive the index. */
#ifndef RK_CHUNK_INDEX_H
#define RK_CHUNK_INDEX_H

#include <stdint.h>

#include "chunkcache/arena.h"
#include "config/config.h"

typedef struct rk_chunk_key {
    uint64_t hi, lo;
} rk_chunk_key;

/* 32 lowercase hex digits + NUL. */
void rk_chunk_key_hex(rk_chunk_key k, char out[33]);
/* Parse 32 hex digits; RK_ERR_INVALID otherwise. */
rk_status rk_chunk_key_parse(const char *hex, rk_chunk_key *out);

/* Everything besides the tokens that changes a chunk's KV. */
typedef struct rk_chunk_policy {
    const char *fingerprint; /* model fingerprint (32 hex) */
    /* 0 = isolated, 1 = computed after the system prompt, 2 = after the
     * anchor (rk_chunk_context's values) */
    int context_system;
    rk_chunk_key system_key; /* hash of the context tokens (system or anchor); used when
                                context_system */
    rk_dtype kv_dtype;
    float rope_theta, rope_factor;
    int rope_n_rot, rope_pairing, rope_scaling;
    /* The cache salt's hash ({0, 0} = no salt: the key is the one an unsalted
     * policy has always had). Chunks under different salts never share a key. */
    rk_chunk_key salt;
} rk_chunk_policy;

rk_chunk_key rk_chunk_key_compute(const rk_chunk_policy *p, const int32_t *tokens, int n_tokens);
/* Hash of a token sequence alone (the system prompt's identity). */
rk_chunk_key rk_tokens_hash(const int32_t *tokens, int n_tokens);

typedef enum rk_chunk_state {
    RK_CHUNK_PENDING = 0, /* reserved, KV being computed */
    RK_CHUNK_READY = 1,
} rk_chunk_state;

typedef struct rk_chunk_entry {
    rk_chunk_key key;
    int32_t *tokens; /* (n_tokens) */
    int n_tokens;
    int32_t *blocks; /* (n_blocks) chunk-pool blocks holding its KV at base positions */
    int n_blocks;
    int base_pos;
    rk_chunk_state state;
    /* PENDING: tokens of its KV written so far, from its first. A chunk may
     * be computed a slice per forward pass, by whichever holder of a
     * reference drives it next; it is READY only once progress reaches
     * n_tokens, and nothing reads a PENDING entry's KV. */
    int progress;
    /* PENDING: a tier load is filling it (the caller's flag, which the index
     * never reads): nobody feeds it meanwhile. */
    int loading;
    int refs;          /* references held by requests (and by tier loads) */
    uint64_t last_use; /* logical clock */
    uint64_t hits;
    double created;  /* unix time */
    char source[12]; /* where its KV came from: "computed", "disk", "redis", "uncached" */
    /* The caller's tag for who the entry belongs to (0 = nobody in
     * particular); the index keeps it and never reads it. */
    int owner;
    /* private: hash chain and LRU links */
    struct rk_chunk_entry *next_in_bucket, *lru_prev, *lru_next;
} rk_chunk_entry;

typedef struct rk_chunk_stats {
    uint64_t lookups, hits, misses; /* a lookup of a PENDING key counts as a miss */
    uint64_t computes;              /* entries computed (reserved and not loaded) */
    uint64_t disk_loads;            /* reserved entries filled from the disk or Redis tier */
    uint64_t hit_tokens, computed_tokens;
    uint64_t evictions, evicted_tokens;
    uint64_t entries, tokens, blocks; /* current */
} rk_chunk_stats;

typedef struct rk_chunk_index rk_chunk_index; /* opaque */

/* An empty index of at most max_entries entries over arena's chunk pool. The
 * caller owns *out. */
rk_status rk_chunk_index_create(rk_arena *arena, int max_entries, rk_chunk_index **out);
/* Free every entry (referenced ones too: the caller has stopped) and its
 * blocks; accepts NULL. */
void rk_chunk_index_free(rk_chunk_index *ix);

typedef enum rk_chunk_lookup {
    RK_CHUNK_HIT = 0,    /* ready: use it */
    RK_CHUNK_MISS = 1,   /* reserved for this caller: compute it, then rk_chunk_index_ready */
    RK_CHUNK_SHARED = 2, /* pending for another caller: use it once that one is ready */
} rk_chunk_lookup;

/* Find key, or reserve a PENDING entry with blocks for n_tokens tokens
 * (evicting unreferenced LRU entries when the chunk pool needs room). Either
 * way the caller holds one reference. RK_ERR_EXHAUSTED when the pool cannot
 * hold the chunk even after eviction; RK_ERR_LIMIT when max_entries entries are
 * all referenced; RK_ERR_INTERNAL on a key collision (tokens differ). */
rk_status rk_chunk_index_acquire(rk_chunk_index *ix, rk_chunk_key key, const int32_t *tokens,
                                 int n_tokens, int base_pos, rk_chunk_entry **out_entry,
                                 rk_chunk_lookup *out_kind);

/* The reserved entry's KV is written: mark it READY (progress n_tokens). */
void rk_chunk_index_ready(rk_chunk_index *ix, rk_chunk_entry *e);

/* The reserved entry was filled from the disk tier instead of computed: mark
 * it READY and count its lookup as a hit (source "disk") rather than a miss.
 * The pipeline also calls it for the Redis tier, then sets source "redis". */
void rk_chunk_index_loaded(rk_chunk_index *ix, rk_chunk_entry *e);

/* Take one more reference on e (a tier load in flight holds one). */
void rk_chunk_index_hold(rk_chunk_entry *e);

/* Drop the caller's reference. A PENDING entry whose computation failed is
 * released with failed = 1: it is removed once unreferenced. */
void rk_chunk_index_release(rk_chunk_index *ix, rk_chunk_entry *e, int failed);

/* Ready entry by key, or NULL (no reference taken). */
rk_chunk_entry *rk_chunk_index_find(rk_chunk_index *ix, rk_chunk_key key);

/* Remove an entry now: RK_ERR_BUSY while referenced, RK_ERR_NOT_FOUND if absent. */
rk_status rk_chunk_index_remove(rk_chunk_index *ix, rk_chunk_key key);

/* Evict unreferenced entries until at least n_blocks chunk-pool blocks are
 * free (or nothing evictable is left); returns the number of entries evicted. */
int rk_chunk_index_evict(rk_chunk_index *ix, int n_blocks);

/* Remove every unreferenced entry; returns how many. */
int rk_chunk_index_flush(rk_chunk_index *ix);

/* Counters since creation and the current sizes. */
void rk_chunk_index_get_stats(const rk_chunk_index *ix, rk_chunk_stats *out);

/* Visit ready entries from most to least recently used; stop when fn returns
 * nonzero. fn must not change the index. */
void rk_chunk_index_foreach(rk_chunk_index *ix, int (*fn)(void *ctx, const rk_chunk_entry *e),
                            void *ctx);

#endif
