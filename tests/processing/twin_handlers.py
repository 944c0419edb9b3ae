"""Two handlers registered under one name on one source."""

from __future__ import annotations

from typing import Any

from webhook_receiver.processing import handler


@handler(source="shop", name="twin")
def first(event: Any, session: Any) -> None:
    pass


@handler(source="shop", name="twin")
def second(event: Any, session: Any) -> None:
    pass
