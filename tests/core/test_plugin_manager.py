"""Plugin discovery, registration, selection by config, and failure reporting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.factories import save_hf_model
from tokenmill import hookimpl
from tokenmill.config import load_config
from tokenmill.model_loader import load_model
from tokenmill.model_runner import ModelRunner, SequenceChunk
from tokenmill.plugin_manager import ESSENTIAL_PLUGINS, PluginError, Slot, load_plugins

REPO = Path(__file__).resolve().parents[2]
CONTRIB_PLUGIN = REPO / "contrib" / "tokenmill-eager-attention"


@pytest.fixture(scope="module")
def installed_contrib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The contrib plugin installed (as a user would, with pip) into a private folder."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(CONTRIB_PLUGIN),
        ],
        check=True,
    )
    return target


@pytest.fixture
def contrib_on_path(installed_contrib: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(installed_contrib))
    return installed_contrib


def _write_broken_plugin(site: Path) -> None:
    """A distribution whose entry point module fails to import."""
    dist_info = site / "broken_plugin-0.3.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.3\n")
    (dist_info / "entry_points.txt").write_text("[tokenmill]\nbroken = broken_plugin_module\n")
    (site / "broken_plugin_module.py").write_text("import not_a_real_dependency_of_anything\n")


def test_builtins_register_through_the_same_hooks() -> None:
    system = load_plugins(autoload=False)
    registry = system.registry
    assert registry.names(Slot.ATTENTION_BACKEND) == ["torch"]
    assert registry.names(Slot.WEIGHT_FORMAT) == ["gguf", "safetensors"]
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= set(
        registry.names(Slot.ARCHITECTURE)
    )
    builtin = {info.name: info for info in system.infos}
    assert builtin["tokenmill.attention.plugin"].provides == {"attention_backend": ["torch"]}
    assert builtin["tokenmill.attention.plugin"].hooks == ["tokenmill_register_attention_backends"]


def test_contrib_plugin_found_through_its_entry_point(contrib_on_path: Path) -> None:
    system = load_plugins(allowlist=["eager-attention"])
    info = next(info for info in system.infos if info.name == "eager-attention")
    assert (info.version, info.source, info.error) == ("0.1.0", "entry point", None)
    assert info.provides == {"attention_backend": ["eager"]}
    assert system.registry.names(Slot.ATTENTION_BACKEND) == ["eager", "torch"]


def test_contrib_plugin_listed_by_cli(installed_contrib: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(installed_contrib)}
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "plugins", "--json"], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr
    listing = {info["name"]: info for info in json.loads(result.stdout)}
    assert listing["eager-attention"]["provides"] == {"attention_backend": ["eager"]}
    assert listing["eager-attention"]["version"] == "0.1.0"


def test_contrib_plugin_selected_by_config_runs_the_model(contrib_on_path: Path, tmp_path: Path) -> None:
    hf_model = save_hf_model("qwen2-sliding", tmp_path)
    config_file = tmp_path / "runtime.toml"
    config_file.write_text(f'[model]\nmodel = "{tmp_path}"\n[attention]\nbackend = "eager"\n[device]\ndevice = "cpu"\n')
    loaded = load_model(load_config(config_file))
    assert type(loaded.attention).__module__ == "tokenmill_eager_attention.backend"
    prompt = list(range(3, 40, 2))
    logits = ModelRunner(loaded, num_blocks=8, block_size=4).execute(
        [SequenceChunk(prompt, 0, [5, 1, 7, 0, 2])], all_logits=True
    )
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_unknown_name_lists_installed_names(tmp_path: Path) -> None:
    save_hf_model("llama-tiny", tmp_path)
    config = load_config(overrides={"model": {"model": str(tmp_path)}, "attention": {"backend": "flash"}})
    with pytest.raises(PluginError) as excinfo:
        load_model(config, load_plugins(autoload=False))
    assert str(excinfo.value) == "unknown attention_backend 'flash'; installed: torch"


def test_broken_plugin_is_reported_not_fatal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_broken_plugin(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    system = load_plugins(allowlist=["broken"])
    broken = next(info for info in system.infos if info.name == "broken")
    assert broken.version == "0.3"
    assert broken.error == "ModuleNotFoundError: No module named 'not_a_real_dependency_of_anything'"
    assert system.registry.names(Slot.ATTENTION_BACKEND) == ["torch"]  # the rest still works
    with pytest.raises(PluginError, match=r"unknown attention_backend 'x'; installed: torch; plugins that failed"):
        system.registry.load(Slot.ATTENTION_BACKEND, "x")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "TOKENMILL_PLUGINS": "broken"}
    listing = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "plugins"], capture_output=True, text=True, env=env
    )
    assert listing.returncode == 0
    assert "broken 0.3 (entry point) FAILED: ModuleNotFoundError" in listing.stdout


def test_allowlist_and_disable(contrib_on_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert "eager-attention" not in {i.name for i in load_plugins(disabled=["eager-attention"]).infos}
    assert "eager-attention" not in {i.name for i in load_plugins(allowlist=["something-else"]).infos}
    monkeypatch.setenv("TOKENMILL_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert "eager-attention" not in {i.name for i in load_plugins().infos}
    with pytest.raises(PluginError, match="essential"):
        load_plugins(disabled=[ESSENTIAL_PLUGINS[0]])


def test_plugin_object_registers_and_hooks_are_recorded() -> None:
    calls: list[str] = []

    class RecordingPlugin:
        @hookimpl
        def tokenmill_register_attention_backends(self, register):
            calls.append("attention")
            register("sdpa-alias", "tokenmill.attention.torch_backend:TorchAttentionBackend")

    system = load_plugins(autoload=False, extra_plugins=[("recorder", RecordingPlugin())])
    assert calls == ["attention"]
    backend_class = system.registry.load(Slot.ATTENTION_BACKEND, "sdpa-alias")
    assert backend_class.__name__ == "TorchAttentionBackend"


def test_misspelled_hook_fails_loudly() -> None:
    class Misspelled:
        @hookimpl
        def tokenmill_register_attention_backend(self, register):  # missing "s"
            pass

    with pytest.raises(PluginError, match="misspelled|unknown hook"):
        load_plugins(autoload=False, extra_plugins=[("misspelled", Misspelled())])


def test_conflicting_registrations_name_both_plugins() -> None:
    class Impostor:
        @hookimpl
        def tokenmill_register_attention_backends(self, register):
            register("torch", "impostor.module:Backend")

    with pytest.raises(PluginError, match="registered by both 'tokenmill.attention.plugin' and 'impostor'"):
        load_plugins(autoload=False, extra_plugins=[("impostor", Impostor())])


def test_broken_selected_plugin_is_fatal_with_its_name() -> None:
    class Dangling:
        @hookimpl
        def tokenmill_register_attention_backends(self, register):
            register("dangling", "no_such_module_here:Backend")

    system = load_plugins(autoload=False, extra_plugins=[("dangling", Dangling())])
    with pytest.raises(PluginError, match="attention_backend 'dangling' from plugin 'dangling' failed to import"):
        system.registry.load(Slot.ATTENTION_BACKEND, "dangling")


def test_entry_point_module_import_is_cheap(installed_contrib: Path) -> None:
    """Listing plugins must not import the backend (which a GPU plugin would need CUDA for)."""
    code = textwrap.dedent(
        """
        import sys
        from tokenmill.plugin_manager import load_plugins
        load_plugins(allowlist=["eager-attention"])
        print("tokenmill_eager_attention.backend" in sys.modules)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(installed_contrib)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False"
