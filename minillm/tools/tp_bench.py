"""`minillm bench --tp N`: the same model at tp = 1 and tp = N on this machine's cores, side by side.

tp = 1 runs with N BLAS threads, tp = N with one a rank (MPI ranks under mpiexec), so both use the same
cores. Each row: prefill and decode tok/s, the weights a rank holds, the share of a decode step spent
in collectives, and µs per all-reduce inside decode (alone, an all-reduce of `dim` values costs a few
µs here: the rest is waiting for the slower rank). engine/parallel/measure.py does the measuring.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

from minillm.errors import MiniLLMError


def _weights_dir(model: str, random_weights: bool, tmp: str) -> Path:
    """An HF-layout folder the ranks can each map: the model's, or random weights of a preset's shape."""
    from minillm.checkpoints.pull import resolve
    from minillm.model.config import PRESETS
    if random_weights:
        from minillm.checkpoints.quantize import write_random_checkpoint
        if model not in PRESETS:
            raise MiniLLMError(f"--random-weights needs a preset name, not {model!r}")
        return write_random_checkpoint(PRESETS[model].config, tmp, dtype="float32")
    path = Path(model) if Path(model).is_dir() else resolve(model)
    if path.suffix == ".gguf" or not (path / "config.json").is_file():
        raise MiniLLMError(f"bench --tp reads an HF-layout weights folder; convert {model} first (minillm convert)")
    return path


def run_cli(model: str, tp: int, random_weights: bool, prompt_tokens: int, new_tokens: int,
            echo: Callable[[str], None] = print) -> int:
    """Measure tp = 1 (tp threads) and tp = N (1 thread a rank); print the table; -> exit code."""
    from minillm.checkpoints.weights import read_config
    from minillm.engine.parallel import sharding
    from minillm.engine.parallel.measure import measure
    with tempfile.TemporaryDirectory() as tmp:
        path = _weights_dir(model, random_weights, tmp)
        sharding.check(read_config(path), tp)           # one line naming the sizes that work
        rows = [(f"tp=1, {tp} threads", measure(path, 1, tp, prompt_tokens, new_tokens)),
                (f"tp={tp}, 1 thread a rank", measure(path, tp, 1, prompt_tokens, new_tokens))]
    echo(f"{model}: prompt {prompt_tokens} tokens, {new_tokens} decoded")
    echo(f"{'run':<24} {'prefill tok/s':>13} {'decode tok/s':>12} {'MB/rank':>8} {'comm share':>10} {'µs/all-reduce':>13}")
    for name, m in rows:
        echo(f"{name:<24} {m['prefill_tok_s']:>13.1f} {m['decode_tok_s']:>12.2f} {m['weights_bytes_per_rank'] / 1e6:>8.0f} "
             f"{100 * m['comm_share']:>9.0f}% {m['all_reduce_us']:>13.0f}")
    alone = rows[1][1].get("all_reduce_us_by_size", {})
    if alone:
        echo("one all-reduce alone: " + ", ".join(f"{n} values {us:.1f} µs" for n, us in alone.items()))
    return 0
