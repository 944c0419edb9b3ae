"""A handler module that cannot work stops the app, the worker and the consumers at start."""

from __future__ import annotations

import pytest

from webhook_receiver.config import ConfigError

from .conftest import FAST, config_with


def _app(make_app, module):
    config = config_with()
    config["handlers"] = [module]
    return make_app(config, **FAST)


def _one_line(exc: pytest.ExceptionInfo[ConfigError]) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_a_handler_module_that_fails_to_import_stops_the_start(make_app):
    with pytest.raises(ConfigError) as exc:
        _app(make_app, "tests.processing.broken_handlers")
    assert _one_line(exc) == (
        "handlers: cannot import 'tests.processing.broken_handlers': "
        "No module named 'no_such_package_for_handlers'"
    )


def test_two_handlers_of_one_name_stop_the_start(make_app):
    with pytest.raises(ConfigError) as exc:
        _app(make_app, "tests.processing.twin_handlers")
    assert "source 'shop' has two consumers named 'twin'" in _one_line(exc)


def test_a_handler_of_a_source_that_does_not_exist_stops_the_start(make_app):
    # It was registered and never called: no event of 'shopp' ever comes.
    with pytest.raises(ConfigError) as exc:
        _app(make_app, "tests.processing.stray_handlers")
    message = _one_line(exc)
    assert "handler 'typo' of tests.processing.stray_handlers" in message
    assert "no source 'shopp'" in message


def test_a_handler_of_an_api_client_s_events_is_accepted(make_app):
    # misuse_handlers holds one for api:acme, a configured client's events.
    assert _app(make_app, "tests.processing.misuse_handlers") is not None
