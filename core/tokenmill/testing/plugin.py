"""tokenmill's pytest plugin: fixtures for testing plugins, loaded in every pytest run once tokenmill is
installed (entry point ``pytest11``: ``tokenmill``).

Fixtures (docs/plugins/testing.md):

- ``tiny_model_dir``: a tiny random Llama with its own 512-token tokenizer, saved once per session;
- ``tiny_engine``: an in-process ``EngineCore`` on it; config sections from the
  ``@pytest.mark.tokenmill_engine(scheduler={"policy": ...})`` marker are merged over the tiny defaults;
- ``tokenmill_server``: a factory that starts real ``tokenmill serve`` processes (stopped at teardown);
- ``plugin_manager``: a factory for a plugin system with autoload off and your plugin objects registered.

Importing this module imports neither torch nor transformers; the fixtures do, when used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tokenmill.engine import EngineCore
    from tokenmill.plugin_manager import PluginSystem
    from tokenmill.testing.server import TokenmillServer

#: The name ``tiny_model_dir`` is served under by ``tokenmill_server``.
TINY_MODEL_NAME = "tiny"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "tokenmill_engine(**sections): config sections for the tiny_engine fixture, "
        'e.g. tokenmill_engine(attention={"backend": "eager"})',
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (2 layers, hidden 64, vocab 512, float32) with a byte-level tokenizer and a
    ChatML template, saved as a Hugging Face directory. Built once per session; needs ``transformers``."""
    from tokenmill.testing.factories import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def tiny_engine(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineCore:
    """An in-process ``EngineCore`` on ``tiny_model_dir``, on CPU, with 256 KV blocks of 4 tokens."""
    from tokenmill.testing.factories import make_engine

    marker = request.node.get_closest_marker("tokenmill_engine")
    sections: dict[str, Any] = dict(marker.kwargs) if marker is not None else {}
    return make_engine(tiny_model_dir, **sections)


@pytest.fixture
def tokenmill_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[Callable[..., TokenmillServer]]:
    """Start real ``tokenmill serve`` processes on free loopback ports; each is stopped at teardown.

    ``tokenmill_server(*args, model=None, config=None, env=None, api_key=None)``: ``args`` are more
    flags; ``model`` defaults to ``tiny_model_dir`` (served as ``"tiny"``); ``config`` is a TOML file's
    text, written and passed as ``--config``; ``env`` adds environment variables. The returned server has
    ``.url``, ``.client`` (an ``openai.OpenAI``), ``.model``, ``.log``, ``.metrics()`` and ``.stop()``.
    """
    from tokenmill.testing.server import start_server

    servers: list[TokenmillServer] = []

    def start(
        *args: str,
        model: str | Path | None = None,
        config: str | None = None,
        env: Mapping[str, str] | None = None,
        api_key: str | None = None,
    ) -> TokenmillServer:
        log_dir = tmp_path_factory.mktemp("tokenmill-server")
        flags = list(args)
        if config is not None:
            config_file = log_dir / "config.toml"
            config_file.write_text(config)
            flags += ["--config", str(config_file)]
        if model is None:
            flags = [str(tiny_model_dir), "--served-model-name", TINY_MODEL_NAME, *flags]
        else:
            flags = [str(model), *flags]
        server = start_server(log_dir, *flags, env=env, api_key=api_key)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def plugin_manager() -> Callable[..., PluginSystem]:
    """Load plugins with autoload off: ``plugin_manager(my_plugin, ("name", other))`` registers each object
    (a module or an object with ``@hookimpl`` methods) beside the built-ins and returns the ``PluginSystem``.
    Pass ``autoload=True`` to load installed entry points as well."""
    from tokenmill.plugin_manager import load_plugins

    def load(*plugins: object, autoload: bool = False, disabled: tuple[str, ...] = ()) -> PluginSystem:
        extra = [p if isinstance(p, tuple) else (getattr(p, "__name__", type(p).__name__), p) for p in plugins]
        return load_plugins(disabled=disabled, autoload=autoload, extra_plugins=extra)

    return load
