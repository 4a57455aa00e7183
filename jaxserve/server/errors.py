"""OpenAI-shaped errors: one exception type, one JSON body, the right status code.

Every message a client can cause is short and says what to change; bodies never echo the request.
"""

from __future__ import annotations

import re
from http import HTTPStatus

from starlette.responses import JSONResponse

MAX_MESSAGE_CHARS = 400

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        msg = (
            self.message
            if len(self.message) <= MAX_MESSAGE_CHARS
            else self.message[:MAX_MESSAGE_CHARS] + "..."
        )
        return {
            "error": {"message": msg, "type": self.type, "param": self.param, "code": self.code}
        }

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def http_error(status: int, detail: str | None, method: str, path: str) -> APIError:
    """Starlette's own HTTP errors (unknown route, wrong method) in the OpenAI shape."""
    phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    where = f"{method} {path[:100]}"
    return APIError(
        status, f"{detail if detail and detail != phrase else phrase}: {where}.", code=code
    )


_INVALID_FIELD = re.compile(r"^Invalid (\w+)=")


def from_value_error(
    e: ValueError, aliases: dict[str, str] | None = None, default_param: str | None = None
) -> APIError:
    """A ValueError from SamplingParams/the engine ("Invalid <field>=<value>: <rule>.") as a 400."""
    msg = e.args[0] if e.args and isinstance(e.args[0], str) else str(e)
    m = _INVALID_FIELD.match(msg)
    param = m[1] if m else default_param
    if param and aliases and aliases.get(param, param) != param:
        if m:  # name the parameter the client sent (e.g. top_logprobs, not logprobs)
            msg = f"Invalid {aliases[param]}=" + msg[m.end() :]
        param = aliases[param]
    return bad_request(msg, param)


def from_validation_error(errors: list[dict]) -> APIError:
    """The first pydantic error as a 400 naming the parameter (e.g. `messages[0].role`)."""
    err = errors[0]
    if err["type"] == "json_invalid":
        return bad_request(
            f"The request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}.",
            code="invalid_json",
        )
    loc = err.get("loc", ())
    if not loc:
        return bad_request("The request body must be a JSON object.", code="invalid_json")
    param = ""
    for part in loc:
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        msg = f"'{param}' is required."
    elif err["type"] == "extra_forbidden":
        msg = f"'{param}' is not a supported parameter."
    else:
        msg = f"Invalid '{param}': {msg[0].lower() + msg[1:] if msg else msg}"
        if not msg.endswith("."):
            msg += "."
    return bad_request(
        msg,
        param,
        code="invalid_value" if err["type"] != "missing" else "missing_required_parameter",
    )
