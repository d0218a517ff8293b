/* chunkcache/radix.c — see radix.h.
 *
 * Invariants (checked by the tests after every operation):
 *   - every edge is a non-empty whole number of pages; children of a node are
 *     sorted by their first page and no two share it;
 *   - a node's lock count is >= each child's (locks cover whole paths);
 *   - evictable_tokens + protected_tokens == cached_tokens, where a node's
 *     tokens are protected while its lock count is > 0. */
#include "chunkcache/radix.h"

#include <stdlib.h>
#include <string.h>

struct rk_radix_node {
    rk_radix_node *parent; /* NULL for a root */
    rk_radix_node **kids;  /* (n_kids) sorted by first page */
    int n_kids, cap_kids;
    int32_t *tokens; /* (len) edge tokens */
    int32_t *pages;  /* (len / page_size) pages owned by this edge */
    int len;
    int lock;
    int priority;
    uint64_t clock; /* logical time of the last match or insert through it */
    uint64_t hits;
    /* The partial page that followed this edge in an inserted sequence: its
     * first tail_len (1 .. page_size - 1) tokens, held in tail_page. A tail is
     * only ever copied out by a match, never shared, so it needs no lock: it
     * goes with its node, or when a newer tail replaces it. */
    int32_t *tail;
    int tail_len;
    int32_t tail_page;
};

typedef struct radix_root {
    uint64_t ns;
    rk_radix_node *node;
} radix_root;

struct rk_radix {
    rk_radix_params p;
    radix_root *roots;
    int n_roots, cap_roots;
    uint64_t clock;
    rk_radix_stats st;
};

/* ---------------------------------------------------------------- nodes */

static int page_cmp(const rk_radix *r, const int32_t *a, const int32_t *b) {
    for (int i = 0; i < r->p.page_size; i++)
        if (a[i] != b[i]) return a[i] < b[i] ? -1 : 1;
    return 0;
}

/* Index of the child whose first page equals key, or -(insertion point) - 1. */
static int find_kid(const rk_radix *r, const rk_radix_node *n, const int32_t *key) {
    int lo = 0, hi = n->n_kids - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        int c = page_cmp(r, n->kids[mid]->tokens, key);
        if (c == 0) return mid;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return -lo - 1;
}

static rk_status add_kid(rk_radix_node *parent, int at, rk_radix_node *kid) {
    if (parent->n_kids == parent->cap_kids) {
        int cap = parent->cap_kids ? parent->cap_kids * 2 : 2;
        rk_radix_node **k = realloc(parent->kids, (size_t)cap * sizeof *k);
        if (!k) return rk_errorf(RK_ERR_NOMEM, "radix: out of memory");
        parent->kids = k;
        parent->cap_kids = cap;
    }
    memmove(parent->kids + at + 1, parent->kids + at,
            (size_t)(parent->n_kids - at) * sizeof *parent->kids);
    parent->kids[at] = kid;
    parent->n_kids++;
    kid->parent = parent;
    return RK_OK;
}

static void remove_kid(rk_radix_node *parent, rk_radix_node *kid) {
    for (int i = 0; i < parent->n_kids; i++)
        if (parent->kids[i] == kid) {
            memmove(parent->kids + i, parent->kids + i + 1,
                    (size_t)(parent->n_kids - i - 1) * sizeof *parent->kids);
            parent->n_kids--;
            return;
        }
}

static void node_free(rk_radix_node *n) {
    if (!n) return;
    free(n->tail);
    free(n->kids);
    free(n->tokens);
    free(n->pages);
    free(n);
}

static rk_radix_node *node_new(const rk_radix *r, const int32_t *tokens, const int32_t *pages,
                               int len) {
    rk_radix_node *n = calloc(1, sizeof *n);
    if (!n) return NULL;
    int n_pages = len / r->p.page_size;
    n->tokens = malloc((size_t)(len ? len : 1) * sizeof *n->tokens);
    n->pages = malloc((size_t)(n_pages ? n_pages : 1) * sizeof *n->pages);
    if (!n->tokens || !n->pages) {
        node_free(n);
        return NULL;
    }
    if (len) memcpy(n->tokens, tokens, (size_t)len * sizeof *tokens);
    if (n_pages) memcpy(n->pages, pages, (size_t)n_pages * sizeof *pages);
    n->len = len;
    return n;
}

/* Split n after k tokens (0 < k < len, page-aligned): a new node takes the
 * first k tokens and their pages and becomes n's parent; it copies n's lock
 * count, priority, clock and hits. Returns the new node, NULL when out of memory. */
