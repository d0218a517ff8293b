// tests/openai_sdk_responses.mjs — the Responses API (POST /v1/responses)
// through the official `openai` npm SDK (v6), against a running `ragkv serve`
// of a ChatML (Qwen3-shaped) model with random weights (RAGKV_URL, e.g.
// http://127.0.0.1:8080/v1), served as "ragkv-test": responses.create,
// responses.stream (its events in order, its final response equal to the
// unstreamed one), a function tool round trip, previous_response_id over three
// turns, and responses.parse with a zod schema. Run by tests/test_responses.c;
// prints "ok: all checks passed" and exits 0, or throws at the first check
// that fails.
import assert from "node:assert/strict";
import OpenAI from "openai";
import { zodTextFormat } from "openai/helpers/zod";
import { z } from "zod";

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

// What differs between two requests for the same answer: ids, time, report.
function comparable(r) {
  const c = structuredClone(r);
  delete c.id;
  delete c.created_at;
  delete c.ragkv;
  delete c.output_text;
  delete c.usage.input_tokens_details;
  for (const it of c.output) {
    delete it.id;
    delete it.call_id;
    delete it.parsed_arguments;
  }
  return c;
}

step("responses.create");
const ask = {
  model,
  input: "Say something.",
  instructions: "Be short.",
  reasoning: { effort: "minimal" },
  max_output_tokens: 24,
  seed: 7,
  metadata: { run: "sdk" },
};
const r = await client.responses.create(ask);
assert.equal(r.object, "response");
assert.ok(r.id.startsWith("resp_"));
assert.ok(["completed", "incomplete"].includes(r.status));
assert.equal(typeof r.output_text, "string");
assert.equal(r.output.at(-1).type, "message");
assert.equal(r.output_text, r.output.at(-1).content[0].text);
assert.equal(r.metadata.run, "sdk");
assert.equal(r.usage.total_tokens, r.usage.input_tokens + r.usage.output_tokens);

step("responses.retrieve, inputItems.list, delete");
const got = await client.responses.retrieve(r.id);
assert.equal(got.id, r.id);
assert.equal(got.output_text, r.output_text);
const items = [];
for await (const it of client.responses.inputItems.list(r.id)) items.push(it);
assert.equal(items.length, 1);
assert.equal(items[0].content[0].text, "Say something.");
await client.responses.delete(r.id);
await assert.rejects(client.responses.retrieve(r.id), (e) => e instanceof OpenAI.NotFoundError);

step("responses.stream: events in order, final response equal to the unstreamed one");
const stream = client.responses.stream(ask);
const types = [];
let deltas = "";
let lastSeq = -1;
let ended = null;
for await (const ev of stream) {
  if (ev.type === "response.completed" || ev.type === "response.incomplete") ended = ev.response;
  types.push(ev.type);
  assert.equal(ev.sequence_number, lastSeq + 1);
  lastSeq = ev.sequence_number;
  if (ev.type === "response.output_text.delta") deltas += ev.delta;
}
const fin = await stream.finalResponse();
assert.equal(types[0], "response.created");
assert.equal(types[1], "response.in_progress");
assert.ok(["response.completed", "response.incomplete"].includes(types.at(-1)));
assert.ok(types.includes("response.output_text.delta"));
assert.equal(deltas, r.output_text);
assert.equal(fin.output_text, r.output_text);
assert.equal(fin.id, ended.id);
assert.deepEqual(comparable(ended), comparable(r));

step("thinking streamed as reasoning_text, gathered by the stream helper");
const think = {
  model,
  input: "Hi",
  max_output_tokens: 4,
  temperature: 0,
  logit_bias: { 151667: 100 }, // <think>: the answer opens a thinking block
};
const tr = await client.responses.create(think);
assert.equal(tr.output[0].type, "reasoning");
const ts = client.responses.stream(think);
let thought = "";
for await (const ev of ts) if (ev.type === "response.reasoning_text.delta") thought += ev.delta;
const tf = await ts.finalResponse();
assert.equal(thought, tr.output[0].content[0].text);
assert.equal(tf.output[0].type, "reasoning");
assert.equal(tf.output[0].content[0].text, tr.output[0].content[0].text);
assert.ok(tr.usage.output_tokens_details.reasoning_tokens > 0);

step("a function tool round trip with function_call_output");
const tools = [
  {
    type: "function",
    name: "get_weather",
    description: "The weather in a city.",
    strict: true,
    parameters: {
      type: "object",
      properties: { city: { type: "string", maxLength: 16 } },
      required: ["city"],
      additionalProperties: false,
    },
  },
];
const t1 = await client.responses.create({
  model,
  input: "What is the weather in Paris?",
  tools,
  tool_choice: "required",
  max_output_tokens: 60,
  seed: 5,
});
const call = t1.output.find((o) => o.type === "function_call");
assert.ok(call, JSON.stringify(t1.output));
assert.equal(call.name, "get_weather");
assert.equal(typeof JSON.parse(call.arguments).city, "string");
const t2 = await client.responses.create({
  model,
  previous_response_id: t1.id,
  input: [{ type: "function_call_output", call_id: call.call_id, output: '{"temp_c": 21}' }],
  tools,
  reasoning: { effort: "minimal" },
  max_output_tokens: 12,
  seed: 6,
});
assert.equal(t2.previous_response_id, t1.id);
// The earlier answer's (empty) thinking block is not rendered again, as
// Qwen3's template drops it: the cache holds the earlier prompt up to the
// answer's turn.
assert.ok(t2.usage.input_tokens_details.cached_tokens >= t1.usage.input_tokens - 8);

step("previous_response_id over three turns");
let prev = null;
let before = 0; // the previous turn's prompt
for (const [i, text] of ["Hello.", "Tell me more.", "And then?"].entries()) {
  const t = await client.responses.create({
    model,
    input: text,
    previous_response_id: prev,
    reasoning: { effort: "minimal" },
    max_output_tokens: 10,
    seed: i + 1,
  });
  if (prev) {
    assert.ok(
      t.usage.input_tokens_details.cached_tokens >= before - 2,
      `turn ${i + 1}: ${t.usage.input_tokens_details.cached_tokens} cached, ${before} before`,
    );
  }
  before = t.usage.input_tokens - 4; // less its empty thinking block, not rendered again
  prev = t.id;
}

step("responses.parse with a zod schema");
const Person = z.object({
  name: z.string().max(16),
  age: z.number().int().min(0).max(99),
});
const p = await client.responses.parse({
  model,
  input: "Describe a person.",
  text: { format: zodTextFormat(Person, "person") },
  max_output_tokens: 120,
  seed: 3,
});
assert.equal(p.status, "completed", JSON.stringify(p.output));
assert.ok(p.output_parsed, "the SDK parsed the output");
assert.deepEqual(Object.keys(p.output_parsed).sort(), ["age", "name"]);
assert.ok(Number.isInteger(p.output_parsed.age));

step("a bad request is a BadRequestError naming the field");
await assert.rejects(
  client.responses.create({ model, input: [{ role: "user", content: [{ type: "input_image", image_url: "http://x/y.png" }] }] }),
  (e) => e instanceof OpenAI.BadRequestError && e.param === "input",
);

console.log("ok: all checks passed");
