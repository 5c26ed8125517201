"""Speculative decoding (runtime/speculative.py): the MTP layer against a reference written from the
spec with transformers' classes, and decoding with drafts against decoding without: the same greedy
text, the same sampled text for a seed, the same distribution, the caches rolled back to exactly the
tokens kept (V4's compressor state included)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

import cpumla
from cpumla.errors import CpumlaError
from cpumla.runtime import speculative

from support import models
from support.models import IDS, check_fp32


@pytest.fixture(scope="module", params=["v3", "v32", "v4"])
def v3_mtp(request, tmp_path_factory):
    """V3, V3.2 (whose MTP layer has an indexer of its own) and V4 (whose takes the residual streams)
    with their MTP layers."""
    d = tmp_path_factory.mktemp(f"{request.param}-mtp")
    if request.param == "v4":
        return d, models.build_v4_mtp(d)
    return d, models.build_v3_mtp(d, v32=request.param == "v32")


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    d = tmp_path_factory.mktemp("v4")
    models.build_v4(d)
    return d


class Oracle:
    """A drafter that knows the answer: proposes the continuation `truth` after the tokens so far, with
    the token at every `wrong`-th answer position replaced (a rejection there)."""

    def __init__(self, eng, prompt_len: int, truth: list[int], wrong: int = 0):
        self.eng, self.n0, self.truth, self.wrong = eng, prompt_len, truth, wrong

    def draft(self, tok: int, k: int) -> list[int]:
        i = len(self.eng.tokens) + 1 - self.n0          # answer tokens known, tok included
        out = list(self.truth[i:i + k])
        for j in range(len(out)):
            if self.wrong and (i + j) % self.wrong == 0:
                out[j] = (out[j] + 1) % self.eng.config.vocab_size
        return out


def generate(eng, n, **kw):
    """n tokens after IDS, from an empty cache."""
    eng.reset()
    return list(eng.generate(IDS, n, stop_ids=[], **kw))


def test_mtp_layer_matches_the_spec(v3_mtp):
    d, ref = v3_mtp
    eng = cpumla.load(str(d))
    assert eng.has_mtp and eng.draft == "mtp"          # on by default where the checkpoint has the layer
    m, D, V = eng.model, eng.model.mtp_width, eng.config.vocab_size
    ids = np.asarray(IDS, np.int64)
    nxt = np.asarray(IDS[1:] + [9], np.int64)
    h, logits = np.empty((len(ids), D), np.float32), np.empty((len(ids), V), np.float32)
    m.forward_hidden(ids, 0, logits, False, h)
    h_ref = ref.hidden(IDS)
    check_fp32(h, h_ref.numpy())
    want = ref.logits(h_ref, nxt.tolist())
    got, h_all = np.empty((len(ids), V), np.float32), np.empty((len(ids), D), np.float32)
    m.mtp_forward(nxt, 0, h, got, False, h_all)
    check_fp32(got, want)
    # the last position's alone (a draft: the others only write their entries) is the full pass's last
    one, h_one = np.empty((1, V), np.float32), np.empty((1, D), np.float32)
    m.mtp_forward(nxt, 0, h, one, True, h_one)
    check_fp32(one, want[-1:])
    check_fp32(h_one, h_all[-1:])
    with pytest.raises(CpumlaError, match="hidden_out must hold"):        # a buffer too small for the rows
        m.mtp_forward(nxt, 0, h, got, False, h_one)
    # the same entries written in pieces (a prefill, then one position at a time) give the same logits
    parts = [np.empty((1, V), np.float32) for _ in range(len(ids) - 5)]
    m.mtp_forward(nxt[:5], 0, h[:5], None, True)
    for t in range(5, len(ids)):
        m.mtp_forward(nxt[t:t + 1], t, h[t:t + 1], parts[t - 5], True)
    check_fp32(np.concatenate(parts), want[5:])


def test_mtp_entries_follow_the_cache(v3_mtp):
    """After decoding with drafts (rejections, rollbacks, chained drafts), the MTP layer's next draft is
    the one a fresh reference pass over the whole sequence gives."""
    d, ref = v3_mtp
    eng = cpumla.load(str(d))
    eng.set_draft("mtp", 3, p_min=0.0)
    seq = IDS + generate(eng, 17)                      # the last token is forwarded too
    assert eng.tokens == seq
    want = ref.logits(ref.hidden(seq), seq[1:] + [5])[-1]
    assert eng.drafter.draft(5, 1) == [int(np.argmax(want))]


def test_mtp_long_prefill_is_written_in_chunks(v3_mtp):
    d, ref = v3_mtp
    eng = cpumla.load(str(d), max_seq_len=1024)
    eng.set_draft("mtp", 1, p_min=0.0)
    prompt = (IDS * 60)[:700]                          # above the 512-token prefill chunk
    eng.forward(prompt, last_only=True)
    assert eng.drafter.done == 699 and len(eng.drafter.rows) == 1
    want = ref.logits(ref.hidden(prompt), prompt[1:] + [5])[-1]
    assert eng.drafter.draft(5, 1) == [int(np.argmax(want))]


def test_v4_mtp_output_streams_and_restart(tmp_path):
    """V4's MTP layer hands on its output streams (what a chained draft takes) as the spec computes
    them; after a rollback deeper than its window ring holds, its window starts again where the
    entries start: its draft is the reference's over the pairs from there on (attention sees relative
    positions only)."""
    ref = models.build_v4_mtp(tmp_path)
    eng = cpumla.load(str(tmp_path), max_seq_len=1024)
    m, V, W = eng.model, eng.config.vocab_size, eng.config.sliding_window
    ids = np.asarray(IDS, np.int64)
    nxt = np.asarray(IDS[1:] + [9], np.int64)
    h, logits = np.empty((len(ids), m.mtp_width), np.float32), np.empty((len(ids), V), np.float32)
    m.forward_hidden(ids, 0, logits, False, h)
    want, streams = ref.run(ref.hidden(IDS), nxt.tolist())
    got, h_out = np.empty_like(logits), np.empty_like(h)
    m.mtp_forward(nxt, 0, h, got, False, h_out)
    check_fp32(h_out, streams)
    check_fp32(got, want)
    seq = (IDS * 60)[:700]
    for a, b in ((0, 512), (512, 700)):          # entries 0 .. 699: the ring holds the last ones alone
        h = np.empty((b - a, m.mtp_width), np.float32)
        m.forward_hidden(np.asarray(seq[a:b], np.int64), a, logits[:1], True, h)
        m.mtp_forward(np.asarray(seq[a + 1:b + 1], np.int64), a, h, None, True)
    tail = [int(x) for x in np.random.default_rng(0).integers(0, V, 3 * W)]
    full = seq[:100] + tail
    h = np.empty((len(tail), m.mtp_width), np.float32)
    m.forward_hidden(np.asarray(tail, np.int64), 100, logits[:1], True, h)      # back at 100
    nxt = np.asarray(full[101:] + [5], np.int64)
    got = np.empty((len(tail), V), np.float32)
    m.mtp_forward(nxt, 100, h, got, False)
    check_fp32(got, ref.logits(ref.hidden(full)[100:], nxt.tolist()))


def test_v4_mtp_layer_is_read_as_a_sliding_window_layer():
    """V4's MTP layer takes the last entry of compress_ratios (a shrunk config keeps the list), and is
    read only as a sliding-window layer."""
    from cpumla.models import deepseek_v4 as v4

    base = {**models.V4_BASE, "model_type": "deepseek_v4", "num_nextn_predict_layers": 1}
    shrunk = v4.Config.from_dict({**base, "num_hidden_layers": 3, "compress_ratios": [0, 4, 128, 4, 128, 0]})
    assert shrunk.mtp_ratio == 0 and v4.has_mtp(shrunk) and "mtp.0.e_proj.weight" in v4.tensors(shrunk)
    comp = v4.Config.from_dict({**base, "compress_ratios": [0, 4, 128, 4, 128, 4]})
    assert comp.mtp_ratio == 4 and not v4.has_mtp(comp)
    assert not any(name.startswith("mtp.") for name in v4.tensors(comp))


@pytest.mark.parametrize("mode,k", [("mtp", 1), ("mtp", 2), ("mtp", 3), ("ngram", 2)])
def test_greedy_text_is_the_same_with_drafts(v3_mtp, mode, k):
    d, _ = v3_mtp
    eng = cpumla.load(str(d))
    eng.set_draft("none")
    base = generate(eng, 40)
    eng.set_draft(mode, k, **({"p_min": 0.0} if mode == "mtp" else {}))
    assert generate(eng, 40) == base
    assert eng.tokens == IDS + base


@pytest.mark.parametrize("wrong", [0, 3, 5])
@pytest.mark.parametrize("k", [1, 3])
def test_accepted_and_rejected_drafts_keep_the_text(v3_mtp, k, wrong):
    d, _ = v3_mtp
    eng = cpumla.load(str(d))
    eng.set_draft("none")
    base = generate(eng, 30)
    eng.reset()
    row = eng.forward(IDS, last_only=True)[-1]
    step = speculative.Stepper(eng, Oracle(eng, len(IDS), base, wrong), k)
    got = []
    for _ in range(30):
        tok = int(np.argmax(row))
        got.append(tok)
        row = step(tok)
    step.close()
    assert got == base
    assert eng.tokens == IDS + base                 # every token stepped, no draft left over
    if wrong == 0:
        assert step.accepted == step.verified > 0 and step.forwards <= -(-30 // (k + 1)) + 1
    else:
        assert 0 < step.accepted < step.verified


@pytest.mark.parametrize("k", [1, 3])
def test_v4_rollbacks_across_compression_windows(v4, k):
    """V4's compressors (ratios 4 and 8) and sliding window under drafts that are kept and dropped."""
    eng = cpumla.load(str(v4))
    prompt = IDS * 2
    base = list(eng.generate(prompt, 30, stop_ids=[]))
    eng.reset()
    row = eng.forward(prompt, last_only=True)[-1]
    with speculative.Stepper(eng, Oracle(eng, len(prompt), base, wrong=3), k) as step:
        got = []
        for _ in range(30):
            tok = int(np.argmax(row))
            got.append(tok)
            row = step(tok)
        assert 0 < step.accepted < step.verified
    assert got == base
    # the cache after the rollbacks is the one a plain forward of the same tokens makes
    nxt = eng.forward([3], last_only=True)[-1]
    fresh = cpumla.load(str(v4))
    check_fp32(nxt[None], fresh.forward(prompt + base + [3], last_only=True))


