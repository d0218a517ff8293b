/* tests/test_chat.c — chat rendering (gateway/chat.c): the pieces of one,
 * two and three turns under each template, and the claim the layout is built
 * for: turn N+1's system piece and chunks are turn N's and its question starts
 * with turn N's question, so on the real pipeline turn N+1 reuses turn N's
 * whole sequence (prompt and answer) and computes only what follows, with the
 * output it has without any reuse. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/report.h"
#include "gateway/chat.h"
#include "pipeline/pipeline.h"
#include "tests/testutil.h"

#define N_TEMPLATES 5

/* ---------------------------------------------------------------- rendering */

/* {"role": role, "content": content} appended to msgs. */
static void add_msg(json_t *msgs, const char *role, const char *content) {
    cr_assert_eq(
        json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", role, "content", content)), 0);
}

/* Parse body (a JSON text) as a chat request (the server's chat separator
 * chat_separator, NULL for none) and render it with template t; returns the status (the request is
 * freed on failure). */
static rk_status render_text(rk_chat_template t, const char *text, int max_chunks,
                             const char *chat_separator, rk_api_request *r, rk_http_error *err) {
    rk_parse_limits lim = {
        .max_chunks = max_chunks, .max_tokens = 64, .chat_separator = chat_separator};
    memset(err, 0, sizeof *err);
    rk_status st = rk_api_parse(text, strlen(text), 1, &lim, r, err);
    cr_assert_eq(st, RK_OK, "parse: %s", err->message);
    st = rk_chat_render(t, r, max_chunks, err);
    if (st) rk_api_request_free(r);
    return st;
}

/* Parse {"messages": msgs, "chunks": chunks (may be NULL), "max_tokens",
 * "temperature": 0, "separator": "##"} (these tests write documents inline,
 * split on the separator the body names) and render it with template t;
 * returns the status. */
static rk_status render_body(rk_chat_template t, json_t *msgs, json_t *chunks, int max_chunks,
                             rk_api_request *r, rk_http_error *err) {
    json_t *body = json_pack("{s:O, s:i, s:i, s:s}", "messages", msgs, "max_tokens", 12,
                             "temperature", 0, "separator", "##");
    if (chunks) json_object_set(body, "chunks", chunks);
    char *text = json_dumps(body, 0);
    json_decref(body);
    rk_status st = render_text(t, text, max_chunks, NULL, r, err);
    free(text);
    return st;
}

static void render_ok(rk_chat_template t, json_t *msgs, json_t *chunks, rk_api_request *r) {
    rk_http_error err;
    cr_assert_eq(render_body(t, msgs, chunks, 8, r, &err), RK_OK, "%s", err.message);
}

/* later's system piece and chunks are earlier's; its question starts with
 * earlier's. */
static void assert_extends(const rk_api_request *earlier, const rk_api_request *later) {
    cr_assert_str_eq(later->pieces.system.s, earlier->pieces.system.s);
    cr_assert_eq(later->pieces.n_chunks, earlier->pieces.n_chunks);
    for (int k = 0; k < later->pieces.n_chunks; k++)
        cr_assert_str_eq(later->pieces.chunks[k].s, earlier->pieces.chunks[k].s);
    cr_assert_eq(later->pieces.n_groups, earlier->pieces.n_groups);
    for (int g = 0; g < later->pieces.n_groups; g++) {
        cr_assert_eq(later->pieces.group_end[g], earlier->pieces.group_end[g]);
        if (g + 1 < later->pieces.n_groups)
            cr_assert_str_eq(later->pieces.texts[g].s, earlier->pieces.texts[g].s);
    }
    cr_assert_eq(
        strncmp(later->pieces.question.s, earlier->pieces.question.s, earlier->pieces.question.len),
        0, "\"%s\" does not start with \"%s\"", later->pieces.question.s,
        earlier->pieces.question.s);
    cr_assert_gt(later->pieces.question.len, earlier->pieces.question.len);
}

static const char *WANT_SYS[N_TEMPLATES] = {
    "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n",
    "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>user<|end_"
    "header_id|>\n\n",
    "[INST] <<SYS>>\nS\n<</SYS>>\n\n", "<|system|>\nS<|end|>\n<|user|>\n",
    "<start_of_turn>user\nS\n\n"};

/* The question pieces of turns 1, 2 and 3 of the conversation below. */
static const char *WANT_Q[N_TEMPLATES][3] = {
    {"Q1<|im_end|>\n<|im_start|>assistant\n",
     "Q1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n<|im_"
     "start|>assistant\n",
     "Q1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n<|im_"
     "start|>assistant\nA2<|im_end|>\n<|im_start|>user\nQ3<|im_end|>\n<|im_start|>assistant\n"},
    {"Q1<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
     "Q1<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nA1<|eot_id|><|start_header_id|"
     ">user<|end_header_id|>\n\nQ2<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
     "Q1<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nA1<|eot_id|><|start_header_id|"
     ">user<|end_header_id|>\n\nQ2<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nA2<|"
     "eot_id|><|start_header_id|>user<|end_header_id|>\n\nQ3<|eot_id|><|start_header_id|>"
     "assistant<|end_header_id|>\n\n"},
    {"Q1 [/INST]", "Q1 [/INST] A1 </s><s>[INST] Q2 [/INST]",
     "Q1 [/INST] A1 </s><s>[INST] Q2 [/INST] A2 </s><s>[INST] Q3 [/INST]"},
    {"Q1<|end|>\n<|assistant|>\n",
     "Q1<|end|>\n<|assistant|>\nA1<|end|>\n<|user|>\nQ2<|end|>\n<|assistant|>\n",
     "Q1<|end|>\n<|assistant|>\nA1<|end|>\n<|user|>\nQ2<|end|>\n<|assistant|>\nA2<|end|>\n<|"
     "user|>\nQ3<|end|>\n<|assistant|>\n"},
    {"Q1<end_of_turn>\n<start_of_turn>model\n",
     "Q1<end_of_turn>\n<start_of_turn>model\nA1<end_of_turn>\n<start_of_turn>user\nQ2<end_of_"
     "turn>\n<start_of_turn>model\n",
     "Q1<end_of_turn>\n<start_of_turn>model\nA1<end_of_turn>\n<start_of_turn>user\nQ2<end_of_"
     "turn>\n<start_of_turn>model\nA2<end_of_turn>\n<start_of_turn>user\nQ3<end_of_turn>\n<"
     "start_of_turn>model\n"}};

Test(chat, each_turn_extends_the_layout_of_the_last) {
    const char *answers[] = {"A1", "A2"}, *questions[] = {"Q2", "Q3"};
    for (int t = 0; t < N_TEMPLATES; t++) {
        json_t *msgs = json_array();
        add_msg(msgs, "system", "S");
        add_msg(msgs, "user", "c1##c2##Q1");
        rk_api_request turns[3];
        for (int n = 0; n < 3; n++) {
            if (n > 0) {
                add_msg(msgs, "assistant", answers[n - 1]);
                add_msg(msgs, "user", questions[n - 1]);
            }
            render_ok((rk_chat_template)t, msgs, NULL, &turns[n]);
            cr_assert_str_eq(turns[n].pieces.system.s, WANT_SYS[t]);
            cr_assert_eq(turns[n].pieces.n_chunks, 2);
            cr_assert_str_eq(turns[n].pieces.chunks[0].s, "c1");
            cr_assert_str_eq(turns[n].pieces.chunks[1].s, "c2");
            cr_assert_str_eq(turns[n].pieces.question.s, WANT_Q[t][n], "template %d turn %d", t,
                             n + 1);
            if (n > 0) assert_extends(&turns[n - 1], &turns[n]);
        }
        for (int n = 0; n < 3; n++) rk_api_request_free(&turns[n]);
        json_decref(msgs);
    }
}

/* Without documents in any turn the layout is the one with documents, with
 * no chunks: the system piece ends at the first user message's opening and
 * every turn from it on is in the question piece, so each turn extends the
 * last (earlier turns in the system piece would leave nothing of the last
 * turn's question where the radix key has it). */
Test(chat, without_documents_every_turn_is_in_the_question_piece) {
    json_t *msgs = json_array();
    for (int t = 0; t < N_TEMPLATES; t++) {
        json_array_clear(msgs);
        add_msg(msgs, "system", "S");
        add_msg(msgs, "user", "Q1");
        rk_api_request turns[2];
        for (int n = 0; n < 2; n++) {
            if (n > 0) {
                add_msg(msgs, "assistant", "A1");
                add_msg(msgs, "user", "Q2");
            }
            render_ok((rk_chat_template)t, msgs, NULL, &turns[n]);
            cr_assert_str_eq(turns[n].pieces.system.s, WANT_SYS[t]);
            cr_assert_eq(turns[n].pieces.n_chunks, 0);
            cr_assert_str_eq(turns[n].pieces.question.s, WANT_Q[t][n], "template %d turn %d", t,
                             n + 1);
        }
        assert_extends(&turns[0], &turns[1]);
        for (int n = 0; n < 2; n++) rk_api_request_free(&turns[n]);
    }
    json_decref(msgs);
}

/* The first user turn with documents holds the first chunk group, even
 * when it is not the first turn; a later turn's documents are a group where
 * they stand, after the text of the turns between. */
Test(chat, each_turn_with_documents_is_a_chunk_group_where_it_stands) {
    json_t *msgs = json_array();
    add_msg(msgs, "user", "Hi");
    add_msg(msgs, "assistant", "Hello");
    add_msg(msgs, "user", "c1####c2##Q1");
    rk_api_request r1, r2;
    render_ok(RK_CHAT_CHATML, msgs, NULL, &r1);
    cr_assert_str_eq(r1.pieces.system.s, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
                                         "Hello<|im_end|>\n<|im_start|>user\n");
    cr_assert_eq(r1.pieces.n_chunks, 2);
    cr_assert_eq(r1.pieces.n_empty_chunks, 1);
    add_msg(msgs, "assistant", "A1");
    add_msg(msgs, "user", "c3##Q2");
    render_ok(RK_CHAT_CHATML, msgs, NULL, &r2);
    cr_assert_str_eq(r2.pieces.system.s, r1.pieces.system.s);
    cr_assert_eq(r2.pieces.n_chunks, 3);
    cr_assert_str_eq(r2.pieces.chunks[0].s, "c1");
    cr_assert_str_eq(r2.pieces.chunks[1].s, "c2");
    cr_assert_str_eq(r2.pieces.chunks[2].s, "c3");
    cr_assert_eq(r2.pieces.n_groups, 2);
    cr_assert_eq(r2.pieces.group_end[0], 2);
    cr_assert_eq(r2.pieces.group_end[1], 3);
    cr_assert_str_eq(r2.pieces.texts[0].s,
                     "Q1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\n");
    cr_assert_str_eq(r2.pieces.question.s, "Q2<|im_end|>\n<|im_start|>assistant\n");
    /* Turn 1's layout is the start of turn 2's: its question piece is
     * turn 2's first text, continued. */
    cr_assert_eq(strncmp(r2.pieces.texts[0].s, r1.pieces.question.s, r1.pieces.question.len - 1),
                 0);
    /* The next turn, with no new documents, extends this one. */
    rk_api_request r3;
    add_msg(msgs, "assistant", "A2");
    add_msg(msgs, "user", "Q3");
    render_ok(RK_CHAT_CHATML, msgs, NULL, &r3);
    assert_extends(&r2, &r3);
    rk_api_request_free(&r3);
    rk_api_request_free(&r1);
    rk_api_request_free(&r2);
    json_decref(msgs);
}

/* The `chunks` extension belongs to the first user message, with its ids in
 * order (empty chunks skipped and counted). */
Test(chat, the_chunks_extension_belongs_to_the_first_user_message) {
    json_t *chunks = json_pack("[{s:s, s:s}, s, {s:s, s:s}]", "id", "doc-1", "text", "c1", "", "id",
                               "doc-2", "text", "c2");
    json_t *msgs = json_array();
    add_msg(msgs, "system", "S");
    add_msg(msgs, "user", "Q1");
    rk_api_request r1, r2;
    for (int t = 0; t < N_TEMPLATES; t++) {
        render_ok((rk_chat_template)t, msgs, chunks, &r1);
        cr_assert_str_eq(r1.pieces.system.s, WANT_SYS[t]);
        cr_assert_str_eq(r1.pieces.question.s, WANT_Q[t][0]);
        rk_api_request_free(&r1);
    }
    render_ok(RK_CHAT_CHATML, msgs, chunks, &r1);
    add_msg(msgs, "assistant", "A1");
    add_msg(msgs, "user", "x##Q2");
    render_ok(RK_CHAT_CHATML, msgs, chunks, &r2);
    cr_assert_str_eq(r2.pieces.system.s, r1.pieces.system.s);
    for (int i = 0; i < 2; i++) {
        const rk_api_request *r = i ? &r2 : &r1;
        cr_assert_eq(r->pieces.n_chunks, 2 + i);
        cr_assert_eq(r->pieces.n_empty_chunks, 1);
        cr_assert_not_null(r->chunk_ids);
        cr_assert_str_eq(r->chunk_ids[0], "doc-1");
        cr_assert_str_eq(r->chunk_ids[1], "doc-2");
    }
    /* The body names a separator: the later message's document is a group
     * of its own (a chunk with no id) where the message stands. */
    cr_assert_str_eq(r2.pieces.chunks[2].s, "x");
    cr_assert_null(r2.chunk_ids[2]);
    cr_assert_eq(r2.pieces.n_groups, 2);
    cr_assert_not_null(strstr(r2.pieces.texts[0].s, "A1<|im_end|>\n<|im_start|>user\n"));
    cr_assert_str_eq(r2.pieces.question.s, "Q2<|im_end|>\n<|im_start|>assistant\n");
    rk_api_request_free(&r1);
    rk_api_request_free(&r2);
    json_decref(msgs);
    json_decref(chunks);
}

/* Gemma: the text Gemma 3's own template (tokenizer_config.json's
 * chat_template) renders for the same conversation, documents aside:
 * BOS (added by the tokenizer step), the system text and a blank line
 * opening the first user turn, every message trimmed, the assistant as
 * "model"; tools are refused; the template is detected from the GGUF's
 * chat_template text and from the family. */
Test(chat, gemma_renders_as_its_template) {
    json_t *msgs = json_array();
    add_msg(msgs, "system", "You are helpful.");
    add_msg(msgs, "user", "  What is a KV cache?  ");
    add_msg(msgs, "assistant", " Keys and values. ");
    add_msg(msgs, "user", "And reuse?\n");
    rk_api_request r;
    render_ok(RK_CHAT_GEMMA, msgs, NULL, &r);
    char all[1024];
    snprintf(all, sizeof all, "%s%s", r.pieces.system.s, r.pieces.question.s);
    cr_assert_str_eq(all, "<start_of_turn>user\nYou are helpful.\n\nWhat is a KV cache?<end_of_"
                          "turn>\n<start_of_turn>model\nKeys and values.<end_of_turn>\n<start_"
                          "of_turn>user\nAnd reuse?<end_of_turn>\n<start_of_turn>model\n");
    rk_api_request_free(&r);
    json_decref(msgs);
    cr_assert_eq(
        rk_chat_template_detect("{{ bos_token }}...'<start_of_turn>' + role", "llama", 0, 0),
        RK_CHAT_GEMMA);
    cr_assert_eq(rk_chat_template_detect(NULL, "gemma3", 0, 0), RK_CHAT_GEMMA);
    cr_assert_eq(rk_chat_template_detect(NULL, "gemma4", 0, 0), RK_CHAT_GEMMA);
    cr_assert_eq(rk_chat_template_detect(NULL, "gemma2", 0, 0), RK_CHAT_GEMMA);
    cr_assert_str_eq(rk_chat_template_name(RK_CHAT_GEMMA), "gemma");
}

/* The system piece, the chunks and the question of r, joined, into all. */
static void joined(const rk_api_request *r, char *all, size_t cap) {
    size_t n = (size_t)snprintf(all, cap, "%s", r->pieces.system.s);
    for (int k = 0; k < r->pieces.n_chunks && n < cap; k++)
        n += (size_t)snprintf(all + n, cap - n, "%s", r->pieces.chunks[k].s);
    if (n < cap) snprintf(all + n, cap - n, "%s", r->pieces.question.s);
}

/* Render msgs with Gemma 4's template (thinking: the request to think) and
 * compare the joined pieces with want. */
static void expect_gemma4(json_t *msgs, int thinking, const char *want) {
    rk_api_request r;
    render_ok(RK_CHAT_GEMMA4, msgs, NULL, &r);
    if (thinking) {
        rk_http_error err = {0};
        r.thinking = 1;
        cr_assert_eq(rk_chat_render(RK_CHAT_GEMMA4, &r, 8, &err), RK_OK, "%s", err.message);
    }
    char all[1024];
    joined(&r, all, sizeof all);
    cr_assert_str_eq(all, want);
    rk_api_request_free(&r);
    json_decref(msgs);
}

/* Gemma 4: every expected text below is the literal output of Gemma 4's own
 * chat template (tokenizer.chat_template of Gemma 4 E4B, rendered with
 * Jinja2, bos_token "<bos>", add_generation_prompt true, enable_thinking
 * true where thinking is set) for the same conversation, less the "<bos>"
 * the tokenizer step adds: the first system message in a system turn of its
 * own, "<|think|>\n" opening it when thinking (alone when there is no system
 * message), later system messages as system turns, every message trimmed,
 * the assistant as "model", an earlier answer's thought channel dropped and
 * an answer right after another continuing its model turn. */
Test(chat, gemma4_renders_as_its_template) {
    json_t *msgs = json_array();
    add_msg(msgs, "user", "  What is a KV cache?  ");
    expect_gemma4(msgs, 0, "<|turn>user\nWhat is a KV cache?<turn|>\n<|turn>model\n");

    msgs = json_array();
    add_msg(msgs, "system", " Be brief. ");
    add_msg(msgs, "user", "Hi");
    expect_gemma4(msgs, 0,
                  "<|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n");

    msgs = json_array();
    add_msg(msgs, "system", " You are helpful. ");
    add_msg(msgs, "user", "  What is a KV cache?  ");
    add_msg(msgs, "assistant", "<|channel>thought\nKeys, values.<channel|> Keys and values. ");
    add_msg(msgs, "assistant", "More.");
    add_msg(msgs, "user", "And reuse?\n");
    expect_gemma4(msgs, 0,
                  "<|turn>system\nYou are helpful.<turn|>\n<|turn>user\nWhat is a KV "
                  "cache?<turn|>\n<|turn>model\nKeys and values.<turn|>\nMore.<turn|>\n<|turn>"
                  "user\nAnd reuse?<turn|>\n<|turn>model\n");

    msgs = json_array();
    add_msg(msgs, "user", "Hi");
    expect_gemma4(msgs, 1,
                  "<|turn>system\n<|think|>\n<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n");

    msgs = json_array();
    add_msg(msgs, "system", "Be brief.");
    add_msg(msgs, "user", "Hi");
    add_msg(msgs, "system", " Later. ");
    add_msg(msgs, "user", "Again");
    expect_gemma4(msgs, 1,
                  "<|turn>system\n<|think|>\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>"
                  "system\nLater.<turn|>\n<|turn>user\nAgain<turn|>\n<|turn>model\n");
}

/* Gemma 4 with documents: the system piece ends with the document turn's
 * opening, the documents are chunks, raw, and the question closes the turn;
 * joined they are the template's text for the message's whole text ("Doc
 * one. Doc two. What do they say?"), and a follow-up extends the layout. */
Test(chat, gemma4_documents_are_chunks_of_the_user_turn) {
    json_t *msgs = json_array();
    add_msg(msgs, "system", "S");
    add_msg(msgs, "user", "Doc one. ##Doc two. ##What do they say?");
    rk_api_request r, r2;
    render_ok(RK_CHAT_GEMMA4, msgs, NULL, &r);
    cr_assert_str_eq(r.pieces.system.s, "<|turn>system\nS<turn|>\n<|turn>user\n");
    cr_assert_eq(r.pieces.n_chunks, 2);
    cr_assert_str_eq(r.pieces.question.s, "What do they say?<turn|>\n<|turn>model\n");
    char all[1024];
    joined(&r, all, sizeof all);
    cr_assert_str_eq(all, "<|turn>system\nS<turn|>\n<|turn>user\nDoc one. Doc two. What do they "
                          "say?<turn|>\n<|turn>model\n");
    add_msg(msgs, "assistant", "They say hello.");
    add_msg(msgs, "user", "Why?");
    render_ok(RK_CHAT_GEMMA4, msgs, NULL, &r2);
    assert_extends(&r, &r2);
    cr_assert_str_eq(r2.pieces.question.s, "What do they say?<turn|>\n<|turn>model\nThey say "
                                           "hello.<turn|>\n<|turn>user\nWhy?<turn|>\n<|turn>"
                                           "model\n");
    rk_api_request_free(&r);
    rk_api_request_free(&r2);
    json_decref(msgs);
}

/* Gemma 4 is known by its template's <|turn>, or by the gemma4 family when
 * the vocabulary has <|turn> (a gemma4 file with Gemma 3's vocabulary keeps
 * Gemma 3's template). Its tools: tests/test_gemma4.c. */
Test(chat, gemma4_is_detected) {
    cr_assert_eq(
        rk_chat_template_detect("{{- '<|turn>' + role + '\\n' }}<start_of_turn>", "llama", 0, 0),
        RK_CHAT_GEMMA4);
    cr_assert_eq(rk_chat_template_detect(NULL, "gemma4", 0, 1), RK_CHAT_GEMMA4);
    cr_assert_eq(rk_chat_template_detect(NULL, "gemma4", 0, 0), RK_CHAT_GEMMA);
    cr_assert_eq(rk_chat_template_detect(NULL, "gemma3", 0, 1), RK_CHAT_GEMMA);
    cr_assert_str_eq(rk_chat_template_name(RK_CHAT_GEMMA4), "gemma4");
}

/* Llama-2: a system message after the document turn opens the next [INST]
 * with its own <<SYS>> block; an answer's leading space (the decoded space of
 * its first token) is not doubled. */
Test(chat, llama2_keeps_later_system_messages_and_answer_spaces) {
    json_t *msgs = json_array();
    add_msg(msgs, "system", "S");
    add_msg(msgs, "user", "c1##Q1");
    add_msg(msgs, "assistant", " A1");
    add_msg(msgs, "system", "T");
    add_msg(msgs, "user", "Q2");
    rk_api_request r;
    render_ok(RK_CHAT_LLAMA2, msgs, NULL, &r);
    cr_assert_str_eq(r.pieces.system.s, WANT_SYS[RK_CHAT_LLAMA2]);
    cr_assert_str_eq(r.pieces.question.s,
                     "Q1 [/INST] A1 </s><s>[INST] <<SYS>>\nT\n<</SYS>>\n\nQ2 [/INST]");
    rk_api_request_free(&r);
    json_decref(msgs);
}

/* max_chunks applies to the chunks of every turn together; an empty
 * question after a separator is refused in any user message. */
Test(chat, limits_and_errors_follow_the_document_turn) {
    json_t *msgs = json_array();
    add_msg(msgs, "user", "c1##c2##c3##Q1");
    rk_api_request r;
    rk_http_error err;
    cr_assert_eq(render_body(RK_CHAT_CHATML, msgs, NULL, 2, &r, &err), RK_ERR_LIMIT);
    cr_assert_eq(err.status, 422);
    json_array_clear(msgs);
    add_msg(msgs, "user", "c1##Q1");
    add_msg(msgs, "assistant", "A1");
    add_msg(msgs, "user", "c2##Q2");
    cr_assert_eq(render_body(RK_CHAT_CHATML, msgs, NULL, 2, &r, &err), RK_OK, "%s", err.message);
    cr_assert_eq(r.pieces.n_chunks, 2);
    rk_api_request_free(&r);
    add_msg(msgs, "assistant", "A2");
    add_msg(msgs, "user", "c3##Q3");
    cr_assert_eq(render_body(RK_CHAT_CHATML, msgs, NULL, 2, &r, &err), RK_ERR_LIMIT);
    cr_assert_eq(err.status, 422);
    json_array_clear(msgs);
    add_msg(msgs, "user", "c1##");
    add_msg(msgs, "assistant", "A1");
    add_msg(msgs, "user", "Q2");
    cr_assert_eq(render_body(RK_CHAT_CHATML, msgs, NULL, 8, &r, &err), RK_ERR_INVALID);
    cr_assert_eq(err.status, 400);
    cr_assert_not_null(strstr(err.message, "messages[0]"), "%s", err.message);
    json_decref(msgs);
}

/* Without a separator in the body or the server's, "##" in a chat message is
 * text: a Markdown heading does not turn a chat into a RAG prompt. The
 * server's chat separator, or the body's, splits it. */
Test(chat, markdown_headings_are_text_unless_a_separator_is_set) {
    static const char *body =
        "{\"messages\": [{\"role\": \"user\", \"content\": \"## Summary\\nShort.##Q\"}]}";
    rk_api_request r;
    rk_http_error err;
    cr_assert_eq(render_text(RK_CHAT_CHATML, body, 8, NULL, &r, &err), RK_OK, "%s", err.message);
    cr_assert_eq(r.pieces.n_chunks, 0);
    cr_assert_str_eq(r.pieces.question.s,
                     "## Summary\nShort.##Q<|im_end|>\n<|im_start|>assistant\n");
    rk_api_request_free(&r);
    cr_assert_eq(render_text(RK_CHAT_CHATML, body, 8, "##", &r, &err), RK_OK, "%s", err.message);
    cr_assert_eq(r.pieces.n_chunks, 1);
    cr_assert_str_eq(r.pieces.chunks[0].s, " Summary\nShort.");
    cr_assert_str_eq(r.pieces.question.s, "Q<|im_end|>\n<|im_start|>assistant\n");
    rk_api_request_free(&r);
    static const char *with_sep = "{\"messages\": [{\"role\": \"user\", \"content\": "
                                  "\"a||b||Q\"}], \"separator\": \"||\"}";
    cr_assert_eq(render_text(RK_CHAT_CHATML, with_sep, 8, "##", &r, &err), RK_OK, "%s",
                 err.message);
    cr_assert_eq(r.pieces.n_chunks, 2);
    rk_api_request_free(&r);
}

/* vLLM's `documents` (text or content, id, title) are the first user
 * message's chunks, as the `chunks` extension's; content parts marked
 * ragkv_chunk are their message's chunks. Turn N+1 still extends turn N. */
Test(chat, documents_and_ragkv_chunk_parts_are_chunks) {
    rk_api_request r1, r2;
    rk_http_error err;
    static const char *docs =
        "{\"messages\": [{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", "
        "\"content\": \"Q1\"}], \"documents\": [{\"id\": \"d1\", \"title\": \"T\", \"text\": "
        "\"c1\"}, {\"content\": \"c2\"}, {\"text\": \"\"}]}";
    cr_assert_eq(render_text(RK_CHAT_LLAMA3, docs, 8, NULL, &r1, &err), RK_OK, "%s", err.message);
    cr_assert_str_eq(r1.pieces.system.s, WANT_SYS[RK_CHAT_LLAMA3]);
    cr_assert_eq(r1.pieces.n_chunks, 2);
    cr_assert_str_eq(r1.pieces.chunks[0].s, "T\nc1");
    cr_assert_str_eq(r1.pieces.chunks[1].s, "c2");
    cr_assert_eq(r1.pieces.n_empty_chunks, 1);
    cr_assert_not_null(r1.chunk_ids);
    cr_assert_str_eq(r1.chunk_ids[0], "d1");
    cr_assert_null(r1.chunk_ids[1]);
    cr_assert_str_eq(r1.pieces.question.s, WANT_Q[RK_CHAT_LLAMA3][0]);
    rk_api_request_free(&r1);

    static const char *parts1 =
        "{\"messages\": [{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", "
        "\"content\": [{\"type\": \"text\", \"text\": \"c1\", \"ragkv_chunk\": true}, {\"type\": "
        "\"text\", \"text\": \"c2\", \"ragkv_chunk\": true}, {\"type\": \"text\", \"text\": "
        "\"Q1\"}]}]}";
    static const char *parts2 =
        "{\"messages\": [{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", "
        "\"content\": [{\"type\": \"text\", \"text\": \"c1\", \"ragkv_chunk\": true}, {\"type\": "
        "\"text\", \"text\": \"c2\", \"ragkv_chunk\": true}, {\"type\": \"text\", \"text\": "
        "\"Q1\"}]}, {\"role\": \"assistant\", \"content\": \"A1\"}, {\"role\": \"user\", "
        "\"content\": \"## Q2\"}]}";
    for (int t = 0; t < N_TEMPLATES; t++) {
        cr_assert_eq(render_text((rk_chat_template)t, parts1, 8, NULL, &r1, &err), RK_OK, "%s",
                     err.message);
        cr_assert_eq(render_text((rk_chat_template)t, parts2, 8, NULL, &r2, &err), RK_OK, "%s",
                     err.message);
        cr_assert_str_eq(r1.pieces.system.s, WANT_SYS[t]);
        cr_assert_eq(r1.pieces.n_chunks, 2);
        cr_assert_str_eq(r1.pieces.chunks[0].s, "c1");
        cr_assert_str_eq(r1.pieces.chunks[1].s, "c2");
        cr_assert_str_eq(r1.pieces.question.s, WANT_Q[t][0]);
        cr_assert_null(r1.chunk_ids);
        assert_extends(&r1, &r2);
        cr_assert_not_null(strstr(r2.pieces.question.s, "## Q2"));
        rk_api_request_free(&r1);
        rk_api_request_free(&r2);
    }
}

/* A chat whose last message is the assistant's continues it: no new
 * assistant header after it and no end-of-turn marker. */
Test(chat, a_last_assistant_message_is_continued) {
    static const char *want_q[N_TEMPLATES] = {
        "Q1<|im_end|>\n<|im_start|>assistant\nThe answer is",
        "Q1<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nThe answer is",
        "Q1 [/INST] The answer is", "Q1<|end|>\n<|assistant|>\nThe answer is",
        "Q1<end_of_turn>\n<start_of_turn>model\nThe answer is"};
    for (int t = 0; t < N_TEMPLATES; t++) {
        json_t *msgs = json_array();
        add_msg(msgs, "system", "S");
        add_msg(msgs, "user", "Q1");
        add_msg(msgs, "assistant", "The answer is");
        rk_api_request r;
        render_ok((rk_chat_template)t, msgs, NULL, &r);
        cr_assert_str_eq(r.pieces.system.s, WANT_SYS[t]);
        cr_assert_str_eq(r.pieces.question.s, want_q[t], "template %d", t);
        rk_api_request_free(&r);
        json_decref(msgs);
    }
}

/* Bodies the chat parser refuses, each with a 400 that says why. */
Test(chat, bad_chat_bodies_are_400) {
    static const char *bodies[][2] = {
        {"{\"messages\": [{\"role\": \"assistant\", \"content\": \"A\"}]}", "no user message"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"Q\"}, {\"role\": \"system\", "
         "\"content\": \"S\"}]}",
         "last message"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"Q\"}], \"chunks\": [\"a\"], "
         "\"documents\": [{\"text\": \"b\"}]}",
         "not both"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"Q\"}], \"documents\": [\"b\"]}",
         "documents[0]"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"Q\"}, {\"role\": \"assistant\", "
         "\"content\": [{\"type\": \"text\", \"text\": \"d\", \"ragkv_chunk\": true}]}]}",
         "only user and tool messages"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": "
         "\"d\", \"ragkv_chunk\": 1}]}]}",
         "ragkv_chunk"},
    };
    rk_parse_limits lim = {.max_chunks = 8, .max_tokens = 64};
    for (size_t i = 0; i < sizeof bodies / sizeof bodies[0]; i++) {
        rk_api_request r;
        rk_http_error err = {0};
        cr_assert_eq(rk_api_parse(bodies[i][0], strlen(bodies[i][0]), 1, &lim, &r, &err),
                     RK_ERR_INVALID, "%s", bodies[i][0]);
        cr_assert_eq(err.status, 400);
        cr_assert_not_null(strstr(err.message, bodies[i][1]), "%s: %s", bodies[i][0], err.message);
    }
}

/* ---------------------------------------------------------------- on the pipeline */

static rk_service *open_svc(const char *model, int prefix_cache, const char *reindex) {
    rk_config cfg = rk_test_config(2, 64, NULL);
    cfg.prefix_cache = prefix_cache;
    snprintf(cfg.reindex, sizeof cfg.reindex, "%s", reindex);
    return rk_test_service_open(&cfg, model);
}

/* Prepare and run the rendered request api on svc (greedy: the body says
 * temperature 0). */
static void run_turn(rk_service *svc, const rk_api_request *api, rk_request *r) {
    memset(r, 0, sizeof *r);
    r->opt = api->opt;
    cr_assert_eq(rk_request_prepare(svc, &api->pieces, r), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_pipeline_run(svc, &r, 1, NULL), RK_OK, "%s", rk_error_message());
    cr_assert_gt(r->n_out, 1);
    cr_assert_eq(r->cached_tokens + r->computed_tokens, r->prompt_tokens);
}

/* How many of earlier's answer tokens that have KV (all but the last, which
 * was sampled and never fed) later's question repeats right after earlier's
 * question. Asserts that later's system, chunks and question start are
 * earlier's tokens. */
static int answer_tokens_repeated(const rk_request *earlier, const rk_request *later) {
    cr_assert_eq(later->n_sys, earlier->n_sys);
    cr_assert_eq(memcmp(later->sys, earlier->sys, (size_t)later->n_sys * sizeof(int32_t)), 0);
    cr_assert_eq(later->n_chunks, earlier->n_chunks);
    for (int k = 0; k < later->n_chunks; k++) {
        cr_assert_eq(later->chunk_lens[k], earlier->chunk_lens[k]);
        cr_assert_eq(memcmp(later->chunks[k], earlier->chunks[k],
                            (size_t)later->chunk_lens[k] * sizeof(int32_t)),
                     0);
    }
    int nq = earlier->n_question;
    cr_assert_gt(later->n_question, nq);
    cr_assert_eq(memcmp(later->question, earlier->question, (size_t)nq * sizeof(int32_t)), 0);
    int same = 0;
    while (same < earlier->n_out - 1 && nq + same < later->n_question &&
           later->question[nq + same] == earlier->out_tokens[same])
        same++;
    return same;
}

static const char *SYSTEM = "You are a storyteller.";
static const char *DOCUMENTS =
    "Lily had a red ball. She liked to play with it in the garden every day.##Tom had a big dog "
    "named Max. Max liked to run and bark at the birds.##The sun was warm and the sky was "
    "blue.##Tell me what Lily did one day";
static const char *PLAIN = "Tell me a story about Lily, her red ball and the garden";
static const char *FOLLOW_UPS[] = {"What did Tom do?", "Where did the dog run?"};
#define TURNS 3

/* A conversation of TURNS turns, each the last one's messages, its answer as
 * the service returns it and a new question: every turn after the first
 * reuses all of the last one's sequence its prompt repeats (the last one's
 * whole prompt, and its answer as far as the answer's text tokenizes to the
 * tokens generated), so it computes the rest of the answer, the template and
 * its question alone; and it generates what it generates on a service
 * without the prefix cache. first: the first user message, which carries
 * n_chunks documents (0: a chat without documents). whole_answer (a bit per
 * template): the answer is repeated whole. */
static void check_conversation_on(const char *model, const char *first, int n_chunks,
                                  unsigned whole_answer, const char *reindex) {
    rk_service *svc = open_svc(model, 1, reindex), *off = open_svc(model, 0, reindex);
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    for (int t = 0; t < N_TEMPLATES; t++) {
        json_t *msgs = json_array();
        add_msg(msgs, "system", SYSTEM);
        add_msg(msgs, "user", first);
        rk_request prev;
        for (int n = 0; n < TURNS; n++) {
            if (n > 0) {
                char *answer;
                cr_assert_eq(rk_report_text(tok, &prev, &answer), RK_OK);
                add_msg(msgs, "assistant", answer);
                add_msg(msgs, "user", FOLLOW_UPS[n - 1]);
                free(answer);
            }
            rk_api_request api;
            render_ok((rk_chat_template)t, msgs, NULL, &api);
            rk_request r;
            run_turn(svc, &api, &r);
            cr_assert_eq(r.n_chunks, n_chunks);
            if (n > 0) {
                int fed = prev.n_out - 1, same = answer_tokens_repeated(&prev, &r);
                cr_assert_eq(r.cached_tokens, prev.prompt_tokens + same,
                             "%s, template %d turn %d: %d cached of %d, %d answer tokens repeated",
                             reindex, t, n + 1, r.cached_tokens, r.prompt_tokens, same);
                cr_assert_eq(r.computed_tokens, r.n_question - prev.n_question - same);
                if (whole_answer & (1 << t))
                    cr_assert_eq(same, fed, "template %d turn %d: %d of %d answer tokens", t, n + 1,
                                 same, fed);
                rk_request ref;
                run_turn(off, &api, &ref);
                cr_assert_eq(ref.sys_cached + ref.conv_cached, 0);
                cr_assert_eq(r.n_out, ref.n_out);
                cr_assert_eq(
                    memcmp(r.out_tokens, ref.out_tokens, (size_t)r.n_out * sizeof(int32_t)), 0,
                    "template %d turn %d: the output differs from the one without reuse", t, n + 1);
                rk_request_free(&ref);
                rk_request_free(&prev);
            }
            prev = r;
            rk_api_request_free(&api);
        }
        rk_request_free(&prev);
        json_decref(msgs);
    }
    rk_service_close(svc);
    rk_service_close(off);
}

/* On both reindex paths: a zero-copy turn goes into the radix tree as a
 * copy of its runs, and the next turn's match reaches past its chunks. A
 * chat without documents extends its last turn the same way. */
static void check_conversation(const char *model, unsigned whole_answer) {
    check_conversation_on(model, DOCUMENTS, 3, whole_answer, "copy");
    check_conversation_on(model, DOCUMENTS, 3, whole_answer, "zero-copy");
    check_conversation_on(model, PLAIN, 0, whole_answer, "copy");
}

/* The embedded model's random weights emit byte tokens, some not valid
 * UTF-8 (returned as U+FFFD) and some that tokenize otherwise as text: its
 * answers come back as other tokens after the first few. */
Test(chat, tiny_a_follow_up_turn_computes_only_what_follows_the_last) {
    check_conversation(NULL, 0);
}

Test(chat, stories260k_a_follow_up_turn_computes_only_what_follows_the_last) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    /* Its answers are text that tokenizes back to the tokens generated. Under
     * Llama-2 the template's space after [/INST] is not what the model
     * generated there (it starts its answer without one), so the match ends
     * where the answer begins. */
    check_conversation(model, 1u << RK_CHAT_CHATML | 1u << RK_CHAT_LLAMA3);
    free(model);
}

