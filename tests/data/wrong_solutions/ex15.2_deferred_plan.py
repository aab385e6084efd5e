"""A deliberately wrong solution of exercise 15.2: the gate's 1/RMS applied after SiLU, as if it were linear.
The grader must fail it on the case named FAILS_CASE, with SAYS in its message (tests/test_exercises.py)."""

FAILS_CASE = "the MLP (SwiGLU)"
SAYS = "SiLU is not linear"


def deferred_plan(block):
    plan = [{"op": "inv_rms", "in": "x", "out": "s", "stream": 1}]
    if block["kind"] == "mlp":
        plan += [{"op": "matmul", "in": "x", "w": "gate", "out": "g", "stream": 0},
                 {"op": "matmul", "in": "x", "w": "up", "out": "u", "stream": 0},
                 {"op": "wait", "for": "s", "stream": 0},
                 {"op": "silu", "in": "g", "out": "a_raw", "stream": 0},              # the bug: SiLU first
                 {"op": "scale", "in": "a_raw", "by": "s", "out": "a", "stream": 0},
                 {"op": "mul", "in": "a", "by": "u", "out": "h", "stream": 0},
                 {"op": "matmul", "in": "h", "w": "down", "out": "d", "stream": 0},
                 {"op": "scale", "in": "d", "by": "s", "out": "out", "stream": 0}]     # the up path's, after down
        return plan
    plan += [{"op": "matmul", "in": "x", "w": w, "out": f"{w}_raw", "stream": 0} for w in block["weights"]]
    plan.append({"op": "wait", "for": "s", "stream": 0})
    return plan + [{"op": "scale", "in": f"{w}_raw", "by": "s", "out": w, "stream": 0} for w in block["weights"]]
