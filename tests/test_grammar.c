/* tests/test_grammar.c — the grammar engine (engine/grammar*.c): grammar
 * text, JSON Schema compilation and its errors, and constrained walks over
 * the real Qwen3 vocabulary: every walk gives JSON that jansson parses and
 * that a validator written here (for the supported subset, patterns checked
 * with PCRE2) accepts, and sampled mask bits agree with a byte-level replay. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "engine/engine.h"
#include "engine/grammar.h"
#include "testutil.h"

#define QWEN3_N_VOCAB 151936

static rk_tokenizer *g_tok;
static rk_grammar_vocab *g_vocab;

/* The Qwen3 tokenizer and its trie, built once for the suite. */
static void need_qwen3(void) {
    if (g_vocab) return;
    const char *path;
    RK_REQUIRE_SHARED(path, "tokenizers/qwen3/tokenizer.json");
    rk_vocab v;
    cr_assert_eq(rk_vocab_from_hf_json(path, QWEN3_N_VOCAB, &v), RK_OK, "%s", rk_error_message());
    free((char *)path);
    cr_assert_eq(rk_tokenizer_create(&v, &g_tok), RK_OK, "%s", rk_error_message());
    rk_vocab_free(&v);
    cr_assert_eq(rk_grammar_vocab_create(g_tok, &g_vocab), RK_OK, "%s", rk_error_message());
}

static json_t *parse_json(const char *s) {
    json_error_t e;
    json_t *j = json_loads(s, JSON_DECODE_ANY, &e);
    cr_assert_not_null(j, "bad test JSON: %s: %s", e.text, s);
    return j;
}

/* ---------------------------------------------------- a small validator */

static int utf8_chars(const char *s) {
    int n = 0;
    for (; *s; s++) n += ((unsigned char)*s & 0xC0) != 0x80;
    return n;
}

static int validate(const json_t *root, const json_t *s, const json_t *v, char *why, size_t cap);

static int fail(char *why, size_t cap, const char *msg, const json_t *v) {
    char *d = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    snprintf(why, cap, "%s: %s", msg, d ? d : "?");
    free(d);
    return 0;
}

static int type_ok(const char *t, const json_t *v) {
    if (!strcmp(t, "string")) return json_is_string(v);
    if (!strcmp(t, "integer")) return json_is_integer(v);
    if (!strcmp(t, "number")) return json_is_number(v);
    if (!strcmp(t, "boolean")) return json_is_boolean(v);
    if (!strcmp(t, "null")) return json_is_null(v);
    if (!strcmp(t, "object")) return json_is_object(v);
    if (!strcmp(t, "array")) return json_is_array(v);
    return 0;
}

static int validate(const json_t *root, const json_t *s, const json_t *v, char *why, size_t cap) {
    if (json_is_true(s)) return 1;
    const json_t *ref = json_object_get(s, "$ref");
    if (ref) {
        const char *r = json_string_value(ref);
        const json_t *t =
            !strcmp(r, "#") ? root : json_object_get(json_object_get(root, "$defs"), r + 8);
        return validate(root, t, v, why, cap);
    }
    const json_t *any = json_object_get(s, "anyOf");
    if (any) {
        for (size_t i = 0; i < json_array_size(any); i++)
            if (validate(root, json_array_get(any, i), v, why, cap)) return 1;
        return fail(why, cap, "no anyOf branch matches", v);
    }
    const json_t *en = json_object_get(s, "enum");
    if (en) {
        for (size_t i = 0; i < json_array_size(en); i++)
            if (json_equal(json_array_get(en, i), (json_t *)v)) return 1;
        return fail(why, cap, "not in enum", v);
    }
    const json_t *cn = json_object_get(s, "const");
    if (cn && !json_equal((json_t *)cn, (json_t *)v)) return fail(why, cap, "not the const", v);
    const json_t *type = json_object_get(s, "type");
    if (json_is_string(type) && !type_ok(json_string_value(type), v))
        return fail(why, cap, "wrong type", v);
    if (json_is_array(type)) {
        int ok = 0;
        for (size_t i = 0; i < json_array_size(type); i++)
            ok |= type_ok(json_string_value(json_array_get(type, i)), v);
        if (!ok) return fail(why, cap, "wrong type", v);
    }
    if (json_is_number(v)) {
        double x = json_number_value(v);
        const json_t *b;
        if ((b = json_object_get(s, "minimum")) && x < json_number_value(b))
            return fail(why, cap, "below minimum", v);
        if ((b = json_object_get(s, "maximum")) && x > json_number_value(b))
            return fail(why, cap, "above maximum", v);
        if ((b = json_object_get(s, "exclusiveMinimum")) && x <= json_number_value(b))
            return fail(why, cap, "not above exclusiveMinimum", v);
        if ((b = json_object_get(s, "exclusiveMaximum")) && x >= json_number_value(b))
            return fail(why, cap, "not below exclusiveMaximum", v);
    }
    if (json_is_string(v)) {
        const json_t *b;
        int n = utf8_chars(json_string_value(v));
        if ((b = json_object_get(s, "minLength")) && n < json_integer_value(b))
            return fail(why, cap, "too short", v);
        if ((b = json_object_get(s, "maxLength")) && n > json_integer_value(b))
            return fail(why, cap, "too long", v);
        if ((b = json_object_get(s, "pattern"))) {
            int err;
            PCRE2_SIZE off;
            pcre2_code *re = pcre2_compile((PCRE2_SPTR)json_string_value(b), PCRE2_ZERO_TERMINATED,
                                           PCRE2_UTF, &err, &off, NULL);
            cr_assert_not_null(re, "PCRE2 refuses the test pattern");
            pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
            int rc = pcre2_match(re, (PCRE2_SPTR)json_string_value(v), json_string_length(v), 0, 0,
                                 md, NULL);
            pcre2_match_data_free(md);
            pcre2_code_free(re);
            if (rc < 0) return fail(why, cap, "does not match the pattern", v);
        }
    }
    if (json_is_object(v)) {
        const json_t *props = json_object_get(s, "properties");
        const json_t *req = json_object_get(s, "required");
        for (size_t i = 0; i < json_array_size(req); i++)
            if (!json_object_get(v, json_string_value(json_array_get(req, i))))
                return fail(why, cap, "a required property is missing", v);
        const char *k;
        json_t *x;
        json_object_foreach((json_t *)v, k, x) {
            const json_t *ps = props ? json_object_get(props, k) : NULL;
            if (!ps && json_is_false(json_object_get(s, "additionalProperties")))
                return fail(why, cap, "an additional property", v);
            if (ps && !validate(root, ps, x, why, cap)) return 0;
        }
    }
    if (json_is_array(v)) {
        const json_t *b;
        size_t n = json_array_size(v);
        if ((b = json_object_get(s, "minItems")) && (json_int_t)n < json_integer_value(b))
            return fail(why, cap, "too few items", v);
        if ((b = json_object_get(s, "maxItems")) && (json_int_t)n > json_integer_value(b))
            return fail(why, cap, "too many items", v);
        const json_t *items = json_object_get(s, "items");
        for (size_t i = 0; items && i < n; i++)
            if (!validate(root, items, json_array_get(v, i), why, cap)) return 0;
    }
    return 1;
}

