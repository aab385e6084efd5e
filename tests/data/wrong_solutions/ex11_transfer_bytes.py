"""A deliberately wrong solution of exercise 11: it counts the fp32 norm gains at weight_bytes.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""

FAILS_CASE = 'SmolLM2'
SAYS = 'gains stay fp32'


def transfer_bytes(config, weight_bytes=2):
    return config.n_params * weight_bytes, 8, config.vocab_size * 4
