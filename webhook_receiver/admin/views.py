"""Admin views: log in and out, look at what arrived, and set stuck things going again."""

from __future__ import annotations

import logging
from collections import Counter
from datetime import timedelta
from typing import Any

from flask import (
    Response,
    abort,
    current_app,
    flash,
    redirect,
    render_template,
    request,
    send_from_directory,
    url_for,
)
from flask.typing import ResponseReturnValue

from ..config import FileConfig
from ..database import unit_of_work
from ..idempotency.persistence import records
from ..models import utcnow
from ..observability import metrics
from ..outbox import deliveries
from ..processing import registry
from . import (
    auth,
    conflict_reviews,
    counts,
    delivery_queries,
    paging,
    presenters,
    queries,
    targets,
)
from .blueprint import bp

log = logging.getLogger(__name__)

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
REVIEW_NOTE_MAX = 2000


def _page_size() -> int:
    size = int(current_app.config.get("ADMIN_PAGE_SIZE", DEFAULT_PAGE_SIZE))
    return max(1, min(size, MAX_PAGE_SIZE))


def _cursors() -> dict[str, paging.Cursor | None]:
    found: dict[str, paging.Cursor | None] = {"before": None, "after": None}
    for name in found:
        raw = request.args.get(name)
        if raw:
            try:
                found[name] = paging.Cursor.decode(raw)
            except ValueError:
                abort(400, "That page link is not valid; start again from the first page.")
    return found


def _pager(page: paging.Page) -> dict[str, str | None]:
    """Links to the newer and older pages, keeping the current filters."""
    # An argument named like one of url_for's own (endpoint, _method,
    # _external, ...) is no filter: passed on, it failed the page (a 500) or
    # changed the links.
    args: dict[str, Any] = {
        k: v
        for k, v in request.args.items()
        if k not in ("before", "after", "endpoint") and not k.startswith("_") and v
    }
    endpoint = request.endpoint or "admin.overview"
    return {
        "newer": url_for(endpoint, **request.view_args or {}, **args, after=page.newer.encode())
        if page.newer
        else None,
        "older": url_for(endpoint, **request.view_args or {}, **args, before=page.older.encode())
        if page.older
        else None,
        "first": url_for(endpoint, **request.view_args or {}, **args),
    }


def _render_list(template: str, page: paging.Page, **context: Any) -> str:
    """Render a paged list: its page, the links to its neighbours, and ``context``."""
    return render_template(template, page=page, pager=_pager(page), **context)


def _file_config() -> FileConfig:
    return current_app.config["FILE_CONFIG"]


def _broker_providers() -> dict[str, str]:
    """Each configured broker source's provider (rabbitmq, nats), to name its intake."""
    return {name: source.provider for name, source in _file_config().brokers.items()}


def _sources() -> list[str]:
    config = _file_config()
    # Webhook and broker sources alike, then the API clients' sources.
    names = sorted([*config.sources, *config.brokers])
    return names + [f"api:{name}" for name in sorted(config.clients)]


# A list's filters that name nothing are refused (400, the list's page with
# what is wrong), never answered with an empty or unfiltered list that an
# operator who mistyped would believe.


def check_source(source: str, errors: list[str], *, rejections: bool = False) -> None:
    """Say so in ``errors`` when ``source`` is neither configured nor on any stored row."""
    if source and source not in _sources():
        if not queries.source_is_stored(source, rejections=rejections):
            kept = "refusal" if rejections else "event"
            errors.append(
                f"Unknown source “{source}”: no source of that name is configured, "
                f"and no {kept} has it."
            )


def check_event_type(event_type: str, errors: list[str]) -> None:
    """Say so in ``errors`` when no event has ``event_type`` (types are not configured)."""
    if event_type and not queries.event_type_is_stored(event_type):
        errors.append(f"Unknown event type “{event_type}”: no event has it.")


def check_consumer(consumer: str, errors: list[str]) -> None:
    """Say so in ``errors`` when ``consumer`` is neither configured nor on any delivery."""
    configured = {name for named in registry.get().consumers.values() for name in named}
    if consumer and consumer not in configured and not queries.consumer_is_stored(consumer):
        errors.append(
            f"Unknown consumer “{consumer}”: no consumer of that name is configured, "
            "and no delivery is to one."
        )