/* ---------------------------------------------------- random walks */

static uint64_t rng_next(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

#define BIT(m, i) ((m)[(i) >> 6] >> ((i)&63) & 1)

/* Replay out[0..n) and then the token's bytes on a fresh state: is the token
 * allowed after out? (The mask comes from a trie walk; this from bytes.) */
static int replay_allows(const rk_grammar *g, const char *out, size_t n, int32_t tok) {
    char buf[512];
    int len = rk_tokenizer_token_bytes(g_tok, tok, 0, buf, sizeof buf);
    rk_grammar_state *s;
    cr_assert_eq(rk_grammar_state_create(g, g_vocab, &s), RK_OK);
    cr_assert_eq(rk_grammar_state_accept_bytes(s, out, (int)n), RK_OK);
    int ok;
    if (rk_tokenizer_is_eog(g_tok, tok))
        ok = rk_grammar_state_can_end(s);
    else if (len <= 0 || len > (int)sizeof buf)
        ok = 0;
    else
        ok = rk_grammar_state_accept_bytes(s, buf, len) == RK_OK;
    rk_grammar_state_free(s);
    return ok;
}

/* Walk: sample allowed tokens uniformly (an end token as soon as one is
 * allowed, half the time) for at most max_tokens; returns the finish reason
 * the pipeline would give ("stop" or "length") and the text in *out. */
static const char *walk(const rk_grammar *g, uint64_t seed, int max_tokens, int check_every,
                        char **out) {
    rk_grammar_state *s;
    cr_assert_eq(rk_grammar_state_create(g, g_vocab, &s), RK_OK, "%s", rk_error_message());
    int32_t n = rk_grammar_vocab_n(g_vocab);
    int32_t *allowed = malloc((size_t)n * sizeof *allowed);
    size_t cap = 1 << 16, len = 0;
    char *text = malloc(cap);
    const char *reason = "length";
    for (int step = 0; step < max_tokens; step++) {
        const uint64_t *m;
        cr_assert_eq(rk_grammar_state_mask(s, &m), RK_OK, "%s", rk_error_message());
        int na = 0, eog = -1;
        for (int32_t i = 0; i < n; i++)
            if (BIT(m, i)) {
                allowed[na++] = i;
                if (rk_tokenizer_is_eog(g_tok, i)) eog = i;
            }
        cr_assert_gt(na, 0, "no token allowed after %zu bytes: %.*s", len, (int)len, text);
        if (check_every && step % check_every == 0) {
            /* A sample of ids (allowed ones and any) checked byte by byte. */
            for (int k = 0; k < 40; k++) {
                int32_t id = k < 20 ? allowed[rng_next(&seed) % (uint64_t)na]
                                    : (int32_t)(rng_next(&seed) % (uint64_t)n);
                cr_assert_eq(BIT(m, id) != 0, replay_allows(g, text, len, id) != 0,
                             "token %d: mask says %d after %.*s", id, (int)BIT(m, id), (int)len,
                             text);
            }
        }
        int32_t tok =
            eog >= 0 && rng_next(&seed) % 2 ? eog : allowed[rng_next(&seed) % (uint64_t)na];
        cr_assert_eq(rk_grammar_state_accept(s, tok), RK_OK, "%s", rk_error_message());
        if (rk_tokenizer_is_eog(g_tok, tok)) {
            reason = "stop";
            break;
        }
        char buf[512];
        int bl = rk_tokenizer_token_bytes(g_tok, tok, 0, buf, sizeof buf);
        cr_assert(bl > 0 && bl <= (int)sizeof buf);
        if (len + (size_t)bl + 1 > cap) text = realloc(text, cap *= 2);
        memcpy(text + len, buf, (size_t)bl);
        len += (size_t)bl;
    }
    text[len] = 0;
    free(allowed);
    rk_grammar_state_free(s);
    *out = text;
    return reason;
}

/* Walk schema (JSON text) for seeds 1..n; each walk must end by itself with
 * JSON that the schema accepts. */
static void walk_schema(const char *schema_text, int seeds) {
    need_qwen3();
    json_t *schema = parse_json(schema_text);
    rk_grammar *g;
    cr_assert_eq(rk_grammar_from_schema(schema, &g), RK_OK, "%s", rk_error_message());
    for (int seed = 1; seed <= seeds; seed++) {
        char *text;
        const char *reason = walk(g, (uint64_t)seed, 4000, seed == 1 ? 7 : 0, &text);
        cr_assert_str_eq(reason, "stop", "seed %d did not end: %.300s", seed, text);
        json_error_t e;
        json_t *v = json_loads(text, JSON_DECODE_ANY, &e);
        cr_assert_not_null(v, "seed %d: jansson refuses %s: %s", seed, text, e.text);
        char why[600];
        cr_assert(validate(schema, schema, v, why, sizeof why), "seed %d: %s (whole: %s)", seed,
                  why, text);
        json_decref(v);
        free(text);
    }
    rk_grammar_free(g);
    json_decref(schema);
}

Test(grammar, walks_over_nested_objects_give_valid_json) {
    walk_schema("{\"type\":\"object\",\"properties\":{"
                "\"name\":{\"type\":\"string\",\"maxLength\":12},"
                "\"address\":{\"type\":\"object\",\"properties\":{"
                "  \"city\":{\"type\":\"string\",\"minLength\":1,\"maxLength\":8},"
                "  \"zip\":{\"type\":\"string\",\"pattern\":\"^[0-9]{5}$\"}},"
                "  \"required\":[\"city\",\"zip\"],\"additionalProperties\":false},"
                "\"nick\":{\"type\":[\"string\",\"null\"],\"maxLength\":6},"
                "\"ok\":{\"type\":\"boolean\"}},"
                "\"required\":[\"name\",\"address\",\"ok\"],\"additionalProperties\":false}",
                4);
}

Test(grammar, walks_over_arrays_and_enums_give_valid_json) {
    walk_schema("{\"type\":\"object\",\"properties\":{"
                "\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"red\",\"green\",\"blue\",3,"
                "null,true]},\"minItems\":2,\"maxItems\":5},"
                "\"grid\":{\"type\":\"array\",\"items\":{\"type\":\"array\",\"items\":"
                "{\"type\":\"integer\",\"minimum\":-3,\"maximum\":12},\"maxItems\":3},"
                "\"maxItems\":3},"
                "\"kind\":{\"const\":\"fixed\\\"q\"}},"
                "\"required\":[\"tags\",\"grid\",\"kind\"],\"additionalProperties\":false}",
                4);
}

Test(grammar, walks_over_bounded_numbers_give_valid_json) {
    walk_schema(
        "{\"type\":\"object\",\"properties\":{"
        "\"age\":{\"type\":\"integer\",\"minimum\":18,\"maximum\":130},"
        "\"temp\":{\"type\":\"number\",\"minimum\":-40,\"maximum\":55},"
        "\"big\":{\"type\":\"integer\",\"exclusiveMinimum\":999,\"exclusiveMaximum\":123457},"
        "\"neg\":{\"type\":\"integer\",\"maximum\":-7},"
        "\"score\":{\"type\":\"number\"},"
        "\"pos\":{\"type\":\"number\",\"minimum\":1}},"
        "\"required\":[\"age\",\"temp\",\"big\",\"neg\",\"score\",\"pos\"],"
        "\"additionalProperties\":false}",
        6);
}

Test(grammar, walks_over_patterns_give_matching_strings) {
    walk_schema(
        "{\"type\":\"object\",\"properties\":{"
        "\"id\":{\"type\":\"string\",\"pattern\":\"^[A-Z]{2}-\\\\d{3,4}(x|yz)?$\"},"
        "\"mail\":{\"type\":\"string\",\"pattern\":\"^[a-z0-9._]{1,8}@[a-z]{1,6}\\\\.(com|org)$\"},"
        "\"quoted\":{\"type\":\"string\",\"pattern\":\"^\\\"[^\\\"]{0,4}\\\"$\"},"
        "\"has\":{\"type\":\"string\",\"pattern\":\"^a(b|cd)+e$\"},"
        "\"dot\":{\"type\":\"string\",\"pattern\":\"^.{2}\\\\s\\\\w$\"}},"
        "\"required\":[\"id\",\"mail\",\"quoted\",\"has\",\"dot\"],"
        "\"additionalProperties\":false}",
        4);
}

Test(grammar, walks_over_any_of_and_refs_give_valid_json) {
    walk_schema(
        "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{"
        "  \"v\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":9},"
        "  \"kids\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/node\"},\"maxItems\":2}},"
        "  \"required\":[\"v\",\"kids\"],\"additionalProperties\":false},"
        " \"pt\":{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"number\"}},"
        "  \"required\":[\"x\"],\"additionalProperties\":false}},"
        "\"type\":\"object\",\"properties\":{"
        "\"tree\":{\"$ref\":\"#/$defs/node\"},"
        "\"either\":{\"anyOf\":[{\"$ref\":\"#/$defs/pt\"},{\"type\":\"string\",\"maxLength\":3},"
        "{\"type\":\"null\"}]},"
        "\"any\":{}},"
        "\"required\":[\"tree\",\"either\"],\"additionalProperties\":false}",
        4);
}

