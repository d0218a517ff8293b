// tests/openai_sdk.mjs — the official `openai` npm SDK (v6) against a
// running `ragkv serve` (RAGKV_URL, e.g. http://127.0.0.1:8080/v1), served
// as "ragkv-test" with a 256-token context. Run by tests/test_openai.c from
// the folder the SDK is installed in; prints "ok: all checks passed" and
// exits 0, or throws (exit 1) at the first check that fails.
import assert from "node:assert/strict";
import OpenAI from "openai";

const client = new OpenAI({
  baseURL: process.env.RAGKV_URL,
  apiKey: "not-checked",
  maxRetries: 0,
  timeout: 60_000,
});
const SERVED = "ragkv-test";
const OTHER = "gpt-4o-mini"; // a name the server does not serve: answered as SERVED

function step(name) {
  console.log(`- ${name}`);
}

// One chat logprobs entry: {token, logprob, bytes, top_logprobs: k entries}.
function checkChatLogprob(e, k) {
  assert.equal(typeof e.token, "string");
  assert.equal(typeof e.logprob, "number");
  assert.ok(e.logprob <= 0);
  assert.ok(Array.isArray(e.bytes));
  if (k >= 0) {
    assert.equal(e.top_logprobs.length, k);
    for (const t of e.top_logprobs) checkChatLogprob(t, -1);
  }
}

step("models");
const models = await client.models.list();
assert.equal(models.data[0].id, SERVED);
const model = await client.models.retrieve(SERVED);
assert.equal(model.id, SERVED);
assert.equal(model.object, "model");

step("completion, another model name");
const c = await client.completions.create({
  model: OTHER,
  prompt: "Once upon a time",
  max_tokens: 8,
  temperature: 0,
});
assert.ok(c.id.startsWith("cmpl-"), c.id);
assert.equal(c.object, "text_completion");
assert.equal(c.model, SERVED);
assert.equal(typeof c.system_fingerprint, "string");
assert.equal(typeof c.choices[0].text, "string");
assert.ok(["length", "stop"].includes(c.choices[0].finish_reason));
assert.ok(c.usage.completion_tokens >= 1 && c.usage.completion_tokens <= 8);
assert.equal(c.usage.total_tokens, c.usage.prompt_tokens + c.usage.completion_tokens);

for (const includeUsage of [false, true]) {
  step(`completion stream, include_usage ${includeUsage}`);
  const stream = await client.completions.create({
    model: SERVED,
    prompt: "Once upon a time",
    max_tokens: 8,
    temperature: 0,
    stream: true,
    ...(includeUsage ? { stream_options: { include_usage: true } } : {}),
  });
  let text = "", finishes = 0, usage = null, report = null;
  for await (const chunk of stream) {
    assert.equal(chunk.object, "text_completion");
    if (chunk.usage) usage = chunk.usage;
    if (chunk.ragkv) report = chunk.ragkv;
    // Empty choices: the usage event alone, and only when asked for.
    if (chunk.choices.length === 0) {
      assert.ok(includeUsage && chunk.usage, "an event with empty choices, usage not asked");
      continue;
    }
    text += chunk.choices[0].text;
    if (chunk.choices[0].finish_reason !== null) {
      finishes++;
      if (!includeUsage) assert.ok(chunk.ragkv, "the finish event carries the report");
    }
  }
  assert.equal(finishes, 1);
  assert.ok(report.question.tokens > 0, "the report counts the question");
  assert.equal(text, c.choices[0].text);
  if (includeUsage) assert.equal(usage.completion_tokens, c.usage.completion_tokens);
  else assert.equal(usage, null);
}

