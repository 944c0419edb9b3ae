"""A handler for a source the config does not have (a typo of ``shop``)."""

from __future__ import annotations

from typing import Any

from webhook_receiver.processing import handler


@handler(source="shopp", name="typo")
def never_called(event: Any, session: Any) -> None:
    raise AssertionError("a handler of no source ran")