Test(grammar, json_object_walks_give_objects_or_end_by_length) {
    need_qwen3();
    rk_grammar *g;
    cr_assert_eq(rk_grammar_json_object(&g), RK_OK, "%s", rk_error_message());
    int stopped = 0;
    for (int seed = 1; seed <= 4; seed++) {
        char *text;
        const char *reason = walk(g, (uint64_t)seed, 600, seed == 1 ? 11 : 0, &text);
        if (!strcmp(reason, "stop")) {
            json_error_t e;
            json_t *v = json_loads(text, 0, &e);
            cr_assert(json_is_object(v), "seed %d: not an object: %s (%s)", seed, text, e.text);
            json_decref(v);
            stopped++;
        }
        free(text);
    }
    /* A forced end: two tokens cannot close an object that opened with a key. */
    rk_grammar_state *s;
    cr_assert_eq(rk_grammar_state_create(g, g_vocab, &s), RK_OK);
    cr_assert_eq(rk_grammar_state_accept_bytes(s, "{\"a", 3), RK_OK);
    cr_expect_not(rk_grammar_state_can_end(s));
    char *text;
    cr_expect_str_eq(walk(g, 99, 1, 0, &text), "length");
    free(text);
    rk_grammar_state_free(s);
    rk_grammar_free(g);
    (void)stopped;
}