/* ---------------------------------------------------------------- over HTTP */

/* Chat templates as a converted model's GGUF carries them in
 * tokenizer.chat_template (written here, not any model's own): the server
 * picks the Llama-2 or the Llama-3 rendering from their markers. */
static const char *LLAMA2_JINJA =
    "{% for m in messages %}{% if m['role'] == 'system' %}{% set sys = m['content'] %}"
    "{% elif m['role'] == 'user' %}{{ bos_token + '[INST] ' }}{% if sys %}"
    "{{ '<<SYS>>\\n' + sys + '\\n<</SYS>>\\n\\n' }}{% set sys = '' %}{% endif %}"
    "{{ m['content'] + ' [/INST]' }}{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}"
    "{% endif %}{% endfor %}";
static const char *LLAMA3_JINJA =
    "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
    "'<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}";

/* A first user message of about 45 tokens. */
static const char *LONG_FIRST =
    "Once upon a time there was a little girl named Lily. She had a red ball and a big dog "
    "named Max. Every day they went to the park to play in the sun. Tell me what happened "
    "when the ball rolled away";

/* A chat without documents over HTTP, on the real server with its default
 * cache settings: turn 1 (a system prompt and LONG_FIRST), then turn 2 (turn
 * 1's messages, its answer as the server returned it, a new question). Turn
 * 2 reuses turn 1's whole prompt from the radix tree, reported as the system
 * prompt and the conversation, and computes at most what its prompt adds to
 * turn 1's: the answer as tokenized again (its tokens that match the ones
 * generated are reused too), the template around it and the new question.
 * Its answer is the one computed without the prefix cache. */
