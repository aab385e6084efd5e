"""Exercise 27, constrained decoding: the token mask of one DFA state. A grammar is a state machine over bytes;
a token is allowed in a state if reading all its bytes from there never leaves the machine (lesson 27)."""
from __future__ import annotations

import numpy as np

from minillm.course.cases import Case, CaseFailed, case_rng, expect_unchanged

DEAD = -1          # a transition the grammar has not: the token that takes it can never be sampled


def dfa_token_mask_reference(transitions: np.ndarray, state: int, token_bytes: np.ndarray,
                             token_lengths: np.ndarray) -> np.ndarray:
    """Every token walked through the DFA at once, one byte position a step.

    transitions: int [n_states, 256] (DEAD: none), token_bytes: uint8 [vocab, max_len] left-aligned,
    token_lengths: int [vocab]   -> bool [vocab]: the tokens whose bytes all have a transition from `state`."""
    n_states = transitions.shape[0]
    table = np.vstack([np.where(transitions == DEAD, n_states, transitions),    # DEAD -> a sink state n_states
                       np.full((1, 256), n_states)]).astype(np.int64)          # [n_states + 1, 256]
    at = np.full(len(token_lengths), state, dtype=np.int64)                    # [vocab] each token's state
    for j in range(token_bytes.shape[1]):
        walking = token_lengths > j                                            # tokens with a byte at j
        at[walking] = table[at[walking], token_bytes[walking, j]]
    return (at != n_states) & (token_lengths > 0)               # a token with no bytes moves nothing: never


def token_table(tokens: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """A vocabulary's bytes as arrays: uint8 [vocab, max_len] (left-aligned, zero-padded), int32 [vocab]."""
    width = max((len(t) for t in tokens), default=1) or 1
    table = np.zeros((len(tokens), width), dtype=np.uint8)
    for i, t in enumerate(tokens):
        table[i, :len(t)] = np.frombuffer(t, dtype=np.uint8)
    return table, np.array([len(t) for t in tokens], dtype=np.int32)


def digits_unit_dfa() -> tuple[np.ndarray, np.ndarray]:
    """The regex `[0-9]+ (kg|g)` as a DFA: (transitions int32 [5, 256], accepting bool [5]).

    0 --digit--> 1 --digit--> 1 --" "--> 2 --"k"--> 3 --"g"--> 4 (accepting)
                                         2 --"g"---------------> 4"""
    t = np.full((5, 256), DEAD, dtype=np.int32)
    digits = np.frombuffer(b"0123456789", dtype=np.uint8)
    t[0, digits] = 1
    t[1, digits] = 1
    t[1, ord(" ")] = 2
    t[2, ord("k")] = 3
    t[2, ord("g")] = 4
    t[3, ord("g")] = 4
    return t, np.array([False, False, False, False, True])


UNIT_TOKENS = [b"", b"1", b"12", b"123", b"7 ", b"0 k", b" ", b" k", b" kg", b"kg", b"k", b"g", b"gram", b"kg ",
               b"9", b"a", b" 5", b"42 g", b"\xff", b"g\x00"]


def _mask_cases() -> list[Case]:
    rng = case_rng(27)
    dfa, _ = digits_unit_dfa()
    table, lengths = token_table(UNIT_TOKENS)
    cases = [Case(f"`[0-9]+ (kg|g)` in state {s}{note}", dict(transitions=dfa, state=s, token_bytes=table,
                                                               token_lengths=lengths))
             for s, note in ((0, " (start: digits only)"), (1, " (after a digit)"), (2, " (after the space)"),
                             (4, " (accepting: nothing may follow)"))]

    def random_dfa(name, n_states, vocab, max_len, alphabet):
        t = np.full((n_states, 256), DEAD, dtype=np.int32)
        letters = np.frombuffer(alphabet, dtype=np.uint8)
        for s in range(n_states):
            taken = rng.choice(letters, size=rng.integers(1, len(letters) + 1), replace=False)
            t[s, taken] = rng.integers(0, n_states, size=len(taken))
        lengths = rng.integers(0, max_len + 1, size=vocab).astype(np.int32)
        table = np.zeros((vocab, max_len), dtype=np.uint8)
        for i, n in enumerate(lengths):
            table[i, :n] = rng.choice(letters, size=n)
            table[i, n:] = rng.choice(letters, size=max_len - n)      # padding that is not zero: never read it
        return Case(name, dict(transitions=t, state=int(rng.integers(0, n_states)), token_bytes=table,
                               token_lengths=lengths))
    cases += [random_dfa("a random 6-state DFA over 'abc', 300 tokens of 0..5 bytes", 6, 300, 5, b"abc"),
              random_dfa("a random 20-state DFA over 8 letters, 2,000 tokens of up to 8 bytes (padding is "
                         "not zeros)", 20, 2000, 8, b"abcdefgh")]
    return cases


def _check_mask(fn, case: Case) -> str:
    given = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in case.inputs.items()}
    got = fn(given["transitions"], given["state"], given["token_bytes"], given["token_lengths"])
    for name in ("transitions", "token_bytes", "token_lengths"):
        expect_unchanged(name, case.inputs[name], given[name])
    want = dfa_token_mask_reference(**case.inputs)
    got = np.asarray(got)
    if got.shape != want.shape:
        raise CaseFailed(f"shape: expected [{len(want)}] (one entry per token), got {list(got.shape)}")
    if got.dtype != bool:
        raise CaseFailed(f"expected a bool mask, got dtype {got.dtype}")
    wrong = np.flatnonzero(got != want)
    if len(wrong):
        i = int(wrong[0])
        n = int(case.inputs["token_lengths"][i])
        spelled = bytes(case.inputs["token_bytes"][i, :n])
        verdict = "allowed a token the DFA cannot read" if got[i] else "refused a token the DFA can read"
        raise CaseFailed(f"{len(wrong)} tokens wrong; e.g. token {i} {spelled!r} (length {n}): {verdict}")
    return f"{int(want.sum())} of {len(want)} tokens allowed"
