/* pipeline/release.c — stage 8 of a request: when it leaves or is
 * preempted, its whole sequence goes into the radix tree
 * (rk_insert_sequence, keyed by the layout prefix.c built), then everything
 * it holds is released (rk_release_request): chunk references, its radix
 * lock, its blocks and buffers. KV planner, engine thread only. */
#include <stdlib.h>
#include <string.h>

#include "pipeline/internal.h"

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

/* A zero-copy request's sequence on its way into the tree. Its table is
 * not 1:1 with the key (each chunk is a shifted run of the chunk pool's
 * blocks), so the tree gets a copy: the pages it has already are shared, the
 * rest is copied from the runs, rotated to their live positions, into
 * prefix-pool blocks. That copy is what the copy path pays at admission;
 * here it is paid once, after the request has left, and only for what the
 * tree did not have. It holds its own references on the runs' blocks and
 * the match's radix lock, so the request releases everything at once, and
 * the copy may run a slice a step (rk_inserts_step). */
struct rk_insert_job {
    uint64_t ns;
    int32_t *key; /* (n) taken from the request */
    int n;
    rk_seq seq;          /* the matched pages shared, then fresh prefix blocks */
    rk_copy_plan copies; /* from the runs into seq */
    int next;            /* copies run so far */
    rk_radix_node *lock; /* the match's node, locked (NULL: none) */
    int32_t *held;       /* (n_held) references on the runs' blocks */
    int n_held;
};

static void insert_job_free(rk_service *svc, rk_insert_job *j) {
    if (j->lock) rk_radix_unlock(svc->prefix, j->lock);
    rk_seq_release(&j->seq, svc->arena);
    if (j->n_held) rk_arena_release(svc->arena, j->held, j->n_held);
    rk_copy_plan_free(&j->copies);
    free(j->held);
    free(j->key);
    free(j);
}

/* Plan the copy of s's sequence of n tokens (its key and references taken
 * from s's runs); *out NULL when the tree has all of it. */
static rk_status insert_job_plan(rk_service *svc, rk_req_state *s, int n, rk_insert_job **out) {
    int bs = rk_arena_block_size(svc->arena);
    *out = NULL;
    rk_insert_job *j = calloc(1, sizeof *j);
    int32_t *pages = malloc((size_t)(n / bs + 1) * sizeof *pages);
    if (!j || !pages) {
        free(j);
        free(pages);
        return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
    }
    j->ns = s->ns;
    j->n = n;
    rk_radix_result m = {0};
    rk_status st = rk_radix_match(svc->prefix, s->ns, s->key, n, RK_RADIX_UNCOUNTED, pages, &m);
    j->lock = m.node;
    int fresh = n - m.n_matched;
    if (!st && fresh > 0) {
        st = rk_seq_share(&j->seq, svc->arena, pages, m.n_matched / bs);
        if (!st) st = rk_seq_reserve(&j->seq, svc->arena, RK_POOL_PREFIX, fresh, NULL);
        if (st == RK_ERR_EXHAUSTED) {
            rk_radix_evict(svc->prefix, fresh, NULL);
            st = rk_seq_reserve(&j->seq, svc->arena, RK_POOL_PREFIX, fresh, NULL);
        }
        for (int i = 0, start = 0; !st && i < s->runs.n_runs && start < n; i++) {
            int end = s->runs.end[i] < n ? s->runs.end[i] : n;
            int from = start > m.n_matched ? start : m.n_matched;
            if (from < end)
                st = rk_copy_plan_add(&j->copies, bs, s->runs.blocks + s->runs.first[i],
                                      from - start, &j->seq, from, end - from, s->runs.delta[i]);
            start = s->runs.end[i];
        }
        if (!st && !(j->held = malloc((size_t)s->runs.n_blocks * sizeof *j->held)))
            st = rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
        if (!st && !(st = rk_arena_ref(svc->arena, s->runs.blocks, s->runs.n_blocks))) {
            memcpy(j->held, s->runs.blocks, (size_t)s->runs.n_blocks * sizeof *j->held);
            j->n_held = s->runs.n_blocks;
        }
    }
    free(pages);
    if (st || fresh <= 0) {
        insert_job_free(svc, j);
        return st;
    }
    j->key = s->key; /* the request's key goes with the job */
    s->key = NULL;
    *out = j;
    return RK_OK;
}

/* Run at most max (<= 0: all) of j's copies; once all ran, its pages go
 * into the tree. *done: it is over (inserted, or failed: only the caching
 * is lost). */
static void insert_job_run(rk_service *svc, rk_insert_job *j, int max, int *done) {
    int left = j->copies.n - j->next, n = max > 0 && max < left ? max : left;
    rk_copy_plan slice = {.n = n,
                          .src = j->copies.src + j->next,
                          .dst = j->copies.dst + j->next,
                          .delta = j->copies.delta + j->next};
    rk_status st = rk_copy_plan_run(&slice, svc->be, svc->arena, rk_model_ropes(svc->model));
    j->next += n;
    *done = st || j->next == j->copies.n;
    if (!st && *done) {
        rk_req_state view = {.ns = j->ns, .key = j->key};
        st = insert_pages(svc, &view, j->n, j->seq.blocks);
    }
    if (st && st != RK_ERR_EXHAUSTED)
        RK_LOG_WARN("request sequence not cached: %s", rk_error_message());
}

