"""Errors the engine raises for callers to map onto INVALID_ARGUMENT / NOT_FOUND / 400s."""
from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request can never be served as asked (too long, bad parameter); the message names the limit."""
