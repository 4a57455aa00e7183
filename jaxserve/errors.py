"""The user-error types, for everything outside `core/` (they live in `core/errors.py` so the
jax-free host side depends on nothing above it)."""

from jaxserve.core.errors import MissingFileError, UserError

__all__ = ["MissingFileError", "UserError"]
