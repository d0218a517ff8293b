/* tests/test_radix.c — the system-prompt radix cache: the reference cases of
 * the design documents, locking, eviction policies, and a randomized run
 * against a simple model that checks every answer and every invariant. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "chunkcache/radix.h"

/* Pages released by the tree, and the lock count the test holds on each page. */
#define MAX_PAGES (1 << 21)
static int released[MAX_PAGES];
static int page_locks[MAX_PAGES];
static int n_released;

static void on_release(void *ctx, const int32_t *pages, int n) {
    (void)ctx;
    for (int i = 0; i < n; i++) {
        cr_assert(pages[i] >= 0 && pages[i] < MAX_PAGES);
        cr_assert_eq(page_locks[pages[i]], 0, "page %d released while locked", pages[i]);
        cr_assert_eq(released[pages[i]], 0, "page %d released twice", pages[i]);
        released[pages[i]] = 1;
        n_released++;
    }
}

static rk_radix *make(int page_size, rk_radix_policy policy) {
    memset(released, 0, sizeof released);
    memset(page_locks, 0, sizeof page_locks);
    n_released = 0;
    rk_radix_params p = {.page_size = page_size, .policy = policy, .release_pages = on_release};
    rk_radix *r;
    cr_assert_eq(rk_radix_create(&p, &r), RK_OK);
    return r;
}

static void check_counters(const rk_radix *r) {
    rk_radix_stats s;
    rk_radix_get_stats(r, &s);
    cr_assert_eq(s.evictable_tokens + s.protected_tokens, s.cached_tokens,
                 "evictable %llu + protected %llu != cached %llu",
                 (unsigned long long)s.evictable_tokens, (unsigned long long)s.protected_tokens,
                 (unsigned long long)s.cached_tokens);
}

/* Insert tokens with fresh page ids (page size 1: one page per token). */
static int next_page = 1;
static int insert(rk_radix *r, const int32_t *t, int n) {
    int32_t pages[4096];
    for (int i = 0; i < n; i++) pages[i] = next_page++;
    int present;
    cr_assert_eq(rk_radix_insert(r, 0, t, n, pages, 0, &present, NULL), RK_OK);
    /* The caller releases its duplicates of what was already present. */
    on_release(NULL, pages, present);
    check_counters(r);
    return present;
}

static int match(rk_radix *r, const int32_t *t, int n, int flags, rk_radix_node **node) {
    int32_t pages[4096];
    rk_radix_result m;
    cr_assert_eq(rk_radix_match(r, 0, t, n, flags, pages, &m), RK_OK);
    if (node)
        *node = m.node;
    else if (m.node)
        rk_radix_unlock(r, m.node);
    check_counters(r);
    return m.n_matched;
}

Test(radix, three_sequences_split_into_the_reference_shape) {
    rk_radix *r = make(1, RK_RADIX_LRU);
    int32_t a[] = {1, 2, 3, 4, 5}, b[] = {1, 2, 3, 6, 7}, c[] = {1, 2, 8, 9, 10};
    cr_assert_eq(insert(r, a, 5), 0);
    cr_assert_eq(insert(r, b, 5), 3);
    cr_assert_eq(insert(r, c, 5), 2);
    char buf[256];
    rk_radix_dump(r, 0, buf, sizeof buf);
    cr_assert_str_eq(buf, "[1,2]{[3]{[4,5],[6,7]},[8,9,10]}");
    int nodes, leaves, depth;
    rk_radix_shape(r, 0, &nodes, &leaves, &depth);
    cr_assert_eq(nodes, 5);
    cr_assert_eq(leaves, 3);
    cr_assert_eq(depth, 3);
    rk_radix_stats s;
    rk_radix_get_stats(r, &s);
    cr_assert_eq(s.cached_tokens, 10);
    cr_assert_eq(s.nodes, 5);
    rk_radix_free(r);
}

Test(radix, second_turn_matches_the_first_and_computes_the_rest) {
    rk_radix *r = make(1, RK_RADIX_LRU);
    int32_t t[42];
    for (int i = 0; i < 42; i++) t[i] = 1000 + i;
    insert(r, t, 31);
    rk_radix_node *node;
    int m = match(r, t, 42, RK_RADIX_LEAVE_ONE, &node);
    cr_assert_eq(m, 31);
    cr_assert_eq(42 - m, 11);
    cr_assert_eq(rk_radix_unlock(r, node), RK_OK);
    rk_radix_free(r);
}

