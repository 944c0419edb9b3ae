"""Turning stored rows into what the templates show: bodies, diffs, the chart, times.

Nothing here builds HTML: it hands plain strings and numbers to Jinja, whose
autoescaping makes every payload and header value inert.
"""

from __future__ import annotations

import codecs
import difflib
import json
import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from werkzeug.http import parse_options_header

from ..events import REDACTED, is_secret_header
from ..fingerprint import JSONError, is_json_type, loads

# C0 controls other than tab, newline and carriage return, and DEL: a body
# holding them is shown as bytes.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
HEXDUMP_LIMIT = 4096
# A text or JSON body larger than this is shown as its first part, as text
# (laid out whole, one raised MAX_BODY_BYTES made the page as large); the
# whole body is a download (views.event_body).
SHOWN_LIMIT = 1024 * 1024


def redact(headers: Iterable[Sequence[str]] | None) -> list[tuple[str, str]]:
    """The headers as (name, value), again hiding anything that looks like a credential."""
    shown = []
    for pair in headers or []:
        if len(pair) != 2:
            continue
        name, value = str(pair[0]), str(pair[1])
        # Rows stored before the receipt redacted by name are hidden here too.
        if is_secret_header(name):
            value = REDACTED
        shown.append((name, header_text(value)))
    return shown


def header_text(value: str) -> str:
    """A stored header value as its sender wrote it: UTF-8 bytes read as such.

    WSGI hands header bytes over as Latin-1 (PEP 3333), so "Zoë" sent as
    UTF-8 is stored as "ZoÃ«". Bytes that are not UTF-8 stay Latin-1, and a
    value holding characters beyond Latin-1 was text already (a broker's).
    """
    if value.isascii():
        return value
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return value


@dataclass(frozen=True)
class Body:
    """A stored body as it will be shown."""

    kind: str  # json | text | binary | empty
    text: str
    size: int
    truncated: bool = False
    charset: str = ""  # the Content-Type's, when a text body was read in another than UTF-8


def hexdump(data: bytes, limit: int | None = HEXDUMP_LIMIT) -> list[str]:
    """Lines of offset, hex bytes and printable ASCII, like ``hexdump -C``."""
    shown = data if limit is None else data[:limit]
    lines = []
    for offset in range(0, len(shown), 16):
        chunk = shown[offset : offset + 16]
        hexes = " ".join(f"{b:02x}" for b in chunk)
        text = "".join(chr(b) if 0x20 <= b < 0x7F else "." for b in chunk)
        lines.append(f"{offset:08x}  {hexes:<47}  |{text}|")
    return lines


def declared_charset(content_type: str | None) -> str:
    """The charset a Content-Type names, lowercased, when Python knows it; else ""."""
    if not content_type:
        return ""
    name = parse_options_header(content_type)[1].get("charset", "").strip().lower()
    try:
        codecs.lookup(name)
    except LookupError:
        return ""
    return name


def _as_text(body: bytes, charset: str = "") -> str | None:
    # The charset the sender named, else UTF-8: a Latin-1 form post is text too.
    try:
        text = body.decode(charset or "utf-8")
    except (UnicodeError, LookupError):  # LookupError: not a text encoding (zlib)
        return None
    return None if _CONTROL.search(text) else text


def _head_text(head: bytes, charset: str) -> str | None:
    """A body's first part as text, a character cut in two at its end left out; None if not text."""
    try:
        head.decode(charset or "utf-8")
    except UnicodeDecodeError as exc:
        if exc.start >= len(head) - 3:  # a character's first bytes only, at the cut
            head = head[: exc.start]
    except LookupError:
        return None
    return _as_text(head, charset)


def _as_json(body: bytes, content_type: str | None) -> object | None:
    if not is_json_type(content_type) and body.lstrip()[:1] not in (b"{", b"["):
        return None
    try:
        return loads(body)
    except JSONError:
        return None


def show_body(body: bytes | None, content_type: str | None) -> Body:
    """Pretty-print JSON, show text as it is, and bytes as a hex dump."""
    body = body or b""
    if not body:
        return Body("empty", "", 0)
    charset = declared_charset(content_type)
    if len(body) > SHOWN_LIMIT:
        head = _head_text(body[:SHOWN_LIMIT], charset)
        if head is not None:
            return Body("text", head, len(body), truncated=True)
        return Body("binary", "\n".join(hexdump(body)), len(body), truncated=True)
    parsed = _as_json(body, content_type)
    if parsed is not None:
        return Body("json", json.dumps(parsed, indent=2, ensure_ascii=False), len(body))
    text = _as_text(body, charset)
    if text is not None:
        named = charset if codecs.lookup(charset or "utf-8").name != "utf-8" else ""
        return Body("text", text, len(body), charset=named)
    return Body("binary", "\n".join(hexdump(body)), len(body), len(body) > HEXDUMP_LIMIT)


