/* bench/bench_tokenizer.c — tokenizer throughput: building the Qwen3
 * tokenizer, and encoding ~1 MB of English and of Chinese text with it (and
 * with the llama tokenizer of stories260K). Prints numbers; asserts nothing.
 * The text is made of sentences drawn at random (fixed seed) from a small
 * pool, so no two neighbouring pieces repeat in a pattern a cache could use
 * (and the tokenizer has no cache). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/setup.h"
#include "config/config.h"
#include "engine/gguf.h"
#include "engine/tokenizer.h"

static const char *const k_english[] = {
    "The committee reviewed the proposal on Tuesday and asked for a revised budget. ",
    "Retrieval-augmented generation feeds documents to a language model at query time. ",
    "She couldn't find the keys, so they'll have to wait outside until 6:30 pm.\n",
    "In 1969, about 600 million people watched the first Moon landing on television. ",
    "Caching the key-value state of each chunk avoids recomputing it for every request. ",
    "\"What's the weather like?\" he asked, looking at the grey sky over the harbour.\n\n",
    "Prices rose 3.2% in March, while wages grew by only 1.8% over the same period. ",
    "The function returns an error code; the caller must free the buffer it allocated.\n",
};

static const char *const k_chinese[] = {
    "检索增强生成在查询时把相关文档提供给语言模型。",
    "今天早上下了一场大雨，街道上到处都是积水。",
    "他们计划在明年春天完成这个项目的第一阶段。\n",
    "缓存每个文本块的键值状态，可以避免为每个请求重复计算。",
    "这家餐厅的饺子非常好吃，价格也很合理。",
    "根据最新的统计数据，该市人口已经超过一千万。\n",
    "学习一门新的语言需要耐心和大量的练习。",
    "会议将于下午三点在二楼的大会议室举行。",
};

/* About target bytes of text made from sentences of pool, picked at random. */
static char *make_text(const char *const *pool, size_t n_pool, size_t target, size_t *out_len) {
    char *buf = malloc(target + 512);
    if (!buf) return NULL;
    size_t len = 0;
    unsigned seed = 42;
    while (len < target) {
        const char *s = pool[(size_t)rand_r(&seed) % n_pool];
        size_t n = strlen(s);
        memcpy(buf + len, s, n);
        len += n;
    }
    buf[len] = '\0';
    *out_len = len;
    return buf;
}

static void bench_encode(const rk_tokenizer *t, const char *name, const char *text, size_t len) {
    double best = 1e9;
    size_t n_ids = 0;
    for (int rep = 0; rep < 3; rep++) {
        int32_t *ids;
        double t0 = rk_time_now();
        if (rk_tokenizer_encode(t, text, len, 0, &ids, &n_ids) != RK_OK) {
            printf("%s: encode failed: %s\n", name, rk_error_message());
            return;
        }
        double dt = rk_time_now() - t0;
        if (dt < best) best = dt;
        if (rep == 2) {
            char *out;
            size_t out_len;
            double t1 = rk_time_now();
            if (rk_tokenizer_decode(t, ids, n_ids, 0, 1, &out, &out_len) == RK_OK) {
                double dd = rk_time_now() - t1;
                printf("%-22s %8.2f MB in %7.1f ms: %7.2f MB/s, %8zu tokens (%.2f bytes/token); "
                       "decode %.0f MB/s, %s\n",
                       name, len / 1e6, best * 1e3, len / 1e6 / best, n_ids, (double)len / n_ids,
                       len / 1e6 / dd,
                       out_len == len && memcmp(out, text, len) == 0 ? "exact" : "NOT EXACT");
                free(out);
            }
        }
        free(ids);
    }
}

int main(int argc, char **argv) {
    static const char *usage = "usage: bench_tokenizer\n"
                               "Qwen3 tokenizer build time, and encoding throughput on ~1 MB of "
                               "English and of Chinese.\n";
    int exit_code;
    if (rk_bench_parse("bench_tokenizer", usage, NULL, 0, NULL, argc, argv, &exit_code))
        return exit_code;
    size_t en_len, zh_len;
    char *en = make_text(k_english, sizeof k_english / sizeof *k_english, 1 << 20, &en_len);
    char *zh = make_text(k_chinese, sizeof k_chinese / sizeof *k_chinese, 1 << 20, &zh_len);
    if (!en || !zh) return 1;

    const char *qwen = RK_SHARED_DIR "/tokenizers/qwen3/tokenizer.json";
    rk_vocab v;
    double t0 = rk_time_now();
    if (rk_vocab_from_hf_json(qwen, 151936, &v) != RK_OK) {
        printf("qwen3: %s (skipped)\n", rk_error_message());
    } else {
        double t1 = rk_time_now();
        rk_tokenizer *t;
        if (rk_tokenizer_create(&v, &t) == RK_OK) {
            double t2 = rk_time_now();
            printf("qwen3: tokenizer.json read in %.0f ms, tokenizer built in %.1f ms "
                   "(%d tokens, %d merges)\n",
                   (t1 - t0) * 1e3, (t2 - t1) * 1e3, (int)v.n_tokens, (int)v.n_merges);
            bench_encode(t, "qwen3 English", en, en_len);
            bench_encode(t, "qwen3 Chinese", zh, zh_len);
            rk_tokenizer_free(t);
        } else {
            printf("qwen3: %s\n", rk_error_message());
        }
        rk_vocab_free(&v);
    }

    rk_gguf *g;
    if (rk_gguf_open(RK_SHARED_DIR "/models/stories260K.gguf", &g) == RK_OK) {
        rk_tokenizer *t;
        if (rk_tokenizer_from_gguf(g, &t) == RK_OK) {
            bench_encode(t, "stories260K English", en, en_len);
            bench_encode(t, "stories260K Chinese", zh, zh_len);
            rk_tokenizer_free(t);
        }
        rk_gguf_close(g);
    }
    if (rk_vocab_tiny(&v) == RK_OK) {
        rk_tokenizer *t;
        if (rk_tokenizer_create(&v, &t) == RK_OK) {
            bench_encode(t, "tiny English", en, en_len);
            rk_tokenizer_free(t);
        }
        rk_vocab_free(&v);
    }
    free(en);
    free(zh);
    return 0;
}