Test(radix, an_uncounted_match_locks_like_a_query_but_leaves_the_stats) {
    rk_radix *r = make(1, RK_RADIX_LRU);
    int32_t t[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    insert(r, t, 8);
    rk_radix_node *node;
    cr_assert_eq(match(r, t, 8, RK_RADIX_UNCOUNTED, &node), 8);
    rk_radix_stats s;
    rk_radix_get_stats(r, &s);
    cr_assert_eq(s.queries, 0);
    cr_assert_eq(s.hits + s.misses + s.tokens_processed, 0);
    cr_assert_eq(s.protected_tokens, 8, "the path is locked all the same");
    cr_assert_eq(rk_radix_unlock(r, node), RK_OK);
    cr_assert_eq(match(r, t, 8, 0, NULL), 8);
    rk_radix_get_stats(r, &s);
    cr_assert_eq(s.queries, 1);
    cr_assert_eq(s.hits, 1);
    rk_radix_free(r);
}

Test(radix, hit_rate_and_reuse_of_the_8_14_14_example) {
    rk_radix *r = make(1, RK_RADIX_LRU);
    int32_t q1[] = {1, 2, 3, 4, 5, 10, 11, 12};
    int32_t q2[] = {1, 2, 3, 4, 5, 10, 11, 12, 20, 21, 22, 30, 31, 32};
    cr_assert_eq(match(r, q1, 8, 0, NULL), 0);
    insert(r, q1, 8);
    cr_assert_eq(match(r, q2, 14, 0, NULL), 8);
    insert(r, q2, 14);
    cr_assert_eq(match(r, q2, 14, 0, NULL), 14);
    rk_radix_stats s;
    rk_radix_get_stats(r, &s);
    cr_assert_eq(s.queries, 3);
    cr_assert_eq(s.hits, 2);
    cr_assert_eq(s.misses, 1);
    cr_assert_eq(s.tokens_processed, 36);
    cr_assert_eq(s.tokens_reused, 22);
    cr_assert_eq(s.tokens_computed, 14);
    rk_radix_free(r);
}

Test(radix, exact_repeat_with_page_16_matches_the_aligned_prefix) {
    rk_radix *r = make(16, RK_RADIX_LRU);
    static int32_t t[1124], pages[1124 / 16], got[1124 / 16];
    for (int i = 0; i < 1124; i++) t[i] = i * 7 % 1000;
    for (int i = 0; i < 1124 / 16; i++) pages[i] = 500 + i;
    int present;
    cr_assert_eq(rk_radix_insert(r, 0, t, 1124, pages, 0, &present, NULL), RK_OK);
    cr_assert_eq(present, 0);
    rk_radix_result m;
    cr_assert_eq(rk_radix_match(r, 0, t, 1124, RK_RADIX_LEAVE_ONE, got, &m), RK_OK);
    cr_assert_eq(m.n_matched, 1120);
    cr_assert_eq(memcmp(got, pages, sizeof(int32_t) * 70), 0);
    rk_radix_unlock(r, m.node);
    /* A query that is exactly 70 pages leaves one token, so one page is recomputed. */
    cr_assert_eq(rk_radix_match(r, 0, t, 1120, RK_RADIX_LEAVE_ONE, got, &m), RK_OK);
    cr_assert_eq(m.n_matched, 1104);
    rk_radix_unlock(r, m.node);
    rk_radix_free(r);
}

Test(radix, cached_tokens_count_a_shared_prefix_once) {
    rk_radix *r = make(1, RK_RADIX_LRU);
    int32_t t[108];
    for (int i = 0; i < 108; i++) t[i] = 151644 + i % 5 + i;
    insert(r, t, 69);
    cr_assert_eq(insert(r, t, 108), 69);
    rk_radix_stats s;
    rk_radix_get_stats(r, &s);
    cr_assert_eq(s.cached_tokens, 108);
    rk_radix_free(r);
}

Test(radix, a_locked_sequence_survives_eviction_at_capacity) {
    rk_radix *r = make(1, RK_RADIX_LRU);
    int32_t a[15], b[15];
    for (int i = 0; i < 15; i++) a[i] = i + 1, b[i] = 100 + i;
    insert(r, a, 15);
    insert(r, b, 15); /* capacity 30 reached */
    rk_radix_node *locked;
    cr_assert_eq(match(r, a, 15, 0, &locked), 15);
    int evicted;
    rk_radix_evict(r, 30, &evicted);
    cr_assert_eq(evicted, 15, "only the unlocked sequence can go");
    cr_assert_eq(match(r, b, 15, 0, NULL), 0);
    cr_assert_eq(rk_radix_unlock(r, locked), RK_OK);
    cr_assert_eq(match(r, a, 15, 0, NULL), 15);
    rk_radix_evict(r, 30, &evicted);
    cr_assert_eq(evicted, 15);
    rk_radix_stats s;
    rk_radix_get_stats(r, &s);
    cr_assert_eq(s.cached_tokens, 0);
    cr_assert_eq(s.nodes, 0);
    rk_radix_free(r);
}

Test(radix, unlocking_an_unlocked_node_is_an_error) {
    rk_radix *r = make(1, RK_RADIX_LRU);
    int32_t a[] = {1, 2, 3};
    insert(r, a, 3);
    rk_radix_node *node;
    match(r, a, 3, 0, &node);
    cr_assert_eq(rk_radix_unlock(r, node), RK_OK);
    cr_assert_eq(rk_radix_unlock(r, node), RK_ERR_INVALID);
    check_counters(r);
    rk_radix_free(r);
}

Test(radix, a_split_copies_the_lock_count) {
    rk_radix *r = make(1, RK_RADIX_LRU);
    int32_t a[] = {1, 2, 3, 4}, b[] = {1, 2, 9};
    insert(r, a, 4);
    rk_radix_node *node;
    match(r, a, 4, 0, &node); /* locks [1,2,3,4] */
    insert(r, b, 3);          /* splits it into [1,2] + [3,4] while locked */
    int evicted;
    rk_radix_evict(r, 100, &evicted);
    cr_assert_eq(evicted, 1, "only [9] is unlocked");
    cr_assert_eq(rk_radix_unlock(r, node), RK_OK);
    rk_radix_evict(r, 100, &evicted);
    cr_assert_eq(evicted, 4);
    rk_radix_free(r);
}

Test(radix, namespaces_never_share) {
    rk_radix *r = make(1, RK_RADIX_LRU);
    int32_t a[] = {1, 2, 3, 4};
    int32_t pages[4] = {1, 2, 3, 4}, got[4];
    int present;
    cr_assert_eq(rk_radix_insert(r, 111, a, 4, pages, 0, &present, NULL), RK_OK);
    rk_radix_result m;
    cr_assert_eq(rk_radix_match(r, 222, a, 4, 0, got, &m), RK_OK);
    cr_assert_eq(m.n_matched, 0);
    cr_assert_eq(rk_radix_match(r, 111, a, 4, 0, got, &m), RK_OK);
    cr_assert_eq(m.n_matched, 4);
    rk_radix_unlock(r, m.node);
    rk_radix_free(r);
    cr_assert_eq(n_released, 4, "freeing the tree releases every page");
}

Test(radix, lfu_and_priority_policies_choose_their_victims) {
    int32_t a[] = {1, 2}, b[] = {5, 6};
    rk_radix *r = make(1, RK_RADIX_LFU);
    insert(r, a, 2);
    insert(r, b, 2);
    match(r, a, 2, 0, NULL); /* a is used more, but b more recently */
    match(r, a, 2, 0, NULL);
    match(r, b, 2, 0, NULL);
    int evicted;
    rk_radix_evict(r, 1, &evicted);
    cr_assert_eq(match(r, a, 2, 0, NULL), 2, "LFU keeps the frequently used");
    cr_assert_eq(match(r, b, 2, 0, NULL), 0);
    rk_radix_free(r);

    r = make(1, RK_RADIX_PRIORITY);
    int32_t pages[2] = {1, 2}, pages2[2] = {3, 4};
    int present;
    rk_radix_insert(r, 0, a, 2, pages, 5, &present, NULL);
    rk_radix_insert(r, 0, b, 2, pages2, 1, &present, NULL);
    match(r, b, 2, 0, NULL);
    rk_radix_evict(r, 1, &evicted);
    cr_assert_eq(match(r, a, 2, 0, NULL), 2, "higher priority stays");
    rk_radix_free(r);
}

/* ---------------------------------------------------------------- randomized */

/* The model: a hash map from every cached page-aligned prefix to its page id.
 * A prefix is cached iff the model holds it alive; the tree must match exactly
 * the longest cached prefix and return the model's pages. With 4 token values
 * a prefix of up to 24 tokens packs into 48 bits, plus its length above. */
#define PS       2
#define VOCAB    4
#define MAXLEN   24
#define MAP_SIZE (1 << 20)
typedef struct model_entry {
    uint64_t code; /* 0 = empty slot */
    int32_t page;
    int alive;
} model_entry;
static model_entry *model;
static uint64_t *page_code; /* (MAX_PAGES) code of the prefix a page holds */

static uint64_t prefix_code(const int32_t *t, int len) {
    uint64_t c = (uint64_t)len << 50;
    for (int i = 0; i < len; i++) c |= (uint64_t)t[i] << (2 * i);
    return c;
}

static model_entry *model_slot(uint64_t code) {
    uint64_t h = (code * 0x9E3779B97F4A7C15ull) >> 44;
    while (model[h].code && model[h].code != code) h = (h + 1) & (MAP_SIZE - 1);
    return &model[h];
}

static int model_page(const int32_t *t, int len) {
    model_entry *e = model_slot(prefix_code(t, len));
    return e->code && e->alive ? e->page : -1;
}

static int n_alive;

static void model_on_release(void *ctx, const int32_t *pages, int n) {
    on_release(ctx, pages, n);
    for (int j = 0; j < n; j++) {
        model_entry *e = model_slot(page_code[pages[j]]);
        cr_assert(e->code && e->alive && e->page == pages[j], "released page %d is not cached",
                  pages[j]);
        e->alive = 0;
        n_alive--;
    }
}

Test(radix, randomized_operations_agree_with_the_model, .timeout = 300) {
    memset(released, 0, sizeof released);
    memset(page_locks, 0, sizeof page_locks);
    model = calloc(MAP_SIZE, sizeof *model);
    page_code = calloc(MAX_PAGES, sizeof *page_code);
    n_alive = 0;
    rk_radix_params p = {
        .page_size = PS, .policy = RK_RADIX_LRU, .release_pages = model_on_release};
    rk_radix *r;
    cr_assert_eq(rk_radix_create(&p, &r), RK_OK);
    typedef struct held {
        rk_radix_node *node;
        int32_t pages[MAXLEN / PS];
        int n_pages;
    } held;
    held locks[64];
    int n_locks = 0, page_id = 1;
    srand(12345);
    for (int op = 0; op < 100000; op++) {
        int32_t t[MAXLEN];
        int len = rand() % (MAXLEN + 1);
        for (int i = 0; i < len; i++) t[i] = rand() % VOCAB;
        int kind = rand() % 10;
        if (kind < 4) { /* match */
            int32_t pages[MAXLEN / PS];
            int flags = rand() % 2 ? RK_RADIX_LEAVE_ONE : 0;
            rk_radix_result m;
            cr_assert_eq(rk_radix_match(r, 0, t, len, flags, pages, &m), RK_OK);
            int limit = (flags ? len - 1 : len);
            limit = limit > 0 ? limit / PS * PS : 0;
            int expect = 0;
            while (expect + PS <= limit && model_page(t, expect + PS) >= 0) expect += PS;
            cr_assert_eq(m.n_matched, expect, "op %d: matched %d, model says %d", op, m.n_matched,
                         expect);
            for (int k = 0; k < expect / PS; k++)
                cr_assert_eq(pages[k], model_page(t, (k + 1) * PS));
            if (m.node && n_locks < 64 && rand() % 2) {
                locks[n_locks].node = m.node;
                locks[n_locks].n_pages = expect / PS;
                memcpy(locks[n_locks].pages, pages, sizeof(int32_t) * (expect / PS));
                for (int k = 0; k < expect / PS; k++) page_locks[pages[k]]++;
                n_locks++;
            } else if (m.node) {
                cr_assert_eq(rk_radix_unlock(r, m.node), RK_OK);
            }
        } else if (kind < 7) { /* insert */
            int32_t pages[MAXLEN / PS];
            for (int k = 0; k < len / PS; k++) pages[k] = page_id++;
            cr_assert(page_id < MAX_PAGES);
            int present;
            cr_assert_eq(rk_radix_insert(r, 0, t, len, pages, 0, &present, NULL), RK_OK);
            int expect = 0;
            while (expect + PS <= len && model_page(t, expect + PS) >= 0) expect += PS;
            cr_assert_eq(present, expect, "op %d: present %d, model %d", op, present, expect);
            for (int k = 0; k < present / PS; k++) released[pages[k]] = 1; /* caller's duplicates */
            for (int k = present / PS; k < len / PS; k++) {
                uint64_t code = prefix_code(t, (k + 1) * PS);
                model_entry *e = model_slot(code);
                cr_assert(!(e->code && e->alive), "the tree took a page for a cached prefix");
                *e = (model_entry){code, pages[k], 1};
                page_code[pages[k]] = code;
                n_alive++;
            }
        } else if (kind < 9) { /* unlock one */
            if (n_locks) {
                int i = rand() % n_locks;
                for (int k = 0; k < locks[i].n_pages; k++) page_locks[locks[i].pages[k]]--;
                cr_assert_eq(rk_radix_unlock(r, locks[i].node), RK_OK);
                locks[i] = locks[--n_locks];
            }
        } else { /* evict */
            rk_radix_evict(r, rand() % 16, NULL);
        }
        check_counters(r);
        rk_radix_stats s;
        rk_radix_get_stats(r, &s);
        cr_assert_eq(s.cached_tokens, (uint64_t)n_alive * PS, "op %d", op);
    }
    rk_radix_stats fin;
    rk_radix_get_stats(r, &fin);
    cr_assert_gt(fin.hits, 10000, "the run must exercise hits");
    cr_assert_gt(fin.evictions, 1000, "the run must exercise eviction");
    for (int i = 0; i < n_locks; i++) {
        for (int k = 0; k < locks[i].n_pages; k++) page_locks[locks[i].pages[k]]--;
        cr_assert_eq(rk_radix_unlock(r, locks[i].node), RK_OK);
    }
    rk_radix_free(r);
    cr_assert_eq(n_alive, 0, "freeing the tree releases every cached page");
    free(model);
    free(page_code);
}

/* ---------------------------------------------------------------- partial pages */

/* Insert with a partial last page: pages are fresh ids, the last one partial. */
static void insert_partial(rk_radix *r, const int32_t *t, int n, int32_t *out_pages) {
    int32_t pages[64];
    int n_pages = (n + 3) / 4, present;
    for (int i = 0; i < n_pages; i++) pages[i] = next_page++;
    cr_assert_eq(rk_radix_insert_partial(r, 0, t, n, pages, 0, &present, NULL), RK_OK);
    on_release(NULL, pages, present / 4);
    if (out_pages) memcpy(out_pages, pages, (size_t)n_pages * sizeof *pages);
    check_counters(r);
}

static rk_radix_result match_partial(rk_radix *r, const int32_t *t, int n, int flags) {
    int32_t pages[64];
    rk_radix_result m;
    cr_assert_eq(rk_radix_match(r, 0, t, n, flags | RK_RADIX_PARTIAL, pages, &m), RK_OK);
    if (m.node) rk_radix_unlock(r, m.node);
    check_counters(r);
    return m;
}

Test(radix, a_sequence_shorter_than_a_page_is_matched_from_its_tail) {
    rk_radix *r = make(4, RK_RADIX_LRU);
    int32_t sys[] = {1, 2, 3}, q[] = {1, 2, 3, 9, 9}, pages[1];
    insert_partial(r, sys, 3, pages);
    rk_radix_result m = match_partial(r, q, 5, RK_RADIX_LEAVE_ONE);
    cr_assert_eq(m.n_matched, 0);
    cr_assert_null(m.node, "nothing whole is shared, so nothing is locked");
    cr_assert_eq(m.n_partial, 3);
    cr_assert_eq(m.partial_page, pages[0]);
    /* The exact repeat leaves its last token to compute. */
    m = match_partial(r, sys, 3, RK_RADIX_LEAVE_ONE);
    cr_assert_eq(m.n_partial, 2);
    /* Without the flag the match stays page-aligned. */
    cr_assert_eq(match(r, q, 5, 0, NULL), 0);
    rk_radix_stats s;
    rk_radix_get_stats(r, &s);
    cr_assert_eq(s.cached_tokens, 3);
    rk_radix_flush(r);
    cr_assert(released[pages[0]], "a flush releases a tail held by the root");
    rk_radix_get_stats(r, &s);
    cr_assert_eq(s.cached_tokens, 0);
    rk_radix_free(r);
}

Test(radix, a_query_that_parts_inside_a_page_copies_that_page_up_to_the_difference) {
    rk_radix *r = make(4, RK_RADIX_LRU);
    int32_t a[] = {1, 2, 3, 4, 5, 6, 7, 8}, pages[2];
    insert_partial(r, a, 8, pages);
    int32_t q[] = {1, 2, 3, 4, 5, 6, 0, 0};
    rk_radix_result m = match_partial(r, q, 8, 0);
    cr_assert_eq(m.n_matched, 4);
    cr_assert_eq(m.n_partial, 2, "the child's first page shares 5, 6");
    cr_assert_eq(m.partial_page, pages[1]);
    rk_radix_free(r);
}

Test(radix, the_longer_tail_is_kept_and_the_replaced_one_released) {
    rk_radix *r = make(4, RK_RADIX_LRU);
    int32_t t1[] = {1, 2, 3, 4, 5, 6}, t2[] = {1, 2, 3, 4, 5}, t3[] = {1, 2, 3, 4, 5, 7, 8};
    int32_t p1[2], p2[2], p3[2];
    insert_partial(r, t1, 6, p1);
    insert_partial(r, t2, 5, p2);
    cr_assert(released[p2[1]], "a tail that is a prefix of the held one is released");
    cr_assert(!released[p1[1]]);
    insert_partial(r, t3, 7, p3);
    cr_assert(released[p1[1]], "a tail that differs replaces the held one");
    rk_radix_result m = match_partial(r, t3, 7, 0);
    cr_assert_eq(m.n_matched, 4);
    cr_assert_eq(m.n_partial, 3);
    cr_assert_eq(m.partial_page, p3[1]);
    rk_radix_stats s;
    rk_radix_get_stats(r, &s);
    cr_assert_eq(s.cached_tokens, 7);
    /* Eviction takes the leaf with its tail. */
    int freed;
    rk_radix_evict(r, 1, &freed);
    cr_assert_eq(freed, 7);
    cr_assert(released[p3[0]] && released[p3[1]]);
    rk_radix_get_stats(r, &s);
    cr_assert_eq(s.cached_tokens, 0);
    rk_radix_free(r);
}

Test(radix, a_tail_on_a_locked_node_is_protected_and_counted) {
    rk_radix *r = make(4, RK_RADIX_LRU);
    int32_t t[] = {1, 2, 3, 4, 5, 6};
    int32_t pages[4096];
    insert_partial(r, t, 4, NULL);
    rk_radix_result m;
    cr_assert_eq(rk_radix_match(r, 0, t, 6, 0, pages, &m), RK_OK);
    cr_assert_eq(m.n_matched, 4);
    page_locks[pages[0]]++;
    insert_partial(r, t, 6, NULL); /* the locked node gets a tail */
    rk_radix_stats s;
    rk_radix_get_stats(r, &s);
    cr_assert_eq(s.protected_tokens, 6);
    rk_radix_evict(r, 100, NULL);
    rk_radix_get_stats(r, &s);
    cr_assert_eq(s.cached_tokens, 6, "nothing locked is evicted");
    page_locks[pages[0]]--;
    cr_assert_eq(rk_radix_unlock(r, m.node), RK_OK);
    check_counters(r);
    rk_radix_free(r);
}
