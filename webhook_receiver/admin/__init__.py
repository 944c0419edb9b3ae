"""The admin: operators browse events, duplicates, conflicts and dead letters, and act on them.

Off (every URL a 404) unless ``ADMIN_PASSWORD`` is set.
"""

from __future__ import annotations

from . import deliveries, targets, views
from .blueprint import bp

__all__ = ["bp", "deliveries", "targets", "views"]
