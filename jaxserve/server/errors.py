"""OpenAI-shaped errors: one exception type, one JSON body, the right status code.

Every message a client can cause is short and says what to change; bodies never echo the request.
"""

from __future__ import annotations

from http import HTTPStatus

from starlette.responses import JSONResponse

from jaxserve.errors import UserError

MAX_MESSAGE_CHARS = 400

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(UserError):
    """A UserError with the OpenAI error `type` (derived from the status unless given)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ):
        super().__init__(message, param=param, status=status, code=code)
        self.type = type or _TYPES.get(status, "invalid_request_error")


def error_body(e: UserError) -> dict:
    """The OpenAI error body of any UserError (message cut to MAX_MESSAGE_CHARS)."""
    msg = e.message if len(e.message) <= MAX_MESSAGE_CHARS else e.message[:MAX_MESSAGE_CHARS] + "..."
    kind = getattr(e, "type", None) or _TYPES.get(e.status, "invalid_request_error")
    return {"error": {"message": msg, "type": kind, "param": e.param, "code": e.code}}


# Anthropic's error `type` per status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
ANTHROPIC_PATHS = ("/v1/messages",)  # routes that answer in Anthropic's error shape


def anthropic_error_body(e: UserError) -> dict:
    """Anthropic's error body; the message names the field (Anthropic's shape has no `param`)."""
    msg = error_body(e)["error"]["message"]
    if e.param and e.param not in msg:
        msg = f"{e.param}: {msg}"
    kind = _ANTHROPIC_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": msg}}


def error_response(e: UserError, path: str = "") -> JSONResponse:
    """`e` in the shape of the API that `path` belongs to (OpenAI's unless it is Anthropic's)."""
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    anthropic = path.startswith(ANTHROPIC_PATHS)
    body = anthropic_error_body(e) if anthropic else error_body(e)
    return JSONResponse(body, status_code=e.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def internal_error() -> APIError:
    """What a client sees of a bug (the traceback goes to the server log)."""
    return APIError(500, "Internal server error: see the server log.", code="internal_error")


def http_error(status: int, detail: str | None, method: str, path: str) -> APIError:
    """Starlette's own HTTP errors (unknown route, wrong method) in the OpenAI shape."""
    phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    where = f"{method} {path[:100]}"
    return APIError(
        status, f"{detail if detail and detail != phrase else phrase}: {where}.", code=code
    )


def from_user_error(e: UserError, aliases: dict[str, str] | None = None) -> UserError:
    """`e` naming the parameter the client sent (e.g. top_logprobs where SamplingParams says logprobs)."""
    alias = (aliases or {}).get(e.param or "", e.param)
    if alias == e.param:
        return e
    msg = e.message.replace(f"Invalid {e.param}=", f"Invalid {alias}=", 1)
    return APIError(e.status, msg, param=alias, code=e.code)


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