static void check_plain_follow_up(const char *model, const char *want_template) {
    rk_test_server srv;
    const char *args[] = {"--model", model, "--threads", "1", NULL};
    cr_assert_eq(rk_test_server_start_ready(&srv, "chat", NULL, args), 0,
                 "the server did not start");
    rk_test_resp m;
    cr_assert_eq(rk_test_exchange(&srv.t, "GET", "/v1/models", NULL, NULL, &m), 0);
    cr_assert_str_eq(rk_test_jstr(m.json, "data.0.ragkv.chat_template"), want_template);
    rk_test_resp_free(&m);

    json_t *msgs = json_array();
    add_msg(msgs, "system", SYSTEM);
    add_msg(msgs, "user", LONG_FIRST);
    char *text = json_dumps(msgs, 0);
    rk_test_resp t1 = rk_test_postf(
        &srv.t, "/v1/chat/completions",
        "{\"messages\": %s, \"max_tokens\": 8, \"temperature\": 0, \"ignore_eos\": true}", text);
    free(text);
    cr_assert_eq(t1.http.status, 200, "%s", t1.http.body);
    long long p1 = rk_test_jint(t1.json, "usage.prompt_tokens");
    cr_assert_gt(p1, 40, "%s", t1.http.body);
    add_msg(msgs, "assistant", rk_test_jstr(t1.json, "choices.0.message.content"));
    add_msg(msgs, "user", "What did Max do?");
    text = json_dumps(msgs, 0);
    const char *fmt = "{\"messages\": %s, \"max_tokens\": 8, \"temperature\": 0, \"ignore_eos\": "
                      "true, \"prefix_cache\": %s}";
    rk_test_resp t2 = rk_test_postf(&srv.t, "/v1/chat/completions", fmt, text, "true");
    rk_test_resp ref = rk_test_postf(&srv.t, "/v1/chat/completions", fmt, text, "false");
    free(text);
    cr_assert_eq(t2.http.status, 200, "%s", t2.http.body);
    cr_assert_eq(ref.http.status, 200, "%s", ref.http.body);
    long long p2 = rk_test_jint(t2.json, "usage.prompt_tokens");
    long long cached = rk_test_jint(t2.json, "usage.prompt_tokens_details.cached_tokens");
    long long computed = rk_test_jint(t2.json, "ragkv.timings.prompt_tokens_computed");
    cr_log_info("%s: turn 1 %lld prompt tokens; turn 2 %lld, %lld cached, %lld computed",
                want_template, p1, p2, cached, computed);
    cr_assert_eq(cached + computed, p2);
    cr_assert_geq(cached, p1, "%s: turn 2 reuses %lld tokens of turn 1's %lld: %s", want_template,
                  cached, p1, t2.http.body);
    cr_assert_leq(computed, p2 - p1, "%s: turn 2 computes %lld tokens, its prompt adds %lld",
                  want_template, computed, p2 - p1);
    cr_assert_eq(rk_test_jint(t2.json, "ragkv.reused.prefix") +
                     rk_test_jint(t2.json, "ragkv.reused.conversation"),
                 cached, "%s", t2.http.body);
    cr_assert_gt(rk_test_jint(t2.json, "ragkv.reused.conversation"), 0, "%s", t2.http.body);
    cr_assert_eq(rk_test_jint(ref.json, "usage.prompt_tokens_details.cached_tokens"), 0);
    cr_assert(json_equal(rk_test_jget(t2.json, "ragkv.completion_ids"),
                         rk_test_jget(ref.json, "ragkv.completion_ids")),
              "%s: the answer differs from the one without the prefix cache", want_template);
    rk_test_resp_free(&t1);
    rk_test_resp_free(&t2);
    rk_test_resp_free(&ref);
    json_decref(msgs);
    rk_test_server_stop_checked(&srv);
}

