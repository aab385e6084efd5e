"""Student mode: the real model runs on a student's own pieces (`minillm generate --student DIR`).

DIR is a handout folder: the pieces are the exercises' functions (ex01_rmsnorm.py's `rmsnorm`, ...), with
the exercises' contracts, plugged into the engine's seam (model/pieces.py) of a copy of the model that
shares its weights. The engine's own copy runs beside it on the same tokens, so every logit is compared,
and a wrong piece is found as the first layer and position where the hidden state leaves the reference.

This run is the student's own, local and ungraded: it imports their files into this process (nothing
is confined, unlike `minillm exercise grade`). A stub still raising NotImplementedError is left out
(the engine's own piece runs), and said so.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from minillm.course.grader import exercise_files, load_exercise
from minillm.engine.sampling import top_p_filter
from minillm.errors import MiniLLMError
from minillm.model.kv_cache import KVCache
from minillm.model.pieces import Pieces
from minillm.model.quant import Int8Weight, quantize_int8

LOGIT_TOLERANCE = 1e-3     # max |Δ| of the logits against the engine's own (fp32 reorderings stay near 1e-5)
HIDDEN_TOLERANCE = 1e-4    # per layer, relative to the row's largest value: where a wrong piece shows first
INT8_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@dataclass(frozen=True)
class PieceSpec:
    exercise: str              # "01"
    function: str              # the function the exercise file defines
    role: str                  # what it does in the engine
    needs: str                 # which run uses it
    probe: Callable            # a tiny call: NotImplementedError means a stub not written yet


SPECS = [
    PieceSpec("01", "rmsnorm", "RMSNorm (every layer's two norms, the final norm)", "generate",
              lambda f: f(np.ones((1, 4), np.float32), np.ones(4, np.float32), 1e-5)),
    PieceSpec("02", "kv_cache_update", "the KV-cache write", "generate",
              lambda f: f(*np.zeros((2, 1, 4, 2), np.float32), *np.ones((2, 1, 1, 2), np.float32), 0)),
    PieceSpec("02.2", "attend_over_cache", "attention over the cache", "generate",
              lambda f: f(*np.ones((3, 1, 1, 2), np.float32))),
    PieceSpec("03", "apply_rope", "RoPE on queries and keys", "generate",
              lambda f: f(np.ones((1, 1, 4), np.float32), np.ones((1, 2), np.float32), np.zeros((1, 2), np.float32))),
    PieceSpec("04", "top_p_filter", "top-p on each step's logits", "generate without --speculative",
              lambda f: f(np.array([0.0, 1.0]), 0.9)),
    PieceSpec("08", "quantize_int8_per_row", "the int8 weight quantizer", "generate --quant int8",
              lambda f: f(np.ones((2, 4), np.float32))),
    PieceSpec("16", "gather_through_block_table", "the paged gather", "serve --student or the Engine",
              lambda f: f(np.zeros((2, 2, 1, 2), np.float32), [0], 1)),
    PieceSpec("17", "pack_batch", "the batch packing", "serve --student or the Engine",
              lambda f: f([([1, 2], 0)])),
    PieceSpec("20", "speculative_step", "the speculative accept step", "generate --speculative with --temperature > 0",
              lambda f: f(np.array([0.5, 0.5]), np.array([0.5, 0.5]), 0)),
]


class StudentPieceError(MiniLLMError):
    """A student's piece raised during the run: names the piece and its file."""


@dataclass
class Piece:
    spec: PieceSpec
    file: Path
    function: Callable
    calls: int = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        try:
            return self.function(*args, **kwargs)
        except Exception as e:
            raise StudentPieceError(f"your {self.spec.function} ({self.file.name}) raised {type(e).__name__}: "
                                    f"{e}") from None


