"""``LLM(...).generate`` with ``SamplingParams(structured_outputs=StructuredOutputsParams(...))``, offline."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.structured_output.schemas import SCHEMAS, assert_valid
from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.sampling_params import InvalidRequestError


def test_llm_generate_with_structured_outputs(model_dir: Path) -> None:
    llm = LLM(str(model_dir), device="cpu", num_kv_blocks=256, block_size=4)
    schema = SCHEMAS["flat"]
    constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    outputs = llm.generate(
        ["a", "b", "c"], SamplingParams(temperature=1.0, seed=0, max_tokens=80, structured_outputs=constraint),
        use_tqdm=False,
    )  # fmt: skip
    for output in outputs:
        assert_valid(output.outputs[0].text, schema)
    with pytest.raises(InvalidRequestError, match="structured_outputs cannot be used: .*strin"):
        llm.generate("a", SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "strin"})))
    with pytest.raises(InvalidRequestError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["b"])
