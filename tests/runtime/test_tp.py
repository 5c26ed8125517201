"""Tensor-parallel ranks (runtime/tp.py) against one process: 2 and 4 local ranks of every family
(V2-Lite, V3 and V4 and their MTP layers, V3.2; a GGUF file), fp32 logits within 1e-5 of max |logit| in
prefill and decode, over shared memory and over gloo; bf16 / FP8 / q4 ranks as close to the fp32
reference as one process of the same format; and the faults: a rank killed, hung, started with
another model, an N that splits a block, rank 0 killed or interrupted. Each ends every rank with one
line and leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import cpumla
from cpumla.errors import CpumlaError

from support import models
from support.models import IDS

WIDE = dict(qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, moe_intermediate_size=64,
            intermediate_size=128)      # every split a whole number of 32-blocks at 2 ranks (q4, FP8 32x32)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, v2_lite_dir):
    d = {"v2-lite": v2_lite_dir}
    for name in ("v3", "v32", "wide", "wide-bf16"):
        d[name] = tmp_path_factory.mktemp(name)
    models.build("v3", d["v3"])
    models.build_v32(d["v32"])
    kw = {**models.BASE, **models.VARIANTS["v3"][1], **WIDE}
    models.build_from_kwargs("deepseek_v3", kw, d["wide"])
    models.build_from_kwargs("deepseek_v3", kw, d["wide-bf16"], dtype=torch.bfloat16)
    d["wide-fp8"] = tmp_path_factory.mktemp("wide-fp8")
    models.quantize_fp8(d["wide"], d["wide-fp8"], block=(32, 32))
    d["fp8-128"] = tmp_path_factory.mktemp("fp8-128")
    models.quantize_fp8(d["v3"], d["fp8-128"])
    d["v4"] = tmp_path_factory.mktemp("v4")
    models.build_v4(d["v4"], o_groups=4)             # four output groups: 1, 2 or 4 ranks
    return d


LONG = [(7 * i + 3) % 160 for i in range(40)]        # V4: across several compressed windows


def logits(eng) -> np.ndarray:
    """A prefill of the first 8 ids, then 4 decode steps: their logits (V4: of 40 ids, then a truncate
    back into the rings and 2 more)."""
    eng.reset()
    if eng.config.model_type == "deepseek_v4":
        out = [eng.forward(LONG[:36])] + [eng.forward([t]) for t in LONG[36:]]
        eng.truncate(30)
        return np.concatenate(out + [eng.forward([5, 9])])
    return np.concatenate([eng.forward(IDS[:8])] + [eng.forward([t]) for t in IDS[8:]])


def run(path, tp=None, **kw):
    eng = cpumla.load(str(path), tp=tp, draft="none", **kw)
    try:
        return logits(eng)
    finally:
        eng.close()


def our_children() -> list[int]:
    """Live (not zombie) processes this one started as ranks."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
            cmd = (p / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"cpumla.runtime.tp_rank" in cmd:
            out.append(int(p.name))
    return out


@pytest.mark.parametrize("variant", ["v2-lite", "v3", "v32", "v4"])
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_compute_what_one_process_does(dirs, variant, world):
    one = run(dirs[variant])
    got = run(dirs[variant], tp=world)
    err = np.abs(got - one).max()
    assert err <= 1e-5 * np.abs(one).max(), (err, np.abs(one).max())
    assert not our_children()


@pytest.mark.parametrize("family", ["v3", "v4"])
def test_the_mtp_layer_and_drafting_under_ranks(dirs, tmp_path, family):
    (models.build_v4_mtp if family == "v4" else models.build_v3_mtp)(tmp_path)   # saved with its MTP layer
    res = []
    for tp in (None, 2):
        eng = cpumla.load(str(tmp_path), tp=tp, draft="none")
        m, n, w = eng.model, len(IDS), eng.model.mtp_width
        ids = np.asarray(IDS, np.int64)
        out, hid = np.empty((n, eng.config.vocab_size), np.float32), np.empty((n, w), np.float32)
        m.forward_hidden(ids, 0, out, False, hid)
        mo, ho = np.empty((n - 1, eng.config.vocab_size), np.float32), np.empty((n - 1, w), np.float32)
        m.mtp_forward(ids[1:], 0, hid[:-1], mo, False, ho)
        eng.set_draft("mtp", 2, 0.0)                   # every draft proposed, verified by the ranks
        eng.reset()
        text = list(eng.generate(IDS, 10, stop_ids=[]))
        eng.close()
        res.append((out, mo, ho, text))
    for a, b in zip(res[0][:3], res[1][:3]):
        assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()
    assert res[0][3] == res[1][3]


def test_a_gguf_file_runs_on_ranks(dirs, tmp_path):
    from support import gguf_files

    pytest.importorskip("gguf")
    path = tmp_path / "v3.gguf"
    gguf_files.write(models.build("v3", tmp_path / "hf"), path, "F32", split_kv_b=True)   # k_b / v_b apart
    one = run(path)
    assert np.abs(run(path, tp=2) - one).max() <= 1e-5 * np.abs(one).max()


def test_rank_0_gets_its_cpus_and_threads_back_and_refuses_settings(dirs):
    from cpumla import native

    native.ensure_init()
    cpus, threads = os.sched_getaffinity(0), native.get_threads()
    eng = cpumla.load(str(dirs["v3"]), tp=2, draft="none")
    assert len(os.sched_getaffinity(0)) == max(1, len(cpus) // 2) and native.get_threads() == len(os.sched_getaffinity(0))
    with pytest.raises(CpumlaError, match="each run a model of their own"):
        eng.model.mha_min_tokens = 3                   # would change rank 0's model alone
    eng.close()
    assert os.sched_getaffinity(0) == cpus and native.get_threads() == threads


def test_smoke_widens_its_experts_for_the_ranks():
    from cpumla.cli.smoke import default_overrides

    assert default_overrides("deepseek-ai/DeepSeek-V4-Flash", {}, 4)["moe_intermediate_size"] == 512
    assert default_overrides("deepseek-ai/DeepSeek-V4-Flash", {})["moe_intermediate_size"] == 128


def test_gloo_between_ranks_computes_the_same(dirs, monkeypatch):
    monkeypatch.setenv("CPUMLA_TP_COMM", "gloo")        # what ranks on several machines talk over
    one = run(dirs["v3"])
    got = run(dirs["v3"], tp=2)
    assert np.abs(got - one).max() <= 1e-5 * np.abs(one).max()


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "q4"])
def test_ranks_of_a_rounded_format_are_as_close_to_fp32_as_one_process(dirs, fmt):
    ref = run(dirs["wide"])
    path, kw = {"bf16": (dirs["wide-bf16"], {}), "fp8": (dirs["wide-fp8"], {}), "q4": (dirs["wide"], {"quant": "q4"})}[fmt]
    one, got = run(path, **kw), run(path, tp=2, **kw)
    e_one, e_got = np.abs(one - ref).max(), np.abs(got - ref).max()
    assert e_one > 0
    assert e_got <= 1.25 * e_one, (e_got, e_one)
    assert (got.argmax(-1) == one.argmax(-1)).mean() >= 0.9


