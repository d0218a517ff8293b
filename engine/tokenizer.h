/* engine/tokenizer.h — text <-> token ids.
 *
 * Three tokenizer families, all read from GGUF metadata (tokenizer.ggml.*):
 *   - "llama": SentencePiece-style BPE driven by token scores, with byte
 *     fallback tokens <0xXX> and the U+2581 space marker;
 *   - "gpt2": byte-level BPE driven by a ranked merge list, with a regex
 *     pre-tokenizer chosen by tokenizer.ggml.pre (e.g. "qwen2"), run with PCRE2;
 *   - "gemma4": BPE driven by a ranked merge list over text spelled as
 *     SentencePiece spells it (U+2581 spaces, <0xXX> byte fallback, no space
 *     prefix), runs of newlines apart; BOS always added. Decoded as llama.
 * Special tokens (control / user-defined) are recognised in the input text
 * only when the caller asks for it. Decoding returns the exact bytes.
 *
 * Thread-safety: a tokenizer is immutable once built, so any number of threads
 * may encode and decode with one tokenizer at the same time; building and
 * freeing it are the owner's alone. An rk_vocab is plain data with no locking.
 * Ownership: every output array or string is malloc'ed for the caller, who
 * frees it; inputs are never kept (they are copied or only read). */
#ifndef RK_TOKENIZER_H
#define RK_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "config/config.h"
#include "engine/gguf.h"

/* GGUF token types (tokenizer.ggml.token_type). */
enum {
    RK_TOKEN_NORMAL = 1,
    RK_TOKEN_UNKNOWN = 2,
    RK_TOKEN_CONTROL = 3,
    RK_TOKEN_USER_DEFINED = 4,
    RK_TOKEN_UNUSED = 5,
    RK_TOKEN_BYTE = 6,
};

/* A vocabulary as plain arrays: what the GGUF writer stores and what a
 * tokenizer is built from. All arrays are owned by the struct and released by
 * rk_vocab_free(). */
typedef struct rk_vocab {
    char model[16]; /* "llama", "gpt2" or "gemma4" */
    char pre[32];   /* gpt2 pre-tokenizer name ("qwen2", "default", ...); "" for llama */
    int32_t n_tokens;
    char **tokens;        /* (n_tokens) NUL-terminated token texts, as stored in GGUF */
    float *scores;        /* (n_tokens) or NULL */
    int32_t *token_types; /* (n_tokens) RK_TOKEN_* */
    int32_t n_merges;
    char **merges; /* (n_merges) "left right": gpt2, gemma4 (and a SentencePiece-style
                    * tokenizer.json's, which a llama tokenizer does not use) */
    int32_t bos_id, eos_id, unk_id, pad_id; /* -1 when absent */
    int add_bos;                            /* tokenizer.ggml.add_bos_token */
    int add_space_prefix; /* llama: tokenizer.ggml.add_space_prefix, a U+2581 before the text */
    /* Special tokens but BOS, EOS and <unk> take the whitespace after them
     * (Phi-3's tokenizer marks them rstrip): set for the SentencePiece
     * vocabularies of general.architecture phi3 (Phi-3, Phi-3.5; Phi-4-mini's
     * o200k tokens keep their whitespace) */
    int special_rstrip;
} rk_vocab;

/* Release the arrays and zero the struct; accepts NULL and a zeroed struct. */
void rk_vocab_free(rk_vocab *v);

/* Read a Hugging Face tokenizer.json into a vocabulary, added tokens
 * included, padded with unused "[PAD<id>]" tokens up to n_pad_to entries when
 * n_pad_to is larger than the vocabulary: byte-level BPE (Qwen3) becomes a
 * gpt2 vocabulary; BPE with byte fallback and U+2581 for spaces (the
 * SentencePiece models: Llama 2, Phi-3, Gemma) a llama one, whose scores
 * follow the merge ranks (see vocab.c), with the space prefix only where the
 * normalizer prepends U+2581 (not Gemma's). */
rk_status rk_vocab_from_hf_json(const char *path, int32_t n_pad_to, rk_vocab *out);

