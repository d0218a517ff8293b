/* gateway/generate.c — the batched generation loop: every step builds one
 * rk_batch from all unfinished sequences (the uncached part of their prompts
 * on the first step, their last sampled token afterwards), reserves slots,
 * runs the forward pass and samples each sequence's next token.
 *
 * The system prompt (the first n_system tokens) goes through the prefix
 * cache: the matched pages are shared into the sequence's block table (one
 * arena reference each) with the radix path locked; the unmatched whole pages
 * are prefilled into prefix-pool blocks and inserted after the first pass
 * (the tree takes its own reference on the pages it keeps). */
#include <stdlib.h>
#include <string.h>

#include "gateway/gateway.h"

typedef struct gen_state {
    rk_seq kv;
    rk_sampler sampler;
    int done;
    int first;           /* first prompt token the prefill computes */
    int n_insert;        /* system tokens to insert into the prefix cache after prefill */
    rk_radix_node *lock; /* the prefix path held for the whole call */
} gen_state;

/* Set up sequence s for its prefill: share its cached system-prompt pages,
 * reserve prefix-pool blocks for the rest of its whole system pages, then live
 * blocks for everything after. Writes the slots of the tokens to compute
 * (prompt[g->first ..]) and advances g->kv.n_tokens to the prompt length. */
static rk_status start_seq(rk_service *svc, const rk_gen_seq *s, gen_state *g, int32_t *slots) {
    int bs = rk_arena_block_size(svc->arena);
    rk_status st;
    int n_sys = s->n_system < s->n_prompt ? s->n_system : s->n_prompt;
    if (svc->prefix && n_sys > 0) {
        int32_t *pages = malloc((size_t)(n_sys / bs + 1) * sizeof *pages);
        if (!pages) return rk_errorf(RK_ERR_NOMEM, "generate: out of memory");
        rk_radix_result m;
        int flags = n_sys == s->n_prompt ? RK_RADIX_LEAVE_ONE : 0;
        st = rk_radix_match(svc->prefix, svc->prefix_ns, s->prompt, n_sys, flags, pages, &m);
        g->lock = m.node;
        if (!st) st = rk_seq_share(&g->kv, svc->arena, pages, m.n_matched / bs);
        free(pages);
        if (st) return st;
        g->first = m.n_matched;
        int aligned = n_sys / bs * bs, n_new = aligned - m.n_matched;
        if (n_new > 0) {
            st = rk_seq_reserve(&g->kv, svc->arena, RK_POOL_PREFIX, n_new, slots);
            if (st == RK_ERR_EXHAUSTED) {
                rk_radix_evict(svc->prefix, n_new, NULL);
                st = rk_seq_reserve(&g->kv, svc->arena, RK_POOL_PREFIX, n_new, slots);
            }
            if (st == RK_OK) {
                g->kv.n_tokens += n_new;
                g->n_insert = aligned;
                slots += n_new;
            } else if (st != RK_ERR_EXHAUSTED) {
                return st;
            } /* else the pool is full of locked pages: compute in live blocks, cache nothing */
        }
    }
    int rest = s->n_prompt - g->kv.n_tokens;
    if ((st = rk_seq_reserve(&g->kv, svc->arena, RK_POOL_LIVE, rest, slots))) return st;
    g->kv.n_tokens = s->n_prompt;
    return RK_OK;
}

/* After the prefill: insert the computed system pages; the tree takes a
 * reference on the pages it keeps, and its locked path replaces the match's. */
static rk_status finish_insert(rk_service *svc, const rk_gen_seq *s, gen_state *g) {
    int bs = rk_arena_block_size(svc->arena), present;
    rk_radix_node *node;
    rk_status st = rk_radix_insert(svc->prefix, svc->prefix_ns, s->prompt, g->n_insert,
                                   g->kv.blocks, 0, &present, &node);
    if (st) return st;
    if ((st = rk_arena_ref(svc->arena, g->kv.blocks + present / bs, (g->n_insert - present) / bs)))
        return st;
    if (g->lock) rk_radix_unlock(svc->prefix, g->lock);
    g->lock = node;
    g->n_insert = 0;
    return RK_OK;
}

