/* pipeline/pipeline.c — the driver of a request's stages (see pipeline.h),
 * numbered as in docs/architecture.md ("The request path"), each stage a
 * call into the file named after it. Requests admitted together go through
 * stages 1-6 in rk_admit_stages, their forward work in up to three prefill
 * passes; they leave in rk_leave:
 *   1 prepare (request.c): the request is tokenized on the HTTP worker
 *             (rk_request_prepare); here it gets its state (rk_init_request);
 *   2 system prompt (prefix.c): the radix match of the request's key and
 *             the blocks reserved for the rest (rk_start_request);
 *   3 chunks (chunks.c): lookup (rk_plan_chunks), then
 *     pass 1 (rk_stage_system_and_chunks, here): every system-prompt tail
 *             the prefix cache did not have that an unstepped `system`
 *             chunk, a scoring pass or an unstepped repair attends to (the
 *             others wait for the question pass); every missing chunk, at
 *             its base positions straight into its entry's chunk-pool
 *             blocks: alone (`isolated`), or after its context through a run
 *             table [context, entry] (`system`: the request's system pages;
 *             `anchor`: its anchor block, whose token is in this pass too;
 *             feed_in_context). With rk_pipeline_join and a step budget these
 *             are "stepped" instead: the steps' passes compute them a slice
 *             at a time (rk_feed_chunks), and the request's stages from pass
 *             2 on run once they are whole. The oracle's chunks (cache off)
 *             go in a scratch sequence after their context, and so do the
 *             context misses on a backend whose attention cannot read runs;
 *     pass 2 (rk_stage_system_chunks): on such a backend, missing chunks of
 *             the `system` context, in a scratch sequence that shares the
 *             request's system KV; the scratch-computed chunks are copied
 *             into their entries;
 *   4 reindex (reindex_stage.c, rk_stage_reindex): zero-copy (the default,
 *             where the backend can): the request's table is assembled from
 *             runs, the cached chunks' own blocks among them, each attended
 *             with its shift live offset - base; copy: one rope_shift_copy
 *             moves every chunk's KV into the request's live blocks (cached
 *             ones rotated by that shift);
 *   5 repair (repair.c, rk_stage_repair): chunk tokens recomputed over the
 *             merged cache (optional): a ratio policy's scoring pass, then
 *             the chosen runs in one pass (with rk_pipeline_join and a step
 *             budget the steps' passes run the deviation pass a slice at a
 *             time and feed the runs, after the system tail);
 *   6 question (question.c, rk_queue_prompt): the rest of each prompt
 *             (deferred system tail, question), fed with logits for the last
 *             token: each request's first token. The question pass is the
 *             first of the steps' passes (rk_run_pass);
 *   7 decode (decode.c): each step's pass (rk_run_pass, run by the
 *             scheduler in step.c) samples every running request's next
 *             token; its report is completed when it leaves
 *             (rk_finish_report);
 *   8 release (release.c, rk_release_request): its sequence into the radix
 *             tree, then everything it holds is given back.
 * batch.c builds and runs the passes (internal.h lists the files). */
#include <stdlib.h>

#include "pipeline/internal.h"
#include "pipeline/persist.h"

/* The stages of an admission (1-6, docs/architecture.md) up to the
 * question pass itself (defer: up to the chunks the steps' passes compute,
 * for the requests that wait for them); on failure every one of reqs has
 * released what it took. */
rk_status rk_admit_stages(rk_pipeline *p, rk_request *const *reqs, int n_reqs, int defer,
                          int *n_fresh) {
    rk_status st = RK_OK;
    if (p->n_running + n_reqs > p->cap) {
        int cap = (p->n_running + n_reqs) * 2;
        rk_request **run = realloc(p->running, (size_t)cap * sizeof *run);
        if (run) p->running = run;
        rk_request **work = realloc(p->work, (size_t)cap * 2 * sizeof *work);
        if (work) p->work = work;
        if (!run || !work) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
        p->cap = cap;
    }
    *n_fresh = 0;
    for (int i = 0; i < n_reqs; i++) {
        reqs[i]->state = NULL;
        if (!reqs[i]->resume) reqs[i]->rank = p->n_admitted + (*n_fresh)++;
    }
    for (int i = 0; i < n_reqs && !st; i++) {
        st = rk_init_request(p->svc, reqs[i]);
        if (reqs[i]->state) reqs[i]->state->hook_index = reqs[i]->rank;
    }
    admission a = {.svc = p->svc,
                   .reqs = reqs,
                   .n = n_reqs,
                   .b = &p->b,
                   .copies = &p->copies,
                   .defer = defer,
                   .feed = &p->feed};
    if (!st) st = rk_stage_system_and_chunks(&a);
    p->feed.n = 0;
    /* The requests that wait for chunks go on in the steps (chunks_done). */
    rk_request *go[n_reqs > 0 ? n_reqs : 1];
    int n_go = 0;
    for (int i = 0; !st && i < n_reqs; i++)
        if (!reqs[i]->state->chunk_wait) go[n_go++] = reqs[i];
    a.reqs = go;
    a.n = n_go;
    if (!st && n_go) st = rk_stages_after_chunks(&a);
    if (st) {
        for (int i = 0; i < n_reqs; i++) rk_release_request(p->svc, reqs[i], 1);
        rk_copy_plan_free(&p->copies);
    }
    return st;
}