def _status(errors: list[str]) -> int:
    return 400 if errors else 200


# -- session -----------------------------------------------------------------


@bp.route("/login", methods=["GET", "POST"])
def login() -> Any:
    """Show the login form, or check the password and open a session."""
    target = auth.safe_next(request.values.get("next"))
    if request.method == "GET":
        if auth.is_logged_in():
            return redirect(target or url_for("admin.overview"))
        return render_template("admin/login.html", next=target)
    now = utcnow()
    if auth.attempt_is_throttled(now):
        wait = auth.retry_after()
        body = render_template(
            "admin/login.html",
            next=target,
            error=f"Too many failed logins from your address. Try again in {wait // 60} minutes.",
        )
        return body, 429, {"Retry-After": str(wait)}
    if not auth.password_matches(request.form.get("password", "")):
        return render_template("admin/login.html", next=target, error="Wrong password.")
    auth.forget_failures()
    auth.log_in()
    return redirect(target or url_for("admin.overview"))


@bp.post("/logout")
def logout() -> ResponseReturnValue:
    """End the session, or every open session (a cookie left in another browser)."""
    if request.form.get("everywhere") == "yes":
        auth.log_out_everywhere()
        flash("You are logged out, and so is every session of every browser.")
    else:
        auth.log_out()
        flash("You are logged out.")
    return redirect(url_for("admin.login"))


# -- overview ----------------------------------------------------------------


@bp.get("")
def root() -> ResponseReturnValue:
    """Send /admin to the overview."""
    return redirect(url_for("admin.overview"))


@bp.get("/")
def overview() -> str:
    """Show the counts of the last day and week, and the hourly chart."""
    now = utcnow()
    hours = presenters.hours_ending(now, 24)
    chart = presenters.hourly_chart(
        hours, counts.hourly_received(hours[0]), counts.hourly_duplicates(hours[0])
    )
    windows = [
        ("Last 24 hours", counts.counts_since(now - timedelta(hours=24))),
        ("Last 7 days", counts.counts_since(now - timedelta(days=7))),
    ]
    return render_template(
        "admin/overview.html",
        windows=windows,
        backlog=counts.backlog(),
        chart=chart,
        now=now,
    )


# -- events ------------------------------------------------------------------


def _event_filters() -> tuple[queries.EventFilters, list[str]]:
    args = request.args
    errors: list[str] = []
    since, until, state = presenters.filter_fields(args, queries.EVENT_STATES, errors)
    filters = queries.EventFilters(
        source=args.get("source", "").strip(),
        event_type=args.get("type", "").strip(),
        state=state,
        since=since,
        until=until,
        q=args.get("q", "").strip(),
    )
    check_source(filters.source, errors)
    check_event_type(filters.event_type, errors)
    return filters, errors


@bp.get("/events")
def events() -> ResponseReturnValue:
    """List events, newest first, filtered and paged by keyset."""
    filters, errors = _event_filters()
    if errors:
        page = paging.Page([])
    else:
        page = queries.list_events(filters, limit=_page_size(), **_cursors())
    states = queries.delivery_states_of([row.id for row in page.rows])
    return _render_list(
        "admin/events.html",
        page,
        filters=filters,
        errors=errors,
        states={k: presenters.delivery_summary(v) for k, v in states.items()},
        state_choices=queries.EVENT_STATES,
        sources=_sources(),
    ), _status(errors)


@bp.get("/events/<int:event_id>")
def event(event_id: int) -> str:
    """Show one event: headers, body, duplicates, conflicts and deliveries."""
    detail = queries.event_detail(event_id)
    if detail is None:
        abort(404, "No such event.")
    now = utcnow()
    ev = detail.event
    tried = delivery_queries.attempts_of([d.id for d in detail.deliveries])
    return render_template(
        "admin/event.html",
        detail=detail,
        event=ev,
        headers=presenters.redact(ev.headers),
        body=presenters.show_body(ev.body, ev.content_type),
        meta=presenters.pretty_json(ev.meta) if ev.meta else "",
        idempotency_key=presenters.idempotency_key(ev.source, ev.meta),
        requeueable={d.id for d in detail.deliveries if queries.can_requeue(d, now)},
        attempts=tried,
        # All shown, or only the newest: the page says which.
        attempts_cut=sum(map(len, tried.values())) >= delivery_queries.ATTEMPTS_SHOWN,
        attempts_shown=delivery_queries.ATTEMPTS_SHOWN,
        filtered_out=targets.filtered_out(
            ev.source, ev.event_type, ev.body, {d.consumer for d in detail.deliveries}
        ),
        duplicates_shown=queries.DUPLICATES_SHOWN,
        shown_limit=presenters.SHOWN_LIMIT,
    )


