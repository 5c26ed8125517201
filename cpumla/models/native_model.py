"""What every family's Model shares: a native state made from the family's description (its caches,
scratch and kernel context), the forward call into it, and closing it."""

from __future__ import annotations

import dataclasses

import numpy as np

from cpumla import native
from cpumla.errors import CpumlaError
from cpumla.models.checks import needer, short, validate_fields

PREFILL_CHUNK = 512     # tokens per native forward call: the scratch of the model's state is sized for it


class NativeModel:
    """Base of a family Model. STATE names the family's native new / free / forward functions."""

    STATE: tuple[str, str, str]

    def start_state(self, desc, ctx: int, max_tokens: int) -> None:
        """Creates the native state for the description `desc` (a cffi struct pointer kept alive by the
        model): CpumlaError when it cannot be made (out of memory, a bad model)."""
        new, free, fwd = (getattr(native.lib, f) for f in self.STATE)
        state = new(desc, ctx, max_tokens)
        if state == native.ffi.NULL:
            raise CpumlaError(native.last_error())
        keep = desc      # the state's free reads the description: keep it alive until then
        self._state = native.ffi.gc(state, lambda p: free(p) if keep is not None else None)
        self._forward = fwd

    def call_state(self, ids: np.ndarray, pos0: int, out: np.ndarray, last_only: bool) -> None:
        """One native forward: ids (int64, contiguous) at pos0, their logits into out (float32)."""
        self._native_call(self._forward, ids, pos0, out, last_only)

    def _native_call(self, fn, ids: np.ndarray, pos0: int, out: np.ndarray, last_only: bool, *more) -> None:
        """fn(state, ids, n, pos0, logits, last_only, *more float buffers)."""
        if self._state is None:
            raise CpumlaError("this model has been closed")
        ffi = native.ffi
        # from_buffer: a fraction of vptr's cost (numpy's .ctypes), paid once a decode token
        rc = fn(self._state, ffi.from_buffer("int64_t[]", ids), ids.size, pos0,
                ffi.from_buffer("float[]", out, require_writable=True), int(last_only),
                *(ffi.from_buffer("float[]", b, require_writable=True) for b in more))
        if rc != 0:
            raise CpumlaError(native.last_error())

    def forward(self, ids: np.ndarray, pos0: int, out: np.ndarray, last_only: bool) -> None:
        """Appends ids at pos0 and writes their logits into out."""
        self.call_state(ids, pos0, out, last_only)

    # ---- speculative decoding (runtime/speculative.py): a family with an MTP layer (`self.mtp`) names
    # the native forward that also returns what that layer takes (HIDDEN_FN) and the layer's (MTP_FN) ----
    HIDDEN_FN = MTP_FN = ""
    mtp = None

    @property
    def mtp_width(self) -> int:
        """Floats of one position's hidden input to the MTP layer."""
        return self.config.hidden_size

    def forward_hidden(self, ids: np.ndarray, pos0: int, out: np.ndarray, last_only: bool, hidden: np.ndarray) -> None:
        """forward() that also writes what the MTP layer takes of every token into hidden [n, mtp_width]."""
        self._rows_fit(hidden, ids.size, "hidden")
        self._native_call(getattr(native.lib, self.HIDDEN_FN), ids, pos0, out, last_only, hidden)

    def _rows_fit(self, a: np.ndarray | None, rows: int, name: str, width: int | None = None) -> None:
        """A CpumlaError unless a holds rows x width float32 values (width: mtp_width)."""
        width = self.mtp_width if width is None else width
        if a is not None and (a.dtype != np.float32 or a.size < rows * width):
            raise CpumlaError(f"{name} must hold {rows} x {width} float32 values")

    def mtp_forward(self, ids: np.ndarray, pos0: int, hidden: np.ndarray, out: np.ndarray | None, last_only: bool,
                    hidden_out: np.ndarray | None = None) -> None:
        """The MTP layer at positions pos0.. over (hidden[t], ids[t]) pairs: the logits of the token after
        each ids[t] into out, its output rows (what a chained draft takes as hidden) into hidden_out,
        each when not None; last_only: of the last position alone (one row each; the others write their
        cache entries and nothing more); with neither, the cache entries only."""
        if self.mtp is None:
            raise CpumlaError("this checkpoint has no MTP layer")
        rows = 1 if last_only else ids.size
        self._rows_fit(hidden, ids.size, "hidden")
        self._rows_fit(out, rows, "out", self.config.vocab_size)
        self._rows_fit(hidden_out, rows, "hidden_out")
        ffi = native.ffi
        if self._state is None:
            raise CpumlaError("this model has been closed")
        rc = getattr(native.lib, self.MTP_FN)(
            self._state, ffi.from_buffer("int64_t[]", ids), ids.size, pos0, ffi.from_buffer("float[]", hidden),
            ffi.NULL if out is None else ffi.from_buffer("float[]", out, require_writable=True), int(last_only),
            ffi.NULL if hidden_out is None else ffi.from_buffer("float[]", hidden_out, require_writable=True))
        if rc != 0:
            raise CpumlaError(native.last_error())

    # ---- tensor parallel (runtime/tp.py): a family that runs as a rank sets TENSOR_PARALLEL, takes a
    # models.shard.Shard and builds its slice, and names the struct with the comm field (comm_desc) ----
    TENSOR_PARALLEL = False

    def comm_desc(self):
        """The native description holding `comm` and `head_row0`."""
        raise NotImplementedError

    def attach(self, comm) -> None:
        """Runs the forward as rank comm.rank of comm.world: its partial sums all-reduced, its logits
        gathered on rank 0, through comm.c (a cpumla_comm the comm keeps alive)."""
        self.comm_desc().comm = comm.c
        self._comm = comm

    def close(self) -> None:
        """Frees the native state (caches and scratch) now rather than at garbage collection."""
        if getattr(self, "_state", None) is not None:
            native.ffi.release(self._state)
            self._state = None


class ConfigBase:
    """What every family's Config dataclass shares (HF field names; unknown keys kept in `extra`): made
    by from_dict, which checks every field against the family's tables (models/checks.py's
    validate_fields: SIZES, REALS, BOOLS, STRINGS), then the family's own cross-field rules (`validate`),
    then computes what is derived from them (`derive`)."""

    MODEL_TYPES: tuple[str, ...] = ()
    SIZES: dict = {}
    REALS: dict = {}
    BOOLS: tuple[str, ...] = ()
    STRINGS: dict = {}

    @classmethod
    def prepare(cls, d: dict) -> dict:
        """config.json as the family reads it (a family folds in other spellings of its fields here)."""
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json"):
        if not isinstance(d, dict):
            raise CpumlaError(f"{source}: expected a JSON object")
        mt = d.get("model_type")
        if mt not in cls.MODEL_TYPES:
            raise CpumlaError(f"{source}: model_type {short(mt)} is not one of {', '.join(cls.MODEL_TYPES)}")
        d = cls.prepare(dict(d))
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in d.items() if k in names}
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   and f.name not in kwargs]
        if missing:
            raise CpumlaError(f"{source}: missing field '{missing[0]}'")
        cfg = cls(**kwargs, extra={k: v for k, v in d.items() if k not in names})
        need = needer(source)
        validate_fields(cfg, need)
        cfg.validate(source)
        cfg.derive(source)
        return cfg

    def validate(self, source: str) -> None:
        """The family's rules across fields (each field's own are its tables'): one CpumlaError line."""

    def derive(self, source: str) -> None:
        """Values computed once from the valid fields."""

    @property
    def eos_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else (list(e) if isinstance(e, list) else [e])

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return {**self.extra, **d}
