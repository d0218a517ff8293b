/* tests/test_gemma4.c — Gemma 4's tools: the declarations in the system
 * turn, earlier calls and their results in the model's turn, exactly as its
 * own chat template writes them (every expected text below is the output of
 * Gemma 4 E4B's tokenizer.chat_template rendered with Jinja2 for the same
 * conversation and tools, less its "<bos>"); the calls the model writes,
 * parsed back into OpenAI tool calls; the grammar of required calls; and
 * the refusals. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "engine/grammar.h"
#include "engine/tokenizer.h"
#include "gateway/chat.h"
#include "tests/testutil.h"

static rk_status render(const char *body, rk_api_request *r, rk_http_error *err) {
    rk_parse_limits lim = {.max_chunks = 8, .max_tokens = 64};
    memset(err, 0, sizeof *err);
    rk_status st = rk_api_parse(body, strlen(body), 1, &lim, r, err);
    if (st) return st;
    st = rk_chat_render(RK_CHAT_GEMMA4, r, 8, err);
    if (st) rk_api_request_free(r);
    return st;
}

/* The pieces of a rendering joined: the prompt as the model reads it. */
static char *joined(const rk_api_request *r) {
    rk_strbuf b = {0};
    rk_strbuf_puts(&b, r->pieces.system.s);
    for (int k = 0; k < r->pieces.n_chunks; k++) rk_strbuf_puts(&b, r->pieces.chunks[k].s);
    rk_strbuf_puts(&b, r->pieces.question.s);
    return rk_strbuf_take(&b);
}

/* Render {"messages": msgs, "tools": [tools]} and compare the prompt. */
static void expect_render(const char *msgs, const char *tools, const char *want) {
    rk_api_request r;
    rk_http_error err;
    char *body = NULL;
    cr_assert(asprintf(&body, "{\"messages\": %s, \"tools\": [%s]}", msgs, tools) > 0);
    cr_assert_eq(render(body, &r, &err), RK_OK, "%s", err.message);
    char *all = joined(&r);
    cr_assert_str_eq(all, want);
    free(all);
    free(body);
    rk_api_request_free(&r);
}

#define W_TOOL                                                                                     \
    "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"descrip"                 \
    "tion\": \"Current weather in a city.\", \"parameters\": {\"type\": \"object\""                \
    ", \"properties\": {\"city\": {\"type\": \"string\", \"description\": \"City "                 \
    "name\"}, \"unit\": {\"type\": \"string\", \"enum\": [\"celsius\", \"fahrenhe"                 \
    "it\"]}, \"days\": {\"type\": \"integer\"}, \"Tags\": {\"type\": \"array\", \""                \
    "items\": {\"type\": \"string\"}}, \"opts\": {\"type\": \"object\", \"propert"                 \
    "ies\": {\"deep\": {\"type\": \"boolean\", \"nullable\": true}}, \"required\""                 \
    ": [\"deep\"]}}, \"required\": [\"city\"]}}}"
#define P_TOOL                                                                                     \
    "{\"type\": \"function\", \"function\": {\"name\": \"ping\", \"parameters\": "                 \
    "{\"type\": \"object\"}}}"
#define N_TOOL                                                                                     \
    "{\"type\": \"function\", \"function\": {\"name\": \"no_params\", \"descripti"                 \
    "on\": \"Nothing.\"}}"
#define W_DECL                                                                                     \
    "<|tool>declaration:get_weather{description:<|\"|>Current weather in a city.<"                 \
    "|\"|>,parameters:{properties:{city:{description:<|\"|>City name<|\"|>,type:<"                 \
    "|\"|>STRING<|\"|>},days:{type:<|\"|>INTEGER<|\"|>},opts:{properties:{deep:{n"                 \
    "ullable:true,type:<|\"|>BOOLEAN<|\"|>}},required:[<|\"|>deep<|\"|>],type:<|\""                \
    "|>OBJECT<|\"|>},Tags:{items:{type:<|\"|>STRING<|\"|>},type:<|\"|>ARRAY<|\"|>"                 \
    "},unit:{enum:[<|\"|>celsius<|\"|>,<|\"|>fahrenheit<|\"|>],type:<|\"|>STRING<"                 \
    "|\"|>}},required:[<|\"|>city<|\"|>],type:<|\"|>OBJECT<|\"|>}}<tool|>"
