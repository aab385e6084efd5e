"""Exercise 15.2 (lesson 15): FlashNorm's deferred normalization, planned as two streams and a join.

Reference solution (for teachers; never in the handout). The stub is
lessons/exercises/ex15.2_deferred_plan.py.

A behaviour exercise: you return a plan as data (which op runs on which stream, and where a stream
waits for the other); the grader runs it on its own arrays as two CUDA streams would, and fails it if an
output differs from the plain block (RMSNorm, then the projections), a read races, or nothing overlaps.
Lesson 15 derives why (x · W*) · 1/RMS(x) equals RMSNorm(x) · W and where SwiGLU must take the scale.

Write `deferred_plan` below, then check it:
    minillm exercise check 15.2       (in a clone: pytest lessons/exercises --exercise 15.2)
"""


def deferred_plan(block: dict) -> list[dict]:
    """The ops of one normalized block with its gains folded into the weights, in issue order.

    block    {"kind": "mlp" | "qkv" | "head", "weights": names, "outputs": names to produce}
             mlp: weights gate, up (folded) and down, output "out" = down(silu(gate(h)) * up(h));
             qkv, head: one output per weight, named as it, = h @ W.T; h = RMSNorm(x) with the gain
    returns  [op, ...], each a dict with "stream": 0 or 1 and one of
             {"op": "inv_rms", "in": A, "out": B}     B = 1/sqrt(mean(A², per row) + eps)   [rows, 1]
             {"op": "matmul", "in": A, "w": NAME, "out": B}    B = A @ W.T  (gate/up/q/k/v/logits folded)
             {"op": "scale", "in": A, "by": S, "out": B}       B = A * S   (S one number per row)
             {"op": "mul", "in": A, "by": C, "out": B}         B = A * C   elementwise
             {"op": "silu", "in": A, "out": B}
             {"op": "wait", "for": B}                 this stream may now read B, made on the other
    The input is "x" (the raw residual, readable by both streams). Each stream runs its ops in order;
    reading a buffer made on the other stream needs a wait for it first. At least one projection of x
    must run on the other stream than inv_rms, before its stream waits for the norm: that overlap is
    what deferring the normalization buys.
    """
    plan = [{"op": "inv_rms", "in": "x", "out": "s", "stream": 1}]
    if block["kind"] == "mlp":
        plan += [{"op": "matmul", "in": "x", "w": "gate", "out": "g", "stream": 0},
                 {"op": "matmul", "in": "x", "w": "up", "out": "u", "stream": 0},
                 {"op": "wait", "for": "s", "stream": 0},
                 {"op": "scale", "in": "g", "by": "s", "out": "g_s", "stream": 0},      # before SiLU: not linear
                 {"op": "silu", "in": "g_s", "out": "a", "stream": 0},
                 {"op": "mul", "in": "a", "by": "u", "out": "h", "stream": 0},
                 {"op": "matmul", "in": "h", "w": "down", "out": "d", "stream": 0},
                 {"op": "scale", "in": "d", "by": "s", "out": "out", "stream": 0}]     # the up path's, after down
        return plan
    plan += [{"op": "matmul", "in": "x", "w": w, "out": f"{w}_raw", "stream": 0} for w in block["weights"]]
    plan.append({"op": "wait", "for": "s", "stream": 0})
    return plan + [{"op": "scale", "in": f"{w}_raw", "by": "s", "out": w, "stream": 0} for w in block["weights"]]


if __name__ == "__main__":   # `python lessons/exercises/ex15.2_deferred_plan.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise("15.2", __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