@dataclass
class StudentPieces:
    """The pieces found in DIR: the student's (by exercise id), and the stubs left to the engine."""
    folder: Path
    pieces: dict[str, Piece] = field(default_factory=dict)
    stubs: list[str] = field(default_factory=list)         # exercise files still raising NotImplementedError

    def engine_pieces(self) -> Pieces:
        """The model's seam (model/pieces.py) with the student's functions where DIR has them."""
        swaps = {}
        if "01" in self.pieces:
            swaps["rmsnorm"] = self.pieces["01"]
        if "03" in self.pieces:
            swaps["apply_rope"] = self.pieces["03"]
        if "02" in self.pieces:
            update = self.pieces["02"]
            swaps["cache_append"] = lambda cache, layer, k, v: _student_append(update, cache, layer, k, v)
        if "02.2" in self.pieces:
            attend = self.pieces["02.2"]
            swaps["attention"] = lambda q, keys, values, window, sinks=None: _student_attention(
                attend, q, keys, values, window, sinks)
        if "16" in self.pieces:
            gather = self.pieces["16"]
            swaps["paged_read"] = lambda pool, layer, table, length, first=0: _student_read(
                gather, pool, layer, table, length, first)
        if "17" in self.pieces:
            pack = self.pieces["17"]
            swaps["pack_batch"] = lambda chunks: pack([(list(c.token_ids), c.start) for c in chunks])
        if "20" in self.pieces:
            swaps["speculative_rule"] = _student_rule(self.pieces["20"])
        return dataclasses.replace(Pieces(), **swaps)

    def summary(self) -> list[str]:
        lines = [f"student mode: the pieces in {self.folder} run inside this process (imported, not isolated): "
                 f"your own run, local and ungraded"]
        yours = [f"{n} {p.spec.function}" for n, p in self.pieces.items()]
        lines.append(f"  yours:    {', '.join(yours) if yours else 'none (no exercise file written yet)'}")
        if self.stubs:
            lines.append(f"  not written yet (the engine's own runs): {', '.join(self.stubs)}")
        lines.append("  always the engine's: the embedding, the matmuls, SwiGLU")
        return lines

    def usage(self) -> list[str]:
        used = [f"{p.spec.function} ({p.calls} calls)" for p in self.pieces.values() if p.calls]
        unused = [f"{p.spec.function} (needs {p.spec.needs})" for p in self.pieces.values() if not p.calls]
        return [f"used by this run: {', '.join(used) if used else 'none of yours'}",
                f"not used by this run: {', '.join(unused) if unused else 'none'}"]


def _student_append(update: Piece, cache, layer: int, k_new, v_new):
    """The student's kv_cache_update on one layer of the engine's KVCache (the positions advance once
    per forward, after the last layer, as the engine's append)."""
    if type(cache) is not KVCache or cache.k.dtype != np.float32:      # not a ring buffer, not int8 codes
        raise MiniLLMError("the student's KV-cache write runs on the plain fp32 cache only (no sliding window, "
                           "no --kv-cache)")
    return update(cache.k[layer], cache.v[layer], k_new, v_new, cache.length)


def _student_attention(attend: Piece, q, keys, values, window, sinks):
    """The student's attend_over_cache in the engine's attention call (causal, no window, no sinks)."""
    if window is not None or sinks is not None:
        raise MiniLLMError("this model's attention has a sliding window or sinks, which attend_over_cache "
                           "does not take: run student mode on SmolLM2 or another Llama")
    return attend(q, keys, values)


def _student_read(gather: Piece, pool, layer: int, block_table, length: int, first_block: int):
    """The student's gather_through_block_table as the paged pool's read (fp32 pools; keys from
    first_block on, as PagedKVCache.read).   -> keys, values [n_kv, n, hd]"""
    if pool.dtype != "float32":
        raise MiniLLMError("the student's paged gather reads the fp32 pool only (drop --kv-cache)")
    skip = first_block * pool.block_size
    return tuple(gather(a[layer], list(block_table), length)[:, skip:] for a in (pool.k, pool.v))


def _student_rule(step: Piece) -> tuple:
    """The student's speculative_step(p, q, token) -> (a, residual) as acceptance.accept_draft's pair of
    functions; a deterministic drafter's q (None) becomes the one-hot the exercise's contract takes."""
    def dense(p, q, token):
        return np.eye(len(p))[token] if q is None else q

    def acceptance(p, q, token):
        return float(step(p.copy(), dense(p, q, token), token)[0])

    def residual(p, q, token):
        return np.asarray(step(p.copy(), dense(p, q, token), token)[1], dtype=np.float64)
    return acceptance, residual


