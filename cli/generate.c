/* cli/generate.c — `ragkv generate`, `tokenize` and `detokenize`: prompts
 * answered in-process (no HTTP), and the tokenizer on its own. */
#include <errno.h>
#include <jansson.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli/cli.h"
#include "engine/gguf.h"
#include "gateway/report.h"

/* ---------------------------------------------------------------- generate */

typedef struct print_ctx {
    const rk_tokenizer *tok;
    int32_t prev;
} print_ctx;

/* Stream each piece as it is generated (the first piece after BOS loses its
 * leading space, as llama2.c prints). */
static void print_token(void *ctx, int req, int32_t token) {
    print_ctx *p = ctx;
    (void)req;
    char *text;
    size_t len;
    int skip = p->prev == rk_tokenizer_bos(p->tok);
    if (rk_tokenizer_decode(p->tok, &token, 1, 0, skip, &text, &len) == RK_OK) {
        fwrite(text, 1, len, stdout);
        fflush(stdout);
        free(text);
    }
    p->prev = token;
}

/* Parse an on/off style choice; returns the index of arg in names or -1. */
static int choice(const char *arg, const char *a, const char *b) {
    return !strcmp(arg, a) ? 0 : !strcmp(arg, b) ? 1 : -1;
}

/* Run one prompt through the pipeline and print it. Returns an exit status. */
static int generate_one(rk_service *svc, const char *prompt, const char *sep,
                        const rk_req_options *opt, int json, int index) {
    rk_split pieces;
    if (rk_split_prompt(prompt, strlen(prompt), sep, svc->cfg.max_chunks, &pieces))
        return fail("bad prompt");
    rk_request r = {.opt = *opt};
    rk_status st = rk_request_prepare(svc, &pieces, &r);
    rk_split_free(&pieces);
    if (st) return fail("bad prompt");
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    print_ctx pc = {.tok = tok,
                    .prev = r.n_question ? r.question[r.n_question - 1] : r.sys[r.n_sys - 1]};
    rk_pipeline_hooks hooks = {.ctx = &pc, .on_token = json ? NULL : print_token};
    rk_request *one = &r;
    if (rk_pipeline_run(svc, &one, 1, &hooks)) {
        if (!json) fputc('\n', stdout);
        rk_request_free(&r);
        return fail("generation failed");
    }
    if (json) {
        char id[32];
        snprintf(id, sizeof id, "cmpl-%d", index);
        const char *name = rk_model_hparams(svc->model)->name;
        json_t *root = rk_report_completion(tok, &r, id, (long)time(NULL), name);
        char *s = root ? json_dumps(root, JSON_COMPACT) : NULL;
        json_decref(root);
        if (!s) {
            rk_request_free(&r);
            rk_error_setf("out of memory");
            return fail("generate");
        }
        puts(s);
        free(s);
    }
    rk_request_free(&r);
    return 0;
}

/* generate's own options: the settings in k_generate_settings, the rest
 * through generate_extra. */
typedef struct gen_args {
    rk_req_options opt;
    long long repeat;
    long long seed; /* -1: random */
    int json;
    int prefix_cache; /* -1: the mode's default */
    char prompts_file[4096];
    const char *prompt, *sep;
} gen_args;

#define G_OFF(m) offsetof(gen_args, m)