static rk_radix_node *split(rk_radix *r, rk_radix_node *n, int k) {
    int pk = k / r->p.page_size, pn = n->len / r->p.page_size;
    rk_radix_node *mid = node_new(r, n->tokens, n->pages, k);
    int32_t *rest_t = malloc((size_t)(n->len - k) * sizeof *rest_t);
    int32_t *rest_p = malloc((size_t)(pn - pk) * sizeof *rest_p);
    rk_radix_node **kids = malloc(2 * sizeof *kids);
    if (!mid || !rest_t || !rest_p || !kids) {
        node_free(mid);
        free(rest_t);
        free(rest_p);
        free(kids);
        return NULL;
    }
    memcpy(rest_t, n->tokens + k, (size_t)(n->len - k) * sizeof *rest_t);
    memcpy(rest_p, n->pages + pk, (size_t)(pn - pk) * sizeof *rest_p);
    free(n->tokens);
    free(n->pages);
    n->tokens = rest_t;
    n->pages = rest_p;
    n->len -= k;
    mid->lock = n->lock;
    mid->priority = n->priority;
    mid->clock = n->clock;
    mid->hits = n->hits;
    /* mid takes n's place under the parent: same first page, same slot. */
    rk_radix_node *parent = n->parent;
    for (int i = 0; i < parent->n_kids; i++)
        if (parent->kids[i] == n) parent->kids[i] = mid;
    mid->parent = parent;
    mid->kids = kids;
    mid->cap_kids = 2;
    mid->kids[0] = n;
    mid->n_kids = 1;
    n->parent = mid;
    r->st.nodes++;
    return mid;
}

/* Tokens two sequences share, rounded down to whole pages. */
static int common_pages(const rk_radix *r, const int32_t *a, int na, const int32_t *b, int nb) {
    int n = na < nb ? na : nb, i = 0;
    while (i < n && a[i] == b[i]) i++;
    return i / r->p.page_size * r->p.page_size;
}

static rk_radix_node *find_root(const rk_radix *r, uint64_t ns) {
    for (int i = 0; i < r->n_roots; i++)
        if (r->roots[i].ns == ns) return r->roots[i].node;
    return NULL;
}

static rk_status get_root(rk_radix *r, uint64_t ns, rk_radix_node **out) {
    if ((*out = find_root(r, ns))) return RK_OK;
    if (r->n_roots == r->cap_roots) {
        int cap = r->cap_roots ? r->cap_roots * 2 : 4;
        radix_root *nr = realloc(r->roots, (size_t)cap * sizeof *nr);
        if (!nr) return rk_errorf(RK_ERR_NOMEM, "radix: out of memory");
        r->roots = nr;
        r->cap_roots = cap;
    }
    rk_radix_node *root = node_new(r, NULL, NULL, 0);
    if (!root) return rk_errorf(RK_ERR_NOMEM, "radix: out of memory");
    r->roots[r->n_roots++] = (radix_root){ns, root};
    *out = root;
    return RK_OK;
}

/* Tokens a node holds: its edge and its tail. */
static uint64_t node_tokens(const rk_radix_node *n) { return (uint64_t)(n->len + n->tail_len); }

static void lock_path(rk_radix *r, rk_radix_node *n) {
    for (; n && n->parent; n = n->parent) {
        if (n->lock++ == 0) {
            r->st.evictable_tokens -= node_tokens(n);
            r->st.protected_tokens += node_tokens(n);
        }
    }
}

/* Give up n's tail page, if any, and its tokens in the counters. */
static void drop_tail(rk_radix *r, rk_radix_node *n) {
    if (!n->tail_len) return;
    r->p.release_pages(r->p.ctx, &n->tail_page, 1);
    r->st.cached_tokens -= (uint64_t)n->tail_len;
    if (n->lock > 0)
        r->st.protected_tokens -= (uint64_t)n->tail_len;
    else
        r->st.evictable_tokens -= (uint64_t)n->tail_len;
    free(n->tail);
    n->tail = NULL;
    n->tail_len = 0;
}

/* ---------------------------------------------------------------- API */

rk_status rk_radix_create(const rk_radix_params *p, rk_radix **out) {
    *out = NULL;
    if (p->page_size < 1 || p->page_size > 4096 || !p->release_pages ||
        (unsigned)p->policy > RK_RADIX_PRIORITY)
        return rk_errorf(RK_ERR_INVALID, "radix: bad parameters (page size %d)", p->page_size);
    rk_radix *r = calloc(1, sizeof *r);
    if (!r) return rk_errorf(RK_ERR_NOMEM, "radix: out of memory");
    r->p = *p;
    *out = r;
    return RK_OK;
}

