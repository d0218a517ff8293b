/* gateway/tokenize.c — POST /tokenize and POST /detokenize: the served
 * model's tokenizer over HTTP, in the request shape of llama.cpp's server
 * ({"content", "add_special", "with_pieces"}; {"tokens"}). The ids are
 * those `ragkv tokenize` prints; the text is what `ragkv detokenize`
 * prints. The tokenizer is immutable, so this runs on the request's own
 * thread without the engine. POST /apply-template: a chat body rendered by
 * the served model's template and tokenized, as the chat route would run
 * it, nothing generated ({"prompt"} as llama.cpp's server answers, with
 * the pieces and their tokens). */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "engine/tokenizer.h"
#include "gateway/http.h"
#include "gateway/report.h"

/* A boolean field (absent or null: dflt), or -1 after a 400. */
static int get_flag(req_ctx *rc, json_t *root, const char *name, int dflt) {
    json_t *v = json_object_get(root, name);
    if (!v || json_is_null(v)) return dflt;
    if (json_is_boolean(v)) return json_is_true(v);
    rk_gw_send_errorf(rc, 400, "'%s' must be true or false", name);
    return -1;
}

/* One {"id", "piece"} entry: the piece is the token's text when it is valid
 * UTF-8 on its own, else its bytes as an array of numbers. */
static json_t *piece_json(const rk_tokenizer *tok, int32_t id) {
    char buf[256];
    int n = rk_tokenizer_token_bytes(tok, id, 1, buf, sizeof buf);
    if (n < 0) n = 0;
    if (n > (int)sizeof buf) n = (int)sizeof buf;
    int valid = 1;
    for (int i = 0; i < n && valid;) {
        uint32_t cp;
        int l = rk_utf8_decode((const unsigned char *)buf + i, (size_t)(n - i), &cp);
        if (l <= 0 || cp == 0) valid = 0;
        i += l > 0 ? l : 1;
    }
    json_t *piece;
    if (valid) {
        piece = json_stringn(buf, (size_t)n);
    } else {
        piece = json_array();
        for (int i = 0; i < n; i++)
            json_array_append_new(piece, json_integer((unsigned char)buf[i]));
    }
    return json_pack("{s:i, s:o}", "id", id, "piece", piece);
}

static void tokenize(req_ctx *rc, const rk_tokenizer *tok, json_t *root) {
    json_t *content = json_object_get(root, "content");
    if (!json_is_string(content)) {
        rk_gw_send_errorf(rc, 400, "'content' must be a string");
        return;
    }
    int add_special = get_flag(rc, root, "add_special", 0);
    if (add_special < 0) return;
    int with_pieces = get_flag(rc, root, "with_pieces", 0);
    if (with_pieces < 0) return;
    int parse_special = get_flag(rc, root, "parse_special", 1);
    if (parse_special < 0) return;
    int32_t *ids = NULL;
    size_t n = 0;
    rk_error_clear();
    if (rk_tokenizer_encode(tok, json_string_value(content), json_string_length(content),
                            parse_special, &ids, &n)) {
        rk_gw_send_errorf(rc, 400, "cannot tokenize: %s", rk_error_message());
        return;
    }
    json_t *out = json_array();
    int bos = add_special && rk_tokenizer_add_bos(tok) && rk_tokenizer_bos(tok) >= 0;
    for (size_t i = 0; out && i < n + (size_t)bos; i++) {
        int32_t id = bos && i == 0 ? rk_tokenizer_bos(tok) : ids[i - (size_t)bos];
        json_array_append_new(out, with_pieces ? piece_json(tok, id) : json_integer(id));
    }
    free(ids);
    rk_gw_send_json(rc, 200, out ? json_pack("{s:o}", "tokens", out) : NULL);
}

static void detokenize(req_ctx *rc, const rk_tokenizer *tok, json_t *root) {
    json_t *tokens = json_object_get(root, "tokens");
    if (!json_is_array(tokens)) {
        rk_gw_send_errorf(rc, 400, "'tokens' must be an array of token ids");
        return;
    }
    size_t n = json_array_size(tokens);
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    if (!ids) {
        rk_gw_send_errorf(rc, 500, "out of memory");
        return;
    }
    int32_t n_vocab = rk_tokenizer_n_vocab(tok);
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(tokens, i);
        json_int_t id = json_is_integer(v) ? json_integer_value(v) : -1;
        if (id < 0 || id >= n_vocab) {
            free(ids);
            rk_gw_send_errorf(rc, 400, "tokens[%zu] must be a token id in [0, %d)", i, n_vocab);
            return;
        }
        ids[i] = (int32_t)id;
    }
    char *raw = NULL, *text = NULL;
    size_t len = 0;
    if (rk_tokenizer_decode(tok, ids, n, 0, 0, &raw, &len) == RK_OK)
        text = rk_utf8_sanitize(raw, len, NULL);
    free(raw);
    free(ids);
    if (!text) {
        rk_gw_send_errorf(rc, 500, "cannot detokenize: %s", rk_error_message());
        return;
    }
    rk_gw_send_json(rc, 200, json_pack("{s:s}", "content", text));
    free(text);
}

int rk_gw_handle_tokenize(req_ctx *rc, int detok) {
    rk_service *svc;
    json_t *root = rk_gw_read_json(rc, &svc);
    if (!root) return 0;
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    if (detok)
        detokenize(rc, tok, root);
    else
        tokenize(rc, tok, root);
    json_decref(root);
    return 0;
}

/* POST /apply-template: what a chat body would run. */
static void send_prompt(void *ctx, const rk_api_request *api, const rk_request *req) {
    req_ctx *rc = ctx;
    rk_strbuf text = {0};
    json_t *chunks = json_array(), *tokens = json_array();
    rk_strbuf_puts(&text, api->pieces.system.s);
    for (int k = 0; k < api->pieces.n_chunks; k++) {
        rk_strbuf_puts(&text, api->pieces.chunks[k].s);
        json_array_append_new(chunks, json_string(api->pieces.chunks[k].s));
    }
    rk_strbuf_puts(&text, api->pieces.question.s);
    for (int i = 0; i < req->n_sys; i++) json_array_append_new(tokens, json_integer(req->sys[i]));
    for (int k = 0; k < req->n_chunks; k++)
        for (int i = 0; i < req->chunk_lens[k]; i++)
            json_array_append_new(tokens, json_integer(req->chunks[k][i]));
    for (int i = 0; i < req->n_question; i++)
        json_array_append_new(tokens, json_integer(req->question[i]));
    json_t *out = text.s && chunks && tokens
                      ? json_pack("{s:s, s:{s:s, s:O, s:s, s:O}}", "prompt", text.s, "ragkv",
                                  "system", api->pieces.system.s, "chunks", chunks, "question",
                                  api->pieces.question.s, "tokens", tokens)
                      : NULL;
    json_decref(chunks);
    json_decref(tokens);
    rk_strbuf_free(&text);
    rk_gw_send_json(rc, 200, out); /* NULL: 500 */
}

int rk_gw_handle_apply_template(req_ctx *rc) {
    char *body;
    size_t len;
    if (rk_gw_read_body(rc, &body, &len)) return 0;
    rk_gw_sink sink = {.ctx = rc, .prompt = send_prompt};
    return rk_gw_generate(rc, 1, body, len, &sink);
}
