"""Exercise 15.2, a behaviour exercise: FlashNorm's deferred normalization as two streams and a join.

With the gains folded (exercise 15), a block's projections read the raw residual x while 1/RMS(x) is
computed beside them (flashnorm.py, Prop. 2). The student's `deferred_plan(block)` answers with a plan as
data, the ops of the block in issue order, each on stream 0 or 1, and waits where a stream reads what the
other produced. The grader runs the plan on its own arrays, as two CUDA streams would (each in order; a
read across streams only after a wait), and checks the outputs against the block run the plain way
(RMSNorm with its gain, then the projections), that no read races, and that the projections did not
wait for the norm (the overlap is the point)."""
from __future__ import annotations

import numpy as np

from minillm.course.behaviour import replay
from minillm.course.cases import Case, CaseFailed, case_rng, expect_close

EPS = 1e-5
OPS = {"matmul", "inv_rms", "scale", "silu", "mul", "wait"}


def deferred_plan_reference(block: dict) -> list[dict]:
    """The engine's deferred_linear / deferred_swiglu as a plan: 1/RMS on stream 1, the projections of
    the raw x on stream 0, one wait, then the scale where each output (or the gate, before SiLU) needs it."""
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


class StreamsWorld:
    """The grader's side: x, the gains, the weights folded and not; the plan run once, as two streams."""

    def __init__(self, kind: str, weights: dict, x: np.ndarray, gain: np.ndarray):
        self.kind, self.x, self.gain, self.weights = kind, x, gain, weights
        self.ran = False

    def observe(self) -> dict:
        outputs = ["out"] if self.kind == "mlp" else list(self.weights)
        return {"kind": self.kind, "weights": list(self.weights), "outputs": outputs}

    def apply(self, plan) -> None:
        from minillm.model.flashnorm import fold_rmsnorm_into_linear, inv_rms
        from minillm.model.layers import silu
        folded = {n: fold_rmsnorm_into_linear(self.gain, w) if n != "down" else w for n, w in self.weights.items()}
        buffers = {"x": (self.x, None, -1)}                   # name -> (array, stream, issue index); x is ready
        waited: list[set] = [set(), set()]                    # per stream: buffers it may read from the other
        self.matmuls, self.made_by = [], {}                   # (stream, waited for s yet); buffer -> its op
        for i, op in enumerate(plan):
            kind, stream = op.get("op"), op.get("stream")
            if kind not in OPS or stream not in (0, 1):
                raise CaseFailed(f"op {i} {_show(op)}: ops are {sorted(OPS)}, streams 0 and 1")
            if kind == "wait":
                if op["for"] not in buffers:
                    raise CaseFailed(f"op {i} waits for {op['for']!r}, which no earlier op produced")
                waited[stream].add(op["for"])
                continue
            args = [self._read(buffers, waited, stream, op[key], i) for key in ("in", "by") if key in op]
            if kind == "matmul":
                if op["w"] not in folded:
                    raise CaseFailed(f"op {i} multiplies by {op['w']!r}; the weights are {sorted(folded)}")
                value = args[0] @ folded[op["w"]].T
                self.matmuls.append((stream, "s" in waited[stream] or buffers.get("s", (0, None))[1] == stream))
            elif kind == "inv_rms":
                value = inv_rms(args[0], EPS)
            elif kind == "scale" or kind == "mul":
                value = args[0] * args[1]
            else:
                value = silu(args[0])
            buffers[op["out"]] = (value, stream, i)
            self.made_by[op["out"]] = op
        self.buffers, self.ran = buffers, True

    def _read(self, buffers, waited, stream, name, i):
        if name not in buffers:
            raise CaseFailed(f"op {i} reads {name!r} before any op produced it")
        value, made_on, _ = buffers[name]
        if made_on not in (None, stream) and name not in waited[stream]:
            raise CaseFailed(f"op {i} reads {name!r} on stream {stream}, made on stream {made_on}, without a wait "
                             f"for it: a race")
        return value

    def done(self) -> bool:
        return self.ran

    def verdict(self) -> str:
        from minillm.model.layers import rmsnorm, silu
        h = rmsnorm(self.x, self.gain, EPS)                                    # the plain block
        w = self.weights
        want = {"out": (silu(h @ w["gate"].T) * (h @ w["up"].T)) @ w["down"].T} if self.kind == "mlp" else \
            {n: h @ m.T for n, m in w.items()}
        summaries = []
        for name, value in want.items():
            if name not in self.buffers:
                raise CaseFailed(f"the plan never produces {name!r}")
            got = self.buffers[name][0]
            silu_in = next((op["in"] for op in self.made_by.values() if op["op"] == "silu"), None)
            if self.kind == "mlp" and not np.allclose(got, value, rtol=1e-4, atol=1e-4) and silu_in is not None \
                    and self.made_by.get(silu_in, {}).get("by") != "s":
                raise CaseFailed("SiLU got a gate without its 1/RMS: SiLU is not linear, so the gate needs the "
                                 "scale before it (the up path's may wait until after down)")
            summaries.append(expect_close(name, got, value, rtol=1e-4, atol=1e-4))
        norm_stream = self.buffers["s"][1] if "s" in self.buffers else None
        overlapped = sum(stream != norm_stream and not waited for stream, waited in self.matmuls)
        if overlapped == 0:
            raise CaseFailed("every projection waited for 1/RMS: nothing overlaps; project the raw x on one "
                             "stream while the other computes the norm")
        plural = "s" if overlapped > 1 else ""
        return f"{'; '.join(summaries)}; {overlapped} projection{plural} overlapped the norm on the other stream"


def _show(op) -> str:
    text = repr(op)
    return text if len(text) < 60 else text[:57] + "..."


def _streams_cases() -> list[Case]:
    rng = case_rng(15, 2)

    def w(out, n_in):
        return (rng.standard_normal((out, n_in)) * 0.1).astype(np.float32)

    def case(name, kind, weights, rows=3, dim=32, scale=1.0):
        x = (rng.standard_normal((rows, dim)) * scale).astype(np.float32)
        gain = (1 + 0.3 * rng.standard_normal(dim)).astype(np.float32)
        return Case(name, dict(kind=kind, weights=weights, x=x, gain=gain))
    return [case("the MLP (SwiGLU): gate, up, down", "mlp", dict(gate=w(48, 32), up=w(48, 32), down=w(32, 48))),
            case("attention's q, k and v", "qkv", dict(q=w(32, 32), k=w(16, 32), v=w(16, 32)), rows=5),
            case("the LM head after the final norm", "head", dict(logits=w(64, 32)), rows=1),
            case("the MLP on a residual of large values", "mlp", dict(gate=w(48, 32), up=w(48, 32), down=w(32, 48)),
                 scale=50.0)]


def _check_streams(fn, case: Case) -> str:
    world = StreamsWorld(**case.inputs)
    return replay(fn, world, max_steps=2)