#define P_DECL                                                                                     \
    "<|tool>declaration:ping{description:<|\"|><|\"|>,parameters:{type:<|\"|>OBJE"                 \
    "CT<|\"|>}}<tool|>"
#define N_DECL "<|tool>declaration:no_params{description:<|\"|>Nothing.<|\"|>}<tool|>"

Test(gemma4, tools_calls_and_results_render_as_the_template) {
    /* every kind of property (described, enum, integer, array items, nested object, nullable),
     * keys in dictsort order, a tool without properties and one without parameters */
    expect_render("[{\"role\": \"system\", \"content\": \" S \"}, {\"role\": \"user\", \"conten"
                  "t\": \"Weather?\"}]",
                  W_TOOL "," P_TOOL "," N_TOOL,
                  "<|turn>system\nS" W_DECL P_DECL N_DECL "<turn|>\n"
                  "<|turn>user\nWeather?<turn|>\n<|turn>model\n");
    /* tools alone open the system turn */
    expect_render("[{\"role\": \"user\", \"content\": \"Weather?\"}]", P_TOOL,
                  "<|turn>system\n" P_DECL "<turn|>\n"
                  "<|turn>user\nWeather?<turn|>\n<|turn>model\n");
    /* a call and its result: the model turn stays open, no opening after it */
    expect_render("[{\"role\": \"user\", \"content\": \"Weather in Paris?\"}, {\"role\": \"assi"
                  "stant\", \"content\": \"\", \"tool_calls\": [{\"id\": \"c1\", \"type\": \"fu"
                  "nction\", \"function\": {\"name\": \"get_weather\", \"arguments\": \"{\\\"ci"
                  "ty\\\": \\\"Paris\\\", \\\"days\\\": 2, \\\"ratio\\\": 0.5, \\\"flag\\\": tr"
                  "ue, \\\"list\\\": [1, \\\"a\\\"], \\\"nested\\\": {\\\"b\\\": 1, \\\"A\\\": "
                  "null}}\"}}]}, {\"role\": \"tool\", \"tool_call_id\": \"c1\", \"content\": \""
                  "18 C, sunny\"}]",
                  W_TOOL,
                  "<|turn>system\n" W_DECL "<turn|>\n"
                  "<|turn>user\nWeather in Paris?<turn|>\n<|turn>model\n<|tool_call>call:get_we"
                  "ather{city:<|\"|>Paris<|\"|>,days:2,flag:true,list:[1,<|\"|>a<|\"|>],nested:"
                  "{A:None,b:1},ratio:0.5}<tool_call|><|tool_response>response:get_weather{valu"
                  "e:<|\"|>18 C, sunny<|\"|>}<tool_response|>");
    /* the answer after the result continues the same model turn */
    expect_render("[{\"role\": \"user\", \"content\": \"Weather in Paris?\"}, {\"role\": \"assi"
                  "stant\", \"content\": \"\", \"tool_calls\": [{\"id\": \"c1\", \"type\": \"fu"
                  "nction\", \"function\": {\"name\": \"get_weather\", \"arguments\": \"{\\\"ci"
                  "ty\\\": \\\"Paris\\\", \\\"days\\\": 2, \\\"ratio\\\": 0.5, \\\"flag\\\": tr"
                  "ue, \\\"list\\\": [1, \\\"a\\\"], \\\"nested\\\": {\\\"b\\\": 1, \\\"A\\\": "
                  "null}}\"}}]}, {\"role\": \"tool\", \"tool_call_id\": \"c1\", \"content\": \""
                  "18 C, sunny\"}, {\"role\": \"assistant\", \"content\": \"It is sunny.\"}, {\""
                  "role\": \"user\", \"content\": \"Thanks\"}]",
                  W_TOOL,
                  "<|turn>system\n" W_DECL "<turn|>\n"
                  "<|turn>user\nWeather in Paris?<turn|>\n<|turn>model\n<|tool_call>call:get_we"
                  "ather{city:<|\"|>Paris<|\"|>,days:2,flag:true,list:[1,<|\"|>a<|\"|>],nested:"
                  "{A:None,b:1},ratio:0.5}<tool_call|><|tool_response>response:get_weather{valu"
                  "e:<|\"|>18 C, sunny<|\"|>}<tool_response|>It is sunny.<turn|>\n<|turn>user\n"
                  "Thanks<turn|>\n<|turn>model\n");
    /* two calls, results named by their id in any order, the calling message's text after them */
    expect_render("[{\"role\": \"user\", \"content\": \"Q\"}, {\"role\": \"assistant\", \"conte"
                  "nt\": \" Checking. \", \"tool_calls\": [{\"id\": \"c1\", \"type\": \"functio"
                  "n\", \"function\": {\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\""
                  ": \\\"Paris\\\", \\\"days\\\": 2, \\\"ratio\\\": 0.5, \\\"flag\\\": true, \\"
                  "\"list\\\": [1, \\\"a\\\"], \\\"nested\\\": {\\\"b\\\": 1, \\\"A\\\": null}}"
                  "\"}}, {\"id\": \"c2\", \"type\": \"function\", \"function\": {\"name\": \"pi"
                  "ng\", \"arguments\": \"{}\"}}]}, {\"role\": \"tool\", \"tool_call_id\": \"c2"
                  "\", \"content\": \"pong\"}, {\"role\": \"tool\", \"tool_call_id\": \"c1\", \""
                  "content\": \" 18 C \"}, {\"role\": \"user\", \"content\": \"More?\"}]",
                  W_TOOL "," P_TOOL,
                  "<|turn>system\n" W_DECL P_DECL "<turn|>\n"
                  "<|turn>user\nQ<turn|>\n<|turn>model\n<|tool_call>call:get_weather{city:<|\"|"
                  ">Paris<|\"|>,days:2,flag:true,list:[1,<|\"|>a<|\"|>],nested:{A:None,b:1},rat"
                  "io:0.5}<tool_call|><|tool_call>call:ping{}<tool_call|><|tool_response>respon"
                  "se:ping{value:<|\"|>pong<|\"|>}<tool_response|><|tool_response>response:get_"
                  "weather{value:<|\"|> 18 C <|\"|>}<tool_response|>Checking.<turn|>\n<|turn>us"
                  "er\nMore?<turn|>\n<|turn>model\n");
    /* a call with no result: <|tool_response> where the results would go */
    expect_render("[{\"role\": \"user\", \"content\": \"Q\"}, {\"role\": \"assistant\", \"conte"
                  "nt\": \"\", \"tool_calls\": [{\"id\": \"c2\", \"type\": \"function\", \"func"
                  "tion\": {\"name\": \"ping\", \"arguments\": \"{}\"}}]}, {\"role\": \"user\","
                  " \"content\": \"Again\"}]",
                  P_TOOL,
                  "<|turn>system\n" P_DECL "<turn|>\n"
                  "<|turn>user\nQ<turn|>\n<|turn>model\n<|tool_call>call:ping{}<tool_call|><|to"
                  "ol_response><|turn>user\nAgain<turn|>\n<|turn>model\n");
    /* the thinking of a call after the last question stays (reasoning_content), an earlier
     * one's is dropped */
    expect_render("[{\"role\": \"user\", \"content\": \"Weather in Paris?\"}, {\"role\": \"assi"
                  "stant\", \"content\": \"\", \"reasoning_content\": \"The tool knows.\", \"to"
                  "ol_calls\": [{\"id\": \"c2\", \"type\": \"function\", \"function\": {\"name\""
                  ": \"ping\", \"arguments\": \"{}\"}}]}, {\"role\": \"tool\", \"tool_call_id\""
                  ": \"c2\", \"content\": \"pong\"}, {\"role\": \"assistant\", \"content\": \"D"
                  "one.\"}, {\"role\": \"user\", \"content\": \"And now?\"}, {\"role\": \"assis"
                  "tant\", \"content\": \"\", \"reasoning_content\": \"Again.\", \"tool_calls\""
                  ": [{\"id\": \"c2\", \"type\": \"function\", \"function\": {\"name\": \"ping\""
                  ", \"arguments\": \"{}\"}}]}, {\"role\": \"tool\", \"tool_call_id\": \"c2\", "
                  "\"content\": \"pong\"}]",
                  P_TOOL,
                  "<|turn>system\n" P_DECL "<turn|>\n"
                  "<|turn>user\nWeather in Paris?<turn|>\n<|turn>model\n<|tool_call>call:ping{}"
                  "<tool_call|><|tool_response>response:ping{value:<|\"|>pong<|\"|>}<tool_respo"
                  "nse|>Done.<turn|>\n<|turn>user\nAnd now?<turn|>\n<|turn>model\n<|channel>tho"
                  "ught\nAgain.\n<channel|><|tool_call>call:ping{}<tool_call|><|tool_response>r"
                  "esponse:ping{value:<|\"|>pong<|\"|>}<tool_response|>");
    /* a result that is JSON text is a string value, as the template writes it */
    expect_render("[{\"role\": \"user\", \"content\": \"Q\"}, {\"role\": \"assistant\", \"conte"
                  "nt\": \"\", \"tool_calls\": [{\"id\": \"c1\", \"type\": \"function\", \"func"
                  "tion\": {\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Pari"
                  "s\\\", \\\"days\\\": 2, \\\"ratio\\\": 0.5, \\\"flag\\\": true, \\\"list\\\""
                  ": [1, \\\"a\\\"], \\\"nested\\\": {\\\"b\\\": 1, \\\"A\\\": null}}\"}}, {\"i"
                  "d\": \"c2\", \"type\": \"function\", \"function\": {\"name\": \"ping\", \"ar"
                  "guments\": \"{}\"}}]}, {\"role\": \"tool\", \"tool_call_id\": \"c1\", \"cont"
                  "ent\": \"{\\\"temp\\\": 18, \\\"sky\\\": \\\"clear\\\", \\\"wind\\\": null, "
                  "\\\"gusts\\\": [1.5, true]}\"}, {\"role\": \"tool\", \"tool_call_id\": \"c2\""
                  ", \"content\": \"42\"}, {\"role\": \"user\", \"content\": \"Ok?\"}]",
                  W_TOOL "," P_TOOL,
                  "<|turn>system\n" W_DECL P_DECL "<turn|>\n"
                  "<|turn>user\nQ<turn|>\n<|turn>model\n<|tool_call>call:get_weather{city:<|\"|"
                  ">Paris<|\"|>,days:2,flag:true,list:[1,<|\"|>a<|\"|>],nested:{A:None,b:1},rat"
                  "io:0.5}<tool_call|><|tool_call>call:ping{}<tool_call|><|tool_response>respon"
                  "se:get_weather{value:<|\"|>{\"temp\": 18, \"sky\": \"clear\", \"wind\": null"
                  ", \"gusts\": [1.5, true]}<|\"|>}<tool_response|><|tool_response>response:pin"
                  "g{value:<|\"|>42<|\"|>}<tool_response|><|turn>user\nOk?<turn|>\n<|turn>model"
                  "\n");
}

