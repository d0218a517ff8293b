/* gateway/gen_text.h — the text of a generation as it is decoded, token
 * by token: what has been sent, where a stop string matched (generate.c
 * streams and answers with it). */
#ifndef RK_GATEWAY_GEN_TEXT_H
#define RK_GATEWAY_GEN_TEXT_H

#include <stddef.h>
#include <stdint.h>

#include "config/config.h"
#include "engine/tokenizer.h"

/* Incremental text of a generation: decoded bytes, what has been sent, stop
 * strings. Text goes out only up to a point that is final: complete UTF-8
 * characters, and far enough from the end that no stop string can still
 * begin before it. */
typedef struct rk_gen_text {
    const rk_tokenizer *tok;
    rk_strbuf raw;   /* decoded bytes of the tokens so far */
    int decoded;     /* tokens decoded */
    int skip_space;  /* drop the leading space of the first piece (as rk_report_text) */
    int specials;    /* special tokens as their text (harmony's channel tags, split later) */
    size_t sent;     /* raw bytes already turned into text */
    long stop_at;    /* raw offset of the first stop match, or -1 */
    int stop_tokens; /* tokens up to the one that completed that match */
    size_t max_stop; /* longest stop string */
    char *const *stop;
    int n_stop;
    size_t *tok_end; /* (decoded) raw length after each token */
    int tok_cap;
} rk_gen_text;

/* Decode tokens [decoded, n) one at a time, until one completes a stop
 * string: the generation ends with that token (the engine may have sampled
 * more before it heard; they are not part of the answer). */
void rk_gt_feed(rk_gen_text *g, const int32_t *tokens, int n);

/* The next piece of text that is final (malloc'ed, valid UTF-8; NULL when
 * nothing new). final: the generation is over, send the rest. */
char *rk_gt_take(rk_gen_text *g, int final);

#endif