static const rk_setting k_generate_settings[] = {
    {"prompts", "prompts", RK_SET_STR, G_OFF(prompts_file), sizeof(((gen_args *)0)->prompts_file),
     0, 0, 0, 0, "FILE  one prompt per line, run in order in one process"},
    {"repeat", "repeat", RK_SET_LONG, G_OFF(repeat), 0, 1, 1000000, 0, 0,
     "N  run the prompt(s) N times (default: 1), sharing the caches"},
    {"max_tokens", "max-tokens", RK_SET_INT, G_OFF(opt.max_tokens), 0, 0, 1 << 20, 0, 0,
     "N  tokens to generate, also -n N (default: 128)"},
    {"temperature", "temp", RK_SET_FLOAT, G_OFF(opt.sampling.temperature), 0, 0, 100, 0, 0,
     "T  sampling temperature, 0 = greedy (default: 1.0)"},
    {"top_k", "top-k", RK_SET_INT, G_OFF(opt.sampling.top_k), 0, 0, 1 << 24, 0, 0,
     "K  keep the K most likely tokens (default: 0 = off)"},
    {"top_p", "top-p", RK_SET_FLOAT, G_OFF(opt.sampling.top_p), 0, 1e-6, 1, 0, 0,
     "P  nucleus sampling threshold (default: 1.0 = off)"},
    {"seed", "seed", RK_SET_LONG, G_OFF(seed), 0, 0, 0x7fffffffffffffffLL, 0, 0,
     "S  sampling seed (default: random)"},
    {"stop_at_eog", "ignore-eos", RK_SET_BOOL, G_OFF(opt.stop_at_eog), 0, 0, 1, 1, 0,
     "  keep generating after an end-of-generation token"},
    {"prefix_cache", "no-prefix-cache", RK_SET_BOOL, G_OFF(prefix_cache), 0, 0, 1, 1, 0,
     "  do not reuse the system prompt through the radix cache"},
    {"repair_k", "repair-k", RK_SET_INT, G_OFF(opt.repair_k), 0, 0, 1 << 20, 0, 0,
     "K  repair: recompute the first K tokens of each chunk over the merged cache (0 = off)"},
    {"repair_ratio", "repair-ratio", RK_SET_FLOAT, G_OFF(opt.repair_ratio), 0, 0, 1, 0, 0,
     "R  repair: recompute the fraction R of chunk tokens that deviate most (0 = off)"},
    {"repair_query", "repair-query", RK_SET_BOOL, G_OFF(opt.repair_query), 0, 0, 1, 0, 0,
     "  with --repair-ratio: the tokens the question attends to most or that deviate most, "
     "in turn (policy query)"},
    {"logprobs", "logprobs", RK_SET_INT, G_OFF(opt.n_logprobs), 0, 0, 20, 0, 0,
     "N  top-N log-probabilities per token (0-20, with --json)"},
    {"json", "json", RK_SET_BOOL, G_OFF(json), 0, 0, 1, 0, 0,
     "  one completion object per request, as POST /v1/completions"},
};

enum { O_PROMPT = 1, O_SEP, O_CC, O_MODE, O_CTX, O_POS };

static const struct option k_generate_extra[] = {{"prompt", required_argument, 0, O_PROMPT},
                                                 {"separator", required_argument, 0, O_SEP},
                                                 {"chunk-cache", required_argument, 0, O_CC},
                                                 {"mode", required_argument, 0, O_MODE},
                                                 {"chunk-context", required_argument, 0, O_CTX},
                                                 {"position-mode", required_argument, 0, O_POS},
                                                 {0, 0, 0, 0}};

/* Choices and free text: what a settings table does not express. */
static rk_status generate_extra(void *ctx, int val, const char *arg) {
    gen_args *g = ctx;
    int r = 0;
    switch (val) {
    case 'n': {
        rk_settings own = {k_generate_settings,
                           sizeof k_generate_settings / sizeof k_generate_settings[0], g};
        return rk_setting_parse(g, rk_settings_find(&own, 1, "max_tokens", NULL), arg);
    }
    case O_PROMPT: g->prompt = arg; return RK_OK;
    case O_SEP:
        if (rk_separator_check(arg)) return rk_errorf(RK_ERR_INVALID, "bad --separator '%s'", arg);
        g->sep = arg;
        return RK_OK;
    case O_CC:
        if ((r = choice(arg, "off", "on")) < 0)
            return rk_errorf(RK_ERR_INVALID, "--chunk-cache is on or off, not '%s'", arg);
        g->opt.chunk_cache = r;
        return RK_OK;
    case O_MODE:
        if ((r = choice(arg, "rag", "plain")) < 0)
            return rk_errorf(RK_ERR_INVALID, "--mode is rag or plain, not '%s'", arg);
        g->opt.mode = r ? RK_MODE_PLAIN : RK_MODE_RAG;
        return RK_OK;
    case O_CTX:
        if (!strcmp(arg, "anchor")) {
            g->opt.chunk_context = RK_CONTEXT_ANCHOR;
            return RK_OK;
        }
        if ((r = choice(arg, "isolated", "system")) < 0)
            return rk_errorf(RK_ERR_INVALID,
                             "--chunk-context is isolated, system or anchor, not '%s'", arg);
        g->opt.chunk_context = r ? RK_CONTEXT_SYSTEM : RK_CONTEXT_ISOLATED;
        return RK_OK;
    case O_POS:
        if ((r = choice(arg, "sequential", "parallel")) < 0)
            return rk_errorf(RK_ERR_INVALID, "--position-mode is sequential or parallel, not '%s'",
                             arg);
        g->opt.positions = r ? RK_POSITIONS_PARALLEL : RK_POSITIONS_SEQUENTIAL;
        return RK_OK;
    }
    return rk_errorf(RK_ERR_INVALID, "unknown option");
}