/* A result without a tool_call_id answers the call in its place (the
 * template would name it "unknown"). */
Test(gemma4, a_result_without_an_id_answers_the_call_in_its_place) {
    expect_render("[{\"role\": \"user\", \"content\": \"Q\"}, {\"role\": \"assistant\", "
                  "\"content\": \"\", \"tool_calls\": [{\"id\": \"c1\", \"type\": \"function\", "
                  "\"function\": {\"name\": \"ping\", \"arguments\": \"{}\"}}, {\"id\": \"c2\", "
                  "\"type\": \"function\", \"function\": {\"name\": \"now\", \"arguments\": "
                  "\"{}\"}}]}, {\"role\": \"tool\", \"content\": \"a\"}, {\"role\": \"tool\", "
                  "\"content\": \"b\"}]",
                  P_TOOL,
                  "<|turn>system\n" P_DECL "<turn|>\n"
                  "<|turn>user\nQ<turn|>\n<|turn>model\n<|tool_call>call:ping{}<tool_call|>"
                  "<|tool_call>call:now{}<tool_call|><|tool_response>response:ping{value:<|\"|>a"
                  "<|\"|>}<tool_response|><|tool_response>response:now{value:<|\"|>b<|\"|>}"
                  "<tool_response|>");
}

/* A tool result with documents: a chunk group inside its value, the rest of
 * its text after them; joined, the template's text for the whole result. */
