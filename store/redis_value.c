/* store/redis_value.c — the Redis tier's value format: a value is byte for
 * byte a disk payload file (store/payload.c writes and checks its header)
 * followed, when the tier has a secret, by an HMAC-SHA-256 tag; beside it a
 * commit marker, "VERSION N_TOKENS N_BYTES CHECKSUM CREATED". Here: encoding
 * a value's header, parsing the marker, the tag and the secret, the verdict
 * on a value read back, and the values the writer queues. */
#include "store/redis.h"

#include <errno.h>
#include <hiredis/hiredis.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "store/payload.h"
#include "store/redis_internal.h"

/* ---------------------------------------------------------------- format */

double rk_redis_wall_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Write the payload header for the value (tokens and body already in place
 * after it), computing the checksum over them. */
/* Fill the value's header (its first RK_STORE_HEADER_BYTES) for its token
 * ids and body, which follow it; out_sum gets the checksum. */
void rk_redis_encode_value(const char *fp, const rk_redis_value *j, uint8_t out_sum[16]) {
    const uint8_t *rest = j->value + RK_STORE_HEADER_BYTES;
    size_t tok_bytes = (size_t)j->n_tokens * sizeof(int32_t);
    rk_payload_header h = {.n_tokens = (uint32_t)j->n_tokens,
                           .layout = j->layout,
                           .body_size = j->size - RK_STORE_HEADER_BYTES - tok_bytes,
                           .created = rk_redis_wall_now()};
    memcpy(h.fingerprint, fp, RK_STORE_KEY_LEN);
    memcpy(h.key, j->key, RK_STORE_KEY_LEN);
    snprintf(h.policy, sizeof h.policy, "%s", j->policy);
    snprintf(h.doc_id, sizeof h.doc_id, "%s", j->doc_id);
    rk_payload_checksum((const int32_t *)(const void *)rest, (size_t)j->n_tokens, rest + tok_bytes,
                        (size_t)h.body_size, h.checksum);
    rk_payload_header_encode(&h, j->value);
    memcpy(out_sum, h.checksum, 16);
}

int rk_redis_meta_parse(const char *s, size_t len, meta *m) {
    char buf[160];
    if (len >= sizeof buf) return -1;
    memcpy(buf, s, len);
    buf[len] = '\0';
    int version = 0, n = 0, end = 0;
    unsigned long long bytes = 0;
    if (sscanf(buf, "%d %d %llu %32s %lf%n", &version, &m->n_tokens, &bytes, m->checksum,
               &m->created, &n) != 5)
        return -1;
    end = n;
    if ((version != META_PLAIN && version != META_TAGGED) || (size_t)end != len ||
        m->n_tokens < 1 || strlen(m->checksum) != RK_STORE_KEY_LEN)
        return -1;
    m->version = version;
    m->n_bytes = bytes;
    return 0;
}

/* Check value (len bytes) against the marker, the model, the key and the
 * request's token ids. Returns NULL when good, else why it is bad. On success
 * out->layout, policy, doc_id and created come from the header. */
static const char *check_value(const rk_redis *r, const char *key, const meta *m, const uint8_t *v,
                               size_t len, const int32_t *tokens, int32_t n_tokens,
                               rk_store_payload *out) {
    if (len != m->n_bytes) return len < m->n_bytes ? "truncated" : "longer than its marker says";
    rk_payload_header h;
    if (len < RK_STORE_HEADER_BYTES || rk_payload_header_decode("redis value", v, len, &h) != RK_OK)
        return "bad header (magic, version, size, checksum or fields)";
    if (h.header_bytes != RK_STORE_HEADER_BYTES) return "old payload version";
    if (strcmp(h.fingerprint, r->fp) != 0) return "written for another model";
    if (memcmp(h.key, key, RK_STORE_KEY_LEN) != 0) return "header key differs";
    if ((int64_t)h.n_tokens != m->n_tokens) return "token count differs from its marker";
    uint64_t fixed = rk_payload_file_bytes(h.n_tokens, 0);
    if (len < fixed || h.body_size != len - fixed) return "body size does not fit the value size";
    char hex[RK_STORE_KEY_LEN + 1];
    rk_payload_checksum_hex(h.checksum, hex);
    if (strcmp(hex, m->checksum) != 0) return "checksum differs from its marker";
    const uint8_t *toks = v + RK_STORE_HEADER_BYTES;
    uint8_t sum[16];
    rk_payload_checksum((const int32_t *)(const void *)toks, h.n_tokens,
                        toks + 4 * (size_t)h.n_tokens, (size_t)h.body_size, sum);
    if (memcmp(sum, h.checksum, 16) != 0) return "checksum mismatch (token ids or body corrupt)";
    if ((int64_t)h.n_tokens != n_tokens || memcmp(toks, tokens, 4 * (size_t)h.n_tokens) != 0)
        return "token ids differ from the request's";
    memset(out, 0, sizeof *out);
    out->layout = h.layout;
    memcpy(out->meta.policy, h.policy, sizeof out->meta.policy);
    memcpy(out->meta.doc_id, h.doc_id, sizeof out->meta.doc_id);
    out->meta.created = h.created;
    return NULL;
}

