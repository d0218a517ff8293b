/* pipeline/reindex_stage.c — stage 4 of a request (driven by pipeline.c),
 * reindex: each request's cached chunks reach its table, either in place
 * (zero-copy: a run table over the chunk entries' own blocks, attended with
 * their shift live offset - base; build_runs) or copied into its live
 * blocks, rotated from their base to their live offset (one copy plan for
 * every request admitted together). Which path a request takes
 * (rk_zero_copy_for) is decided here too. The copy and rotation kernels are
 * reindex/'s. */
#include <string.h>

#include "pipeline/internal.h"

/* Whether the backend's attention reads a sequence through a run table
 * (position-shifted attention): the CPU's. */
int rk_attends_runs(const rk_service *svc) { return strcmp(svc->be->name, "cpu") == 0; }

/* Whether request r reuses its cached chunks in place. Recomputed tokens
 * must be private: `first_k` repair copies the blocks it writes (copy on
 * write, see build_runs), but the deviation policy recomputes layers 0-1 of
 * every chunk token and the query policy chooses its tokens after the
 * reindex, so their requests copy whole chunks (the copy path), as do
 * the oracle and plain modes and every request on a backend without
 * position-shifted attention. So are requests with more than one chunk
 * group: the texts between their groups are computed in their live blocks
 * between the chunks, which a run table of whole blocks does not place. */
int rk_zero_copy_for(const rk_service *svc, const rk_request *r, int tell) {
    static _Atomic int told; /* the fallback is logged once */
    if (r->opt.mode != RK_MODE_RAG || !r->opt.chunk_cache || r->n_chunks == 0 ||
        r->opt.repair_ratio > 0 || r->n_groups > 1 || strcmp(svc->cfg.reindex, "copy") == 0)
        return 0;
    if (!rk_attends_runs(svc)) {
        if (tell && !told++)
            RK_LOG_WARN("zero-copy reindex is not available on the %s backend: chunks are copied",
                        svc->be->name);
        return 0;
    }
    return 1;
}

/* Tokens of a zero-copy request's chunk of n tokens that are copied into
 * private blocks: those of the blocks its `first_k` repair writes. */
int rk_private_tokens(const rk_request *r, int n, int bs) {
    int k = r->opt.repair_k > 0 ? (r->opt.repair_k < n ? r->opt.repair_k : n) : 0;
    int own = (k + bs - 1) / bs * bs;
    return own < n ? own : n;
}

/* Zero-copy reindex of request r: its run table is its system blocks, each
 * chunk entry's blocks as they are (shifted by live offset - base), then its
 * live blocks; the entries it holds keep those blocks until it leaves. The
 * blocks a `first_k` repair will write are copied first (rotated to the live
 * offset, queued on copies) into private live blocks, a run of their own
 * with delta 0: copy on write at block granularity. */
static rk_status build_runs(rk_service *svc, rk_request *r, rk_copy_plan *copies) {
    rk_req_state *s = r->state;
    int bs = rk_arena_block_size(svc->arena), sys_blocks = (r->n_sys + bs - 1) / bs;
    rk_status st = RK_OK;
    r->shared_blocks = 0;
    if (r->n_sys) st = rk_runs_add(&s->runs, bs, s->kv.blocks, r->n_sys, 0);
    for (int k = 0; k < r->n_chunks && !st; k++) {
        const rk_chunk_entry *e = s->entries[k];
        int n = e->n_tokens, m = rk_private_tokens(r, n, bs),
            delta = s->layout.pos[k] - e->base_pos;
        if (m) {
            int first = s->own.n_blocks;
            st = rk_seq_reserve(&s->own, svc->arena, RK_POOL_LIVE, (m + bs - 1) / bs * bs, NULL);
            if (!st) {
                s->own.n_tokens = s->own.n_blocks * bs;
                st = rk_copy_plan_add(copies, bs, e->blocks, 0, &s->own, first * bs, m, delta);
            }
            if (!st) st = rk_runs_add(&s->runs, bs, s->own.blocks + first, m, 0);
        }
        int own = s->scratch[k].uncached; /* the request's live blocks: neither shared nor pooled */
        if (!st && m < n) {
            st = rk_runs_add(&s->runs, bs, e->blocks + m / bs, n - m, delta);
            r->shared_blocks += own ? 0 : e->n_blocks - m / bs;
        }
        r->chunk_reports[k].zero_copy = m < n && !own;
    }
    if (!st)
        st = rk_runs_add(&s->runs, bs, s->kv.blocks + sys_blocks,
                         (s->kv.n_blocks - sys_blocks) * bs, 0);
    return st;
}

/* Stage 4 (reindex): every chunk's KV into its request's live blocks,
 * cached ones rotated from their base to their live offset, in one copy
 * plan; or, for the zero-copy requests, their run tables. */
rk_status rk_stage_reindex(admission *a) {
    rk_service *svc = a->svc;
    int bs = rk_arena_block_size(svc->arena);
    rk_status st;
    double t = rk_time_now();
    int copied_tokens = 0;
    for (int i = 0; i < a->n; i++) {
        rk_request *r = a->reqs[i];
        rk_req_state *s = r->state;
        if (r->opt.mode == RK_MODE_PLAIN) continue;
        if (s->zc) {
            if ((st = build_runs(svc, r, a->copies))) return st;
            for (int k = 0; k < r->n_chunks; k++)
                copied_tokens += rk_private_tokens(r, r->chunk_lens[k], bs);
            continue;
        }
        for (int k = 0; k < r->n_chunks; k++) {
            rk_chunk_entry *e = s->entries[k];
            if (rk_chunk_from_prefix(r, k)) continue;
            if (e) /* cached: rotate from its base to the live offset */
                st = rk_copy_plan_add(a->copies, bs, e->blocks, 0, &s->kv, s->layout.index[k],
                                      e->n_tokens, s->layout.pos[k] - e->base_pos);
            else /* oracle: computed in place already, delta 0 */
                st = rk_copy_plan_add(a->copies, bs, s->scratch[k].kv.blocks,
                                      s->scratch[k].src_first, &s->kv, s->layout.index[k],
                                      r->chunk_lens[k], 0);
            if (st) return st;
            copied_tokens += r->chunk_lens[k];
        }
    }
    if ((st = rk_copy_plan_run(a->copies, svc->be, svc->arena, rk_model_ropes(svc->model))))
        return st;
    /* The scratch sequences' KV is in place now: their live blocks go back
     * before decoding needs them. */
    for (int i = 0; i < a->n; i++)
        for (int k = 0; k < a->reqs[i]->n_chunks; k++) {
            rk_req_state *s = a->reqs[i]->state;
            scratch *sc = &s->scratch[k];
            if (sc->used) rk_seq_release(&sc->kv, svc->arena);
            sc->used = 0;
            if (sc->uncached && !s->zc && a->reqs[i]->opt.mode == RK_MODE_RAG)
                rk_drop_uncached_blocks(svc, s->entries[k]); /* copied: the blocks go back */
        }
    double t_reindex = rk_time_now() - t;
    for (int i = 0; i < a->n; i++) {
        rk_request *r = a->reqs[i];
        r->t.reindex_ms = t_reindex * 1e3;
        for (int k = 0; k < r->n_chunks; k++) {
            int n = r->state->zc ? rk_private_tokens(r, r->chunk_lens[k], bs) : r->chunk_lens[k];
            r->chunk_reports[k].reindex_us =
                copied_tokens ? t_reindex * 1e6 * n / copied_tokens : 0;
        }
    }
    return RK_OK;
}
