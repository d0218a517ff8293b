/* gateway/text.c — text helpers for the user-facing output. */
#include <stdlib.h>
#include <string.h>

#include "engine/tokenizer.h"
#include "gateway/gateway.h"

char *rk_utf8_sanitize(const char *text, size_t n, size_t *out_len) {
    char *out = malloc(n * 3 + 1); /* each invalid byte may become 3 bytes */
    if (!out) return NULL;
    const unsigned char *s = (const unsigned char *)text;
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int len = rk_utf8_decode(s + i, n - i, &cp);
        if (len > 0 && cp != 0) {
            memcpy(out + o, s + i, (size_t)len);
            o += (size_t)len;
            i += (size_t)len;
        } else {
            memcpy(out + o, "\xEF\xBF\xBD", 3); /* U+FFFD */
            o += 3;
            i++;
        }
    }
    out[o] = '\0';
    if (out_len) *out_len = o;
    return out;
}
