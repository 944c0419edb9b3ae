"""Every record is one JSON line, whatever text or number it carries.

orjson writes no lone surrogate (JSON's ``\\uD800`` escape parsed from a
client's body, an exception quoting it) and no integer past 64 bits: the
formatter raised, and logging printed a multi-line "--- Logging error ---"
traceback to stderr in place of the line: the record lost, and the JSON
stream broken for whatever reads it.
"""

from __future__ import annotations

import io
import json
import logging

import pytest

from webhook_receiver.observability import logging as obs_logging


@pytest.fixture
def log(captured):
    """A logger with the handler ``configure`` installs, and no other.

    Outside the logging tree: pytest's own capture would hold the
    surrogates too, and pytest-xdist cannot send them back from a worker.
    """
    logger = logging.Logger("webhook_receiver.review")
    logger.addHandler(logging.getLogger(obs_logging.PACKAGE_LOGGER).handlers[-1])
    return logger


def _lines(buffer: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


def test_a_lone_surrogate_in_the_message_or_a_field_still_makes_one_json_line(log, captured, capfd):
    log.warning(
        "message dead-lettered: %s",
        "type \ud800",
        extra={"dedup_key": "k-\udcff", "meta": {"k\ud800": ["v\udfff", 1]}, "source": "s"},
    )
    (line,) = _lines(captured)
    assert line["message"] == "message dead-lettered: type \ufffd"
    assert line["dedup_key"] == "k-\ufffd"
    assert line["meta"] == {"k\ufffd": ["v\ufffd", 1]}
    assert line["source"] == "s" and line["level"] == "WARNING"
    assert "Logging error" not in capfd.readouterr().err


def test_an_integer_past_64_bits_is_written_as_its_digits(log, captured, capfd):
    log.info("big", extra={"event_id": 2**70, "small": 3})
    (line,) = _lines(captured)
    assert line["event_id"] == str(2**70) and line["small"] == 3
    assert "Logging error" not in capfd.readouterr().err


def test_an_exception_quoting_a_surrogate_keeps_its_line_and_traceback(log, captured, capfd):
    try:
        raise ValueError("no order \ud800")
    except ValueError:
        log.exception("a message could not be identified")
    (line,) = _lines(captured)
    assert line["message"] == "a message could not be identified"
    assert "ValueError: no order \ufffd" in line["exc_info"]
    assert "Logging error" not in capfd.readouterr().err