Test(chat, qwen3_tiny_a_follow_up_without_documents_over_http_computes_its_new_turn,
     .timeout = 300) {
    char *model = rk_test_model("qwen3-tiny", "f32", 1);
    check_plain_follow_up(model, "chatml");
    free(model);
}

/* stories260K carrying each Llama chat template in its GGUF (the real
 * SentencePiece tokenizer: a piece's first word is tokenized with its word
 * start, so the turns must stay in the pieces they were in). */
Test(chat, stories260k_a_follow_up_without_documents_over_http_computes_its_new_turn,
     .timeout = 300) {
    char *src;
    RK_REQUIRE_SHARED(src, "models/stories260K.gguf");
    char *llama2 = rk_test_model_with_template(src, LLAMA2_JINJA, "stories260K-llama2.gguf");
    char *llama3 = rk_test_model_with_template(src, LLAMA3_JINJA, "stories260K-llama3.gguf");
    check_plain_follow_up(llama2, "llama2");
    check_plain_follow_up(llama3, "llama3");
    free(llama2);
    free(llama3);
    free(src);
}

/* ---------------------------------------------------------------- tools */

/* Parse a chat body given as text and render it with template t. */
static rk_status render_tools_body(rk_chat_template t, const char *body, rk_api_request *r,
                                   rk_http_error *err) {
    rk_parse_limits lim = {.max_chunks = 8, .max_tokens = 64};
    memset(err, 0, sizeof *err);
    rk_status st = rk_api_parse(body, strlen(body), 1, &lim, r, err);
    if (st) return st;
    st = rk_chat_render(t, r, 8, err);
    if (st) rk_api_request_free(r);
    return st;
}