static void free_subtree(rk_radix *r, rk_radix_node *n) {
    for (int i = 0; i < n->n_kids; i++) free_subtree(r, n->kids[i]);
    if (n->len) r->p.release_pages(r->p.ctx, n->pages, n->len / r->p.page_size);
    if (n->tail_len) r->p.release_pages(r->p.ctx, &n->tail_page, 1);
    node_free(n);
}

void rk_radix_free(rk_radix *r) {
    if (!r) return;
    for (int i = 0; i < r->n_roots; i++) free_subtree(r, r->roots[i].node);
    free(r->roots);
    free(r);
}

/* Tokens a and b (of na and nb) share at their start. */
static int common_tokens(const int32_t *a, int na, const int32_t *b, int nb) {
    int n = na < nb ? na : nb, i = 0;
    while (i < n && a[i] == b[i]) i++;
    return i;
}

/* The page after node whose start shares most tokens with tokens(n): the
 * first page of a child edge, or the node's tail. Returns the count (less
 * than a page) and writes the page. */
static int best_partial(const rk_radix *r, rk_radix_node *node, const int32_t *tokens, int n,
                        int32_t *out_page, rk_radix_node **out_owner) {
    int ps = r->p.page_size, best = 0;
    if (n >= ps) n = ps - 1;
    for (int i = 0; i < node->n_kids; i++) {
        int k = common_tokens(node->kids[i]->tokens, ps, tokens, n);
        if (k > best) {
            best = k;
            *out_page = node->kids[i]->pages[0];
            *out_owner = node->kids[i];
        }
    }
    int k = common_tokens(node->tail, node->tail_len, tokens, n);
    if (k > best) {
        best = k;
        *out_page = node->tail_page;
        *out_owner = node;
    }
    return best;
}

rk_status rk_radix_match(rk_radix *r, uint64_t ns, const int32_t *tokens, int n, int flags,
                         int32_t *out_pages, rk_radix_result *out) {
    out->n_matched = 0;
    out->node = NULL;
    out->n_partial = 0;
    out->partial_page = -1;
    if (n < 0) return rk_errorf(RK_ERR_INVALID, "radix: negative length");
    int ps = r->p.page_size;
    int limit = (flags & RK_RADIX_LEAVE_ONE) ? n - 1 : n;
    limit = limit > 0 ? limit / ps * ps : 0;
    uint64_t now = ++r->clock;
    rk_radix_node *node = find_root(r, ns);
    int pos = 0;
    while (node && pos < limit) {
        int i = find_kid(r, node, tokens + pos);
        if (i < 0) break;
        rk_radix_node *kid = node->kids[i];
        int k = common_pages(r, kid->tokens, kid->len, tokens + pos, limit - pos);
        if (k == 0) break;
        if (k < kid->len && !(kid = split(r, kid, k)))
            return rk_errorf(RK_ERR_NOMEM, "radix: out of memory splitting a node");
        memcpy(out_pages + pos / ps, kid->pages, (size_t)(k / ps) * sizeof *out_pages);
        kid->clock = now;
        kid->hits++;
        pos += k;
        node = kid;
    }
    int rest = ((flags & RK_RADIX_LEAVE_ONE) ? n - 1 : n) - pos;
    if ((flags & RK_RADIX_PARTIAL) && node && rest > 0) {
        rk_radix_node *owner = NULL;
        out->n_partial = best_partial(r, node, tokens + pos, rest, &out->partial_page, &owner);
        if (owner) owner->clock = now;
    }
    int reused = pos + out->n_partial;
    if (!(flags & RK_RADIX_UNCOUNTED)) {
        r->st.queries++;
        r->st.tokens_processed += (uint64_t)n;
        r->st.tokens_reused += (uint64_t)reused;
        r->st.tokens_computed += (uint64_t)(n - reused);
        if (reused == 0) r->st.misses++;
        if (reused > 0) r->st.hits++;
    }
    if (pos > 0) {
        lock_path(r, node);
        out->node = node;
    }
    out->n_matched = pos;
    return RK_OK;
}

rk_status rk_radix_unlock(rk_radix *r, rk_radix_node *node) {
    if (!node || !node->parent || node->lock <= 0)
        return rk_errorf(RK_ERR_INVALID, "radix: unlock of a node that is not locked");
    for (rk_radix_node *n = node; n->parent; n = n->parent) {
        if (--n->lock == 0) {
            r->st.protected_tokens -= node_tokens(n);
            r->st.evictable_tokens += node_tokens(n);
        }
    }
    return RK_OK;
}

/* Insert the whole pages of tokens(limit); *out_node gets the node where they
 * end (the root when limit is 0). */