Test(grammar, a_state_refuses_what_the_mask_refuses_and_ends_only_where_it_may) {
    need_qwen3();
    json_t *schema = parse_json("{\"enum\":[\"yes\",\"no\"]}");
    rk_grammar *g;
    cr_assert_eq(rk_grammar_from_schema(schema, &g), RK_OK, "%s", rk_error_message());
    rk_grammar_state *s;
    cr_assert_eq(rk_grammar_state_create(g, g_vocab, &s), RK_OK);
    const uint64_t *m;
    cr_assert_eq(rk_grammar_state_mask(s, &m), RK_OK);
    int32_t eos = rk_tokenizer_eos(g_tok);
    cr_expect_not(BIT(m, eos), "the end is allowed before any output");
    cr_expect_neq(rk_grammar_state_accept(s, eos), RK_OK);
    cr_expect_neq(rk_grammar_state_accept_bytes(s, "\"maybe", 6), RK_OK);
    cr_assert_eq(rk_grammar_state_accept_bytes(s, "\"yes\"", 5), RK_OK,
                 "the state moved on a refusal");
    cr_expect(rk_grammar_state_can_end(s));
    cr_expect(rk_grammar_state_must_end(s));
    cr_assert_eq(rk_grammar_state_mask(s, &m), RK_OK);
    int n_allowed = 0;
    for (int32_t i = 0; i < rk_grammar_vocab_n(g_vocab); i++) n_allowed += (int)BIT(m, i);
    cr_expect(BIT(m, eos));
    for (int32_t i = 0; i < rk_grammar_vocab_n(g_vocab); i++)
        if (BIT(m, i))
            cr_expect(rk_tokenizer_is_eog(g_tok, i), "token %d allowed after the end", i);
    rk_grammar_state_free(s);
    rk_grammar_free(g);
    json_decref(schema);
}

/* ---------------------------------------------------- errors */

static void expect_schema_error(const char *schema_text, const char *prefix) {
    json_t *schema = parse_json(schema_text);
    rk_grammar *g = (rk_grammar *)1;
    rk_status st = rk_grammar_from_schema(schema, &g);
    cr_expect_neq(st, RK_OK, "accepted: %s", schema_text);
    cr_expect_null(g);
    cr_expect(!strncmp(rk_error_message(), prefix, strlen(prefix)),
              "%s: got \"%s\", want \"%s...\"", schema_text, rk_error_message(), prefix);
    json_decref(schema);
}

Test(grammar, schemas_outside_the_subset_are_refused_with_their_json_path) {
    expect_schema_error("{\"type\":\"object\",\"properties\":{\"age\":{\"type\":\"string\","
                        "\"format\":\"date\"}}}",
                        "$.properties.age.format: ");
    expect_schema_error("{\"type\":\"strin\"}", "$.type: unknown type");
    expect_schema_error("{\"oneOf\":[{\"type\":\"string\"}]}", "$.oneOf: ");
    expect_schema_error(
        "{\"type\":\"array\",\"items\":{\"type\":\"string\",\"pattern\":\"(?=a)\"}}",
        "$.items.pattern: ");
    expect_schema_error("{\"type\":\"array\",\"items\":{\"type\":\"string\",\"pattern\":\"(a\"}}",
                        "$.items.pattern: ");
    expect_schema_error("{\"type\":\"object\",\"additionalProperties\":{\"type\":\"string\"}}",
                        "$.additionalProperties: ");
    expect_schema_error("{\"type\":\"object\",\"properties\":{\"a\":{}},\"required\":[\"b\"]}",
                        "$.required[0]: ");
    expect_schema_error("{\"type\":\"number\",\"minimum\":0.5}", "$.minimum: ");
    expect_schema_error("{\"type\":\"integer\",\"minimum\":5,\"maximum\":4}", "$: no value");
    expect_schema_error("{\"anyOf\":[{\"type\":\"string\"},{\"$ref\":\"#/$defs/nope\"}]}",
                        "$.anyOf[1].$ref: ");
    expect_schema_error("{\"$defs\":{\"a\":{\"type\":\"object\",\"properties\":{\"x\":{\"$ref\":"
                        "\"#/$defs/a\"}},\"required\":[\"x\"]}},\"$ref\":\"#/$defs/a\"}",
                        "$: no value satisfies the schema");
    expect_schema_error("{\"type\":\"array\",\"minItems\":3,\"maxItems\":2}", "$: maxItems");
    expect_schema_error("[1]", "$: a schema must be an object");
}

Test(grammar, grammar_text_errors_name_the_problem) {
    rk_grammar *g;
    cr_expect_neq(rk_grammar_parse("root ::= a\n", &g), RK_OK);
    cr_expect(strstr(rk_error_message(), "'a' is used but not defined"), "%s", rk_error_message());
    cr_expect_neq(rk_grammar_parse("root ::= root \"x\" | \"y\"\n", &g), RK_OK);
    cr_expect(strstr(rk_error_message(), "left-recursive"), "%s", rk_error_message());
    cr_expect_neq(rk_grammar_parse("root ::= [a-\n", &g), RK_OK);
    cr_expect_neq(rk_grammar_parse("x ::= \"a\"\n", &g), RK_OK);
    cr_expect(strstr(rk_error_message(), "root"), "%s", rk_error_message());
    cr_expect_neq(rk_grammar_parse("root ::= \"a\"{3,2}\n", &g), RK_OK);
}

Test(grammar, a_grammar_text_constrains_bytes) {
    rk_grammar *g;
    cr_assert_eq(rk_grammar_parse("# yes or no, then digits\n"
                                  "root ::= ( \"yes\" | \"no\" ) \" \" num\n"
                                  "num  ::= [1-9] [0-9]{0,2}\n",
                                  &g),
                 RK_OK, "%s", rk_error_message());
    need_qwen3();
    const char *good[] = {"yes 1", "no 999", "yes 40"};
    const char *bad[] = {"maybe", "yes 0", "no 1000", "yes  1"};
    for (size_t i = 0; i < 3; i++) {
        rk_grammar_state *s;
        cr_assert_eq(rk_grammar_state_create(g, g_vocab, &s), RK_OK);
        cr_expect_eq(rk_grammar_state_accept_bytes(s, good[i], (int)strlen(good[i])), RK_OK, "%s",
                     good[i]);
        cr_expect(rk_grammar_state_can_end(s), "%s", good[i]);
        rk_grammar_state_free(s);
    }
    for (size_t i = 0; i < 4; i++) {
        rk_grammar_state *s;
        cr_assert_eq(rk_grammar_state_create(g, g_vocab, &s), RK_OK);
        cr_expect_neq(rk_grammar_state_accept_bytes(s, bad[i], (int)strlen(bad[i])), RK_OK, "%s",
                      bad[i]);
        rk_grammar_state_free(s);
    }
    rk_grammar_free(g);
}