Test(gemma4, documents_of_a_tool_result_are_chunks_of_its_value) {
    const char *body =
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Q\"}, {\"role\": \"assistant\", "
        "\"content\": \"\", \"tool_calls\": [{\"id\": \"c2\", \"type\": \"function\", "
        "\"function\": {\"name\": \"ping\", \"arguments\": \"{}\"}}]}, {\"role\": \"tool\", "
        "\"tool_call_id\": \"c2\", \"documents\": [\"Doc A. \", \"Doc B. \"], \"content\": "
        "\"pong\"}], \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"ping\", "
        "\"parameters\": {\"type\": \"object\"}}}]}";
    rk_api_request r;
    rk_http_error err;
    cr_assert_eq(render(body, &r, &err), RK_OK, "%s", err.message);
    cr_assert_eq(r.pieces.n_chunks, 2);
    cr_assert_str_eq(r.pieces.chunks[0].s, "Doc A. ");
    cr_assert_str_eq(r.pieces.question.s, "pong<|\"|>}<tool_response|>");
    char *all = joined(&r);
    cr_assert_str_eq(all,
                     "<|turn>system\n<|tool>declaration:ping{description:<|\"|><|\"|>,parameters:{"
                     "type:<|\"|>OBJECT<|\"|>}}<tool|><turn|>\n<|turn>user\nQ<turn|>\n<|turn>model"
                     "\n<|tool_call>call:ping{}<tool_call|><|tool_response>response:ping{value:<|\""
                     "|>Doc A. Doc B. pong<|\"|>}<tool_response|>");
    free(all);
    rk_api_request_free(&r);
}

