/* chunkcache/arena.h — the KV block arena and its tagged pools.
 *
 * All KV of a ragkv process lives in one arena of fixed-size blocks. A block
 * id addresses that block in every layer (see rk_kv_cache in kernels.h). The
 * ids are split into isolated pools by tag, each a contiguous id range with its
 * own LIFO free list and quota:
 *
 *   live   [0, L)           requests in flight
 *   prefix [L, L+P)         the radix tree's sequences (radix.h): system
 *                           prompts and whole request sequences
 *   chunk  [L+P, L+P+C)     the chunk cache (chunk_index.h)
 *
 * so the chunk cache can never take a live block and a burst of requests can
 * never take a cached chunk's block. Ids are global, so one block table can mix
 * pools: a request's table holds the prefix blocks it shares from the radix
 * tree, its own live blocks and, on the zero-copy path, the chunk-pool blocks
 * of the cached chunks it attends in place (reindex.h, rk_runs). Every
 * allocated block carries a reference count (the radix tree, a chunk entry
 * and each sequence sharing the block hold one each); a block returns to its
 * own pool's free list when its count drops to zero. A finished request's
 * live blocks join the prefix pool by rk_arena_retag, without a copy.
 * Allocation is all-or-nothing and reports exhaustion as RK_ERR_EXHAUSTED,
 * never aborts.
 *
 * Thread-safety: none inside. An arena, its sequences and the caches built
 * on it (radix.h, chunk_index.h) are used by one thread at a time; in
 * `ragkv serve` that is the engine thread (pipeline/scheduler.h), and other
 * threads read only the counters it publishes.
 * Ownership: the creator owns the arena and frees it last, after every
 * sequence, radix tree and chunk index holding its blocks has let them go. */
#ifndef RK_ARENA_H
#define RK_ARENA_H

#include <stdint.h>

#include "config/config.h"
#include "kernels/kernels.h"

typedef enum rk_pool_tag {
    RK_POOL_LIVE = 0,
    RK_POOL_PREFIX = 1,
    RK_POOL_CHUNK = 2,
    RK_POOL_COUNT = 3,
} rk_pool_tag;

const char *rk_pool_name(rk_pool_tag pool);

typedef struct rk_arena_params {
    int n_layers, n_kv_heads, head_dim;
    int block_size;                 /* tokens per block: power of two in [8, 64] */
    rk_dtype dtype;                 /* KV storage type */
    int pool_blocks[RK_POOL_COUNT]; /* blocks per pool (live must be >= 1) */
    int poison;                     /* fill freed blocks with NaN */
} rk_arena_params;

typedef struct rk_arena rk_arena; /* opaque */

/* Bytes one block takes across all layers (K and V). */
size_t rk_arena_block_bytes(const rk_arena_params *p);

/* Split a memory budget into pool sizes: share[i] of budget_bytes for pool i
 * (shares sum to <= 1). Writes p->pool_blocks. RK_ERR_INVALID when the live
 * pool would get no block. */
rk_status rk_arena_params_from_budget(rk_arena_params *p, size_t budget_bytes,
                                      const float share[RK_POOL_COUNT]);

/* Allocate the KV storage on the backend and build the pools. On failure
 * nothing is left allocated. be must outlive the arena. */
rk_status rk_arena_create(rk_backend *be, const rk_arena_params *p, rk_arena **out);
/* Free the storage and the arena; accepts NULL. */
void rk_arena_free(rk_arena *a);

/* The KV view every kernel takes; valid for the arena's lifetime. */
const rk_kv_cache *rk_arena_kv(const rk_arena *a);
int rk_arena_block_size(const rk_arena *a);

/* Take n blocks from pool, each with reference count 1, ids written to
 * out_ids. All or nothing: on RK_ERR_EXHAUSTED no count or list changed. */
rk_status rk_arena_alloc(rk_arena *a, rk_pool_tag pool, int n, int32_t *out_ids);

/* Add one reference to each block (all must be allocated). */
rk_status rk_arena_ref(rk_arena *a, const int32_t *ids, int n);

/* Drop one reference from each block; a block whose count reaches zero goes
 * back to its pool (poisoned first in poison mode). Releasing a free block or
 * an out-of-range id is reported as RK_ERR_INTERNAL (a double free) and leaves
 * that block untouched. */
rk_status rk_arena_release(rk_arena *a, const int32_t *ids, int n);

/* Blocks in pool, and how many of them are free now. */
int rk_arena_pool_total(const rk_arena *a, rk_pool_tag pool);
int rk_arena_pool_free(const rk_arena *a, rk_pool_tag pool);
/* Pool of a block id, or -1 when out of range. */
int rk_arena_block_pool(const rk_arena *a, int32_t id);

/* Move allocated blocks (distinct ids) into pool, keeping their contents and
 * references: each one not already there swaps places with a free block of
 * pool, which joins the block's old pool, so no pool changes size. A block
 * freed later returns to its new pool. All or nothing: RK_ERR_EXHAUSTED when
 * pool has fewer free blocks than blocks to move. */
rk_status rk_arena_retag(rk_arena *a, const int32_t *ids, int n, rk_pool_tag pool);
/* Reference count of a block (0 = free), or -1 when out of range. */
int rk_arena_refcount(const rk_arena *a, int32_t id);

/* ---------------------------------------------------------------- sequences */

/* A sequence's view of the arena: its block table and how many KV entries it
 * holds. The blocks it lists are references it owns (one each); blocks is
 * malloc'ed by the rk_seq_* calls. A zeroed rk_seq is an empty sequence. */
typedef struct rk_seq {
    int32_t *blocks; /* (cap) block ids; entry i lives in blocks[i / block_size] */
    int n_blocks;
    int cap;
    int n_tokens; /* KV entries written so far */
} rk_seq;

/* Make room for n_new more tokens: allocate blocks from pool as needed (all or
 * nothing) and write the slots of tokens n_tokens .. n_tokens+n_new-1 into
 * out_slots (may be NULL). Does not advance n_tokens; the caller does after
 * the forward pass succeeded. */
rk_status rk_seq_reserve(rk_seq *s, rk_arena *a, rk_pool_tag pool, int n_new, int32_t *out_slots);

/* Append shared blocks (e.g. a cached prefix) covering n_blocks * block_size
 * tokens: the sequence takes its own reference on each. The sequence must end
 * on a block boundary. */
rk_status rk_seq_share(rk_seq *s, rk_arena *a, const int32_t *ids, int n_blocks);

/* Release every block reference, free the table and zero the sequence; s
 * must not be NULL (a zeroed sequence is fine). */
void rk_seq_release(rk_seq *s, rk_arena *a);

#endif