def _chosen_ids() -> list[int]:
    """The delivery ids of an action's form: the ticked ones, or the whole page's."""
    raw_ids = request.form.getlist("ids")
    # The dead-letter page's "... all on this page" buttons carry its ids.
    if request.form.get("page_ids"):
        raw_ids = request.form["page_ids"].split(",")
    chosen = [raw.strip() for raw in raw_ids if raw.strip()]
    if not all(paging.is_row_id(raw) for raw in chosen):
        abort(400, "Delivery ids must be numbers.")
    ids = sorted({int(raw) for raw in chosen})
    # No page offers more; a form posted by hand with more took the database
    # past its limit of parameters in one statement.
    if len(ids) > MAX_PAGE_SIZE:
        abort(400, f"Choose at most {MAX_PAGE_SIZE} deliveries at once; nothing was changed.")
    return ids


def _action_form() -> tuple[list[int], str]:
    """An action's chosen delivery ids, and the page to go back to (by default, dead letters)."""
    return _chosen_ids(), auth.safe_next(request.form.get("next")) or url_for("admin.dead")


def _plural(count: int) -> str:
    return f"{count} {'delivery' if count == 1 else 'deliveries'}"


def _back_with_nothing_chosen(target: str) -> ResponseReturnValue:
    """Back to ``target``, saying that no delivery was ticked."""
    flash("Nothing was selected.", "warning")
    return redirect(target)


def _back_with_result(
    target: str, done: int, chosen: int, action: str, why_not: str
) -> ResponseReturnValue:
    """Back to ``target``, saying how many of the chosen were ``action`` and why not the rest."""
    message = f"{action.capitalize()} {_plural(done)}."
    if done < chosen:
        message += f" {chosen - done} could not be {action} ({why_not})."
    flash(message, "success" if done else "warning")
    return redirect(target)


@bp.post("/deliveries/requeue")
def requeue() -> ResponseReturnValue:
    """Requeue the chosen dead, failed or stuck deliveries."""
    ids, target = _action_form()
    if not ids:
        return _back_with_nothing_chosen(target)
    now = utcnow()
    allowed = queries.requeueable(ids, now)
    count = 0
    if allowed:
        with unit_of_work():
            count = deliveries.requeue(allowed, now)
    return _back_with_result(
        target, count, len(ids), "requeued", "delivered, skipped, discarded or in progress"
    )


@bp.post("/deliveries/discard")
def discard() -> ResponseReturnValue:
    """Discard the chosen dead deliveries for good, once the operator has confirmed it."""
    ids, target = _action_form()
    if not ids:
        return _back_with_nothing_chosen(target)
    # The form's checkbox is required in the browser too; this is the check
    # that counts (no JavaScript, and a form can be posted by hand).
    if request.form.get("confirm") != "yes":
        flash(
            "Nothing was discarded: tick “I understand these deliveries will never be "
            "retried” to confirm.",
            "warning",
        )
        return redirect(target)
    with unit_of_work():
        done = deliveries.discard(ids, utcnow())
    for (source, consumer), n in Counter((d.source, d.consumer) for d in done).items():
        metrics.discarded(source, consumer, n)
    log.info(
        "discarded %d dead deliveries (%d not discarded)",
        len(done),
        len(ids) - len(done),
        extra={
            "outcome": "discarded",
            "count": len(done),
            "not_discarded": len(ids) - len(done),
            "consumers": sorted({item.consumer for item in done}),
            "event_ids": sorted({item.event_id for item in done}),
            "delivery_ids": [item.id for item in done],
        },
    )
    return _back_with_result(
        target,
        len(done),
        len(ids),
        "discarded",
        "not dead: requeued, in progress, delivered, skipped or already discarded",
    )


