"""An event's duplicate count and latest duplicate are read from its event_duplicates rows.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-04

``events.duplicate_count`` and ``events.last_duplicate_at`` were kept up to
date by an UPDATE of the event's row per redelivery; both are the
``count(*)`` and ``max(received_at)`` of the event's ``event_duplicates``
rows, which live and die with it, so they are dropped.

SQLite drops a column in place from 3.35 on. Alembic's batch mode would
copy the table instead, and dropping the old ``events`` with foreign keys
on deletes the deliveries, duplicates and conflicts that point at it
(ON DELETE CASCADE), so an older SQLite is refused with a message.
"""

import sqlite3

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

COLUMNS = ("duplicate_count", "last_duplicate_at")


def upgrade():
    if op.get_bind().dialect.name == "sqlite" and sqlite3.sqlite_version_info < (3, 35):
        raise RuntimeError(
            f"this migration drops two columns of events, which needs SQLite 3.35 or later "
            f"(this Python has {sqlite3.sqlite_version}); upgrade SQLite or run on PostgreSQL"
        )
    for column in COLUMNS:
        # Plain ALTER TABLE ... DROP COLUMN on both databases (not batch mode: see above).
        op.drop_column("events", column)


def downgrade():
    op.add_column(
        "events", sa.Column("duplicate_count", sa.Integer(), nullable=False, server_default="0")
    )
    op.add_column("events", sa.Column("last_duplicate_at", sa.DateTime(), nullable=True))
    op.execute(
        "UPDATE events SET "
        "duplicate_count = (SELECT count(*) FROM event_duplicates AS d "
        "WHERE d.event_id = events.id), "
        "last_duplicate_at = (SELECT max(d.received_at) FROM event_duplicates AS d "
        "WHERE d.event_id = events.id)"
    )
