#!/usr/bin/python3
"""trn-generate --chat's prompts against the real chat templates, rendered by jinja2 (system interpreter).

check DIR --trn-generate BIN --workdir W
    DIR is a Hugging Face directory whose tokenizer_config.json holds a real chat_template. Each of
    CONVERSATIONS (system or not, multi-turn, unicode, white space Python's str.strip() removes,
    empty strings, with and without add_generation_prompt) is rendered as transformers'
    apply_chat_template(messages, tokenize=False, add_generation_prompt=...) renders it (the same
    jinja2 environment and variables), and compared byte for byte with
        trn-generate --init-hf DIR --chat --messages M.json [--no-generation-prompt] --print-prompt
    and, for the conversations --system and --prompt can spell, with those flags instead of a file.
    Prints each mismatch; exits 1 on any.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

S, U, A = "system", "user", "assistant"

# (messages, add_generation_prompt)
CONVERSATIONS = [
    ([(U, "Hello!")], True),
    ([(S, "You are a terse assistant."), (U, "What is 2+2?")], True),
    ([(U, "Hi"), (A, "Hello! How can I help?"), (U, "Tell me a joke.")], True),
    ([(S, "Answer in French."), (U, "Good morning"), (A, "Bonjour"), (U, "Thank you")], True),
    ([(U, "Grüße, 世界! 🙂 ¿Qué tal? Ελληνικά, русский, हिन्दी")], True),
    ([(U, "")], True),
    ([(S, ""), (U, "An empty system message.")], True),
    ([(U, "  spaced out \n\n")], True),
    ([(S, "\u3000full-width space\u00a0"), (U, "\u2028line separator\u2029 and \x1fseparators\x1c")], True),
    ([(U, "line one\nline two\n\n\tindented")], True),
    ([(U, "Literal <|im_start|>user and <|eot_id|>, {{ braces }}, {% tags %}, 'single' \"double\"")], True),
    ([(U, "What is the capital of France?"), (A, "Paris.")], False),
    ([(S, "Only a system message.")], True),
    ([(U, "1"), (A, "2"), (U, "3"), (A, "4"), (U, "5"), (A, "6"), (U, "7")], True),
    ([(U, "First question"), (A, "First answer"), (S, "A later system message."), (U, "Second question")], True),
    ([(U, "C:\\path\\to\\file and a\\nnot-newline")], True),
    ([(U, "Say nothing"), (A, ""), (U, "Now say something")], True),
    ([(S, "Be brief."), (U, "A finished turn without the generation prompt")], False),
    ([(U, "שלום עולם, مرحبا, e\u0301 (combining), 👩\u200d💻 (ZWJ)")], True),
    ([(S, " \t padded system \t "), (U, " padded user "), (A, " padded answer "), (U, "\n")], False),
]


def special_tokens(config):
    """tokenizer_config.json's special tokens, as transformers passes them to the template."""
    out = {}
    for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        v = config.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[key] = v
    if config.get("additional_special_tokens"):
        out["additional_special_tokens"] = config["additional_special_tokens"]
    return out


def environment():
    """transformers' template environment (chat_template_utils._compile_jinja_template)."""
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def render(config, messages, add_generation_prompt):
    template = config["chat_template"]
    if isinstance(template, list):
        template = next(t["template"] for t in template if t["name"] == "default")
    return environment().from_string(template).render(
        messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
        **special_tokens(config))


def check(a):
    with open(os.path.join(a.dir, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    os.makedirs(a.workdir, exist_ok=True)
    failures, runs = 0, 0
    for i, (turns, agp) in enumerate(CONVERSATIONS):
        messages = [{"role": r, "content": c} for r, c in turns]
        want = render(config, messages, agp)
        path = os.path.join(a.workdir, f"conversation-{i:02d}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(messages, f, ensure_ascii=False)
        tail = [] if agp else ["--no-generation-prompt"]
        spellings = [["--messages", path]]
        # --system TEXT and --prompt TEXT spell [system,] user; a NUL-free argv carries any text.
        roles = [r for r, _ in turns]
        if roles in ([U], [S, U]):
            flags = ["--prompt", turns[-1][1]]
            if roles[0] == S:
                flags = ["--system", turns[0][1]] + flags
            spellings.append(flags)
        for spelling in spellings:
            cmd = [a.trn_generate, "--init-hf", a.dir, "--chat"] + spelling + tail + ["--print-prompt"]
            run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
            runs += 1
            got = run.stdout.decode("utf-8", errors="replace")
            if run.returncode != 0 or got != want:
                failures += 1
                print(f"FAIL conversation {i} ({' '.join(spelling[:1])}, add_generation_prompt={agp}): "
                      f"exit {run.returncode} {run.stderr.decode(errors='replace').strip()}")
                print(f"  jinja2:       {want!r}")
                print(f"  trn-generate: {got!r}")
    print(f"{len(CONVERSATIONS)} conversations, {runs} trn-generate runs, {failures} mismatches "
          f"({os.path.join(a.dir, 'tokenizer_config.json')})")
    print("PASS" if failures == 0 else "FAIL")
    return 0 if failures == 0 else 1


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("check")
    c.add_argument("dir")
    c.add_argument("--trn-generate", default="trn-generate")
    c.add_argument("--workdir", required=True)
    a = p.parse_args()
    sys.exit(check(a))


if __name__ == "__main__":
    main()
