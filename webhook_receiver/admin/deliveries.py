"""Admin views of deliveries: the Deliveries list, replays (one event, or many by a filter).

A bulk replay takes two steps: the filter's count on a confirmation page
(``GET /admin/deliveries/replay``), then the replay itself (a POST with the
CSRF token, the confirmation ticked, the count shown and the highest id
counted), which a worker runs in the background (``replay.queue``). Should
the count have changed between the two (a worker moved a delivery out of
the filtered state), nothing is replayed and the page asks again with the
new count. One event's replay runs at once, in the request.
"""

from __future__ import annotations

import logging
from typing import Any

from flask import abort, flash, redirect, render_template, request, url_for
from flask.typing import ResponseReturnValue
from werkzeug.datastructures import MultiDict

from ..extensions import db
from ..models import utcnow
from ..outbox import replays
from ..outbox.replays import Filter
from ..processing import replay
from . import delivery_queries, paging, presenters
from .blueprint import bp
from .views import (
    _cursors,
    _page_size,
    _plural,
    _render_list,
    _sources,
    check_consumer,
    check_event_type,
    check_source,
)

log = logging.getLogger(__name__)

# A bulk replay from the admin takes at most this many (a worker runs it, in the background).
MAX_REPLAY = 100_000


def _filter(args: MultiDict[str, str]) -> tuple[Filter, int | None, list[str]]:
    """The Deliveries filter and replay limit in a query or form, and what is wrong with them."""
    errors: list[str] = []
    since, until, state = presenters.filter_fields(args, replays.STATES, errors)
    limit = None
    raw_limit = args.get("limit", "").strip()
    if raw_limit:
        if not paging.is_row_id(raw_limit) or not 1 <= int(raw_limit) <= MAX_REPLAY:
            errors.append(f"The limit must be a number from 1 to {MAX_REPLAY:,}.")
        else:
            limit = int(raw_limit)
    flt = Filter(
        consumer=args.get("consumer", "").strip(),
        source=args.get("source", "").strip(),
        event_type=args.get("type", "").strip(),
        state=state,
        since=since,
        until=until,
    )
    check_consumer(flt.consumer, errors)
    check_source(flt.source, errors)
    check_event_type(flt.event_type, errors)
    return flt, limit, errors


def _filter_args(flt: Filter, limit: int | None) -> dict[str, Any]:
    """The filter as query arguments (the ones given)."""
    found = {
        "consumer": flt.consumer,
        "source": flt.source,
        "type": flt.event_type,
        "state": flt.state,
        "since": presenters.local_input(flt.since),
        "until": presenters.local_input(flt.until),
        "limit": str(limit) if limit else "",
    }
    return {name: value for name, value in found.items() if value}


def _actor() -> str:
    return f"admin from {request.remote_addr or 'unknown address'}"


@bp.get("/deliveries")
def deliveries() -> ResponseReturnValue:
    """List deliveries, newest event first, filtered and paged by keyset."""
    flt, limit, errors = _filter(request.args)
    if errors:
        return _refused(flt, limit, errors)
    page = delivery_queries.list_deliveries(flt, limit=_page_size(), **_cursors())
    return _list_page(page, flt, limit, errors)


def _list_page(page: paging.Page, flt: Filter, limit: int | None, errors: list[str]) -> str:
    return _render_list(
        "admin/deliveries.html",
        page,
        flt=flt,
        limit=limit,
        errors=errors,
        states=replays.STATES,
        sources=_sources(),
        active=bool(_filter_args(flt, limit)),
        max_replay=MAX_REPLAY,
    )


def _refused(flt: Filter, limit: int | None, errors: list[str]) -> ResponseReturnValue:
    """The Deliveries page, empty, saying what is wrong with its filter (400)."""
    return _list_page(paging.Page([]), flt, limit, errors), 400


@bp.get("/deliveries/replay")
def replay_preview() -> ResponseReturnValue:
    """Show how many deliveries a bulk replay by this filter takes, to confirm it."""
    flt, limit, errors = _filter(request.args)
    if errors:
        # The filter's form, saying what to fix: sent back to an unfiltered
        # list, an operator could take it for what the filter matched.
        return _refused(flt, limit, errors)
    return _confirmation(flt, limit)


