// tests/openai_sdk_structured.mjs — structured output and tool calls through
// the official `openai` npm SDK (v6), against a running `ragkv serve` of a
// ChatML (Qwen3-shaped) model (RAGKV_URL, e.g. http://127.0.0.1:8080/v1),
// served as "ragkv-test". The model's weights are random, so the checks are
// about shape: what the grammar guarantees, read through the SDK's own
// parsing helpers and types. Run by tests/test_openai.c from the folder the
// SDK is installed in; prints "ok: all checks passed" and exits 0, or throws
// (exit 1) at the first check that fails.
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

const person = {
  type: "json_schema",
  json_schema: {
    name: "person",
    strict: true,
    schema: {
      type: "object",
      properties: {
        name: { type: "string", maxLength: 24 },
        age: { type: "integer", minimum: 0, maximum: 130 },
        role: { type: "string", enum: ["author", "reader"] },
      },
      required: ["name", "age", "role"],
      additionalProperties: false,
    },
  },
};

step("chat.completions.parse with a JSON schema");
for (const seed of [1, 2, 3]) {
  const r = await client.chat.completions.parse({
    model,
    messages: [{ role: "user", content: "Describe one person as JSON." }],
    response_format: person,
    temperature: 1,
    seed,
    max_tokens: 120,
  });
  const m = r.choices[0].message;
  assert.equal(r.choices[0].finish_reason, "stop", JSON.stringify(r.choices[0]));
  assert.ok(m.parsed, "the SDK parsed the content");
  assert.deepEqual(Object.keys(m.parsed).sort(), ["age", "name", "role"]);
  assert.equal(typeof m.parsed.name, "string");
  assert.ok(m.parsed.name.length <= 24);
  assert.ok(Number.isInteger(m.parsed.age) && m.parsed.age >= 0 && m.parsed.age <= 130);
  assert.ok(["author", "reader"].includes(m.parsed.role));
}

step("json_object");
const jo = await client.chat.completions.create({
  model,
  messages: [{ role: "user", content: "Answer in JSON." }],
  response_format: { type: "json_object" },
  seed: 4,
  max_tokens: 80,
});
if (jo.choices[0].finish_reason === "stop") {
  const v = JSON.parse(jo.choices[0].message.content);
  assert.equal(typeof v, "object");
  assert.ok(v !== null && !Array.isArray(v));
}

const tools = [
  {
    type: "function",
    function: {
      name: "get_weather",
      description: "The weather in a city.",
      strict: true,
      parameters: {
        type: "object",
        properties: {
          city: { type: "string", maxLength: 20 },
          unit: { type: "string", enum: ["c", "f"] },
        },
        required: ["city", "unit"],
        additionalProperties: false,
      },
    },
  },
];
const ask = [{ role: "user", content: "What is the weather in Paris?" }];

step("a required tool call, parsed by the SDK");
const tc = await client.chat.completions.parse({
  model,
  messages: ask,
  tools,
  tool_choice: "required",
  seed: 5,
  max_tokens: 120,
});
assert.equal(tc.choices[0].finish_reason, "tool_calls");
const calls = tc.choices[0].message.tool_calls;
assert.ok(Array.isArray(calls) && calls.length >= 1);
for (const call of calls) {
  assert.equal(call.type, "function");
  assert.equal(typeof call.id, "string");
  assert.equal(call.function.name, "get_weather");
  const a = call.function.parsed_arguments;
  assert.deepEqual(Object.keys(a).sort(), ["city", "unit"]);
  assert.ok(["c", "f"].includes(a.unit));
}

step("the same call streamed, reassembled by the SDK");
const stream = client.chat.completions.stream({
  model,
  messages: ask,
  tools,
  tool_choice: "required",
  seed: 5,
  max_tokens: 120,
});
const final = await stream.finalChatCompletion();
assert.equal(final.choices[0].finish_reason, "tool_calls");
const streamed = final.choices[0].message.tool_calls;
assert.equal(streamed.length, calls.length);
for (let i = 0; i < calls.length; i++) {
  assert.equal(streamed[i].function.name, calls[i].function.name);
  assert.equal(streamed[i].function.arguments, calls[i].function.arguments);
}

step("a tool result turn is answered");
const after = await client.chat.completions.create({
  model,
  messages: [
    ...ask,
    { role: "assistant", content: null, tool_calls: [calls[0]].map(({ id, type, function: f }) => ({ id, type, function: { name: f.name, arguments: f.arguments } })) },
    { role: "tool", tool_call_id: calls[0].id, content: '{"temperature": 21}' },
  ],
  tools,
  seed: 6,
  max_tokens: 16,
});
assert.equal(after.choices[0].message.role, "assistant");
assert.ok(["stop", "length", "tool_calls"].includes(after.choices[0].finish_reason));

step("an invalid schema is a BadRequestError naming its path");
await assert.rejects(
  client.chat.completions.create({
    model,
    messages: ask,
    response_format: {
      type: "json_schema",
      json_schema: { name: "bad", schema: { type: "object", properties: { d: { type: "string", format: "date" } } } },
    },
    max_tokens: 8,
  }),
  (e) => e instanceof OpenAI.BadRequestError && /properties\.d/.test(e.message),
);

console.log("ok: all checks passed");
