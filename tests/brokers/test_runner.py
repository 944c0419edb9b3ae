"""``flask consume``'s runner: how it runs the consumers' threads."""

from __future__ import annotations

import sys
import threading
from typing import Any

import pytest

from webhook_receiver.brokers import runner


def test_consumers_run_with_the_short_switch_interval_and_the_process_gets_its_own_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = sys.getswitchinterval()
    seen: list[float] = []

    def consuming(*_args: Any) -> None:
        seen.append(sys.getswitchinterval())

    monkeypatch.setattr(runner, "_run", consuming)
    runner.run(None, [], threading.Event())  # type: ignore[arg-type]

    assert runner.SWITCH_INTERVAL_SECONDS < before
    assert seen == [runner.SWITCH_INTERVAL_SECONDS]
    assert sys.getswitchinterval() == before
