/* tests/test_split.c — splitting RAG prompts into system, chunks, question. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/split.h"

static rk_split split(const char *p, const char *sep, int max_chunks, rk_status want) {
    rk_split s;
    rk_status st = rk_split_prompt(p, strlen(p), sep, max_chunks, &s);
    cr_assert_eq(st, want, "split(\"%s\"): %s", p, rk_error_message());
    return s;
}

Test(split, system_chunks_and_question) {
    rk_split s = split("You are kind.##Doc A##Doc B##What?", NULL, 64, RK_OK);
    cr_assert_str_eq(s.system.s, "You are kind.");
    cr_assert_eq(s.n_chunks, 2);
    cr_assert_str_eq(s.chunks[0].s, "Doc A");
    cr_assert_str_eq(s.chunks[1].s, "Doc B");
    cr_assert_str_eq(s.question.s, "What?");
    cr_assert_eq(s.n_empty_chunks, 0);
    rk_split_free(&s);
}

Test(split, no_separator_is_a_plain_prompt) {
    rk_split s = split("Just a question", NULL, 64, RK_OK);
    cr_assert_str_eq(s.system.s, "");
    cr_assert_eq(s.n_chunks, 0);
    cr_assert_str_eq(s.question.s, "Just a question");
    rk_split_free(&s);
}

Test(split, an_empty_plain_prompt_is_an_empty_question) {
    rk_split s = split("", NULL, 64, RK_OK);
    cr_assert_eq(s.question.len, 0);
    cr_assert_eq(s.n_chunks, 0);
    rk_split_free(&s);
}

Test(split, one_separator_is_system_and_question) {
    rk_split s = split("Sys##Q", NULL, 64, RK_OK);
    cr_assert_str_eq(s.system.s, "Sys");
    cr_assert_eq(s.n_chunks, 0);
    cr_assert_str_eq(s.question.s, "Q");
    rk_split_free(&s);
}

Test(split, empty_chunks_are_skipped_and_counted) {
    rk_split s = split("S####A######Q", NULL, 64, RK_OK);
    cr_assert_eq(s.n_chunks, 1);
    cr_assert_str_eq(s.chunks[0].s, "A");
    cr_assert_eq(s.n_empty_chunks, 3);
    rk_split_free(&s);
}

Test(split, empty_question_is_an_error) {
    split("S##A##", NULL, 64, RK_ERR_INVALID);
    split("##", NULL, 64, RK_ERR_INVALID);
    split("####", NULL, 64, RK_ERR_INVALID);
}

Test(split, escaped_separator_is_literal) {
    rk_split s = split("a \\#\\# b##c\\#\\###q", NULL, 64, RK_OK);
    cr_assert_str_eq(s.system.s, "a ## b");
    cr_assert_eq(s.n_chunks, 1);
    cr_assert_str_eq(s.chunks[0].s, "c##");
    cr_assert_str_eq(s.question.s, "q");
    rk_split_free(&s);
}

Test(split, a_configured_separator) {
    rk_split s = split("sys|||one##still one|||q", "|||", 64, RK_OK);
    cr_assert_eq(s.n_chunks, 1);
    cr_assert_str_eq(s.chunks[0].s, "one##still one");
    rk_split_free(&s);
    rk_split bad;
    cr_assert_eq(rk_split_prompt("x", 1, "", 64, &bad), RK_ERR_INVALID);
    cr_assert_eq(rk_split_prompt("x", 1, "a\\b", 64, &bad), RK_ERR_INVALID);
    cr_assert_eq(rk_split_prompt("x", 1, "12345678901234567", 64, &bad), RK_ERR_INVALID);
}

Test(split, too_many_chunks_is_a_limit_error) {
    split("s##1##2##3##q", NULL, 2, RK_ERR_LIMIT);
    rk_split s = split("s##1##2##q", NULL, 2, RK_OK);
    rk_split_free(&s);
}

Test(split, ten_thousand_empty_chunks_give_a_defined_result) {
    size_t n = 2 + 10001 * 2 + 1;
    char *p = malloc(n + 1);
    p[0] = 'S';
    memset(p + 1, '#', 10001 * 2);
    strcpy(p + 1 + 10001 * 2, "Q");
    rk_split s;
    cr_assert_eq(rk_split_prompt(p, strlen(p), NULL, 64, &s), RK_OK);
    cr_assert_eq(s.n_chunks, 0);
    cr_assert_eq(s.n_empty_chunks, 10000);
    cr_assert_str_eq(s.question.s, "Q");
    rk_split_free(&s);
    free(p);
}

Test(split, embedded_nul_bytes_stay_inside_pieces) {
    const char p[] = "s##a\0b##q";
    rk_split s;
    cr_assert_eq(rk_split_prompt(p, sizeof p - 1, NULL, 64, &s), RK_OK);
    cr_assert_eq(s.chunks[0].len, 3);
    rk_split_free(&s);
}

Test(split, structured_form_follows_the_same_rules) {
    const char *chunks[] = {"A", "", "B"};
    rk_split s;
    cr_assert_eq(rk_split_structured("Sys", chunks, 3, "Q?", 64, &s), RK_OK);
    cr_assert_eq(s.n_chunks, 2);
    cr_assert_eq(s.n_empty_chunks, 1);
    cr_assert_str_eq(s.chunks[1].s, "B");
    rk_split_free(&s);
    cr_assert_eq(rk_split_structured(NULL, chunks, 3, "", 64, &s), RK_ERR_INVALID);
    cr_assert_eq(rk_split_structured(NULL, chunks, 3, "q", 1, &s), RK_ERR_LIMIT);
}
