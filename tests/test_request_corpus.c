/* tests/test_request_corpus.c — the fuzz corpus (fuzz/corpus/) replayed
 * through the request parsers with the fuzz target's own invariant checks
 * (fuzz/fuzz_request.c is included here), plus the outcome each hand-written
 * seed promises by its name: ok-* and chat-ok-* parse as a completion or chat
 * body, prewarm-ok-* and flush-ok-* as those bodies, resp-ok-* translate as
 * a POST /v1/responses body into a chat body that parses, resp400-* are
 * refused with 400 (translated or parsed), badNNN-* fail with HTTP
 * status NNN as a completion body, head-ok-* pass the framing check as a
 * request head and headNNN-* are refused by it with status NNN. */
#include <criterion/criterion.h>
#include <math.h>
#include <dirent.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../fuzz/fuzz_request.c"
#include "tests/testutil.h"

/* fuzz/corpus next to this file's folder. */
static const char *corpus_dir(void) {
    static char dir[4096];
    char here[4096];
    snprintf(here, sizeof here, "%s", __FILE__);
    snprintf(dir, sizeof dir, "%s/../fuzz/corpus", dirname(here));
    return dir;
}

typedef struct input {
    char name[256];
    char *data;
    size_t len;
} input;

static int load_corpus(input **out) {
    DIR *d = opendir(corpus_dir());
    cr_assert(d, "cannot open %s", corpus_dir());
    int n = 0, cap = 64;
    input *v = malloc((size_t)cap * sizeof *v);
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        if (n == cap) v = realloc(v, (size_t)(cap *= 2) * sizeof *v);
        char path[8192];
        snprintf(path, sizeof path, "%s/%s", corpus_dir(), e->d_name);
        snprintf(v[n].name, sizeof v[n].name, "%s", e->d_name);
        v[n].data = rk_test_read_file(path, &v[n].len);
        cr_assert(v[n].data, "cannot read %s", path);
        n++;
    }
    closedir(d);
    *out = v;
    return n;
}

static void free_corpus(input *v, int n) {
    for (int i = 0; i < n; i++) free(v[i].data);
    free(v);
}

Test(request_corpus, every_input_keeps_the_parser_invariants) {
    input *v;
    int n = load_corpus(&v);
    cr_assert(n >= 20, "the corpus has only %d inputs", n);
    for (int i = 0; i < n; i++) {
        const char *bad = rk_fuzz_request_check((const uint8_t *)v[i].data, v[i].len);
        cr_assert_null(bad, "%s: %s", v[i].name, bad ? bad : "");
    }
    free_corpus(v, n);
}

Test(request_corpus, named_seeds_give_their_promised_outcome) {
    input *v;
    int n = load_corpus(&v), checked = 0;
    rk_parse_limits lim = {.max_chunks = FUZZ_MAX_CHUNKS, .max_tokens = FUZZ_MAX_TOKENS};
    for (int i = 0; i < n; i++) {
        const char *name = v[i].name;
        rk_http_error err = {0};
        if (!strncmp(name, "ok-", 3) || !strncmp(name, "chat-ok-", 8)) {
            int chat = name[0] == 'c';
            rk_api_request r;
            rk_status st = rk_api_parse(v[i].data, v[i].len, chat, &lim, &r, &err);
            cr_assert_eq(st, RK_OK, "%s: %d %s", name, err.status, err.message);
            if (chat) {
                cr_assert_eq(rk_chat_render(RK_CHAT_CHATML, &r, FUZZ_MAX_CHUNKS, &err), RK_OK,
                             "%s: %s", name, err.message);
                cr_assert(strstr(r.pieces.system.s, "<|im_start|>user\n"));
                cr_assert(strstr(r.pieces.question.s, "<|im_start|>assistant\n"));
            }
            rk_api_request_free(&r);
        } else if (!strncmp(name, "prewarm-ok-", 11)) {
            rk_prewarm_request p;
            cr_assert_eq(rk_prewarm_parse(v[i].data, v[i].len, &p, &err), RK_OK, "%s: %s", name,
                         err.message);
            rk_prewarm_request_free(&p);
        } else if (!strncmp(name, "flush-ok-", 9)) {
            rk_flush_request f;
            cr_assert_eq(rk_flush_parse(v[i].data, v[i].len, &f, &err), RK_OK, "%s", name);
        } else if (!strncmp(name, "bad", 3)) {
            int want = atoi(name + 3);
            rk_api_request r;
            cr_assert_neq(rk_api_parse(v[i].data, v[i].len, 0, &lim, &r, &err), RK_OK, "%s", name);
            cr_assert_eq(err.status, want, "%s: want %d, got %d (%s)", name, want, err.status,
                         err.message);
        } else if (!strncmp(name, "resp-ok-", 8) || !strncmp(name, "resp400-", 8)) {
            const char *bad = NULL;
            int outcome = rk_fuzz_responses((const uint8_t *)v[i].data, v[i].len, &err, &bad);
            cr_assert_null(bad, "%s: %s", name, bad ? bad : "");
            cr_assert_eq(outcome, name[4] == '-' ? 0 : 1, "%s: %d %s", name, err.status,
                         err.message);
            if (outcome) cr_assert_eq(err.status, 400, "%s: %s", name, err.message);
        } else if (!strncmp(name, "head-ok-", 8)) {
            rk_gw_framing f;
            cr_assert_eq(rk_fuzz_head_verdict((const uint8_t *)v[i].data, v[i].len, &f), 0,
                         "%s: %d %s", name, f.status, f.message);
        } else if (!strncmp(name, "head", 4)) {
            int want = atoi(name + 4);
            rk_gw_framing f;
            cr_assert_eq(rk_fuzz_head_verdict((const uint8_t *)v[i].data, v[i].len, &f), -1, "%s",
                         name);
            cr_assert_eq(f.status, want, "%s: want %d, got %d (%s)", name, want, f.status,
                         f.message);
        } else {
            continue;
        }
        checked++;
    }
    cr_assert(checked >= 20, "only %d named seeds", checked);
    free_corpus(v, n);
}