def student_llm(llm, folder: str | Path):
    """`llm` on the student's pieces of `folder` (the same weights): what `serve --student` and
    `Engine(student_llm(llm, DIR))` run. -> (the LLM, the StudentPieces, to print what ran)"""
    from minillm.llm import LLM, on_gpu
    pieces = find_pieces(folder)
    if llm.config.attention != "gqa" or getattr(llm.model, "comm", None) is not None or on_gpu(llm.model):
        raise MiniLLMError("student mode runs Llama-style (GQA) models on one CPU process (no MLA, --tp, cuda)")
    model = llm.model.with_options()
    model.pieces = pieces.engine_pieces()
    return LLM(llm.config, model, llm._tokenizer, llm.name, llm.chat_default), pieces


def find_pieces(folder: str | Path) -> StudentPieces:
    """Load the exercise files of `folder` that implement engine pieces; a stub is left to the engine."""
    folder = Path(folder)
    if not folder.is_dir():
        raise MiniLLMError(f"--student {folder}: not a folder (give your handout folder, with your exNN_*.py)")
    found = StudentPieces(folder)
    for spec in SPECS:
        files = exercise_files(folder, spec.exercise)
        if not files:
            continue
        fn = getattr(load_exercise(spec.exercise, files[0]), spec.function, None)
        if fn is None:
            raise MiniLLMError(f"{files[0]} has no function {spec.function}()")
        try:
            spec.probe(fn)
        except NotImplementedError:
            found.stubs.append(f"{spec.exercise} {spec.function}")
            continue
        except Exception:           # a real bug: the run shows where (a probe's toy input proves nothing)
            pass
        found.pieces[spec.exercise] = Piece(spec, files[0], fn)
    return found


# ---- the run -----------------------------------------------------------------------------------------------------

@dataclass
class Divergence:
    layer: int | None          # None: the final norm and head
    position: int
    error: float


@dataclass
class StudentRun:
    tokens: list[int]                      # the new tokens, as the student's pieces picked them
    max_error: float                       # max |Δ| of the logits, every step
    divergence: Divergence | None          # where the hidden state first left the reference, when it did
    top_p_mismatch: str = ""               # the first step where the student's top-p kept other tokens

    @property
    def matches(self) -> bool:
        return self.max_error <= LOGIT_TOLERANCE and not self.top_p_mismatch


def student_model(model, pieces: StudentPieces, quant: str | None = None):
    """(reference, student): copies of `model` sharing its weights, one on the engine's pieces, one on
    the student's. quant "int8": both re-quantize the layer matrices, each with its own quantizer."""
    if model.config.attention != "gqa" or getattr(model, "comm", None) is not None:
        raise MiniLLMError("student mode runs Llama-style (GQA) models on one process (no MLA, no --tp)")
    reference, student = model.with_options(), model.with_options()      # copies sharing the weights
    student.pieces = pieces.engine_pieces()
    if quant == "int8":
        student_q = pieces.pieces.get("08")
        reference.layers = [_int8_layer(layer, quantize_int8) for layer in model.layers]
        student.layers = [_int8_layer(layer, _student_int8(student_q) if student_q else quantize_int8)
                          for layer in model.layers]
    elif quant is not None:
        raise MiniLLMError(f"student mode quantizes with --quant int8 only, not {quant}")
    return reference, student


def _int8_layer(layer, quantize):
    parts = {name: quantize(getattr(layer, name)) for name in INT8_MATRICES}
    return dataclasses.replace(layer, wqkv=None, w_gate_up=None, **parts)


def _student_int8(piece: Piece) -> Callable:
    def quantize(w):
        w = np.asarray(w, dtype=np.float32)
        got = piece(w.copy())
        if not (isinstance(got, tuple) and len(got) == 2):
            raise StudentPieceError(f"your {piece.spec.function} returned {type(got).__name__}, not (q, scales)")
        q, scales = got
        if getattr(q, "dtype", None) != np.int8 or q.shape != w.shape or np.shape(scales) != (w.shape[0],):
            raise StudentPieceError(f"your {piece.spec.function} returned q {getattr(q, 'dtype', '?')} "
                                    f"{list(np.shape(q))} and scales {list(np.shape(scales))}: expected int8 "
                                    f"{list(w.shape)} and [{w.shape[0]}]")
        return Int8Weight(q, np.asarray(scales, dtype=np.float32))
    return quantize


