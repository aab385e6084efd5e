"""Serving: `minillm serve`, the OpenAI-compatible HTTP API over the engine.

`server` (the FastAPI app and its routes), `protocol` (the wire format: requests in, chunks out),
`metrics` (Prometheus text). It may import the engine and everything below it.
"""
