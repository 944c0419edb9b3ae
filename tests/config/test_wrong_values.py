"""Wrong values in the config file, the environment and the TOML bytes: one line each."""

from __future__ import annotations

import pytest

from webhook_receiver import create_app
from webhook_receiver.config import ConfigError


def _start(raw: dict) -> None:
    create_app({"TESTING": True, "RECEIVER_CONFIG": raw})


@pytest.mark.parametrize("provider", [["kafka"], {"name": "kafka"}, 5])
def test_a_provider_that_is_no_string_is_refused_naming_the_source(provider):
    # A list or a table was looked up in the set of broker providers: a
    # TypeError (unhashable type) and a traceback instead of one line.
    with pytest.raises(ConfigError, match=r"\[sources\.orders\] provider must be one of .*kafka"):
        _start({"sources": {"orders": {"provider": provider}}})
