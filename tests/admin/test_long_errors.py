"""An attempt's error, kept up to 2,000 characters, can be read whole on the event page."""

from __future__ import annotations

import html

from webhook_receiver.outbox.attempts import MAX_ERROR

from .conftest import delivery, event, text
from .test_deliveries import attempt


def test_an_attempts_long_error_can_be_read_whole(admin_app, admin):
    target = event(admin_app)
    billing = delivery(admin_app, target, state="pending", attempts=2, last_error="HTTP 503")
    # What a timeout's traceback or a proxy's error page leaves: the cause at the end.
    error = "connection failed: " + "retrying via proxy; " * 90 + "cause: certificate expired"
    error = error[-MAX_ERROR:]
    attempt(admin_app, billing, 1, "retryable_failure", error=error)
    attempt(admin_app, billing, 2, "retryable_failure", error="HTTP 503")
    page = html.unescape(text(admin.get(f"/admin/events/{target}")))
    row = page[page.index('data-attempt="1"') : page.index('data-attempt="2"')]
    assert error in row
    assert "cause: certificate expired" in row
    # A short one shows as it is, not folded away.
    second = page[page.index('data-attempt="2"') :]
    assert '<pre class="error">HTTP 503</pre>' in second
    assert "<details" not in second[: second.index("</tr>")]