static rk_status insert_pages(rk_radix *r, uint64_t ns, const int32_t *tokens, int limit,
                              const int32_t *pages, int priority, int *out_present,
                              rk_radix_node **out_node) {
    int ps = r->p.page_size;
    rk_radix_node *node;
    rk_status st = get_root(r, ns, &node);
    if (st) return st;
    uint64_t now = ++r->clock;
    int pos = 0;
    while (pos < limit) {
        int i = find_kid(r, node, tokens + pos);
        if (i < 0) {
            rk_radix_node *leaf = node_new(r, tokens + pos, pages + pos / ps, limit - pos);
            if (!leaf || add_kid(node, -i - 1, leaf)) {
                node_free(leaf);
                return rk_errorf(RK_ERR_NOMEM, "radix: out of memory inserting %d tokens", limit);
            }
            leaf->clock = now;
            leaf->priority = priority;
            r->st.nodes++;
            r->st.cached_tokens += (uint64_t)leaf->len;
            r->st.evictable_tokens += (uint64_t)leaf->len;
            *out_present = pos;
            node = leaf;
            pos = limit;
            break;
        }
        rk_radix_node *kid = node->kids[i];
        int k = common_pages(r, kid->tokens, kid->len, tokens + pos, limit - pos);
        if (k < kid->len && !(kid = split(r, kid, k)))
            return rk_errorf(RK_ERR_NOMEM, "radix: out of memory splitting a node");
        kid->clock = now;
        if (priority > kid->priority) kid->priority = priority;
        pos += k;
        node = kid;
        *out_present = pos;
    }
    *out_node = node;
    return RK_OK;
}

rk_status rk_radix_insert(rk_radix *r, uint64_t ns, const int32_t *tokens, int n,
                          const int32_t *pages, int priority, int *out_present,
                          rk_radix_node **out_locked) {
    *out_present = 0;
    if (out_locked) *out_locked = NULL;
    if (n < 0) return rk_errorf(RK_ERR_INVALID, "radix: negative length");
    rk_radix_node *node;
    rk_status st = insert_pages(r, ns, tokens, n / r->p.page_size * r->p.page_size, pages, priority,
                                out_present, &node);
    if (st) return st;
    if (out_locked && node->parent) {
        lock_path(r, node);
        *out_locked = node;
    }
    return RK_OK;
}

rk_status rk_radix_insert_partial(rk_radix *r, uint64_t ns, const int32_t *tokens, int n,
                                  const int32_t *pages, int priority, int *out_present,
                                  rk_radix_node **out_locked) {
    int ps = r->p.page_size, limit = n / ps * ps, tl = n - limit;
    *out_present = 0;
    if (out_locked) *out_locked = NULL;
    if (n < 0) return rk_errorf(RK_ERR_INVALID, "radix: negative length");
    rk_radix_node *node;
    rk_status st = insert_pages(r, ns, tokens, limit, pages, priority, out_present, &node);
    if (st) {
        if (tl) r->p.release_pages(r->p.ctx, pages + limit / ps, 1);
        return st;
    }
    if (tl) {
        /* Keep the tail that covers more: the one held, when the new one is
         * a prefix of it; otherwise the new one replaces it. */
        int32_t *copy = NULL;
        if (common_tokens(node->tail, node->tail_len, tokens + limit, tl) == tl ||
            !(copy = malloc((size_t)tl * sizeof *copy))) {
            r->p.release_pages(r->p.ctx, pages + limit / ps, 1);
        } else {
            drop_tail(r, node);
            memcpy(copy, tokens + limit, (size_t)tl * sizeof *copy);
            node->tail = copy;
            node->tail_len = tl;
            node->tail_page = pages[limit / ps];
            r->st.cached_tokens += (uint64_t)tl;
            if (node->lock > 0)
                r->st.protected_tokens += (uint64_t)tl;
            else
                r->st.evictable_tokens += (uint64_t)tl;
        }
    }
    if (out_locked && node->parent) {
        lock_path(r, node);
        *out_locked = node;
    }
    return RK_OK;
}

/* ---------------------------------------------------------------- eviction */

/* True when a should be evicted before b. */
static int evict_before(const rk_radix *r, const rk_radix_node *a, const rk_radix_node *b) {
    if (r->p.policy == RK_RADIX_LFU && a->hits != b->hits) return a->hits < b->hits;
    if (r->p.policy == RK_RADIX_PRIORITY && a->priority != b->priority)
        return a->priority < b->priority;
    return a->clock < b->clock;
}