def pretty_json(value: object) -> str:
    """Indent a JSON value for reading."""
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)


def diff_lines(body: bytes | None, content_type: str | None) -> list[str]:
    """A body as lines fit for comparing: JSON with sorted keys, text, or a hex dump."""
    body = body or b""
    parsed = _as_json(body, content_type)
    if parsed is not None:
        return json.dumps(parsed, indent=2, sort_keys=True, ensure_ascii=False).splitlines()
    text = _as_text(body, declared_charset(content_type))
    if text is not None:
        return text.splitlines()
    return hexdump(body, limit=64 * 1024)


# -- side-by-side diff -------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """A run of characters in a diff line, changed or not."""

    text: str
    changed: bool = False


@dataclass(frozen=True)
class DiffRow:
    """One row of the side-by-side table: a line on each side (either may be absent)."""

    tag: str  # equal | replace | delete | insert | skip
    left_no: int | None = None
    left: tuple[Segment, ...] = ()
    right_no: int | None = None
    right: tuple[Segment, ...] = ()
    skipped: int = 0


_TOKEN = re.compile(r"\w+|\s+|[^\w\s]")


def _intraline(a: str, b: str) -> tuple[tuple[Segment, ...], tuple[Segment, ...]]:
    if len(a) > MAX_INTRALINE_CHARS or len(b) > MAX_INTRALINE_CHARS:
        return (Segment(a, True),), (Segment(b, True),)  # changed, without the words marked
    # Compare words and punctuation rather than characters: "100" against
    # "250" is one changed number, not a scatter of changed digits.
    ta, tb = _TOKEN.findall(a), _TOKEN.findall(b)
    matcher = difflib.SequenceMatcher(None, ta, tb, autojunk=False)
    left: list[Segment] = []
    right: list[Segment] = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        changed = tag != "equal"
        if i2 > i1:
            _append(left, "".join(ta[i1:i2]), changed)
        if j2 > j1:
            _append(right, "".join(tb[j1:j2]), changed)
    return tuple(left), tuple(right)


def _append(segments: list[Segment], text: str, changed: bool) -> None:
    if segments and segments[-1].changed == changed:
        segments[-1] = Segment(segments[-1].text + text, changed)
    else:
        segments.append(Segment(text, changed))


# Line matching is quadratic in the worst case (18 KB bodies took 2.8 s and
# 1 MB never rendered), and so is the word matching of one long line. Past
# these bounds the bodies are shown side by side without highlighting.
MAX_DIFF_LINES = 1000
MAX_DIFF_BYTES = 32 * 1024
MAX_INTRALINE_CHARS = 500


@dataclass(frozen=True)
class BodyDiff:
    """The conflict page's body comparison: highlighted rows, or both texts as they are."""

    rows: list[DiffRow]
    bounded: bool = True  # False: too large to compare; ``left``/``right`` hold the texts
    left: str = ""
    right: str = ""


def diff_within_bounds(a: list[str], b: list[str]) -> bool:
    """Tell whether two line lists are small enough to compare line by line, on time."""
    if len(a) > MAX_DIFF_LINES or len(b) > MAX_DIFF_LINES:
        return False
    size = 0
    for line in (*a, *b):
        size += len(line) + 1
        if size > 2 * MAX_DIFF_BYTES:
            return False
    return True


def compare_bodies(a: list[str], b: list[str], context: int = 3) -> BodyDiff:
    """Highlight the differences of two bodies within the bounds; past them, show both plainly."""
    if diff_within_bounds(a, b):
        return BodyDiff(side_by_side(a, b, context))
    return BodyDiff([], False, "\n".join(a), "\n".join(b))


def side_by_side(a: list[str], b: list[str], context: int = 3) -> list[DiffRow]:
    """Compare two line lists; long unchanged runs fold to ``context`` lines each side."""
    rows: list[DiffRow] = []
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    opcodes = matcher.get_opcodes()
    for index, (tag, i1, i2, j1, j2) in enumerate(opcodes):
        if tag == "equal":
            keep_head = context if index > 0 else 0
            keep_tail = context if index < len(opcodes) - 1 else 0
            length = i2 - i1
            if length > keep_head + keep_tail + 1:
                for k in range(keep_head):
                    rows.append(_same(a, i1 + k, j1 + k))
                rows.append(DiffRow("skip", skipped=length - keep_head - keep_tail))
                for k in range(length - keep_tail, length):
                    rows.append(_same(a, i1 + k, j1 + k))
            else:
                rows.extend(_same(a, i1 + k, j1 + k) for k in range(length))
            continue
        left_lines = range(i1, i2)
        right_lines = range(j1, j2)
        for k in range(max(len(left_lines), len(right_lines))):
            li = left_lines[k] if k < len(left_lines) else None
            ri = right_lines[k] if k < len(right_lines) else None
            if li is not None and ri is not None:
                left, right = _intraline(a[li], b[ri])
                rows.append(DiffRow("replace", li + 1, left, ri + 1, right))
            elif li is not None:
                rows.append(DiffRow("delete", li + 1, (Segment(a[li], True),)))
            elif ri is not None:
                rows.append(DiffRow("insert", right_no=ri + 1, right=(Segment(b[ri], True),)))
    return rows


