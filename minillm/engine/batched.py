"""Batched execution: one forward pass for several sequences, each at its own length, over the paged pool.

The new tokens of every sequence in the batch, prompt chunks and single decode tokens alike, are packed
into one token matrix [N, dim] (N = the sum of their counts), so every projection and MLP is one GEMM
over all of them: a decode step of B sequences reads each weight once instead of B times, and that is
where batching's throughput comes from (decode is bound by reading the weights). Only attention is
per sequence: each one attends over its own keys, read through its block table.

    sequence a: 5 prompt tokens at 0..4    ─┐
    sequence b: 1 decode token at 37        ├─ x [7, dim] ── q,k,v = one GEMM ── write K,V into their slots
    sequence c: 1 decode token at 12       ─┘        attention: a over 0..4, b over 0..37, c over 0..12

The weights and the layer functions are the Transformer's own (`qkv`, `ffn`, `head`): nothing is
forked, so a change to the model (FlashNorm, quantized weights) is a change here too. Sliding-window
models read only the blocks from the window's start (the scheduler gives the blocks behind it back) and
mask the rest of the window's edge.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from minillm.backend import as_f32
from minillm.errors import MiniLLMError
from minillm.model.layers import linear
from minillm.engine.paged_kv import PagedKVCache, first_needed_block
from minillm.model.pieces import ENGINE_PIECES


@dataclass
class SeqChunk:
    """One sequence's share of a forward pass: tokens to run, where they start, where its KV lives."""
    token_ids: list[int]        # the new tokens: a prompt (or a chunk of it), or the last sampled token
    start: int                  # position of token_ids[0] = how many positions are already in the pool
    block_table: list[int]      # blocks for positions 0 .. start + len(token_ids) - 1

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


class BatchedRunner:
    """Runs a Transformer's weights over many sequences at once, their KV in a PagedKVCache."""

    def __init__(self, model, pool: PagedKVCache, n_layers: int | None = None):
        """n_layers: run only the first n_layers blocks, then the head (an early-exit speculative draft)."""
        check_supported(model)
        self.model, self.pool, self.n_layers = model, pool, n_layers
        pieces = getattr(model, "pieces", ENGINE_PIECES)        # a student's, in course/student.py
        self.pack = pieces.pack_batch or pack
        self.read = pool.read if pieces.paged_read is None else functools.partial(pieces.paged_read, pool)

    def forward(self, chunks: list[SeqChunk], all_logits: bool = False, rows=None) -> np.ndarray:
        """Run every chunk; -> logits [len(chunks), vocab] at each chunk's last token
        (all_logits: [N, vocab], every token, in chunk order; rows: those rows of the N, e.g. every
        position of a speculative verify chunk)."""
        m = self.model
        tokens, positions, last_rows = self.pack(chunks)                                    # [N], [N], [B]
        slots = [self.pool.slots(c.block_table, c.start, c.end) for c in chunks]
        blocks = np.concatenate([b for b, _ in slots])                                      # [N]
        offsets = np.concatenate([o for _, o in slots])                                     # [N]
        seq_ends = np.concatenate([np.full(len(c.token_ids), c.end) for c in chunks])      # [N] (LongRoPE picks by it)
        ropes = m.rope(positions, seq_ends)                                                 # per layer: [N, hd/2] x 2
        x = m.embed_tokens(tokens)                                                          # [N, dim]
        for i, layer in enumerate(m.layers[:self.n_layers]):    # add_residual: tp's all-reduces, Gemma's out norms
            x = m.add_residual(x, self.attention(x, layer, i, chunks, *ropes[i], blocks, offsets), layer.attn_out_norm)
            x = m.add_residual(x, m.ffn(x, layer), layer.mlp_out_norm)
        if rows is not None:
            x = x[rows]                                                                     # [len(rows), dim]
        elif not all_logits:
            x = x[last_rows]                                                                # [B, dim]
        return m.head(x)                                                                    # [B or N, vocab]

    def forward_greedy(self, chunks: list[SeqChunk]) -> np.ndarray:
        """Run every chunk; -> int32 [B]: each chunk's next token by greedy sampling (np.argmax of its row,
        as the Sampler picks it). The Engine's greedy steps call this; the GPU runner picks on the device."""
        return np.argmax(self.forward(chunks), axis=-1).astype(np.int32)

    def attention(self, x, layer, i: int, chunks: list[SeqChunk], cos, sin, blocks, offsets) -> np.ndarray:
        """Projections for all N tokens at once; attention one sequence at a time.   x: [N, dim] -> [N, dim]"""
        q, k, v = self.model.qkv(x, layer, cos, sin)          # q [N, n_heads, hd], k, v [N, n_kv, hd]
        self.pool.write(i, blocks, offsets, k, v)
        out = np.empty((x.shape[0], q.shape[1] * q.shape[2]), dtype=np.float32)   # [N, n_heads * hd]
        window, row = self.model.config.sliding_window, 0
        for c in chunks:
            T = len(c.token_ids)
            first = first_needed_block(c.start, window, self.pool.block_size)     # 0 without a window
            keys, values = self.read(i, c.block_table, c.end, first)              # [n_kv, L, hd] each
            # the queries are the last T of these L keys: masks only need positions relative to them
            out[row:row + T] = self.model.pieces.attention(q[row:row + T], keys, values, self.model.config.window(i),
                                                           sinks=layer.sinks)
            row += T
        return linear(out, layer.wo, layer.bias.get("o"))                          # [N, dim]