static int heap_before(const void *a, const void *b, void *ctx) {
    return evict_before(ctx, *(rk_radix_node *const *)a, *(rk_radix_node *const *)b);
}

/* Push the unlocked leaves under n; -1 when memory runs out. */
static int collect_leaves(const rk_radix *r, rk_radix_node *n, rk_heap *h) {
    if (n->parent && n->n_kids == 0) return n->lock == 0 && rk_heap_push(h, &n) ? -1 : 0;
    for (int i = 0; i < n->n_kids; i++)
        if (collect_leaves(r, n->kids[i], h)) return -1;
    return 0;
}

void rk_radix_evict(rk_radix *r, int n_tokens, int *out_evicted) {
    rk_heap h = {.item_size = sizeof(rk_radix_node *), .before = heap_before, .ctx = r};
    int freed = 0;
    for (int i = 0; i < r->n_roots; i++)
        if (collect_leaves(r, r->roots[i].node, &h)) break; /* out of memory: evict what we have */
    rk_radix_node *leaf;
    while (freed < n_tokens && rk_heap_pop(&h, &leaf)) {
        rk_radix_node *parent = leaf->parent;
        int tail_len = leaf->tail_len;
        drop_tail(r, leaf);
        r->p.release_pages(r->p.ctx, leaf->pages, leaf->len / r->p.page_size);
        freed += leaf->len + tail_len;
        r->st.evictions++;
        r->st.tokens_evicted += (uint64_t)(leaf->len + tail_len);
        r->st.cached_tokens -= (uint64_t)leaf->len;
        r->st.evictable_tokens -= (uint64_t)leaf->len;
        r->st.nodes--;
        remove_kid(parent, leaf);
        node_free(leaf);
        if (parent->parent && parent->n_kids == 0 && parent->lock == 0)
            (void)rk_heap_push(&h, &parent); /* out of memory: evict what we have */
    }
    rk_heap_free(&h);
    /* A tail on a root (a sequence shorter than a page) has no node to go
     * with: it goes last. */
    for (int i = 0; i < r->n_roots && freed < n_tokens; i++) {
        rk_radix_node *root = r->roots[i].node;
        if (!root->tail_len) continue;
        freed += root->tail_len;
        r->st.evictions++;
        r->st.tokens_evicted += (uint64_t)root->tail_len;
        drop_tail(r, root);
    }
    if (out_evicted) *out_evicted = freed;
}

void rk_radix_flush(rk_radix *r) { rk_radix_evict(r, 0x7fffffff, NULL); }

void rk_radix_get_stats(const rk_radix *r, rk_radix_stats *out) { *out = r->st; }

/* ---------------------------------------------------------------- inspection */

typedef struct dump_buf {
    char *buf;
    int cap, len;
} dump_buf;

static void put(dump_buf *d, const char *s) {
    int n = (int)strlen(s);
    if (d->len + n < d->cap) memcpy(d->buf + d->len, s, (size_t)n + 1);
    d->len += n;
}

static void dump_node(const rk_radix_node *n, dump_buf *d) {
    char num[16];
    put(d, "[");
    for (int i = 0; i < n->len; i++) {
        snprintf(num, sizeof num, "%s%d", i ? "," : "", n->tokens[i]);
        put(d, num);
    }
    put(d, "]");
    if (n->n_kids == 0) return;
    put(d, "{");
    for (int i = 0; i < n->n_kids; i++) {
        if (i) put(d, ",");
        dump_node(n->kids[i], d);
    }
    put(d, "}");
}

int rk_radix_dump(const rk_radix *r, uint64_t ns, char *buf, int cap) {
    dump_buf d = {buf, cap, 0};
    if (cap > 0) buf[0] = '\0';
    const rk_radix_node *root = find_root(r, ns);
    for (int i = 0; root && i < root->n_kids; i++) {
        if (i) put(&d, ",");
        dump_node(root->kids[i], &d);
    }
    return d.len;
}

static void shape(const rk_radix_node *n, int depth, int *nodes, int *leaves, int *max_depth) {
    if (n->parent) {
        (*nodes)++;
        if (n->n_kids == 0) (*leaves)++;
        if (depth > *max_depth) *max_depth = depth;
    }
    for (int i = 0; i < n->n_kids; i++) shape(n->kids[i], depth + 1, nodes, leaves, max_depth);
}

void rk_radix_shape(const rk_radix *r, uint64_t ns, int *out_nodes, int *out_leaves,
                    int *out_depth) {
    *out_nodes = *out_leaves = *out_depth = 0;
    const rk_radix_node *root = find_root(r, ns);
    if (root) shape(root, 0, out_nodes, out_leaves, out_depth);
}
