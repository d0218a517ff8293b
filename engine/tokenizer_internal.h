/* engine/tokenizer_internal.h — the parts of the tokenizer shared by its
 * source files (tokenizer.c, tokenizer_spm.c, tokenizer_bpe.c). Private to
 * engine/: nothing outside the tokenizer includes this header.
 *
 * A tokenizer is immutable once built, so any number of threads may encode and
 * decode with one tokenizer at the same time; every encode call allocates its
 * own scratch memory (rk_tok_scratch) and frees it before returning. */
#ifndef RK_TOKENIZER_INTERNAL_H
#define RK_TOKENIZER_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "config/config.h"
#include "engine/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

/* The longest text one encode call accepts, in bytes. Symbol indices are
 * int32, and the llama path triples the text when it spells spaces as U+2581. */
#define RK_TOK_MAX_TEXT ((size_t)1 << 28)

/* Open-addressing hash set of token ids keyed by the token's text. */
typedef struct rk_tok_strmap {
    int32_t *slots; /* (mask + 1) token ids, -1 = empty */
    uint32_t mask;
} rk_tok_strmap;

/* One byte-level BPE merge: the pair (left id, right id) gives id at rank. */
typedef struct rk_tok_merge {
    uint64_t key; /* (uint64)left << 32 | right; UINT64_MAX = empty slot */
    int32_t rank;
    int32_t id;
} rk_tok_merge;

struct rk_tokenizer {
    int is_gpt2;    /* 0: llama (SentencePiece scores), 1: gpt2 (byte-level merges) */
    int spm_merges; /* gemma4: SentencePiece text (U+2581, <0xXX>) merged by rank; decoded as
                     * llama's (is_gpt2 0) */
    char model[16];
    char pre[32];
    int32_t n_tokens;

    char *text;         /* all token texts, each NUL-terminated */
    uint32_t *text_off; /* (n_tokens + 1) token i is text[text_off[i] .. text_off[i+1] - 1) */
    float *scores;      /* (n_tokens) 0 when the vocabulary has none */
    int32_t *types;     /* (n_tokens) RK_TOKEN_* */

    char *dec;             /* decoded bytes of every token, concatenated */
    uint32_t *dec_off;     /* (n_tokens + 1) token i decodes to dec[dec_off[i] .. dec_off[i+1]) */
    uint8_t *dec_special;  /* (n_tokens) 1: decodes to nothing unless render_special */
    rk_tok_strmap map;     /* text -> id */
    int32_t byte_tok[256]; /* llama: id of <0xXX>; gpt2: id of the byte's unicode char; -1 */
    int spm_split;         /* llama: no token has U+2581 right after another character */

    int32_t bos_id, eos_id, unk_id, pad_id;
    int add_bos;
    int add_space_prefix; /* llama: a U+2581 before the text and after each special token */
    int special_rstrip;   /* special tokens but bos, eos and unk take the whitespace after them */
    int32_t eog[12];      /* end-of-generation ids */
    int n_eog;

    /* Special tokens matched when parse_special is set, bucketed by first byte
     * and sorted longest first within a bucket. */
    int32_t *special;            /* (n_special) token ids */
    uint32_t special_first[257]; /* bucket b is special[special_first[b] .. special_first[b+1]) */
    int32_t n_special;

    /* gpt2 and gemma4 */
    rk_tok_merge *merges; /* (merge_mask + 1) hash table */
    uint32_t merge_mask;
    pcre2_code *re; /* pre-tokenizer */
    int re_jit;     /* 1 when the JIT compiled the pattern */
};

/* A growing array of token ids (the encode output). */
typedef struct rk_tok_ids {
    int32_t *ids;
    size_t n, cap;
} rk_tok_ids;

/* Append one id; RK_ERR_NOMEM when the array cannot grow. */
rk_status rk_tok_ids_push(rk_tok_ids *v, int32_t id);

/* Length in bytes of token id's stored text. */
static inline uint32_t rk_tok_text_len(const rk_tokenizer *t, int32_t id) {
    return t->text_off[id + 1] - t->text_off[id] - 1;
}

/* Id of the token whose text is exactly the n bytes at s, or -1. */
int32_t rk_tok_lookup(const rk_tokenizer *t, const char *s, size_t n);

/* Encode one fragment of valid UTF-8 text (no special tokens in it) with the
 * llama (SentencePiece) algorithm, appending to out. add_space: prepend the
 * U+2581 space marker (the fragment begins the text or follows a special
 * token). */
rk_status rk_tok_spm_encode(const rk_tokenizer *t, const char *s, size_t n, int add_space,
                            rk_tok_ids *out);

/* Build the gpt2 parts of t (byte table, merge table, pre-tokenizer regex)
 * from the vocabulary's merges and pre name. */
rk_status rk_tok_bpe_init(rk_tokenizer *t, const rk_vocab *v);

/* Build t's merge table from the vocabulary's merges (gpt2 and gemma4). */
rk_status rk_tok_bpe_merges_init(rk_tokenizer *t, const rk_vocab *v);

/* Encode one fragment of valid UTF-8 text (no special tokens in it) with the
 * gemma4 algorithm, appending to out: spaces become U+2581, runs of newlines
 * and runs of other characters are pieces (a run of newlines that is a token
 * is taken whole), each piece's characters are merged by rank, and a
 * character no token spells becomes its <0xXX> byte tokens. */
rk_status rk_tok_bpe_spm_encode(const rk_tokenizer *t, const char *s, size_t n, rk_tok_ids *out);

/* Release the gpt2 parts of t; accepts a tokenizer without them. */
void rk_tok_bpe_free(rk_tokenizer *t);

/* Encode one fragment of valid UTF-8 text (no special tokens in it) with the
 * gpt2 algorithm (regex pre-tokenizer, byte-level BPE), appending to out. */
rk_status rk_tok_bpe_encode(const rk_tokenizer *t, const char *s, size_t n, rk_tok_ids *out);

/* Name of the supported pre-tokenizer whose regex is exactly re ("qwen2",
 * "llama3", "gpt2"), or NULL. */
const char *rk_tok_pre_name_for_regex(const char *re);

/* The supported pre-tokenizer names, comma-separated, for error messages. */
const char *rk_tok_pre_names(void);

/* Code point -> byte of the GPT-2 byte-to-unicode table; -1 when cp is not in
 * it. */
int rk_tok_gpt2_unicode_to_byte(uint32_t cp);

/* The GPT-2 byte-to-unicode table: the code point byte b is spelled with. */
uint32_t rk_tok_gpt2_byte_to_unicode(uint8_t b);

/* Encode cp as UTF-8 into buf (at least 4 bytes); return the length. */
int rk_tok_utf8_encode(uint32_t cp, char *buf);

#endif
