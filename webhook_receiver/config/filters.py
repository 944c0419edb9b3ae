"""Consumer filters: a JMESPath expression over an event's JSON body, compiled once.

A forward's ``filter = "..."`` (or a handler's ``filter=``) is compiled
when the config is loaded, and its function names and argument counts are
checked then too, so a bad expression is a one-line error at start rather
than a failure per event. The inbox evaluates it when it stores a new
event: the event gets the consumer's delivery only when the result is true
in JMESPath's sense (false, null, an empty string, list or object are
false; every number, 0 included, is true). A body that is not JSON, or an
expression that fails on this body (a function given the wrong type),
passes no filter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import jmespath
import orjson
from jmespath import functions as jmespath_functions

from ..fingerprint import JSONError, loads
from .settings import ConfigError

log = logging.getLogger(__name__)

# A body that is not JSON: no filter passes it.
NOT_JSON: Any = object()


@dataclass(frozen=True)
class Filter:
    """A compiled JMESPath expression; ``text`` is what the config said."""

    text: str
    expression: Any = field(compare=False, repr=False)

    def passes(self, document: Any) -> bool:
        """Tell whether ``document`` (see :func:`document`) is delivered through this filter."""
        if document is NOT_JSON:
            return False
        try:
            return truthy(self.expression.search(document))
        except jmespath.exceptions.JMESPathError as exc:
            log.debug("filter %r failed on an event: %s", self.text, exc)
            return False

    def __str__(self) -> str:
        return self.text


def truthy(value: Any) -> bool:
    """JMESPath's truth: false, null and empty strings, lists and objects are false."""
    if value is None or value is False:
        return False
    if isinstance(value, str | list | dict):
        return bool(value)
    return True


def document(body: bytes) -> Any:
    """The JSON value of an event's body, or ``NOT_JSON``."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        pass
    # orjson refuses an escaped lone surrogate, which the intakes store as
    # sent: such a body is JSON all the same (read here the slower way).
    if b"\\u" not in body:
        return NOT_JSON
    try:
        return loads(body, lone_surrogates=True)
    except JSONError:
        return NOT_JSON


def parse_filter(value: Any, where: str) -> Filter:
    """Compile a ``filter`` setting; a ConfigError of one line if it is no valid expression."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where} filter must be a JMESPath expression (a non-empty string)")
    try:
        expression = jmespath.compile(value)
    except jmespath.exceptions.LexerError as exc:
        raise ConfigError(
            f"{where} filter {value!r}: {exc.message} at character {exc.lexer_position}"
        ) from exc
    except jmespath.exceptions.ParseError as exc:
        near = f" near {exc.token_value!r}" if exc.token_value is not None else ""
        reason = "incomplete expression" if exc.token_value is None else exc.msg
        raise ConfigError(
            f"{where} filter {value!r}: {reason} at character {exc.lex_position}{near}"
        ) from exc
    problem = _function_problem(expression.parsed)
    if problem:
        raise ConfigError(f"{where} filter {value!r}: {problem}")
    return Filter(value, expression)


def _function_problem(node: dict[str, Any]) -> str | None:
    """An unknown function, or one given the wrong number of arguments, in a parsed expression."""
    if node.get("type") == "function_expression":
        name = node["value"]
        found = jmespath_functions.Functions.FUNCTION_TABLE.get(name)
        if found is None:
            return f"unknown function {name}()"
        signature = found["signature"]
        given = len(node["children"])
        variadic = bool(signature) and signature[-1].get("variadic", False)
        if given < len(signature) if variadic else given != len(signature):
            wanted = f"at least {len(signature)}" if variadic else str(len(signature))
            return f"{name}() takes {wanted} argument(s), not {given}"
    for child in node.get("children", ()):
        if isinstance(child, dict):
            problem = _function_problem(child)
            if problem:
                return problem
    return None
