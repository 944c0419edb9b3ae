"""``python -m bench``: run the benchmark scenarios, or ``--profile`` the API hot path."""

from __future__ import annotations

from .run import main

raise SystemExit(main())
