"""Rejections counted per source, reason, address and minute; admin sessions kept server-side.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03

Rows written before this revision keep their exact times and a count of 1;
those that share source, reason, address and time become one row counting them.
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


# Rows that the unique constraint would refuse: before this revision each
# refusal was its own row, stamped with the time, and two processes refusing
# one sender's flood could stamp the same microsecond. The first of each
# such group takes the others' count, and they go. (Edited after release to
# add this: a database that ran this revision never runs it again.)
_SAME = (
    "r.source = rejections.source AND r.reason = rejections.reason"
    " AND r.remote_addr = rejections.remote_addr AND r.received_at = rejections.received_at"
)
MERGE_SAME_TIME = (
    f"UPDATE rejections SET seen_count = (SELECT count(*) FROM rejections AS r WHERE {_SAME})"
    f" WHERE NOT EXISTS (SELECT 1 FROM rejections AS r WHERE {_SAME} AND r.id < rejections.id)"
    f" AND EXISTS (SELECT 1 FROM rejections AS r WHERE {_SAME} AND r.id > rejections.id)"
)
DROP_MERGED = (
    f"DELETE FROM rejections"
    f" WHERE EXISTS (SELECT 1 FROM rejections AS r WHERE {_SAME} AND r.id < rejections.id)"
)


def upgrade():
    with op.batch_alter_table("rejections", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("seen_count", sa.Integer(), server_default="1", nullable=False)
        )
        batch_op.add_column(sa.Column("last_seen_at", sa.DateTime(), nullable=True))
    op.execute(MERGE_SAME_TIME)
    op.execute(DROP_MERGED)
    with op.batch_alter_table("rejections", schema=None) as batch_op:
        batch_op.create_unique_constraint(
            batch_op.f("uq_rejections_source_reason_remote_addr_received_at"),
            ["source", "reason", "remote_addr", "received_at"],
        )

    op.create_table(
        "admin_sessions",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_admin_sessions")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_admin_sessions_token_hash")),
    )
    with op.batch_alter_table("admin_sessions", schema=None) as batch_op:
        batch_op.create_index("ix_admin_sessions_expires_at", ["expires_at"], unique=False)


def downgrade():
    with op.batch_alter_table("admin_sessions", schema=None) as batch_op:
        batch_op.drop_index("ix_admin_sessions_expires_at")
    op.drop_table("admin_sessions")
    with op.batch_alter_table("rejections", schema=None) as batch_op:
        batch_op.drop_constraint(
            batch_op.f("uq_rejections_source_reason_remote_addr_received_at"), type_="unique"
        )
        batch_op.drop_column("last_seen_at")
        batch_op.drop_column("seen_count")