/* A result must answer a call: the template writes it inside the turn of
 * the call it answers, named by its id (without one, by its place). */
Test(gemma4, a_result_without_its_call_is_refused) {
    static const char *const bodies[] = {
        /* no tool_call_id, and more results than calls */
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Q\"}, {\"role\": \"assistant\", "
        "\"content\": \"\", \"tool_calls\": [{\"id\": \"c1\", \"type\": \"function\", "
        "\"function\": {\"name\": \"ping\", \"arguments\": \"{}\"}}]}, {\"role\": \"tool\", "
        "\"content\": \"pong\"}, {\"role\": \"tool\", \"content\": \"pong\"}]}",
        /* an id of no call */
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Q\"}, {\"role\": \"assistant\", "
        "\"content\": \"\", \"tool_calls\": [{\"id\": \"c1\", \"type\": \"function\", "
        "\"function\": {\"name\": \"ping\", \"arguments\": \"{}\"}}]}, {\"role\": \"tool\", "
        "\"tool_call_id\": \"c9\", \"content\": \"pong\"}]}",
        /* after a user message, not a call */
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Q\"}, {\"role\": \"tool\", "
        "\"tool_call_id\": \"c1\", \"content\": \"pong\"}]}",
    };
    for (size_t i = 0; i < sizeof bodies / sizeof *bodies; i++) {
        rk_api_request r;
        rk_http_error err;
        cr_assert_eq(render(bodies[i], &r, &err), RK_ERR_INVALID, "case %zu", i);
        cr_assert_eq(err.status, 400);
        cr_assert(strstr(err.message, "tool_call_id") && strstr(err.message, "gemma4"), "%s",
                  err.message);
    }
}

