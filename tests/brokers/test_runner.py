"""``flask consume``'s runner: how it runs the consumers' threads."""

from __future__ import annotations

import gc
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


def test_consumers_run_with_the_app_frozen_out_of_the_collector_and_fewer_collections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    thresholds = gc.get_threshold()
    frozen_before = gc.get_freeze_count()
    seen: list[tuple[tuple[int, ...], int]] = []

    def consuming(*_args: Any) -> None:
        seen.append((gc.get_threshold(), gc.get_freeze_count()))

    monkeypatch.setattr(runner, "_run", consuming)
    runner.run(None, [], threading.Event())  # type: ignore[arg-type]

    ((during, frozen),) = seen
    assert during == (runner.GC_FIRST_THRESHOLD, *thresholds[1:])
    assert runner.GC_FIRST_THRESHOLD > thresholds[0]
    # The objects alive at the start (this test's modules among them) are frozen.
    assert frozen > frozen_before
    assert gc.get_threshold() == thresholds
    assert gc.get_freeze_count() == frozen_before
