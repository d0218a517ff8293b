/* pipeline/sequence.c — a request's KV into the radix tree: its system
 * pages after they are computed (rk_insert_system), and its whole sequence
 * when it leaves or is preempted (rk_insert_sequence), keyed by the layout
 * pipeline.c built (build_key). Engine thread only. */
#include <stdlib.h>
#include <string.h>

#include "pipeline/internal.h"

/* After the radix-bound system pages are computed: insert them, the partial
 * last page as the tail it is (the request goes on writing its later rows,
 * which a match never copies). The tree takes a reference on the pages it
 * keeps; its locked path replaces ours. */
rk_status rk_insert_system(rk_service *svc, rk_request *r) {
    rk_req_state *s = r->state;
    int bs = rk_arena_block_size(svc->arena), present;
    rk_radix_node *node;
    /* The tree owns the partial page from the call on, even when it fails. */
    rk_status st =
        s->n_insert % bs ? rk_arena_ref(svc->arena, &s->kv.blocks[s->n_insert / bs], 1) : RK_OK;
    if (st) return st;
    st = rk_radix_insert_partial(svc->prefix, s->ns, s->key, s->n_insert, s->kv.blocks, 0, &present,
                                 &node);
    if (st) return st;
    st = rk_arena_ref(svc->arena, s->kv.blocks + present / bs,
                      (s->n_insert / bs * bs - present) / bs);
    if (st) return st;
    if (s->lock) rk_radix_unlock(svc->prefix, s->lock);
    s->lock = node;
    s->n_insert = 0;
    return RK_OK;
}

/* Pages blocks[0 .. ceil(n / bs)) of the sequence keyed s->key[0 .. n) into
 * the tree, which takes a reference on the pages it keeps. */
static rk_status insert_pages(rk_service *svc, rk_req_state *s, int n, int32_t *blocks) {
    int bs = rk_arena_block_size(svc->arena), present;
    /* The tree owns the partial page from the call on, even when it fails. */
    rk_status st = n % bs ? rk_arena_ref(svc->arena, &blocks[n / bs], 1) : RK_OK;
    if (!st) st = rk_radix_insert_partial(svc->prefix, s->ns, s->key, n, blocks, 0, &present, NULL);
    if (!st) st = rk_arena_ref(svc->arena, blocks + present / bs, (n / bs * bs - present) / bs);
    return st;
}

/* A zero-copy request's sequence into the tree. Its table is not 1:1 with
 * the key (each chunk is a shifted run of the chunk pool's blocks), so the
 * tree gets a copy: the pages it has already are shared, the rest is copied
 * from the runs, rotated to their live positions, into prefix-pool blocks.
 * That copy is what the copy path pays at admission; here it is paid once,
 * when the request leaves, and only for what the tree did not have. */
static rk_status insert_runs(rk_service *svc, rk_req_state *s, int n) {
    int bs = rk_arena_block_size(svc->arena);
    rk_seq seq = {0};
    rk_copy_plan copies = {0};
    rk_radix_result m = {0};
    int32_t *pages = malloc((size_t)(n / bs + 1) * sizeof *pages);
    rk_status st =
        pages ? rk_radix_match(svc->prefix, s->ns, s->key, n, RK_RADIX_UNCOUNTED, pages, &m)
              : rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
    if (!st && m.n_matched < n) {
        int fresh = n - m.n_matched;
        st = rk_seq_share(&seq, svc->arena, pages, m.n_matched / bs);
        if (!st) st = rk_seq_reserve(&seq, svc->arena, RK_POOL_PREFIX, fresh, NULL);
        if (st == RK_ERR_EXHAUSTED) {
            rk_radix_evict(svc->prefix, fresh, NULL);
            st = rk_seq_reserve(&seq, svc->arena, RK_POOL_PREFIX, fresh, NULL);
        }
        for (int i = 0, start = 0; !st && i < s->runs.n_runs && start < n; i++) {
            int end = s->runs.end[i] < n ? s->runs.end[i] : n;
            int from = start > m.n_matched ? start : m.n_matched;
            if (from < end)
                st = rk_copy_plan_add(&copies, bs, s->runs.blocks + s->runs.first[i], from - start,
                                      &seq, from, end - from, s->runs.delta[i]);
            start = s->runs.end[i];
        }
        if (!st) st = rk_copy_plan_run(&copies, svc->be, svc->arena, rk_model_rope(svc->model));
        if (!st) st = insert_pages(svc, s, n, seq.blocks);
    }
    if (m.node) rk_radix_unlock(svc->prefix, m.node);
    rk_seq_release(&seq, svc->arena);
    rk_copy_plan_free(&copies);
    free(pages);
    return st;
}

/* A finished request's whole sequence into the tree: its prompt key and the
 * generated tokens that have KV. Its live blocks move to the prefix pool
 * (evicting for room when needed; when there is none, nothing is inserted),
 * or for a zero-copy table a copy of them (insert_runs). The tree takes a
 * reference on the pages it keeps. Failures only lose the caching. */
void rk_insert_sequence(rk_service *svc, rk_request *r) {
    rk_req_state *s = r->state;
    int bs = rk_arena_block_size(svc->arena), n = s->n_valid, n_layout = s->q_index + s->n_qtok;
    if (!r->opt.reuse_sequences || !s->key || n < n_layout)
        return; /* n_valid is 0 or covers the prompt */
    memcpy(s->key + n_layout, r->out_tokens + s->n_gen, (size_t)(n - n_layout) * sizeof *s->key);
    rk_status st;
    if (s->zc) {
        st = insert_runs(svc, s, n);
    } else {
        /* A chunk entry's block in the table stays the chunk cache's: the
         * sequence is inserted up to it. */
        for (int i = 0; i < (n + bs - 1) / bs; i++)
            if (rk_arena_block_pool(svc->arena, s->kv.blocks[i]) == RK_POOL_CHUNK) {
                n = i * bs;
                break;
            }
        if (n == 0) return;
        int n_pages = (n + bs - 1) / bs, to_move = 0;
        for (int i = 0; i < n_pages; i++)
            to_move += rk_arena_block_pool(svc->arena, s->kv.blocks[i]) != RK_POOL_PREFIX;
        st = rk_arena_retag(svc->arena, s->kv.blocks, n_pages, RK_POOL_PREFIX);
        if (st == RK_ERR_EXHAUSTED) {
            rk_radix_evict(svc->prefix,
                           (to_move - rk_arena_pool_free(svc->arena, RK_POOL_PREFIX)) * bs, NULL);
            st = rk_arena_retag(svc->arena, s->kv.blocks, n_pages, RK_POOL_PREFIX);
        }
        if (!st) st = insert_pages(svc, s, n, s->kv.blocks);
    }
    if (st == RK_ERR_EXHAUSTED) return; /* the prefix pool is all locked */
    if (st) RK_LOG_WARN("request sequence not cached: %s", rk_error_message());
}
