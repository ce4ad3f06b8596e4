"""The plugin's own tests, with tokenmill's test kit (``tokenmill.testing``): run them once the package is
installed (``pip install -e .``). The kit's pytest fixtures load by themselves."""

import subprocess

import pytest
from tokenmill_eager_attention.backend import EagerAttentionBackend

from tokenmill import EngineCoreRequest, SamplingParams
from tokenmill.testing import check_attention_backend, make_engine, run_to_completion


def test_listed_by_tokenmill_plugins():
    listing = subprocess.run(["tokenmill", "plugins"], capture_output=True, text=True, check=True).stdout
    assert "eager-attention 0.1.0 (entry point, package tokenmill-eager-attention)" in listing
    assert "attention_backend: eager" in listing


def test_conforms_to_the_attention_backend_contract():
    """Against the built-in backend on random paged steps: chunked prefill, decode, sliding windows, GQA."""
    check_attention_backend(EagerAttentionBackend)


@pytest.mark.tokenmill_engine(attention={"backend": "eager"}, scheduler={"max_num_batched_tokens": 16})
def test_engine_serves_the_same_tokens_as_the_builtin_backend(tiny_engine, tiny_model_dir):
    """Through a whole engine (16-token steps, so the 20-token prompt is read in two chunks)."""
    assert tiny_engine.config.attention.backend == "eager"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    requests = [
        EngineCoreRequest(f"r{i}", list(range(5 + i, 5 + i + n)), params, [], 0.0) for i, n in enumerate((3, 20))
    ]
    builtin = make_engine(tiny_model_dir, attention={"backend": "torch"}, scheduler={"max_num_batched_tokens": 16})
    assert run_to_completion(tiny_engine, requests) == run_to_completion(builtin, requests)
