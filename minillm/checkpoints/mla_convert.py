"""Convert a GQA model (Llama, SmolLM2, Mistral without its window) to multi-head latent attention by SVD.

The problem. MLA caches a latent c_KV from which keys and values are expanded, plus a small RoPE key
shared by all heads ("decoupled" RoPE: mla.py). A Llama model rotates *every* key dimension, so no
key dimension may move into the un-rotated latent without changing the model. We want the converted
model to be exact at full rank, so the keys stay rotated and the compression must commute with RoPE.

The design.
  Values: the latent. W_V [n_kv·hd, dim] = U S Vᵀ; keep r singular directions:
      W_DKV = S_r V_rᵀ   [r, dim]        (kv_a_proj's latent rows; no latent norm: a norm would
      W_UV  = U_r        [n_kv·hd, r]     divide by a per-token RMS the factors cannot undo)
  and every query head h reads its group's rows of W_UV (GQA's sharing becomes duplicated rows).
  Keys: the shared RoPE key, compressed across heads within each frequency. RoPE rotates pair j of
  every KV head by the same angle, so any mixing of the heads that is the same for both members of
  a pair commutes with the rotation. For each pair j, stack its two rows from all n_kv heads,
      K_j = W_K[heads, (j, j + hd/2), :] as [n_kv, 2·dim] = A_j B_j   (SVD, rank r_k ≤ n_kv)
  The cache keeps B_j·x (r_k rotated pairs per frequency: rope width hd·r_k), and query head h of
  group g takes A_j[g, s]·q_h,j as its part for latent pair (j, s), so q_h·k_g is unchanged at
  r_k = n_kv. The RoPE table repeats each source frequency r_k times (rope_type "repeat").
  There is no q_nope/k_nope (qk_nope_head_dim = 0), and q is scaled by √(rope width / hd) so MLA's
  1/√(rope width) softmax scale equals Llama's 1/√hd.

Cache per token and layer: r + hd·r_k values, against GQA's 2·n_kv·hd. Full rank (r = n_kv·hd,
r_k = n_kv) costs the same as GQA and reproduces it; r and r_k trade memory for error.
The SVDs are of the weights alone (no calibration data): the simplest defensible choice; a
data-aware factorization (SVD of W·X over real activations) would lose less at the same rank.
The result runs in minillm's MLA path (naive and absorbed); HF cannot load it.

    python -m minillm.checkpoints.mla_convert [MODEL] --ranks 48 96 192 --key-ranks 1 2 3   # prints error vs rank
"""
from __future__ import annotations

import argparse

import numpy as np

from minillm.backend import as_f32
from minillm.model.config import ModelConfig
from minillm.model.transformer import Transformer
from minillm.checkpoints.pull import resolve
from minillm.checkpoints.reader import read_checkpoint


