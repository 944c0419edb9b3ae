import logging
from logging.config import fileConfig

from alembic import context
from flask import current_app
from sqlalchemy.exc import OperationalError

from webhook_receiver.database import autocommit_connection

# this is the Alembic Config object, which provides
# access to the values within the .ini file in use.
config = context.config

# Interpret the config file for Python logging.
# This line sets up loggers basically.
fileConfig(config.config_file_name, disable_existing_loggers=False)
logger = logging.getLogger("alembic.env")


def get_engine():
    return current_app.extensions["migrate"].db.engine


def get_engine_url():
    try:
        return get_engine().url.render_as_string(hide_password=False).replace("%", "%%")
    except AttributeError:
        return str(get_engine().url).replace("%", "%%")


# add your model's MetaData object here
# for 'autogenerate' support
# from myapp import mymodel
# target_metadata = mymodel.Base.metadata
config.set_main_option("sqlalchemy.url", get_engine_url())
target_db = current_app.extensions["migrate"].db

# other values from the config, defined by the needs of env.py,
# can be acquired:
# my_important_option = config.get_main_option("my_important_option")
# ... etc.


def get_metadata():
    if hasattr(target_db, "metadatas"):
        return target_db.metadatas[None]
    return target_db.metadata


def run_migrations_offline():
    """Run migrations in 'offline' mode.

    This configures the context with just a URL
    and not an Engine, though an Engine is acceptable
    here as well.  By skipping the Engine creation
    we don't even need a DBAPI to be available.

    Calls to context.execute() here emit the given string to the
    script output.

    """
    url = config.get_main_option("sqlalchemy.url")
    context.configure(url=url, target_metadata=get_metadata(), literal_binds=True)

    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online():
    """Run migrations in 'online' mode.

    In this scenario we need to create an Engine
    and associate a connection with the context.

    """

    # this callback is used to prevent an auto-migration from being generated
    # when there are no changes to the schema
    # reference: http://alembic.zzzcomputing.com/en/latest/cookbook.html
    def process_revision_directives(context, revision, directives):
        if getattr(config.cmd_opts, "autogenerate", False):
            script = directives[0]
            if script.upgrade_ops.is_empty():
                directives[:] = []
                logger.info("No changes in schema detected.")

    conf_args = current_app.extensions["migrate"].configure_args
    if conf_args.get("process_revision_directives") is None:
        conf_args["process_revision_directives"] = process_revision_directives

    connectable = get_engine()
    sqlite = connectable.dialect.name == "sqlite"

    # SQLite: the app's connections open a deferred BEGIN; the upgrade opens
    # its own, BEGIN IMMEDIATE (_take_migration_lock), and all of it is one
    # transaction, as on PostgreSQL (SQLite's DDL is transactional too).
    with autocommit_connection() if sqlite else connectable.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=get_metadata(),
            **({"transactional_ddl": True} if sqlite else {}),
            **conf_args,
        )

        with context.begin_transaction():
            _take_migration_lock(connection)
            context.run_migrations()


# Any fixed 64-bit number: the key of the upgrade's advisory lock on PostgreSQL.
MIGRATION_LOCK_KEY = 0x7765_6268_6F6F_6B00  # "webhook\0"


def _take_migration_lock(connection):
    """Wait until no other upgrade (or downgrade) runs on this database, then hold it off.

    Two release steps at once (two deploys, or a release run on every dyno)
    would otherwise both read the same revision and apply it twice: the
    second fails half-way with "already exists". Taken before Alembic reads
    the revision, and held until this upgrade commits, so the second reads
    what the first wrote and has nothing left to do.
    """
    if connection.dialect.name == "postgresql":
        # The app's statement timeout (DATABASE_STATEMENT_TIMEOUT_SECONDS, 30 s)
        # is for requests: an index built on a big table, or this wait behind
        # another upgrade, outlasts it, and the upgrade would be cancelled.
        connection.exec_driver_sql("SET LOCAL statement_timeout = 0")
        connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY})")
        return
    # SQLite: the database's write lock, for the whole upgrade. A writer
    # holds it for a moment at a time; another upgrade for as long as it runs.
    while True:
        try:
            connection.exec_driver_sql("BEGIN IMMEDIATE")
            return
        except OperationalError as exc:
            if "locked" not in str(exc.orig):
                raise
            logger.info("Waiting for the database's write lock (another upgrade runs).")


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