Test(grammar, an_unanchored_pattern_matches_anywhere_in_the_string) {
    json_t *schema = parse_json("{\"type\":\"string\",\"pattern\":\"ab+c\"}");
    rk_grammar *g;
    cr_assert_eq(rk_grammar_from_schema(schema, &g), RK_OK, "%s", rk_error_message());
    need_qwen3();
    const char *good[] = {"\"abc\"", "\"zz abbbc yy\"", "\"\\\"abc\""};
    const char *bad[] = {"\"ac\"", "\"zz\"", "\"abxc\""};
    for (size_t i = 0; i < 3; i++) {
        rk_grammar_state *s;
        cr_assert_eq(rk_grammar_state_create(g, g_vocab, &s), RK_OK);
        cr_expect_eq(rk_grammar_state_accept_bytes(s, good[i], (int)strlen(good[i])), RK_OK, "%s",
                     good[i]);
        cr_expect(rk_grammar_state_can_end(s), "%s", good[i]);
        rk_grammar_state_free(s);
        cr_assert_eq(rk_grammar_state_create(g, g_vocab, &s), RK_OK);
        cr_expect_neq(rk_grammar_state_accept_bytes(s, bad[i], (int)strlen(bad[i])), RK_OK, "%s",
                      bad[i]);
        rk_grammar_state_free(s);
    }
    rk_grammar_free(g);
    json_decref(schema);
}

Test(grammar, the_masked_sampler_never_picks_a_masked_token) {
    enum { N = 130 };
    float logits[N];
    for (int i = 0; i < N; i++) logits[i] = (float)(i % 7);
    logits[3] = 50; /* the favourite, masked out */
    uint64_t mask[3] = {0};
    for (int i = 64; i < N; i += 5) mask[i >> 6] |= 1ull << (i & 63);
    rk_sampler_params ps[] = {{.temperature = 0, .top_p = 1, .seed = 1},
                              {.temperature = 1, .top_p = 1, .seed = 2},
                              {.temperature = 1.5f, .top_k = 40, .top_p = 0.9f, .seed = 3}};
    for (size_t k = 0; k < 3; k++) {
        rk_sampler s;
        cr_assert_eq(rk_sampler_init(&s, &ps[k], N), RK_OK);
        for (int d = 0; d < 500; d++) {
            int32_t id = rk_sampler_sample_masked(&s, logits, mask);
            cr_assert(id >= 0 && id < N && BIT(mask, id), "params %zu drew masked id %d", k, id);
        }
        uint64_t none[3] = {0};
        cr_expect_eq(rk_sampler_sample_masked(&s, logits, none), -1);
        rk_sampler_free(&s);
    }
}

/* ---------------------------------------------------- through the pipeline */

#include "pipeline/pipeline.h"

/* n seeded requests at temperature 1 on the model, batched in one run, each
 * constrained to g; returns them (the caller frees). */
static rk_request **run_constrained(rk_service *svc, const rk_grammar *g, int n, int max_tokens) {
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    int32_t *ids;
    size_t n_ids;
    const char *prompt = "Once upon a time, there was a little girl";
    cr_assert_eq(rk_tokenizer_encode(tok, prompt, strlen(prompt), 0, &ids, &n_ids), RK_OK);
    int32_t bos = rk_tokenizer_bos(tok);
    rk_request **rs = calloc((size_t)n, sizeof *rs);
    for (int i = 0; i < n; i++) {
        rs[i] = calloc(1, sizeof *rs[i]);
        rk_req_options_default(&rs[i]->opt);
        rs[i]->opt.max_tokens = max_tokens;
        rs[i]->opt.sampling.temperature = 1;
        rs[i]->opt.sampling.seed = (uint64_t)i + 1;
        rs[i]->opt.grammar = g;
        cr_assert_eq(rk_request_prepare_tokens(svc, &bos, bos >= 0, ids, (int)n_ids, rs[i]), RK_OK,
                     "%s", rk_error_message());
    }
    free(ids);
    cr_assert_eq(rk_pipeline_run(svc, rs, n, NULL), RK_OK, "%s", rk_error_message());
    return rs;
}

static char *output_text(rk_service *svc, const rk_request *r) {
    char *text;
    size_t len;
    cr_assert_eq(rk_tokenizer_decode(rk_model_tokenizer(svc->model), r->out_tokens,
                                     (size_t)r->n_out, 0, 0, &text, &len),
                 RK_OK);
    return text;
}

static rk_service *open_model(const char *path) {
    rk_config cfg;
    rk_config_defaults(&cfg);
    cfg.n_threads = 2;
    cfg.kv_memory_mb = 256;
    rk_service *svc;
    cr_assert_eq(rk_service_open(&cfg, path, &svc), RK_OK, "%s", rk_error_message());
    return svc;
}

