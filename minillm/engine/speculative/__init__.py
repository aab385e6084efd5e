"""Speculative decoding: a cheap drafter proposes k tokens, the target checks them in one forward pass.

Decode at batch 1 is bound by reading the weights, so one target pass over k + 1 positions costs about
what one position does (on the CPU only with the small-M matmul, model/layers.small_m_matmul). Every
accepted proposal is then a token for the price of none; the acceptance rule keeps the target's
distribution exact, so greedy output is the plain greedy output and sampling samples the same law.

    drafters.py    the drafters behind one small interface: ngram prompt lookup, a draft model (another
                   checkpoint with the same tokenizer), int4 self-draft, early exit (`layers:N`)
    acceptance.py  the rule: accept with min(1, p/q), else resample from norm(max(0, p - q)); a bonus token
    decode.py      the loop for one sequence (llm.generate): draft, verify, accept, roll the caches back
    pooled.py      the same for the continuous-batching Engine: drafts per request, draft-model KV in the pool

Layering: engine (imports model only). A draft model named by path is loaded by minillm.load (llm.py)
and handed in.
"""
from minillm.engine.speculative.acceptance import accept_draft, acceptance_probability, residual_distribution
from minillm.engine.speculative.decode import SpeculativeStats, generate_speculative
from minillm.engine.speculative.drafters import (Drafter, ModelDrafter, NgramDrafter, early_exit_drafter,
                                                 int4_drafter, parse_speculative)

__all__ = ["Drafter", "ModelDrafter", "NgramDrafter", "SpeculativeStats", "accept_draft", "acceptance_probability",
           "early_exit_drafter", "generate_speculative", "int4_drafter", "parse_speculative",
           "residual_distribution"]