def pack(chunks: list[SeqChunk]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The batch as one token matrix: every chunk's token ids one after another [N], the position
    of each [N], and the row of each chunk's last token [B] (its next-token logits come from there)."""
    tokens = np.concatenate([np.asarray(c.token_ids, dtype=np.int64) for c in chunks])       # [N]
    positions = np.concatenate([np.arange(c.start, c.end) for c in chunks])                 # [N]
    last_rows = np.cumsum([len(c.token_ids) for c in chunks]) - 1                           # [B]
    return tokens, positions, last_rows


def check_supported(model) -> None:
    """The engine runs Llama-style (GQA) attention; say so clearly otherwise. (Which backend runs the
    batches is the LLM's `batching`: CPUBatching below, or the GPU's, cuda/gpu_batched.GPUBatching.)"""
    if model.config.attention != "gqa":
        raise MiniLLMError("MLA attention is not supported by the batching engine yet; use llm.generate")


class CPUBatching:
    """How an Engine batches a CPU Transformer: the protocol a backend hands the engine through the LLM
    (`llm.batching`), so the engine never imports a backend. Its pool is a PagedKVCache, its runner a
    BatchedRunner; kv_cache "auto" stores fp32, "int8" codes and scales."""
    device = "cpu"
    default_kv_bytes = 512 << 20        # the pool when neither num_blocks nor max_kv_bytes is given
    default_batch_tokens = 512          # tokens a step computes at most: a 512-row step is ~0.1-1 s on a CPU
    cap_to_max_batch = False            # a CPU pool is host memory: no cap by max_batch

    def __init__(self, model):
        from minillm.model.transformer import Transformer
        if not isinstance(model, Transformer):
            raise MiniLLMError(f"the CPU batching engine runs a Transformer, not {type(model).__name__}")
        check_supported(model)
        self.model = model

    def storage(self, kv_cache: str) -> str:
        return "int8" if kv_cache == "int8" else "float32"

    def bytes_per_block(self, config, block_size: int, kv_cache: str) -> int:
        return PagedKVCache(config, 1, block_size, self.storage(kv_cache)).nbytes

    def new_pool(self, config, num_blocks: int, block_size: int, kv_cache: str) -> PagedKVCache:
        return PagedKVCache(config, num_blocks, block_size, self.storage(kv_cache))

    def new_runner(self, pool: PagedKVCache) -> BatchedRunner:
        return BatchedRunner(self.model, pool)
