"""The stable key every forward sends: ``<consumer>:<source>:<dedup key>``.

The same on every attempt and after a requeue, so a downstream applies each
event once however often it gets it (HTTP's ``Idempotency-Key``, a broker's
message id). A consumer name holds no ``:``; a source name, an API client's
name (its events' source is ``api:<client>``) or a dedup key may, so in each
of them ``%`` and ``:`` are percent-encoded (``%25``, ``%3A``): two events
never share a key (sources ``shop`` and ``shop:eu`` with keys ``eu:1`` and
``1`` were both ``billing:shop:eu:1``). No configured source is named
``api`` (config.sources), so a key whose second part is ``api`` is an API
client's. A name or key without either character is sent as it is.
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote

# What a header value may hold as it is: printable ASCII, no space.
HEADER_SAFE = re.compile(r"^[\x21-\x7e]+$")


def key_part(text: str) -> str:
    """A source name or dedup key as it stands in a stable key: no ``:`` left in it."""
    if ":" not in text and "%" not in text:
        return text
    return text.replace("%", "%25").replace(":", "%3A")


def source_part(source: str) -> str:
    """An event's source as it stands in a stable key: ``api:<client>`` keeps its one ``:``."""
    if source.startswith("api:"):
        return "api:" + key_part(source[4:])
    return key_part(source)


def idempotency_key(consumer: str, source: str, dedup_key: str, replay: int = 0) -> str:
    """The key a forward sends downstream; a replay with a new key (n > 0) ends ``:replay-<n>``."""
    key = f"{consumer}:{source_part(source)}:{key_part(dedup_key)}"
    if replay:
        key += f":replay-{replay}"
    # A header value must be printable ASCII; a dedup key taken from a JSON
    # body may be anything, so anything else is percent-encoded, whole.
    return key if HEADER_SAFE.match(key) else quote(key, safe="")


def dedup_key_of(stable: str, consumer: str, source: str) -> str:
    """The dedup key (and replay suffix) a stable key of ``consumer`` and ``source`` ends with."""
    if ":" not in stable:  # percent-encoded whole: not printable ASCII
        stable = unquote(stable)
    return unquote(stable.removeprefix(f"{consumer}:{source_part(source)}:"))
