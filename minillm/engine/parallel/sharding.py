"""Which slice of each weight rank r of N holds: Megatron-LM's split of a Llama block.

    attention   q, k, v  column-parallel: rank r keeps its heads' output rows        [heads_r * hd, dim]
                o        row-parallel: the matching input columns                  [dim, heads_r * hd]
    MLP         gate, up column-parallel: a slice of the ffn width                 [ffn / N, dim]
                down     row-parallel: the matching input columns                  [dim, ffn / N]
    vocabulary  embedding and LM head: a block of rows each                       [ceil(V / N), dim]

Why this pairing: a column-parallel matmul needs the whole input and leaves each rank a slice of the
output; a row-parallel one takes exactly that slice and leaves each rank a partial sum of the whole
output. So q/k/v -> attention (per head, no communication: heads are independent) -> o gives partial
sums that one all-reduce adds up; gate/up -> SwiGLU (elementwise) -> down, another. Two all-reduces a
block, of T × dim values each, and nothing else moves.

KV heads: with fewer KV heads than ranks (GQA/MQA), each rank keeps the one KV head its query heads
read, so KV heads are replicated (vLLM does the same); tp must then be a multiple of n_kv_heads.

Quantized matrices shard along the same axes: int8 codes with their per-row scales (row-parallel
shards keep every row's scale: each partial sum is scaled by it, and the sum of scaled partials is the
scaled sum); int4 codes, scales and mins by whole groups, so a row-parallel shard's width must be a
multiple of the group size. Biases of column-parallel matrices are sliced like their rows; a
row-parallel bias is kept by rank 0 alone (zeros elsewhere), so the all-reduce adds it exactly once.

Slices of a memory-mapped checkpoint are read from disk only where they are touched: each rank reads
and keeps about 1/N of the weights (`shard_bytes`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minillm.errors import MiniLLMError
from minillm.model.config import ModelConfig

COLUMN_PARALLEL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
REPLICATED = ("input_layernorm.weight", "post_attention_layernorm.weight")
INT4_GROUP_SIZES = (32, 64, 128)
SHARDED_FORMATS = ("int8", "int4")       # quantized storage whose tensors this module knows how to slice
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `size` holds, as index ranges into the full model's axes."""
    rank: int
    size: int
    heads: range         # query heads
    kv_heads: range      # KV heads (one replicated head when size > n_kv_heads)
    ffn: range           # columns of the SwiGLU width
    vocab_rows: int      # rows of the embedding / LM head a rank holds (the last rank's block is padded)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows


# ---- which sizes work ------------------------------------------------------------------------------
def _problems(config: ModelConfig, tp: int) -> list[str]:
    """Why `tp` ranks cannot split this model (empty: they can)."""
    out = []
    if config.n_heads % tp:
        out.append(f"{config.n_heads} query heads")
    kv = config.n_kv_heads
    if kv % tp and tp % kv:
        out.append(f"{kv} KV heads")
    if config.ffn_dim % tp:
        out.append(f"an FFN width of {config.ffn_dim}")
    return out


def valid_sizes(config: ModelConfig, up_to: int = 64) -> list[int]:
    """Every tp from 1 to `up_to` that splits this model's heads, KV heads and FFN width evenly."""
    return [n for n in range(1, up_to + 1) if not _problems(config, n)]


def check(config: ModelConfig, tp: int) -> None:
    """MiniLLMError in one line, naming the sizes that work, when `tp` ranks cannot shard this model."""
    if tp < 1:
        raise MiniLLMError(f"tp must be >= 1, got {tp}")
    if tp == 1:
        return
    if config.attention != "gqa":
        raise MiniLLMError("tensor parallelism shards Llama-style (GQA/MHA/MQA) attention only, not MLA")
    if getattr(config, "n_experts", 0):
        raise MiniLLMError("tensor parallelism does not shard mixture-of-experts layers yet; use tp=1")
    problems = _problems(config, tp)
    if problems:
        sizes = ", ".join(map(str, valid_sizes(config, max(config.n_heads, 8))))
        raise MiniLLMError(f"tp={tp} does not divide this model's {' and '.join(problems)} "
                           f"(tp must divide the query heads and the FFN width, and divide or be a multiple of "
                           f"the KV heads); tp can be {sizes}")
    _check_int4_groups(config, tp)


