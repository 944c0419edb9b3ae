"""Any sender with an HMAC signature header and a stable key in a header or the JSON.

``source.signature_header`` holds the signature, by the source's configurable
scheme (``_scheme.py``; by default HMAC-SHA256 hex of the body, optional
``<word>=`` prefix); that configured header is not in ``secret_headers``:
``providers.redacted_headers(source)`` adds it.
``source.dedup_key`` and ``source.extra["event_type"]`` are specs of the form
``header:<Name>`` or ``json:<RFC 6901 pointer>``. Because the key's location is
per source, JSON is only required when the key is in it: see
:meth:`GenericProvider.requires_json_for`.
"""

from __future__ import annotations

from typing import Any

from ...config import parse_spec
from . import _common as c
from . import _scheme
from .base import Identified, Inbound, PayloadError, SourceConfig


def _lookup(inbound: Inbound, spec: str, *, need_json: bool, key: bool = False) -> Any:
    try:
        kind, arg = parse_spec(spec)
    except ValueError as exc:
        raise PayloadError(str(exc)) from exc
    if kind == "header":
        read = c.key_header if key else c.optional_header
        return read(inbound, arg.strip())
    if inbound.json is None:
        if need_json:
            raise PayloadError("body is not JSON")
        return None
    # Numbers are keys too (ids are often integers), written as canonical JSON writes them.
    return c.pointer_text(c.resolve_pointer(inbound.json, arg))


class GenericProvider:
    """A shared-secret HMAC sender described entirely by its source config."""

    name: str = "generic"
    # Per source really: JSON is needed only for a json: dedup key (requires_json_for).
    requires_json: bool = False
    secret_headers: frozenset[str] = frozenset()

    def requires_json_for(self, source: SourceConfig) -> bool:
        """Whether this source's deliveries must be JSON: only when the key is in the JSON."""
        return source.dedup_key.startswith("json:")

    def verify(self, inbound: Inbound, source: SourceConfig) -> None:
        """Check the configured HMAC header, by the source's scheme, against every secret."""
        _scheme.verify(inbound, source)

    def identify(self, inbound: Inbound, source: SourceConfig) -> Identified:
        """Read the key (and the type, when configured) where the source says."""
        key = c.dedup_key(
            _lookup(inbound, source.dedup_key, need_json=True, key=True), source.dedup_key
        )
        type_spec = source.extra.get("event_type")
        event_type = None
        if type_spec is not None:
            # The type is informational: a json: spec on a non-JSON body just yields None.
            event_type = c.str_or_none(_lookup(inbound, str(type_spec), need_json=False))
        return Identified(dedup_key=key, event_type=event_type)
