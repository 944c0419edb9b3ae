"""Every backticked name in docs/ and the README that names this project's code exists.

Three kinds of reference are checked, outside fenced code blocks:

- a path (``inbox/batch.py``, ``tests/faults/``, ``deploy/prometheus/``):
  it exists under the repository's root or under ``webhook_receiver/``; a
  bare file name (``records.py``) is some file's name. Paths under an
  ignored folder (``instance/``, made at run time) and paths that start
  with no folder of the repository or the package (``metrics/``,
  ``application/json``) are not code and are left alone;
- a dotted name whose first part is the package or one of its modules or
  folders (``inbox.receive``, ``records.save_in_transaction``,
  ``webhook_receiver.processing.worker``, ``admin/queries.list_dead``): the
  module is imported and the rest looked up on it (a call's arguments, and
  what follows them, are not). A short name may stand for any module of
  that name (``batch`` is the inbox's and the brokers'). Left alone: names
  whose first part is also another library (``stripe``, ``logging``) or a
  table of the config file (``sources.orders``), which read as those;
- a name beside a file, `` `name` in `path.py` `` or `` `path.py`'s `name` ``:
  the file defines it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from dataclasses import dataclass
from fnmatch import fnmatch
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "webhook_receiver"
PACKAGE_DIR = ROOT / PACKAGE
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]

# The config file's top-level tables (config/loader.py): `sources.orders` is a key.
CONFIG_TABLES = {"clients", "sources", "handlers"}
# Files, not modules: `webhook_receiver.sqlite3`, `config.toml`.
FILE_SUFFIX = re.compile(r"\.(py|md|toml|ya?ml|json|lock|sqlite3|pid|conf|mjs|txt|cfg|ini|html)$")
BACKTICKED = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^[\w.-]+(?:/[\w.-]+)*/?$")
DOTTED = re.compile(
    r"^(?P<module>[A-Za-z_]\w*(?:[./][A-Za-z_]\w*)*?)\.(?P<rest>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\(.*)?$"
)
NAME_IN_FILE = re.compile(r"`(?P<name>[A-Za-z_]\w*)`\s+in\s+`(?P<path>[\w./-]+\.py)`")
FILES_NAME = re.compile(r"`(?P<path>[\w./-]+\.py)`'s\s+`(?P<name>[A-Za-z_]\w*)`")
SKIPPED_DIRS = {".git", ".hypothesis", ".venv", "node_modules", "__pycache__"}


@dataclass(frozen=True)
class Broken:
    doc: Path
    line: int
    reference: str
    why: str

    def __str__(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}: `{self.reference}`: {self.why}"


def prose(text: str) -> str:
    """The text with fenced code blocks blanked, lines kept in place."""
    lines = text.split("\n")
    fenced = False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            lines[i] = ""
        elif fenced:
            lines[i] = ""
    return "\n".join(lines)


@cache
def ignored() -> tuple[str, ...]:
    """The folders .gitignore leaves out (``instance/``, ``bench/results/``)."""
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return tuple(line.strip("/") for line in lines if line.endswith("/"))


def is_ignored(path: str) -> bool:
    parts = path.strip("/").split("/")
    for pattern in ignored():
        if "/" in pattern:
            if path.strip("/") == pattern or path.startswith(pattern + "/"):
                return True
        else:
            folders = parts if path.endswith("/") else parts[:-1]
            if any(fnmatch(folder, pattern) for folder in folders):
                return True
    return False


@cache
def file_names() -> frozenset[str]:
    """The name of every file of the repository."""
    names: set[str] = set()
    stack = [ROOT]
    while stack:
        folder = stack.pop()
        for entry in folder.iterdir():
            if entry.is_dir():
                if entry.name not in SKIPPED_DIRS and not is_ignored(
                    entry.relative_to(ROOT).as_posix() + "/"
                ):
                    stack.append(entry)
            else:
                names.add(entry.name)
    return frozenset(names)


@cache
def modules() -> dict[str, list[str]]:
    """Each module or folder name of the package, with the dotted modules it may stand for."""
    found: dict[str, list[str]] = {PACKAGE: [PACKAGE]}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if len(parts) > 1:
            found.setdefault(parts[-1], []).append(".".join(parts))
    return found


def top_folders() -> set[str]:
    """The repository's own top-level folders and the package's first-level ones."""
    folders = {
        p.name
        for p in ROOT.iterdir()
        if p.is_dir() and p.name not in SKIPPED_DIRS and not is_ignored(p.name + "/")
    }
    return folders | {p.name for p in PACKAGE_DIR.iterdir() if (p / "__init__.py").exists()}


def is_path(reference: str) -> bool:
    """Whether the reference is written as a path: a folder, or a file with its suffix."""
    if not PATH.match(reference):
        return False
    last = reference.rstrip("/").rsplit("/", 1)[-1]
    if "/" not in reference:
        return reference.endswith(".py")
    return reference.endswith("/") or "." not in last or bool(FILE_SUFFIX.search(last))


def check_path(path: str) -> str | None:
    """Why the path names no file or folder here, or None if it does (or is not code)."""
    if is_ignored(path):
        return None
    if "/" not in path.rstrip("/"):
        if path.endswith(".py"):
            return None if path in file_names() else "no file of that name"
        if not path.endswith("/"):
            return None
    if (ROOT / path).exists() or (PACKAGE_DIR / path).exists():
        return None
    if path.split("/")[0] in top_folders() or path.endswith(".py"):
        return "no such file or folder"
    return None


def is_other_library(name: str) -> bool:
    """Whether ``name`` is also a top-level module outside the package (``stripe``, ``logging``)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    return spec is not None