def _check_int4_groups(config: ModelConfig, tp: int) -> None:
    """Row-parallel int4 shards must hold whole groups: o_proj's and down_proj's inputs per rank."""
    q = config.quantization or {}
    if q and q.get("method") not in SHARDED_FORMATS:
        raise MiniLLMError(f"tensor parallelism shards float, int8 and int4 weights, not {q.get('method')}; "
                           f"use tp=1 or quantize to int8/int4")
    if q.get("method") != "int4":
        return
    widths = {"o_proj": config.n_heads * config.head_dim // tp, "down_proj": config.ffn_dim // tp}
    g = int(q.get("group_size", 128))
    bad = {name: w for name, w in widths.items() if w % g}
    if bad:
        works = [s for s in INT4_GROUP_SIZES if all(w % s == 0 for w in widths.values())]
        fix = (f"quantize with group size {' or '.join(map(str, works))}" if works
               else "no int4 group size fits; use int8 or another tp")
        name, w = next(iter(bad.items()))
        raise MiniLLMError(f"tp={tp} gives each rank {w} inputs of {name}, which int4 groups of {g} do not "
                           f"divide: {fix}")


# ---- the plan for one rank ---------------------------------------------------------------------
def plan(config: ModelConfig, tp: int, rank: int) -> Shard:
    """Rank `rank`'s slices (check(config, tp) first)."""
    check(config, tp)
    per_rank = config.n_heads // tp
    heads = range(rank * per_rank, (rank + 1) * per_rank)
    kv = config.n_kv_heads
    if kv >= tp:
        kv_heads = range(rank * kv // tp, (rank + 1) * kv // tp)
    else:                                                   # replicated: tp // kv ranks share each KV head
        head = rank // (tp // kv)
        kv_heads = range(head, head + 1)
    f = config.ffn_dim // tp
    return Shard(rank, tp, heads, kv_heads, range(rank * f, (rank + 1) * f), -(-config.vocab_size // tp))


def local_config(config: ModelConfig, shard: Shard) -> ModelConfig:
    """The shape one rank's Transformer runs: its heads, KV heads and FFN slice (vocab_size stays the
    whole vocabulary: the LM head's gathered logits are the full row)."""
    if shard.size == 1:
        return config
    return config.replace(n_heads=len(shard.heads), n_kv_heads=len(shard.kv_heads), ffn_dim=len(shard.ffn))


# ---- slicing the tensors -----------------------------------------------------------------------
def shard_tensors(config: ModelConfig, tensors: dict, shard: Shard) -> dict:
    """The HF-named tensors (plain or quantized: .weight, .qweight, .scales, .mins, .bias) rank
    `shard.rank` keeps. Norms are replicated; anything this module does not know is refused."""
    if shard.size == 1:
        return dict(tensors)
    hd = config.head_dim
    q_rows = _rows(shard.heads, hd)
    kv_rows = _rows(shard.kv_heads, hd)
    rows = {"self_attn.q_proj": q_rows, "self_attn.k_proj": kv_rows, "self_attn.v_proj": kv_rows,
            "mlp.gate_proj": shard.ffn, "mlp.up_proj": shard.ffn}
    cols = {"self_attn.o_proj": q_rows, "mlp.down_proj": shard.ffn}
    group = int((config.quantization or {}).get("group_size", 0)) if _is_int4(config) else 0
    out = {}
    for name, a in tensors.items():
        if name == "lm_head.weight" and config.tie_embeddings:
            continue                                                    # the Transformer ties it to the embedding
        if name in VOCAB_TENSORS:
            out[name] = _vocab_block(a, shard)
            continue
        if not name.startswith("model.layers.") or name.endswith(REPLICATED):
            out[name] = a                                               # norms: every rank needs them whole
            continue
        part, kind = _matrix_of(name)
        if part in rows:
            out[name] = _own(a[rows[part].start:rows[part].stop])
        elif part in cols:
            out[name] = _row_parallel(a, kind, cols[part], group, shard.rank)
        else:
            raise MiniLLMError(f"tensor parallelism does not know how to shard {name}; use tp=1")
    return out


def _is_int4(config: ModelConfig) -> bool:
    return (config.quantization or {}).get("method") == "int4"


def _rows(heads: range, head_dim: int) -> range:
    return range(heads.start * head_dim, heads.stop * head_dim)


def _matrix_of(name: str) -> tuple[str, str]:
    """'model.layers.3.mlp.down_proj.qweight' -> ('mlp.down_proj', 'qweight')."""
    rest = name.split(".", 3)[3]                       # after 'model.layers.N.'
    part, _, kind = rest.rpartition(".")
    return part, kind


def _row_parallel(a: np.ndarray, kind: str, cols: range, group: int, rank: int) -> np.ndarray:
    """The input-column slice of o/down in each storage: float weight, int8 or int4 codes and scales."""
    if kind == "bias":                                  # added once: by rank 0, after the all-reduce sums
        return _own(a) if rank == 0 else np.zeros_like(a)
    if kind == "weight" or (kind == "qweight" and not group):       # float, or int8 codes [out, in]
        return _own(a[:, cols.start:cols.stop])
    if kind == "scales" and not group:                   # int8: one scale per output row, kept whole
        return a
    if kind == "qweight":                               # int4: two codes a byte
        return _own(a[:, cols.start // 2:cols.stop // 2])
    if kind in ("scales", "mins"):                       # int4: one per group of inputs
        return _own(a[:, cols.start // group:cols.stop // group])
    raise MiniLLMError(f"tensor parallelism does not know how to shard a row-parallel {kind!r}")


def _vocab_block(a: np.ndarray, shard: Shard) -> np.ndarray:
    """Rows vocab_start ... vocab_start + vocab_rows of the table, zero rows past its end (so every rank
    holds the same number: the all-gather then needs no per-rank sizes)."""
    start = shard.vocab_start
    block = a[start:start + shard.vocab_rows]
    if len(block) == shard.vocab_rows:
        return _own(block)
    padded = np.zeros((shard.vocab_rows,) + a.shape[1:], dtype=a.dtype)
    padded[:len(block)] = block
    return padded


def _own(view: np.ndarray) -> np.ndarray:
    """A slice this rank can keep: a contiguous view of a memory-mapped file stays a view (its pages are
    read when used, and only those); anything else is copied, so the full array it came from can go."""
    if view.flags.c_contiguous and _mapped(view):
        return view
    return np.array(view, copy=True) if view.base is not None else view


def _mapped(a: np.ndarray) -> bool:
    while a is not None:
        if isinstance(a, np.memmap):
            return True
        a = getattr(a, "base", None)
        if not isinstance(a, np.ndarray):
            return False
    return False


def shard_bytes(tensors: dict) -> int:
    """Bytes of the weights a rank holds (a tied head counted once)."""
    seen, total = set(), 0
    for a in tensors.values():
        if id(a) not in seen:
            seen.add(id(a))
            total += a.nbytes
    return total


def shard_checkpoint(config: ModelConfig, tensors: dict, rank: int, size: int) -> tuple[ModelConfig, dict]:
    """(the shape rank `rank` of `size` runs, the tensors it keeps): what `minillm.load(tp=...)` builds
    that rank's Transformer from. MiniLLMError in one line if the model does not split `size` ways."""
    shard = plan(config, size, rank)
    return local_config(config, shard), shard_tensors(config, tensors, shard)


def model_bytes(model) -> int:
    """Bytes of weights a (sharded) Transformer holds: the embedding and everything a decode step reads."""
    arrays = {id(a): a for a in [model.embed] + list(model.weights_read_per_token())}
    return sum(a.nbytes for a in arrays.values())
