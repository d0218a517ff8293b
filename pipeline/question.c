/* pipeline/question.c — stage 6 of a request (driven by pipeline.c): what
 * is left of its prompt for the question pass (rk_queue_prompt), and how the
 * steps' passes feed it within the step budget (rk_feed_prompt): the
 * deferred system tail, the stepped repair runs (stage 5), then the
 * question. Engine thread only. */
#include "pipeline/internal.h"

/* Stage 6 (question), its set-up: what is left of each request's prompt for
 * the question pass: its deferred system tail, its stepped repair runs
 * (stage 5) and its question (plain: chunks and question; resuming: and its
 * generated tokens but the last). A request whose whole prompt is its
 * computed system prompt feeds the last system token again for its logits.
 * A cancelled request is done. */
void rk_queue_prompt(admission *a) {
    for (int i = 0; i < a->n; i++) {
        rk_request *r = a->reqs[i];
        rk_req_state *s = r->state;
        if (!s->done && r->cancel) {
            r->finish_reason = RK_FINISH_CANCELLED;
            s->done = 1;
        }
        if (s->done) continue;
        s->ptok = s->qtok;
        s->n_ptok = s->n_qtok;
        s->p_idx = s->q_index;
        s->p_pos = s->q_pos;
        s->p_next = 0;
        s->next_pos = s->n_qtok ? s->q_pos + s->n_qtok : r->n_sys;
        if (s->n_qtok == 0 && s->sys_next == r->n_sys && r->n_out == 0) {
            s->ptok = r->sys + r->n_sys - 1;
            s->n_ptok = 1;
            s->p_idx = s->p_pos = r->n_sys - 1;
        }
        s->prefilling =
            s->sys_next < r->n_sys || s->scoring || s->r_next < s->n_rtok || s->n_ptok > 0;
        if (!s->prefilling) s->n_valid = s->kv.n_tokens; /* resumed, nothing to feed */
    }
}

/* Feed what is left of r's prompt into b, at most *left tokens: its
 * system tail, its stepped repair runs, then the rest (table order: each
 * slice attends to what the earlier ones wrote); logits for the last token
 * when it has no token yet. */
rk_status rk_feed_prompt(batch *b, int bs, rk_request *r, int *left) {
    rk_req_state *s = r->state;
    rk_status st;
    int n = r->n_sys - s->sys_next < *left ? r->n_sys - s->sys_next : *left;
    if (n > 0) {
        int last = s->sys_next + n == r->n_sys && s->n_ptok == 0 && r->n_out == 0;
        if ((st = rk_batch_add_req(b, bs, s, r->sys + s->sys_next, n, s->sys_next, s->sys_next,
                                   last)))
            return st;
        if (last) s->row = b->n_logits - 1;
        s->fed_sys = n;
        *left -= n;
    }
    if (s->sys_next + s->fed_sys < r->n_sys) return RK_OK;
    if ((st = rk_repair_feed(b, bs, s, left))) return st;
    if (s->r_next + s->fed_r < s->n_rtok) return RK_OK;
    int m = s->n_ptok - s->p_next < *left ? s->n_ptok - s->p_next : *left;
    if (m <= 0) return RK_OK;
    int last = s->p_next + m == s->n_ptok && r->n_out == 0;
    if ((st = rk_batch_add_req(b, bs, s, s->ptok + s->p_next, m, s->p_pos + s->p_next,
                               s->p_idx + s->p_next, last)))
        return st;
    if (last) s->row = b->n_logits - 1;
    s->fed_p = m;
    *left -= m;
    return RK_OK;
}
