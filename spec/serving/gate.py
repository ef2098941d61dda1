"""ASGI middleware in front of the app: the API key and the request-body cap, answered in the OpenAI envelope."""

from __future__ import annotations

import hmac

from spec.serving.schemas import ApiError


class Gate:
    """ASGI middleware in front of everything: the API key (constant-time compare; /health stays public) and the
    request-body cap (read here, up to the cap, then replayed to the app), both answered in the OpenAI envelope."""

    def __init__(self, app, api_key: str | None, max_body: int):
        self.app = app
        self.key = f"Bearer {api_key}".encode() if api_key else None
        self.max_body = max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.key and scope["path"] != "/health":
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.key):
                error = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                 code="invalid_api_key")
                return await error.response()(scope, receive, send)
        if scope["method"] == "POST":
            kind = headers.get(b"content-type", b"application/json").split(b";")[0].strip().lower()
            if kind != b"application/json":
                error = ApiError(415, "send the body as JSON, with 'Content-Type: application/json'",
                                 code="unsupported_media_type")
                return await error.response()(scope, receive, send)
            if b"content-type" not in headers:  # a bare JSON body (no header) is read as JSON
                scope = {**scope, "headers": [*scope["headers"], (b"content-type", b"application/json")]}
        too_big = ApiError(413, f"the request body is larger than the limit of {self.max_body} bytes",
                           code="body_too_large")
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_body:
            return await too_big.response()(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if size > self.max_body:
                return await too_big.response()(scope, receive, send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: waits for the client to disconnect

        await self.app(scope, replay, send)
