"""Tools a user runs on a model: `bench` and `serve_bench` (speed against the machine's limits and a
peer), `serve_client_bench` (the same workload over HTTP), `planner` (`minillm plan`), `evaluate`
(perplexity) and `info`. They may import every layer below them, never the CLI.
"""
