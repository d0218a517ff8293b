/* tests/test_sampler.c — engine/sample.c: greedy, temperature, top-k and
 * top-p sampling (alone and together), seeded reproducibility, parameter
 * checks, logit_bias and the presence, frequency and repetition penalties,
 * and the top-N log-probabilities. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "engine/engine.h"

/* Logits whose softmax at temperature 1 is exactly p (p sums to 1). */
static void logits_of(const double *p, int n, float *out) {
    for (int i = 0; i < n; i++) out[i] = (float)log(p[i]);
}

/* How often each id comes out of draws samples. */
static void histogram(rk_sampler *s, const float *logits, int n, int draws, int *counts) {
    for (int i = 0; i < n; i++) counts[i] = 0;
    for (int d = 0; d < draws; d++) {
        int32_t id = rk_sampler_sample(s, logits);
        cr_assert(id >= 0 && id < n, "id %d out of range", id);
        counts[id]++;
    }
}

Test(sampler, greedy_takes_the_largest_logit_and_the_first_on_ties) {
    const float logits[] = {0.5f, 3.0f, -1.0f, 3.0f, 2.9f};
    rk_sampler s;
    rk_sampler_params p = {.temperature = 0, .top_p = 1, .seed = 1};
    cr_assert_eq(rk_sampler_init(&s, &p, 5), RK_OK);
    for (int i = 0; i < 10; i++) cr_expect_eq(rk_sampler_sample(&s, logits), 1);
    rk_sampler_free(&s);
}

Test(sampler, temperature_one_follows_the_softmax) {
    const double prob[] = {0.5, 0.3, 0.15, 0.05};
    float logits[4];
    logits_of(prob, 4, logits);
    rk_sampler s;
    rk_sampler_params p = {.temperature = 1, .top_p = 1, .seed = 42};
    cr_assert_eq(rk_sampler_init(&s, &p, 4), RK_OK);
    int counts[4];
    enum { DRAWS = 20000 };
    histogram(&s, logits, 4, DRAWS, counts);
    /* The standard error of each frequency is below 0.004; allow five of them. */
    for (int i = 0; i < 4; i++)
        cr_expect(fabs((double)counts[i] / DRAWS - prob[i]) < 0.02, "id %d: %d of %d, want %.2f", i,
                  counts[i], DRAWS, prob[i]);
    rk_sampler_free(&s);
}

Test(sampler, temperature_divides_the_logits_before_the_softmax) {
    const double prob[] = {0.5, 0.3, 0.2};
    float logits[3];
    logits_of(prob, 3, logits);
    /* At temperature 0.5 each probability is squared and renormalised; at 2
     * its square root is. */
    const double temps[] = {0.5, 2};
    for (int t = 0; t < 2; t++) {
        double want[3], sum = 0;
        for (int i = 0; i < 3; i++) sum += want[i] = pow(prob[i], 1 / temps[t]);
        rk_sampler s;
        rk_sampler_params p = {.temperature = (float)temps[t], .top_p = 1, .seed = 5};
        cr_assert_eq(rk_sampler_init(&s, &p, 3), RK_OK);
        int counts[3];
        enum { DRAWS = 20000 };
        histogram(&s, logits, 3, DRAWS, counts);
        for (int i = 0; i < 3; i++)
            cr_expect(fabs((double)counts[i] / DRAWS - want[i] / sum) < 0.02,
                      "temperature %g, id %d: %d of %d, want %.3f", temps[t], i, counts[i], DRAWS,
                      want[i] / sum);
        rk_sampler_free(&s);
    }
}

Test(sampler, top_k_keeps_only_the_k_most_likely) {
    const double prob[] = {0.1, 0.4, 0.05, 0.25, 0.2};
    float logits[5];
    logits_of(prob, 5, logits);
    rk_sampler s;
    rk_sampler_params p = {.temperature = 1, .top_k = 2, .top_p = 1, .seed = 7};
    cr_assert_eq(rk_sampler_init(&s, &p, 5), RK_OK);
    int counts[5];
    enum { DRAWS = 10000 };
    histogram(&s, logits, 5, DRAWS, counts);
    cr_expect_eq(counts[0] + counts[2] + counts[4], 0, "only ids 1 and 3 are kept");
    /* Renormalised over the two: 0.4 / 0.65 and 0.25 / 0.65. */
    cr_expect(fabs((double)counts[1] / DRAWS - 0.4 / 0.65) < 0.025, "id 1: %d", counts[1]);
    rk_sampler_free(&s);
    /* top_k 1 is greedy whatever the temperature and the seed. */
    p.top_k = 1;
    for (uint64_t seed = 0; seed < 20; seed++) {
        p.seed = seed;
        cr_assert_eq(rk_sampler_init(&s, &p, 5), RK_OK);
        cr_expect_eq(rk_sampler_sample(&s, logits), 1, "seed %llu", (unsigned long long)seed);
        rk_sampler_free(&s);
    }
}