def _same(a: list[str], i: int, j: int) -> DiffRow:
    return DiffRow("equal", i + 1, (Segment(a[i]),), j + 1, (Segment(a[i]),))


# -- the chart ---------------------------------------------------------------


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    value: int


@dataclass(frozen=True)
class Column:
    hour: datetime
    received: Bar
    duplicates: Bar
    label: str = ""


@dataclass
class Chart:
    """Geometry of the hourly chart, drawn as SVG by the template."""

    width: int
    height: int
    top: int
    baseline: int
    left: int
    peak: int
    columns: list[Column] = field(default_factory=list)
    ticks: list[tuple[float, int]] = field(default_factory=list)


def hours_ending(now: datetime, count: int) -> list[datetime]:
    """The ``count`` UTC hours up to and including the current one, oldest first."""
    current = now.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    return [current - timedelta(hours=count - 1 - i) for i in range(count)]


def hourly_chart(
    hours: list[datetime],
    received: dict[datetime, int],
    duplicates: dict[datetime, int],
    *,
    width: int = 1160,
    height: int = 200,
) -> Chart:
    """Lay out a pair of bars (received, duplicates) per hour."""
    left, top, bottom = 44, 12, 28
    baseline = height - bottom
    plot_height = baseline - top
    highest = max([1, *(received.get(h, 0) for h in hours), *(duplicates.get(h, 0) for h in hours)])
    # The axis runs to a round number above the highest bar, in round steps.
    step = nice_step(highest)
    peak = step * math.ceil(highest / step)
    slot = (width - left - 8) / max(1, len(hours))
    bar = max(1.0, slot * 0.38)
    chart = Chart(width, height, top, baseline, left, peak)

    def make(x: float, value: int) -> Bar:
        h = plot_height * value / peak
        return Bar(round(x, 1), round(baseline - h, 1), round(bar, 1), round(h, 1), value)

    for i, hour in enumerate(hours):
        x = left + i * slot + slot * 0.1
        chart.columns.append(
            Column(
                hour,
                make(x, received.get(hour, 0)),
                make(x + bar, duplicates.get(hour, 0)),
                hour.strftime("%H:00") if i % 3 == 0 else "",
            )
        )
    for value in range(0, peak + 1, step):
        chart.ticks.append((round(baseline - plot_height * value / peak, 1), value))
    return chart


def nice_step(highest: int, most: int = 5) -> int:
    """The smallest step of 1, 2 or 5 times a power of ten with at most ``most`` intervals."""
    magnitude = 1
    while True:
        for factor in (1, 2, 5):
            step = factor * magnitude
            if math.ceil(highest / step) <= most:
                return step
        magnitude *= 10


# -- formatting --------------------------------------------------------------


def utc(moment: datetime | None) -> str:
    """Format an aware datetime in UTC to the second, or a dash."""
    if moment is None:
        return "—"
    return _iso(moment, "seconds")


def _iso(moment: datetime, timespec: str) -> str:
    # Not strftime: its %Y leaves years before 1000 unpadded ("1-01-01"),
    # which a time field then refuses.
    return moment.astimezone(UTC).replace(tzinfo=None).isoformat(" ", timespec)


def filter_fields(
    args: Mapping[str, str], states: Collection[str], errors: list[str]
) -> tuple[datetime | None, datetime | None, str]:
    """A filter form's since, until and state; what is wrong with them goes to ``errors``.

    A wrong value is left out of the filter (None, or no state), and said.
    """
    times: dict[str, datetime | None] = {}
    for name in ("since", "until"):
        try:
            times[name] = parse_utc(args.get(name, ""))
        except ValueError:
            errors.append(f"“{args.get(name)}” is not a date and time (use YYYY-MM-DDTHH:MM, UTC).")
            times[name] = None
    since, until = times["since"], times["until"]
    if since is not None and until is not None and since > until:
        # No row is in a range that ends before it starts: an empty list would mislead.
        errors.append(
            f"“From” ({args.get('since', '').strip()}) is after “Until” "
            f"({args.get('until', '').strip()}): swap them."
        )
    state = args.get("state", "")
    if state and state not in states:
        errors.append(f"Unknown state “{state}”: choose one of {', '.join(states)}.")
        state = ""
    return since, until, state


