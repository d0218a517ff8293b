/* engine/sample.c — greedy, temperature, top-k and top-p sampling with a
 * seeded xoroshiro128+ generator after logit_bias and the presence,
 * frequency and repetition penalties, and top-N log-probabilities. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

/* Uniform in [0, 1) with 24 bits, from xoroshiro128+. */
static float next_uniform(uint64_t s[2]) {
    uint64_t s0 = s[0], s1 = s[1], r = s0 + s1;
    s1 ^= s0;
    s[0] = rotl(s0, 24) ^ s1 ^ (s1 << 16);
    s[1] = rotl(s1, 37);
    return (float)(r >> 40) * (1.0f / 16777216.0f);
}

rk_status rk_sampler_init(rk_sampler *s, const rk_sampler_params *p, int n_vocab) {
    memset(s, 0, sizeof *s);
    if (!(p->temperature >= 0) || p->top_k < 0 || !(p->top_p > 0 && p->top_p <= 1) || n_vocab < 1)
        return rk_errorf(RK_ERR_INVALID,
                         "sampler: temperature must be >= 0, top_k >= 0, top_p in (0, 1] "
                         "(got %g, %d, %g)",
                         p->temperature, p->top_k, p->top_p);
    if (!(p->presence_penalty >= -2 && p->presence_penalty <= 2))
        return rk_errorf(RK_ERR_INVALID, "presence_penalty must be from -2 to 2, got %g",
                         p->presence_penalty);
    if (!(p->frequency_penalty >= -2 && p->frequency_penalty <= 2))
        return rk_errorf(RK_ERR_INVALID, "frequency_penalty must be from -2 to 2, got %g",
                         p->frequency_penalty);
    if (!(p->repetition_penalty >= 0) || p->repetition_penalty > 100)
        return rk_errorf(RK_ERR_INVALID, "repetition_penalty must be from 0 (off) to 100, got %g",
                         p->repetition_penalty);
    if (p->n_logit_bias < 0 || p->n_logit_bias > RK_MAX_LOGIT_BIAS)
        return rk_errorf(RK_ERR_INVALID, "logit_bias has %d entries; at most %d are allowed",
                         p->n_logit_bias, RK_MAX_LOGIT_BIAS);
    for (int i = 0; i < p->n_logit_bias; i++) {
        const rk_logit_bias *b = &p->logit_bias[i];
        if (b->token < 0 || b->token >= n_vocab)
            return rk_errorf(RK_ERR_INVALID,
                             "logit_bias: token %d is not in the vocabulary (0 to %d)", b->token,
                             n_vocab - 1);
        if (!(b->bias >= -100 && b->bias <= 100))
            return rk_errorf(RK_ERR_INVALID,
                             "logit_bias: the bias of token %d must be from -100 "
                             "to 100, got %g",
                             b->token, b->bias);
    }
    s->p = *p;
    s->n_vocab = n_vocab;
    uint64_t seed = p->seed;
    s->rng[0] = splitmix64(&seed);
    s->rng[1] = splitmix64(&seed);
    int penalties = p->presence_penalty != 0 || p->frequency_penalty != 0 ||
                    (p->repetition_penalty != 0 && p->repetition_penalty != 1);
    int nomem = 0;
    if (p->temperature > 0) {
        s->probs = malloc((size_t)n_vocab * sizeof *s->probs);
        s->idx = malloc((size_t)n_vocab * sizeof *s->idx);
        nomem |= !s->probs || !s->idx;
    }
    if (penalties || p->n_logit_bias > 0) {
        s->adj = malloc((size_t)n_vocab * sizeof *s->adj);
        nomem |= !s->adj;
    }
    if (penalties) {
        s->count = calloc((size_t)n_vocab, sizeof *s->count);
        nomem |= !s->count;
    }
    if (nomem) {
        rk_sampler_free(s);
        return rk_errorf(RK_ERR_NOMEM, "sampler: out of memory");
    }
    return RK_OK;
}

void rk_sampler_free(rk_sampler *s) {
    if (!s) return;
    free(s->probs);
    free(s->idx);
    free(s->adj);
    free(s->count);
    s->probs = NULL;
    s->idx = NULL;
    s->adj = NULL;
    s->count = NULL;
}

void rk_sampler_accept(rk_sampler *s, int32_t token) {
    if (s->count && token >= 0 && token < s->n_vocab) s->count[token]++;
}

/* The logits with logit_bias and the penalties applied, in s->adj (or the
 * logits themselves when nothing adjusts them). A bias of -100 bans the
 * token outright (-inf), as OpenAI documents it. */
static const float *adjusted(rk_sampler *s, const float *logits) {
    if (!s->adj) return logits;
    int n = s->n_vocab;
    memcpy(s->adj, logits, (size_t)n * sizeof *s->adj);
    for (int i = 0; i < s->p.n_logit_bias; i++) {
        const rk_logit_bias *b = &s->p.logit_bias[i];
        s->adj[b->token] = b->bias <= -100 ? -INFINITY : s->adj[b->token] + b->bias;
    }
    if (s->count) {
        float rp = s->p.repetition_penalty;
        int rep = rp != 0 && rp != 1;
        for (int i = 0; i < n; i++) {
            int32_t c = s->count[i];
            if (!c) continue;
            float v = s->adj[i];
            if (rep) v = v > 0 ? v / rp : v * rp;
            v -= (float)c * s->p.frequency_penalty + s->p.presence_penalty;
            s->adj[i] = v;
        }
    }
    /* Everything banned: choose among the unbiased logits rather than from nothing. */
    float mx = s->adj[0];
    for (int i = 1; i < n; i++) mx = s->adj[i] > mx ? s->adj[i] : mx;
    return mx == -INFINITY ? logits : s->adj;
}

