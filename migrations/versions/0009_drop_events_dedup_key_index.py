"""Events lose the index on the dedup key alone: no query used it, and every new event paid for it.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-08

The admin's search by key matches the dedup key or, for an API event, the
Idempotency-Key in its meta; the second has no index, so both databases
scan for the two together, and the index on ``dedup_key`` was never read.
Every intake's lookups go by source and key, through the unique
constraint's index. Written with every event, the index cost PostgreSQL
about 1.5 µs of a batch's 14 µs a row. The downgrade builds it again.
"""

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade():
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index("ix_events_dedup_key")


def downgrade():
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.create_index("ix_events_dedup_key", ["dedup_key"], unique=False)