Test(grammar, batched_requests_on_stories260k_each_give_schema_valid_json) {
    const char *path;
    RK_REQUIRE_SHARED(path, "models/stories260K.gguf");
    rk_service *svc = open_model(path);
    free((char *)path);
    const char *schema_text =
        "{\"type\":\"object\",\"properties\":{"
        "\"name\":{\"type\":\"string\",\"maxLength\":10},"
        "\"age\":{\"type\":\"integer\",\"minimum\":1,\"maximum\":99},"
        "\"mood\":{\"enum\":[\"happy\",\"sad\"]},"
        "\"pets\":{\"type\":\"array\",\"items\":{\"type\":\"string\",\"pattern\":\"^[a-z]{1,6}$\"},"
        "\"maxItems\":3}},"
        "\"required\":[\"name\",\"age\",\"mood\",\"pets\"],\"additionalProperties\":false}";
    json_t *schema = parse_json(schema_text);
    rk_grammar *g;
    cr_assert_eq(rk_grammar_from_schema(schema, &g), RK_OK, "%s", rk_error_message());
    enum { N = 20 };
    rk_request **rs = run_constrained(svc, g, N, 200);
    for (int i = 0; i < N; i++) {
        char *text = output_text(svc, rs[i]);
        cr_expect_eq(rs[i]->finish_reason, RK_FINISH_STOP, "seed %d: %s", i + 1, text);
        json_error_t e;
        json_t *v = json_loads(text, 0, &e);
        cr_assert_not_null(v, "seed %d: jansson refuses %s: %s", i + 1, text, e.text);
        char why[600];
        cr_expect(validate(schema, schema, v, why, sizeof why), "seed %d: %s", i + 1, why);
        json_decref(v);
        free(text);
        rk_test_request_free(rs[i]);
    }
    free(rs);
    /* A forced end: three tokens cannot finish the object. */
    rs = run_constrained(svc, g, 1, 3);
    cr_expect_eq(rs[0]->finish_reason, RK_FINISH_LENGTH);
    cr_expect_eq(rs[0]->n_out, 3);
    char *text = output_text(svc, rs[0]);
    cr_expect(text[0] == '{', "%s", text);
    free(text);
    rk_test_request_free(rs[0]);
    free(rs);
    rk_grammar_free(g);
    json_decref(schema);
    rk_service_close(svc);
}

Test(grammar, json_object_requests_on_stories260k_give_objects) {
    const char *path;
    RK_REQUIRE_SHARED(path, "models/stories260K.gguf");
    rk_service *svc = open_model(path);
    free((char *)path);
    rk_grammar *g;
    cr_assert_eq(rk_grammar_json_object(&g), RK_OK, "%s", rk_error_message());
    enum { N = 20 };
    rk_request **rs = run_constrained(svc, g, N, 400);
    for (int i = 0; i < N; i++) {
        char *text = output_text(svc, rs[i]);
        cr_expect_eq(rs[i]->finish_reason, RK_FINISH_STOP, "seed %d: %s", i + 1, text);
        json_error_t e;
        json_t *v = json_loads(text, 0, &e);
        cr_expect(json_is_object(v), "seed %d: not an object: %s (%s)", i + 1, text, e.text);
        json_decref(v);
        free(text);
        rk_test_request_free(rs[i]);
    }
    free(rs);
    rk_grammar_free(g);
    rk_service_close(svc);
}

/* A grammar that may only be empty: its first state has no stack (the
 * sanitizer build once stopped on the sort of no stacks), allows only the
 * end tokens, and must end at once. */
Test(grammar, a_grammar_of_only_the_empty_string_allows_only_the_end) {
    need_qwen3();
    rk_grammar *g;
    cr_assert_eq(rk_grammar_parse("root ::= \"\"\n", &g), RK_OK, "%s", rk_error_message());
    rk_grammar_state *s;
    cr_assert_eq(rk_grammar_state_create(g, g_vocab, &s), RK_OK, "%s", rk_error_message());
    cr_expect(rk_grammar_state_can_end(s));
    cr_expect(rk_grammar_state_must_end(s));
    cr_expect_eq(rk_grammar_state_min_bytes(s), 0);
    const uint64_t *m;
    cr_assert_eq(rk_grammar_state_mask(s, &m), RK_OK, "%s", rk_error_message());
    int n = 0;
    for (int32_t i = 0; i < rk_grammar_vocab_n(g_vocab); i++)
        if (BIT(m, i)) {
            cr_expect(rk_tokenizer_is_eog(g_tok, i), "token %d is allowed", i);
            n++;
        }
    cr_expect_gt(n, 0);
    cr_expect_neq(rk_grammar_state_accept_bytes(s, "a", 1), RK_OK);
    rk_grammar_state_free(s);
    rk_grammar_free(g);
}

/* 40 rules, each twice the one before: the shortest output is 2^40 bytes,
 * more than an int holds. Sampling near max_tokens must not overflow (the
 * sanitizer build stops on signed overflow), and the output is cut by
 * max_tokens. */
Test(grammar, a_grammar_longer_than_an_int_is_cut_by_max_tokens) {
    const char *path;
    RK_REQUIRE_SHARED(path, "models/stories260K.gguf");
    rk_service *svc = open_model(path);
    free((char *)path);
    char text[2048];
    int o = snprintf(text, sizeof text, "root ::= r39\nr0 ::= \"ab\" | \"ba\"\n");
    for (int i = 1; i < 40; i++)
        o += snprintf(text + o, sizeof text - (size_t)o, "r%d ::= r%d r%d\n", i, i - 1, i - 1);
    rk_grammar *g;
    cr_assert_eq(rk_grammar_parse(text, &g), RK_OK, "%s", rk_error_message());
    rk_request **rs = run_constrained(svc, g, 1, 12);
    cr_expect_eq(rs[0]->failure, RK_OK, "%s", rs[0]->failure_msg);
    cr_expect_eq(rs[0]->finish_reason, RK_FINISH_LENGTH);
    cr_expect_eq(rs[0]->n_out, 12);
    char *out = output_text(svc, rs[0]);
    for (const char *p = out; *p; p++) cr_expect(*p == 'a' || *p == 'b', "%s", out);
    free(out);
    rk_test_request_free(rs[0]);
    free(rs);
    rk_grammar_free(g);
    rk_service_close(svc);
}

/* Negated class escapes hold non-ASCII characters: [^\D] is the digits
 * alone, [^\S] white space alone; \S, \W, '.' and [^a] allow non-ASCII
 * characters but never white space. Walks over the Qwen3 vocabulary, whose
 * tokens are mostly multi-byte, checked with PCRE2. */
