"""The docs name what is there: every module, class, function, method and attribute
docs/architecture.md names in backquotes exists in the tree (or in the library it names), and
every file it names exists."""

from __future__ import annotations

import ast
import importlib
import re
from functools import cache

import pytest

from relay.environment import declared
from tests.support.processes import ROOT

pytestmark = pytest.mark.defaults

PACKAGES = ("relay", "xmppgateway", "pushsite", "analytics")
# What the page quotes that is not a name in code: HTTP header fields.
NOT_CODE = {"TTL", "Topic", "Urgency", "Location"}
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_FILE = re.compile(r"[\w./-]+\.(?:py|conf|md|yaml|toml)")


def _names_in(tree: ast.Module, module: str) -> set[str]:
    """The qualified names a module defines: its functions and classes (nested too), their
    methods, the names its statements assign (module, class and `self.` attributes), the
    parameters of its functions, the keywords of its calls, and the strings that are names (a
    task's name, its options, a provider's error codes)."""
    found: set[str] = set()

    def visit(node: ast.AST, prefix: str, owner: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}.{child.name}"
                found.add(name)
                if not isinstance(child, ast.ClassDef):
                    arguments = child.args
                    for argument in (*arguments.posonlyargs, *arguments.args,
                                     *arguments.kwonlyargs):  # fmt: skip
                        found.add(f"{name}.{argument.arg}")
                visit(child, name, name if isinstance(child, ast.ClassDef) else owner)
                continue
            if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                found.add(f"{prefix}.{child.id}")
            elif (
                isinstance(child, ast.Attribute)
                and isinstance(child.ctx, ast.Store)
                and isinstance(child.value, ast.Name)
                and child.value.id == "self"
            ):
                found.add(f"{owner}.{child.attr}")
            elif isinstance(child, ast.keyword) and child.arg:
                found.add(f"{prefix}.{child.arg}")
            elif (
                isinstance(child, ast.Constant)
                and isinstance(child.value, str)
                and _DOTTED.fullmatch(child.value)
            ):  # a name the code spells as a string: a task's, an option's, an error code
                found.add(child.value)
            elif isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name):
                found.add(f"{prefix}.{child.target.id}")
            visit(child, prefix, owner)

    visit(tree, module, module)
    return found


@cache
def defined() -> frozenset[str]:
    """Every dotted tail of every qualified name in the product packages: `messages.prepare`
    and `prepare` for relay.unifiedpush.services.messages.prepare."""
    tails: set[str] = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            module = module.removesuffix(".__init__")
            for name in {module} | _names_in(ast.parse(path.read_text()), module):
                parts = name.split(".")
                tails.update(".".join(parts[i:]) for i in range(len(parts)))
    return frozenset(tails)


def _in_a_library(name: str) -> bool:
    """`name` is importable as a module and attributes of it (`aiohttp.web.Server`)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def missing_names(text: str) -> list[str]:
    settings = {env for _, env, _ in declared()}
    files = {path.name for package in PACKAGES for path in (ROOT / package).rglob("*")}
    missing = []
    for quoted in re.findall(r"`([^`\n]+)`", text):
        name = quoted.removesuffix("()")
        if _FILE.fullmatch(name):
            if not ((ROOT / name).exists() if "/" in name else name in files):
                missing.append(quoted)
        elif (
            _DOTTED.fullmatch(name)
            and name not in NOT_CODE | settings
            and name not in defined()
            and not ("." in name and _in_a_library(name))
        ):
            missing.append(quoted)
    return missing


def test_the_checker_finds_a_name_that_is_not_there():
    assert missing_names("`Site.send` `_Answer.send` `relay/nowhere.py` `Site.nowhere`") == [
        "_Answer.send",
        "relay/nowhere.py",
        "Site.nowhere",
    ]
    assert missing_names("`aiohttp.web.Server` `aiohttp.web.Nowhere` `WEB_BIND`") == [
        "aiohttp.web.Nowhere"
    ]


def test_every_name_in_the_architecture_page_exists():
    assert missing_names((ROOT / "docs" / "architecture.md").read_text()) == []