static void parse_tools(rk_api_request *r) {
    const char *body =
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Q\"}], \"tools\": [{\"type\": "
        "\"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": "
        "\"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}}}, {\"type\": "
        "\"function\", \"function\": {\"name\": \"now\"}}]}";
    rk_http_error err;
    cr_assert_eq(render(body, r, &err), RK_OK, "%s", err.message);
}

/* The calls the model writes: each <|tool_call>call:NAME{...}<tool_call|>
 * of a known tool, its value syntax read into JSON; the text before the
 * first is the content. */
Test(gemma4, a_call_the_model_writes_is_a_tool_call) {
    rk_api_request r;
    parse_tools(&r);
    char *content = NULL;
    json_t *calls = rk_chat_tool_calls(
        RK_CHAT_GEMMA4, &r,
        "Let me check. <|tool_call>call:get_weather{city:<|\"|>Paris, \"FR\"<|\"|>,days:2,"
        "ratio:0.5,flag:true,none:None,list:[1,<|\"|>a<|\"|>,{x:-3}],nested:{<|\"|>k<|\"|>:"
        "false}}<tool_call|><|tool_call>call:now{}<tool_call|><|tool_response>",
        "chatcmpl-x", &content);
    cr_assert_not_null(calls);
    cr_assert_eq(json_array_size(calls), 2);
    json_t *c = json_array_get(calls, 0);
    cr_assert_str_eq(json_string_value(json_object_get(c, "id")), "call_chatcmpl-x_0");
    cr_assert_str_eq(rk_test_jstr(c, "function.name"), "get_weather");
    json_t *args = json_loads(rk_test_jstr(c, "function.arguments"), 0, NULL);
    json_t *want = json_loads("{\"city\": \"Paris, \\\"FR\\\"\", \"days\": 2, \"ratio\": 0.5, "
                              "\"flag\": true, \"none\": null, \"list\": [1, \"a\", {\"x\": -3}], "
                              "\"nested\": {\"k\": false}}",
                              0, NULL);
    cr_assert(json_equal(args, want), "%s", rk_test_jstr(c, "function.arguments"));
    json_decref(args);
    json_decref(want);
    cr_assert_str_eq(rk_test_jstr(json_array_get(calls, 1), "function.name"), "now");
    cr_assert_str_eq(rk_test_jstr(json_array_get(calls, 1), "function.arguments"), "{}");
    cr_assert_str_eq(content, "Let me check.");
    json_decref(calls);
    free(content);
    /* not calls: an unknown tool, no closing tag, a broken value, no
     * mapping, plain text */
    static const char *const not_calls[] = {
        "<|tool_call>call:nope{}<tool_call|>",
        "<|tool_call>call:now{}",
        "<|tool_call>call:get_weather{city:<|\"|>Paris}<tool_call|>",
        "<|tool_call>call:get_weather{city}<tool_call|>",
        "<|tool_call>call:now[]<tool_call|>",
        "call:now{}",
        "",
    };
    for (size_t i = 0; i < sizeof not_calls / sizeof *not_calls; i++) {
        content = (char *)"unset";
        calls = rk_chat_tool_calls(RK_CHAT_GEMMA4, &r, not_calls[i], "id", &content);
        cr_assert_null(calls, "case %zu", i);
        cr_assert_null(content, "case %zu", i);
    }
    rk_api_request_free(&r);
}

