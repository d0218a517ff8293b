/* bench/bench_matmul.c — the CPU matmul at the shapes of the qwen3-0.6b
 * preset, per weight type (a program, not a test):
 *   the six projections of a layer (k x m: 1024 x 2048 q, 1024 x 1024 k and v,
 *   2048 x 1024 o, 1024 x 3072 gate and up, 3072 x 1024 down) and the output
 *   head (1024 x 151936), each at n = 1 (decode) and n = 512 (prefill; the
 *   head only at n = 1, as a prefill computes the last token's logits only).
 * Every case runs --reps times after a warm-up (at n = 1 each call on another
 * copy of the weights, 128 MiB of copies in all, so they stream from memory
 * as in a model's decode); the table gives the best and
 * the median time, and GB/s of weights (n = 1) or GFLOP/s (n = 512) of the
 * best. The last lines add the shapes up as the model runs them (28 layers;
 * the head once per token in decode, once per prompt in prefill) into the
 * matmul-only bound on decode tok/s and pp512 tok/s: what the model could
 * reach if nothing but its matrix products took time.
 * Usage: bench_matmul [--threads N] (2) [--reps N] (7) [--types bf16,q8_0,q4_k]
 *                     [--isa auto|avx512_bf16|avx512_vnni|avx2|portable]
 *                     [--n 1|512|both] */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/setup.h"
#include "config/config.h"
#include "kernels/cpu/cpu.h"
#include "kernels/kernels.h"

#define N_LAYERS   28
#define MAX_COPIES 64
#define N_SHAPES   6

typedef struct shape {
    const char *name;
    int k, m, per_layer; /* per_layer 0: the head, once per forward pass */
} shape;

static const shape SHAPES[N_SHAPES] = {
    {"q", 1024, 2048, 1},       {"k,v", 1024, 1024, 2},  {"o", 2048, 1024, 1},
    {"gate,up", 1024, 3072, 2}, {"down", 3072, 1024, 1}, {"head", 1024, 151936, 0},
};
#define HEAD 5

static uint64_t rng = 88172645463325252ull;

static float frand(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
}

static void check(rk_status st, const char *what) {
    if (st != RK_OK) {
        fprintf(stderr, "bench_matmul: %s failed: %s (%s)\n", what, rk_status_str(st),
                rk_error_message());
        exit(1);
    }
}

