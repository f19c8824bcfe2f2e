"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {429: "rate_limit_error"}


class APIError(Exception):
    """An error answered as OpenAI's error JSON with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        if type is None:
            type = "server_error" if status >= 500 else _TYPES.get(status, "invalid_request_error")
        self.status, self.message, self.type, self.code = status, message, type, code
        self.headers = headers

    def body(self) -> dict:
        error = {"message": self.message, "type": self.type, "param": None, "code": self.code}
        return {"error": error}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)
