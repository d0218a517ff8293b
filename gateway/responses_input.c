/* gateway/responses_input.c — a Responses body as the chat completions body
 * the chat path parses (rk_api_parse): `instructions` as the system
 * message, `input` (a string or items) and the stored conversation as
 * messages, the Responses shapes of tools, tool_choice and text.format as
 * chat's, and the sampling fields renamed. What cannot be honoured is
 * refused with a 400 naming the field. */
#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "gateway/responses.h"

/* Fields passed to the chat body as they are (chat validates them): the
 * sampling ones both APIs share and ragkv's extensions. */
static const char *const pass_through[] = {"model",
                                           "temperature",
                                           "top_p",
                                           "parallel_tool_calls",
                                           "seed",
                                           "top_k",
                                           "min_p",
                                           "stop",
                                           "presence_penalty",
                                           "frequency_penalty",
                                           "repair",
                                           "repetition_penalty",
                                           "logit_bias",
                                           "documents",
                                           "chunks",
                                           "separator",
                                           "chunking",
                                           "cache_salt",
                                           "user",
                                           "safety_identifier",
                                           "prompt_cache_key",
                                           "service_tier"};

/* Fields of OpenAI's that ask for what this server does not do, refused
 * unless null (or false). */
static const char *const refused[] = {"background", "conversation", "prompt", "max_tool_calls",
                                      "top_logprobs"};

static json_t *fail(rk_http_error *err, const char *param, const char *fmt, const char *a) {
    rk_http_errorf(err, 400, fmt, a);
    err->param = param;
    return NULL;
}

/* A content part (input_text, output_text or text) as a chat text part;
 * NULL with err for a kind this server cannot read. */
static json_t *chat_part(json_t *part, const char *where, rk_http_error *err) {
    const char *ty = json_string_value(json_object_get(part, "type"));
    const char *text = json_string_value(json_object_get(part, "text"));
    if (ty && (!strcmp(ty, "input_text") || !strcmp(ty, "output_text") || !strcmp(ty, "text")) &&
        text) {
        json_t *p = json_pack("{s:s, s:s}", "type", "text", "text", text);
        json_t *rc = json_object_get(part, "ragkv_chunk");
        if (p && rc) json_object_set(p, "ragkv_chunk", rc);
        return p;
    }
    if (ty && !strcmp(ty, "refusal")) return json_pack("{s:s, s:s}", "type", "text", "text", "");
    rk_http_errorf(err, 400,
                   "%s: a content part must be input_text or output_text with a 'text'; \"%s\" "
                   "is not supported (this server reads text only)",
                   where, ty ? ty : "?");
    err->param = "input";
    return NULL;
}

/* A message item's content (a string or parts) as chat content. */
static json_t *chat_content(json_t *content, const char *where, rk_http_error *err) {
    if (json_is_string(content)) return json_incref(content);
    if (!json_is_array(content)) {
        rk_http_errorf(err, 400, "%s.content must be a string or an array of parts", where);
        err->param = "input";
        return NULL;
    }
    json_t *parts = json_array();
    for (size_t j = 0; parts && j < json_array_size(content); j++) {
        char w[96];
        snprintf(w, sizeof w, "%s.content[%zu]", where, j);
        json_t *p = chat_part(json_array_get(content, j), w, err);
        if (!p) {
            json_decref(parts);
            return NULL;
        }
        json_array_append_new(parts, p);
    }
    return parts;
}

/* The last message of msgs when it is an assistant's (function calls join it). */
static json_t *last_assistant(json_t *msgs) {
    size_t n = json_array_size(msgs);
    json_t *m = n ? json_array_get(msgs, n - 1) : NULL;
    const char *role = json_string_value(json_object_get(m, "role"));
    return role && !strcmp(role, "assistant") ? m : NULL;
}

static int add_function_call(json_t *msgs, json_t *item, const char *where, rk_http_error *err) {
    const char *call_id = json_string_value(json_object_get(item, "call_id"));
    const char *name = json_string_value(json_object_get(item, "name"));
    const char *args = json_string_value(json_object_get(item, "arguments"));
    if (!call_id || !name || !args) {
        rk_http_errorf(err, 400, "%s: a function_call needs 'call_id', 'name' and 'arguments'",
                       where);
        err->param = "input";
        return 1;
    }
    json_t *call = json_pack("{s:s, s:s, s:{s:s, s:s}}", "id", call_id, "type", "function",
                             "function", "name", name, "arguments", args);
    json_t *m = last_assistant(msgs);
    if (m && !json_object_get(m, "tool_calls")) json_object_set_new(m, "tool_calls", json_array());
    if (!m) {
        m = json_pack("{s:s, s:s, s:[]}", "role", "assistant", "content", "", "tool_calls");
        json_array_append_new(msgs, m);
    }
    json_array_append_new(json_object_get(m, "tool_calls"), call);
    return 0;
}

