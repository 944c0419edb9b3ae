"""Broker positions: where a partitioned log's consumer reads next, per source, topic, partition.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05

Written by the inbox in the transaction of the batch it follows. A new
table, nothing to carry over; the downgrade drops it (a consumer then
starts from its broker's own committed offsets, or its reset policy).
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade():
    op.create_table(
        "broker_positions",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("source", sa.String(length=200), nullable=False),
        sa.Column("topic", sa.String(length=255), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("next_offset", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_broker_positions")),
        sa.UniqueConstraint(
            "source", "topic", "partition", name=op.f("uq_broker_positions_source_topic_partition")
        ),
    )


def downgrade():
    op.drop_table("broker_positions")
