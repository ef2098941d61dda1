"""The OpenAI-compatible server over the speculative loop; `server_spec.py` is its entry point.

- `schemas`: request and response shapes, the error envelope;
- `text`: token ids -> text deltas (UTF-8 boundaries, stop strings);
- `engine`: the worker thread that drives `spec.loop.speculate`, the bounded queue, cancellation and drain;
- `metrics`: Prometheus counters and latency histograms (prometheus_client, one registry per app);
- `routes`: the endpoints (an APIRouter) and the one response builder of JSON bodies and SSE chunks;
- `gate`: the API key and body-size middleware;
- `app`: `create_app`, with the models loaded in its lifespan;
- `cli`: the command line.
"""
