"""`minillm bench`'s peer: HF transformers on the same weights, timed in a process of its own.

Why a process of its own: in minillm's process, torch's thread pool and OpenBLAS's spinning workers
compete for the same cores, and each side's count is whatever its library chose (torch: all cores).
Once that printed "minillm / HF: decode 20x"; on one thread each the ratio was 1.9x (issue 40). Here
the peer runs alone, on exactly the thread count it is asked for (torch.set_num_threads), and says
what it ran on, so bench can compare the two sides at the same count. On the GPU (`minillm bench --device
cuda`, tools/gpu_bench.py) the peer builds random weights of an HF config on the device instead, so torch's
caching allocator and minillm's CuPy pool never share a process.

Both ends of the conversation live in this file. The parent (`HFPeer`) starts this file as a script,
which imports torch and transformers but nothing of minillm, loads the weights folder (or makes the random
model) once, prints one JSON line (its pid and versions), then answers one JSON line per request line:
    request  {"prompt": [ids], "new_tokens": 32, "threads": 1, "plain_forward": false}   (threads: optional)
    reply    {"pid": ..., "threads": 1, "ttft_s": ..., "decode_tok_s": ..., "tokens": [...], ...}
One request is one round, timed as bench times minillm: a prefill (the LM head on the last row only,
as HF's generate does), then `new_tokens` greedy decode steps; the reply has the median step and the
greedy tokens, which bench checks against minillm's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


class PeerError(RuntimeError):
    """The peer process failed or said something that is not a reply."""


class HFPeer:
    """A running peer process on one HF-layout weights folder, or on random weights of an HF config dict
    (`config`, e.g. ModelConfig.to_hf(); made with torch.manual_seed(seed)) on `device` in `dtype`. Use it
    as a context manager."""

    def __init__(self, weights_dir: str | Path | None = None, config: dict | None = None, device: str = "cpu",
                 dtype: str = "float32", seed: int = 0):
        if (weights_dir is None) == (config is None):
            raise ValueError("HFPeer takes a weights folder or an HF config, one of the two")
        model = {"weights": str(weights_dir)} if config is None else {"config": config, "seed": seed}
        spec = json.dumps(model | {"device": device, "dtype": dtype})
        self._stderr = tempfile.TemporaryFile(mode="w+")     # a file, not a pipe: a chatty peer cannot block
        # The peer's NumPy is never used for compute: one BLAS thread keeps an idle OpenBLAS pool out of it.
        env = os.environ | {"OPENBLAS_NUM_THREADS": "1"}
        self._process = subprocess.Popen([sys.executable, __file__, spec], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env)
        hello = self._read()
        self.pid, self.versions = hello["pid"], f"torch {hello['torch']}, transformers {hello['transformers']}"

    def measure(self, prompt: list[int], new_tokens: int, threads: int | None = None,
                plain_forward: bool = False) -> dict:
        """One timed round on `threads` torch threads (None: as they are); the reply (see the module docstring)."""
        request = {"prompt": list(prompt), "new_tokens": new_tokens, "threads": threads,
                   "plain_forward": plain_forward}
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        return self._read()

    def _read(self) -> dict:
        line = self._process.stdout.readline()
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            self._process.wait()
            self._stderr.seek(0)
            said = [ln for ln in self._stderr.read().splitlines() if ln.strip()]
            self.close()
            raise PeerError(f"the HF peer process stopped (exit {self._process.returncode}): "
                            f"{said[-1] if said else line.strip() or 'no output'}") from None

    def close(self) -> None:
        if not self._process.stdin.closed:
            self._process.stdin.close()                      # end of requests: the peer exits
        self._process.wait()
        self._stderr.close()

    def __enter__(self) -> HFPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- the peer process --------------------------------------------------------------------------------
def _round(model, prompt: list[int], new_tokens: int, plain_forward: bool) -> dict:
    import statistics
    import time

    import torch
    ids = torch.tensor([prompt], device=model.device)
    steps = []
    with torch.inference_mode():
        start = time.perf_counter()
        out = model(ids, use_cache=True, logits_to_keep=1)     # like HF generate: LM head on the last row only
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        tokens = [int(token)]                                  # the host read waits for a GPU to finish
        ttft = time.perf_counter() - start
        for _ in range(new_tokens):
            start = time.perf_counter()
            out = model(token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(token))
            steps.append(time.perf_counter() - start)
        reply = {"ttft_s": ttft, "decode_tok_s": 1.0 / statistics.median(steps), "tokens": tokens}
        if plain_forward:                                      # a bare model call: logits for every position
            start = time.perf_counter()
            model(ids, use_cache=True)
            reply["plain_forward_s"] = time.perf_counter() - start
    return reply


def _model(spec: dict):
    """The model a peer serves: a weights folder, or random weights of an HF config made on the device."""
    import torch
    import transformers
    dtype = getattr(torch, spec["dtype"])
    if "weights" in spec:
        return transformers.AutoModelForCausalLM.from_pretrained(spec["weights"], dtype=dtype).to(spec["device"])
    fields = dict(spec["config"])
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(spec["seed"])
    with torch.device(spec["device"]):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def main(spec: str) -> None:
    import warnings

    import torch
    import transformers
    warnings.filterwarnings("ignore", category=FutureWarning)   # transformers renames cache arguments often
    replies = os.fdopen(os.dup(1), "w")         # the JSON lines go here; anything else printed to stdout,
    os.dup2(2, 1)                               # by Python or C code, lands on stderr instead
    model = _model(json.loads(spec)).eval()

    def send(message: dict) -> None:
        replies.write(json.dumps(message | {"pid": os.getpid()}) + "\n")
        replies.flush()

    send({"torch": torch.__version__, "transformers": transformers.__version__})
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("threads"):
            torch.set_num_threads(request["threads"])
        reply = _round(model, request["prompt"], request["new_tokens"], request["plain_forward"])
        send(reply | {"threads": torch.get_num_threads()})


if __name__ == "__main__":
    sys.path.pop(0)     # this file's folder, first on the path: its evaluate.py would shadow HF's `evaluate`
    main(sys.argv[1])