#define TOOL_BODY(extra)                                                                           \
    "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},"                              \
    "{\"role\":\"user\",\"content\":\"Add 2 and 3\"},"                                             \
    "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c1\",\"type\":"            \
    "\"function\","                                                                                \
    "\"function\":{\"name\":\"add\",\"arguments\":\"{\\\"a\\\":2,\\\"b\\\":3}\"}}]},"              \
    "{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"5\"}],"                              \
    "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"add\",\"description\":\"Sum\","    \
    "\"parameters\":{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},"            \
    "\"b\":{\"type\":\"integer\"}},\"required\":[\"a\",\"b\"]}}}]" extra "}"

Test(chat, tools_and_tool_turns_render_as_each_template_writes_them) {
    rk_api_request r;
    rk_http_error err;
    cr_assert_eq(render_tools_body(RK_CHAT_CHATML, TOOL_BODY(""), &r, &err), RK_OK, "%s",
                 err.message);
    const char *sys = r.pieces.system.s, *q = r.pieces.question.s;
    cr_expect(strstr(sys, "<|im_start|>system\nBe brief.\n\n# Tools\n"), "%s", sys);
    cr_expect(strstr(sys, "<tools>\n{\"type\":\"function\",\"function\":{\"name\":\"add\""), "%s",
              sys);
    cr_expect(strstr(q, "<|im_start|>assistant\n<tool_call>\n{\"name\": \"add\", \"arguments\": "
                        "{\"a\":2,\"b\":3}}\n</tool_call><|im_end|>\n"),
              "%s", q);
    cr_expect(strstr(q, "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
                        "<|im_start|>assistant\n"),
              "%s", q);
    cr_expect_null(r.grammar, "auto: no constraint");
    /* Rendering again (another template, the same one) leaves the request as parsed. */
    char *first = strdup(sys);
    cr_assert_eq(rk_chat_render(RK_CHAT_LLAMA3, &r, 8, &err), RK_OK, "%s", err.message);
    cr_assert_eq(rk_chat_render(RK_CHAT_CHATML, &r, 8, &err), RK_OK, "%s", err.message);
    cr_expect_str_eq(r.pieces.system.s, first);
    cr_expect_eq(r.n_msgs, 4);
    free(first);
    rk_api_request_free(&r);

    cr_assert_eq(
        render_tools_body(RK_CHAT_LLAMA3, TOOL_BODY(",\"tool_choice\":\"required\""), &r, &err),
        RK_OK, "%s", err.message);
    q = r.pieces.question.s;
    cr_expect(strstr(r.pieces.system.s, "respond with JSON for a function call"), "%s",
              r.pieces.system.s);
    cr_expect(strstr(q, "{\"name\": \"add\", \"parameters\": {\"a\":2,\"b\":3}}<|eot_id|>"), "%s",
              q);
    cr_expect(strstr(q, "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>"), "%s", q);
    cr_expect_not_null(r.grammar, "required: constrained");
    cr_expect(r.opt.grammar == r.grammar);
    cr_assert_eq(rk_chat_render(RK_CHAT_CHATML, &r, 8, &err), RK_OK, "%s", err.message);
    cr_expect(r.grammar && r.opt.grammar == r.grammar,
              "the second render's grammar replaces the first");
    rk_api_request_free(&r);

    cr_expect_neq(render_tools_body(RK_CHAT_LLAMA2, TOOL_BODY(""), &r, &err), RK_OK);
    cr_expect_eq(err.status, 400);
    cr_expect(strstr(err.message, "llama2"), "%s", err.message);
    cr_expect_neq(
        render_tools_body(RK_CHAT_LLAMA3,
                          TOOL_BODY(",\"tool_choice\":\"required\",\"parallel_tool_calls\":true"),
                          &r, &err),
        RK_OK);
    cr_expect(strstr(err.message, "parallel_tool_calls"), "%s", err.message);
}

