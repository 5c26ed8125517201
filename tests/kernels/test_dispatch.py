"""The dispatch rule: which level a CPU gets, as a function of its feature bits and the OS's support
(a CPU with AVX-512 F/BW/VL/DQ but without BF16 gets avx512f; no OS zmm state: avx2), and what the
library says a level this machine cannot run lacks."""

from __future__ import annotations

import pytest

from cpumla import native

X86 = ("avx", "avx2", "fma", "f16c", "os_avx")


F_LEVEL = X86 + ("avx512f", "avx512bw", "avx512vl", "avx512dq", "os_avx512")


@pytest.mark.parametrize("feats,want", [
    ((), "scalar"),
    (X86, "avx2"),
    (X86 + ("avxvnni",), "avxvnni"),                                              # Alder Lake, Sierra Forest
    (X86[:-1] + ("avxvnni",), "scalar"),                                          # the OS does not save ymm
    (X86 + ("avxvnni", "avx512f", "avx512bw", "avx512vl", "avx512dq"), "avxvnni"),  # no zmm state
    (X86 + ("avx512f", "avx512bw", "avx512vl", "avx512dq"), "avx2"),            # the OS does not save zmm
    (F_LEVEL[:-2] + ("os_avx512",), "avx2"),                                      # no AVX512DQ
    (F_LEVEL, "avx512f"),                                                          # Skylake-SP, Cascade Lake
    (F_LEVEL + ("avx512vnni", "avx512vbmi"), "avx512vnni"),                       # Ice Lake: no BF16
    (F_LEVEL + ("avx512bf16", "avx512vnni"), "avx512vnni"),                       # Cooper Lake: no VBMI
    (F_LEVEL + ("avx512bf16", "avx512vbmi"), "avx512f"),                          # no VNNI
    (F_LEVEL[:-1] + ("avx512vnni",), "avx2"),                                     # no zmm state
    (F_LEVEL + ("avx512bf16", "avx512vnni", "avx512vbmi"), "avx512"),            # Zen 4
    (F_LEVEL + ("avx512bf16", "avx512vnni", "avx512vbmi", "avxvnni"), "avx512"),  # Zen 5, Sapphire Rapids
    (F_LEVEL + ("avxvnni",), "avx512f"),
    (F_LEVEL + ("avx512bf16", "avx512vnni", "avx512vbmi", "amx_tile", "amx_bf16", "amx_int8"), "avx512"),
    (F_LEVEL + ("avx512bf16", "avx512vnni", "avx512vbmi", "amx_tile", "amx_bf16", "amx_int8", "os_amx"), "amx"),
])
def test_dispatch_rule(feats, want):
    if "avx2" not in native.built_isas():
        pytest.skip("the x86 chain is not built here")
    assert native.isa_for_features({f: True for f in feats}) == want


def test_isa_missing_in_c():
    f = native.lib.cpumla_isa_missing
    assert native.ffi.string(f(b"scalar")) == b""
    assert f(b"bogus") == native.ffi.NULL
    for isa in native.built_isas():
        text = native.ffi.string(f(isa.encode())).decode()
        assert (text == "") == (isa in native.available_isas())