def run_student(reference, student, pieces: StudentPieces, prompt_ids: list[int], max_tokens: int,
                top_p: float = 0.9, stop_ids=()) -> StudentRun:
    """Prefill the prompt, then decode greedily, on both models layer by layer in lockstep; the student's
    model picks the tokens (its top-p filters each step's logits first) and the reference is fed them too."""
    n = len(prompt_ids) + max_tokens
    ref_cache, stu_cache = reference.new_cache(n), student.new_cache(n)
    divergence, ref_logits, logits = _side_by_side(reference, student, prompt_ids, ref_cache, stu_cache)
    max_error = float(np.abs(logits - ref_logits).max())
    user_top_p = pieces.pieces.get("04")
    tokens, top_p_mismatch = [], ""
    for step in range(max_tokens):
        if user_top_p is not None:
            kept = np.asarray(user_top_p(logits.astype(np.float64), top_p))
            want = top_p_filter(logits.astype(np.float64), top_p)
            if kept.shape != want.shape or not np.array_equal(np.isfinite(kept), np.isfinite(want)):
                top_p_mismatch = top_p_mismatch or (f"step {step}: your top_p_filter kept "
                                                    f"{int(np.isfinite(kept).sum())} tokens at p={top_p}, "
                                                    f"the engine's {int(np.isfinite(want).sum())}")
            token = int(np.argmax(kept))
        else:
            token = int(np.argmax(logits))
        tokens.append(token)
        if token in stop_ids or step == max_tokens - 1:
            break
        off, ref_logits, logits = _side_by_side(reference, student, [token], ref_cache, stu_cache)
        max_error = max(max_error, float(np.abs(logits - ref_logits).max()))
        divergence = divergence or off
    return StudentRun(tokens, max_error, divergence, top_p_mismatch)


def _side_by_side(reference, student, ids, ref_cache, stu_cache):
    """The forward pass's layer loop (Transformer.forward) over `ids` after the caches' positions, on both
    models in lockstep, comparing the hidden state after each layer.
    -> (first divergence or None, reference logits [vocab], student's [vocab]) at the last position"""
    tokens, start = np.asarray(ids, dtype=np.int64), ref_cache.length
    ropes = reference.rope(np.arange(start, start + len(tokens)))     # [(cos, sin) [T, hd/2]] per layer
    x_ref, x_stu = reference.embed_tokens(tokens), student.embed_tokens(tokens)   # [T, dim] each
    divergence = None
    for i, layer in enumerate(reference.layers):
        states = []
        sides = ((reference, x_ref, ref_cache, layer), (student, x_stu, stu_cache, student.layers[i]))
        for model, x, cache, own in sides:
            x = model.add_residual(x, model.attend(x, own, i, cache, *ropes[i]), own.attn_out_norm)
            states.append(model.add_residual(x, model.ffn(x, own), own.mlp_out_norm))   # [T, dim]
        x_ref, x_stu = states
        divergence = divergence or _first_row_off(x_ref, x_stu, i, start)
    ref_cache.advance(len(tokens))
    stu_cache.advance(len(tokens))
    ref_logits, logits = reference.head(x_ref[-1:])[0], student.head(x_stu[-1:])[0]   # [vocab] each
    error = float(np.abs(logits - ref_logits).max())
    if divergence is None and not error <= LOGIT_TOLERANCE:
        divergence = Divergence(None, start + len(tokens) - 1, error)
    return divergence, ref_logits, logits


def _first_row_off(x_ref: np.ndarray, x_stu: np.ndarray, layer: int, start: int) -> Divergence | None:
    """The first row (position start + row) whose hidden state is off by more than HIDDEN_TOLERANCE."""
    scale = np.maximum(1.0, np.abs(x_ref).max(axis=-1))                         # [T]
    error = np.abs(x_stu.astype(np.float64) - x_ref).max(axis=-1)              # [T]
    off = np.flatnonzero(~(error <= HIDDEN_TOLERANCE * scale))                  # NaN counts as off
    return Divergence(layer, start + int(off[0]), float(error[off[0]])) if len(off) else None


def report_lines(run: StudentRun, pieces: StudentPieces, prompt_ids: list[int], decode_text: Callable) -> list[str]:
    """What `generate --student` prints after the text: the comparison, where it left, the pieces used."""
    verdict = "match" if run.max_error <= LOGIT_TOLERANCE else "DIFFER"
    lines = [f"logits vs the engine's own pieces: max |Δ| {run.max_error:.2g} over {len(prompt_ids)} prompt "
             f"positions and {len(run.tokens)} new tokens (tolerance {LOGIT_TOLERANCE:g}): {verdict}"]
    d = run.divergence
    if d is not None and run.max_error > LOGIT_TOLERANCE:
        ids = list(prompt_ids) + run.tokens
        token = repr(decode_text([ids[d.position]])) if d.position < len(ids) else "?"
        where = f"layer {d.layer}" if d.layer is not None else "the final norm and head"
        lines.append(f"your pieces leave the reference first at {where}, position {d.position} (token {token}): "
                     f"max |Δ| {d.error:.3g} in the hidden state there")
    if run.top_p_mismatch:
        lines.append(f"top-p differs: {run.top_p_mismatch}")
    return lines + pieces.usage()