Test(chat, tool_calls_are_parsed_from_answers_of_either_family) {
    rk_api_request r;
    rk_http_error err;
    cr_assert_eq(render_tools_body(RK_CHAT_CHATML, TOOL_BODY(""), &r, &err), RK_OK, "%s",
                 err.message);
    char *content;
    json_t *calls = rk_chat_tool_calls(
        RK_CHAT_CHATML, &r,
        "Let me add.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n"
        "</tool_call>\n<tool_call>\n{\"name\": \"nope\", \"arguments\": {}}\n</tool_call>\n"
        "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 3, \"b\": 4}}\n</tool_call>",
        "req1", &content);
    cr_assert_not_null(calls);
    cr_expect_eq(json_array_size(calls), 2, "the unknown function is not a call");
    cr_expect_str_eq(content, "Let me add.");
    json_t *f = json_object_get(json_array_get(calls, 1), "function");
    cr_expect_str_eq(json_string_value(json_object_get(f, "name")), "add");
    cr_expect_str_eq(json_string_value(json_object_get(f, "arguments")), "{\"a\":3,\"b\":4}");
    cr_expect_str_eq(json_string_value(json_object_get(json_array_get(calls, 0), "id")),
                     "call_req1_0");
    json_decref(calls);
    free(content);
    calls = rk_chat_tool_calls(RK_CHAT_CHATML, &r, "Just text, no call.", "req1", &content);
    cr_expect_null(calls);
    calls = rk_chat_tool_calls(RK_CHAT_LLAMA3, &r,
                               " {\"name\": \"add\", \"parameters\": {\"a\": 5, \"b\": 6}}", "r2",
                               &content);
    cr_assert_not_null(calls);
    cr_expect_eq(json_array_size(calls), 1);
    cr_expect_str_eq(content, "");
    json_decref(calls);
    free(content);
    rk_api_request_free(&r);
}