static void *be_alloc(rk_backend *be, size_t n) {
    void *p = NULL;
    check(be->ops->alloc(be, n, &p), "alloc");
    return p;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Time reps calls after one warm-up, call r on copy r % n_w of the weights;
 * best and median in seconds. */
static void time_matmul(rk_backend *be, float *y, const float *x, void *const *w, int n_w,
                        rk_dtype t, int n, int k, int m, int reps, double *best, double *median) {
    double ts[64];
    if (reps > 64) reps = 64;
    check(be->ops->matmul(be, y, x, w[n_w - 1], t, n, k, m), "matmul");
    for (int r = 0; r < reps; r++) {
        double t0 = rk_time_now();
        check(be->ops->matmul(be, y, x, w[r % n_w], t, n, k, m), "matmul");
        ts[r] = rk_time_now() - t0;
    }
    qsort(ts, (size_t)reps, sizeof ts[0], cmp_double);
    *best = ts[0];
    *median = ts[reps / 2];
}

static int parse_isa(const char *s, rk_cpu_isa *out) {
    static const struct {
        const char *name;
        rk_cpu_isa isa;
    } names[] = {{"auto", RK_CPU_ISA_AUTO},
                 {"portable", RK_CPU_ISA_PORTABLE},
                 {"avx2", RK_CPU_ISA_AVX2},
                 {"avx512_vnni", RK_CPU_ISA_AVX512_VNNI},
                 {"avx512_bf16", RK_CPU_ISA_AVX512_BF16}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcmp(s, names[i].name) == 0) {
            *out = names[i].isa;
            return 1;
        }
    return 0;
}

static void bench_type(rk_backend *be, rk_dtype t, int reps, int do_decode, int do_prefill) {
    int n_max = 512, k_max = 3072;
    size_t m_max = 151936;
    float *wf = malloc(m_max * 1024 * sizeof(float));
    float *x = malloc((size_t)n_max * k_max * sizeof(float));
    float *y = be_alloc(be, (size_t)n_max * 3072 * sizeof(float) > m_max * sizeof(float)
                                ? (size_t)n_max * 3072 * sizeof(float)
                                : m_max * sizeof(float));
    if (!wf || !x) {
        fprintf(stderr, "bench_matmul: out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < m_max * 1024; i++) wf[i] = frand() * 0.05f;
    for (size_t i = 0; i < (size_t)n_max * k_max; i++) x[i] = frand();
    double sum_best[2] = {0, 0}, sum_med[2] = {0, 0};
    printf("\n%s weights\n", rk_dtype_name(t));
    printf("  %-12s %6s %7s %4s %10s %10s %10s\n", "shape", "k", "m", "n", "best ms", "median ms",
           "rate");
    for (int s = 0; s < N_SHAPES; s++) {
        const shape *sh = &SHAPES[s];
        size_t bytes = rk_dtype_row_bytes(t, (size_t)sh->k) * (size_t)sh->m;
        /* Decode reads each layer's weights from memory: enough copies to
         * pass 128 MiB (four times the L3) keep them from staying in cache. */
        int n_w = (int)(((size_t)128 << 20) / bytes) + 1;
        if (n_w > MAX_COPIES) n_w = MAX_COPIES;
        void *w[MAX_COPIES];
        w[0] = be_alloc(be, bytes);
        rk_quantize(w[0], wf, t, (size_t)sh->m * sh->k);
        for (int i = 1; i < n_w; i++) {
            w[i] = be_alloc(be, bytes);
            memcpy(w[i], w[0], bytes);
        }
        for (int pass = 0; pass < 2; pass++) {
            int n = pass == 0 ? 1 : n_max;
            if ((pass == 0 && !do_decode) || (pass == 1 && !do_prefill)) continue;
            /* the head of a prefill runs on the last token only */
            if (pass == 1 && s == HEAD) continue;
            double best, med;
            time_matmul(be, y, x, w, pass == 0 ? n_w : 1, t, n, sh->k, sh->m, reps, &best, &med);
            if (pass == 0)
                printf("  %-12s %6d %7d %4d %10.3f %10.3f %7.1f GB/s\n", sh->name, sh->k, sh->m, n,
                       best * 1e3, med * 1e3, (double)bytes / best * 1e-9);
            else
                printf("  %-12s %6d %7d %4d %10.3f %10.3f %7.1f GFLOP/s\n", sh->name, sh->k, sh->m,
                       n, best * 1e3, med * 1e3, 2.0 * n * sh->k * sh->m / best * 1e-9);
            int times = s == HEAD ? 1 : N_LAYERS * sh->per_layer;
            sum_best[pass] += times * best;
            sum_med[pass] += times * med;
            /* prefill: the head at n = 1, measured on the decode pass */
            if (pass == 0 && s == HEAD) {
                sum_best[1] += best;
                sum_med[1] += med;
            }
        }
        for (int i = 0; i < n_w; i++) be->ops->free(be, w[i]);
    }
    if (do_decode)
        printf("  matmul-only bound, decode: %.1f tok/s (best), %.1f (median)\n", 1.0 / sum_best[0],
               1.0 / sum_med[0]);
    if (do_prefill && do_decode)
        printf("  matmul-only bound, pp512: %.1f tok/s (best), %.1f (median)\n",
               n_max / sum_best[1], n_max / sum_med[1]);
    free(wf);
    free(x);
    be->ops->free(be, y);
}

typedef struct opts {
    int n_threads, reps;
    char types[128], isa[16], n[8];
} opts;

#define O_OFF(f) offsetof(opts, f)
#define O_STR(f) O_OFF(f), sizeof(((opts *)0)->f)

static const rk_setting k_settings[] = {
    {"threads", "threads", RK_SET_INT, O_OFF(n_threads), 0, 0, 1024, 0, 0,
     "N  backend threads (default: 2; 0 = one per core)"},
    {"reps", "reps", RK_SET_INT, O_OFF(reps), 0, 1, 1000, 0, 0,
     "N  timed runs of every case (default: 7)"},
    {"types", "types", RK_SET_STR, O_STR(types), 0, 0, 0, 0,
     "LIST  weight types, comma-separated (default: bf16,q8_0,q4_k)"},
    {"isa", "isa", RK_SET_STR, O_STR(isa), 0, 0, 0, 0,
     "ISA  auto (default), avx512_bf16, avx512_vnni, avx2 or portable"},
    {"n", "n", RK_SET_STR, O_STR(n), 0, 0, 0, 0,
     "ROWS  1 (decode), 512 (prefill) or both (default)"},
};

int main(int argc, char **argv) {
    static const char *usage =
        "usage: bench_matmul [--threads N] [--reps N] [--types LIST] [--isa ISA] [--n 1|512|both]\n"
        "The CPU matmul at the qwen3-0.6b shapes per weight type, and the matmul-only bounds\n"
        "on decode and pp512 tok/s they imply.\n";
    opts o = {.n_threads = 2, .reps = 7, .types = "bf16,q8_0,q4_k", .isa = "auto", .n = "both"};
    rk_settings own = {k_settings, sizeof k_settings / sizeof k_settings[0], &o};
    int exit_code;
    if (rk_bench_parse("bench_matmul", usage, NULL, 0, &own, argc, argv, &exit_code))
        return exit_code;
    rk_cpu_isa isa;
    if (!parse_isa(o.isa, &isa)) {
        fprintf(stderr,
                "bench_matmul: --isa takes auto, avx512_bf16, avx512_vnni, avx2 or portable, "
                "got '%s'\n",
                o.isa);
        return 2;
    }
    if (strcmp(o.n, "1") && strcmp(o.n, "512") && strcmp(o.n, "both")) {
        fprintf(stderr, "bench_matmul: --n takes 1, 512 or both, got '%s'\n", o.n);
        return 2;
    }
    int n_threads = o.n_threads, reps = o.reps, do_decode = strcmp(o.n, "512") != 0,
        do_prefill = strcmp(o.n, "1") != 0;
    const char *types = o.types;
    rk_backend *be = NULL;
    check(rk_backend_create("cpu", n_threads, &be), "backend_create");
    check(rk_cpu_force_isa(isa), "force_isa");
    printf("bench_matmul: CPU backend, %d threads, %d reps, isa %d\n", be->n_threads, reps,
           (int)rk_cpu_isa_active());
    char buf[256];
    snprintf(buf, sizeof buf, "%s", types);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        int t = 0;
        while (t < RK_DTYPE_COUNT && strcmp(rk_dtype_name((rk_dtype)t), tok) != 0) t++;
        if (t == RK_DTYPE_COUNT) {
            fprintf(stderr, "bench_matmul: unknown type %s\n", tok);
            return 2;
        }
        bench_type(be, (rk_dtype)t, reps, do_decode, do_prefill);
    }
    rk_backend_free(be);
    return 0;
}
