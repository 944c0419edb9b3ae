"""A replay's progress and lease: a worker runs the admin's bulk replays in the background.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07

``replays`` gains where the replay stops (``up_to``, ``max_count``), how
far it got (``after_id``, ``walked``), how long it rests after each batch
(``rest``), and the lease of the process running it (``lease_token``,
``lease_expires_at``), so that a replay whose process died is resumed
where it stopped. Replays recorded before were run to their end at once:
they are finished, and keep the defaults. The downgrade drops the columns
(SQLite 3.35 drops a column in place).
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade():
    op.add_column("replays", sa.Column("up_to", sa.BigInteger(), nullable=True))
    op.add_column("replays", sa.Column("max_count", sa.Integer(), nullable=True))
    op.add_column(
        "replays", sa.Column("after_id", sa.BigInteger(), nullable=False, server_default="0")
    )
    op.add_column("replays", sa.Column("walked", sa.Integer(), nullable=False, server_default="0"))
    op.add_column("replays", sa.Column("rest", sa.Float(), nullable=False, server_default="0"))
    op.add_column("replays", sa.Column("lease_token", sa.String(length=64), nullable=True))
    op.add_column("replays", sa.Column("lease_expires_at", sa.DateTime(), nullable=True))


def downgrade():
    for column in (
        "lease_expires_at",
        "lease_token",
        "rest",
        "walked",
        "after_id",
        "max_count",
        "up_to",
    ):
        op.drop_column("replays", column)
