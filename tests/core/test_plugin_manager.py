"""Plugin discovery, registration, selection by config, and failure reporting."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import pytest
import torch

from tests.factories import save_hf_model
from tokenmill import hookimpl
from tokenmill.config import load_config
from tokenmill.model_loader import load_model
from tokenmill.model_runner import ModelRunner, SequenceChunk
from tokenmill.plugin_manager import ESSENTIAL_PLUGINS, FRONT_END_SLOTS, PluginError, Slot, load_plugins
from tokenmill.routing import RoundRobinRouter

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
    # The allowlist names third-party plugins only: the first-party fast path stays.
    assert system.registry.names(Slot.ATTENTION_BACKEND) == ["cpu", "cuda", "eager", "torch", "triton"]


def test_contrib_plugin_listed_by_cli(installed_contrib: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(installed_contrib)}
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "plugins", "--json"], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    listing = {info["name"]: info for info in report["plugins"]}
    slots = {slot["slot"]: slot for slot in report["slots"]}
    assert "eager" in slots["attention_backend"]["installed"] and slots["scheduler"]["selected"] == ["fcfs"]
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
    assert broken.error == "failed to import: ModuleNotFoundError: No module named 'not_a_real_dependency_of_anything'"
    assert broken.package == "broken-plugin"
    assert "torch" in system.registry.names(Slot.ATTENTION_BACKEND)  # the rest still works
    with pytest.raises(PluginError, match=r"unknown attention_backend 'x'; installed: .*torch.*; plugins that failed"):
        system.registry.load(Slot.ATTENTION_BACKEND, "x")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "TOKENMILL_PLUGINS": "broken"}
    listing = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "plugins"], capture_output=True, text=True, env=env
    )
    assert listing.returncode == 0
    assert "broken 0.3 (entry point, package broken-plugin) FAILED: failed to import: ModuleNotFoundError" in (
        listing.stdout
    )


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


def test_unknown_hook_skips_that_plugin_with_a_clear_error() -> None:
    class Misspelled:
        @hookimpl
        def tokenmill_register_attention_backend(self, register):  # missing "s"
            register("never", "x:y")

    system = load_plugins(autoload=False, extra_plugins=[("misspelled", Misspelled())])
    info = next(info for info in system.infos if info.name == "misspelled")
    assert info.error == "implements hook(s) that tokenmill 0.1.0 does not have: tokenmill_register_attention_backend"
    assert not system.pm.has_plugin("misspelled") and "never" not in system.registry.names(Slot.ATTENTION_BACKEND)


def test_conflicting_registrations_name_both_plugins() -> None:
    class Impostor:
        @hookimpl
        def tokenmill_register_attention_backends(self, register):
            register("torch", "impostor.module:Backend")

    system = load_plugins(autoload=False, extra_plugins=[("impostor", Impostor())])
    impostor = next(info for info in system.infos if info.name == "impostor")
    assert impostor.error is not None
    assert "registers attention_backend 'torch', which plugin 'tokenmill.attention.plugin'" in impostor.error
    assert system.registry.get(Slot.ATTENTION_BACKEND, "torch").plugin == "tokenmill.attention.plugin"


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


class _Options(msgspec.Struct, forbid_unknown_fields=True):
    greeting: str = "hello"
    times: int = 1


class _OptionsPlugin:
    """Declares options and registers a router that keeps what it was given."""

    @hookimpl
    def tokenmill_plugin_options(self):
        return _Options

    @hookimpl
    def tokenmill_register_routers(self, register):
        register("remembering", f"{__name__}:RememberingRouter")


class RememberingRouter(RoundRobinRouter):
    name = "remembering"

    def __init__(self, options: _Options) -> None:
        super().__init__()
        self.options = options


def test_plugin_options_are_validated_and_delivered() -> None:
    system = load_plugins(autoload=False, extra_plugins=[("greeter", _OptionsPlugin())])
    system.configure({"greeter": {"greeting": "hi", "times": 3}})
    router = system.create(Slot.ROUTER, "remembering")
    assert router.options == _Options(greeting="hi", times=3)
    assert system.create(Slot.ROUTER, "round-robin").__class__ is RoundRobinRouter  # built-ins take none
    with pytest.raises(PluginError, match=r"^\[plugins.greeter\]: unknown option 'time'; allowed: greeting, times$"):
        system.configure({"greeter": {"time": 3}})
    with pytest.raises(PluginError, match=r"^\[plugins.greeter\]: invalid option times: Expected `int`"):
        system.configure({"greeter": {"times": "x"}})
    with pytest.raises(PluginError, match=r"plugin 'nobody' is not installed; plugins with options: greeter"):
        system.configure({"nobody": {}})


def test_config_selections_are_checked_before_any_model_loads() -> None:
    system = load_plugins(autoload=False)
    for overrides, message in [
        ({"model": {"quantization": "in4"}}, "model.quantization: unknown quantizer 'in4'; installed: none"),
        ({"scheduler": {"policy": "lifo"}}, "scheduler.policy: unknown scheduler 'lifo'; installed: fcfs, priority"),
        ({"sampler": {"logits_processors": ["nope"]}}, "sampler.logits_processors: unknown logits_processor 'nope'"),
        ({"server": {"router": "random"}}, "server.router: unknown router 'random'; installed: round-robin"),
    ]:
        with pytest.raises(PluginError, match="^" + re.escape(message)):
            system.check_config(load_config(overrides=overrides))


def test_a_misspelled_name_fails_the_cli_in_one_line_and_under_two_seconds(tmp_path: Path) -> None:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "serve", str(tmp_path / "no-model-needed"), "--quantization", "in4"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "Error: model.quantization: unknown quantizer 'in4'; installed: awq, compressed-tensors, gptq, int4, int8, none"
    ]
    assert elapsed < 2.0, f"took {elapsed:.2f} s"


def test_an_engine_does_not_need_the_front_ends_router_installed() -> None:
    config = load_config(overrides={"server": {"router": "installed-only-on-the-front-end"}})
    with pytest.raises(PluginError, match="server.router: unknown router"):
        load_plugins(autoload=False).check_config(config)
    load_plugins(autoload=False).check_config(config, skip=FRONT_END_SLOTS)  # what an engine process checks


def test_server_backend_names_an_engine_backend_and_local_is_the_cores_own() -> None:
    system = load_plugins(allowlist=[])
    assert system.registry.get(Slot.ENGINE_BACKEND, "ray").plugin == "ray_backend"
    system.check_config(load_config())  # 'local': engine processes on this host, no plugin selected
    config = load_config(overrides={"server": {"backend": "kubernetes"}})
    with pytest.raises(PluginError) as excinfo:
        system.check_config(config)
    assert str(excinfo.value) == "server.backend: unknown engine_backend 'kubernetes'; installed: ray"
    system.check_config(config, skip=FRONT_END_SLOTS)  # an engine process never builds one


def test_plugins_json_lists_the_engine_backend_slot_with_ray() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "plugins", "--json", "--backend", "ray"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    slots = {slot["slot"]: slot for slot in report["slots"]}
    assert slots["engine_backend"]["setting"] == "server.backend" and slots["engine_backend"]["selected"] == ["ray"]
    assert "ray" in slots["engine_backend"]["installed"]
    listing = {info["name"]: info for info in report["plugins"]}
    assert listing["ray_backend"]["provides"] == {"engine_backend": ["ray"]}
    assert listing["ray_backend"]["hooks"] == ["tokenmill_register_engine_backends"]
