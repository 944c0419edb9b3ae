"""Indexes for the admin: deliveries by state and completion, events by dedup key.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade():
    with op.batch_alter_table("deliveries", schema=None) as batch_op:
        batch_op.create_index(
            "ix_deliveries_state_completed_at", ["state", "completed_at"], unique=False
        )
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.create_index("ix_events_dedup_key", ["dedup_key"], unique=False)


def downgrade():
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index("ix_events_dedup_key")
    with op.batch_alter_table("deliveries", schema=None) as batch_op:
        batch_op.drop_index("ix_deliveries_state_completed_at")
