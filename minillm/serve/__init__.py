"""Serving: `minillm serve`, the OpenAI-compatible HTTP API over the engine.

`server` (the FastAPI app and its routes), `protocol` (the wire format: requests in, chunks out),
`guard` (what a request must show before a route runs), `connections` (what one connection may hold:
time limits, a cap on their number), `metrics` (Prometheus text), `web` and `live` (the page). It may
import the engine and everything below it.
"""
