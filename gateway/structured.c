/* gateway/structured.c — the request fields of structured output:
 * `response_format` (text, json_object, json_schema), the `grammar`
 * extension, and chat `tools`, `tool_choice`, `parallel_tool_calls` and the
 * tool calls of earlier assistant messages. The grammar itself is compiled
 * by the engine (engine/grammar.h) when the request is prepared; here the
 * fields are validated and kept, and a grammar is compiled (on the HTTP
 * worker, through the service's cache of compiled grammars when one is
 * given). Safe from any thread. */
#include <ctype.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/api.h"
#include "gateway/json_fields.h"

/* response_format ({"type": "text" | "json_object" | "json_schema"}) and the
 * `grammar` extension (grammar text), compiled into out->grammar (through
 * cache, which may be NULL). A schema the engine cannot enforce is refused
 * with the JSON path of the part; a grammar over a bound, with the bound. */
int rk_api_parse_response_format(json_t *root, rk_grammar_cache *cache, rk_api_request *out,
                                 rk_http_error *err) {
    json_t *rf = json_object_get(root, "response_format");
    json_t *gr = json_object_get(root, "grammar");
    const char *type = NULL;
    if (rf && !json_is_null(rf)) {
        type = json_string_value(json_object_get(rf, "type"));
        if (!json_is_object(rf) || !type)
            return rk_http_errorf(err, 400,
                                  "'response_format' must be an object with a 'type': \"text\", "
                                  "\"json_object\" or \"json_schema\""),
                   1;
        if (!strcmp(type, "text"))
            type = NULL;
        else if (strcmp(type, "json_object") && strcmp(type, "json_schema"))
            return rk_http_errorf(err, 400,
                                  "'response_format.type' must be \"text\", \"json_object\" or "
                                  "\"json_schema\""),
                   1;
    }
    if (gr && !json_is_null(gr)) {
        if (!json_is_string(gr))
            return rk_http_errorf(err, 400, "'grammar' must be a string of grammar rules"), 1;
        if (type)
            return rk_http_errorf(err, 400, "give 'grammar' or a JSON 'response_format', not both"),
                   1;
        if (rk_grammar_cache_parse(cache, json_string_value(gr), &out->grammar))
            return rk_http_errorf(err, 400, "'grammar' is not valid: %s", rk_error_message()), 1;
    } else if (type && !strcmp(type, "json_object")) {
        if (rk_grammar_cache_json_object(cache, &out->grammar))
            return rk_http_errorf(err, 500, "%s", rk_error_message()), 1;
    } else if (type) {
        json_t *js = json_object_get(rf, "json_schema");
        json_t *schema = json_object_get(js, "schema");
        json_t *name = json_object_get(js, "name"), *strict = json_object_get(js, "strict");
        if (!json_is_object(js) || !schema)
            return rk_http_errorf(err, 400,
                                  "'response_format.json_schema' must be an object with a "
                                  "'schema'"),
                   1;
        if (name && !json_is_null(name) && !json_is_string(name))
            return rk_http_errorf(err, 400, "'response_format.json_schema.name' must be a string"),
                   1;
        if (strict && !json_is_null(strict) && !json_is_boolean(strict))
            return rk_http_errorf(err, 400,
                                  "'response_format.json_schema.strict' must be a boolean"),
                   1;
        /* strict or not, the schema is enforced whole: a part that cannot be
         * is refused rather than left unchecked. */
        if (rk_grammar_cache_schema(cache, schema, &out->grammar))
            return rk_http_errorf(err, 400,
                                  "'response_format.json_schema.schema' cannot be enforced: %s",
                                  rk_error_message()),
                   1;
    }
    out->opt.grammar = out->grammar;
    return 0;
}

/* Function names: what OpenAI allows ([A-Za-z0-9_-], 1 to 64). */
static int tool_name_ok(const char *s) {
    size_t n = strlen(s);
    if (n < 1 || n > 64) return 0;
    for (size_t i = 0; i < n; i++)
        if (!isalnum((unsigned char)s[i]) && s[i] != '_' && s[i] != '-') return 0;
    return 1;
}