Test(grammar, negated_class_escapes_in_patterns_hold_multibyte_characters_exactly) {
    walk_schema("{\"type\":\"string\",\"pattern\":\"^[^\\\\D]{3}$\"}", 10);
    walk_schema("{\"type\":\"string\",\"pattern\":\"^[^\\\\S]{3}$\"}", 10);
    walk_schema("{\"type\":\"string\",\"pattern\":\"^[^\\\\W\\\\d]{2}[^\\\\w\\\\s]$\"}", 10);
    walk_schema("{\"type\":\"string\",\"pattern\":\"^\\\\S\\\\W.[^a]$\"}", 10);
    json_t *schema = parse_json("{\"type\":\"string\",\"pattern\":\"^[^\\\\D][^\\\\S].$\"}");
    rk_grammar *g;
    cr_assert_eq(rk_grammar_from_schema(schema, &g), RK_OK, "%s", rk_error_message());
    /* ” (E2 80 9D) is neither a digit nor white space; U+00A0 and U+2028
     * are white space and '.' refuses a line separator. */
    const char *good[] = {"\"1 x\"", "\"7\\t\xC3\xA9\""};
    const char *bad[] = {"\"\xE2\x80\x9D x\"", "\"1\xE2\x80\x9Dx\"", "\"1 \xE2\x80\xA8\"",
                         "\"1 \\n\""};
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
        rk_grammar_state *s;
        cr_assert_eq(rk_grammar_state_create(g, g_vocab, &s), RK_OK);
        cr_expect_eq(rk_grammar_state_accept_bytes(s, good[i], (int)strlen(good[i])), RK_OK, "%s",
                     good[i]);
        cr_expect(rk_grammar_state_can_end(s), "%s", good[i]);
        rk_grammar_state_free(s);
    }
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        rk_grammar_state *s;
        cr_assert_eq(rk_grammar_state_create(g, g_vocab, &s), RK_OK);
        int took = rk_grammar_state_accept_bytes(s, bad[i], (int)strlen(bad[i])) == RK_OK;
        cr_expect(!took || !rk_grammar_state_can_end(s), "%s", bad[i]);
        rk_grammar_state_free(s);
    }
    rk_grammar_free(g);
    json_decref(schema);
}

/* A pattern whose language holds no string JSON output can carry is
 * refused with its path: an empty class, or U+0000 (never in the output). */
Test(grammar, a_pattern_that_matches_nothing_is_refused) {
    const char *pats[] = {"^[^\\\\s\\\\S]$", "^\\\\u0000+$", "^x\\\\0$", "[^\\\\w\\\\W]"};
    for (size_t i = 0; i < sizeof pats / sizeof *pats; i++) {
        char text[256];
        snprintf(text, sizeof text, "{\"type\":\"string\",\"pattern\":\"%s\"}", pats[i]);
        json_t *schema = parse_json(text);
        rk_grammar *g = NULL;
        cr_expect_eq(rk_grammar_from_schema(schema, &g), RK_ERR_INVALID, "%s", pats[i]);
        cr_expect(strstr(rk_error_message(), "$.pattern: no string"), "%s: %s", pats[i],
                  rk_error_message());
        rk_grammar_free(g);
        json_decref(schema);
    }
    /* An optional U+0000 is left out, not refused. */
    need_qwen3();
    json_t *schema = parse_json("{\"type\":\"string\",\"pattern\":\"^a\\\\u0000?$\"}");
    rk_grammar *g;
    cr_assert_eq(rk_grammar_from_schema(schema, &g), RK_OK, "%s", rk_error_message());
    rk_grammar_state *s;
    cr_assert_eq(rk_grammar_state_create(g, g_vocab, &s), RK_OK);
    cr_expect_eq(rk_grammar_state_accept_bytes(s, "\"a\"", 3), RK_OK);
    cr_expect(rk_grammar_state_can_end(s));
    rk_grammar_state_free(s);
    cr_assert_eq(rk_grammar_state_create(g, g_vocab, &s), RK_OK);
    cr_expect_neq(rk_grammar_state_accept_bytes(s, "\"a\\u0000", 8), RK_OK);
    rk_grammar_state_free(s);
    rk_grammar_free(g);
    json_decref(schema);
}

/* A rule of n alternatives "w<i>" (about 11 bytes each), as grammar text. */
static char *wide_grammar(int n) {
    size_t cap = (size_t)n * 16 + 64, o = 0;
    char *t = malloc(cap);
    o += (size_t)snprintf(t, cap, "root ::= ");
    for (int i = 0; i < n; i++)
        o += (size_t)snprintf(t + o, cap - o, "%s\"w%07d\"", i ? " | " : "", i);
    snprintf(t + o, cap - o, "\n");
    return t;
}

/* 79,000 alternatives alive at once (a 1 MB text) once held the engine
 * thread for seconds; the state's width is bounded, and the bound named. */
Test(grammar, a_state_wider_than_its_bound_is_refused_naming_it, .timeout = 60) {
    need_qwen3();
    /* The time bound is given room: a sanitizer build parses 1 MB slower than
     * the default second, and this test is about the width bound. */
    char *text = wide_grammar(79000);
    rk_grammar *g;
    cr_assert_eq(rk_grammar_parse_within(text, 60e3, &g), RK_OK, "%s", rk_error_message());
    rk_grammar_state *s = NULL;
    cr_expect_eq(rk_grammar_state_create(g, g_vocab, &s), RK_ERR_LIMIT);
    cr_expect(strstr(rk_error_message(), "more than 4096 alternatives at once"), "%s",
              rk_error_message());
    rk_grammar_state_free(s);
    rk_grammar_free(g);
    free(text);
    /* At the bound it is allowed, and its first mask is the 4096 words' "w". */
    text = wide_grammar(RK_GRAMMAR_MAX_WIDTH);
    cr_assert_eq(rk_grammar_parse_within(text, 60e3, &g), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_grammar_state_create(g, g_vocab, &s), RK_OK, "%s", rk_error_message());
    const uint64_t *m;
    cr_expect_eq(rk_grammar_state_mask(s, &m), RK_OK, "%s", rk_error_message());
    cr_expect_eq(rk_grammar_state_accept_bytes(s, "w0004095", 8), RK_OK);
    cr_expect(rk_grammar_state_can_end(s));
    rk_grammar_state_free(s);
    rk_grammar_free(g);
    free(text);
}