def generate_cli(folder, prompt: str, model: str, quant: str | None, max_tokens: int, top_p: float | None,
                 chat: bool | None, echo: Callable, speculative: str | None = None, draft_tokens: int | None = None,
                 temperature: float = 0.0, seed: int | None = None) -> int:
    """`minillm generate --student DIR PROMPT`: load, run on the student's pieces beside the engine's,
    print the text and the comparison. -> exit code (1 when the student's run leaves the engine's)."""
    from minillm.llm import load
    if quant not in (None, "int8"):
        raise MiniLLMError(f"student mode quantizes with --quant int8 only (your exercise 08), not {quant}")
    pieces = find_pieces(folder)
    for line in pieces.summary():
        echo(line, err=True)
    llm = load(model, quant=None if quant == "int8" else quant)
    reference, student = student_model(llm.model, pieces, quant)
    ids = llm.prompt_ids(prompt, chat=llm.chat_default if chat is None else chat)
    stop_ids = set(llm.tokenizer.eos_ids) | set(llm.config.eos_token_ids)
    try:
        if speculative is not None:
            return _speculative_cli(llm, reference, student, pieces, ids, max_tokens, stop_ids, echo,
                                    speculative, draft_tokens, llm.sampling_params(temperature, top_p=top_p, seed=seed))
        run = run_student(reference, student, pieces, ids, max_tokens, 0.9 if top_p is None else top_p, stop_ids)
    except MiniLLMError:
        raise
    except Exception as e:          # a piece returned something the engine cannot use: one line, not a traceback
        raise MiniLLMError(f"the forward pass failed on your pieces ({type(e).__name__}: {e}); check each with "
                           f"`minillm exercise check N`") from None
    echo(llm.tokenizer.decode(run.tokens))
    for line in report_lines(run, pieces, ids, llm.tokenizer.decode):
        echo(line, err=True)
    return 0 if run.matches else 1


def _speculative_cli(llm, reference, student, pieces, ids, max_tokens, stop_ids, echo, speculative, draft_tokens,
                     params) -> int:
    """Speculative sampling (engine/speculative/decode.py) twice with the same seed, on the engine's
    pieces and on the student's (their accept step among them): the same tokens, or where they part."""
    tokens = [speculative_tokens(llm, model, ids, max_tokens, stop_ids, speculative, draft_tokens, params)
              for model in (reference, student)]
    echo(llm.tokenizer.decode(tokens[1]))
    same = tokens[0] == tokens[1]
    part = next((i for i, (a, b) in enumerate(zip(*tokens)) if a != b), min(map(len, tokens)))
    echo(f"speculative sampling (seed {params.seed}) on your pieces vs the engine's: "
         + ("the same tokens" if same else f"DIFFER from new token {part}"), err=True)
    for line in pieces.usage():
        echo(line, err=True)
    return 0 if same else 1


def speculative_tokens(llm, model, ids, max_tokens, stop_ids, speculative, draft_tokens, params) -> list[int]:
    """The new tokens of one speculative run of `model` (a copy of llm's, with its pieces)."""
    from minillm.engine.speculative.decode import generate_speculative
    from minillm.llm import LLM
    drafter = LLM(llm.config, model, llm._tokenizer, llm.name).drafter(speculative)
    k = drafter.default_k if draft_tokens is None else draft_tokens
    return generate_speculative(model, drafter, ids, max_tokens, params, k, stop_ids=stop_ids).token_ids


def refused_with_student(**given: bool) -> None:
    """Options student mode does not run (a plain greedy CPU run): refused in one line."""
    names = [f"--{name.replace('_', '-')}" for name, on in given.items() if on]
    if names:
        raise MiniLLMError(f"--student runs on the CPU with the default cache, decoding greedily (sampling with "
                           f"--speculative); it does not run with {', '.join(names)}")