def _confirmation(flt: Filter, limit: int | None, changed_from: int | None = None) -> str:
    plan = replay.preview(flt, limit=limit or MAX_REPLAY)
    capped = limit is None and plan.count == MAX_REPLAY
    return render_template(
        "admin/replay_confirm.html",
        plan=plan,
        flt=flt,
        limit=limit,
        args=_filter_args(flt, limit),
        capped=capped,
        changed_from=changed_from,
        max_replay=MAX_REPLAY,
        same_key_warning=replay.SAME_KEY_WARNING,
    )


@bp.post("/deliveries/replay")
def replay_many() -> ResponseReturnValue:
    """Replay the deliveries a filter takes, once the operator has confirmed the count."""
    flt, limit, errors = _filter(request.form)
    if errors:
        abort(400, " ".join(errors))
    raw_up_to, raw_count = request.form.get("up_to", ""), request.form.get("count", "")
    if not (paging.is_row_id(raw_up_to) and paging.is_row_id(raw_count)):
        abort(400, "The confirmation form is incomplete; start again from the Deliveries page.")
    up_to, shown = int(raw_up_to), int(raw_count)
    if request.form.get("confirm") != "yes":
        flash("Nothing was replayed: tick the confirmation to replay.", "warning")
        return redirect(url_for("admin.replay_preview", **_filter_args(flt, limit)))
    try:
        now = replays.count(flt, limit=limit or MAX_REPLAY, up_to=up_to)
    finally:
        db.session.rollback()
    if now != shown:
        flash(
            f"Nothing was replayed: {_plural(now)} match now, not the {shown:,} shown. "
            "Check the new count and confirm again.",
            "warning",
        )
        return _confirmation(flt, limit, changed_from=shown)
    plan = replay.Preview(flt, now, up_to, limit or MAX_REPLAY)
    new_key = request.form.get("new_key") == "yes"
    # Run by a worker in the background: 100,000 deliveries, in batches that
    # rest to leave the database to the intake, outlast a request.
    replay_id = replay.queue(plan, actor=_actor(), via=replays.VIA_ADMIN, new_key=new_key)
    flash(
        f"Replay {replay_id}: {_plural(now)} to queue again"
        + (", each with a new key" if new_key else f" ({replay.SAME_KEY_WARNING})")
        + ". A worker queues them in batches, in the background: its progress is below.",
        "success",
    )
    return redirect(url_for("admin.replays"))


@bp.post("/events/<int:event_id>/replay")
def replay_event(event_id: int) -> ResponseReturnValue:
    """Send one event again to one of its consumers, or to all of them."""
    consumer = request.form.get("consumer", "").strip()
    new_key = request.form.get("new_key") == "yes"
    try:
        done = replay.replay_event(
            event_id, consumer, actor=_actor(), via=replays.VIA_ADMIN, new_key=new_key
        )
    except replay.ReplayError as exc:
        # The whole message: the other one quotes the consumer asked for.
        if str(exc) == f"no event {event_id}":
            abort(404, "No such event.")
        flash(f"Nothing was replayed: {exc}.", "warning")
        return redirect(url_for("admin.event", event_id=event_id))
    flash(_done_message(done, new_key), "success" if done.replayed else "warning")
    return redirect(url_for("admin.event", event_id=event_id) + "#deliveries")


def _done_message(done: replay.Done, new_key: bool) -> str:
    message = f"Replay {done.replay_id}: queued {_plural(done.replayed)} again"
    message += ", each with a new key." if new_key else f" ({replay.SAME_KEY_WARNING})."
    if done.left_alone:
        message += f" {_plural(done.left_alone)} left alone: in progress at a worker, or gone."
    return message


@bp.get("/replays", endpoint="replays")
def replays_list() -> str:
    """List replays, newest first: who asked, when, for what, and how many went again."""
    page = delivery_queries.list_replays(limit=_page_size(), **_cursors())
    return _render_list("admin/replays.html", page, now=utcnow())