/* What the template writes for a call reads back as the same arguments. */
Test(gemma4, a_written_call_reads_back_as_its_arguments) {
    static const char *const cases[] = {
        "{}",
        "{\"a\": \"\"}",
        "{\"s\": \"commas, colons: and {braces} [too]\", \"n\": -12, \"x\": 1e-07}",
        "{\"big\": 12345678901234567, \"f\": 1e+16, \"g\": 100.0, \"h\": 0.1, \"t\": true}",
        "{\"deep\": {\"b\": [[1, 2], [], {}], \"A\": {\"c\": null}}, \"Z\": \"unicode \\u00e9\"}",
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        json_t *args = json_loads(cases[i], 0, NULL);
        cr_assert_not_null(args, "case %zu", i);
        rk_strbuf b = {0};
        rk_gemma4_call(&b, "f", args);
        cr_assert(!b.oom);
        size_t pos = 0, at = 1;
        char name[65];
        json_t *got = NULL;
        cr_assert_eq(rk_gemma4_find_call(b.s, &pos, name, &got, &at), 1, "%s", b.s);
        cr_assert_str_eq(name, "f");
        cr_assert_eq(at, 0);
        cr_assert_eq(pos, b.len);
        cr_assert(json_equal(got, args), "case %zu: %s", i, b.s);
        json_decref(got);
        json_decref(args);
        rk_strbuf_free(&b);
    }
    /* numbers as Python prints them (the template's text) */
    json_t *args = json_loads("{\"a\": 1e-07, \"b\": 1e+16, \"c\": 100.0, \"d\": 0.0001, "
                              "\"e\": 123456.789, \"f\": -2.5e-05}",
                              0, NULL);
    rk_strbuf b = {0};
    rk_gemma4_call(&b, "f", args);
    cr_assert_str_eq(b.s, "<|tool_call>call:f{a:1e-07,b:1e+16,c:100.0,d:0.0001,e:123456.789,"
                          "f:-2.5e-05}<tool_call|>");
    rk_strbuf_free(&b);
    json_decref(args);
}

/* Whether the grammar takes text whole (and may end there). */
static int takes(const rk_grammar *g, const rk_grammar_vocab *v, const char *text) {
    rk_grammar_state *s;
    cr_assert_eq(rk_grammar_state_create(g, v, &s), RK_OK, "%s", rk_error_message());
    int ok = rk_grammar_state_accept_bytes(s, text, (int)strlen(text)) == RK_OK &&
             rk_grammar_state_can_end(s);
    rk_grammar_state_free(s);
    return ok;
}

/* tool_choice required or named: the answer is Gemma 4's calls, each tool's
 * mapping shaped by its parameters (keys in the template's order, required
 * ones present, values of their types), and what it takes parses back. */
