"""A handler with a filter, loaded through ``handlers = ["tests.processing.filtered_handlers"]``."""

from __future__ import annotations

from typing import Any

from webhook_receiver.processing import handler


@handler(source="shop", name="big-orders", filter="data.amount >= `100`")
def big_orders(event: Any, session: Any) -> None:
    """Take big orders only: the filter keeps the others from getting a delivery."""
