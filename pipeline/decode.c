/* pipeline/decode.c — stage 7 of a request: the runner's side of a step.
 * One forward pass (rk_run_pass) holds the next token of every decoding
 * request and the prompt work of the prefilling ones (stepped chunks,
 * chunks.c; the rest of the prompt, question.c), within the step budget the
 * scheduler (step.c) gives it; then each request's next token is sampled
 * (take_token) and, when it leaves, its report completed
 * (rk_finish_report). Engine thread only. */
#include <math.h>
#include <stdio.h>

#include "pipeline/internal.h"

/* How many tokens before a constrained request would run out of room to
 * close its output it starts sampling only tokens that keep room. */
#define RK_GRAMMAR_BUDGET_MARGIN 64

/* Sample request r's next token from its logits (or take the forced one) and
 * decide whether it is done. A row with a NaN or infinite logit (KV that is
 * not finite, from a bad payload or an overflow) fails the request instead:
 * sampling it would answer garbage. Only the sampled rows are checked. */
static void take_token(rk_service *svc, rk_request *r, const float *logits,
                       const rk_pipeline_hooks *hooks) {
    rk_req_state *s = r->state;
    int ri = s->hook_index;
    const rk_hparams *hp = rk_model_hparams(svc->model);
    int64_t bad = rk_dtype_first_nonfinite(RK_DTYPE_F32, logits, (size_t)hp->n_vocab);
    if (bad >= 0) {
        r->failure = RK_ERR_INTERNAL;
        snprintf(r->failure_msg, sizeof r->failure_msg,
                 "the model produced a non-finite logit (token id %lld is %s) at output token "
                 "%d: the KV it attended to is not finite (a corrupt cached chunk or an overflow)",
                 (long long)bad, isnan(logits[bad]) ? "NaN" : "infinite", r->n_out);
        RK_LOG_ERROR("request failed: %s", r->failure_msg);
        svc->nonfinite_logits++;
        s->done = 1;
        return;
    }
    if (hooks && hooks->on_logits) hooks->on_logits(hooks->ctx, ri, r->n_out, logits, hp->n_vocab);
    int32_t t = hooks && hooks->force_token ? hooks->force_token(hooks->ctx, ri, r->n_out) : -1;
    if (r->grammar_state) {
        /* Constrained: draw from the tokens the grammar allows, then move
         * its state on by the one drawn (a forced token must be allowed too). */
        const uint64_t *mask = NULL;
        rk_status st = RK_OK;
        if (t < 0 || t >= hp->n_vocab) {
            /* Near max_tokens, only tokens after which what is left still
             * fits the tokens left: the output closes rather than being cut
             * (where it can no longer fit, the plain mask, and it is cut). */
            int left = r->opt.max_tokens - r->n_out - 1, n_ok = 0;
            /* min_bytes may be INT32_MAX (a grammar whose shortest output
             * is longer than that): the margin is taken from left, never
             * added to it. */
            if (rk_grammar_state_min_bytes(r->grammar_state) >= left - RK_GRAMMAR_BUDGET_MARGIN)
                st = rk_grammar_state_mask_budget(r->grammar_state, left, &mask, &n_ok);
            if (!st && !n_ok) st = rk_grammar_state_mask(r->grammar_state, &mask);
            if (!st) t = rk_sampler_sample_masked(&s->sampler, logits, mask);
            if (!st && t < 0) st = rk_errorf(RK_ERR_INTERNAL, "grammar: no token is allowed");
        }
        if (!st) st = rk_grammar_state_accept(r->grammar_state, t);
        if (st) {
            r->failure = st;
            snprintf(r->failure_msg, sizeof r->failure_msg, "constrained sampling failed: %s",
                     rk_error_message());
            RK_LOG_ERROR("request failed: %s", r->failure_msg);
            s->done = 1;
            return;
        }
    } else if (t < 0 || t >= hp->n_vocab) {
        t = rk_sampler_sample(&s->sampler, logits);
    }
    rk_sampler_accept(&s->sampler, t);
    /* Log-probabilities only where the request asks for them: the sum is a
     * pass of exp over the whole vocabulary, taken once for both. */
    if (r->opt.n_logprobs > 0) {
        float lse = rk_log_sum_exp(logits, hp->n_vocab);
        rk_logprobs_top(logits, hp->n_vocab, lse, r->opt.n_logprobs,
                        r->top_ids + (size_t)r->n_out * r->opt.n_logprobs,
                        r->top_logprobs + (size_t)r->n_out * r->opt.n_logprobs);
        r->logprobs[r->n_out] = logits[t] - lse;
    }
    if (r->n_out == 0) r->t.ttft_ms = (rk_time_now() - s->t_start) * 1e3;
    r->out_tokens[r->n_out++] = t;
    if (hooks && hooks->on_token) hooks->on_token(hooks->ctx, ri, t);
    if ((r->opt.stop_at_eog || r->grammar_state) &&
        rk_tokenizer_is_eog(rk_model_tokenizer(svc->model), t)) {
        r->finish_reason = RK_FINISH_STOP;
        s->done = 1;
    } else if (r->grammar_state && rk_grammar_state_must_end(r->grammar_state)) {
        /* The grammar is complete and allows nothing more: stop without
         * spending a step on the end token. */
        r->finish_reason = RK_FINISH_STOP;
        s->done = 1;
    } else if (r->n_out >= r->opt.max_tokens) {
        s->done = 1;
    }
}