def parse_utc(raw: str) -> datetime | None:
    """Read a time field's value (``YYYY-MM-DD[ HH:MM[:SS]]``, or with a ``T``) as UTC."""
    raw = raw.strip()
    if not raw:
        return None
    try:
        moment = datetime.fromisoformat(raw)
    except ValueError as exc:
        raise ValueError(f"not a date and time: {raw!r}") from exc
    if moment.tzinfo is None:
        return moment.replace(tzinfo=UTC)
    try:
        return moment.astimezone(UTC)
    except OverflowError:
        # 0001-01-01T00:00+01:00 is before the year 1 in UTC, 9999-12-31T23:59-01:00
        # after 9999: a bound past every stored time, taken as the first or last there is.
        return (datetime.min if moment.year == 1 else datetime.max).replace(tzinfo=UTC)


def local_input(moment: datetime | None) -> str:
    """Format a datetime for a time field, as ISO 8601 in UTC (``YYYY-MM-DD HH:MM``).

    Seconds and microseconds are kept when there are any: the filter goes
    back as it came (a bulk replay's confirmation carries it), not widened.
    """
    if moment is None:
        return ""
    if moment.microsecond:
        return _iso(moment, "microseconds")
    return _iso(moment, "seconds" if moment.second else "minutes")


# -- intakes -----------------------------------------------------------------

BROKER_NAMES = {
    "rabbitmq": "RabbitMQ",
    "nats": "NATS",
    "kafka": "Kafka",
    "sqs": "Amazon SQS",
    "pubsub": "Pub/Sub",
    "redis": "Redis Streams",
    "mqtt": "MQTT",
}
# What refused an unauthentic webhook delivery (webhooks/receipt.py; its
# sender unknown when unreadable before the check): the overview's signature
# failures. A signed delivery refused for its content is listed as
# refused-<problem>; any other reason is a broker message dead-lettered
# without being stored (brokers/batch.py).
WEBHOOK_REFUSALS = frozenset({"signature", "timestamp", "unreadable"})
REFUSED_PREFIX = "refused-"
REJECTION_REASONS = {
    "signature": "no secret verified the signature",
    "timestamp": "signed time outside the tolerance",
    "unreadable": "refused before its signature could be checked",
    "refused-dedup-key-missing": "signed, but no dedup key could be found in it",
    "refused-payload-invalid": "signed, but its body or a value in it cannot be read or stored",
    "refused-unsupported-media-type": "signed, but its Content-Type is missing or cannot be stored",
    "dedup-key-missing": "no dedup key: dead-lettered",
    "payload-invalid": "body or key its specs cannot read: dead-lettered",
    "message-malformed": "malformed message: dead-lettered",
    "consumer-error": "the consumer failed on it: dead-lettered",
}


def intake(source: str, brokers: Mapping[str, str], broker: object = None) -> str:
    """Name what a source's messages came through: webhook, API, RabbitMQ or NATS.

    ``brokers`` maps the configured broker sources to their provider;
    ``broker`` is what the message itself says (an event's ``meta.broker``),
    for a source no longer configured.
    """
    if source.startswith("api:"):
        return "API"
    provider = brokers.get(source) or (broker if isinstance(broker, str) else None)
    if provider:
        return BROKER_NAMES.get(provider, provider)
    return "webhook"


def rejection_intake(source: str, reason: str, brokers: Mapping[str, str]) -> str:
    """Name the intake of a refused delivery or dead-lettered broker message."""
    # A broker source since removed from the config is known by its reason.
    webhook = reason in WEBHOOK_REFUSALS or reason.startswith(REFUSED_PREFIX)
    return intake(source, brokers, None if webhook else "broker")


def idempotency_key(source: str, meta: object) -> str | None:
    """The Idempotency-Key an API client sent with its event, or None for a webhook event."""
    if not source.startswith("api:") or not isinstance(meta, dict):
        return None
    key = meta.get("idempotency_key")
    return key if isinstance(key, str) else None


def delivery_summary(states: dict[str, int]) -> list[tuple[str, int]]:
    """An event's delivery states, the ones needing attention first."""
    order = ["dead", "in_progress", "pending", "delivered", "skipped", "discarded"]
    known = [(s, states[s]) for s in order if s in states]
    return known + sorted((s, n) for s, n in states.items() if s not in order)
