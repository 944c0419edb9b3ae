"""Delivery targets: each forward target's circuit breaker and rate limit, shared by all workers.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-07

One row per (source, consumer) that has failed or sent under a rate limit:
the circuit's state, its consecutive failures, the cool-down's end and the
half-open probe's holder, and the rate limit's next send time (seconds since
the epoch). A new table, nothing to carry over (no row is a closed
circuit); the downgrade drops it, which closes every circuit.
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade():
    op.create_table(
        "delivery_targets",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("source", sa.String(length=200), nullable=False),
        sa.Column("consumer", sa.String(length=200), nullable=False),
        sa.Column("circuit", sa.String(length=20), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("opened_at", sa.DateTime(), nullable=True),
        sa.Column("retry_at", sa.DateTime(), nullable=True),
        sa.Column("probe_token", sa.String(length=64), nullable=True),
        sa.Column("probe_expires_at", sa.DateTime(), nullable=True),
        sa.Column("next_send_at", sa.Double(), nullable=True),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_delivery_targets")),
        sa.UniqueConstraint("source", "consumer", name=op.f("uq_delivery_targets_source_consumer")),
    )


def downgrade():
    op.drop_table("delivery_targets")