/* ---------------------------------------------------------------- authentication */

/* HMAC-SHA-256 of the n bytes at p under r's secret into tag. RK_ERR_NOMEM
 * when libcrypto cannot compute it (it allocates): never a verdict on the
 * value. */
rk_status rk_redis_value_mac(const rk_redis *r, const uint8_t *p, size_t n,
                             uint8_t tag[RK_REDIS_TAG_BYTES]) {
    unsigned int len = 0;
    if (!HMAC(EVP_sha256(), r->secret, (int)r->secret_len, p, n, tag, &len) ||
        len != RK_REDIS_TAG_BYTES)
        return rk_errorf(RK_ERR_NOMEM, "redis: cannot compute a value's HMAC-SHA-256 (no memory)");
    return RK_OK;
}

rk_status rk_redis_secret_load(const char *path, const char *env_value,
                               uint8_t out[RK_REDIS_SECRET_MAX], size_t *out_len) {
    *out_len = 0;
    size_t n = 0;
    const char *what;
    if (path && path[0]) {
        what = path;
        FILE *f = fopen(path, "rb");
        if (!f) return rk_errorf(RK_ERR_IO, "redis secret file %s: %s", path, strerror(errno));
        n = fread(out, 1, RK_REDIS_SECRET_MAX, f);
        int more = fgetc(f) != EOF, err = ferror(f);
        fclose(f);
        if (err) {
            memset(out, 0, RK_REDIS_SECRET_MAX);
            return rk_errorf(RK_ERR_IO, "redis secret file %s: read error", path);
        }
        if (more) n = RK_REDIS_SECRET_MAX + 1;
        if (n > 0 && n <= RK_REDIS_SECRET_MAX && out[n - 1] == '\n') n--;
        if (n > 0 && n <= RK_REDIS_SECRET_MAX && out[n - 1] == '\r') n--;
    } else if (env_value && env_value[0]) {
        what = "RAGKV_REDIS_SECRET";
        n = strlen(env_value);
        if (n <= RK_REDIS_SECRET_MAX) memcpy(out, env_value, n);
    } else {
        return RK_OK;
    }
    if (n < RK_REDIS_SECRET_MIN || n > RK_REDIS_SECRET_MAX) {
        memset(out, 0, RK_REDIS_SECRET_MAX);
        return rk_errorf(RK_ERR_INVALID, "redis secret (%s) must be %d to %d bytes, got %s", what,
                         RK_REDIS_SECRET_MIN, RK_REDIS_SECRET_MAX,
                         n < RK_REDIS_SECRET_MIN ? "fewer" : "more");
    }
    *out_len = n;
    return RK_OK;
}

/* ---------------------------------------------------------------- values read back */

/* Judge the value read by load: marker mr, the value's length vlen and its
 * first bytes vr (at most want of them). On V_GOOD *got has the header fields
 * and *out_payload the bytes without the tag; otherwise why says what is
 * wrong (perhaps in buf, cap bytes) and *out_unread is set when the value was
 * refused by its size without being read. RK_ERR_NOMEM when the tag cannot be computed (no
 * verdict). */