step("chat with logprobs");
const chat = await client.chat.completions.create({
  model: OTHER,
  messages: [
    { role: "system", content: "You tell stories." },
    { role: "user", content: [{ type: "text", text: "Tell" }, { type: "text", text: "a story" }] },
  ],
  max_tokens: 8,
  temperature: 0,
  logprobs: true,
  top_logprobs: 2,
});
assert.ok(chat.id.startsWith("chatcmpl-"), chat.id);
assert.equal(chat.object, "chat.completion");
assert.equal(chat.model, SERVED);
assert.equal(chat.choices[0].message.role, "assistant");
assert.equal(typeof chat.choices[0].message.content, "string");
assert.equal(chat.choices[0].logprobs.content.length, chat.usage.completion_tokens);
for (const e of chat.choices[0].logprobs.content) checkChatLogprob(e, 2);

for (const includeUsage of [false, true]) {
  step(`chat stream, include_usage ${includeUsage}`);
  const stream = await client.chat.completions.create({
    model: SERVED,
    messages: [{ role: "user", content: "Tell a story" }],
    max_tokens: 8,
    temperature: 0,
    stream: true,
    logprobs: true,
    top_logprobs: 1,
    ...(includeUsage ? { stream_options: { include_usage: true } } : {}),
  });
  let text = "", role = null, finishes = 0, usage = null, entries = 0;
  for await (const chunk of stream) {
    assert.equal(chunk.object, "chat.completion.chunk");
    if (chunk.usage) usage = chunk.usage;
    if (chunk.choices.length === 0) {
      assert.ok(includeUsage && chunk.usage, "an event with empty choices, usage not asked");
      continue;
    }
    const ch = chunk.choices[0];
    if (ch.delta.role) role = ch.delta.role;
    if (ch.delta.content) text += ch.delta.content;
    if (ch.logprobs?.content) {
      for (const e of ch.logprobs.content) checkChatLogprob(e, 1);
      entries += ch.logprobs.content.length;
    }
    if (ch.finish_reason !== null) finishes++;
  }
  assert.equal(role, "assistant");
  assert.equal(finishes, 1);
  assert.ok(text.length > 0);
  if (includeUsage) {
    assert.equal(usage.completion_tokens, entries);
  } else {
    assert.equal(usage, null);
  }
}

step("chat stream through the SDK's accumulating helper");
const runner = client.chat.completions.stream({
  model: SERVED,
  messages: [{ role: "user", content: "Tell a story" }],
  max_tokens: 8,
  temperature: 0,
  stream_options: { include_usage: true },
});
let streamed = "";
runner.on("content", (delta) => (streamed += delta));
const final = await runner.finalChatCompletion();
assert.equal(final.choices[0].message.content, streamed);
assert.equal(final.choices[0].message.role, "assistant");
assert.ok(final.usage.completion_tokens >= 1);

step("context_length_exceeded as a BadRequestError");
try {
  await client.completions.create({
    model: SERVED,
    prompt: "Once upon a time there was a girl. ".repeat(40),
    max_tokens: 10,
  });
  assert.fail("an over-long prompt was accepted");
} catch (e) {
  assert.ok(e instanceof OpenAI.BadRequestError, `got ${e?.constructor?.name}: ${e}`);
  assert.equal(e.status, 400);
  assert.equal(e.code, "context_length_exceeded");
  assert.equal(e.param, "prompt");
  assert.equal(e.type, "invalid_request_error");
  assert.match(e.message, /context/);
}

step("max_tokens beyond the context as a BadRequestError");
try {
  await client.completions.create({ model: SERVED, prompt: "Once", max_tokens: 100000 });
  assert.fail("max_tokens beyond the context was accepted");
} catch (e) {
  assert.ok(e instanceof OpenAI.BadRequestError, `got ${e?.constructor?.name}: ${e}`);
  assert.equal(e.code, "context_length_exceeded");
  assert.equal(e.type, "invalid_request_error");
}

step("a field error names the field in param");
try {
  await client.completions.create({ model: SERVED, prompt: "Once", temperature: 500 });
  assert.fail("temperature 500 was accepted");
} catch (e) {
  assert.ok(e instanceof OpenAI.BadRequestError, `got ${e?.constructor?.name}: ${e}`);
  assert.equal(e.param, "temperature");
  assert.equal(e.code, null);
  assert.equal(e.type, "invalid_request_error");
}

console.log("ok: all checks passed");