def test_an_n_that_splits_a_block_is_refused_naming_the_tensor(dirs):
    with pytest.raises(CpumlaError) as e:
        cpumla.load(str(dirs["fp8-128"]), tp=2)
    assert str(e.value).startswith("--tp 2: model.layers.0.self_attn.q_b_proj.weight: rows 0..")
    assert "cut through its 128x128 e4m3 blocks" in str(e.value)
    with pytest.raises(CpumlaError) as e:
        cpumla.load(str(dirs["v3"]), tp=3)
    assert str(e.value) == "--tp 3: attention heads (4) do not split into 3 equal parts"
    assert not our_children()


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_a_rank_that_dies_or_hangs_ends_every_rank_with_one_line(dirs, monkeypatch, how):
    monkeypatch.setenv("CPUMLA_TP_TIMEOUT", "2")
    eng = cpumla.load(str(dirs["v3"]), tp=4, draft="none")
    eng.forward(IDS[:4])
    victim = eng.ranks.children[1]                   # rank 2
    os.kill(victim.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    t = time.perf_counter()
    with pytest.raises(CpumlaError) as e:
        eng.forward([5])
    why = "exited" if how == "kill" else "did not answer within 2 s"
    assert str(e.value) == f"tensor-parallel rank 2 (pid {victim.pid}) {why}"
    assert time.perf_counter() - t < 10
    if how == "hang":
        os.kill(victim.pid, signal.SIGCONT)
    with pytest.raises(CpumlaError):                 # the ranks are gone: nothing more runs
        eng.forward([6])
    kids = list(eng.ranks.children)
    eng.close()
    codes = [p.wait(timeout=20) for p in kids]
    assert len(codes) == 3 and all(c != 0 for c in codes), codes       # every rank ended as failed
    assert not our_children()


def cli(*args, env=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "cpumla", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)


def test_ranks_of_another_model_refuse_with_one_line_each(dirs):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}     # as torchrun sets
    other = subprocess.Popen([sys.executable, "-m", "cpumla", "smoke", "-m", str(dirs["v32"])], env={**os.environ, **env,
                             "RANK": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    r0 = cli("smoke", "-m", str(dirs["v3"]), env={**env, "RANK": "0"})
    out1, err1 = other.communicate(timeout=120)
    for rc, err in ((r0.returncode, r0.stderr), (other.returncode, err1)):
        assert rc != 0
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "tensor-parallel rank 1 runs another model" in lines[0], err


@pytest.mark.parametrize("env, line", [
    ({"WORLD_SIZE": "x"}, "error: WORLD_SIZE must be an integer, got 'x'"),
    ({"WORLD_SIZE": "2", "RANK": "y"}, "error: RANK must be an integer, got 'y'"),
    ({"WORLD_SIZE": "2", "RANK": "5"}, "error: RANK 5 is not one of the 2 ranks of this launch (WORLD_SIZE)"),
    ({"CPUMLA_TP": "two"}, "error: CPUMLA_TP must be a number of ranks, got 'two'"),
    ({"CPUMLA_TP": "99"}, "error: tp must be a number of ranks from 1 to 64, got 99"),
])
def test_a_bad_launch_environment_is_one_line(dirs, env, line):
    r = cli("smoke", "-m", str(dirs["v3"]), env=env, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == line, (r.returncode, r.stderr)


def leader(path, code: str) -> subprocess.Popen:
    """A rank 0 of --tp 2 in a process group of its own (as a terminal's foreground job): prints its
    child's pid, then runs code."""
    src = (f"import cpumla, sys, time\neng = cpumla.load({str(path)!r}, tp=2, draft='none')\n"
           f"eng.forward([1, 2, 3])\nprint(eng.ranks.children[0].pid, flush=True)\n{code}\n")

    def terminal():
        os.setsid()
        signal.signal(signal.SIGINT, signal.SIG_DFL)    # even where this test runs with it ignored
    return subprocess.Popen([sys.executable, "-c", src], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=terminal)


def gone(pid: int, within: float) -> bool:
    end = time.time() + within
    while time.time() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        if state[state.rindex(")") + 2] in "ZX":
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_rank_0_killed_or_interrupted_stops_every_rank(dirs, sig):
    p = leader(dirs["v3"], "time.sleep(60)")
    child = int(p.stdout.readline())
    p.send_signal(sig)
    p.wait(timeout=30)
    assert gone(child, 10)


def test_ctrl_c_at_the_terminal_is_rank_0s_to_handle(dirs):
    """Ctrl-C reaches the terminal's foreground process group: rank 0 (chat stops the answer and goes on),
    not the ranks it started, which go on serving it."""
    p = leader(dirs["v3"], "try:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    pass\n"
                           "print(eng.forward([4]).shape, flush=True)\neng.close()")
    child = int(p.stdout.readline())
    time.sleep(0.5)
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and out.strip() == "(1, 160)", err
    assert gone(child, 10)


def test_chat_greedy_text_is_the_same_on_ranks():
    ov = ('{"num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 8, "hidden_size": 256, '
          '"num_attention_heads": 4, "moe_intermediate_size": 128, "intermediate_size": 512, "q_lora_rank": 64, '
          '"kv_lora_rank": 64}')
    outs = []
    for tp in ("1", "2"):
        r = cli("chat", "deepseek-ai/DeepSeek-V3", "--dummy-weights", "--hf-overrides", ov, "-p", "Hello there",
                "--temperature", "0", "--max-tokens", "16", "--tp", tp)
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout)
    assert outs[0] == outs[1] and outs[0].strip()


def test_info_and_bench_show_the_ranks(dirs):
    import json

    r = cli("info", "deepseek-ai/DeepSeek-V3", "--tp", "4", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    whole, rank = d["weights"]["stored"], d["per_rank"]["weights"]["stored"]
    assert whole / 4 < rank < whole / 3            # most of V3 splits four ways; q_a, kv_a, norms, router do not
    assert d["per_rank"]["weights"]["stored"] == round(whole - d["split"]["stored"] * 3 / 4)
    r = cli("bench", str(dirs["v3"]), "-p", "8", "-n", "4", "-r", "1", "--tp", "2")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("tensor parallel:"))
    assert "2 ranks over shared memory" in line and "p50" in line and "p99" in line
