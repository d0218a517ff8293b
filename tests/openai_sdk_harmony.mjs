// tests/openai_sdk_harmony.mjs — a gpt-oss model (harmony chat format)
// through the official `openai` npm SDK (v6), against a running `ragkv
// serve` of gpt-oss-tiny (RAGKV_URL, e.g. http://127.0.0.1:8080/v1), served
// as "ragkv-test": documents and a chunk hit on repeat, the analysis channel
// as `reasoning_content`, a tool call as `tool_calls`, whole and streamed.
// The weights are random, so the answers are forced by the `grammar`
// extension into the model's own harmony form (spelled by ordinary tokens: a
// grammar's text never matches a special token); what is checked is what
// the server parses out of it, as the SDK reads it. Run by tests/test_openai.c
// from the folder the SDK is installed in; prints "ok: all checks passed" and
// exits 0, or throws (exit 1) at the first check that fails.
import assert from "node:assert/strict";
import OpenAI from "openai";

const client = new OpenAI({
  baseURL: process.env.RAGKV_URL,
  apiKey: "not-checked",
  maxRetries: 0,
  timeout: 120_000,
});
const model = "ragkv-test";

function step(name) {
  console.log(`- ${name}`);
}

const answer =
  'root ::= "<|channel|>analysis<|message|>The first document says so.<|end|>' +
  '<|start|>assistant<|channel|>final<|message|>Lily.<|return|>"';
const ask = {
  model,
  messages: [
    { role: "system", content: "Answer from the documents." },
    { role: "user", content: "Who had the red ball?" },
  ],
  documents: [{ text: "Lily had a red ball." }, { text: "Tom had a big dog named Max." }],
  max_tokens: 200,
  temperature: 0,
  grammar: answer,
};

step("chat with documents: the analysis as reasoning_content, the final as content");
const a = await client.chat.completions.create(ask);
assert.equal(a.choices[0].message.content, "Lily.", JSON.stringify(a.choices[0]));
assert.equal(a.choices[0].message.reasoning_content, "The first document says so.");
assert.equal(a.choices[0].finish_reason, "stop");
assert.equal(a.ragkv.chunks.length, 2);

step("the same request again: its documents are chunk hits");
const b = await client.chat.completions.create(ask);
assert.deepEqual(a.ragkv.chunks.map(() => "hit"), b.ragkv.chunks.map((c) => c.status));
assert.equal(b.choices[0].message.content, "Lily.");

step("streamed: reasoning and content deltas add up to the same");
let thought = "";
let text = "";
for await (const chunk of await client.chat.completions.create({ ...ask, stream: true })) {
  const d = chunk.choices[0]?.delta ?? {};
  if (d.reasoning_content) thought += d.reasoning_content;
  if (d.content) text += d.content;
}
assert.equal(thought, "The first document says so.");
assert.equal(text, "Lily.");

const tools = [
  {
    type: "function",
    function: {
      name: "get_weather",
      description: "Get the weather.",
      parameters: {
        type: "object",
        properties: { city: { type: "string" } },
        required: ["city"],
      },
    },
  },
];
const call =
  'root ::= "<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant' +
  '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>' +
  '{\\"city\\": \\"Paris\\"}<|call|>"';
const askTool = {
  model,
  messages: [{ role: "user", content: "Weather in Paris?" }],
  tools,
  max_tokens: 200,
  temperature: 0,
  grammar: call,
};

step("a tool call: tool_calls with its arguments, the analysis as reasoning");
const t = await client.chat.completions.create(askTool);
const tc = t.choices[0].message.tool_calls;
assert.equal(t.choices[0].finish_reason, "tool_calls", JSON.stringify(t.choices[0]));
assert.equal(tc.length, 1);
assert.equal(tc[0].type, "function");
assert.equal(tc[0].function.name, "get_weather");
assert.deepEqual(JSON.parse(tc[0].function.arguments), { city: "Paris" });
assert.equal(t.choices[0].message.reasoning_content, "Need it.");

step("the tool call streamed, gathered by the SDK's stream helper");
const s = client.chat.completions.stream(askTool);
const final = await s.finalChatCompletion();
assert.equal(final.choices[0].finish_reason, "tool_calls");
assert.equal(final.choices[0].message.tool_calls[0].function.name, "get_weather");
assert.deepEqual(JSON.parse(final.choices[0].message.tool_calls[0].function.arguments), {
  city: "Paris",
});

console.log("ok: all checks passed");