static int add_function_output(json_t *msgs, json_t *item, const char *where, rk_http_error *err) {
    const char *call_id = json_string_value(json_object_get(item, "call_id"));
    json_t *out = json_object_get(item, "output");
    json_t *content = call_id && out ? chat_content(out, where, err) : NULL;
    if (!content) {
        if (!err->status) {
            rk_http_errorf(err, 400, "%s: a function_call_output needs 'call_id' and 'output'",
                           where);
            err->param = "input";
        }
        return 1;
    }
    json_array_append_new(msgs, json_pack("{s:s, s:s, s:o}", "role", "tool", "tool_call_id",
                                          call_id, "content", content));
    return 0;
}

/* One input item onto msgs (reasoning items are left out: the chat
 * template renders no earlier thinking). */
static int add_item(json_t *msgs, json_t *item, const char *where, rk_http_error *err) {
    if (!json_is_object(item)) {
        rk_http_errorf(err, 400, "%s must be an object", where);
        err->param = "input";
        return 1;
    }
    const char *ty = json_string_value(json_object_get(item, "type"));
    const char *role = json_string_value(json_object_get(item, "role"));
    if (ty && !strcmp(ty, "function_call")) return add_function_call(msgs, item, where, err);
    if (ty && !strcmp(ty, "function_call_output"))
        return add_function_output(msgs, item, where, err);
    if (ty && !strcmp(ty, "reasoning")) return 0;
    if ((ty && strcmp(ty, "message")) || !role ||
        (strcmp(role, "user") && strcmp(role, "assistant") && strcmp(role, "system") &&
         strcmp(role, "developer"))) {
        rk_http_errorf(err, 400,
                       "%s: an item must be a message (role user, assistant, system or "
                       "developer), function_call, function_call_output or reasoning; got \"%s\"",
                       where,
                       ty     ? ty
                       : role ? role
                              : "?");
        err->param = "input";
        return 1;
    }
    json_t *content = chat_content(json_object_get(item, "content"), where, err);
    if (!content) return 1;
    json_array_append_new(msgs, json_pack("{s:s, s:o}", "role", role, "content", content));
    return 0;
}

/* The request's input as items, in the shape the store and input_items
 * list them. */
static json_t *input_items(json_t *input, const char *id_base) {
    json_t *items = json_is_string(input)
                        ? json_pack("[{s:s, s:s, s:[{s:s, s:O}]}]", "type", "message", "role",
                                    "user", "content", "type", "input_text", "text", input)
                        : json_deep_copy(input);
    for (size_t i = 0; items && i < json_array_size(items); i++) {
        json_t *it = json_array_get(items, i);
        if (!json_is_object(it)) continue;
        if (!json_object_get(it, "type")) json_object_set_new(it, "type", json_string("message"));
        if (!json_object_get(it, "id")) {
            char id[96];
            snprintf(id, sizeof id, "in_%s_%zu", id_base, i);
            json_object_set_new(it, "id", json_string(id));
        }
        json_t *c = json_object_get(it, "content");
        if (json_is_string(c))
            json_object_set_new(it, "content",
                                json_pack("[{s:s, s:O}]", "type", "input_text", "text", c));
    }
    return items;
}

/* The top-level `documents` (strings or {"text" or "content"} without ids)
 * as ragkv_chunk parts at the start of the input's first user message, so
 * that the stored conversation carries them and a later turn renders them
 * as this one does. 1 when moved; 0 when left to the chat body (none, ids
 * given, or no user message in the input). */
