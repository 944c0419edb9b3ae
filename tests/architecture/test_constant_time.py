"""Secrets and digests are compared in constant time, everywhere in the package (read by ast)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SECRETISH = re.compile(r"digest|signature|secret|token|hmac|password|passwd", re.IGNORECASE)

AUTHENTICATING = ("webhooks/providers/", "admin/auth.py", "api/auth.py", "observability/metrics.py")
PACKAGE = Path(__file__).resolve().parents[2] / "webhook_receiver"


def _is_literal(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Name | ast.Attribute):  # a CONSTANT or module.CONSTANT
        return (node.id if isinstance(node, ast.Name) else node.attr).isupper()
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return all(_is_literal(e) for e in node.elts)
    # Lengths, types and the sets of names compared at import are not secrets.
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("len", "type", "set", "frozenset")
    )


def _is_sql(node: ast.expr) -> bool:
    # ``table.c.lease_token == token`` and ``Model.token_hash == digest`` build
    # SQL: the database looks the value up (by index), nothing is timed here.
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        if node.value.id[:1].isupper() and not node.value.id.isupper():
            return True
    return any(isinstance(sub, ast.Attribute) and sub.attr == "c" for sub in ast.walk(node))


def _names(node: ast.expr) -> list[str]:
    return [
        sub.id if isinstance(sub, ast.Name) else sub.attr
        for sub in ast.walk(node)
        if isinstance(sub, ast.Name | ast.Attribute)
    ]


def non_constant_time_comparisons() -> list[str]:
    """Each ==, !=, in or not in that may compare a secret or a digest, as path:line: code."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        strict = relative.startswith(AUTHENTICATING)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            for op, a, b in zip(node.ops, operands, operands[1:], strict=False):
                if not isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn):
                    continue
                if any(_is_literal(x) or _is_sql(x) for x in (a, b)):
                    continue
                if strict or any(SECRETISH.search(n) for n in _names(a) + _names(b)):
                    found.append(f"{relative}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_secrets_and_digests_are_compared_in_constant_time() -> None:
    # hmac.compare_digest (or a provider's any_match / same_token) only: an
    # early-exit == tells an attacker, byte by byte, how much of a guess is right.
    assert non_constant_time_comparisons() == []
