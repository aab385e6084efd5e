"""`minillm serve` fuzzed from its own OpenAPI document: `schemathesis run --checks all` passes.

Every check schemathesis has (no 5xx, every status, content type and body declared, schema-invalid
requests refused, 405 with an `Allow` header for undeclared methods, the API key not ignored, ...),
except `positive_data_acceptance`, which this file replaces by the same check less the refusals a JSON
schema cannot express, each listed below with its reason. schemathesis runs as its own command (its
pytest plugin does not run under pytest 9), in a process of its own, with this file as its hooks.
Bounded: a model with a 64-token context (no answer is long), a fixed seed, a few examples per route.
"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")

KEY = "fuzz-key"

# Schema-valid requests this server refuses all the same, by the (param, code) of their 400, and why
# no JSON schema can say so: the document states what the server knows before it reads a body.
REFUSALS_THE_SCHEMA_CANNOT_EXPRESS = {
    ("prompt", "context_length_exceeded"): "a prompt's length is counted in tokens, by the model's tokenizer",
    ("messages", "context_length_exceeded"): "likewise for the messages, rendered through the chat template",
    ("max_tokens", "context_length_exceeded"): "the prompt's tokens plus max_tokens must fit the context",
    ("logit_bias", None): "its keys are token ids below the vocabulary's size; a schema bounds no key numerically",
    ("top_logprobs", None): "top_logprobs > 0 needs logprobs: true, a rule between two fields",
    # Grammars (engine/structured.py, engine/tool_calls.py): whether one compiles is found by compiling it.
    ("response_format", "invalid_grammar"): "a JSON schema may be unsatisfiable, cyclic or name an unknown format",
    ("structured_outputs", "invalid_grammar"): "likewise, and a regex or grammar may not parse",
    ("tools", "invalid_grammar"): "a function's parameters must be a JSON schema that compiles; names unique",
    ("tool_choice", "invalid_grammar"): "it must name a function of tools, a rule between two fields",
}


@schemathesis.check
def positive_data_acceptance_less_listed_refusals(ctx, response, case):
    """schemathesis' positive_data_acceptance (a schema-valid request is not a 4xx, bar 401, 403, 404,
    409 and 429), except the refusals listed above."""
    if case.meta is None or not case.meta.generation.mode.is_positive or not 400 <= response.status_code < 500:
        return None
    if response.status_code in (401, 403, 404, 409, 429) or _sent_past_the_seed_limit(response):
        return None
    error = response.json()["error"]
    if (error["param"], error["code"]) not in REFUSALS_THE_SCHEMA_CANNOT_EXPRESS:
        raise AssertionError(f"a schema-valid request was refused: {response.status_code} {error}")
    return None


def _sent_past_the_seed_limit(response) -> bool:
    """schemathesis computes boundaries in floating point: near 2^64, the seed's exclusive maximum (a
    float exactly), it sends seeds at or past it as valid ones. Those are not schema-valid requests."""
    body = json.loads(response.request.body or b"{}")
    return isinstance(body.get("seed"), int) and body["seed"] >= 2 ** 64


@pytest.fixture(scope="module")
def fuzz_url(smollm2_dir):
    from minillm import load_tokenizer
    from minillm.engine.engine import Engine
    from minillm.llm import LLM
    from minillm.model.config import ModelConfig
    from minillm.serve.server import ServeOptions, create_app, serve_in_thread
    from minillm.tools.bench import random_model
    tok = load_tokenizer(smollm2_dir)
    config = ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64,
                         max_seq_len=64, tie_embeddings=True, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    llm = LLM(config, random_model(config), tok, name="tiny")
    with serve_in_thread(create_app(llm, Engine(llm, max_batch=4), "tiny", ServeOptions(api_key=KEY))) as url:
        yield url


def test_schemathesis_checks_all_pass(fuzz_url, tmp_path):
    command = [sys.executable, "-m", "schemathesis.cli", "run", f"{fuzz_url}/openapi.json", "--checks", "all",
               "--exclude-checks", "positive_data_acceptance", "-H", f"Authorization: Bearer {KEY}",
               "--exclude-path", "/api/live",               # the page's event stream never ends
               "--max-examples", "20", "--seed", "1", "--workers", "1", "--request-timeout", "30",
               "--generation-database", "none", "--no-color", "--output-sanitize", "false"]
    env = dict(os.environ, SCHEMATHESIS_HOOKS=__file__)
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