static int documents_into_items(json_t *root, json_t *items) {
    json_t *docs = json_object_get(root, "documents"), *user = NULL;
    if (!json_is_array(docs) || !json_array_size(docs)) return 0;
    for (size_t i = 0; !user && i < json_array_size(items); i++) {
        json_t *it = json_array_get(items, i);
        const char *role = json_string_value(json_object_get(it, "role"));
        if (role && !strcmp(role, "user") && json_is_array(json_object_get(it, "content")))
            user = it;
    }
    if (!user) return 0;
    json_t *parts = json_array();
    for (size_t k = 0; k < json_array_size(docs); k++) {
        json_t *d = json_array_get(docs, k);
        json_t *t = json_is_string(d) ? d : json_object_get(d, "text");
        if (!t && json_is_object(d)) t = json_object_get(d, "content");
        if (!json_is_string(t) || (json_is_object(d) && json_object_get(d, "id"))) {
            json_decref(parts);
            return 0; /* the chat parser checks it, or keeps its id */
        }
        json_array_append_new(
            parts, json_pack("{s:s, s:O, s:b}", "type", "input_text", "text", t, "ragkv_chunk", 1));
    }
    json_array_extend(parts, json_object_get(user, "content"));
    json_object_set_new(user, "content", parts);
    return 1;
}

/* text.format as response_format; reasoning.effort as enable_thinking. */
static int add_format_and_reasoning(json_t *root, json_t *chat, rk_http_error *err) {
    json_t *text = json_object_get(root, "text"), *fmt = json_object_get(text, "format");
    if (text && !json_is_null(text) && !json_is_object(text))
        return fail(err, "text", "'text' must be an object with a 'format'%s", ""), 1;
    if (fmt && !json_is_null(fmt)) {
        const char *ty = json_string_value(json_object_get(fmt, "type"));
        if (ty && !strcmp(ty, "json_schema")) {
            json_t *js = json_deep_copy(fmt);
            json_object_del(js, "type");
            json_object_set_new(chat, "response_format",
                                json_pack("{s:s, s:o}", "type", "json_schema", "json_schema", js));
        } else if (ty && (!strcmp(ty, "json_object") || !strcmp(ty, "text"))) {
            json_object_set_new(chat, "response_format", json_pack("{s:s}", "type", ty));
        } else {
            return fail(err, "text.format",
                        "'text.format.type' must be \"text\", \"json_object\" or "
                        "\"json_schema\"%s",
                        ""),
                   1;
        }
    }
    json_t *rs = json_object_get(root, "reasoning");
    if (!rs || json_is_null(rs)) return 0;
    json_t *effort = json_object_get(rs, "effort");
    const char *e = json_string_value(effort);
    if (!json_is_object(rs) || (effort && !json_is_null(effort) && !e))
        return fail(err, "reasoning", "'reasoning' must be an object with an 'effort'%s", ""), 1;
    if (e && strcmp(e, "none") && strcmp(e, "minimal") && strcmp(e, "low") && strcmp(e, "medium") &&
        strcmp(e, "high"))
        return fail(err, "reasoning.effort",
                    "'reasoning.effort' must be none, minimal, low, medium or high, not \"%s\"", e),
               1;
    if (e && (!strcmp(e, "none") || !strcmp(e, "minimal")))
        json_object_set_new(chat, "chat_template_kwargs", json_pack("{s:b}", "enable_thinking", 0));
    return 0;
}

/* tools in the Responses shape ({"type": "function", "name", ...}) and
 * tool_choice ({"type": "function", "name"}) as chat's. */
static int add_tools(json_t *root, json_t *chat, rk_http_error *err) {
    json_t *tools = json_object_get(root, "tools"), *choice = json_object_get(root, "tool_choice");
    if (tools && !json_is_null(tools)) {
        if (!json_is_array(tools)) return fail(err, "tools", "'tools' must be an array%s", ""), 1;
        json_t *list = json_array();
        json_object_set_new(chat, "tools", list);
        for (size_t k = 0; k < json_array_size(tools); k++) {
            json_t *t = json_array_get(tools, k);
            const char *ty = json_string_value(json_object_get(t, "type"));
            if (!ty || strcmp(ty, "function"))
                return fail(err, "tools",
                            "'tools': only function tools are supported; \"%s\" is not",
                            ty ? ty : "?"),
                       1;
            json_t *f = json_deep_copy(t);
            json_object_del(f, "type");
            json_object_del(f, "strict");
            json_array_append_new(list, json_pack("{s:s, s:o}", "type", "function", "function", f));
        }
    }
    if (choice && !json_is_null(choice)) {
        const char *ty = json_string_value(json_object_get(choice, "type"));
        const char *name = json_string_value(json_object_get(choice, "name"));
        if (json_is_string(choice))
            json_object_set(chat, "tool_choice", choice);
        else if (ty && !strcmp(ty, "function") && name)
            json_object_set_new(
                chat, "tool_choice",
                json_pack("{s:s, s:{s:s}}", "type", "function", "function", "name", name));
        else
            return fail(err, "tool_choice",
                        "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": "
                        "\"function\", \"name\"}%s",
                        ""),
                   1;
    }
    return 0;
}

