"""Writes the DeepSeek-V2 tokenizer cpumla bundles (cpumla/chat/data/deepseek-v2/) from a GGUF file of its
vocabulary:

    python3 tools/bundle_v2_tokenizer.py ggml-vocab-deepseek-llm.gguf [--out DIR]

The source is llama.cpp's vocabulary-only file of DeepSeek LLM (`models/ggml-vocab-deepseek-llm.gguf` in
llama.cpp's source tree, which the sdist of llama-cpp-python carries under `vendor/llama.cpp/`): the
vocabulary of DeepSeek LLM, which DeepSeek-V2 and V2-Lite and their chat models use. 102400 ids: a
byte-level BPE of 100000 tokens and 99757 merges, then BOS `<｜begin▁of▁sentence｜>` 100000 and EOS
`<｜end▁of▁sentence｜>` 100001 (control tokens), 13 user-defined tokens (the bytes that never occur in
UTF-8) and padding tokens `[PAD100015]` ... `[PAD102399]`; pre-tokenizer `deepseek-llm`.

It is read with cpumla's GGUF tokenizer reader (cpumla/chat/gguf_tokenizer.py) and written as:

  tokenizer.json.gz       the `tokenizers` tokenizer.json, compact, merges as "left right" strings (the form
                          every `tokenizers` release reads), a post-processor that puts BOS first when special
                          tokens are added (add_bos_token), gzip level 9 with no name or time in the header, so
                          the same input gives the same bytes
  tokenizer_config.json   BOS, EOS (also the padding token, as the GGUF file has it), add_bos_token, and
                          V2's chat template: {bos}{system}\\n\\nUser: {u}\\n\\nAssistant: {a}{eos}User: ...
                          \\n\\nAssistant: (the built-in deepseek-v2 format of cpumla/chat/chat_format.py)

When the file has llama.cpp's test texts beside it (FILE.inp, FILE.out: texts cut by lines
`__ggml_vocab_test__`, and one line of ids each), every text is encoded and compared first; the written
files are read back and compared again.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "cpumla" / "chat" / "data" / "deepseek-v2"
VOCAB = 102400
SEPARATOR = "\n__ggml_vocab_test__\n"

# V2's chat format: BOS, a system message followed by a blank line, "User: " turns followed by a blank line,
# "Assistant: " answers closed by EOS, and "Assistant:" to prompt the next answer
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def test_texts(gguf: Path) -> list[tuple[str, list[int]]]:
    """llama.cpp's (text, ids) pairs beside the file, or [] when it has none."""
    inp, out = Path(str(gguf) + ".inp"), Path(str(gguf) + ".out")
    if not (inp.is_file() and out.is_file()):
        return []
    texts = inp.read_text(encoding="utf-8").split(SEPARATOR)
    ids = out.read_text(encoding="utf-8").split("\n")
    if ids and ids[-1] == "" and len(ids) == len(texts) + 1:
        ids.pop()
    if len(texts) != len(ids):
        sys.exit(f"{inp}: {len(texts)} texts, {out}: {len(ids)} lines")
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, ids)]


def check(encode, cases, what: str) -> None:
    for text, want in cases:
        got = encode(text)
        if got != want:
            sys.exit(f"{what}: {text!r} encodes as {got}, llama.cpp's test says {want}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].rstrip(":"))
    ap.add_argument("gguf", type=Path, help="ggml-vocab-deepseek-llm.gguf")
    ap.add_argument("--out", type=Path, default=OUT, help=f"folder to write (default {OUT.relative_to(ROOT)})")
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT))
    from cpumla.errors import CpumlaError

    try:
        write(args.gguf, args.out)
    except CpumlaError as e:
        sys.exit(f"error: {e}")


def write(gguf: Path, out: Path) -> None:
    from cpumla.chat.gguf_tokenizer import from_gguf
    from cpumla.chat.tokenizer import Tokenizer
    from cpumla.checkpoint.gguf import GGUFFile
    from tokenizers import processors

    g = GGUFFile(gguf)
    if g.value("tokenizer.ggml.pre") != ("STRING", "deepseek-llm"):
        sys.exit(f"{gguf}: tokenizer.ggml.pre is {g.value('tokenizer.ggml.pre')}, not deepseek-llm")
    tk, config, _ = from_gguf(g)
    g.close()
    bos = config["bos_token"]          # encode(add_special_tokens=True) starts with BOS, as add_bos_token says
    tk.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                      special_tokens=[(bos, tk.token_to_id(bos))])
    if tk.get_vocab_size(with_added_tokens=True) != VOCAB:
        sys.exit(f"{gguf}: {tk.get_vocab_size(with_added_tokens=True)} tokens, not {VOCAB}")
    cases = test_texts(gguf)
    check(lambda t: tk.encode(t, add_special_tokens=False).ids, cases, str(gguf))

    data = json.loads(tk.to_str())
    data["model"]["merges"] = [" ".join(pair) for pair in data["model"]["merges"]]
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": config["bos_token"],
        "eos_token": config["eos_token"],
        "pad_token": config["pad_token"],
        "add_bos_token": config["add_bos_token"],
        "add_eos_token": config["add_eos_token"],
        "chat_template": CHAT_TEMPLATE,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json.gz").write_bytes(gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0))
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")

    tok = Tokenizer.from_files(out / "tokenizer.json.gz", out / "tokenizer_config.json", str(out))
    assert tok.vocab_size == VOCAB and tok.token_id(tok.bos_token) == 100000 and tok.token_id(tok.eos_token) == 100001
    check(tok.encode, cases, str(out))
    size = (out / "tokenizer.json.gz").stat().st_size
    print(f"wrote {out}: tokenizer.json.gz {size} bytes ({len(text.encode())} unpacked), tokenizer_config.json; "
          f"{len(cases)} of llama.cpp's test texts encode as its .out says")


if __name__ == "__main__":
    main()
