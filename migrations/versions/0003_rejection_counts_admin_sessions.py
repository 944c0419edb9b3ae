"""Rejections counted per source, reason, address and minute; admin sessions kept server-side.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03

Rows written before this revision keep their exact times and a count of 1.
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade():
    with op.batch_alter_table("rejections", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("seen_count", sa.Integer(), server_default="1", nullable=False)
        )
        batch_op.add_column(sa.Column("last_seen_at", sa.DateTime(), nullable=True))
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
