/* chunkcache/radix.h — the exact prefix cache of whole sequences: a radix
 * tree over token ids whose nodes own the KV pages of their edge tokens.
 *
 * What it caches is the caller's business; the pipeline keys it by a
 * request's layout (pipeline/pipeline.c build_key): the system prompt, each
 * chunk as it sits in the merged sequence, the question and then the
 * generated tokens that have KV, with a segment mark (bit 30) on the first
 * token of every chunk and of the question, so the same tokens segmented
 * differently never match. A request matches its whole prompt (or, with
 * reuse_sequences off, its system prompt alone); the system prompt is
 * inserted once it is computed and the whole sequence when the request
 * leaves. Tokens here are int32 keys, not necessarily token ids.
 *
 * Edges are whole pages (page_size tokens; a page is one KV block in the
 * engine, one token in the unit tests), so every shared match is
 * page-aligned. Children are keyed by their first page. Reuse is still
 * token-granular: rk_radix_insert_partial keeps a sequence's partial last page
 * as the tail of the node it follows, and a match with RK_RADIX_PARTIAL also
 * names the page after the match (a child's first page or a tail) that
 * shares the most tokens with the query, for the caller to copy: a partial
 * page is never shared, because the caller writes the rest of it. Each
 * namespace has its own root, so different namespaces never share; the
 * pipeline derives one from everything besides the key that changes a
 * sequence's KV (model, KV type, mode, chunk cache on/off, chunk context,
 * position mode, repair policy) and the tenant or request salt.
 *
 * match() finds the longest cached prefix, splits the node where it ends
 * inside an edge, and locks the path from that node to the root in the same
 * call; the caller later unlocks with the node handle it got, never by tokens.
 * Locked nodes are never evicted. insert() adds only the new suffix and says
 * how much was already present, so the caller releases its duplicate pages.
 * Eviction takes unlocked leaves (with their tails) in policy order and
 * reconsiders the parent; tails on roots go last.
 * Pages leave the tree only through the release callback.
 *
 * Thread-safety: none inside; one thread at a time (the engine thread in
 * `ragkv serve`), which also runs the release callback.
 * Ownership: the tree owns the pages inserted into it until it hands them to
 * release_pages; node handles stay valid while their path is locked. */
#ifndef RK_RADIX_H
#define RK_RADIX_H

#include <stdint.h>
#include <stdio.h>

#include "config/config.h"

typedef enum rk_radix_policy {
    RK_RADIX_LRU = 0,      /* least recently used first (logical clock) */
    RK_RADIX_LFU = 1,      /* fewest hits first, then LRU */
    RK_RADIX_PRIORITY = 2, /* lowest priority first, then LRU */
} rk_radix_policy;

typedef struct rk_radix_params {
    int page_size; /* tokens per page, >= 1 */
    rk_radix_policy policy;
    /* Called when the tree gives up pages (eviction, flush, free). */
    void (*release_pages)(void *ctx, const int32_t *pages, int n_pages);
    void *ctx;
} rk_radix_params;

typedef struct rk_radix rk_radix;           /* opaque */
typedef struct rk_radix_node rk_radix_node; /* opaque handle returned by match/insert */

typedef struct rk_radix_stats {
    uint64_t queries, hits, misses;
    uint64_t tokens_processed, tokens_reused, tokens_computed;
    uint64_t evictions, tokens_evicted;
    uint64_t nodes;         /* excluding roots */
    uint64_t cached_tokens; /* = evictable_tokens + protected_tokens */
    uint64_t evictable_tokens, protected_tokens;
} rk_radix_stats;

/* An empty tree (p is copied). The caller owns *out. */
rk_status rk_radix_create(const rk_radix_params *p, rk_radix **out);
/* Release every page through the callback and free the tree; accepts NULL.
 * Locked node handles are invalid afterwards. */
void rk_radix_free(rk_radix *r);

enum {
    /* Leave at least one token of the query unmatched (its logits must be
     * computed): the match is capped at n - 1 before page alignment. */
    RK_RADIX_LEAVE_ONE = 1,
    /* Also report the page that continues the match for fewer than
     * page_size tokens (n_partial, partial_page). */
    RK_RADIX_PARTIAL = 2,
    /* Not a query of the cache (e.g. what is present before an insert): the
     * stats do not count it. */
    RK_RADIX_UNCOUNTED = 4,
};

typedef struct rk_radix_result {
    int n_matched;       /* tokens, a multiple of page_size */
    rk_radix_node *node; /* locked; pass to rk_radix_unlock. NULL when nothing matched */
    /* With RK_RADIX_PARTIAL: the first n_partial (< page_size) tokens of
     * partial_page continue the match (0 and -1 when none). The page is not
     * locked: copy it, or take an arena reference on it, before anything
     * else can evict (an allocation from its pool, another radix call). */
    int n_partial;
    int32_t partial_page;
} rk_radix_result;

/* Match tokens(n) in namespace ns. Writes the pages of the matched prefix to
 * out_pages (room for n / page_size entries) and locks the path. Counts a
 * query in the stats (a hit when n_matched > 0) unless RK_RADIX_UNCOUNTED. */
rk_status rk_radix_match(rk_radix *r, uint64_t ns, const int32_t *tokens, int n, int flags,
                         int32_t *out_pages, rk_radix_result *out);

/* Unlock the path locked by match or insert. Unlocking a node that is not
 * locked is reported as RK_ERR_INVALID and changes nothing. */
rk_status rk_radix_unlock(rk_radix *r, rk_radix_node *node);

/* Insert the page-aligned prefix of tokens(n) with its pages (n / page_size
 * of them). *out_present receives the tokens already cached: the tree keeps
 * its own pages there, so the caller releases pages[0 .. present/page_size)
 * that differ from the tree's; the tree takes ownership of the rest. When
 * out_locked is not NULL the path to the inserted end is locked and its node
 * returned (NULL when nothing was inserted or matched). */
rk_status rk_radix_insert(rk_radix *r, uint64_t ns, const int32_t *tokens, int n,
                          const int32_t *pages, int priority, int *out_present,
                          rk_radix_node **out_locked);

/* rk_radix_insert, and the partial last page too: n need not be a multiple
 * of page_size, and pages holds n / page_size whole pages then the partial
 * one. The tree owns that page from now on: it keeps it as the tail of the
 * node the whole pages end at, or releases it (when the node already holds
 * a tail of which this one is a prefix, or on error). */
rk_status rk_radix_insert_partial(rk_radix *r, uint64_t ns, const int32_t *tokens, int n,
                                  const int32_t *pages, int priority, int *out_present,
                                  rk_radix_node **out_locked);

/* Evict unlocked leaves until at least n_tokens tokens were freed or nothing
 * evictable is left; *out_evicted (may be NULL) gets the number freed. */
void rk_radix_evict(rk_radix *r, int n_tokens, int *out_evicted);

/* Evict everything that is not locked. */
void rk_radix_flush(rk_radix *r);

/* Counters since creation and the current sizes. */
void rk_radix_get_stats(const rk_radix *r, rk_radix_stats *out);

/* Write the tree of namespace ns as nested text, children in key order, e.g.
 * "[1,2]{[3]{[4,5],[6,7]},[8,9,10]}". Returns bytes needed (like snprintf). */
int rk_radix_dump(const rk_radix *r, uint64_t ns, char *buf, int cap);

/* Shape of namespace ns: nodes (excluding the root), leaves, max depth. */
void rk_radix_shape(const rk_radix *r, uint64_t ns, int *out_nodes, int *out_leaves,
                    int *out_depth);

#endif
