"""OpenAI-shaped error bodies: ``{"error": {"message", "type", "param", "code"}}``."""

from typing import Optional

from fastapi.responses import JSONResponse

TYPES = {401: "authentication_error", 429: "rate_limit_error"}


class APIError(Exception):
    """A request the server answers with ``status`` and a one-line message."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)