int rk_cli_generate(int argc, char **argv) {
    static const char *help =
        "usage: ragkv generate [--model F.gguf] (--prompt TEXT | --prompts FILE) [options]\n"
        "Answer prompts in-process (no HTTP). A prompt may be `system##chunk##...##question`:\n"
        "each chunk's KV is computed once and reused wherever it appears again.\n"
        "  --prompt TEXT         the prompt (BOS is added when the model asks for it)\n"
        "  --separator S         piece separator (default: ##; \\#\\# is a literal ##)\n"
        "  --chunk-cache on|off  off = the oracle: chunks computed fresh at their position\n"
        "  --mode rag|plain      plain = the pieces as one ordinary sequence, no caches\n"
        "  --chunk-context isolated|system|anchor   what a chunk's KV is computed after\n"
        "  --position-mode sequential|parallel   where chunks go in the sequence\n";
    rk_run_opts o;
    rk_run_opts_defaults(&o);
    gen_args g = {.repeat = 1, .seed = -1, .prefix_cache = -1, .sep = "##"};
    rk_req_options_default(&g.opt);
    rk_settings own = {k_generate_settings,
                       sizeof k_generate_settings / sizeof k_generate_settings[0], &g};
    rk_cmdline cl = {.cmd = "generate",
                     .usage = help,
                     .extra = k_generate_extra,
                     .shorts = "n:",
                     .on_extra = generate_extra,
                     .ctx = &g};
    int exit_code;
    if (rk_cli_parse_run(&cl, &o, &own, 1, argc, argv, &exit_code)) return exit_code;
    rk_req_options opt = g.opt;
    opt.sampling.seed =
        g.seed >= 0 ? (uint64_t)g.seed : (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    const char *prompt = g.prompt, *prompts_file = g.prompts_file[0] ? g.prompts_file : NULL;
    const char *sep = g.sep;
    long repeat = (long)g.repeat;
    int json = g.json, prefix_flag = g.prefix_cache;
    if (!prompt == !prompts_file)
        return usage_error("generate", "%s", "give exactly one of --prompt and --prompts");
    /* Plain mode is the no-cache reference unless asked otherwise. */
    opt.prefix_cache = prefix_flag >= 0 ? prefix_flag : opt.mode == RK_MODE_RAG;

    /* The prompts: one, or one per line of the file. */
    char *file_text = NULL, **lines = NULL;
    size_t n_lines = 0;
    if (prompts_file) {
        FILE *f = fopen(prompts_file, "rb");
        if (!f) {
            rk_error_setf("%s: %s", prompts_file, strerror(errno));
            return fail("cannot read the prompts");
        }
        size_t cap = 0, len = 0;
        char buf[65536];
        size_t k;
        while ((k = fread(buf, 1, sizeof buf, f)) > 0) {
            if (len + k + 1 > cap) {
                cap = (len + k + 1) * 2;
                char *nt = realloc(file_text, cap);
                if (!nt) break;
                file_text = nt;
            }
            memcpy(file_text + len, buf, k);
            len += k;
        }
        fclose(f);
        if (!file_text) file_text = calloc(1, 1);
        if (!file_text) return fail("out of memory");
        file_text[len] = '\0';
        for (char *p = file_text; *p;) {
            char *nl = strchr(p, '\n');
            if (nl) *nl = '\0';
            if (*p) {
                char **nlines = realloc(lines, (n_lines + 1) * sizeof *lines);
                if (!nlines) break;
                lines = nlines;
                lines[n_lines++] = p;
            }
            if (!nl) break;
            p = nl + 1;
        }
    }
    rk_service *svc;
    if (open_service(&o, &svc)) {
        free(file_text);
        free(lines);
        return fail("cannot start");
    }
    int rc = 0, index = 0;
    size_t n_prompts = prompts_file ? n_lines : 1;
    for (long rep = 0; rep < repeat && rc == 0; rep++)
        for (size_t i = 0; i < n_prompts && rc == 0; i++) {
            rc = generate_one(svc, prompts_file ? lines[i] : prompt, sep, &opt, json, index++);
            if (!json && rc == 0 && (n_prompts > 1 || repeat > 1 || isatty(STDOUT_FILENO)))
                fputc('\n', stdout);
        }
    free(file_text);
    free(lines);
    rk_service_close(svc);
    return rc;
}

/* ---------------------------------------------------------------- tokenize / detokenize */

/* tokenize and detokenize: the text or ids, and whether specials count. */
typedef struct tok_args {
    int special;
    const char *text;
} tok_args;

static const rk_setting k_tokenize_settings[] = {
    {"special", "special", RK_SET_BOOL, offsetof(tok_args, special), 0, 0, 1, 0, 0,
     "  special tokens: recognised in the text (tokenize), rendered (detokenize)"},
};

static rk_status tok_extra(void *ctx, int val, const char *arg) {
    ((tok_args *)ctx)->text = arg;
    return RK_OK;
}

/* Parse tokenize's or detokenize's command line; the one extra option
 * (--text or --ids, named by flag) is required. */
static int parse_tok_args(const char *cmd, const char *help, const char *flag, int argc,
                          char **argv, rk_run_opts *o, tok_args *t, int *out_exit) {
    rk_run_opts_defaults(o);
    rk_settings own = {k_tokenize_settings, 1, t};
    struct option extra[] = {{flag, required_argument, 0, 1}, {0, 0, 0, 0}};
    rk_cmdline cl = {.cmd = cmd, .usage = help, .extra = extra, .on_extra = tok_extra, .ctx = t};
    if (rk_cli_parse_run(&cl, o, &own, 1, argc, argv, out_exit)) return -1;
    if (!t->text) {
        char what[64];
        snprintf(what, sizeof what, "--%s is required", flag);
        *out_exit = usage_error(cmd, "%s", what);
        return -1;
    }
    return 0;
}

int rk_cli_tokenize(int argc, char **argv) {
    static const char *help = "usage: ragkv tokenize [--model F.gguf] --text TEXT [--special]\n"
                              "Print the token ids of TEXT as a JSON array (no BOS added).\n"
                              "  --text TEXT           the text\n";
    rk_run_opts o;
    tok_args ta = {0};
    int exit_code;
    if (parse_tok_args("tokenize", help, "text", argc, argv, &o, &ta, &exit_code)) return exit_code;
    const char *text = ta.text;
    int special = ta.special;
    /* Only the tokenizer is needed: read it from the file without loading weights. */
    rk_tokenizer *tok = NULL;
    rk_service *svc = NULL;
    rk_gguf *g = NULL;
    if (o.model[0]) {
        if (rk_gguf_open(o.model, &g) || rk_tokenizer_from_gguf(g, &tok)) {
            rk_gguf_close(g);
            return fail("cannot read the tokenizer");
        }
    } else if (open_service(&o, &svc)) {
        return fail("cannot start");
    }
    const rk_tokenizer *t = tok ? tok : rk_model_tokenizer(svc->model);
    int32_t *ids = NULL;
    size_t n = 0;
    int rc = 0;
    if (rk_tokenizer_encode(t, text, strlen(text), special, &ids, &n)) {
        rc = fail("cannot tokenize");
    } else {
        fputc('[', stdout);
        for (size_t i = 0; i < n; i++) printf("%s%d", i ? ", " : "", ids[i]);
        fputs("]\n", stdout);
    }
    free(ids);
    rk_tokenizer_free(tok);
    rk_gguf_close(g);
    rk_service_close(svc);
    return rc;
}

int rk_cli_detokenize(int argc, char **argv) {
    static const char *help = "usage: ragkv detokenize [--model F.gguf] --ids 1,2,3 [--special]\n"
                              "Print the text of comma-separated token ids.\n"
                              "  --ids 1,2,3           the token ids\n";
    rk_run_opts o;
    tok_args ta = {0};
    int exit_code;
    if (parse_tok_args("detokenize", help, "ids", argc, argv, &o, &ta, &exit_code))
        return exit_code;
    const char *ids_arg = ta.text;
    int special = ta.special;
    size_t cap = strlen(ids_arg) / 2 + 1, n = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    if (!ids) return fail("out of memory");
    for (const char *p = ids_arg; *p;) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX || (*end && *end != ',') || n == cap) {
            free(ids);
            return usage_error("detokenize", "bad --ids '%s' (want e.g. 1,2,3)", ids_arg);
        }
        ids[n++] = (int32_t)v;
        p = *end ? end + 1 : end;
    }
    rk_tokenizer *tok = NULL;
    rk_service *svc = NULL;
    rk_gguf *g = NULL;
    int rc = 0;
    if (o.model[0]) {
        if (rk_gguf_open(o.model, &g) || rk_tokenizer_from_gguf(g, &tok))
            rc = fail("cannot read the tokenizer");
    } else if (open_service(&o, &svc)) {
        rc = fail("cannot start");
    }
    if (rc == 0) {
        const rk_tokenizer *t = tok ? tok : rk_model_tokenizer(svc->model);
        char *text;
        size_t len;
        for (size_t i = 0; i < n; i++)
            if (ids[i] >= rk_tokenizer_n_vocab(t)) {
                rk_error_setf("token id %d is out of range [0, %d)", ids[i],
                              rk_tokenizer_n_vocab(t));
                rc = fail("cannot detokenize");
                break;
            }
        if (rc == 0 && rk_tokenizer_decode(t, ids, n, special, 0, &text, &len) == RK_OK) {
            fwrite(text, 1, len, stdout);
            fputc('\n', stdout);
            free(text);
        } else if (rc == 0) {
            rc = fail("cannot detokenize");
        }
    }
    free(ids);
    rk_tokenizer_free(tok);
    rk_gguf_close(g);
    rk_service_close(svc);
    return rc;
}