/* ---------------------------------------------------------------- thinking */

/* Split text whole, then fed in every two pieces and byte by byte: the same
 * thinking and answer each time. */
static void expect_think_as(int kind, const char *text, const char *want_r, const char *want_c) {
    rk_strbuf r = {0}, c = {0};
    rk_think_split_text_as(kind, text, &r, &c);
    cr_assert_str_eq(r.s ? r.s : "", want_r, "thinking of \"%s\"", text);
    cr_assert_str_eq(c.s ? c.s : "", want_c, "answer of \"%s\"", text);
    rk_strbuf_free(&r);
    rk_strbuf_free(&c);
    size_t n = strlen(text);
    for (size_t cut = 0; cut <= n + 1; cut++) {
        rk_think_split s = {.gemma4 = kind == RK_THINK_GEMMA4};
        rk_strbuf r2 = {0}, c2 = {0};
        if (cut <= n) { /* two pieces */
            rk_think_feed(&s, text, cut, 0, &r2, &c2);
            rk_think_feed(&s, text + cut, n - cut, 1, &r2, &c2);
        } else { /* byte by byte */
            for (size_t i = 0; i < n; i++) rk_think_feed(&s, text + i, 1, 0, &r2, &c2);
            rk_think_feed(&s, "", 0, 1, &r2, &c2);
        }
        cr_assert_str_eq(r2.s ? r2.s : "", want_r, "\"%s\" cut at %zu: thinking", text, cut);
        cr_assert_str_eq(c2.s ? c2.s : "", want_c, "\"%s\" cut at %zu: answer", text, cut);
        rk_strbuf_free(&r2);
        rk_strbuf_free(&c2);
        rk_strbuf_free(&s.pending);
    }
}

static void expect_think(const char *text, const char *want_r, const char *want_c) {
    expect_think_as(RK_THINK_TAGS, text, want_r, want_c);
}

Test(chat, thinking_is_split_from_the_answer_however_the_text_arrives) {
    expect_think("<think>\nLet me see.\nIt is 4.\n</think>\n\nThe answer is 4.",
                 "Let me see.\nIt is 4.", "The answer is 4.");
    expect_think("The answer is 4.", "", "The answer is 4.");
    expect_think("  <think>a b</think>c", "a b", "c");
    expect_think("<think>\n\n</think>\n\nHi", "", "Hi");
    expect_think("<think>never closes ", "never closes", "");
    expect_think("<thi", "", "<thi");
    expect_think("<think>x </thinking> y</think> z </think>", "x </thinking> y", "z </think>");
    expect_think("", "", "");
    expect_think("Say <think> later", "", "Say <think> later");
}

/* Gemma 4's answer, decoded with its special tokens: the thought channel is
 * the thinking, the rest the answer, its end of turn (<turn|>, the end of
 * generation) and what follows belong to neither; Qwen3's tags are text. */
Test(chat, gemma4_thought_channel_is_split_from_the_answer_however_the_text_arrives) {
    expect_think_as(RK_THINK_GEMMA4,
                    "<|channel>thought\nLet me see.\nIt is 4.<channel|>The answer is 4.<turn|>",
                    "Let me see.\nIt is 4.", "The answer is 4.");
    expect_think_as(RK_THINK_GEMMA4, "The answer is 4.<turn|>", "", "The answer is 4.");
    expect_think_as(RK_THINK_GEMMA4, "<|channel>thought\n<channel|>Hi", "", "Hi");
    expect_think_as(RK_THINK_GEMMA4, "<|channel>thought\nnever closes ", "never closes", "");
    expect_think_as(RK_THINK_GEMMA4, "<|channel>thought\nstops<turn|>x", "stops", "");
    /* calls end the answer with the opening of their results */
    expect_think_as(RK_THINK_GEMMA4,
                    "<|channel>thought\nCall f.<channel|>On it.<|tool_call>call:f{}<tool_call|>"
                    "<|tool_response>x",
                    "Call f.", "On it.<|tool_call>call:f{}<tool_call|>");
    expect_think_as(RK_THINK_GEMMA4, "<|channel>thought\ncut<|tool_response>", "cut", "");
    expect_think_as(RK_THINK_GEMMA4, "<|chan", "", "<|chan");
    expect_think_as(RK_THINK_GEMMA4, "<think>a</think>b<turn", "", "<think>a</think>b<turn");
    expect_think_as(RK_THINK_GEMMA4, "Say <|channel>thought later", "",
                    "Say <|channel>thought later");
    expect_think_as(RK_THINK_GEMMA4, "", "", "");
}

/* Qwen3's template: a request that turns thinking off gets an empty
 * thinking block after the assistant's opening; an earlier answer's thinking
 * is dropped from the history. */
