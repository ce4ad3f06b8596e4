"""Every name the docs mention exists: ``tokenmill.*`` objects, hook names, slots and config settings."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from scripts.docgen import hookspec_versions
from tokenmill import hookspecs
from tokenmill.plugin_manager import Slot

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", *REPO.glob("docs/**/*.md"), *REPO.glob("contrib/*/README.md")])
_DOTTED = re.compile(r"`(tokenmill(?:_plugins|_kernels)?(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
_HOOK = re.compile(r"\b(tokenmill_(?:register|add|plugin)_[a-z_]+)\b")


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[split:]:
            target = getattr(target, attribute)
        return target
    raise ModuleNotFoundError(dotted)


def _missing(text: str) -> list[str]:
    missing = []
    for dotted in sorted(set(_DOTTED.findall(text))):
        try:
            _resolve(dotted)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{dotted} ({type(exc).__name__}: {exc})")
    hooks = {name for name in vars(hookspecs) if name.startswith("tokenmill_")}
    missing += [f"hook {name}" for name in sorted(set(_HOOK.findall(text)) - hooks)]
    return missing


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_tokenmill_name_in_the_docs_exists(page: Path) -> None:
    missing = _missing(page.read_text())
    assert not missing, f"{page.relative_to(REPO)} names what does not exist: {missing}"


def test_the_check_catches_a_name_that_does_not_exist() -> None:
    text = "Implement `tokenmill.RoutingPolicy` with `tokenmill_register_routing_policies`; see `tokenmill.Router`."
    missing = _missing(text)
    assert [m.split(" (")[0] for m in missing] == [
        "tokenmill.RoutingPolicy",
        "hook tokenmill_register_routing_policies",
    ]


def test_every_slot_has_a_hook_and_every_hook_a_version() -> None:
    versions = hookspec_versions()  # raises for a hook without "Since: X. Stability: Y."
    assert all(slot.hook_name in versions for slot in Slot)
    assert set(versions) == {slot.hook_name for slot in Slot} | {
        "tokenmill_add_hookspecs",
        "tokenmill_plugin_options",
        "tokenmill_register_commands",
    }
