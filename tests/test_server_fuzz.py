"""`minillm serve` fuzzed from its own OpenAPI document (schemathesis): no request it can be sent is a 500
or a hang. The request bodies' schemas are the pydantic models of protocol.py, so the fuzzer sends
valid requests as well as every kind of bad value. Bounded: a few dozen examples per route, a model
with a 64-token context (no answer is long), a timeout per request.
"""
import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402


@pytest.fixture(scope="module")
def fuzz_url(smollm2_dir):
    from minillm import load_tokenizer
    from minillm.engine.engine import Engine
    from minillm.llm import LLM
    from minillm.model.config import ModelConfig
    from minillm.serve.server import create_app, serve_in_thread
    from minillm.tools.bench import random_model
    tok = load_tokenizer(smollm2_dir)
    config = ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64,
                         max_seq_len=64, tie_embeddings=True, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    llm = LLM(config, random_model(config), tok, name="tiny")
    with serve_in_thread(create_app(llm, Engine(llm, max_batch=4), "tiny")) as url:
        yield url


@pytest.fixture(scope="module")
def api_schema(fuzz_url):
    return schemathesis.openapi.from_url(f"{fuzz_url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.include(path_regex="^/v1/").parametrize()        # the API; the page's event stream never ends
@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_request_is_a_server_error(case):
    response = case.call(timeout=30)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
