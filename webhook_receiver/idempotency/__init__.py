"""The Idempotency-Key engine: claim a key, run the view once, replay the response.

``@idempotent`` (decorator.py, the HTTP surface) keeps its records
through a persistence layer (the persistence/ folder, data access: the
record's state machine in records.py, its SQL in statements.py) and knows
nothing of tables, sessions or what the view writes.
"""

from __future__ import annotations

from .decorator import Refused, idempotent
from .persistence import Persistence, RunAgain

__all__ = ["Persistence", "Refused", "RunAgain", "idempotent"]