def convert_to_mla(config: ModelConfig, tensors: dict[str, np.ndarray], kv_rank: int,
                   key_rank: int | None = None) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(MLA config, HF-named tensors) of a GQA model: values through a rank-`kv_rank` latent, keys
    through `key_rank` (default n_kv_heads: uncompressed) shared RoPE key heads per frequency."""
    c = config
    hd, n_kv, H = c.head_dim, c.n_kv_heads, c.n_heads
    key_rank = n_kv if key_rank is None else key_rank
    if c.attention != "gqa" or c.sliding_window is not None:
        raise ValueError("convert_to_mla needs a full-attention GQA model (no sliding window)")
    if not 1 <= key_rank <= n_kv or not 1 <= kv_rank <= min(n_kv * hd, c.dim):
        raise ValueError(f"ranks out of range: key_rank {key_rank} in 1..{n_kv}, "
                         f"kv_rank {kv_rank} in 1..{min(n_kv * hd, c.dim)}")
    rope = hd * key_rank
    mla = c.replace(attention="mla", family="deepseek_v3", q_lora_rank=None, kv_lora_rank=kv_rank,
                    qk_nope_head_dim=0, qk_rope_head_dim=rope, v_head_dim=hd, rope_interleave=False,
                    rope_scaling={"rope_type": "repeat", "head_dim": hd, "repeat": key_rank,
                                  "base": c.rope_scaling})
    out = {k: v for k, v in tensors.items() if ".self_attn." not in k}
    for i in range(c.n_layers):
        p = f"model.layers.{i}.self_attn."
        wq, wk, wv = (as_f32(tensors[p + n + "_proj.weight"]) for n in "qkv")
        w_down, w_uv = _value_latent(wv, kv_rank)                          # [r, dim], [n_kv * hd, r]
        k_rope, mix = _shared_rope_key(wk, n_kv, hd, key_rank)             # [rope, dim], [hd/2, n_kv, r_k]
        out[p + "q_proj.weight"] = _rope_queries(wq, mix, H, n_kv, hd) * np.sqrt(rope / hd)  # [H * rope, dim]
        out[p + "kv_a_proj_with_mqa.weight"] = np.concatenate([w_down, k_rope])             # [r + rope, dim]
        group = np.arange(H) // (H // n_kv)                                # each query head's KV head
        out[p + "kv_b_proj.weight"] = w_uv.reshape(n_kv, hd, kv_rank)[group].reshape(H * hd, kv_rank)
        out[p + "o_proj.weight"] = tensors[p + "o_proj.weight"]
    return mla, out


def _value_latent(wv: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """W_V ≈ W_UV · W_DKV, the best rank-`rank` factorization in the Frobenius norm."""
    u, s, vt = np.linalg.svd(wv, full_matrices=False)                      # [n_kv*hd, k], [k], [k, dim]
    return (s[:rank, None] * vt[:rank]).astype(np.float32), u[:, :rank].astype(np.float32)


def _shared_rope_key(wk: np.ndarray, n_kv: int, hd: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Per frequency pair j, factor the n_kv heads' rows K_j = A_j B_j; B_j become the cached key.

    -> B as rows in RoPE's half-split order [2 · hd/2 · rank, dim]; A [hd/2, n_kv, rank]
    """
    dim = wk.shape[1]
    pairs = wk.reshape(n_kv, 2, hd // 2, dim).transpose(2, 0, 1, 3)        # [hd/2, n_kv, 2, dim]
    u, s, vt = np.linalg.svd(pairs.reshape(hd // 2, n_kv, 2 * dim), full_matrices=False)
    mix = u[:, :, :rank]                                                   # [hd/2, n_kv, rank]   A_j
    latent = (s[:, :rank, None] * vt[:, :rank]).reshape(hd // 2, rank, 2, dim)   # B_j
    # Row (half c, pair j, latent head s) sits at c · (hd/2 · rank) + j · rank + s: pair j·rank + s
    # rotates with frequency j, matching np.repeat(inv_freq, rank) (mla.mla_rope, "repeat").
    rows = latent.transpose(2, 0, 1, 3).reshape(2 * (hd // 2) * rank, dim)
    return rows.astype(np.float32), mix.astype(np.float32)


def _rope_queries(wq: np.ndarray, mix: np.ndarray, H: int, n_kv: int, hd: int) -> np.ndarray:
    """Query head h (group g) scores latent pair (j, s) with A_j[g, s] · q_h,j.  -> [H * rope, dim]"""
    dim, rank = wq.shape[1], mix.shape[2]
    q = wq.reshape(H, 2, hd // 2, dim)                                     # [H, 2, hd/2, dim]
    group_mix = mix.transpose(1, 0, 2)[np.arange(H) // (H // n_kv)]        # [H, hd/2, rank]
    rows = q[:, :, :, None, :] * group_mix[:, None, :, :, None]            # [H, 2, hd/2, rank, dim]
    return rows.reshape(H * 2 * (hd // 2) * rank, dim).astype(np.float32)


# ---- measuring what the ranks cost -------------------------------------------------------------

def rank_sweep(config: ModelConfig, tensors: dict[str, np.ndarray], ids, ranks, key_ranks=(None,),
               mode: str = "absorbed") -> list[dict]:
    """For each (kv_rank, key_rank): cache bytes per token (fp16) and logit error vs the source model
    (max |Δ|, and RMS(Δ) / RMS(logits), which falls more smoothly with rank)."""
    source = Transformer(config, tensors)
    ref = source.prefill(ids, source.new_cache(len(ids)), all_logits=True)  # [T, vocab]
    rows = []
    for key_rank in key_ranks:
        for r in ranks:
            mla_config, mla_tensors = convert_to_mla(config, tensors, r, key_rank)
            model = Transformer(mla_config, mla_tensors, mla_mode=mode)
            got = model.prefill(ids, model.new_cache(len(ids)), all_logits=True)
            rows.append(dict(kv_rank=r, key_rank=mla_config.qk_rope_head_dim // config.head_dim,
                             bytes_per_token=mla_config.kv_bytes_per_token(2),
                             gqa_bytes_per_token=config.kv_bytes_per_token(2),
                             max_abs_err=float(np.abs(got - ref).max()),
                             rel_rms_err=float(np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref ** 2))),
                             top1_agree=float(np.mean(got.argmax(-1) == ref.argmax(-1)))))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--ranks", type=int, nargs="+", default=None, help="latent (value) ranks r")
    ap.add_argument("--key-ranks", type=int, nargs="+", default=None, help="RoPE key heads per frequency")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args(argv)
    cfg, tensors, tokenizer = read_checkpoint(resolve(args.model))
    full = min(cfg.n_kv_heads * cfg.head_dim, cfg.dim)
    ranks = args.ranks or sorted({max(1, full // 8), full // 4, full // 2, full})
    key_ranks = args.key_ranks or list(range(1, cfg.n_kv_heads + 1))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, args.tokens).tolist()
    if tokenizer is not None:
        text = "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away, "
        ids = (tokenizer.encode(text * 4))[:args.tokens]
    print(f"{args.model}: GQA cache {cfg.kv_bytes_per_token(2):,} B/token (fp16); {len(ids)} tokens")
    print(f"{'r':>5} {'r_k':>4} {'B/token':>9} {'vs GQA':>7} {'max|Δlogit|':>12} {'rel RMS':>9} {'top-1 agree':>12}")
    for row in rank_sweep(cfg, tensors, ids, ranks, key_ranks):
        print(f"{row['kv_rank']:>5} {row['key_rank']:>4} {row['bytes_per_token']:>9,} "
              f"{row['bytes_per_token'] / row['gqa_bytes_per_token']:>7.0%} {row['max_abs_err']:>12.2e} "
              f"{row['rel_rms_err']:>9.2e} "
              f"{row['top1_agree']:>12.0%}")


if __name__ == "__main__":
    main()