/* Whether something before the question pass attends to r's system KV: a
 * `system`-context chunk computed after it (fed through its run table, or
 * in pass 2), a ratio policy's
 * scoring pass, or a repair run (or a text between chunk groups) at
 * admission (stepped ones are fed after the system tail in the steps). */
static int needs_system_first(const admission *a, const rk_request *r) {
    if (r->opt.mode != RK_MODE_RAG || r->opt.prompt_logprobs) return 0;
    for (int k = 0; k < r->n_chunks; k++) {
        const scratch *sc = &r->state->scratch[k];
        /* A stepped one: the steps feed the system tail before it (rk_feed_chunks). */
        if (sc->pass2 ||
            (sc->ctx_runs.n_runs && !sc->stepped && r->opt.chunk_context == RK_CONTEXT_SYSTEM))
            return 1;
    }
    if (r->opt.repair_ratio > 0) return 1;
    /* The texts between chunk groups run with the repair's runs. */
    return (r->opt.repair_k > 0 || r->n_groups > 1) && !rk_repair_stepped(a, r);
}

/* Stages 2 (system prompt) and 3 (chunks), first part: match each
 * request's key in the radix tree and reserve its blocks, look its chunks
 * up, then pass 1: the system tails the tree did not have (those something
 * before the question pass attends to), the isolated chunk misses (unless
 * the admission defers them to the steps), the anchored misses and the
 * oracle chunks. The new system pages go into the tree. */
rk_status rk_stage_system_and_chunks(admission *a) {
    int bs = rk_arena_block_size(a->svc->arena);
    rk_status st;
    double t = rk_time_now();
    rk_batch_reset(a->b);
    for (int i = 0; i < a->n; i++) {
        rk_request *r = a->reqs[i];
        rk_req_state *s = r->state;
        if ((st = rk_start_request(a->svc, r))) return st;
        if (s->n_partial && (st = rk_copy_plan_add(a->copies, bs, &s->partial_src, 0, &s->kv,
                                                   s->reused - s->n_partial, s->n_partial, 0)))
            return st;
    }
    rk_persist_begin_lookups(a->svc);
    for (int i = 0; i < a->n; i++)
        if (a->reqs[i]->opt.mode == RK_MODE_RAG && (st = rk_plan_chunks(a, a->reqs[i]))) return st;
    /* A system tail nothing before the question pass attends to goes into
     * that pass, with the question. */
    for (int i = 0; i < a->n; i++) {
        rk_request *r = a->reqs[i];
        rk_req_state *s = r->state;
        s->sys_next = r->n_sys;
        if (s->sys_first == r->n_sys) continue;
        if (!needs_system_first(a, r)) {
            s->sys_next = s->sys_first;
            continue;
        }
        if ((st = rk_batch_add(a->b, bs, &s->kv, r->sys + s->sys_first, r->n_sys - s->sys_first,
                               s->sys_first, s->sys_first, 0)))
            return st;
    }
    double t_lookup = rk_time_now() - t;
    t = rk_time_now();
    /* The partial pages' rows first: the tails computed in pass 1 attend to them. */
    if ((st =
             rk_copy_plan_run(a->copies, a->svc->be, a->svc->arena, rk_model_ropes(a->svc->model))))
        return st;
    for (int i = 0; i < a->n; i++) rk_drop_partial(a->svc, a->reqs[i]->state);
    if ((st = rk_batch_run(a->svc, a->b))) return st;
    rk_feed_done(a->feed);
    rk_persist_note_prefill(a->svc, a->b->n_tok, rk_time_now() - t);
    for (int i = 0; i < a->n; i++) {
        rk_req_state *s = a->reqs[i]->state;
        if (s->n_insert && s->sys_next == a->reqs[i]->n_sys &&
            (st = rk_insert_system(a->svc, a->reqs[i])))
            return st;
    }
    double t_compute = rk_time_now() - t;
    for (int i = 0; i < a->n; i++) {
        a->reqs[i]->t.lookup_ms = t_lookup * 1e3;
        a->reqs[i]->t.chunk_compute_ms = t_compute * 1e3;
    }
    return RK_OK;
}

/* The stages after the chunks' first part (docs/architecture.md's
 * numbering: 3 chunks' pass 2, 4 reindex, 5 repair, 6 question set-up) of
 * the requests in a. */
rk_status rk_stages_after_chunks(admission *a) {
    rk_status st = rk_stage_system_chunks(a);
    if (!st) st = rk_stage_reindex(a);
    if (!st) st = rk_stage_repair(a);
    if (!st) rk_queue_prompt(a);
    return st;
}

/* A finished request leaves: its report is completed and all it holds
 * released (a failed one's sequence is not kept; a zero-copy one's copy
 * into the radix tree is queued on p). */
void rk_leave(rk_pipeline *p, rk_request *r) {
    rk_finish_report(r);
    rk_release_leaving(p, r);
    r->finished = 1;
}