Test(gemma4, required_calls_are_constrained_to_the_tools_parameters) {
    rk_vocab voc;
    rk_tokenizer *tok;
    rk_grammar_vocab *v;
    cr_assert_eq(rk_vocab_from_hf_json(RK_TEST_DATA "/spm-tokenizer.json", 0, &voc), RK_OK, "%s",
                 rk_error_message());
    cr_assert_eq(rk_tokenizer_create(&voc, &tok), RK_OK, "%s", rk_error_message());
    rk_vocab_free(&voc);
    cr_assert_eq(rk_grammar_vocab_create(tok, &v), RK_OK, "%s", rk_error_message());
    const char *body =
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Q\"}], \"tool_choice\": "
        "\"required\", \"parallel_tool_calls\": false, \"tools\": [{\"type\": \"function\", "
        "\"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\", "
        "\"properties\": {\"city\": {\"type\": \"string\"}, \"unit\": {\"type\": \"string\", "
        "\"enum\": [\"celsius\", \"fahrenheit\"]}, \"days\": {\"type\": \"integer\"}, \"Tags\": "
        "{\"type\": \"array\", \"items\": {\"type\": \"number\"}}, \"opts\": {\"type\": "
        "\"object\", \"properties\": {\"deep\": {\"type\": \"boolean\"}}}}, \"required\": "
        "[\"city\"]}}}, {\"type\": \"function\", \"function\": {\"name\": \"now\"}}]}";
    rk_api_request r;
    rk_http_error err;
    cr_assert_eq(render(body, &r, &err), RK_OK, "%s", err.message);
    cr_assert_not_null(r.opt.grammar);
    static const char *const good[] = {
        "<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>}<tool_call|>",
        "<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>,days:-2,opts:{deep:true},"
        "Tags:[1.5,2e3],unit:<|\"|>celsius<|\"|>}<tool_call|>",
        "<|tool_call>call:get_weather{city:<|\"|><|\"|>,unit:<|\"|>fahrenheit<|\"|>}"
        "<tool_call|>",
        "<|tool_call>call:now{}<tool_call|>",
        "<|tool_call>call:now{any:[<|\"|>x<|\"|>,{y:false}]}<tool_call|>",
    };
    static const char *const bad[] = {
        "<|tool_call>call:get_weather{}<tool_call|>",                          /* city */
        "<|tool_call>call:get_weather{days:2,city:<|\"|>P<|\"|>}<tool_call|>", /* order */
        "<|tool_call>call:get_weather{city:<|\"|>P<|\"|>,unit:<|\"|>K<|\"|>}<tool_call|>", /* enum
                                                                                            */
        "<|tool_call>call:get_weather{city:3}<tool_call|>",                      /* type */
        "<|tool_call>call:get_weather{city:<|\"|>P<|\"|>,days:1.5}<tool_call|>", /* integer */
        "<|tool_call>call:get_weather{city:<|\"|>P<|\"|>,wind:1}<tool_call|>",   /* key */
        "<|tool_call>call:nope{}<tool_call|>",
        "<|tool_call>call:now{}<tool_call|><|tool_call>call:now{}<tool_call|>", /* one call */
        "Sure: <|tool_call>call:now{}<tool_call|>",
    };
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
        cr_assert(takes(r.opt.grammar, v, good[i]), "good %zu: %s", i, good[i]);
        char *content = NULL;
        json_t *calls = rk_chat_tool_calls(RK_CHAT_GEMMA4, &r, good[i], "id", &content);
        cr_assert_eq(json_array_size(calls), 1, "good %zu parses", i);
        json_decref(calls);
        free(content);
    }
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        cr_assert(!takes(r.opt.grammar, v, bad[i]), "bad %zu: %s", i, bad[i]);
    rk_api_request_free(&r);
    /* named, several in a row (parallel_tool_calls, true by default) */
    const char *named =
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Q\"}], \"tool_choice\": {\"type\": "
        "\"function\", \"function\": {\"name\": \"now\"}}, \"tools\": [{\"type\": \"function\", "
        "\"function\": {\"name\": \"get_weather\"}}, {\"type\": \"function\", \"function\": "
        "{\"name\": \"now\"}}]}";
    cr_assert_eq(render(named, &r, &err), RK_OK, "%s", err.message);
    cr_assert(takes(r.opt.grammar, v, "<|tool_call>call:now{}<tool_call|>"));
    cr_assert(takes(r.opt.grammar, v,
                    "<|tool_call>call:now{}<tool_call|><|tool_call>call:now{a:1}<tool_call|>"));
    cr_assert(!takes(r.opt.grammar, v, "<|tool_call>call:get_weather{}<tool_call|>"));
    rk_api_request_free(&r);
    rk_grammar_vocab_free(v);
    rk_tokenizer_free(tok);
}