rk_status rk_redis_judge(rk_redis *r, const char *key, const redisReply *mr, uint64_t vlen,
                         const redisReply *vr, uint64_t want, const int32_t *tokens,
                         int32_t n_tokens, const rk_store_layout *layout, meta *m,
                         rk_store_payload *got, uint64_t *out_payload, verdict *v, const char **why,
                         int *out_unread, char *buf, size_t cap) {
    *v = V_CORRUPT;
    *out_unread = 0;
    if (rk_redis_meta_parse(mr->str, mr->len, m)) {
        *why = "unreadable commit marker";
        return RK_OK;
    }
    if (vlen != m->n_bytes) {
        *why = vlen < m->n_bytes ? "truncated" : "longer than its marker says";
        *out_unread = vlen > want;
        return RK_OK;
    }
    if (r->secret_len && m->version != META_TAGGED) {
        *v = V_AUTH;
        *why = "written without the shared secret (no tag)";
        return RK_OK;
    }
    uint64_t tag = m->version == META_TAGGED ? RK_REDIS_TAG_BYTES : 0;
    if (vlen < tag + RK_STORE_HEADER_BYTES) {
        *why = "shorter than a header";
        return RK_OK;
    }
    const uint8_t *p = (const uint8_t *)vr->str;
    if (vlen > want || vr->len != vlen) {
        /* Not read whole: too large for this chunk. Its header (read) tells a
         * sound value of another layout, which is kept, from a bad one. */
        rk_payload_header h;
        if (layout && vr->len >= RK_STORE_HEADER_BYTES &&
            rk_payload_header_decode("redis value", p, vr->len, &h) == RK_OK &&
            h.header_bytes == RK_STORE_HEADER_BYTES && strcmp(h.fingerprint, r->fp) == 0 &&
            memcmp(h.key, key, RK_STORE_KEY_LEN) == 0 && (int64_t)h.n_tokens == n_tokens &&
            memcmp(&h.layout, layout, sizeof h.layout) != 0) {
            *v = V_LAYOUT;
            return RK_OK;
        }
        *why = "larger than a value of this chunk can be: refused unread";
        *out_unread = 1;
        return RK_OK;
    }
    uint64_t plen = vlen - tag;
    if (tag && r->secret_len) {
        uint8_t mac[RK_REDIS_TAG_BYTES];
        rk_status st = rk_redis_value_mac(r, p, (size_t)plen, mac);
        if (st) return st;
        if (CRYPTO_memcmp(mac, p + plen, RK_REDIS_TAG_BYTES) != 0) {
            *v = V_AUTH;
            *why = "tag does not verify (forged, or written under another secret)";
            return RK_OK;
        }
    }
    meta pm = *m;
    pm.n_bytes = plen;
    if ((*why = check_value(r, key, &pm, p, (size_t)plen, tokens, n_tokens, got))) return RK_OK;
    if (layout && memcmp(layout, &got->layout, sizeof got->layout) != 0) {
        *v = V_LAYOUT;
        return RK_OK;
    }
    size_t tok_bytes = 4 * (size_t)m->n_tokens;
    if (r->cfg.body_check &&
        r->cfg.body_check(&got->layout, p + RK_STORE_HEADER_BYTES + tok_bytes,
                          (size_t)plen - RK_STORE_HEADER_BYTES - tok_bytes, buf, cap)) {
        *why = buf;
        return RK_OK;
    }
    *out_payload = plen;
    *v = V_GOOD;
    return RK_OK;
}

/* ---------------------------------------------------------------- values to write */

rk_status rk_redis_value_new(const char *key, const char *policy, const char *doc_id,
                             const rk_store_layout *layout, const int32_t *tokens, int32_t n_tokens,
                             size_t body_size, rk_redis_value **out, void **out_body) {
    *out = NULL;
    if (out_body) *out_body = NULL;
    if (!key || !rk_store_key_valid(key) || !layout || !tokens || n_tokens < 1)
        return rk_errorf(RK_ERR_INVALID, "redis: a value needs a key, a layout and token ids");
    size_t np = policy ? strlen(policy) : 0, nd = doc_id ? strlen(doc_id) : 0;
    if (np == 0 || np > RK_STORE_POLICY_MAX || !rk_payload_printable((const uint8_t *)policy, np))
        return rk_errorf(RK_ERR_INVALID, "redis: policy must be 1..%d printable characters",
                         RK_STORE_POLICY_MAX);
    if (nd > RK_STORE_DOC_ID_MAX)
        return rk_errorf(RK_ERR_INVALID, "redis: document id longer than %d bytes",
                         RK_STORE_DOC_ID_MAX);
    size_t tok_bytes = (size_t)n_tokens * sizeof(int32_t);
    size_t size = RK_STORE_HEADER_BYTES + tok_bytes + body_size;
    rk_redis_value *j = calloc(1, sizeof *j);
    if (j) j->value = malloc(size + RK_REDIS_TAG_BYTES);
    if (!j || !j->value) {
        free(j);
        return rk_errorf(RK_ERR_NOMEM, "redis: no memory for a %zu-byte value", size);
    }
    memcpy(j->key, key, RK_STORE_KEY_LEN + 1);
    memcpy(j->policy, policy, np);
    if (nd) memcpy(j->doc_id, doc_id, nd);
    j->layout = *layout;
    j->n_tokens = (uint32_t)n_tokens;
    j->size = size;
    memcpy(j->value + RK_STORE_HEADER_BYTES, tokens, tok_bytes);
    *out = j;
    if (out_body) *out_body = j->value + RK_STORE_HEADER_BYTES + tok_bytes;
    return RK_OK;
}

void rk_redis_value_free(rk_redis_value *v) {
    if (!v) return;
    free(v->value);
    free(v);
}
