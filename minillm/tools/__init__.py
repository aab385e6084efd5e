"""Tools a user runs on a model: `bench` and `serve_bench` (speed against the machine's limits and a
peer; `hf_peer` is bench's HF transformers peer, a process of its own), `serve_client_bench` (the same workload over HTTP), `planner` (`minillm plan`), `evaluate`
(perplexity), `info`, and `chat_input` (what `minillm chat` reads: line editing, history, a message over
several lines). They may import every layer below them, never the CLI.
"""