# -- dead letters ------------------------------------------------------------


@bp.get("/dead")
def dead() -> ResponseReturnValue:
    """List dead deliveries, to requeue or discard one or many."""
    consumer = request.args.get("consumer", "").strip()
    errors: list[str] = []
    check_consumer(consumer, errors)
    page = (
        paging.Page([])
        if errors
        else queries.list_dead(limit=_page_size(), consumer=consumer, **_cursors())
    )
    return _render_list(
        "admin/dead.html",
        page,
        consumer=consumer,
        errors=errors,
        page_ids=",".join(str(row.id) for row in page.rows),
    ), _status(errors)


# -- conflicts ---------------------------------------------------------------


@bp.get("/conflicts")
def conflicts() -> ResponseReturnValue:
    """List deliveries that reused a dedup key with different content."""
    view = request.args.get("view") or "unreviewed"
    errors: list[str] = []
    if view not in conflict_reviews.CONFLICT_VIEWS:
        errors.append(
            f"Unknown view “{view}”: choose one of {', '.join(conflict_reviews.CONFLICT_VIEWS)}."
        )
    page = (
        paging.Page([])
        if errors
        else conflict_reviews.list_conflicts(limit=_page_size(), view=view, **_cursors())
    )
    brokers = _broker_providers()
    return _render_list(
        "admin/conflicts.html",
        page,
        view=view,
        views=conflict_reviews.CONFLICT_VIEWS,
        errors=errors,
        intakes={row.id: presenters.intake(row.source, brokers, row.broker) for row in page.rows},
    ), _status(errors)


def _body_download(body: bytes | None, name: str) -> Response:
    """A stored body as it came, byte for byte, saved as a file (never shown inline)."""
    response = Response(body or b"", mimetype="application/octet-stream")
    response.headers["Content-Disposition"] = f'attachment; filename="{name}"'
    return response


@bp.get("/events/<int:event_id>/body")
def event_body(event_id: int) -> Response:
    """Download an event's body as it was received."""
    body = queries.event_body(event_id)
    if body is None:
        abort(404, "No such event.")
    return _body_download(body, f"event-{event_id}.body")


@bp.get("/conflicts/<int:conflict_id>/body")
def conflict_body(conflict_id: int) -> Response:
    """Download a conflicting delivery's body as it was received."""
    body = conflict_reviews.conflict_body(conflict_id)
    if body is None:
        abort(404, "No such conflict.")
    return _body_download(body, f"conflict-{conflict_id}.body")


@bp.get("/conflicts/<int:conflict_id>")
def conflict(conflict_id: int) -> str:
    """Show the original and the conflicting payload side by side."""
    return _conflict_page(conflict_id)


def _conflict_page(conflict_id: int, refused_note: str | None = None) -> str:
    """The conflict's page; ``refused_note`` is a note not saved, kept in the form to edit."""
    found = conflict_reviews.conflict_with_event(conflict_id)
    if found is None:
        abort(404, "No such conflict.")
    item, original = found
    body = presenters.compare_bodies(
        presenters.diff_lines(original.body, original.content_type),
        presenters.diff_lines(item.body, item.content_type),
    )
    headers = presenters.compare_bodies(
        [f"{n}: {v}" for n, v in presenters.redact(original.headers)],
        [f"{n}: {v}" for n, v in presenters.redact(item.headers)],
        context=1000,
    )
    meta = original.meta if isinstance(original.meta, dict) else {}
    return render_template(
        "admin/conflict.html",
        conflict=item,
        original=original,
        intake=presenters.intake(item.source, _broker_providers(), meta.get("broker")),
        body=body,
        headers=headers,
        max_lines=presenters.MAX_DIFF_LINES,
        max_kb=presenters.MAX_DIFF_BYTES // 1024,
        note_max=REVIEW_NOTE_MAX,
        review_version=conflict_reviews.review_version(item),
        refused_note=refused_note,
    )


