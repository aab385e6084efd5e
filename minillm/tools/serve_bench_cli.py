"""`minillm bench serve`: the serving workload in this process (tools/serve_bench.py) on a loaded or
random-weight model, or sent over HTTP to a running server (tools/serve_client_bench.py)."""
from __future__ import annotations

from minillm.tools import serve_bench


def run_from_cli(model_name: str, device: str = "cpu", random_weights: bool = False, n_requests: int = 16,
                 concurrency: int = 8, prefix_share: float = 0.75, workload: str = "both", prompt_len: int = 128,
                 output_len: int = 32, seed: int = 0, csv_path=None, png_path=None, url: str | None = None,
                 rounds: int = 3, api_key: str | None = None, echo=print, long_prompt_len: int = 7500,
                 target_step_ms: float | None = None) -> None:
    """What `minillm bench serve` does: over HTTP against `url`, or in this process on a loaded (or
    random-weight) model; the mixed workload compares two engines, so in this process only."""
    from minillm.errors import MiniLLMError
    from minillm.llm import LLM, check_device, load
    from minillm.model.config import PRESETS
    if workload == "mixed" and (url is not None or png_path is not None):
        raise MiniLLMError("--workload mixed compares two engines in this process: it takes no --url or --png")
    if url is not None:                    # the workload goes over HTTP; no model is loaded here
        if png_path is not None:
            raise MiniLLMError("--png compares the in-process modes; with --url use --csv")
        from minillm.tools.serve_client_bench import run_cli as run_over_http
        try:
            run_over_http(url, n_requests, concurrency, prefix_share, workload, prompt_len, output_len, csv_path,
                          seed, api_key=api_key, echo=echo)
        except ValueError as e:
            raise MiniLLMError(str(e)) from None
        return
    if random_weights:
        if model_name not in PRESETS:
            raise MiniLLMError(f"--random-weights needs a preset name, got {model_name!r}")
        config = PRESETS[model_name].config
        if device == "cuda":         # made on the device in fp16: a 7B model in fp32 on the host is 29 GB
            check_device("cuda")
            from minillm.cuda.gpu_model import GPUTransformer
            llm = LLM(config, GPUTransformer.random(config, "float16"), name=model_name)
        else:
            from minillm.llm import thread_policy
            from minillm.threads import install
            from minillm.tools.bench import random_model
            llm = LLM(config, random_model(config), name=model_name)
            install(thread_policy(llm.model))           # as load() does: BLAS threads measured for this model
    else:
        llm = load(model_name, device)
    if workload == "mixed":
        from minillm.tools import serve_bench_mixed
        serve_bench_mixed.run_cli(llm, prompt_len, output_len, long_prompt_len, rounds, target_step_ms, csv_path, seed,
                                  echo=echo)
        return
    serve_bench.run_cli(llm, n_requests, concurrency, prefix_share, workload, prompt_len, output_len, csv_path, png_path, seed,
                        rounds, echo=echo)
