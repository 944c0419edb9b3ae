"""The attempt log and replays: one row per delivery attempt, one per operator's replay.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-07

``delivery_attempts`` keeps every attempt of every delivery (deleted with
its delivery, so with its event); ``replays`` records each replay (who,
when, the filter, the counts). Two columns on ``deliveries`` say which
replay last queued it again and which replay's key it sends (0: the
original). Nothing to carry over: earlier attempts were never recorded.
The downgrade drops the tables and columns (SQLite 3.35 drops a column in
place).
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade():
    op.add_column("deliveries", sa.Column("replay_id", sa.BigInteger(), nullable=True))
    op.add_column(
        "deliveries", sa.Column("key_replay", sa.Integer(), nullable=False, server_default="0")
    )
    op.create_table(
        "delivery_attempts",
        sa.Column("id", _ID, nullable=False),
        sa.Column("delivery_id", _ID, nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("ended_at", sa.DateTime(), nullable=False),
        sa.Column("outcome", sa.String(length=20), nullable=False),
        sa.Column("latency_ms", sa.Float(), nullable=False),
        sa.Column("status", sa.Integer(), nullable=True),
        sa.Column("confirmation", sa.String(length=500), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("response_body", sa.Text(), nullable=True),
        sa.Column("replay_id", sa.BigInteger(), nullable=True),
        sa.Column("worker", sa.String(length=200), nullable=True),
        sa.ForeignKeyConstraint(
            ["delivery_id"],
            ["deliveries.id"],
            name=op.f("fk_delivery_attempts_delivery_id_deliveries"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_delivery_attempts")),
    )
    op.create_index(
        "ix_delivery_attempts_delivery_id_id", "delivery_attempts", ["delivery_id", "id"]
    )
    op.create_table(
        "replays",
        sa.Column("id", _ID, nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("via", sa.String(length=20), nullable=False),
        sa.Column("filters", _JSON, nullable=False),
        sa.Column("new_key", sa.Boolean(), nullable=False),
        sa.Column("matched", sa.Integer(), nullable=False),
        sa.Column("replayed", sa.Integer(), nullable=False, server_default="0"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_replays")),
    )
    op.create_index("ix_replays_created_at_id", "replays", ["created_at", "id"])


def downgrade():
    op.drop_index("ix_replays_created_at_id", table_name="replays")
    op.drop_table("replays")
    op.drop_index("ix_delivery_attempts_delivery_id_id", table_name="delivery_attempts")
    op.drop_table("delivery_attempts")
    op.drop_column("deliveries", "key_replay")
    op.drop_column("deliveries", "replay_id")
