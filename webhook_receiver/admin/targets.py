"""Admin: each consumer's target, with its circuit breaker, rate limit, concurrency and filter."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from flask import render_template

from ..models import utcnow
from ..outbox import circuits
from ..processing import registry
from .blueprint import bp
from .presenters import utc


@dataclass(frozen=True)
class TargetRow:
    """One consumer of one source, as the Targets page shows it."""

    source: str
    consumer: str
    kind: str
    circuit: circuits.Circuit | None  # None: no circuit breaker (a handler, or turned off)
    breaker: str
    max_per_second: float | None
    concurrency: int
    filter: str | None


def target_rows() -> list[TargetRow]:
    """Every configured consumer, forwards with their circuit as the database has it."""
    found = {(c.source, c.consumer): c for c in circuits.read_all()}
    rows = []
    for source, named in sorted(registry.get().consumers.items()):
        for name, consumer in sorted(named.items()):
            forward = consumer.forward
            breaker = forward.circuit_breaker if forward is not None else None
            rows.append(
                TargetRow(
                    source=source,
                    consumer=name,
                    kind=consumer.kind,
                    circuit=None
                    if breaker is None
                    else found.get((source, name), circuits.Circuit(source, name)),
                    breaker=""
                    if breaker is None
                    else f"{breaker.failures} failures, {breaker.cool_down_seconds:g} s",
                    max_per_second=forward.max_per_second if forward is not None else None,
                    concurrency=consumer.concurrency,
                    filter=str(consumer.filter) if consumer.filter is not None else None,
                )
            )
    return rows


def next_probe(circuit: circuits.Circuit, now: datetime) -> str:
    """When the circuit's next probe goes, as the Targets page says it.

    A cool-down that is over, or a probe whose worker died, waits for the
    target's next delivery: its time alone would read as a probe still to come.
    """
    if circuit.state == circuits.OPEN and circuit.retry_at is not None:
        due = " (due: the next delivery probes)" if circuit.retry_at <= now else ""
        return utc(circuit.retry_at) + due
    if circuit.state == circuits.HALF_OPEN and circuit.probe_expires_at is not None:
        if circuit.probe_expires_at > now:
            return f"in flight until {utc(circuit.probe_expires_at)}"
        return f"lapsed at {utc(circuit.probe_expires_at)}: the next delivery probes"
    return "—"


@bp.get("/targets")
def targets() -> str:
    """Show each consumer's circuit (closed, open, half-open), rate limit and filter."""
    return render_template(
        "admin/targets.html", rows=target_rows(), next_probe=next_probe, now=utcnow()
    )


def filtered_out(
    source: str, event_type: str | None, body: bytes, delivered: set[str]
) -> list[str]:
    """The consumers of an event that its filter kept from it (those without a delivery)."""
    dropped = registry.get().filtered_out(source, event_type, body)
    return [name for name in dropped if name not in delivered]
