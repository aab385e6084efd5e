"""A deliberately wrong solution of exercise 13: it forgets the embedding launch before the layers.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""

FAILS_CASE = 'Mistral-7B, gemv v4, norms fused'
SAYS = 'outside the layers'


def decode_launches(config, gemv_version, fuse_norm):
    fused = fuse_norm and (gemv_version >= 4 or config.dim <= 12000)
    per_layer = (5 if fused else 7) if gemv_version >= 4 else (9 if fused else 11)
    return per_layer * config.n_layers + (1 if fused else 2)