void rk_finish_report(rk_request *r) {
    int chunk_tokens = 0, cached = r->sys_cached + r->conv_cached;
    for (int k = 0; k < r->n_chunks; k++) {
        chunk_tokens += r->chunk_lens[k];
        if (r->chunk_reports[k].status == RK_CHUNK_STATUS_HIT &&
            r->chunk_reports[k].source != RK_CHUNK_SOURCE_PREFIX)
            cached += r->chunk_lens[k] - r->chunk_reports[k].repaired; /* repaired: computed */
    }
    r->prompt_tokens = r->n_sys + chunk_tokens + r->n_gap_tokens + r->n_question;
    r->cached_tokens = cached;
    r->computed_tokens = r->prompt_tokens - cached;
    r->t.total_ms = (rk_time_now() - r->state->t_start) * 1e3 + r->t.queue_ms;
}

/* One forward pass: the next token of every request in dec (their tables
 * have room for it), then the prompt work of the requests in pre, in their
 * order, at most budget tokens of it (<= 0: all of it): the chunks a
 * request waits for, or what is left of its prompt. A request whose
 * prompt ends in the pass takes its first token from it (a resumed one has
 * its next token already) and decodes from the next pass on; its system
 * prompt goes into the radix tree once computed. */
rk_status rk_run_pass(rk_pipeline *p, rk_request *const *dec, int n_dec, rk_request *const *pre,
                      int n_pre, int budget, const rk_pipeline_hooks *hooks) {
    rk_service *svc = p->svc;
    int bs = rk_arena_block_size(svc->arena), n_vocab = rk_model_hparams(svc->model)->n_vocab;
    rk_status st;
    rk_batch_reset(&p->b);
    for (int i = 0; i < n_dec; i++) {
        rk_request *r = dec[i];
        rk_req_state *s = r->state;
        int idx = s->kv.n_tokens++;
        if ((st = rk_batch_add_req(&p->b, bs, s, &r->out_tokens[r->n_out - 1], 1, s->next_pos++,
                                   idx, 1)))
            return st;
    }
    int left = budget > 0 ? budget : 1 << 30;
    /* Prompts' log-probability rows: a bounded share of logits per pass. */
    int max_rows = (int)(RK_PROMPT_LOGITS_BYTES / ((size_t)n_vocab * sizeof(float)));
    for (int i = 0; i < n_pre; i++) {
        rk_req_state *s = pre[i]->state;
        s->row = -1;
        s->fed_sys = s->fed_p = s->fed_r = s->lp_n = 0;
        st = s->chunk_wait ? rk_feed_chunks(p, pre[i], &left)
             : s->scoring  ? RK_OK /* its deviation pass first: rk_repair_score_step */
                           : rk_feed_prompt(&p->b, bs, pre[i], &left, max_rows);
        if (st) {
            p->feed.n = 0;
            return st;
        }
    }
    if (p->b.n_seq == 0) return RK_OK;
    double t = rk_time_now();
    st = rk_batch_run(svc, &p->b);
    if (st) {
        p->feed.n = 0;
        return st;
    }
    rk_feed_done(&p->feed);
    double dt = (rk_time_now() - t) * 1e3;
    for (int i = 0; i < n_dec; i++) {
        rk_request *r = dec[i];
        r->state->n_valid = r->state->kv.n_tokens;
        r->t.decode_ms += dt;
        take_token(svc, r, p->b.logits + (size_t)i * n_vocab, hooks);
    }
    for (int i = 0; i < n_pre; i++) {
        rk_request *r = pre[i];
        rk_req_state *s = r->state;
        if (s->chunk_wait) r->t.chunk_compute_ms += dt;
        if (s->fed_r) r->t.repair_ms += dt;
        if (s->fed_sys || s->fed_p) r->t.prefill_ms += dt;
        if (s->lp_n) rk_take_prompt_logprobs(r, p->b.logits, n_vocab);
        if (!s->fed_sys && !s->fed_r && !s->fed_p) continue;
        s->sys_next += s->fed_sys;
        s->r_next += s->fed_r;
        s->p_next += s->fed_p;
        if (s->fed_sys && s->sys_next == r->n_sys && s->n_insert && (st = rk_insert_system(svc, r)))
            return st;
        if (s->chunk_wait || s->sys_next < r->n_sys || s->r_next < s->n_rtok ||
            s->p_next < s->n_ptok)
            continue;
        s->prefilling = 0;
        s->n_valid = s->kv.n_tokens;
        if (r->opt.max_tokens == 0) /* computed for its log-probabilities alone */
            s->done = 1;
        else if (s->row >= 0)
            take_token(svc, r, p->b.logits + (size_t)s->row * n_vocab, hooks);
    }
    return RK_OK;
}
