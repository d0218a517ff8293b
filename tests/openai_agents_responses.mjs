// tests/openai_agents_responses.mjs — the OpenAI Agents SDK for JavaScript
// (@openai/agents) against a running `ragkv serve` (RAGKV_URL, e.g.
// http://127.0.0.1:8080/v1) of a ChatML (Qwen3-shaped) model with random
// weights, served as "ragkv-test": an agent with one function tool that
// returns documents runs on POST /v1/responses to a final answer. The first
// turn is made to call the tool (toolChoice "required"); the SDK runs it,
// sends its output back as a function_call_output item and, with the tool
// choice reset, the model answers. Run by tests/test_responses.c; prints
// "ok: all checks passed" and exits 0, or throws at the first check that
// fails.
import assert from "node:assert/strict";
import OpenAI from "openai";
import {
  Agent,
  run,
  tool,
  setDefaultOpenAIClient,
  setOpenAIAPI,
  setTracingDisabled,
} from "@openai/agents";
import { z } from "zod";

setDefaultOpenAIClient(
  new OpenAI({ baseURL: process.env.RAGKV_URL, apiKey: "not-checked", maxRetries: 0 }),
);
setOpenAIAPI("responses");
setTracingDisabled(true);

const calls = [];
const search = tool({
  name: "search_documents",
  description: "Find documents about a topic.",
  parameters: z.object({ topic: z.string().max(16) }),
  execute: async ({ topic }) => {
    calls.push(topic);
    return JSON.stringify([
      { id: "doc-1", text: "A chunk keeps its KV cache between requests." },
      { id: "doc-2", text: `Keys are rotated to the new position (${topic}).` },
    ]);
  },
});

const agent = new Agent({
  name: "librarian",
  instructions: "Answer from the documents the search tool returns.",
  model: "ragkv-test",
  tools: [search],
  modelSettings: {
    toolChoice: "required",
    maxTokens: 40,
    temperature: 0.7,
    // Random weights seldom end an answer: a bias on <|im_end|> (Qwen3's
    // end of turn) lets the answer end within maxTokens (the Agents SDK takes
    // an incomplete response for a failed run). providerData goes into the
    // request body as it is.
    providerData: { logit_bias: { 151645: 8 }, seed: 3 },
  },
});

console.log("- an agent run with one function tool");
const result = await run(agent, "What does a chunk keep?", { maxTurns: 4 });
assert.equal(calls.length, 1, `the tool ran once: ${JSON.stringify(calls)}`);
assert.equal(typeof calls[0], "string");
assert.equal(typeof result.finalOutput, "string");
const kinds = result.newItems.map((i) => i.type);
assert.ok(kinds.includes("tool_call_item"), kinds.join(","));
assert.ok(kinds.includes("tool_call_output_item"), kinds.join(","));
assert.equal(kinds.at(-1), "message_output_item", kinds.join(","));
assert.equal(result.rawResponses.length, 2);
console.log(`  final output: ${JSON.stringify(result.finalOutput).slice(0, 80)}`);
console.log("ok: all checks passed");