Test(sampler, top_p_keeps_the_smallest_set_that_reaches_p) {
    const double prob[] = {0.15, 0.5, 0.05, 0.3};
    float logits[4];
    logits_of(prob, 4, logits);
    rk_sampler s;
    /* 0.5 < 0.7 <= 0.5 + 0.3: ids 1 and 3 are the nucleus. */
    rk_sampler_params p = {.temperature = 1, .top_p = 0.7f, .seed = 3};
    cr_assert_eq(rk_sampler_init(&s, &p, 4), RK_OK);
    int counts[4];
    enum { DRAWS = 10000 };
    histogram(&s, logits, 4, DRAWS, counts);
    cr_expect_eq(counts[0] + counts[2], 0, "ids 0 and 2 are outside the nucleus");
    cr_expect(fabs((double)counts[1] / DRAWS - 0.5 / 0.8) < 0.025, "id 1: %d", counts[1]);
    cr_expect_gt(counts[3], 0);
    rk_sampler_free(&s);
}

Test(sampler, top_k_and_top_p_together_keep_the_smaller_set) {
    const double prob[] = {0.3, 0.25, 0.2, 0.15, 0.1};
    float logits[5];
    logits_of(prob, 5, logits);
    rk_sampler s;
    int counts[5];
    enum { DRAWS = 10000 };
    /* top_p cuts inside the top k: ids 0 and 1 (0.3 + 0.25) reach p 0.5. */
    rk_sampler_params p = {.temperature = 1, .top_k = 3, .top_p = 0.5f, .seed = 11};
    cr_assert_eq(rk_sampler_init(&s, &p, 5), RK_OK);
    histogram(&s, logits, 5, DRAWS, counts);
    cr_expect_eq(counts[2] + counts[3] + counts[4], 0, "only ids 0 and 1 reach p 0.5");
    cr_expect(fabs((double)counts[0] / DRAWS - 0.3 / 0.55) < 0.025, "id 0: %d", counts[0]);
    rk_sampler_free(&s);
    /* top_k cuts inside the nucleus: p 0.9 would keep four ids, k 2 keeps two. */
    p.top_k = 2;
    p.top_p = 0.9f;
    cr_assert_eq(rk_sampler_init(&s, &p, 5), RK_OK);
    histogram(&s, logits, 5, DRAWS, counts);
    cr_expect_eq(counts[2] + counts[3] + counts[4], 0, "only the top 2 are kept");
    cr_expect(fabs((double)counts[1] / DRAWS - 0.25 / 0.55) < 0.025, "id 1: %d", counts[1]);
    rk_sampler_free(&s);
    /* top_p applies to the top k renormalised: within ids 0 and 1, id 0 has
     * 0.3 / 0.55 = 0.545 >= 0.5, so it is kept alone (of the whole
     * vocabulary it has 0.3 < 0.5, which would keep id 1 too). */
    p.top_k = 2;
    p.top_p = 0.5f;
    cr_assert_eq(rk_sampler_init(&s, &p, 5), RK_OK);
    histogram(&s, logits, 5, DRAWS, counts);
    cr_expect_eq(counts[0], DRAWS, "the nucleus of the top 2 is id 0 alone: %d", counts[0]);
    rk_sampler_free(&s);
}

Test(sampler, a_seed_gives_the_same_sequence_and_another_seed_does_not) {
    float logits[64];
    for (int i = 0; i < 64; i++) logits[i] = (float)((i * 37) % 11) * 0.3f;
    rk_sampler_params p = {.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .seed = 1234};
    int32_t a[200], b[200], c[200];
    int32_t *runs[3] = {a, b, c};
    uint64_t seeds[3] = {1234, 1234, 1235};
    for (int r = 0; r < 3; r++) {
        rk_sampler s;
        p.seed = seeds[r];
        cr_assert_eq(rk_sampler_init(&s, &p, 64), RK_OK);
        for (int i = 0; i < 200; i++) runs[r][i] = rk_sampler_sample(&s, logits);
        rk_sampler_free(&s);
    }
    int same_ab = 1, same_ac = 1;
    for (int i = 0; i < 200; i++) {
        same_ab &= a[i] == b[i];
        same_ac &= a[i] == c[i];
    }
    cr_expect(same_ab, "one seed, one sequence");
    cr_expect(!same_ac, "another seed, another sequence");
}