/* An assistant message's tool_calls, kept as JSON text of [{"name",
 * "arguments"}] with the arguments parsed from their JSON string. */
static int parse_tool_calls(json_t *tc, int i, char **out, rk_http_error *err) {
    if (!json_is_array(tc) || !json_array_size(tc))
        return rk_http_errorf(err, 400, "messages[%d].tool_calls must be a non-empty array", i), 1;
    json_t *list = json_array();
    for (size_t k = 0; list && k < json_array_size(tc); k++) {
        json_t *c = json_array_get(tc, k), *f = json_object_get(c, "function");
        const char *name = json_string_value(json_object_get(f, "name"));
        const char *args = json_string_value(json_object_get(f, "arguments"));
        json_t *ty = json_object_get(c, "type");
        if (!json_is_object(f) || !name || !args ||
            (ty && !json_is_null(ty) &&
             strcmp(json_string_value(ty) ? json_string_value(ty) : "", "function"))) {
            json_decref(list);
            return rk_http_errorf(err, 400,
                                  "messages[%d].tool_calls[%zu] must be {\"type\": \"function\", "
                                  "\"function\": {\"name\", \"arguments\"}}",
                                  i, k),
                   1;
        }
        json_t *a = json_loads(args, JSON_DECODE_ANY, NULL);
        if (!json_is_object(a)) {
            json_decref(a);
            json_decref(list);
            return rk_http_errorf(err, 400,
                                  "messages[%d].tool_calls[%zu].function.arguments must be a JSON "
                                  "object in a string",
                                  i, k),
                   1;
        }
        json_t *call = json_pack("{s:s, s:o}", "name", name, "arguments", a);
        const char *cid = json_string_value(json_object_get(c, "id"));
        if (call && cid) json_object_set_new(call, "id", json_string(cid));
        json_array_append_new(list, call);
    }
    *out = list ? json_dumps(list, JSON_COMPACT) : NULL;
    json_decref(list);
    if (!*out) return rk_http_errorf(err, 500, "out of memory"), 1;
    return 0;
}

int rk_api_parse_msg_tool_fields(json_t *m, int i, rk_chat_msg *msg, rk_http_error *err) {
    json_t *tc = json_object_get(m, "tool_calls"), *tid = json_object_get(m, "tool_call_id");
    json_t *th = json_object_get(m, "reasoning_content");
    if (!th || json_is_null(th)) th = json_object_get(m, "reasoning");
    if (tc && !json_is_null(tc)) {
        if (msg->role != RK_ROLE_ASSISTANT)
            return rk_http_errorf(err, 400,
                                  "messages[%d]: only assistant messages carry 'tool_calls'", i),
                   1;
        if (parse_tool_calls(tc, i, &msg->tool_calls, err)) return 1;
    }
    if (tid && !json_is_null(tid) && !json_is_string(tid))
        return rk_http_errorf(err, 400, "messages[%d].tool_call_id must be a string", i), 1;
    if (th && !json_is_null(th) && !json_is_string(th))
        return rk_http_errorf(err, 400, "messages[%d].reasoning_content must be a string", i), 1;
    if (json_is_string(tid) && msg->role == RK_ROLE_TOOL &&
        !(msg->tool_call_id = rk_strdup(json_string_value(tid))))
        return rk_http_errorf(err, 500, "out of memory"), 1;
    if (json_is_string(th) && msg->role == RK_ROLE_ASSISTANT && json_string_length(th) &&
        !(msg->reasoning = rk_strdup(json_string_value(th))))
        return rk_http_errorf(err, 500, "out of memory"), 1;
    return 0;
}