/* The small byte-level vocabulary of the embedded `tiny` model: a llama
 * (SentencePiece) vocabulary of <unk>, <s>, </s>, the 256 byte tokens and a few
 * hundred common English pieces, so any UTF-8 text encodes. */
rk_status rk_vocab_tiny(rk_vocab *out);

/* Read the tokenizer.ggml.* metadata of a GGUF file into a vocabulary. */
rk_status rk_vocab_from_gguf(const rk_gguf *g, rk_vocab *out);

/* ---------------------------------------------------------------- tokenizer */

typedef struct rk_tokenizer rk_tokenizer; /* opaque */

/* Build a tokenizer from a vocabulary (copied; v may be freed afterwards).
 * The caller owns *out and releases it with rk_tokenizer_free. */
rk_status rk_tokenizer_create(const rk_vocab *v, rk_tokenizer **out);
/* Same, from a GGUF file's metadata (nothing of g is kept: g may be closed). */
rk_status rk_tokenizer_from_gguf(const rk_gguf *g, rk_tokenizer **out);
/* Accepts NULL. No encode or decode may still be running on t. */
void rk_tokenizer_free(rk_tokenizer *t);

int32_t rk_tokenizer_n_vocab(const rk_tokenizer *t);
int32_t rk_tokenizer_bos(const rk_tokenizer *t); /* -1 when none */
int32_t rk_tokenizer_eos(const rk_tokenizer *t);
int rk_tokenizer_add_bos(const rk_tokenizer *t); /* should callers prepend BOS? */
/* True for end-of-generation tokens (eos, eot, <|im_end|>, <|endoftext|>, ...). */
int rk_tokenizer_is_eog(const rk_tokenizer *t, int32_t id);
/* Token text as stored (not decoded), owned by t; NULL when out of range. */
const char *rk_tokenizer_token_text(const rk_tokenizer *t, int32_t id);
/* Id of a token whose stored text equals s exactly, or -1. */
int32_t rk_tokenizer_find(const rk_tokenizer *t, const char *s);

/* Encode len bytes of UTF-8 text (need not be NUL-terminated) into ids; no BOS
 * is added (callers add it). parse_special: recognise control and user-defined
 * tokens written literally in the text. *out_ids is malloc'ed (caller frees);
 * empty text gives n = 0 and may give NULL. Invalid UTF-8 -> RK_ERR_INVALID
 * with a message giving the byte offset. */
rk_status rk_tokenizer_encode(const rk_tokenizer *t, const char *text, size_t len,
                              int parse_special, int32_t **out_ids, size_t *out_n);

/* Decode ids to bytes: *out malloc'ed and NUL-terminated, *out_len its length.
 * Control tokens decode to nothing unless render_special is set. For llama
 * vocabularies the leading space of the text is dropped when the first id is
 * the first token after BOS (skip_leading_space), as llama2.c prints. */
rk_status rk_tokenizer_decode(const rk_tokenizer *t, const int32_t *ids, size_t n,
                              int render_special, int skip_leading_space, char **out,
                              size_t *out_len);

/* Bytes of one token as it decodes (byte tokens give their byte, U+2581 gives
 * a space, gpt2 byte-unicode is reversed). Writes at most cap bytes to buf and
 * returns the full length, or -1 for an invalid id. */
int rk_tokenizer_token_bytes(const rk_tokenizer *t, int32_t id, int render_special, char *buf,
                             int cap);

/* ---------------------------------------------------------------- UTF-8 */

/* Decode the UTF-8 character at s (n >= 1 bytes left) into *cp and return its
 * length (1..4). Returns 0 when the bytes there are not valid UTF-8
 * (overlong forms, surrogates and code points above U+10FFFF included), and
 * -1 when s[0..n) is a valid start of a character that the end cuts short, so
 * a streaming caller can wait for more bytes. The one decoder of the code
 * base: the tokenizer's validation and the gateway's text output use it. */
int rk_utf8_decode(const unsigned char *s, size_t n, uint32_t *cp);

#endif
