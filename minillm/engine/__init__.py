"""The engine: running the model for one sequence or many.

`sampling` and `generate` (one sequence: the loop, streaming, stop strings), then the serving engine
in nano-vllm's rooms: `paged_kv` (the block pool and its manager), `prefix_cache`, `scheduler`
(continuous batching) and its `step_budget`, `batched` (one forward pass over many sequences) and
`engine` (`Engine`);
`speculative/` drafts tokens cheaply and verifies them in one pass, for `generate` and the `Engine`;
`disaggregated` runs prefill and decode in two processes, the prompt's KV blocks handed between them;
`structured` turns a grammar (JSON schema, regex, Lark, choice) into each step's token mask, and `tool_calls`
puts tools into the chat template and parses the model's calls out of its answer.
It may import `minillm.model` and `minillm.checkpoints`. A faster runner (the GPU's) is handed in by
`minillm.load`, never imported from here.
"""
