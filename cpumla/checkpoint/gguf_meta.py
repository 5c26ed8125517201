"""Typed reads of a GGUF file's metadata (checkpoint/gguf.py's GGUFFile), and the config keys every
DeepSeek arch shares: each key read as the kind asked for, or one CpumlaError line naming the file and
the key. Keys may name the architecture as `{arch}.` (general.architecture)."""

from __future__ import annotations

from cpumla.checkpoint.gguf import GGUFFile
from cpumla.errors import CpumlaError

INTS = ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64")
FLOATS = ("FLOAT32", "FLOAT64") + INTS
KINDS = {"int": INTS, "float": FLOATS, "bool": ("BOOL",), "str": ("STRING",),
         "ints": tuple(f"ARRAY[{t}]" for t in INTS), "floats": tuple(f"ARRAY[{t}]" for t in FLOATS),
         "strs": ("ARRAY[STRING]",)}
WANT = {"int": "an integer", "float": "a number", "bool": "a boolean", "str": "a string",
        "ints": "an array of integers", "floats": "an array of numbers", "strs": "an array of strings"}
ARCHES = ("deepseek2", "deepseek32", "deepseek4")


class Metadata:
    """Typed reads of a GGUF file's metadata: one CpumlaError line naming the file and the key."""

    def __init__(self, g: GGUFFile, any_arch: bool = False):
        """any_arch: read keys that do not name the architecture (the tokenizer's) of any file."""
        self.g, self.file = g, g.files[0]
        if any_arch:
            return
        arch = self.get("general.architecture", "str")
        if arch not in ARCHES:
            known = ", ".join(ARCHES)
            raise CpumlaError(f"{self.file}: architecture '{arch}' is not one cpumla reads from GGUF ({known})")
        self.arch = arch

    def key(self, key: str) -> str:
        return key.format(arch=getattr(self, "arch", ""))

    def get(self, key: str, kind: str, default=KeyError):
        key = self.key(key)
        got = self.g.value(key)
        if got is None:
            if default is KeyError:
                raise CpumlaError(f"{self.file}: metadata key '{key}' is missing")
            return default
        t, v = got
        if t not in KINDS[kind]:
            raise CpumlaError(f"{self.file}: metadata key '{key}' is {t}, want {WANT[kind]}")
        if kind == "floats":
            return [float(x) for x in v]
        return float(v) if kind == "float" else v

    def fail(self, key: str, why: str):
        raise CpumlaError(f"{self.file}: metadata key '{self.key(key)}' {why}")

def common(m: Metadata, g: GGUFFile) -> dict:
    """The keys every arch has: vocabulary, width, layers (NextN blocks left out), eps, context, token ids."""
    a = "{arch}."
    blocks = m.get(a + "block_count", "int")
    nextn = m.get(a + "nextn_predict_layers", "int", 0)
    if not 0 <= nextn < blocks:
        m.fail(a + "nextn_predict_layers", f"is {nextn}, not from 0 to below block_count {blocks}")
    vocab = m.get(a + "vocab_size", "int", None)
    if vocab is None:
        embd = g.entries.get("token_embd.weight")
        if embd is None:
            raise CpumlaError(f"{m.file}: has no tensor 'token_embd.weight' and no metadata key '{m.arch}.vocab_size'")
        vocab = embd.shape[0]
    return {
        "vocab_size": vocab, "hidden_size": m.get(a + "embedding_length", "int"),
        "num_hidden_layers": blocks - nextn, "num_nextn_predict_layers": nextn,
        "num_attention_heads": m.get(a + "attention.head_count", "int"),
        "max_position_embeddings": m.get(a + "context_length", "int"),
        "rms_norm_eps": m.get(a + "attention.layer_norm_rms_epsilon", "float"),
        "bos_token_id": m.get("tokenizer.ggml.bos_token_id", "int", None),
        "eos_token_id": m.get("tokenizer.ggml.eos_token_id", "int", None),
    }


def yarn(m: Metadata) -> dict | None:
    """rope_scaling from rope.scaling.*: YaRN's factor, original context and betas, or None."""
    a = "{arch}."
    kind = m.get(a + "rope.scaling.type", "str", "none")
    if kind == "none":
        return None
    if kind != "yarn":
        m.fail(a + "rope.scaling.type", f"is '{kind}'; cpumla takes yarn or none")
    return {"type": "yarn", "factor": m.get(a + "rope.scaling.factor", "float"),
            "original_max_position_embeddings": m.get(a + "rope.scaling.original_context_length", "int"),
            "beta_fast": m.get(a + "rope.scaling.yarn_beta_fast", "float", 32.0),
            "beta_slow": m.get(a + "rope.scaling.yarn_beta_slow", "float", 1.0)}
