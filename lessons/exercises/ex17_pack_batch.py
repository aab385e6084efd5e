"""Exercise 17 (lesson 17): pack a batch of sequences, each at its own length, into one token matrix.

Write `pack_batch` below, then check it:
    minillm exercise check 17          (in a clone: pytest lessons/exercises --exercise 17)
The grader compares it with the engine's `minillm.engine.batched.pack`.
"""
import numpy as np


def pack_batch(chunks: list[tuple[list[int], int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One continuous-batching step runs several sequences' new tokens as ONE matrix, so every
    projection is one GEMM. Each chunk is (token_ids, start): a prompt (or a piece of it), or the
    single token a decode step feeds back; `start` is the position of its first token (how many
    positions of that sequence are already in the KV cache).

    returns (tokens, positions, last_rows):
      tokens     int64 [N]  every chunk's token ids, one chunk after another (N = total tokens)
      positions  int64 [N]  the position of each token in its own sequence (RoPE needs it)
      last_rows  int64 [B]  for each chunk, the row of its last token in `tokens`: that row's
                            logits predict the chunk's next token
    """
    raise NotImplementedError("write pack_batch: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex17_pack_batch.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(17, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