def lookup(module: str, rest: list[str]) -> bool:
    """Whether ``module`` imports and ``rest`` names something in it (an attribute or submodule)."""
    try:
        obj: object = importlib.import_module(module)
    except ImportError:
        return False
    dotted = module
    for part in rest:
        dotted = f"{dotted}.{part}"
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif hasattr(obj, "__path__") and importlib.util.find_spec(dotted) is not None:
            obj = importlib.import_module(dotted)
        else:
            return False
    return True


def check_dotted(reference: str) -> str | None:
    """Why the dotted name names nothing of the package, or None if it does (or is not code)."""
    match = DOTTED.match(reference)
    if match is None or FILE_SUFFIX.search(reference):
        return None
    module, rest = match["module"], match["rest"].split(".")
    if "/" in module:
        folders = module.split("/")
        if folders[0] == PACKAGE:
            folders = folders[1:]
        if not (PACKAGE_DIR / folders[0] / "__init__.py").exists():
            return None
        candidates = [".".join([PACKAGE, *folders])]
    else:
        first, *more = module.split(".")
        if first not in modules():
            return None
        if first != PACKAGE and (first in CONFIG_TABLES or is_other_library(first)):
            return None
        candidates = [".".join([c, *more]) for c in modules()[first]]
    if any(lookup(c, rest) for c in candidates):
        return None
    return f"not found in {' or '.join(candidates)}"


def defines(path: Path, name: str) -> bool:
    """Whether the file defines ``name`` (a function, class or assigned name, at any depth)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name == name:
                return True
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id == name:
            return True
    return False


def check_name_in_file(path: str, name: str) -> str | None:
    """Why ``name`` is not defined in the file ``path``, or None if it is."""
    for folder in (ROOT, PACKAGE_DIR):
        if (folder / path).is_file():
            return None if defines(folder / path, name) else f"not defined in {path}"
    return None  # a missing file is reported by the path check


def broken_references(doc: Path, text: str) -> list[Broken]:
    """Every backticked reference to code in ``text`` (the doc's) that names nothing."""
    text = prose(text)
    broken = []

    def line_of(offset: int) -> int:
        return text.count("\n", 0, offset) + 1

    for match in BACKTICKED.finditer(text):
        reference = match[1].strip()
        if is_path(reference):
            why = check_path(reference)
        else:
            why = check_dotted(reference)
        if why:
            broken.append(Broken(doc, line_of(match.start()), reference, why))
    for pattern in (NAME_IN_FILE, FILES_NAME):
        for match in pattern.finditer(text):
            why = check_name_in_file(match["path"], match["name"])
            if why:
                reference = f"{match['name']}` / `{match['path']}"
                broken.append(Broken(doc, line_of(match.start()), reference, why))
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: doc.name)
def test_every_backticked_name_exists(doc: Path) -> None:
    broken = broken_references(doc, doc.read_text())
    assert not broken, "names of code that do not exist:\n" + "\n".join(map(str, broken))


def test_a_name_that_does_not_exist_is_reported() -> None:
    doc = ROOT / "docs" / "example.md"
    text = "\n".join(
        [
            "`inbox.receive` and `inbox.no_such_function`",
            "`inbox/store.py`, `webhook_receiver/processing/deliveries.py`, `store.py`",
            "`records.no_such` and `admin/queries.no_such` and `webhook_receiver.nothing`",
            "`identify.Delivery`; `no_such` in `inbox/batch.py`; `inbox/duplicates.py`'s `nope`",
            "`webhook_receiver.inbox.receive_many(messages)` `outbox/deliveries.claim_next`",
        ]
    )
    found = [(b.line, b.reference) for b in broken_references(doc, text)]
    assert found == [
        (1, "inbox.no_such_function"),
        (2, "inbox/store.py"),
        (2, "webhook_receiver/processing/deliveries.py"),
        (2, "store.py"),
        (3, "records.no_such"),
        (3, "admin/queries.no_such"),
        (3, "webhook_receiver.nothing"),
        (4, "identify.Delivery"),
        (4, "no_such` / `inbox/batch.py"),
        (4, "nope` / `inbox/duplicates.py"),
    ]


def test_what_is_not_this_packages_code_is_left_alone() -> None:
    doc = ROOT / "docs" / "example.md"
    text = "\n".join(
        [
            "`os.environ`, `pika.BasicProperties`, `sources.orders`, `stripe.Webhook`",
            "`config.toml`, `instance/config.toml`, `metrics/`, `application/json`, `/a~2`",
            "`self.stop`, `order.created`, `webhook_receiver.sqlite3`, `postgresql://…`",
            "```",
            "inbox.no_such_function `inbox.no_such_function`",
            "```",
        ]
    )
    assert broken_references(doc, text) == []
