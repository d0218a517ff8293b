// tests/openai_sdk_embeddings.mjs — the official `openai` npm SDK (v6)'s
// embeddings.create against a running `ragkv serve` (RAGKV_URL) on an
// embedding model of width 128 (qwen3-embedding-tiny), served as
// "ragkv-test". Run by tests/test_openai.c; prints "ok: all checks passed"
// and exits 0, or throws (exit 1) at the first check that fails.
import assert from "node:assert/strict";
import OpenAI from "openai";

const client = new OpenAI({
  baseURL: process.env.RAGKV_URL,
  apiKey: "not-checked",
  maxRetries: 0,
  timeout: 60_000,
});
const SERVED = "ragkv-test";
const DIM = 128;
const input = ["Paris is the capital of France.", "KV caches hold keys and values."];

function step(name) {
  console.log(`- ${name}`);
}

function norm2(v) {
  return v.reduce((s, x) => s + x * x, 0);
}

step("float");
const f = await client.embeddings.create({ model: SERVED, input, encoding_format: "float" });
assert.equal(f.object, "list");
assert.equal(f.model, SERVED);
assert.equal(f.data.length, 2);
for (const [i, d] of f.data.entries()) {
  assert.equal(d.object, "embedding");
  assert.equal(d.index, i);
  assert.equal(d.embedding.length, DIM);
  assert.ok(Math.abs(norm2(d.embedding) - 1) < 1e-5);
}
assert.ok(f.usage.prompt_tokens > 4);
assert.equal(f.usage.total_tokens, f.usage.prompt_tokens);

step("base64, as the SDK asks by default and decodes");
const d = await client.embeddings.create({ model: SERVED, input });
for (const i of [0, 1]) {
  assert.equal(d.data[i].embedding.length, DIM);
  for (let k = 0; k < DIM; k++)
    assert.equal(Math.fround(d.data[i].embedding[k]), Math.fround(f.data[i].embedding[k]));
}

step("base64, asked for: the string the SDK leaves as it is");
const b = await client.embeddings.create({ model: SERVED, input: input[0], encoding_format: "base64" });
assert.equal(typeof b.data[0].embedding, "string");
const bytes = Buffer.from(b.data[0].embedding, "base64");
assert.equal(bytes.length, DIM * 4);
const floats = new Float32Array(bytes.buffer, bytes.byteOffset, DIM);
for (let k = 0; k < DIM; k++) assert.equal(floats[k], Math.fround(f.data[0].embedding[k]));

step("dimensions");
const c = await client.embeddings.create({ model: SERVED, input: input[0], dimensions: 32 });
assert.equal(c.data[0].embedding.length, 32);
assert.ok(Math.abs(norm2(c.data[0].embedding) - 1) < 1e-5);

step("errors");
await assert.rejects(
  client.embeddings.create({ model: SERVED, input: "", encoding_format: "float" }),
  (e) => e instanceof OpenAI.BadRequestError && e.status === 400,
);
await assert.rejects(
  client.embeddings.create({ model: SERVED, input: "x", dimensions: DIM + 1 }),
  (e) => e instanceof OpenAI.BadRequestError && /dimensions/.test(e.message),
);
await assert.rejects(
  client.completions.create({ model: SERVED, prompt: "hi", max_tokens: 2 }),
  (e) => e instanceof OpenAI.BadRequestError && /does not generate/.test(e.message),
);

console.log("ok: all checks passed");
