/* gateway/chat.h — chat templates: a parsed chat request rendered into the
 * three kinds of pieces the pipeline tokenizes separately (gateway/chat.c
 * describes the layout). Pure functions, safe from any thread. */
#ifndef RK_CHAT_H
#define RK_CHAT_H

#include "gateway/api.h"

/* ---------------------------------------------------------------- chat templates */

typedef enum rk_chat_template {
    RK_CHAT_CHATML = 0,  /* <|im_start|>role\n...<|im_end|> (Qwen2, Qwen3) */
    RK_CHAT_LLAMA3 = 1,  /* <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|> */
    RK_CHAT_LLAMA2 = 2,  /* [INST] <<SYS>>...<</SYS>> ... [/INST] */
    RK_CHAT_PHI3 = 3,    /* <|role|>\n...<|end|>\n (Phi-3, Phi-4-mini) */
    RK_CHAT_GEMMA = 4,   /* <start_of_turn>user|model\n...<end_of_turn>\n (Gemma 2, Gemma 3) */
    RK_CHAT_HARMONY = 5, /* <|start|>role<|message|>...<|end|> (gpt-oss; see harmony.c) */
    RK_CHAT_GEMMA4 = 6,  /* <|turn>user|model|system\n...<turn|>\n (Gemma 4; chat_gemma4.c) */
} rk_chat_template;

/* Name of a template: "chatml", "llama3", "llama2", "phi3", "gemma", "harmony", "gemma4". */
const char *rk_chat_template_name(rk_chat_template t);

/* Choose a template: from the GGUF tokenizer.chat_template text when given
 * (NULL when absent), else from the architecture name ("qwen2", "qwen3":
 * ChatML; "phi3": Phi-3; "gemma2", "gemma3": Gemma; "gemma4": Gemma 4 when
 * has_gemma4_tokens (<|turn> exists), else Gemma; "gpt-oss": harmony) and
 * the vocabulary (has_llama3_tokens: <|start_header_id|> exists), else
 * Llama-2. */
rk_chat_template rk_chat_template_detect(const char *jinja, const char *arch, int has_llama3_tokens,
                                         int has_gemma4_tokens);

/* Render a parsed chat request into req->pieces around the document turn
 * (the first user message with documents, else the first user message): the
 * system piece is the template's system part, the turns before it and its
 * opening; the chunks are its documents and every later user message's,
 * raw text, in order; the question piece is the rest of it, every later
 * turn's text and the assistant prefix (or, when the last message is the
 * assistant's, that message left open to be continued), so a follow-up's
 * layout extends the previous turn's. A user message's documents are its
 * ragkv_chunk parts and, when req->split_chat is set, the pieces of its text
 * split on req->separator; the `chunks`/`documents` extension is the first
 * user message's.
 *
 * On success req->pieces (and req->chunk_ids, when the extension named ids)
 * replace what req held, owned by req. On failure err says why (400 for a
 * bad conversation, 422 for more than max_chunks chunks, 500 when out of
 * memory) and req's pieces are unchanged. Pure: any thread. */
rk_status rk_chat_render(rk_chat_template t, rk_api_request *req, int max_chunks,
                         rk_http_error *err);

/* The tool calls in a generated answer (tool_choice auto, required or
 * named): Qwen's <tool_call> blocks, Llama 3's JSON call, or harmony's
 * messages to=functions.NAME closed by <|call|> (text: the answer decoded
 * with its special tokens), naming one of req's tools with an object of
 * arguments. Returns them in OpenAI's shape ([{"id": "call_<id>_<i>",
 * "type": "function", "function": {"name", "arguments" (JSON text)}}], a
 * new reference) with *content the text before them (malloc'ed; harmony:
 * the content of the messages before the first call); NULL when the answer
 * holds no call. */
json_t *rk_chat_tool_calls(rk_chat_template t, const rk_api_request *req, const char *text,
                           const char *id, char **content);