@bp.post("/conflicts/<int:conflict_id>/review")
def review(conflict_id: int) -> ResponseReturnValue:
    """Mark a conflict reviewed, with the operator's note, unless another review came first."""
    note = request.form.get("note", "").strip()
    if len(note) > REVIEW_NOTE_MAX:
        abort(400, f"The note is longer than {REVIEW_NOTE_MAX} characters.")
    try:
        seen = conflict_reviews.parse_review_version(request.form.get("reviewed"))
    except ValueError:
        abort(400, "The review form is not valid; reload the page and try again.")
    with unit_of_work():
        saved = conflict_reviews.review_conflict(conflict_id, note, utcnow(), seen)
    if not saved:
        # Missing (404 from the page), or reviewed by someone else meanwhile:
        # the page shows their review, and this note in the form to edit.
        return _conflict_page(conflict_id, refused_note=note), 409
    flash("Marked as reviewed.", "success")
    return redirect(url_for("admin.conflict", conflict_id=conflict_id))


# -- idempotency keys --------------------------------------------------------


@bp.get("/idempotency")
def idempotency() -> ResponseReturnValue:
    """List Idempotency-Key records per client, with their state and expiry."""
    client = request.args.get("client", "").strip()
    state = request.args.get("state", "")
    key = request.args.get("key", "").strip()
    errors: list[str] = []
    if state and state not in queries.KEY_STATES:
        errors.append(f"Unknown state “{state}”: choose one of {', '.join(queries.KEY_STATES)}.")
    if client and client not in _file_config().clients and not queries.client_is_stored(client):
        errors.append(
            f"Unknown client “{client}”: no client of that name is configured, and no key is one's."
        )
    now = utcnow()
    page = (
        paging.Page([])
        if errors
        else queries.list_idempotency_records(
            limit=_page_size(), now=now, client=client, state=state, key=key, **_cursors()
        )
    )
    return _render_list(
        "admin/idempotency.html",
        page,
        client=client,
        state=state,
        key=key,
        now=now,
        # Offered an Evict button: all but those the engine would keep.
        running={row.id for row in page.rows if records.is_running(row, now)},
        errors=errors,
        clients=sorted(_file_config().clients),
        key_states=queries.KEY_STATES,
    ), _status(errors)


@bp.post("/idempotency/<int:record_id>/evict")
def evict(record_id: int) -> ResponseReturnValue:
    """Delete one Idempotency-Key record, so that the key may be used afresh; not while it runs."""
    back = auth.safe_next(request.form.get("next")) or url_for("admin.idempotency")
    # The form's checkbox is required in the browser too; this is the check
    # that counts (no JavaScript, and a form can be posted by hand).
    if request.form.get("confirm") != "yes":
        flash("Nothing was evicted: tick “Its next request runs afresh” to confirm.", "warning")
        return redirect(back)
    # The rule (never a running request's record) is the engine's own.
    with unit_of_work():
        outcome = records.evict(record_id, utcnow())
    if outcome == records.EVICTED:
        flash("Evicted the key: its next request runs afresh.", "success")
    elif outcome == records.RUNNING:
        flash(
            "Not evicted: its request is still running, and a retry would run it a second "
            "time. Evict it once it has completed, or once its lease has run out (abandoned).",
            "warning",
        )
    else:
        flash("That key was already gone.", "warning")
    return redirect(back)


# -- rejections --------------------------------------------------------------


@bp.get("/rejections")
def rejections() -> ResponseReturnValue:
    """List webhook deliveries refused (signature, timestamp) and broker messages dead-lettered."""
    source = request.args.get("source", "").strip()
    errors: list[str] = []
    check_source(source, errors, rejections=True)
    page = (
        paging.Page([])
        if errors
        else queries.list_rejections(limit=_page_size(), source=source, **_cursors())
    )
    brokers = _broker_providers()
    return _render_list(
        "admin/rejections.html",
        page,
        source=source,
        sources=_sources(),
        errors=errors,
        intakes={
            row.id: presenters.rejection_intake(row.source, row.reason, brokers)
            for row in page.rows
        },
        reasons=presenters.REJECTION_REASONS,
    ), _status(errors)


# -- favicon -----------------------------------------------------------------


def favicon() -> ResponseReturnValue:
    """Serve the admin's icon where browsers look for one by default."""
    return send_from_directory(bp.static_folder or "", "favicon.svg", mimetype="image/svg+xml")


# At the root, not under /admin: a browser asks for /favicon.ico on its own.
bp.record_once(lambda state: state.app.add_url_rule("/favicon.ico", "favicon", favicon))
