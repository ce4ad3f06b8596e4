"""The test kit's fixtures and factories, as a plugin's tests use them."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tokenmill import EngineCore, EngineCoreRequest, SamplingParams, Tokenizer, hookimpl
from tokenmill.plugin_manager import PluginSystem, Slot
from tokenmill.scheduler import PriorityScheduler
from tokenmill.testing import make_scheduler, run_to_completion, save_tiny_tokenizer


def test_importing_the_kit_and_its_pytest_plugin_imports_neither_torch_nor_transformers() -> None:
    code = (
        "import sys, tokenmill.testing, tokenmill.testing.plugin; from tokenmill.testing import check_router; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_the_pytest_plugin_is_registered_by_the_installed_distribution(pytestconfig: pytest.Config) -> None:
    assert pytestconfig.pluginmanager.has_plugin("tokenmill")


def test_tiny_engine_generates(tiny_engine: EngineCore) -> None:
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    tokens = run_to_completion(tiny_engine, [EngineCoreRequest("r", [1, 2, 3], params, [], 0.0)])
    assert len(tokens["r"]) == 5 and all(0 <= t < 512 for t in tokens["r"])


@pytest.mark.tokenmill_engine(scheduler={"policy": "priority", "max_num_seqs": 3}, cache={"num_kv_blocks": 64})
def test_tiny_engine_takes_config_sections_from_its_marker(tiny_engine: EngineCore) -> None:
    assert tiny_engine.config.scheduler.max_num_seqs == 3
    assert tiny_engine.config.cache.num_kv_blocks == 64  # merged over the kit's defaults ...
    assert tiny_engine.config.cache.block_size == 4  # ... which stay where not overridden
    assert isinstance(tiny_engine.scheduler, PriorityScheduler)


def test_tiny_model_dir_has_its_own_tokenizer(tiny_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_path(tiny_model_dir)
    assert tokenizer.vocab_size == 512 and tokenizer.eos_token_ids == (2,)  # <|im_end|>
    assert tokenizer.decode(tokenizer.encode("hello, wörld")) == "hello, wörld"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_tokenizer_refuses_a_size_it_cannot_fill(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size=100 is outside"):
        save_tiny_tokenizer(tmp_path, vocab_size=100)


class _Greeter:
    """A plugin object with one registration hook."""

    @hookimpl
    def tokenmill_register_routers(self, register: Callable[[str, str], None]) -> None:
        register("greeter", "tokenmill.routing:RoundRobinRouter")


def test_plugin_manager_registers_plugin_objects_beside_the_builtins(
    plugin_manager: Callable[..., PluginSystem],
) -> None:
    system = plugin_manager(_Greeter(), ("named", _Greeter()))
    assert system.registry.names(Slot.ROUTER) == ["greeter", "round-robin", "round_robin"]
    infos = {info.name: info for info in system.infos}
    # Named after its class, or as given; registering the same class under a name again is no conflict.
    assert infos["_Greeter"].provides == infos["named"].provides == {"router": ["greeter"]}
    assert "attention" not in infos  # autoload is off


def test_make_scheduler_builds_a_named_policy_or_a_class() -> None:
    assert type(make_scheduler("priority")) is PriorityScheduler
    scheduler = make_scheduler(PriorityScheduler, num_blocks=8)
    assert scheduler.kv_cache.num_blocks == 8  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="unknown settings \\['num_block'\\]"):
        make_scheduler(num_block=8)
