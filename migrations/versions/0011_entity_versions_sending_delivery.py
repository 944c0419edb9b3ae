"""Entity versions name the forward delivery sending one: one version of an entity in flight.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07

An ordered source's forwards checked a delivery's version before the call
and recorded it after, so two workers could send two versions of one
entity at once and the older could arrive last. ``sending_delivery_id``
names the delivery whose call is in flight; another version waits for it
(outbox/ordering.take_entity). A nullable column with no default: no
rewrite, an ACCESS EXCLUSIVE lock for a moment. The downgrade drops it.
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade():
    op.add_column(
        "entity_versions", sa.Column("sending_delivery_id", sa.BigInteger(), nullable=True)
    )


def downgrade():
    with op.batch_alter_table("entity_versions", schema=None) as batch_op:
        batch_op.drop_column("sending_delivery_id")
