"""Model-description helpers of the kernel library's Python face: the router (cpumla_router), expert
tables (cpumla_expert[] for cpumla_moe), and pointing a cpumla_vec at an array."""

from __future__ import annotations

import numpy as np

from cpumla.errors import CpumlaError
from cpumla.native import checks
from cpumla.native.checks import ld
from cpumla.native.library import check, ensure_init, ffi, fptr, lib, vptr
from cpumla.native.weight import F32, Weight, as_weight

ROUTE_METHODS = {"softmax": lib.CPUMLA_ROUTE_SOFTMAX, "group_limited": lib.CPUMLA_ROUTE_GROUP_LIMITED,
                 "noaux_tc": lib.CPUMLA_ROUTE_NOAUX_TC, "sqrtsoftplus": lib.CPUMLA_ROUTE_SQRTSOFTPLUS,
                 "hash": lib.CPUMLA_ROUTE_HASH}


class Router:
    """A cpumla_router with the arrays it points at kept alive. Inconsistent counts (top_k above the
    experts, groups that do not divide them) are the C router's to refuse, at the call."""

    def __init__(self, method: str, n_experts: int, top_k: int, n_group: int = 1, topk_group: int = 1,
                 norm_topk_prob: bool = False, routed_scaling_factor: float = 1.0,
                 bias: np.ndarray | None = None, tid2eid: np.ndarray | None = None):
        if method not in ROUTE_METHODS:
            raise CpumlaError(f"unknown routing method '{method}'")
        i32 = (-checks.I32_MAX - 1, checks.I32_MAX)
        n_experts = checks.integer(n_experts, "n_experts", *i32)
        top_k = checks.integer(top_k, "top_k", *i32)
        n_group = checks.integer(n_group, "n_group", *i32)
        topk_group = checks.integer(topk_group, "topk_group", *i32)
        r = ffi.new("cpumla_router *")
        r.method = ROUTE_METHODS[method]
        r.n_experts, r.top_k, r.n_group, r.topk_group = n_experts, top_k, n_group, topk_group
        r.norm_topk_prob = int(bool(norm_topk_prob))
        r.routed_scaling_factor = checks.real(routed_scaling_factor, "routed_scaling_factor")
        self._bias = None
        if bias is not None:
            checks.array(np.asarray(bias), "bias", (np.float32, np.float64), 1, (max(n_experts, 0),))
            self._bias = np.ascontiguousarray(bias, dtype=F32)
        r.bias = ffi.NULL if self._bias is None else fptr(self._bias)
        self._t = None
        if tid2eid is not None:
            checks.array(tid2eid, "tid2eid", (np.int64, np.int32), 2, (None, max(top_k, 0)))
            self._t = np.ascontiguousarray(tid2eid)
            r.tid2eid = vptr(self._t)
            r.tid2eid_dtype = lib.CPUMLA_I64 if self._t.dtype == np.int64 else lib.CPUMLA_I32
            r.vocab = self._t.shape[0]
        self.c = r
        self.n_experts = n_experts
        self.top_k = top_k

    def __call__(self, logits: np.ndarray, token_ids: np.ndarray | None = None):
        ensure_init()
        checks.array(logits, "logits", F32, 2)
        n = logits.shape[0]
        if logits.shape[1] < self.n_experts:
            raise CpumlaError(f"logits have {logits.shape[1]} columns, the router has {self.n_experts} experts")
        ids = None
        if token_ids is not None:
            checks.array(np.asarray(token_ids), "token_ids", (np.int64, np.int32), 1, (n,))
            ids = np.ascontiguousarray(token_ids, dtype=np.int64)
        idx = np.empty((n, max(self.top_k, 0)), np.int32)
        w = np.empty((n, max(self.top_k, 0)), F32)
        rc = lib.cpumla_route(self.c, fptr(logits), ld(logits), n,
                              ffi.NULL if ids is None else vptr(ids, "int64_t *"),
                              vptr(idx, "int32_t *"), fptr(w))
        check(rc)
        return idx, w


class Experts:
    """A table of SwiGLU MLPs (cpumla_expert[]) for cpumla_moe; keeps its Weights alive."""

    def __init__(self, experts: list[tuple[Weight, Weight, Weight]]):
        if not experts:
            raise CpumlaError("an expert table needs at least one expert")
        self._keep = experts
        self.c = ffi.new("cpumla_expert[]", len(experts))
        I, D = as_weight(experts[0][0]).rows, experts[0][0].cols
        for i, trio in enumerate(experts):
            if len(trio) != 3:
                raise CpumlaError(f"expert {i} is not a (gate, up, down) trio")
            g, u, d = (as_weight(t) for t in trio)
            if (g.rows, g.cols, u.rows, u.cols, d.rows, d.cols) != (I, D, I, D, D, I):
                raise CpumlaError(f"expert {i} has shapes {g.rows}x{g.cols}/{u.rows}x{u.cols}/{d.rows}x{d.cols}, "
                                  f"want {I}x{D}/{I}x{D}/{D}x{I}")
            self.c[i].gate, self.c[i].up, self.c[i].down = g.c[0], u.c[0], d.c[0]
        self.n, self.hidden, self.intermediate = len(experts), D, I

    @property
    def trios(self) -> list:
        """The (gate, up, down) Weights of each expert."""
        return list(self._keep)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's three weights (the first's; a table's experts share shapes and format)."""
        return sum(as_weight(t).nbytes for t in self._keep[0])

    def __call__(self, x: np.ndarray, idx: np.ndarray, w: np.ndarray, out: np.ndarray, limit: float = 0.0):
        """out[t] += sum_j w[t, j] * Expert_{idx[t, j]}(x[t]); x, out [n, D]; idx, w [n, k]."""
        ensure_init()
        checks.array(x, "x", F32, 2, (None, self.hidden))
        n = x.shape[0]
        checks.array(np.asarray(idx), "idx", (np.int32, np.int64), 2, (n, None))
        idx = np.ascontiguousarray(idx, dtype=np.int32)
        checks.array(np.asarray(w), "w", (np.float32, np.float64), 2, idx.shape)
        w = np.ascontiguousarray(w, dtype=F32)
        checks.array(out, "out", F32, 2, (n, self.hidden), writable=True)
        limit = checks.real(limit, "limit")
        rc = lib.cpumla_moe(self.c, self.n, fptr(x), ld(x), n, vptr(idx, "int32_t *"), fptr(w),
                            idx.shape[1], fptr(out), ld(out), limit)
        check(rc)
        return out


# ---- model descriptions ----------------------------------------------------------------------------
_VEC_DTYPES = {np.dtype(np.float32): lib.CPUMLA_F32, np.dtype(np.uint16): lib.CPUMLA_BF16,
               np.dtype(np.float16): lib.CPUMLA_F16}
_FORMATS = {np.dtype(np.float32): "f32", np.dtype(np.uint16): "bf16", np.dtype(np.float16): "f16"}


def set_vec(c, v: np.ndarray) -> None:
    """Points a cpumla_vec at v (float32, bf16 bits as uint16, or float16) in place; v must outlive it."""
    if v.dtype not in _VEC_DTYPES or not v.flags.c_contiguous:
        raise CpumlaError(f"a vector must be contiguous float32, bf16 or float16, got {v.dtype}")
    c.data, c.dtype = vptr(v), _VEC_DTYPES[v.dtype]


def format_of(a: np.ndarray) -> str:
    """The weight format of a plain array: f32, bf16 (uint16 bits) or f16."""
    if a.dtype not in _FORMATS:
        raise CpumlaError(f"no weight format for {a.dtype}")
    return _FORMATS[a.dtype]