Test(sampler, bad_parameters_are_refused) {
    rk_sampler s;
    rk_sampler_params p = {.temperature = -1, .top_p = 1};
    cr_expect_eq(rk_sampler_init(&s, &p, 8), RK_ERR_INVALID);
    p = (rk_sampler_params){.temperature = 1, .top_p = 0};
    cr_expect_eq(rk_sampler_init(&s, &p, 8), RK_ERR_INVALID);
    p = (rk_sampler_params){.temperature = 1, .top_p = 1.5f};
    cr_expect_eq(rk_sampler_init(&s, &p, 8), RK_ERR_INVALID);
    p = (rk_sampler_params){.temperature = 1, .top_k = -2, .top_p = 1};
    cr_expect_eq(rk_sampler_init(&s, &p, 8), RK_ERR_INVALID);
    p = (rk_sampler_params){.temperature = 1, .top_p = 1};
    cr_expect_eq(rk_sampler_init(&s, &p, 0), RK_ERR_INVALID);
    rk_sampler_free(NULL);
}

Test(sampler, logprobs_are_the_top_log_softmax_most_likely_first) {
    const double prob[] = {0.1, 0.6, 0.3};
    float logits[3];
    for (int i = 0; i < 3; i++) logits[i] = (float)log(prob[i]) + 5.0f; /* shift-invariant */
    int32_t ids[3];
    float lp[3];
    float lse = rk_log_sum_exp(logits, 3);
    cr_assert_eq(rk_logprobs_top(logits, 3, lse, 2, ids, lp), 2);
    cr_expect_eq(ids[0], 1);
    cr_expect_eq(ids[1], 2);
    cr_expect_float_eq(lp[0], (float)log(0.6), 1e-5);
    cr_expect_float_eq(lp[1], (float)log(0.3), 1e-5);
    cr_expect_eq(rk_logprobs_top(logits, 3, lse, 0, ids, lp), 0);
}

Test(sampler, log_sum_exp_is_stable_for_large_logits) {
    const float logits[3] = {1000.0f, 1000.0f, -1000.0f}; /* exp overflows without the shift */
    cr_expect_float_eq(rk_log_sum_exp(logits, 3), 1000.0f + (float)log(2.0), 1e-3);
    cr_expect_float_eq(rk_log_sum_exp(logits + 2, 1), -1000.0f, 1e-3);
}

/* ---------------------------------------------------------------- adjustments */

/* A bias of -100 bans a token: it never comes out, greedy or sampled, even
 * where it has the largest logit; a positive bias moves greedy to its token. */
Test(sampler, a_logit_bias_of_minus_100_bans_the_token) {
    const float logits[] = {0.1f, 4.0f, 0.2f, 0.3f};
    for (int temp = 0; temp < 2; temp++) {
        rk_sampler s;
        rk_sampler_params p = {
            .temperature = (float)temp * 2, .top_p = 1, .seed = 7, .n_logit_bias = 1};
        p.logit_bias[0] = (rk_logit_bias){.token = 1, .bias = -100};
        cr_assert_eq(rk_sampler_init(&s, &p, 4), RK_OK, "%s", rk_error_message());
        int counts[4];
        histogram(&s, logits, 4, 2000, counts);
        cr_expect_eq(counts[1], 0, "banned token drawn %d times (temperature %d)", counts[1],
                     temp * 2);
        rk_sampler_free(&s);
    }
    rk_sampler s;
    rk_sampler_params p = {.temperature = 0, .top_p = 1, .n_logit_bias = 1};
    p.logit_bias[0] = (rk_logit_bias){.token = 3, .bias = 5};
    cr_assert_eq(rk_sampler_init(&s, &p, 4), RK_OK);
    cr_expect_eq(rk_sampler_sample(&s, logits), 3);
    rk_sampler_free(&s);
}

/* Greedy over fixed logits repeats one token forever; each penalty, over the
 * tokens accepted so far, moves it on as its formula says. */
