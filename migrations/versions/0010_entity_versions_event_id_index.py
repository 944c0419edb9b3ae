"""Entity versions are indexed by their event: the purge no longer scans them once per event.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06

``entity_versions.event_id`` refers to ``events`` with ON DELETE SET NULL,
and had no index: each event ``flask purge`` deleted made both databases
scan the whole table for versions naming it. A batch of 1,000 events
beside 300,000 entity versions took 17 s on PostgreSQL, its locks held
throughout (SQLite's write lock, the intake waiting); with the index,
0.05 s. The downgrade drops it.
"""

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade():
    with op.batch_alter_table("entity_versions", schema=None) as batch_op:
        batch_op.create_index("ix_entity_versions_event_id", ["event_id"], unique=False)


def downgrade():
    with op.batch_alter_table("entity_versions", schema=None) as batch_op:
        batch_op.drop_index("ix_entity_versions_event_id")
