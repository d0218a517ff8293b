/* gateway/generate.c — the batched generation loop: every step builds one
 * rk_batch from all unfinished sequences (their prompts on the first step,
 * their last sampled token afterwards), reserves live-pool slots, runs the
 * forward pass and samples each sequence's next token. */
#include <stdlib.h>
#include <string.h>

#include "gateway/gateway.h"

typedef struct gen_state {
    rk_seq kv;
    rk_sampler sampler;
    int done;
} gen_state;

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
            const int32_t *src =
                step == 0 ? seqs[i].prompt : &seqs[i].out_tokens[seqs[i].n_out - 1];
            int n_new = step == 0 ? seqs[i].n_prompt : 1;
            if ((st = rk_seq_reserve(&g[i].kv, svc->arena, RK_POOL_LIVE, n_new, b.slots + n_tok)))
                goto done;
            for (int j = 0; j < n_new; j++) {
                b.tokens[n_tok + j] = src[j];
                b.pos[n_tok + j] = g[i].kv.n_tokens + j;
            }
            n_tok += n_new;
            b.seq_of[n_act] = i;
            b.kv_len[n_act] = g[i].kv.n_tokens + n_new;
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
            g[i].kv.n_tokens = b.kv_len[a];
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
            rk_seq_release(&g[i].kv, svc->arena);
            rk_sampler_free(&g[i].sampler);
        }
    free(g);
    step_buf_free(&b);
    return st;
}