/* tools, tool_choice and parallel_tool_calls of a chat body. */
int rk_api_parse_tools(json_t *root, rk_api_request *out, rk_http_error *err) {
    json_t *tools = json_object_get(root, "tools"), *choice = json_object_get(root, "tool_choice");
    out->parallel_tool_calls = 1;
    json_t *par = json_object_get(root, "parallel_tool_calls");
    if (par && !json_is_null(par)) {
        if (get_bool(root, "parallel_tool_calls", &out->parallel_tool_calls, err)) return 1;
        out->parallel_given = 1;
    }
    if (!tools || json_is_null(tools)) {
        if (choice && !json_is_null(choice))
            return rk_http_errorf(err, 400, "'tool_choice' needs 'tools'"), 1;
        return 0;
    }
    if (!json_is_array(tools) || json_array_size(tools) > RK_MAX_TOOLS)
        return rk_http_errorf(err, 400, "'tools' must be an array of at most %d functions",
                              RK_MAX_TOOLS),
               1;
    size_t n = json_array_size(tools);
    out->tools = calloc(n ? n : 1, sizeof *out->tools);
    if (!out->tools) return rk_http_errorf(err, 500, "out of memory"), 1;
    for (size_t k = 0; k < n; k++) {
        json_t *t = json_array_get(tools, k), *f = json_object_get(t, "function");
        const char *ty = json_string_value(json_object_get(t, "type"));
        const char *name = json_string_value(json_object_get(f, "name"));
        json_t *desc = json_object_get(f, "description"),
               *params = json_object_get(f, "parameters");
        if (!ty || strcmp(ty, "function") || !json_is_object(f) || !name || !tool_name_ok(name))
            return rk_http_errorf(err, 400,
                                  "tools[%zu] must be {\"type\": \"function\", \"function\": "
                                  "{\"name\": [A-Za-z0-9_-]{1,64}, ...}}",
                                  k),
                   1;
        if ((desc && !json_is_null(desc) && !json_is_string(desc)) ||
            (params && !json_is_null(params) && !json_is_object(params)))
            return rk_http_errorf(err, 400,
                                  "tools[%zu].function: 'description' must be a string and "
                                  "'parameters' a JSON Schema object",
                                  k),
                   1;
        for (size_t j = 0; j < k; j++)
            if (!strcmp(out->tools[j].name, name))
                return rk_http_errorf(err, 400, "tools[%zu]: the name '%s' is used twice", k, name),
                       1;
        out->tools[k].name = rk_strdup(name);
        out->tools[k].description =
            json_is_string(desc) ? rk_strdup(json_string_value(desc)) : NULL;
        out->tools[k].parameters = json_is_object(params) ? json_incref(params) : NULL;
        out->n_tools = (int)k + 1;
        if (!out->tools[k].name || (json_is_string(desc) && !out->tools[k].description))
            return rk_http_errorf(err, 500, "out of memory"), 1;
    }
    out->tool_choice = n ? RK_TOOLS_AUTO : RK_TOOLS_NONE;
    if (choice && !json_is_null(choice)) {
        const char *c = json_string_value(choice);
        const char *named =
            json_string_value(json_object_get(json_object_get(choice, "function"), "name"));
        if (c && !strcmp(c, "none")) {
            out->tool_choice = RK_TOOLS_NONE;
        } else if (c && !strcmp(c, "auto")) {
            out->tool_choice = RK_TOOLS_AUTO;
        } else if (c && !strcmp(c, "required")) {
            out->tool_choice = RK_TOOLS_REQUIRED;
        } else if (named) {
            out->tool_choice = RK_TOOLS_NAMED;
            out->tool_named = -1;
            for (int j = 0; j < out->n_tools; j++)
                if (!strcmp(out->tools[j].name, named)) out->tool_named = j;
            if (out->tool_named < 0)
                return rk_http_errorf(err, 400, "'tool_choice' names '%s', which is not in 'tools'",
                                      named),
                       1;
        } else {
            return rk_http_errorf(err, 400,
                                  "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                                  "{\"type\": \"function\", \"function\": {\"name\"}}"),
                   1;
        }
        if (out->tool_choice >= RK_TOOLS_REQUIRED && !n)
            return rk_http_errorf(err, 400, "'tool_choice' asks for a call but 'tools' is empty"),
                   1;
    }
    if (out->tool_choice >= RK_TOOLS_REQUIRED && out->grammar)
        return rk_http_errorf(err, 400,
                              "a required tool call cannot be combined with 'response_format' or "
                              "'grammar'"),
               1;
    return 0;
}
