"""Kept for the tests that still import ``hmac_hex`` from here: it lives in tests/helpers."""

from __future__ import annotations

from ..helpers.signing import hmac_hex

__all__ = ["hmac_hex"]