/* A request without repair, or with "policy": "auto", takes the service's
 * policy; one that names a policy takes it, "none" included. */
Test(request_corpus, repair_defaults_to_the_service_policy_and_auto_names_it) {
    rk_parse_limits lim = {.max_chunks = 8, .max_tokens = 64, .repair_k = 2};
    static const struct {
        const char *body;
        int k;
        float ratio;
        int query;
    } cases[] = {
        {"{\"prompt\": \"S##c##Q\"}", 2, 0, 0},
        {"{\"prompt\": \"S##c##Q\", \"repair\": {\"policy\": \"auto\"}}", 2, 0, 0},
        {"{\"prompt\": \"S##c##Q\", \"repair\": {}}", 2, 0, 0},
        {"{\"prompt\": \"S##c##Q\", \"repair\": {\"policy\": \"none\"}}", 0, 0, 0},
        {"{\"prompt\": \"S##c##Q\", \"repair\": {\"policy\": \"first_k\", \"k\": 5}}", 5, 0, 0},
        {"{\"prompt\": \"S##c##Q\", \"repair\": {\"policy\": \"deviation\", \"ratio\": 0.1}}", 0,
         0.1f, 0},
        {"{\"prompt\": \"S##c##Q\", \"repair\": {\"policy\": \"query\", \"ratio\": 0.05}}", 0,
         0.05f, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        rk_api_request r;
        rk_http_error err = {0};
        cr_assert_eq(rk_api_parse(cases[i].body, strlen(cases[i].body), 0, &lim, &r, &err), RK_OK,
                     "%s: %s", cases[i].body, err.message);
        cr_expect_eq(r.opt.repair_k, cases[i].k, "%s", cases[i].body);
        cr_expect(fabsf(r.opt.repair_ratio - cases[i].ratio) < 1e-7f, "%s", cases[i].body);
        cr_expect_eq(r.opt.repair_query, cases[i].query, "%s", cases[i].body);
        rk_api_request_free(&r);
    }
    /* A service whose policy (or calibration) is query serves it to auto. */
    rk_parse_limits qlim = {
        .max_chunks = 8, .max_tokens = 64, .repair_ratio = 0.05f, .repair_query = 1};
    const char *a = "{\"prompt\": \"S##c##Q\", \"repair\": {\"policy\": \"auto\"}}";
    rk_api_request q;
    rk_http_error qerr = {0};
    cr_assert_eq(rk_api_parse(a, strlen(a), 0, &qlim, &q, &qerr), RK_OK);
    cr_expect_eq(q.opt.repair_query, 1);
    cr_expect(fabsf(q.opt.repair_ratio - 0.05f) < 1e-7f);
    rk_api_request_free(&q);
    const char *bad = "{\"prompt\": \"S##c##Q\", \"repair\": {\"policy\": \"best\"}}";
    rk_api_request r;
    rk_http_error err = {0};
    cr_expect_neq(rk_api_parse(bad, strlen(bad), 0, &lim, &r, &err), RK_OK);
    cr_expect_eq(err.status, 400);
}

Test(request_corpus, chat_templates_put_chunks_between_system_and_question) {
    const char *body = "{\"messages\": [{\"role\": \"system\", \"content\": \"S\"}, {\"role\": "
                       "\"user\", \"content\": \"c1##c2##Q\"}], \"separator\": \"##\"}";
    rk_parse_limits lim = {.max_chunks = 8, .max_tokens = 64};
    static const char *want_sys[] = {
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n",
        "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>user<|end_"
        "header_id|>\n\n",
        "[INST] <<SYS>>\nS\n<</SYS>>\n\n"};
    static const char *want_q[] = {"Q<|im_end|>\n<|im_start|>assistant\n",
                                   "Q<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
                                   "Q [/INST]"};
    for (int t = 0; t < 3; t++) {
        rk_api_request r;
        rk_http_error err = {0};
        cr_assert_eq(rk_api_parse(body, strlen(body), 1, &lim, &r, &err), RK_OK);
        cr_assert_eq(rk_chat_render((rk_chat_template)t, &r, 8, &err), RK_OK, "%s", err.message);
        cr_assert_str_eq(r.pieces.system.s, want_sys[t]);
        cr_assert_eq(r.pieces.n_chunks, 2);
        cr_assert_str_eq(r.pieces.chunks[0].s, "c1");
        cr_assert_str_eq(r.pieces.chunks[1].s, "c2");
        cr_assert_str_eq(r.pieces.question.s, want_q[t]);
        rk_api_request_free(&r);
    }
    cr_assert_eq(rk_chat_template_detect("{% if x %}<|im_start|>", "llama", 0, 0), RK_CHAT_CHATML);
    cr_assert_eq(rk_chat_template_detect(NULL, "qwen3", 0, 0), RK_CHAT_CHATML);
    cr_assert_eq(rk_chat_template_detect(NULL, "llama", 1, 0), RK_CHAT_LLAMA3);
    cr_assert_eq(rk_chat_template_detect(NULL, "llama", 0, 0), RK_CHAT_LLAMA2);
}
