"""The one type for input a user can get wrong.

`UserError` is raised at validation points (config, sampling parameters, prompts, requests) and
carries the parameter it names. Only a UserError becomes an HTTP 4xx on the server or a one-line
message on the CLI; any other exception is a bug: logged with its traceback, a 500 for that
request, while the engine keeps serving the others.

It subclasses ValueError so callers that catch ValueError (the offline API's users) keep working.
"""

from __future__ import annotations


class UserError(ValueError):
    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code

    def __str__(self) -> str:
        return self.message


class MissingFileError(UserError, FileNotFoundError):
    """A path the user gave (a model, a config file) does not exist or is incomplete."""
