"""Moonlight's tokenizer (a tiktoken BPE file plus tokenizer_config.json's added tokens) and chat
format, offline: a small tiktoken file is written by the test."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import pytest

from support.cli import cli_env

pytest.importorskip("tiktoken")

from cpumla.chat.chat_format import ChatFormat, Message, detect_family, render_moonlight  # noqa: E402
from cpumla.chat.tiktoken_tokenizer import TiktokenTokenizer  # noqa: E402
from cpumla.chat.tokenizer import IncrementalDecoder  # noqa: E402
from cpumla.errors import CpumlaError  # noqa: E402

# Moonlight-16B-A3B-Instruct's chat_template (one line in its tokenizer_config.json)
TEMPLATE = ("{%- for message in messages -%}{%- if loop.first and messages[0]['role'] != 'system' -%}"
            "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>{%- endif -%}"
            "{%- if message['role'] == 'system' -%}<|im_system|>{%- endif -%}"
            "{%- if message['role'] == 'user' -%}<|im_user|>{%- endif -%}"
            "{%- if message['role'] == 'assistant' -%}<|im_assistant|>{%- endif -%}"
            "{{ message['role'] }}<|im_middle|>{{message['content']}}<|im_end|>{%- endfor -%}"
            "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")
SPECIAL = {163584: "[BOS]", 163585: "[EOS]", 163586: "<|im_end|>", 163587: "<|im_user|>",
           163588: "<|im_assistant|>", 163594: "<|im_system|>", 163601: "<|im_middle|>"}
MERGES = [b"He", b"ll", b"llo", b"Hello", b" w", b"or", b"ld", b" wor", b" world", b"\xe4\xbd", b"\xe4\xbd\xa0"]


def write_checkpoint_tokenizer(d, with_template=True):
    ranks = [bytes([b]) for b in range(256)] + MERGES
    (d / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    cfg = {"bos_token": "[BOS]", "eos_token": "[EOS]",
           "added_tokens_decoder": {str(i): {"content": c, "special": True} for i, c in SPECIAL.items()}}
    if with_template:
        cfg["chat_template"] = TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return ranks


def test_tiktoken_file_and_added_tokens(tmp_path):
    ranks = write_checkpoint_tokenizer(tmp_path)
    tok = TiktokenTokenizer.from_dir(tmp_path)
    assert tok.vocab_size == 163840 and tok.chat_template == TEMPLATE
    for i, c in SPECIAL.items():
        assert tok.token_id(c) == i and i in tok.special_ids
    assert tok.token_id("<|reserved_token_163590|>") == 163590         # ids the file leaves unnamed
    ids = tok.encode("<|im_user|>Hello world 你好<|im_end|>")
    assert ids[0] == 163587 and ids[-1] == 163586
    assert ranks.index(b"Hello") in ids and ranks.index(b" world") in ids
    assert tok.decode(ids) == "<|im_user|>Hello world 你好<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "Hello world 你好"
    dec = IncrementalDecoder(tok)                                       # a split character is held back
    shown = "".join(dec.push(i) for i in tok.encode("你好!"))
    assert shown == "你好!" and "\ufffd" not in shown
    assert tok.split_added("a<|im_end|>b") == ["a", "<|im_end|>", "b"]


def test_bad_tiktoken_files_are_one_line_errors(tmp_path):
    (tmp_path / "tiktoken.model").write_text("not base64 at all\n")
    with pytest.raises(CpumlaError, match="tiktoken"):
        TiktokenTokenizer.from_dir(tmp_path)
    write_checkpoint_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"]["5"] = {"content": "<x>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CpumlaError, match="overlaps the BPE ranks"):
        TiktokenTokenizer.from_dir(tmp_path)


CONVERSATIONS = [
    [Message("user", "Hello")],
    [Message("system", "Be brief."), Message("user", "Hi"), Message("assistant", "Hello!"), Message("user", "2+2?")],
    [Message("user", "a"), Message("assistant", "b"), Message("user", "c")],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_builtin_format_equals_the_checkpoint_template(messages):
    builtin = ChatFormat("moonlight").render(messages)
    assert builtin == ChatFormat("moonlight", chat_template=TEMPLATE).render(messages)
    assert builtin.endswith("<|im_assistant|>assistant<|im_middle|>")
    assert render_moonlight(messages, add_generation_prompt=False).endswith("<|im_end|>")


def test_family_detection():
    assert detect_family("deepseek_v3", "moonshotai/Moonlight-16B-A3B-Instruct") == "moonlight"
    assert detect_family("deepseek_v3", "some/dir", TEMPLATE) == "moonlight"
    assert detect_family("deepseek_v3", "deepseek-ai/DeepSeek-V3") == "deepseek-v3"
    assert "<|im_end|>" in ChatFormat("moonlight").stop_strings


SHRINK = {"num_hidden_layers": 1, "hidden_size": 128, "n_routed_experts": 8, "first_k_dense_replace": 1,
          "num_attention_heads": 2, "moe_intermediate_size": 64, "intermediate_size": 256}


def test_chat_on_a_moonlight_checkpoint_uses_its_tokenizer_and_template(tmp_path):
    from cpumla.runtime.resolve import PRESETS

    cfg = json.loads(PRESETS["moonshotai/Moonlight-16B-A3B-Instruct"].read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **SHRINK}))
    write_checkpoint_tokenizer(tmp_path)
    p = subprocess.run([sys.executable, "-m", "cpumla", "chat", str(tmp_path), "--dummy-weights", "-p", "Hello world",
                        "-n", "3", "--temperature", "0"], capture_output=True, env=cli_env(), timeout=120)
    err = p.stderr.decode()
    assert p.returncode == 0, err
    tok = TiktokenTokenizer.from_dir(tmp_path)
    want = len(tok.encode(ChatFormat("moonlight", chat_template=TEMPLATE).render([Message("user", "Hello world")])))
    assert f"prompt {want} tok" in err


def test_moonlight_preset_uses_the_synthetic_stand_in():
    from cpumla.chat.tokenizer import load_tokenizer
    from cpumla.runtime.resolve import resolve_model

    tok, notices = load_tokenizer(resolve_model("moonshotai/Moonlight-16B-A3B"), None, True)
    assert isinstance(tok, TiktokenTokenizer) and tok.vocab_size == 163840 and "synthetic" in tok.source
    assert tok.token_id("<|im_end|>") == 163586 and tok.decode(tok.encode("Hi there!")) == "Hi there!"
