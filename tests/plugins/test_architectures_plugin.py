"""The architectures plugin (``architectures``): found through its entry point, and each of its models serving a
request through the engine (their parity with transformers is tests/models/test_reference_match.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenmill_plugins.architectures.plugin import ARCHITECTURES

from tests.factories import make_engine, run_to_completion, save_tiny_model
from tokenmill.engine import now
from tokenmill.messages import EngineCoreRequest
from tokenmill.plugin_manager import Slot, load_plugins
from tokenmill.sampling_params import SamplingParams


def test_registered_through_its_entry_point() -> None:
    system = load_plugins(allowlist=["architectures"])
    info = next(info for info in system.infos if info.name == "architectures")
    assert (info.source, info.error) == ("entry point", None)
    assert set(ARCHITECTURES) <= set(system.registry.names(Slot.ARCHITECTURE))
    assert system.registry.load(Slot.ARCHITECTURE, "Gemma2ForCausalLM").__name__ == "GemmaForCausalLM"


@pytest.mark.parametrize("name", ["gemma3-tiny", "phi3-tiny"])
def test_serves_a_request(name: str, tmp_path: Path) -> None:
    engine = make_engine(save_tiny_model(tmp_path, name))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    tokens = run_to_completion(engine, [EngineCoreRequest("a", [5, 6, 7], params, [], now())])
    assert len(tokens["a"]) == 5


def test_docs_models_lists_every_installed_architecture() -> None:
    from tokenmill.models.catalog import architecture_table

    page = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    rows = architecture_table(load_plugins(allowlist=["architectures"]).registry)
    for row in rows:
        if not row.is_fallback:
            assert f"| `{row.architecture}` | `{row.implementation}` (" in page, row.architecture
    fallback = "| any other decoder transformers implements | `TransformersForCausalLM` (`architectures`) | fallback"
    assert fallback in page
