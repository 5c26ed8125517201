"""DeepSeek-V2's bundled tokenizer (cpumla/chat/data/deepseek-v2, made by tools/bundle_v2_tokenizer.py):
llama.cpp's own expected encodings of its DeepSeek LLM vocabulary test texts, BOS / EOS ids, a two-turn
chat render and its ids (ids read from the vocabulary's token list), the bundled chat_template against
the built-in V2 format, the files as transformers reads them, the family's bundled tokenizer picked for
V2 presets (102400 ids, no vocab_size raised) and written by `cpumla quantize`."""

from __future__ import annotations

import json

import pytest

from cpumla.chat.chat_format import ChatFormat, Message, render_v2
from cpumla.chat.tokenizer import BUNDLED, Tokenizer, bundled_files, copy_bundled, load_tokenizer
from cpumla.errors import CpumlaError
from cpumla.runtime.resolve import PRESETS, resolve_model

from support.cli import run_cli

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
V2_PRESETS = ["deepseek-ai/DeepSeek-V2", "deepseek-ai/DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V2-Lite-Chat",
              "deepseek-ai/DeepSeek-V2.5"]
SMALL = {"num_hidden_layers": 1, "n_routed_experts": 4, "hidden_size": 256, "intermediate_size": 512,
         "moe_intermediate_size": 128}

# llama.cpp's models/ggml-vocab-deepseek-llm.gguf.inp and .out: texts and the ids they must encode to
LLAMA_CPP = [
    ('ied 4 ½ months', [1052, 207, 19, 207, 19109, 4223]),
    ('Äpfel', [82077, 26723, 282]),
    ('  ', [243]),
    ('\n\n', [185, 185]),
    ('\t\n', [184, 185]),
    ('Hello world', [17464, 1843]),
    (' Hello world', [37727, 1843]),
    ('Hello, world!', [17464, 11, 1843, 0]),
    (' Hello, world!', [37727, 11, 1843, 0]),
    (' this is 🦙.cpp', [437, 317, 12356, 99, 234, 13, 14743]),
    ('w048 7tuijk dsdfhu', [86, 15, 19, 23, 207, 22, 83, 3970, 27519, 26016, 3944, 14025]),
    ('нещо на Български', [1603, 6476, 620, 91754]),
    ('\U0001f680 (normal) \U0001f636\u200d\U0001f32b\ufe0f (multiple emojis concatenated) \u2705 (only emoji that has '
     'its own token)', [10044, 95300, 334, 8754, 8, 33701, 114, 350, 222, 10044, 221, 104, 46713, 334, 34732, 996,
                        24250, 262, 80923, 8, 207, 37103, 214, 334, 5956, 89213, 344, 643, 895, 1377, 10728, 8]),
    ('    Hello\n    Hello', [300, 37727, 185, 300, 37727]),
    ('\n =', [185, 403]),
    ("' era", [6, 2906]),
    ("Hello, y'all! How are you 😁 ?我想在apple工作1314151天～",
     [17464, 11, 320, 6, 436, 0, 1724, 418, 340, 33701, 210, 3025, 19017, 612, 9407, 2681, 16, 18, 16, 19, 16, 20, 16,
      1398, 68940, 239]),
    ('333333333', [18, 18, 18, 18, 18, 18, 18, 18, 18]),
    ('Cửa Việt', [34, 32555, 242, 64, 23708, 32555, 216, 83]),
    (' discards', [1763, 2550]),
]

# ids of the vocabulary's tokens (tokenizer.ggml.tokens of the same file): byte-level text -> id
PIECES = {"User": 5726, ":": 25, "Assistant": 77398, "\n": 185, "Be": 4677, " brief": 8749, ".": 13,
          " Hello": 37727, ",": 11, " world": 1843, "!": 0, " How": 1724, " are": 418, " you": 340, "?": 30}
CONV = [Message("system", "Be brief."), Message("user", "Hello, world!"), Message("assistant", "Hello"),
        Message("user", "How are you?")]
CONV_TEXT = (f"{B}Be brief.\n\nUser: Hello, world!\n\nAssistant: Hello{E}User: How are you?\n\nAssistant:")
CONV_IDS = [100000, 4677, 8749, 13, 185, 185, 5726, 25, 37727, 11, 1843, 0, 185, 185, 77398, 25, 37727, 100001,
            5726, 25, 1724, 418, 340, 30, 185, 185, 77398, 25]
# "Hello, world!" as a one-message chat: BOS User : ␣Hello , ␣world ! \n \n Assistant :
PROMPT_IDS = [100000, 5726, 25, 37727, 11, 1843, 0, 185, 185, 77398, 25]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.bundled("v2")


@pytest.mark.parametrize("text,ids", LLAMA_CPP, ids=range(len(LLAMA_CPP)))
def test_llama_cpp_encodings(tok, text, ids):
    assert tok.encode(text) == ids
    assert tok.decode(ids) == text


def test_vocabulary_and_special_ids(tok):
    assert tok.vocab_size == 102400 and tok.bundled and "V2" in tok.source
    assert tok.bos_token == B and tok.eos_token == E
    assert tok.token_id(B) == 100000 and tok.token_id(E) == 100001
    assert tok.token_id("[PAD102399]") == 102399 and tok.token_id("<｜User｜>") is None   # V3's tokens are not V2's
    assert tok.special_ids == {100000, 100001}
    assert tok.encode(f"{B}Hello world{E}") == [100000, 17464, 1843, 100001]
    assert tok.decode([100000, 17464, 1843, 100001], skip_special_tokens=True) == "Hello world"
    assert tok.split_added(f"{B}User: hi{E}") == [B, "User: hi", E]
    for piece, i in PIECES.items():
        assert tok.decode([i]) == piece