/* Arrays of one step, sized for the whole prefill (the largest step). */
typedef struct step_buf {
    int32_t *tokens, *pos, *slots, *logit_rows, *q_start, *kv_len, *table, *seq_of;
    float *logits;
} step_buf;

static void step_buf_free(step_buf *b) {
    free(b->tokens);
    free(b->pos);
    free(b->slots);
    free(b->logit_rows);
    free(b->q_start);
    free(b->kv_len);
    free(b->table);
    free(b->seq_of);
    free(b->logits);
}

static rk_status check_seqs(const rk_service *svc, const rk_gen_seq *seqs, int n_seqs) {
    const rk_hparams *hp = rk_model_hparams(svc->model);
    for (int i = 0; i < n_seqs; i++) {
        if (seqs[i].n_prompt < 1)
            return rk_errorf(RK_ERR_INVALID, "generate: sequence %d has an empty prompt", i);
        if (seqs[i].max_new < 0)
            return rk_errorf(RK_ERR_INVALID, "generate: sequence %d asks for %d tokens", i,
                             seqs[i].max_new);
        for (int j = 0; j < seqs[i].n_prompt; j++)
            if (seqs[i].prompt[j] < 0 || seqs[i].prompt[j] >= hp->n_vocab)
                return rk_errorf(RK_ERR_INVALID, "generate: token id %d out of range [0, %d)",
                                 seqs[i].prompt[j], hp->n_vocab);
    }
    return RK_OK;
}

