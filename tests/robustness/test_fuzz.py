"""A bounded, seeded fuzz of what cpumla reads from outside: mutated safetensors headers, configs and
--hf-overrides. Every case ends in a load or one CpumlaError line, never another exception, a crash or
a hang (each case has a time limit)."""

import contextlib
import json
import signal
import struct

import numpy as np

import cpumla
from cpumla.checkpoint.safetensors import SafetensorsFile
from cpumla.cli.overrides import parse_hf_overrides
from cpumla.errors import CpumlaError
from cpumla.models import config_from_dict, family
from cpumla.runtime.resolve import apply_overrides, preset_config

CASES = 150
SECONDS = 10          # per case


@contextlib.contextmanager
def time_limit(seconds=SECONDS):
    def fire(*_):
        raise TimeoutError(f"case took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def ends_well(fn):
    """Runs fn: success, or a one-line CpumlaError. Anything else fails the test."""
    with time_limit():
        try:
            return fn()
        except CpumlaError as e:
            assert str(e) and "\n" not in str(e), repr(str(e))
            return None


HOSTILE = [0, -1, 1, 2, 3, 7, 2**31, 2**63, -2**63, 10**30, 0.5, -0.0, 1e308, float("nan"), float("inf"),
           True, False, None, "", "x", "128", [], [0], [128, 128], [1, 2, 3], {}, {"type": "yarn"},
           {"a": {"b": {"c": [1]}}}, "[/]\n\x1b"]


def mutate_text(text: str, rng) -> str:
    s = list(text)
    for _ in range(int(rng.integers(1, 4))):
        op = int(rng.integers(0, 5))
        i = int(rng.integers(0, max(1, len(s))))
        if op == 0 and s:
            del s[i:i + int(rng.integers(1, 8))]
        elif op == 1:
            s.insert(i, rng.choice(list('{}[]:,"0123456789-.eE \\naxtfnul')))
        elif op == 2 and s:
            s[i] = rng.choice(list('{}[]:,"0189-eE x'))
        elif op == 3:
            s.insert(i, json.dumps(HOSTILE[int(rng.integers(0, len(HOSTILE)))]))
        else:
            s = s[:i]
    return "".join(s)


def _good_file(path):
    t = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones((2, 2), np.uint16)}
    header, data = {}, b""
    for name, arr in t.items():
        header[name] = {"dtype": "F32" if arr.dtype == np.float32 else "BF16", "shape": list(arr.shape),
                        "data_offsets": [len(data), len(data) + arr.nbytes]}
        data += arr.tobytes()
    header["__metadata__"] = {"format": "pt"}
    return json.dumps(header), data


def test_fuzz_safetensors_headers(tmp_path):
    rng = np.random.default_rng(1234)
    header, data = _good_file(tmp_path)
    doc = json.loads(header)
    f = tmp_path / "m.safetensors"
    for case in range(CASES):
        if case % 2:
            text = mutate_text(header, rng)
        else:                        # a structural mutation: one field of one entry set to something hostile
            d = json.loads(header)
            name = rng.choice(list(doc))
            key = rng.choice(list(d[name]) + ["extra"])
            d[name][key] = HOSTILE[int(rng.integers(0, len(HOSTILE)))]
            text = json.dumps(d)
        raw = text.encode("utf-8", "surrogatepass")
        pad = int(rng.integers(0, 3))
        body = data if case % 5 else data[: int(rng.integers(0, len(data)))]
        f.write_bytes(struct.pack("<Q", len(raw) + pad) + raw + b" " * pad + body)

        def read():
            with SafetensorsFile(f) as sf:
                for name in sf.keys():
                    arr = sf.tensor(name)
                    arr.sum()
        ends_well(read)


CONFIG_FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank",
                 "moe_intermediate_size", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                 "first_k_dense_replace", "moe_layer_freq", "topk_method", "n_group", "topk_group",
                 "norm_topk_prob", "routed_scaling_factor", "rope_theta", "rope_scaling", "max_position_embeddings",
                 "rms_norm_eps", "eos_token_id", "tie_word_embeddings", "quantization_config", "model_type",
                 "index_topk", "index_head_dim", "index_n_heads", "mlp_layer_types", "rope_parameters"]
SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32,
         "n_routed_experts": 4, "num_attention_heads": 2, "vocab_size": 256, "q_lora_rank": 32,
         "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2}
PRESETS = ["deepseek-ai/DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-V3.2"]


def test_fuzz_configs(monkeypatch):
    monkeypatch.setenv("CPUMLA_MEMORY_AVAILABLE", str(64 << 20))     # nothing big is ever built
    rng = np.random.default_rng(99)
    loaded = 0
    for case in range(CASES):
        cfg = {**preset_config(PRESETS[case % 3]), **SMALL}
        for _ in range(int(rng.integers(1, 3))):
            field = CONFIG_FIELDS[int(rng.integers(0, len(CONFIG_FIELDS)))]
            value = HOSTILE[int(rng.integers(0, len(HOSTILE)))]
            if field == "rope_scaling" and rng.integers(0, 2):
                rs = cfg.get("rope_scaling")
                value = {**(rs if isinstance(rs, dict) else {"type": "yarn"}),
                         rng.choice(["factor", "original_max_position_embeddings", "beta_fast", "mscale",
                                     "mscale_all_dim", "type"]): value}
            cfg[field] = value

        def build():
            c = config_from_dict(cfg)
            fam = family(c.model_type)
            b = fam.memory_bytes(c, 16, "bf16")
            assert all(isinstance(v, int) and v >= 0 for v in b.values())
            if case % 10 == 0:
                eng = cpumla.load(PRESETS[case % 3], dummy_weights=True, max_seq_len=16,
                                  hf_overrides={k: v for k, v in cfg.items() if k in preset_config(PRESETS[case % 3])})
                assert eng.forward([1, 2]).shape == (2, c.vocab_size)
            return True
        loaded += bool(ends_well(build))
    assert loaded > 0                        # the mutations leave some configs valid


def test_fuzz_hf_overrides(monkeypatch):
    monkeypatch.setenv("CPUMLA_MEMORY_AVAILABLE", str(64 << 20))
    rng = np.random.default_rng(7)
    base = json.dumps({"num_hidden_layers": 2, "hidden_size": 64, "n_routed_experts": 4,
                       "rope_scaling": {"factor": 4, "beta_fast": 32}, "rms_norm_eps": 1e-6})
    for case in range(CASES):
        text = mutate_text(base, rng)

        def load():
            ov = parse_hf_overrides(text)
            cfg = apply_overrides(preset_config("deepseek-ai/DeepSeek-V2-Lite"), ov)
            c = config_from_dict(cfg)
            family(c.model_type).memory_bytes(c, 16, "bf16")
        ends_well(load)