Test(sampler, penalties_change_a_repetitive_greedy_output) {
    const float logits[] = {2.0f, 1.5f, 1.2f, -3.0f};
    int32_t out[6];
    /* None: token 0 every time. */
    rk_sampler s;
    rk_sampler_params p = {.temperature = 0, .top_p = 1, .repetition_penalty = 1};
    cr_assert_eq(rk_sampler_init(&s, &p, 4), RK_OK);
    for (int i = 0; i < 6; i++) rk_sampler_accept(&s, out[i] = rk_sampler_sample(&s, logits));
    for (int i = 0; i < 6; i++) cr_expect_eq(out[i], 0);
    rk_sampler_free(&s);
    /* presence 1: a token once seen loses 1, whatever its count: 0, 1, 2, then
     * 0 again (2 - 1 > 1.2 - 1). */
    p = (rk_sampler_params){.temperature = 0, .top_p = 1, .presence_penalty = 1};
    cr_assert_eq(rk_sampler_init(&s, &p, 4), RK_OK);
    for (int i = 0; i < 4; i++) rk_sampler_accept(&s, out[i] = rk_sampler_sample(&s, logits));
    cr_expect(out[0] == 0 && out[1] == 1 && out[2] == 2 && out[3] == 0, "%d %d %d %d", out[0],
              out[1], out[2], out[3]);
    rk_sampler_free(&s);
    /* frequency 0.4: each step takes the largest logit - 0.4 * count (ties to
     * the lower id), checked against the formula step by step. */
    p = (rk_sampler_params){.temperature = 0, .top_p = 1, .frequency_penalty = 0.4f};
    cr_assert_eq(rk_sampler_init(&s, &p, 4), RK_OK);
    int count[4] = {0};
    for (int i = 0; i < 6; i++) {
        int best = 0;
        float bv = -1e30f;
        for (int k = 0; k < 4; k++) {
            float v = logits[k] - 0.4f * (float)count[k];
            if (v > bv) bv = v, best = k;
        }
        int32_t t = rk_sampler_sample(&s, logits);
        cr_expect_eq(t, best, "step %d", i);
        rk_sampler_accept(&s, t);
        count[t]++;
    }
    cr_expect(count[1] > 0, "a frequency penalty moves greedy off token 0");
    rk_sampler_free(&s);
    /* repetition 2: a seen positive logit is halved: 0 (2 -> 1), then 1 (1.5
     * -> 0.75), then 2 (1.2 -> 0.6), then 0 again (1 > 0.75 > 0.6). A seen
     * negative logit is doubled (more negative). */
    p = (rk_sampler_params){.temperature = 0, .top_p = 1, .repetition_penalty = 2};
    cr_assert_eq(rk_sampler_init(&s, &p, 4), RK_OK);
    for (int i = 0; i < 4; i++) rk_sampler_accept(&s, out[i] = rk_sampler_sample(&s, logits));
    cr_expect(out[0] == 0 && out[1] == 1 && out[2] == 2 && out[3] == 0, "%d %d %d %d", out[0],
              out[1], out[2], out[3]);
    rk_sampler_free(&s);
}

/* With penalties and a bias, one seed gives one sequence. */
Test(sampler, the_same_seed_gives_the_same_output_with_penalties) {
    float logits[64];
    for (int i = 0; i < 64; i++) logits[i] = (float)((i * 37) % 11) * 0.3f;
    int32_t runs[2][300];
    for (int r = 0; r < 2; r++) {
        rk_sampler s;
        rk_sampler_params p = {.temperature = 0.8f,
                               .top_k = 20,
                               .top_p = 0.9f,
                               .seed = 99,
                               .presence_penalty = 0.5f,
                               .frequency_penalty = 0.3f,
                               .repetition_penalty = 1.3f,
                               .n_logit_bias = 2};
        p.logit_bias[0] = (rk_logit_bias){.token = 5, .bias = -100};
        p.logit_bias[1] = (rk_logit_bias){.token = 6, .bias = 2};
        cr_assert_eq(rk_sampler_init(&s, &p, 64), RK_OK);
        for (int i = 0; i < 300; i++) {
            runs[r][i] = rk_sampler_sample(&s, logits);
            rk_sampler_accept(&s, runs[r][i]);
            cr_expect_neq(runs[r][i], 5);
        }
        rk_sampler_free(&s);
    }
    cr_expect_eq(memcmp(runs[0], runs[1], sizeof runs[0]), 0);
}

Test(sampler, bad_penalties_and_biases_are_refused_by_name) {
    rk_sampler s;
    struct {
        rk_sampler_params p;
        const char *name;
    } bad[] = {
        {{.temperature = 1, .top_p = 1, .presence_penalty = 2.5f}, "presence_penalty"},
        {{.temperature = 1, .top_p = 1, .frequency_penalty = -3}, "frequency_penalty"},
        {{.temperature = 1, .top_p = 1, .repetition_penalty = -1}, "repetition_penalty"},
        {{.temperature = 1, .top_p = 1, .n_logit_bias = 1, .logit_bias = {{.token = 8, .bias = 1}}},
         "logit_bias"},
        {{.temperature = 1,
          .top_p = 1,
          .n_logit_bias = 1,
          .logit_bias = {{.token = 1, .bias = 101}}},
         "logit_bias"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cr_expect_eq(rk_sampler_init(&s, &bad[i].p, 8), RK_ERR_INVALID, "case %zu", i);
        cr_expect_not_null(strstr(rk_error_message(), bad[i].name), "%s", rk_error_message());
    }
}