/* ---------------------------------------------------------------- thinking (reasoning.c) */

/* A thinking model's answer ("<think>...</think>answer", Qwen3) split into
 * the thinking (message.reasoning_content) and the answer (content). An
 * answer that does not start with <think> (after whitespace) is all answer;
 * thinking that never closes is all thinking. Whitespace around the
 * thinking and before the answer belongs to neither. */
typedef enum rk_think_state {
    RK_THINK_START = 0, /* nothing decided yet */
    RK_THINK_OPENED,    /* after <think> */
    RK_THINK_IN,        /* in the thinking */
    RK_THINK_AFTER,     /* after </think> */
    RK_THINK_ANSWER,    /* in the answer */
    RK_THINK_END,       /* after Gemma 4's end of turn (<turn|>): neither */
} rk_think_state;

/* The kinds of split: Qwen3's <think> tags, harmony's channels, Gemma 4's
 * "<|channel>thought\n...<channel|>" (the answer decoded with its special
 * tokens; its <turn|> ends the answer). */
enum { RK_THINK_TAGS = 0, RK_THINK_HARMONY = 1, RK_THINK_GEMMA4 = 2 };

typedef struct rk_think_split {
    rk_think_state state;
    rk_strbuf pending; /* text not yet known to be thinking or answer */
    /* harmony (gpt-oss): rk_think_feed splits the answer by channel
     * (rk_harmony_feed); analysis: the message being read is the analysis
     * channel's */
    int harmony, analysis;
    int gemma4; /* Gemma 4's channel tags in place of <think> */
} rk_think_split;

/* Feed the next n bytes of the answer; append to reasoning and content what
 * is now decided (final: the answer is over, decide the rest). The pieces
 * of a stream add up to what the whole text gives at once. Release with
 * rk_strbuf_free(&s->pending). */
void rk_think_feed(rk_think_split *s, const char *text, size_t n, int final, rk_strbuf *reasoning,
                   rk_strbuf *content);

/* The same for a whole answer (kind: an RK_THINK_ kind; harmony: split by
 * channel). */
void rk_think_split_text(const char *text, rk_strbuf *reasoning, rk_strbuf *content);
void rk_think_split_text_as(int kind, const char *text, rk_strbuf *reasoning, rk_strbuf *content);
static inline int rk_think_kind(const rk_think_split *s) {
    return s->harmony ? RK_THINK_HARMONY : s->gemma4 ? RK_THINK_GEMMA4 : RK_THINK_TAGS;
}

/* ---------------------------------------------------------------- Gemma 4 (chat_gemma4.c) */

/* Gemma 4's system turn, as its template opens: when the first message is a
 * system message, req->thinking is set or req has tools, "<|turn>system\n",
 * "<|think|>\n" when thinking, the first message's text trimmed, each
 * tool's declaration ("<|tool>declaration:NAME{...}<tool|>"), "<turn|>\n";
 * else nothing. Into b. */
void rk_gemma4_system(rk_strbuf *b, const rk_api_request *req);

/* Gemma 4: a system or assistant message m of req as a turn into b (the
 * first message, a system one, is the system turn's and writes nothing): the
 * text trimmed, an assistant's thinking channels dropped, an assistant
 * message after another continuing its model turn (no new opening). open: the
 * assistant's turn the answer continues, without its end (its text only
 * trimmed at the start). */
void rk_gemma4_turn(rk_strbuf *b, const rk_api_request *req, const rk_chat_msg *m, int open);

/* Gemma 4 tools. An assistant message with calls (rk_gemma4_turn) writes
 * each as "<|tool_call>call:NAME{key:value,...}<tool_call|>"; the tool
 * messages right after it are its results, each
 * "<|tool_response>response:NAME{value:<|\"|>TEXT<|\"|>}<tool_response|>"
 * (rk_gemma4_tool_open, the text, rk_gemma4_tool_close), and the calling
 * message's text (and the turn's end, when it has text) follows the last
 * of them; with no result after it, its text and "<|tool_response>" (where
 * the results would go) follow the calls. */