Test(chat, chatml_without_thinking_opens_the_answer_after_an_empty_thinking_block) {
    json_t *msgs = json_array();
    add_msg(msgs, "user", "Q1");
    add_msg(msgs, "assistant", "<think>\nhmm\n</think>\n\nA1");
    add_msg(msgs, "user", "Q2");
    rk_api_request r;
    render_ok(RK_CHAT_CHATML, msgs, NULL, &r);
    cr_assert_str_eq(r.pieces.question.s, "Q1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|"
                                          "im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n");
    cr_assert_eq(r.enable_thinking, -1);
    rk_http_error err = {0};
    r.no_thinking = 1;
    cr_assert_eq(rk_chat_render(RK_CHAT_CHATML, &r, 8, &err), RK_OK, "%s", err.message);
    const char *q = r.pieces.question.s;
    const char *tail = "<|im_start|>assistant\n<think>\n\n</think>\n\n";
    cr_assert(strlen(q) > strlen(tail) && !strcmp(q + strlen(q) - strlen(tail), tail), "%s", q);
    rk_api_request_free(&r);
    json_decref(msgs);
}

/* A served model's template and its prompt tokens for one chat turn. */
static void template_and_prompt(const char *const *args, char *tmpl, size_t cap, long long *n) {
    rk_test_server srv;
    cr_assert_eq(rk_test_server_start_ready(&srv, "chat", NULL, args), 0, "did not start");
    rk_test_resp m, r;
    cr_assert_eq(rk_test_exchange(&srv.t, "GET", "/v1/models", NULL, NULL, &m), 0);
    snprintf(tmpl, cap, "%s", rk_test_jstr(m.json, "data.0.ragkv.chat_template"));
    r = rk_test_postf(&srv.t, "/v1/chat/completions",
                      "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], "
                      "\"max_tokens\": 1}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    *n = rk_test_jint(r.json, "usage.prompt_tokens");
    rk_test_resp_free(&m);
    rk_test_resp_free(&r);
    rk_test_server_stop_checked(&srv);
}

/* --chat-template NAME or FILE overrides the model's template (the
 * embedded model's is Llama-2): the name, or a Jinja file's markers as a
 * GGUF's would be read; anything else stops the server at startup. */
Test(chat, chat_template_flag_names_the_template_or_a_jinja_file, .timeout = 300) {
    char tmpl[32];
    long long n_default, n_chatml, n_file;
    const char *plain[] = {"--threads", "1", NULL};
    template_and_prompt(plain, tmpl, sizeof tmpl, &n_default);
    cr_assert_str_eq(tmpl, "llama2");
    const char *named[] = {"--threads", "1", "--chat-template", "chatml", NULL};
    template_and_prompt(named, tmpl, sizeof tmpl, &n_chatml);
    cr_assert_str_eq(tmpl, "chatml");
    cr_assert_neq(n_chatml, n_default, "the turn is rendered otherwise");
    char *file = rk_test_write_tmp("chat", "t.jinja", LLAMA3_JINJA);
    const char *from_file[] = {"--threads", "1", "--chat-template", file, NULL};
    template_and_prompt(from_file, tmpl, sizeof tmpl, &n_file);
    cr_assert_str_eq(tmpl, "llama3");
    cr_assert_neq(n_file, n_default);
    char *junk = rk_test_write_tmp("chat", "junk.jinja", "{{ messages }}");
    const char *bad[][5] = {{"--chat-template", "chat-ml", NULL},
                            {"--chat-template", junk, NULL},
                            {"--chat-template", "/no/such/file.jinja", NULL}};
    const char *why[] = {"neither a template name", "no template is recognised",
                         "neither a template name"};
    for (int i = 0; i < 3; i++) {
        rk_test_server srv;
        int status = 0;
        cr_assert_eq(rk_test_server_start(&srv, "chat", NULL, bad[i], &status), -1, "%s started",
                     bad[i][1]);
        char *log = rk_test_read_file(srv.log, NULL);
        cr_assert(log && strstr(log, why[i]), "%s: %s", bad[i][1], log ? log : "(no log)");
        free(log);
    }
    free(file);
    free(junk);
}

/* An agent's loop: a tool result asked to be chunked is a group where it
 * stands (a JSON array of passages, or text split on the separator), as is
 * a later user message's `documents` field; the turns between are texts. */
Test(chat, tool_results_and_message_documents_are_groups_where_they_stand) {
    const char *body =
        "{\"messages\": ["
        "{\"role\": \"system\", \"content\": \"S\"},"
        "{\"role\": \"user\", \"content\": \"Q1\", \"documents\": [\"d1\", {\"text\": \"d2\"}]},"
        "{\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"id\": \"c1\", \"type\": "
        "\"function\", \"function\": {\"name\": \"search\", \"arguments\": \"{}\"}}]},"
        "{\"role\": \"tool\", \"tool_call_id\": \"c1\", \"content\": \"[\\\"p1\\\", {\\\"text\\\": "
        "\\\"p2\\\"}, \\\"\\\"]\"},"
        "{\"role\": \"assistant\", \"content\": \"A1\"},"
        "{\"role\": \"tool\", \"tool_call_id\": \"c2\", \"content\": \"p3##p4\"},"
        "{\"role\": \"user\", \"content\": \"Q2\"}],"
        " \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"search\"}}],"
        " \"chunking\": {\"tool_results\": true}, \"max_tokens\": 4}";
    rk_api_request r;
    rk_http_error err;
    cr_assert_eq(render_text(RK_CHAT_CHATML, body, 16, NULL, &r, &err), RK_OK, "%s", err.message);
    cr_assert_eq(r.pieces.n_groups, 3);
    cr_assert_eq(r.pieces.n_chunks, 6);
    const char *want[] = {"d1", "d2", "p1", "p2", "p3", "p4"};
    for (int k = 0; k < 6; k++) cr_assert_str_eq(r.pieces.chunks[k].s, want[k]);
    cr_assert_eq(r.pieces.group_end[0], 2);
    cr_assert_eq(r.pieces.group_end[1], 4);
    cr_assert_eq(r.pieces.group_end[2], 6);
    cr_assert_eq(r.pieces.n_empty_chunks, 1);
    cr_assert(strstr(r.pieces.system.s, "<|im_start|>user\n") != NULL);
    cr_assert(strncmp(r.pieces.texts[0].s, "Q1<|im_end|>\n", 13) == 0, "%s", r.pieces.texts[0].s);
    size_t n0 = strlen(r.pieces.texts[0].s);
    const char *opening = "<|im_start|>user\n<tool_response>\n";
    cr_assert(n0 > strlen(opening) && !strcmp(r.pieces.texts[0].s + n0 - strlen(opening), opening),
              "%s", r.pieces.texts[0].s);
    cr_assert(strncmp(r.pieces.texts[1].s, "\n</tool_response><|im_end|>\n", 28) == 0);
    cr_assert(strstr(r.pieces.texts[1].s, "A1<|im_end|>") != NULL);
    cr_assert(
        strncmp(r.pieces.question.s, "\n</tool_response><|im_end|>\n<|im_start|>user\nQ2", 47) == 0,
        "%s", r.pieces.question.s);
    rk_api_request_free(&r);
    /* Without chunking, a tool result is text (after the group), and a
     * tool message's documents field is its group. */
    const char *plain = "{\"messages\": [{\"role\": \"user\", \"content\": \"Q\"},"
                        "{\"role\": \"tool\", \"content\": \"p1##p2\", \"documents\": [\"x\"]},"
                        "{\"role\": \"user\", \"content\": \"Q2\"}], \"max_tokens\": 4}";
    cr_assert_eq(render_text(RK_CHAT_CHATML, plain, 16, NULL, &r, &err), RK_OK, "%s", err.message);
    cr_assert_eq(r.pieces.n_groups, 0, "one group: the classic layout");
    cr_assert_eq(r.pieces.n_chunks, 1);
    cr_assert_str_eq(r.pieces.chunks[0].s, "x");
    cr_assert(strstr(r.pieces.system.s, "<tool_response>\n") != NULL);
    cr_assert(strncmp(r.pieces.question.s, "p1##p2\n</tool_response>", 23) == 0, "%s",
              r.pieces.question.s);
    rk_api_request_free(&r);
}
