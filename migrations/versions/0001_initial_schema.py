"""Initial schema: events, their duplicates and conflicts, idempotency records, deliveries.

Revision ID: 0001
Revises:
Create Date: 2026-12-02

Timestamps are naive UTC (the models wrap them as aware UTC).
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

# revision identifiers, used by Alembic.
revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade():
    op.create_table(
        "admin_login_failures",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("remote_addr", sa.String(length=100), nullable=False),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_admin_login_failures")),
    )
    with op.batch_alter_table("admin_login_failures", schema=None) as batch_op:
        batch_op.create_index(
            "ix_admin_login_failures_remote_addr_at", ["remote_addr", "at"], unique=False
        )

    op.create_table(
        "events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("source", sa.String(length=200), nullable=False),
        sa.Column("dedup_key", sa.String(length=512), nullable=False),
        sa.Column("event_type", sa.String(length=255), nullable=True),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("content_type", sa.String(length=255), nullable=True),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column(
            "headers",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column(
            "meta",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column("client", sa.String(length=200), nullable=True),
        sa.Column("correlation_id", sa.String(length=200), nullable=True),
        sa.Column("received_at", sa.DateTime(), nullable=False),
        sa.Column("duplicate_count", sa.Integer(), nullable=False),
        sa.Column("last_duplicate_at", sa.DateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
        sa.UniqueConstraint("source", "dedup_key", name=op.f("uq_events_source_dedup_key")),
    )
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.create_index("ix_events_received_at_id", ["received_at", "id"], unique=False)
        batch_op.create_index(
            "ix_events_source_received_at", ["source", "received_at"], unique=False
        )

    op.create_table(
        "idempotency_records",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("client", sa.String(length=200), nullable=False),
        sa.Column("key", sa.String(length=255), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("method", sa.String(length=10), nullable=False),
        sa.Column("path", sa.String(length=2000), nullable=False),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.Column("lease_token", sa.String(length=64), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
        sa.Column("completed_at", sa.DateTime(), nullable=True),
        sa.Column("response_status", sa.Integer(), nullable=True),
        sa.Column(
            "response_headers",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column("response_body", sa.LargeBinary(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_idempotency_records")),
        sa.UniqueConstraint("client", "key", name=op.f("uq_idempotency_records_client_key")),
    )
    with op.batch_alter_table("idempotency_records", schema=None) as batch_op:
        batch_op.create_index("ix_idempotency_records_expires_at", ["expires_at"], unique=False)

    op.create_table(
        "rejections",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("source", sa.String(length=200), nullable=False),
        sa.Column("reason", sa.String(length=50), nullable=False),
        sa.Column("detail", sa.String(length=500), nullable=True),
        sa.Column("remote_addr", sa.String(length=100), nullable=True),
        sa.Column("received_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rejections")),
    )
    with op.batch_alter_table("rejections", schema=None) as batch_op:
        batch_op.create_index("ix_rejections_received_at", ["received_at"], unique=False)

    op.create_table(
        "deliveries",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("event_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("consumer", sa.String(length=200), nullable=False),
        sa.Column("kind", sa.String(length=20), nullable=False),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(), nullable=False),
        sa.Column("lease_token", sa.String(length=64), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("response_status", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.Column("completed_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(
            ["event_id"],
            ["events.id"],
            name=op.f("fk_deliveries_event_id_events"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_deliveries")),
        sa.UniqueConstraint("event_id", "consumer", name=op.f("uq_deliveries_event_id_consumer")),
    )
    with op.batch_alter_table("deliveries", schema=None) as batch_op:
        batch_op.create_index(
            "ix_deliveries_state_next_attempt_at", ["state", "next_attempt_at"], unique=False
        )

    op.create_table(
        "entity_versions",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("source", sa.String(length=200), nullable=False),
        sa.Column("entity", sa.String(length=512), nullable=False),
        sa.Column("version", sa.String(length=100), nullable=False),
        sa.Column("event_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["event_id"],
            ["events.id"],
            name=op.f("fk_entity_versions_event_id_events"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_entity_versions")),
        sa.UniqueConstraint("source", "entity", name=op.f("uq_entity_versions_source_entity")),
    )
    op.create_table(
        "event_conflicts",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("event_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("source", sa.String(length=200), nullable=False),
        sa.Column("dedup_key", sa.String(length=512), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("content_type", sa.String(length=255), nullable=True),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column(
            "headers",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column("received_at", sa.DateTime(), nullable=False),
        sa.Column("seen_count", sa.Integer(), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(), nullable=False),
        sa.Column("reviewed_at", sa.DateTime(), nullable=True),
        sa.Column("review_note", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["event_id"],
            ["events.id"],
            name=op.f("fk_event_conflicts_event_id_events"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_event_conflicts")),
        sa.UniqueConstraint(
            "event_id", "fingerprint", name=op.f("uq_event_conflicts_event_id_fingerprint")
        ),
    )
    with op.batch_alter_table("event_conflicts", schema=None) as batch_op:
        batch_op.create_index("ix_event_conflicts_received_at", ["received_at"], unique=False)

    op.create_table(
        "event_duplicates",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("event_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("received_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["event_id"],
            ["events.id"],
            name=op.f("fk_event_duplicates_event_id_events"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_event_duplicates")),
    )
    with op.batch_alter_table("event_duplicates", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_event_duplicates_event_id"), ["event_id"], unique=False
        )
        batch_op.create_index("ix_event_duplicates_received_at", ["received_at"], unique=False)


def downgrade():
    with op.batch_alter_table("event_duplicates", schema=None) as batch_op:
        batch_op.drop_index("ix_event_duplicates_received_at")
        batch_op.drop_index(batch_op.f("ix_event_duplicates_event_id"))

    op.drop_table("event_duplicates")
    with op.batch_alter_table("event_conflicts", schema=None) as batch_op:
        batch_op.drop_index("ix_event_conflicts_received_at")

    op.drop_table("event_conflicts")
    op.drop_table("entity_versions")
    with op.batch_alter_table("deliveries", schema=None) as batch_op:
        batch_op.drop_index("ix_deliveries_state_next_attempt_at")

    op.drop_table("deliveries")
    with op.batch_alter_table("rejections", schema=None) as batch_op:
        batch_op.drop_index("ix_rejections_received_at")

    op.drop_table("rejections")
    with op.batch_alter_table("idempotency_records", schema=None) as batch_op:
        batch_op.drop_index("ix_idempotency_records_expires_at")

    op.drop_table("idempotency_records")
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index("ix_events_source_received_at")
        batch_op.drop_index("ix_events_received_at_id")

    op.drop_table("events")
    with op.batch_alter_table("admin_login_failures", schema=None) as batch_op:
        batch_op.drop_index("ix_admin_login_failures_remote_addr_at")

    op.drop_table("admin_login_failures")