void rk_gemma4_call(rk_strbuf *b, const char *name, const json_t *args);
void rk_gemma4_tool_open(rk_strbuf *b, const char *name);
void rk_gemma4_tool_close(rk_strbuf *b, const rk_api_request *req, int i);

/* The assistant message whose calls tool message i answers (the one before
 * the run of tool messages i is in, when it has calls), or NULL. */
const rk_chat_msg *rk_gemma4_caller(const rk_api_request *req, int i);

/* The name of the call tool message i answers: the call of its caller with
 * its tool_call_id (malloc'ed), or NULL when there is none (or no memory). */
char *rk_gemma4_tool_name(const rk_api_request *req, int i);

/* The next call in a Gemma 4 answer (decoded with its special tokens), from
 * *pos on: "<|tool_call>call:NAME{...}<tool_call|>" with NAME at most 64
 * characters of [A-Za-z0-9_-] and a mapping in Gemma 4's value syntax.
 * Returns 1 with name, *args (a new JSON object), *at where the call begins
 * and *pos after it; 0 when there is none. */
int rk_gemma4_find_call(const char *text, size_t *pos, char name[65], json_t **args, size_t *at);

/* tool_choice required or named: the grammar text (malloc'ed, NULL when
 * memory ran out) of one call of req's tools, or of the named one (several
 * in a row when parallel_tool_calls), in Gemma 4's syntax, each tool's
 * mapping shaped by its parameters: its properties in the template's key
 * order, the required ones present, each value of its type (enums, strings
 * without a '<', integers, numbers, booleans, lists, mappings); a value of
 * another schema is any value. */
char *rk_gemma4_calls_grammar(const rk_api_request *req);

/* Harmony (harmony.c): the analysis channel's message bodies to reasoning,
 * the other channels' to content, headers and tags to neither (the answer
 * decoded with its special tokens as text); the states of rk_think_split:
 * START a header, OPENED a channel's name, IN a body, ANSWER after
 * <|return|> or <|call|>. */
void rk_harmony_feed(rk_think_split *s, const char *text, size_t n, int final, rk_strbuf *reasoning,
                     rk_strbuf *content);

/* The harmony system message (its model identity, "Current date: " today
 * unless NULL or empty, "Reasoning: " effort, 1 low, 2 medium, 3 high, 0
 * the default medium, and its channels; with tools, the line that sends
 * calls to the commentary channel), into b. */
void rk_harmony_system(rk_strbuf *b, int effort, int tools, const char *today);

/* Harmony tools, as gpt-oss's template writes them: req's tools as the
 * developer message's "# Tools" section (namespace functions, each tool a
 * TypeScript-like type of its parameters); an assistant's call
 * ("<|start|>assistant to=functions.NAME<|channel|>commentary
 * json<|message|>ARGS<|call|>", ARGS as the template's tojson); a tool
 * result's opening ("<|start|>functions.NAME to=assistant<|channel|>
 * commentary<|message|>") and its text as a JSON string. */
void rk_harmony_functions(rk_strbuf *b, const rk_api_request *req);
void rk_harmony_call(rk_strbuf *b, const char *name, const json_t *args);
void rk_harmony_tool_open(rk_strbuf *b, const char *name);
void rk_harmony_tool_text(rk_strbuf *b, const char *content);

/* The next tool call in a harmony answer (decoded with its special tokens),
 * from *pos on: a message whose header has "to=functions.NAME" and whose
 * body is closed by <|call|>. Returns 1 with name (NUL-terminated, at most
 * 64 characters of [A-Za-z0-9_-]), the body (*args, *args_len: the
 * arguments' text), *at where the message begins (its <|start|>, else its
 * header) and *pos after it; 0 when there is none. */
int rk_harmony_find_call(const char *text, size_t *pos, char name[65], const char **args,
                         size_t *args_len, size_t *at);

#endif