def test_two_turn_chat_render_and_ids(tok):
    fmt = ChatFormat("deepseek-v2", bos=tok.bos_token, eos=tok.eos_token)
    assert fmt.render(CONV) == CONV_TEXT
    assert tok.encode(CONV_TEXT) == CONV_IDS
    assert tok.encode(fmt.render([Message("user", "Hello, world!")])) == PROMPT_IDS
    assert [i for i in CONV_IDS if i in tok.special_ids] == [100000, 100001]


@pytest.mark.parametrize("conv,gen", [(CONV, True), (CONV, False), (CONV[1:3], False), (CONV[1:2], True), ([], True),
                                      ([Message("user", "a"), Message("system", "b"), Message("user", "c")], True)])
def test_bundled_chat_template_is_the_built_in_format(tok, conv, gen):
    """The chat_template in tokenizer_config.json (what a folder written by `cpumla quantize` renders)
    against chat_format.render_v2."""
    assert tok.chat_template
    jinja = ChatFormat("deepseek-v2", chat_template=tok.chat_template, bos=B, eos=E)
    assert jinja.render(conv, add_generation_prompt=gen) == render_v2(conv, add_generation_prompt=gen)


def test_copied_folder_as_transformers_reads_it(tmp_path, tok):
    copy_bundled("v2", tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    own = Tokenizer.from_dir(tmp_path)
    assert not own.bundled and own.vocab_size == 102400 and own.encode(CONV_TEXT) == CONV_IDS
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert (len(hf), hf.bos_token_id, hf.eos_token_id) == (102400, 100000, 100001)
    assert hf.encode("Hello world") == [100000, 17464, 1843]       # add_bos_token
    msgs = [{"role": m.role, "content": m.content} for m in CONV]
    text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == CONV_TEXT and hf.encode(text, add_special_tokens=False) == CONV_IDS


def test_bundled_files():
    json_gz, config = bundled_files("v2")
    assert json_gz.name == "tokenizer.json.gz" and json_gz.stat().st_size < 2_000_000
    assert json.loads(config.read_text(encoding="utf-8"))["bos_token"] == B
    assert BUNDLED == ("v2", "v3")
    with pytest.raises(CpumlaError, match="no bundled tokenizer 'v9'"):
        bundled_files("v9")


# ---- which bundled tokenizer a model gets ------------------------------------------------------------------
@pytest.mark.parametrize("model", V2_PRESETS)
def test_v2_presets_get_the_v2_tokenizer(model):
    for choice in (None, "bundled", "bundled-v2"):
        tok, notices = load_tokenizer(resolve_model(model), choice, True)
        assert (tok.vocab_size, tok.token_id(B), notices) == (102400, 100000, [])


def test_explicit_names_and_other_families():
    v3 = resolve_model("deepseek-ai/DeepSeek-V3")
    assert load_tokenizer(v3, None, True)[0].vocab_size == 129280
    assert load_tokenizer(v3, "bundled", True)[0].vocab_size == 129280
    assert load_tokenizer(v3, "bundled-v2", True)[0].vocab_size == 102400
    v2 = resolve_model("deepseek-ai/DeepSeek-V2-Lite")
    assert load_tokenizer(v2, "bundled-v3", True)[0].token_id(B) == 0
    with pytest.raises(CpumlaError, match="bundled-v2, bundled-v3"):
        load_tokenizer(v2, "bundled-v9", True)


def test_v2_directory_without_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text(PRESETS["deepseek-ai/DeepSeek-V2-Lite-Chat"].read_text())
    tok, notices = load_tokenizer(resolve_model(str(tmp_path)), None, True)
    assert tok.vocab_size == 102400 and notices == [f"{tmp_path} has no tokenizer.json; using the bundled "
                                                    f"DeepSeek V2 tokenizer"]


# ---- a V2 preset running with it ---------------------------------------------------------------------------
def test_v2_preset_runs_with_102400_ids():
    from cpumla.server.model import load_served

    served, notices = load_served("deepseek-ai/DeepSeek-V2-Lite-Chat", dummy_weights=True, hf_overrides=SMALL, ctx=64)
    try:
        assert not any("vocab_size" in n for n in notices), notices
        assert served.tok.vocab_size == 102400
        assert served.engine.forward(PROMPT_IDS).shape == (len(PROMPT_IDS), 102400)
    finally:
        served.engine.close()
    served, notices = load_served("deepseek-ai/DeepSeek-V2-Lite-Chat", dummy_weights=True, hf_overrides=SMALL, ctx=64,
                                  tokenizer="bundled-v3")
    served.engine.close()
    assert any("vocab_size raised from 102400 to 129280" in n for n in notices), notices


def test_cli_chat_on_a_v2_preset():
    p = run_cli("chat", "deepseek-ai/DeepSeek-V2-Lite-Chat", "--dummy-weights", "--hf-overrides", json.dumps(SMALL),
                "-p", "Hello, world!", "-n", "2", "--temperature", "0")
    assert p.returncode == 0, p.stderr
    assert "vocab_size" not in p.stderr and f"prompt {len(PROMPT_IDS)} tok" in p.stderr
