"""A handler module whose import fails: it needs a package that is not installed."""

from __future__ import annotations

import no_such_package_for_handlers  # noqa: F401