/* The scalar fields: renamed, passed through, refused. */
static int add_fields(json_t *root, json_t *chat, int docs_moved, rk_http_error *err) {
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        json_t *v = json_object_get(root, refused[i]);
        if (v && !json_is_null(v) && !json_is_false(v))
            return fail(err, refused[i], "'%s' is not supported by this server", refused[i]), 1;
    }
    json_t *inc = json_object_get(root, "include");
    if (inc && !json_is_null(inc) && !(json_is_array(inc) && !json_array_size(inc)))
        return fail(err, "include", "'include' is not supported by this server%s", ""), 1;
    json_t *tr = json_object_get(root, "truncation");
    const char *t = json_string_value(tr);
    if (tr && !json_is_null(tr) && !(t && (!strcmp(t, "disabled") || !strcmp(t, "auto"))))
        return fail(err, "truncation", "'truncation' must be \"disabled\" or \"auto\"%s", ""), 1;
    for (size_t i = 0; i < sizeof pass_through / sizeof pass_through[0]; i++) {
        json_t *v = json_object_get(root, pass_through[i]);
        if (v && !(docs_moved && !strcmp(pass_through[i], "documents")))
            json_object_set(chat, pass_through[i], v);
    }
    json_t *mot = json_object_get(root, "max_output_tokens");
    if (mot && !json_is_null(mot)) json_object_set(chat, "max_tokens", mot);
    json_t *md = json_object_get(root, "metadata");
    if (md && !json_is_null(md) && !json_is_object(md))
        return fail(err, "metadata", "'metadata' must be an object%s", ""), 1;
    json_t *st = json_object_get(root, "store");
    if (st && !json_is_null(st) && !json_is_boolean(st))
        return fail(err, "store", "'store' must be true or false%s", ""), 1;
    json_t *stream = json_object_get(root, "stream");
    if (stream && !json_is_null(stream) && !json_is_boolean(stream))
        return fail(err, "stream", "'stream' must be true or false%s", ""), 1;
    if (json_is_true(stream)) {
        json_object_set_new(chat, "stream", json_true());
        json_object_set_new(chat, "stream_options", json_pack("{s:b}", "include_usage", 1));
    }
    return add_tools(root, chat, err) || add_format_and_reasoning(root, chat, err);
}

/* instructions, the conversation and the input as messages. */
static json_t *messages(json_t *root, json_t *conversation, json_t *input, rk_http_error *err) {
    json_t *msgs = json_array(), *ins = json_object_get(root, "instructions");
    if (ins && !json_is_null(ins) && !json_is_string(ins)) {
        json_decref(msgs);
        return fail(err, "instructions", "'instructions' must be a string%s", "");
    }
    if (json_is_string(ins))
        json_array_append_new(msgs, json_pack("{s:s, s:O}", "role", "system", "content", ins));
    json_t *lists[2] = {conversation, input};
    for (int l = 0; l < 2; l++)
        for (size_t i = 0; i < json_array_size(lists[l]); i++) {
            char where[48];
            snprintf(where, sizeof where, l ? "input[%zu]" : "previous_response_id's item %zu", i);
            if (add_item(msgs, json_array_get(lists[l], i), where, err)) {
                json_decref(msgs);
                return NULL;
            }
        }
    return msgs;
}

json_t *rk_resp_chat_body(json_t *root, json_t *conversation, const char *id_base, json_t **input,
                          rk_http_error *err) {
    *input = NULL;
    json_t *in = json_object_get(root, "input");
    if (!json_is_string(in) && !(json_is_array(in) && json_array_size(in)))
        return fail(err, "input", "'input' must be a string or a non-empty array of items%s", "");
    json_t *chat = json_object();
    json_t *items = input_items(in, id_base);
    int docs_moved = items && documents_into_items(root, items);
    json_t *msgs = items ? messages(root, conversation, items, err) : NULL;
    if (!chat || !msgs || add_fields(root, chat, docs_moved, err)) {
        if (!err->status) rk_http_errorf(err, 500, "out of memory");
        json_decref(chat);
        json_decref(msgs);
        json_decref(items);
        return NULL;
    }
    json_object_set_new(chat, "messages", msgs);
    *input = items;
    return chat;
}