static rk_status grow_inserts(rk_pipeline *p) {
    int cap = p->cap_inserts ? p->cap_inserts * 2 : 4;
    rk_insert_job **q = realloc(p->inserts, (size_t)cap * sizeof *q);
    if (!q) return RK_ERR_NOMEM;
    p->inserts = q;
    p->cap_inserts = cap;
    return RK_OK;
}

/* A zero-copy sequence into the tree now (insert_job_plan, then all its
 * copies), or queued on p (not NULL) to run a slice a step. */
static rk_status insert_runs(rk_service *svc, rk_pipeline *p, rk_req_state *s, int n) {
    rk_insert_job *j;
    rk_status st = insert_job_plan(svc, s, n, &j);
    if (st || !j) return st;
    if (p && (p->n_inserts < p->cap_inserts || !grow_inserts(p))) {
        p->inserts[p->n_inserts++] = j;
        return RK_OK;
    }
    int done;
    insert_job_run(svc, j, 0, &done);
    insert_job_free(svc, j);
    return RK_OK;
}

/* A finished request's whole sequence into the tree: its prompt key and the
 * generated tokens that have KV. Its live blocks move to the prefix pool
 * (evicting for room when needed; when there is none, nothing is inserted),
 * or for a zero-copy table a copy of them (insert_runs). The tree takes a
 * reference on the pages it keeps. Failures only lose the caching. */
void rk_insert_sequence(rk_service *svc, rk_pipeline *p, rk_request *r) {
    rk_req_state *s = r->state;
    int bs = rk_arena_block_size(svc->arena), n = s->n_valid, n_layout = s->q_index + s->n_qtok;
    if (!r->opt.reuse_sequences || !s->key || n < n_layout)
        return; /* n_valid is 0 or covers the prompt */
    memcpy(s->key + n_layout, r->out_tokens + s->n_gen, (size_t)(n - n_layout) * sizeof *s->key);
    rk_status st;
    if (s->zc) {
        st = insert_runs(svc, p, s, n);
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

int rk_inserts_step(rk_pipeline *p, int max) {
    int kept = 0, left = max > 0 ? max : -1; /* -1: no bound */
    for (int i = 0; i < p->n_inserts; i++) {
        rk_insert_job *j = p->inserts[i];
        int done = 0, before = j->next;
        if (left != 0) insert_job_run(p->svc, j, left, &done);
        if (left > 0) left -= j->next - before;
        if (done)
            insert_job_free(p->svc, j);
        else
            p->inserts[kept++] = j;
    }
    p->n_inserts = kept;
    return kept;
}

int rk_pipeline_inserting(const rk_pipeline *p) {
    int n = 0;
    for (int i = 0; i < p->n_inserts; i++) n += p->inserts[i]->copies.n - p->inserts[i]->next;
    return n;
}

void rk_inserts_drop(rk_pipeline *p) {
    for (int i = 0; i < p->n_inserts; i++) insert_job_free(p->svc, p->inserts[i]);
    p->n_inserts = 0;
}

/* Release all r holds; its sequence goes into the tree unless failed (now,
 * or queued on p when not NULL). */
static void release(rk_service *svc, rk_pipeline *p, rk_request *r, int failed) {
    rk_req_state *s = r->state;
    if (!s) return;
    rk_restore_report(r);
    /* A request still waiting for its chunks has no sequence to keep. */
    if (!failed && !s->chunk_wait) rk_insert_sequence(svc, p, r);
    for (int k = 0; s->entries && s->scratch && k < r->n_chunks; k++) {
        scratch *sc = &s->scratch[k];
        if (sc->used) rk_seq_release(&sc->kv, svc->arena);
        if (sc->rlocked) (void)rk_redis_unlock(svc->redis, &sc->rlock); /* never computed */
        rk_runs_free(&sc->ctx_runs);
        free(sc->tokens);
        if (s->entries[k] && sc->uncached) {
            rk_drop_uncached_blocks(svc, s->entries[k]);
            free(s->entries[k]->blocks);
            free(s->entries[k]);
        } else if (s->entries[k]) {
            /* A chunk still PENDING stops with its last holder: removed, its
             * progress lost, or carried on by a request that holds it too. */
            rk_chunk_entry *e = s->entries[k];
            rk_chunk_index_release(svc->chunks, e, failed || e->state == RK_CHUNK_PENDING);
        }
    }
    if (s->lock) rk_radix_unlock(svc->prefix, s->lock);
    rk_drop_partial(svc, s);
    rk_seq_release(&s->kv, svc->arena);
    rk_runs_free(&s->runs);
    rk_seq_release(&s->own, svc->arena);
    rk_seq_release(&s->anchor, svc->arena);
    rk_sampler_free(&s->sampler);
    rk_layout_free(&s->layout);
    free(s->entries);
    free(s->kinds);
    free(s->scratch);
    free(s->qtok);
    free(s->key);
    free(s->repair);
    free(s->dev_before);
    free(s->q_mass);
    free(s);
    r->state = NULL;
}

void rk_release_request(rk_service *svc, rk_request *r, int failed) {
    release(svc, NULL, r, failed);
}

void rk_release_leaving(rk_pipeline *p, rk_request *r) {
    release(p->svc, p, r, r->failure != RK_OK);
}
