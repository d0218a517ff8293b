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

/* Whether r's passes compute its prompt's log-probabilities: a logits row
 * for each prompt token, until its first token (a resumed request has them
 * all). */
static int wants_prompt_rows(const rk_request *r) {
    return r->opt.prompt_logprobs && r->n_out == 0;
}

/* Feed what is left of r's prompt into b, at most *left tokens: its
 * system tail, its stepped repair runs, then the rest (table order: each
 * slice attends to what the earlier ones wrote); logits for the last token
 * when it has no token yet. With the prompt's log-probabilities, logits for
 * every token, as many as the pass's max_rows leave (none when other
 * prompts took them: the next pass goes on). */
rk_status rk_feed_prompt(batch *b, int bs, rk_request *r, int *left, int max_rows) {
    rk_req_state *s = r->state;
    rk_status st;
    int all = wants_prompt_rows(r), room = *left;
    s->lp_n = 0;
    if (all) {
        int rows = max_rows - b->n_prompt_rows;
        if (rows < 1 && b->n_prompt_rows > 0) return RK_OK;
        room = rows < 1 ? 1 : rows < room ? rows : room;
        s->lp_row = b->n_logits;
        s->lp_seq = s->sys_next < r->n_sys ? s->sys_next : r->n_sys + s->p_next;
    }
    int n = r->n_sys - s->sys_next < room ? r->n_sys - s->sys_next : room;
    if (n > 0) {
        int last = s->sys_next + n == r->n_sys && s->n_ptok == 0 && r->n_out == 0;
        if ((st = rk_batch_add_req(b, bs, s, r->sys + s->sys_next, n, s->sys_next, s->sys_next,
                                   all ? RK_LOGITS_ALL : last)))
            return st;
        if (last) s->row = b->n_logits - 1;
        s->fed_sys = n;
        *left -= n;
        room -= n;
    }
    if (s->sys_next + s->fed_sys < r->n_sys) goto rows;
    int before = room;
    if ((st = rk_repair_feed(b, bs, s, &room))) return st;
    *left -= before - room;
    if (s->r_next + s->fed_r < s->n_rtok) goto rows;
    int m = s->n_ptok - s->p_next < room ? s->n_ptok - s->p_next : room;
    if (m <= 0) goto rows;
    int last = s->p_next + m == s->n_ptok && r->n_out == 0;
    if ((st = rk_batch_add_req(b, bs, s, s->ptok + s->p_next, m, s->p_pos + s->p_next,
                               s->p_idx + s->p_next, all ? RK_LOGITS_ALL : last)))
        return st;
    if (last) s->row = b->n_logits - 1;
    s->fed_p = m;
    *left -= m;
rows:
    if (all) {
        s->lp_n = b->n_logits - s->lp_row;
        b->n_prompt_rows += s->lp_n;
    }
    return RK_OK;
}

/* After the pass: r's prompt rows (lp_n logits rows from lp_row, the first
 * for prompt token lp_seq) reduced at once to its prompt entries, as the
 * sampler's log-probabilities are (rk_log_sum_exp, rk_logprobs_top): the row
 * of token j gives entry j + 1; the last prompt token's row gives the first
 * generated token instead. */
void rk_take_prompt_logprobs(rk_request *r, const float *logits, int n_vocab) {
    rk_req_state *s = r->state;
    int n = r->n_sys + r->n_question, k = r->opt.n_logprobs;
    for (int i = 0; i < s->lp_n && s->lp_seq + i + 1 < n; i++) {
        int j = s->lp_seq + i + 1;
        const float *row = logits + (size_t)(s->lp_row + i) * n_vocab;
        int32_t t = j < r->n_sys ? r->sys[j] : r->question[j - r->n_sys];
        float lse = rk_log_sum_exp(row, n_vocab);
        rk_logprobs_top(row, n_vocab, lse, k, r->prompt_top_ids + (size_t)j * k,
                        r->prompt_top_logprobs + (size_t)j * k);
        r->prompt_logprobs[j] = row[t] - lse;
    }
    s->lp_n = 0;
}