/* qsort takes no context argument; a thread-local carries the probabilities. */
static _Thread_local const float *t_sort_probs;

static int by_prob_desc(const void *a, const void *b) {
    float pa = t_sort_probs[*(const int32_t *)a], pb = t_sort_probs[*(const int32_t *)b];
    if (pa != pb) return pa > pb ? -1 : 1;
    return *(const int32_t *)a - *(const int32_t *)b;
}

int32_t rk_sampler_sample(rk_sampler *s, const float *logits) {
    return rk_sampler_sample_masked(s, logits, NULL);
}

#define ALLOWED(m, i) ((m)[(i) >> 6] >> ((i)&63) & 1)

int32_t rk_sampler_sample_masked(rk_sampler *s, const float *logits, const uint64_t *allowed) {
    int n = s->n_vocab;
    const float *raw = logits;
    logits = adjusted(s, logits);
    if (!allowed && s->p.temperature == 0) return rk_argmax_f32(logits, n);
    int32_t best = -1;
    float mx = 0;
    for (int pass = 0; pass < 2; pass++) {
        best = -1;
        for (int i = 0; i < n; i++)
            if ((!allowed || ALLOWED(allowed, i)) && (best < 0 || logits[i] > mx))
                mx = logits[i], best = i;
        /* Every allowed token banned by logit_bias: choose among their
         * unbiased logits rather than from nothing. */
        if (best < 0 || mx != -INFINITY || logits == raw) break;
        logits = raw;
    }
    if (best < 0 || s->p.temperature == 0) return best;
    double sum = 0;
    for (int i = 0; i < n; i++) {
        s->probs[i] =
            !allowed || ALLOWED(allowed, i) ? expf((logits[i] - mx) / s->p.temperature) : 0;
        sum += s->probs[i];
    }
    int n_keep = n;
    int filter = (s->p.top_k > 0 && s->p.top_k < n) || s->p.top_p < 1;
    if (filter) {
        /* Candidates sorted by probability (ties by id, so the order is reproducible). */
        for (int i = 0; i < n; i++) s->idx[i] = i;
        t_sort_probs = s->probs;
        qsort(s->idx, (size_t)n, sizeof *s->idx, by_prob_desc);
        if (allowed) { /* masked tokens sort last (probability 0): never keep them */
            int n_allowed = 0;
            for (int w = 0; w < (n + 63) / 64; w++) n_allowed += __builtin_popcountll(allowed[w]);
            n_keep = n_allowed;
        }
        if (s->p.top_k > 0 && s->p.top_k < n_keep) n_keep = s->p.top_k;
        if (s->p.top_p < 1) {
            /* The nucleus of what top_k kept, renormalised (as the Hugging
             * Face and llama.cpp samplers do), not of the whole vocabulary. */
            double kept = 0, cum = 0;
            for (int i = 0; i < n_keep; i++) kept += s->probs[s->idx[i]];
            for (int i = 0; i < n_keep; i++) {
                cum += s->probs[s->idx[i]] / kept;
                if (cum >= s->p.top_p) {
                    n_keep = i + 1;
                    break;
                }
            }
        }
        sum = 0;
        for (int i = 0; i < n_keep; i++) sum += s->probs[s->idx[i]];
    }
    float r = next_uniform(s->rng) * (float)sum;
    double acc = 0;
    for (int i = 0; i < n_keep; i++) {
        int id = filter ? s->idx[i] : i;
        acc += s->probs[id];
        if (r < acc) return id;
    }
    /* Rounding left r at the very end. */
    return filter ? s->idx[n_keep - 1] : allowed ? best : n - 1;
}

float rk_log_sum_exp(const float *logits, int n) {
    float mx = logits[0];
    for (int i = 1; i < n; i++) mx = logits[i] > mx ? logits[i] : mx;
    double sum = 0;
    for (int i = 0; i < n; i++) sum += exp((double)(logits[i] - mx));
    return mx + (float)log(sum);
}

int rk_logprobs_top(const float *logits, int n, float lse, int k, int32_t *out_ids,
                    float *out_logprobs) {
    if (k > n) k = n;
    if (k <= 0) return 0;
    /* Insertion into a k-sized descending list; k is small (<= 20). */
    int have = 0;
    for (int i = 0; i < n; i++) {
        float v = logits[i];
        if (have == k && v <= logits[out_ids[k - 1]]) continue;
        int j = have < k ? have++ : k - 1;
        while (j > 0 && logits[out_ids[j - 1]] < v) {
            out_ids[j] = out_ids[j - 1];
            j--;
        }
        out_ids[j] = i;
    }
    for (int i = 0; i < have; i++) out_logprobs[i] = logits[out_ids[i]] - lse;
    return have;
}