/* Alternatives that double at every level (2^40 paths to one byte class)
 * are expanded once per distinct position, not once per path. */
Test(grammar, doubling_alternatives_expand_in_linear_time, .timeout = 20) {
    need_qwen3();
    char text[4096];
    int o = snprintf(text, sizeof text, "root ::= r0\nr40 ::= \"x\"\n");
    for (int i = 0; i < 40; i++)
        o += snprintf(text + o, sizeof text - (size_t)o, "r%d ::= r%d | r%d\n", i, i + 1, i + 1);
    rk_grammar *g;
    cr_assert_eq(rk_grammar_parse(text, &g), RK_OK, "%s", rk_error_message());
    rk_grammar_state *s;
    cr_assert_eq(rk_grammar_state_create(g, g_vocab, &s), RK_OK, "%s", rk_error_message());
    const uint64_t *m;
    cr_expect_eq(rk_grammar_state_mask(s, &m), RK_OK, "%s", rk_error_message());
    cr_expect_eq(rk_grammar_state_accept_bytes(s, "x", 1), RK_OK);
    cr_expect(rk_grammar_state_must_end(s));
    rk_grammar_state_free(s);
    rk_grammar_free(g);
}

Test(grammar, grammars_over_the_rule_and_time_bounds_are_refused_naming_them) {
    /* x{0,9999} is 9999 rules: seven of them are over 65536. */
    rk_grammar *g = NULL; /* (the time bound given room: this is about rules) */
    cr_expect_eq(
        rk_grammar_parse_within("root ::= a b c d e f g\na ::= \"x\"{0,9999}\nb ::= a\nc ::= "
                                "a\nd ::= a\ne ::= \"y\"{0,9999}\nf ::= \"z\"{0,9999}\ng ::= "
                                "\"v\"{0,9999} \"w\"{0,9999} \"u\"{0,9999} \"t\"{0,9999}\n",
                                60e3, &g),
        RK_ERR_LIMIT);
    cr_expect(strstr(rk_error_message(), "more than 65536 rules"), "%s", rk_error_message());
    rk_grammar_free(g);
    g = NULL;
    char *text = wide_grammar(2000);
    cr_expect_eq(rk_grammar_parse_within(text, 1e-6, &g), RK_ERR_LIMIT);
    cr_expect(strstr(rk_error_message(), "took longer than the bound"), "%s", rk_error_message());
    rk_grammar_free(g);
    free(text);
}

/* A repeated schema is compiled once: the second request gets the same
 * compiled grammar from the cache. */
Test(grammar, the_cache_compiles_a_repeated_schema_once) {
    rk_grammar_cache *c;
    cr_assert_eq(rk_grammar_cache_create(2, &c), RK_OK);
    json_t *a = parse_json("{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"integer\"}}}");
    json_t *b = parse_json("{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"integer\"}}}");
    rk_grammar *g1, *g2, *g3;
    cr_assert_eq(rk_grammar_cache_schema(c, a, &g1), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_grammar_cache_schema(c, b, &g2), RK_OK, "%s", rk_error_message());
    cr_expect(g1 == g2, "a repeated schema was compiled again");
    cr_assert_eq(rk_grammar_cache_parse(c, "root ::= \"x\"", &g3), RK_OK);
    cr_expect(g3 != g1);
    int64_t hits, misses;
    rk_grammar_cache_counts(c, &hits, &misses);
    cr_expect_eq(hits, 1);
    cr_expect_eq(misses, 2);
    rk_grammar_free(g1);
    rk_grammar_cache_free(c); /* the requests' references outlive the cache */
    need_qwen3();
    rk_grammar_state *s;
    cr_assert_eq(rk_grammar_state_create(g2, g_vocab, &s), RK_OK);
    cr_expect_eq(rk_grammar_state_accept_bytes(s, "{\"x\":12}", 8), RK_OK);
    rk_grammar_state_free(s);
    rk_grammar_free(g2);
    rk_grammar_free(g3);
    json_decref(a);
    json_decref(b);
}

/* A state as wide as the bound whose alternatives all allow [a-z] next
 * (each alternative's class a class of its own) is expanded once per group
 * of bytes its classes tell apart, not once per letter: a decode step's mask
 * over such a grammar once cost the engine thread about 26 expansions of
 * 4,096 stacks per new state. */
Test(grammar, a_wide_state_is_expanded_once_per_group_of_alike_bytes, .timeout = 120) {
    need_qwen3();
    int n = RK_GRAMMAR_MAX_WIDTH;
    size_t cap = (size_t)n * 32 + 64, o = 0;
    char *text = malloc(cap);
    o += (size_t)snprintf(text, cap, "root ::= ");
    for (int i = 0; i < n; i++)
        o += (size_t)snprintf(text + o, cap - o, "%s[a-z]{40} \"%c%c%c\"", i ? " | " : "",
                              'a' + i % 26, 'a' + i / 26 % 26, 'a' + i / 676);
    rk_grammar *g;
    cr_assert_eq(rk_grammar_parse(text, &g), RK_OK, "%s", rk_error_message());
    rk_grammar_state *s;
    cr_assert_eq(rk_grammar_state_create(g, g_vocab, &s), RK_OK, "%s", rk_error_message());
    const uint64_t *m;
    for (int k = 0; k < 4; k++) {
        cr_assert_eq(rk_grammar_state_mask(s, &m), RK_OK, "%s", rk_error_message());
        cr_assert_eq(rk_grammar_state_accept_bytes(s, "abcde", 5), RK_OK, "%s", rk_error_message());
    }
    /* Every state stepped so far has two groups of bytes: [a-z] and the rest. */
    int64_t steps = rk_grammar_state_n_steps(s);
    int states = rk_grammar_state_n_states(s);
    cr_expect_leq(steps, 2 * (int64_t)states, "%lld transitions expanded for %d states",
                  (long long)steps, states);
    cr_expect(!rk_grammar_state_can_end(s));
    rk_grammar_state_free(s);
    rk_grammar_free(g);
    free(text);
}