rk_status rk_generate(rk_service *svc, rk_gen_seq *seqs, int n_seqs, const rk_gen_hooks *hooks,
                      rk_gen_stats *stats) {
    rk_status st = check_seqs(svc, seqs, n_seqs);
    if (st) return st;
    const rk_hparams *hp = rk_model_hparams(svc->model);
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    int bs = rk_arena_block_size(svc->arena);
    int total_prompt = 0, max_len = 0;
    for (int i = 0; i < n_seqs; i++) {
        total_prompt += seqs[i].n_prompt;
        int len = seqs[i].n_prompt + seqs[i].max_new;
        max_len = len > max_len ? len : max_len;
    }
    int max_blocks = (max_len + bs - 1) / bs;
    int cap = total_prompt > n_seqs ? total_prompt : n_seqs;

    gen_state *g = calloc((size_t)n_seqs, sizeof *g);
    step_buf b = {0};
    b.tokens = malloc((size_t)cap * 4);
    b.pos = malloc((size_t)cap * 4);
    b.slots = malloc((size_t)cap * 4);
    b.logit_rows = malloc((size_t)n_seqs * 4);
    b.q_start = malloc((size_t)(n_seqs + 1) * 4);
    b.kv_len = malloc((size_t)n_seqs * 4);
    b.seq_of = malloc((size_t)n_seqs * 4);
    b.table = malloc((size_t)n_seqs * (size_t)max_blocks * 4);
    b.logits = malloc((size_t)n_seqs * (size_t)hp->n_vocab * sizeof(float));
    if (!g || !b.tokens || !b.pos || !b.slots || !b.logit_rows || !b.q_start || !b.kv_len ||
        !b.seq_of || !b.table || !b.logits) {
        st = rk_errorf(RK_ERR_NOMEM, "generate: out of memory");
        goto done;
    }
    for (int i = 0; i < n_seqs; i++) {
        seqs[i].n_out = 0;
        seqs[i].finish_reason = "length";
        if ((st = rk_sampler_init(&g[i].sampler, &seqs[i].sampling, hp->n_vocab))) goto done;
        g[i].done = seqs[i].max_new == 0;
    }
    if (stats) memset(stats, 0, sizeof *stats);
    double t_start = rk_time_now();
    for (int step = 0;; step++) {
        /* Gather this step's tokens from every unfinished sequence. */
        int n_tok = 0, n_act = 0;
        b.q_start[0] = 0;
        for (int i = 0; i < n_seqs; i++) {
            if (g[i].done) continue;
            int n_new;
            if (step == 0) {
                if ((st = start_seq(svc, &seqs[i], &g[i], b.slots + n_tok))) goto done;
                n_new = seqs[i].n_prompt - g[i].first;
                seqs[i].n_cached = g[i].first;
                for (int j = 0; j < n_new; j++) {
                    b.tokens[n_tok + j] = seqs[i].prompt[g[i].first + j];
                    b.pos[n_tok + j] = g[i].first + j;
                }
            } else {
                n_new = 1;
                if ((st = rk_seq_reserve(&g[i].kv, svc->arena, RK_POOL_LIVE, 1, b.slots + n_tok)))
                    goto done;
                b.tokens[n_tok] = seqs[i].out_tokens[seqs[i].n_out - 1];
                b.pos[n_tok] = g[i].kv.n_tokens++;
            }
            n_tok += n_new;
            b.seq_of[n_act] = i;
            b.kv_len[n_act] = g[i].kv.n_tokens;
            b.logit_rows[n_act] = n_tok - 1;
            for (int k = 0; k < max_blocks; k++)
                b.table[n_act * max_blocks + k] = k < g[i].kv.n_blocks ? g[i].kv.blocks[k] : -1;
            b.q_start[++n_act] = n_tok;
        }
        if (n_act == 0) break;
        rk_batch batch = {.n_tokens = n_tok,
                          .tokens = b.tokens,
                          .pos = b.pos,
                          .slots = b.slots,
                          .attn = {.n_seqs = n_act,
                                   .q_start = b.q_start,
                                   .kv_len = b.kv_len,
                                   .block_table = b.table,
                                   .max_blocks = max_blocks},
                          .n_logits = n_act,
                          .logit_rows = b.logit_rows};
        double t0 = rk_time_now();
        if ((st = rk_model_forward(svc->model, rk_arena_kv(svc->arena), &batch, b.logits)))
            goto done;
        double t1 = rk_time_now();
        if (stats) {
            if (step == 0)
                stats->prefill_s += t1 - t0, stats->prompt_tokens += n_tok;
            else
                stats->decode_s += t1 - t0, stats->decode_tokens += n_act;
        }
        for (int a = 0; a < n_act; a++) {
            int i = b.seq_of[a];
            rk_gen_seq *s = &seqs[i];
            if (g[i].n_insert && (st = finish_insert(svc, s, &g[i]))) goto done;
            const float *logits = b.logits + (size_t)a * hp->n_vocab;
            if (hooks && hooks->on_logits)
                hooks->on_logits(hooks->ctx, i, s->n_out, logits, hp->n_vocab);
            int32_t t = rk_sampler_sample(&g[i].sampler, logits);
            if (s->n_out == 0) s->ttft_s = t1 - t_start;
            s->out_tokens[s->n_out++] = t;
            if (hooks && hooks->on_token) hooks->on_token(hooks->ctx, i, t);
            if (s->stop_at_eog && rk_tokenizer_is_eog(tok, t)) {
                s->finish_reason = "stop";
                g[i].done = 1;
            } else if (s->n_out >= s->max_new) {
                g[i].done = 1;
            }
        }
    }
done:
    if (g)
        for (int i = 0; i < n_seqs; i++) {
            if (g[i].lock) rk_radix_unlock(svc->prefix, g[i].lock);
            rk_seq_release(&g[i].kv, svc->arena);
            rk_sampler_free(&g[i].sampler);
        }
    free(g);
    step_buf_free(&b);
    return st;
}
