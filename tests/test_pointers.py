"""JSON pointers: one strict RFC 6901 resolution, the same for every intake and rule.

A webhook source's ``json:`` key, a broker source's ``json:`` key and an
ordering rule's entity pointer resolve the same value in the same document,
or all refuse the pointer (and so does the config, before any message).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from werkzeug.datastructures import Headers

from webhook_receiver import pointers
from webhook_receiver.brokers.identify import MISSING_KEY, BrokerMessage, Unidentified, identify
from webhook_receiver.config import parse_broker_spec, parse_spec
from webhook_receiver.fingerprint import canonical_number
from webhook_receiver.outbox import ordering
from webhook_receiver.webhooks.providers import (
    GenericProvider,
    Inbound,
    MissingKeyError,
    PayloadError,
    SourceConfig,
)
from webhook_receiver.webhooks.providers._common import resolve_pointer as webhook_resolve

from .helpers import RABBIT_SOURCE

DOC = {"items": ["a", "b"], "a~2": 1, "a~b": 2, "a/b": 3, "01": 4, "١": 5}


@pytest.mark.parametrize(
    ("pointer", "expected"),
    [
        ("", DOC),
        ("/items/0", "a"),
        ("/items/1", "b"),
        ("/a~0b", 2),
        ("/a~1b", 3),
        ("/01", 4),  # a member name, not an index: found in an object
        ("/١", 5),
    ],
)
def test_resolves(pointer, expected):
    assert pointers.resolve(DOC, pointer) == expected


@pytest.mark.parametrize(
    "pointer",
    [
        "/items/01",  # a leading zero is no index (RFC 6901 section 4)
        "/items/١",  # nor are non-ASCII digits
        "/items/-",  # the element after the last: nothing is there
        "/items/2",
        "/items/ 1",
        "/items/+1",
        "/items/1\n",
        "/items/" + "9" * 5000,  # not handed to int()
        "/nope",
        "/items/0/x",
    ],
)
def test_finds_nothing(pointer):
    assert pointers.resolve(DOC, pointer) is None


@pytest.mark.parametrize("pointer", ["/a~2", "/a~", "items", "~0"])
def test_refuses_what_is_no_pointer(pointer):
    with pytest.raises(pointers.PointerError):
        pointers.resolve(DOC, pointer)
    with pytest.raises(ValueError):
        parse_spec(f"json:{pointer}")


# --- every intake alike ------------------------------------------------------

# Member names and tokens that tell the resolvers apart if they differ:
# escapes, digits (ASCII, leading zero, Arabic-Indic), the "-" index.
NAMES = st.sampled_from(["a", "b", "0", "1", "01", "10", "١", "-", "~", "/", "a~2", "a/b", ""])
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53), max_value=2**53)
    | st.text(alphabet="ab01~/", max_size=4)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(NAMES, inner, max_size=4),
    max_leaves=12,
)
# A body that is JSON null reads as no JSON at all to the providers: containers only.
DOCUMENTS = st.dictionaries(NAMES, VALUES, max_size=4) | st.lists(VALUES, max_size=3)
RAW_TOKENS = NAMES | st.sampled_from(["~0", "~1", "~2", "~", "a~2b"])
POINTERS = st.lists(RAW_TOKENS, max_size=4).map(lambda ts: "".join("/" + t for t in ts)) | st.text(
    alphabet="/~012ab١-", max_size=8
)


def _webhook_key(document, pointer):
    body = json.dumps(document).encode()
    inbound = Inbound(body, Headers(), "application/json", document, time.time())
    source = SourceConfig(
        name="generic", provider="generic", secrets=("s",), dedup_key=f"json:{pointer}"
    )
    try:
        return GenericProvider().identify(inbound, source).dedup_key
    except MissingKeyError:
        return None


def _broker_key(document, pointer):
    source = replace(RABBIT_SOURCE, dedup_key=f"json:{pointer}")
    try:
        return identify(source, BrokerMessage(body=json.dumps(document).encode())).dedup_key
    except Unidentified as exc:
        assert exc.reason == MISSING_KEY, exc
        return None


def _ordering_entity(document, pointer):
    key = ordering.key_for("c", json.dumps(document).encode(), pointer, pointer)
    return None if key is None else key.entity.removeprefix("c:")


@given(DOCUMENTS, POINTERS)
def test_webhook_broker_and_ordering_resolve_alike(document, pointer):
    try:
        pointers.parse(pointer)
    except pointers.PointerError:
        # No pointer: the config refuses it for every intake, and so would each resolver.
        for check in (
            lambda: parse_spec(f"json:{pointer}"),
            lambda: parse_broker_spec(f"json:{pointer}", "rabbitmq"),
            lambda: ordering.resolve_pointer(document, pointer),
        ):
            with pytest.raises(ValueError):
                check()
        with pytest.raises(PayloadError):
            webhook_resolve(document, pointer)
        return
    value = webhook_resolve(document, pointer)
    # The very same value, not merely an equal one.
    assert ordering.resolve_pointer(document, pointer) is value
    assert pointers.resolve(document, pointer) is value

    # And the keys each intake reads from it.
    webhook, broker = _webhook_key(document, pointer), _broker_key(document, pointer)
    if isinstance(value, str) and value.strip():
        assert webhook == broker == value
    elif isinstance(value, int) and not isinstance(value, bool):
        assert broker == canonical_number(value)
    elif value is None or isinstance(value, dict | list):
        assert webhook is None and broker is None
    if isinstance(value, str) and 0 < len(value) < 100:
        assert _ordering_entity(document, pointer) == value
    elif value is None or isinstance(value, dict | list | bool):
        assert _ordering_entity(document, pointer) is None