def test_sampled_text_is_the_same_for_a_seed(v3_mtp):
    d, _ = v3_mtp
    eng = cpumla.load(str(d))
    for seed in range(4):
        eng.set_draft("none")
        base = generate(eng, 25, temperature=1.0, top_p=0.9, seed=seed, repeat_penalty=1.1)
        eng.set_draft("mtp", 2, p_min=0.0)
        assert generate(eng, 25, temperature=1.0, top_p=0.9, seed=seed, repeat_penalty=1.1) == base


def test_sampled_distribution_is_the_models(v3_mtp):
    """Chi-square: the second sampled token with drafts against its exact distribution under the
    model, sum over x1 of p(x1) p(x2 | x1), at temperature 1 over the 160-token vocabulary."""
    d, _ = v3_mtp
    eng = cpumla.load(str(d))
    T, V = 1.0, eng.config.vocab_size

    def probs(logits):
        z = logits.astype(np.float64) / T
        p = np.exp(z - z.max())
        return p / p.sum()

    last = eng.forward(IDS + [0])
    p1, cond = probs(last[-2]), np.empty((V, V))
    for x1 in range(V):
        eng.truncate(len(IDS))
        cond[x1] = probs(eng.forward([x1], last_only=True)[-1])
    want = p1 @ cond
    eng.set_draft("mtp", 1, p_min=0.0)
    n = 3000
    counts = np.zeros(V)
    for seed in range(n):
        counts[generate(eng, 2, temperature=T, seed=seed)[1]] += 1
    exp = want * n
    big = exp >= 5
    obs, exp = counts[big], exp[big]
    if not big.all():                                  # the rare tokens pooled into one bin
        obs, exp = np.append(obs, counts[~big].sum()), np.append(exp, (want * n)[~big].sum())
    chi2 = ((obs - exp) ** 2 / exp).sum()
    assert stats.chi2.sf(chi2, len(obs) - 1) > 1e-3, chi2


def test_draft_settings_are_checked(v3_mtp, tmp_path):
    d, _ = v3_mtp
    eng = cpumla.load(str(d))
    for bad in (dict(mode="eagle"), dict(mode="mtp", tokens=0), dict(mode="mtp", tokens=99),
                dict(mode="mtp", p_min=1.5)):
        with pytest.raises(CpumlaError):
            eng.set_draft(**bad)
    models.build("v2-lite", tmp_path)
    plain = cpumla.load(str(tmp_path))
    assert not plain.has_mtp and plain.draft == "none"
    with pytest.raises(CpumlaError, match="no MTP layer"):
        plain.set_draft("mtp")
    plain.set_draft("ngram", 2)
    assert plain.draft == "ngram"
