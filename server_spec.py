"""An OpenAI-compatible server over the speculative loop: the same answers as the target alone, fewer target steps.

    python server_spec.py --pair auto --method draft --k 4 --host 127.0.0.1 --port 8000 [--api-key KEY]

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions, GET /health (503 while the models load),
GET /metrics (Prometheus, named like vLLM's metrics under the `spark:` prefix). Binds to loopback by default.

No algorithm lives here, nor in the package behind it (`spec/serving/`): requests are validated, turned into token
ids and handed to one worker thread that drives `spec.loop.speculate`. docs/serving.md has the details.
"""

from spec.serving.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
