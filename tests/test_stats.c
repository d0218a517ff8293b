/* tests/test_stats.c — gateway/stats.h's latency histograms: bucketing at the
 * fixed bounds and quantiles interpolated inside a bucket, capped by the
 * largest value seen. */
#include <criterion/criterion.h>
#include <math.h>

#include "gateway/stats.h"

Test(hist, an_empty_histogram_has_quantile_zero) {
    rk_hist h = {0};
    cr_expect_eq(rk_hist_quantile(&h, 0.5), 0);
    cr_expect_eq(rk_hist_quantile(&h, 0.99), 0);
}

Test(hist, values_land_in_the_bucket_whose_upper_bound_they_reach) {
    const double *b = rk_hist_bounds();
    cr_expect_eq(b[0], 0.00005);
    cr_expect_eq(b[RK_HIST_BUCKETS - 1], 60.0);
    rk_hist h = {0};
    rk_hist_add(&h, 0.001);  /* exactly a bound: that bucket (0.0005, 0.001] */
    rk_hist_add(&h, 0.0011); /* the next one */
    rk_hist_add(&h, 100);    /* beyond the last bound: +Inf */
    rk_hist_add(&h, -1);     /* negative and NaN count as 0 */
    rk_hist_add(&h, NAN);
    cr_expect_eq(h.counts[4], 1);
    cr_expect_eq(h.counts[5], 1);
    cr_expect_eq(h.counts[RK_HIST_BUCKETS], 1);
    cr_expect_eq(h.counts[0], 2);
    cr_expect_eq(h.n, 5);
    cr_expect_float_eq(h.sum, 100.0021, 1e-9);
    cr_expect_eq(h.max, 100);
}

Test(hist, quantiles_interpolate_inside_the_bucket_up_to_the_largest_value) {
    rk_hist h = {0};
    for (int i = 0; i < 90; i++) rk_hist_add(&h, 0.0008); /* bucket (0.0005, 0.001] */
    for (int i = 0; i < 10; i++) rk_hist_add(&h, 0.3);    /* bucket (0.25, 0.5] */
    /* p50: rank 50 of the first bucket's 90, between its bounds. */
    cr_expect_float_eq(rk_hist_quantile(&h, 0.5), 0.0005 + 0.0005 * 50.0 / 90.0, 1e-12);
    /* p99: rank 99 is the 9th of the 10 in (0.25, 0.5], whose top is capped at
     * the largest value seen (0.3), never the bound 0.5. */
    cr_expect_float_eq(rk_hist_quantile(&h, 0.99), 0.25 + 0.05 * 0.9, 1e-12);
    cr_expect_float_eq(rk_hist_quantile(&h, 1.0), 0.3, 1e-12);
    /* q = 0: the bottom of the first non-empty bucket. */
    cr_expect_float_eq(rk_hist_quantile(&h, 0), 0.0005, 1e-12);
}

Test(hist, the_overflow_bucket_reaches_up_to_the_largest_value) {
    rk_hist h = {0};
    rk_hist_add(&h, 70);
    rk_hist_add(&h, 90);
    cr_expect_float_eq(rk_hist_quantile(&h, 0.5), 60 + 30 * 0.5, 1e-9);
    cr_expect_float_eq(rk_hist_quantile(&h, 1.0), 90, 1e-9);
}
