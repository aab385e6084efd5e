"""What `minillm serve` reports on GET /metrics, in Prometheus' text exposition format.

Gauges for the engine's state (requests running and waiting, KV blocks used, the last batch), counters
for tokens and finished requests, and two histograms of what users feel: time to first token and the
inter-token latency. The engine thread writes these, HTTP handlers read them: one lock guards both.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field


class Histogram:
    """A Prometheus histogram: cumulative counts per upper bound, plus the sum and the count."""

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * len(buckets)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        out += [f'{self.name}_bucket{{le="{upper}"}} {n}' for upper, n in zip(self.buckets, self.counts)]
        out += [f'{self.name}_bucket{{le="+Inf"}} {self.count}', f"{self.name}_sum {self.sum:.6f}",
                f"{self.name}_count {self.count}"]
        return out


@dataclass
class Metrics:
    """What /metrics reports. The engine thread writes, HTTP handlers read: one lock for both."""
    ttft: Histogram = field(default_factory=lambda: Histogram(
        "minillm_time_to_first_token_seconds", "Time from a request's arrival to its first token.",
        (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)))
    itl: Histogram = field(default_factory=lambda: Histogram(
        "minillm_inter_token_latency_seconds", "Time between two tokens of one request.",
        (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)))
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict = field(default_factory=dict)     # finish_reason -> requests
    refused: dict = field(default_factory=dict)      # HTTP status -> requests refused before the engine saw them
    max_batch: int = 0
    engine: dict = field(default_factory=dict)       # the engine's stats() after its last step
    lock: threading.Lock = field(default_factory=threading.Lock)

    def render(self) -> str:
        with self.lock:
            e = self.engine
            lines = []
            for name, kind, help, value in [
                ("minillm_requests_running", "gauge", "Requests in the running batch.", e.get("running", 0)),
                ("minillm_requests_waiting", "gauge", "Requests waiting for KV blocks or a batch slot.", e.get("waiting", 0)),
                ("minillm_kv_blocks_used", "gauge", "KV-cache blocks held by requests.", e.get("blocks_used", 0)),
                ("minillm_kv_blocks_total", "gauge", "KV-cache blocks in the pool.", e.get("blocks_total", 0)),
                ("minillm_kv_blocks_cached", "gauge", "Unused blocks kept for their prefix.", e.get("blocks_cached", 0)),
                ("minillm_kv_peak_bytes", "gauge", "Most KV-cache bytes in use at once since the start.",
                 e.get("peak_kv_bytes", 0)),
                ("minillm_batch_size", "gauge", "Sequences in the last engine step.", e.get("batch_size", 0)),
                ("minillm_batch_size_max", "gauge", "Largest engine step since the server started.", self.max_batch),
                ("minillm_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", self.prompt_tokens),
                ("minillm_generation_tokens_total", "counter", "Tokens generated.", self.generation_tokens),
                ("minillm_engine_steps_total", "counter", "Engine steps (one batched forward pass each).",
                 e.get("steps", 0)),
                ("minillm_prefix_cache_hit_tokens_total", "counter", "Prompt tokens served from the prefix cache.",
                 e.get("prefix_hit_tokens", 0)),
            ] + _speculative_rows(e):
                lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name} {value}"]
            lines += ["# HELP minillm_requests_finished_total Requests finished, by finish reason.",
                      "# TYPE minillm_requests_finished_total counter"]
            lines += [f'minillm_requests_finished_total{{finish_reason="{reason}"}} {n}'
                      for reason, n in sorted(self.finished.items())]
            lines += ["# HELP minillm_requests_refused_total Requests refused with a 4xx (limits, key, Host, schema).",
                      "# TYPE minillm_requests_refused_total counter"]
            lines += [f'minillm_requests_refused_total{{status="{status}"}} {n}'
                      for status, n in sorted(self.refused.items())]
            lines += self.ttft.lines() + self.itl.lines()
        return "\n".join(lines) + "\n"

    def count_refusal(self, status: int) -> None:
        """One more request refused with `status` (a hostile client shows up here first)."""
        with self.lock:
            self.refused[status] = self.refused.get(status, 0) + 1


def _speculative_rows(e: dict) -> list[tuple]:
    """Speculative decoding's metrics, when the engine runs it (`minillm serve --speculative`)."""
    if "spec_draft_tokens" not in e:
        return []
    return [("minillm_spec_draft_tokens_total", "counter", "Tokens proposed by the drafter.", e["spec_draft_tokens"]),
            ("minillm_spec_accepted_tokens_total", "counter", "Drafted tokens the target accepted.",
             e["spec_accepted_tokens"]),
            ("minillm_spec_acceptance_rate", "gauge", "Accepted / drafted tokens since the start.",
             round(e["spec_acceptance_rate"], 4)),
            ("minillm_spec_mean_accepted_length", "gauge", "Tokens per verify pass (accepted drafts + 1).",
             round(e["spec_mean_accepted_length"], 4))]
