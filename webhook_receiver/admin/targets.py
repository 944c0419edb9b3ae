"""Admin: each consumer's target, with its circuit breaker, rate limit, concurrency and filter."""

from __future__ import annotations

from dataclasses import dataclass

from flask import render_template

from ..outbox import circuits
from ..processing import registry
from .blueprint import bp


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


@bp.get("/targets")
def targets() -> str:
    """Show each consumer's circuit (closed, open, half-open), rate limit and filter."""
    return render_template("admin/targets.html", rows=target_rows())


def filtered_out(
    source: str, event_type: str | None, body: bytes, delivered: set[str]
) -> list[str]:
    """The consumers of an event that its filter kept from it (those without a delivery)."""
    dropped = registry.get().filtered_out(source, event_type, body)
    return [name for name in dropped if name not in delivered]
