"""What one tensor-parallel rank holds of a DeepSeek-V2 / V3 / V3.2 layer (V4's: deepseek_v4.Model._part):
its slice of the attention heads (q / q_b and kv_b rows, o_proj columns), of every routed and shared
expert's and the dense MLP's intermediate dimension (gate / up rows, down columns) and of the vocabulary
(lm_head rows). The small
projections (q_a, kv_a), the norms, the router and V3.2's indexer are held whole by every rank. A rank
reads only its rows and columns (native.Weight.part: rows a view of the checkpoint, columns a copy).
A count that does not split into equal parts, or a slice that would cut a block of the format (FP8's
128x128, q8 / q4's 1x32, a GGUF block), is refused with one line naming the tensor."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cpumla import native
from cpumla.errors import CpumlaError
from cpumla.models import deepseek_v2_tensors as tables


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int

    def part(self, total: int, what: str) -> tuple[int, int]:
        """This rank's [a, b) of `total` equal parts' worth (total must divide by world)."""
        if total % self.world:
            raise CpumlaError(f"--tp {self.world}: {what} ({total}) do not split into {self.world} equal parts")
        per = total // self.world
        return self.rank * per, (self.rank + 1) * per

    def error(self, e: CpumlaError) -> CpumlaError:
        """e (a slice refused by native.Weight.part, or one of part()'s own) as a --tp error."""
        text = str(e)
        return CpumlaError(text if text.startswith("--tp ") else f"--tp {self.world}: {text}")

    def span(self, total: int, unit: int, what: str) -> tuple[int, int]:
        """This rank's [a, b) of `total` rows in parts of whole `unit`s (the last part may be short)."""
        per = -(-total // self.world // unit) * unit if total >= self.world * unit else 0
        a, b = min(self.rank * per, total), min((self.rank + 1) * per, total)
        if self.rank == self.world - 1:
            b = total
        if b <= a:
            raise CpumlaError(f"--tp {self.world}: {what} ({total}) is too small for {self.world} ranks")
        return a, b


def vocab_rows(w: native.Weight, shard: Shard, name: str) -> tuple[int, native.Weight]:
    """(first row, the rows) of the head `w` [V, D] this rank computes."""
    a, b = shard.span(w.rows, w.block_unit(0), f"the vocabulary of {name}")
    return a, w.part(0, a, b, name)


def table(t: native.Experts | None, shard: Shard, names: list) -> native.Experts | None:
    """Each expert's gate / up rows and down columns of this rank's slice of the intermediate dimension."""
    if t is None:
        return None
    a, b = shard.part(t.intermediate, f"the intermediate size of {names[0][0].rsplit('.', 2)[0]}")
    return native.Experts([(g.part(0, a, b, ng), u.part(0, a, b, nu), d.part(1, a, b, nd))
                           for (g, u, d), (ng, nu, nd) in zip(t.trios, names)])


def layer(L, cfg, index: int, shard: Shard):
    """This rank's part of layer `index` (a deepseek_v2.Layer, or a subclass's)."""
    try:
        return _layer(L, cfg, index, shard)
    except CpumlaError as e:
        raise shard.error(e) from None


def _layer(L, cfg, index: int, shard: Shard):
    names = tables.checkpoint_name_map(cfg, index)
    h0, h1 = shard.part(cfg.num_attention_heads, "attention heads")
    qk, dv, dn = cfg.qk_head_dim, cfg.v_head_dim, cfg.qk_nope_head_dim

    def rows(role, per, name=None):
        w = getattr(L, role)
        return None if w is None else w.part(0, h0 * per, h1 * per, name or names[role][0])

    k_name, v_name = tables.split_kv_b_names(index)

    mlp = tables.mlp_names(cfg, index)
    return dataclasses.replace(
        L, q=rows("q", qk), q_b=rows("q_b", qk), kv_b=rows("kv_b", dn + dv),
        k_b=rows("k_b", cfg.kv_lora_rank, k_name), v_b=rows("v_b", dv, v_name),
        o_proj=L.o_proj.part(1, h0 * dv, h1 * dv, names["o_proj"][0]),
        mlp=table(L.mlp, shard, mlp.get("dense", [])), experts=table(L.experts, shard, mlp.get("experts", [])),
        shared=table(L.shared, shard, mlp.get("shared", [])))


# the tensors a rank holds a slice of, by name (runtime/plan.py sizes a rank with it); the rest are whole
SPLIT = (".q_proj.", ".q_b_proj.", ".kv_b_proj.", ".o_proj.", ".mlp.experts.", ".mlp.shared_experts.",
         ".mlp.gate_proj.", ".mlp.up_proj.", ".mlp.down_proj.",                        # V2 / V3 / V3.2
         ".attn.wq_b.", ".attn.wo_a.", ".attn.wo_b.", ".ffn.experts.", ".ffn.shared_experts.")   # V4


def is_split(name: str) -> bool:
    return name.startswith(("lm_head.", "head.")) or any(s in name for s in SPLIT)
