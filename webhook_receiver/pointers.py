"""JSON pointers (RFC 6901): one parser and one resolution for every intake and rule.

A ``json:<pointer>`` spec (a webhook source's key or type, a broker
source's key or type, an ordering rule's version and entity) is parsed here
when the config is loaded, and resolved here for every message: the same
pointer finds the same value, or nothing, whichever intake reads it.

Strict, as the RFC says: ``~0`` and ``~1`` are the only escapes (``/a~2`` is
no pointer, refused by the config); an array index is ``0`` or ASCII digits
without a leading zero (``/items/01``, ``/items/١`` and ``/items/-`` find
nothing). The ``jsonpointer`` package parses; the walk is these few lines,
over the dicts and lists a JSON parser makes, with the RFC's index rule
written out rather than taken from the package (versions before 3.x let
``01`` through).
"""

from __future__ import annotations

import functools
import re
from typing import Any

from jsonpointer import JsonPointer, JsonPointerException

# RFC 6901 section 4: array-index = %x30 / ( %x31-39 *(%x30-39) ); ASCII only.
_INDEX = re.compile(r"0|[1-9][0-9]*", re.ASCII)
_MISSING = object()


class PointerError(ValueError):
    """The text is not an RFC 6901 JSON pointer."""


@functools.lru_cache(maxsize=1024)
def parse(pointer: str) -> tuple[str, ...]:
    """Return the pointer's reference tokens, unescaped, or raise PointerError.

    Cached: pointers come from the config, a few per source, and each
    message resolves an already parsed one.
    """
    try:
        return tuple(JsonPointer(pointer).parts)
    except JsonPointerException as exc:
        raise PointerError(f"{pointer!r} is not a JSON pointer (RFC 6901): {exc}") from exc


def resolve(document: Any, pointer: str) -> Any:
    """Return the value ``pointer`` refers to in ``document``; None when nothing is there.

    ``""`` is the whole document. Raises PointerError when ``pointer`` is
    not a pointer (the config refuses those before any message is read).
    """
    node = document
    for token in parse(pointer):
        if isinstance(node, dict):
            node = node.get(token, _MISSING)
            if node is _MISSING:
                return None
        elif (
            isinstance(node, list)
            and len(token) < 19  # int() of thousands of digits is slow, then refused
            and _INDEX.fullmatch(token)
            and int(token) < len(node)
        ):
            node = node[int(token)]
        else:
            return None
    return node
