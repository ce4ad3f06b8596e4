"""The Hugging Face transformers baseline of the comparison suite: batched ``generate`` and prefill.

Each suite scenario measures tokenmill first, stops its server, then measures
transformers on the same model here, in the benchmark's own process, so the two
never compete for cores. Prompts are the same random token ids that
``bench.workload`` gives the tokenmill run. ``generate`` is greedy with
``min_new_tokens = max_new_tokens`` (EOS cannot end a row early, like
``ignore_eos``), and a batch is static: rows of different lengths are
left-padded and every row runs for the longest output, but only the tokens each
row asked for count as output. TTFT is one forward over the prompt, timed
separately (``prefill``). On a GPU the model runs with SDPA attention and
generates with its static cache, transformers' fast path, which compiles the
forward with ``torch.compile`` for each new shape: every timed ``generate`` there
follows an untimed one of the same shapes.

transformers is a test-only dependency of tokenmill; it is imported when a
baseline is loaded, and a missing install is a one-line ``HFBaselineError``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.errors import TokenmillError
from tokenmill_plugins.commands.bench.metrics import percentile
from tokenmill_plugins.commands.bench.workload import random_token_ids

if TYPE_CHECKING:  # torch and transformers load only when a baseline runs
    import torch

logger = logging.getLogger(__name__)

_DTYPES = ("float32", "float16", "bfloat16")
_WARMUP_PROMPT_LEN = 8
_WARMUP_OUTPUT_LEN = 2
_MISSING = (
    "the transformers baseline needs transformers: install it with `pip install transformers` or pass --no-hf-baseline"
)


class HFBaselineError(TokenmillError):
    """transformers is missing or cannot load the model; the message says to install it or skip the baseline."""


def check_transformers() -> None:
    """Raise ``HFBaselineError`` now if transformers is not installed; the suite calls it before it
    starts a server, so a missing install fails in a second rather than after the tokenmill run."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise HFBaselineError(_MISSING)


@contextmanager
def torch_threads(num_threads: int | None) -> Iterator[None]:
    """Run the block with torch on ``num_threads`` threads (None: leave torch's default), then restore."""
    import torch

    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class HFModel:
    """A transformers causal LM loaded once and measured several times by one suite scenario.

    Built by ``HFModel.load`` (from ``bench.suite`` or ``run_hf_*``); each measurement
    runs with torch pinned to ``num_threads``, the count the tokenmill server used.
    """

    def __init__(self, model: Any, path: Path, device: str, dtype: str, num_threads: int | None) -> None:
        self.model = model
        self.path = path
        self.device = device
        self.on_gpu = device.startswith("cuda")
        self.dtype = dtype
        self.num_threads = num_threads
        self.pad_token_id = 0  # left padding is masked out, so any id works

    @classmethod
    def load(
        cls, model_path: Path, *, device: str = "cpu", dtype: str = "float32", num_threads: int | None = None
    ) -> HFModel:
        """Load a Hugging Face directory or a ``.gguf`` file (dequantized to ``dtype``) and warm it up."""
        if dtype not in _DTYPES:
            raise HFBaselineError(f"dtype={dtype!r} is invalid for the transformers baseline: use one of {_DTYPES}")
        try:
            import torch
            from transformers import AutoModelForCausalLM
        except ImportError:
            raise HFBaselineError(_MISSING) from None
        path = Path(model_path)
        location, extra = (str(path.parent), {"gguf_file": path.name}) if path.is_file() else (str(path), {})
        extra.update(_compressed_tensors_options(path))
        logger.info("loading %s into transformers as %s on %s", path, dtype, device)
        with torch_threads(num_threads):
            try:
                if device.startswith("cuda"):
                    extra["attn_implementation"] = "sdpa"  # what transformers' docs recommend on a GPU
                model: Any = AutoModelForCausalLM.from_pretrained(location, dtype=getattr(torch, dtype), **extra)
            except Exception as exc:  # any load failure is the user's model or install, said in one line
                message = " ".join(str(exc).split())[:300]
                raise HFBaselineError(
                    f"transformers could not load {path} ({type(exc).__name__}: {message}); pass --no-hf-baseline "
                    "to measure tokenmill alone"
                ) from None
            model = model.to(device).eval()
            baseline = cls(model, path, device, dtype, num_threads)
            # One-time costs (lazy init, first kernels) are not timed.
            warmup = random_token_ids([_WARMUP_PROMPT_LEN], seed=0, vocab_size=baseline.vocab_size)
            baseline._generate(warmup, _WARMUP_OUTPUT_LEN)
        return baseline

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def generate(self, prompts: list[list[int]], output_lens: list[int]) -> dict[str, Any]:
        """Time one batched greedy ``generate`` of ``prompts`` (one static batch) and return its figures.

        Every row runs for ``max(output_lens)`` new tokens; ``num_output_tokens`` counts
        only the ``output_lens`` each row asked for, and ``output_throughput`` is that
        count per second. A batch of one also gets ``ttft_ms`` (a separate prefill of
        its prompt) and ``itl_ms``, the mean time of each later token.
        """
        assert prompts and len(prompts) == len(output_lens)
        max_new_tokens = max(output_lens)
        with torch_threads(self.num_threads):
            if self.on_gpu:
                # The static cache makes transformers compile the forward for these shapes on first use: an
                # untimed run of the same call keeps the compilation out of the figures.
                self._generate(prompts, max_new_tokens)
            duration, num_new_tokens = self._generate(prompts, max_new_tokens)
        if num_new_tokens != max_new_tokens:
            raise HFBaselineError(
                f"transformers generated {num_new_tokens} tokens per row, not {max_new_tokens}: "
                "is the prompt plus output longer than the model's context?"
            )
        num_output_tokens = sum(output_lens)
        result: dict[str, Any] = {
            "batch_size": len(prompts),
            "num_input_tokens": sum(len(p) for p in prompts),
            "num_output_tokens": num_output_tokens,
            "num_generated_tokens": len(prompts) * num_new_tokens,  # the padding rows' extra tokens included
            "generated_tokens_per_row": num_new_tokens,
            "duration_s": duration,
            "output_throughput": num_output_tokens / duration,
            "ttft_ms": None,
            "itl_ms": None,
        }
        if len(prompts) == 1:
            ttft = self.prefill(prompts[0], num_iters=3)["prefill_s"]
            result["ttft_ms"] = ttft * 1000
            if max_new_tokens > 1:
                result["itl_ms"] = max(duration - ttft, 0.0) / (max_new_tokens - 1) * 1000
        logger.info("transformers: batch %d generated %d tokens in %.2f s", len(prompts), num_output_tokens, duration)
        return result

    def prefill(self, token_ids: list[int], *, num_iters: int = 3) -> dict[str, Any]:
        """Time ``num_iters`` forwards over ``token_ids`` that build the KV cache and the last position's
        logits: the prefill ``generate`` does before its first token. Returns the p50 as ``prefill_s``."""
        import torch

        input_ids = torch.tensor([token_ids], device=self.device)  # [1, num_tokens]
        times = []
        with torch_threads(self.num_threads), torch.inference_mode():
            for _ in range(num_iters):
                self._synchronize()
                start = time.perf_counter()
                # logits_to_keep=1: only the last position's logits, as generate's prefill computes.
                self.model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
                self._synchronize()
                times.append(time.perf_counter() - start)
        prefill_s = percentile(times, 50)
        return {
            "input_len": len(token_ids),
            "num_iters": num_iters,
            "prefill_s": prefill_s,
            "prefill_throughput": len(token_ids) / prefill_s,
            "iteration_s": times,
        }

    def _generate(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, int]:
        """Seconds for one ``generate`` call and the new tokens per row it produced."""
        import torch
        from transformers import GenerationConfig

        input_ids, attention_mask = self._left_pad(prompts)
        eos = self.model.generation_config.eos_token_id or self.model.config.eos_token_id
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,  # EOS cannot end a row early: ignore_eos
            pad_token_id=self.pad_token_id,
            eos_token_id=eos,
            # On a GPU, the static cache: preallocated, so no step reallocates it (transformers' fast path).
            cache_implementation="static" if self.on_gpu else None,
        )
        with torch.inference_mode():
            self._synchronize()
            start = time.perf_counter()
            output = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
            self._synchronize()
            duration = time.perf_counter() - start
        return duration, int(output.shape[1] - input_ids.shape[1])

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)  # [batch, width]
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [batch, width]
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        return input_ids.to(self.device), attention_mask.to(self.device)

    def _synchronize(self) -> None:
        if self.on_gpu:
            import torch

            torch.cuda.synchronize()


def run_hf_generate(
    model_path: Path,
    batch_size: int,
    input_len: int,
    output_len: int,
    seed: int = 0,
    num_threads: int | None = None,
    *,
    device: str = "cpu",
    dtype: str = "float32",
) -> dict[str, Any]:
    """Load the model and time one batched ``generate`` of ``batch_size`` random prompts
    (the ones ``bench serve`` sends with this seed); see ``HFModel.generate``."""
    model = HFModel.load(model_path, device=device, dtype=dtype, num_threads=num_threads)
    prompts = random_token_ids([input_len] * batch_size, seed=seed)
    return model.generate(prompts, [output_len] * batch_size)


def run_hf_prefill(
    model_path: Path,
    input_len: int,
    seed: int = 0,
    num_threads: int | None = None,
    *,
    num_iters: int = 3,
    device: str = "cpu",
    dtype: str = "float32",
) -> dict[str, Any]:
    """Load the model and time the prefill of one random ``input_len`` prompt; see ``HFModel.prefill``."""
    model = HFModel.load(model_path, device=device, dtype=dtype, num_threads=num_threads)
    (prompt,) = random_token_ids([input_len], seed=seed)
    return model.prefill(prompt, num_iters=num_iters)


def _compressed_tensors_options(path: Path) -> dict[str, Any]:
    """For a weight-only llm-compressor checkpoint: decompress it to dense weights at load
    (``run_compressed=False``). transformers 5.24 with compressed-tensors 0.19 refuses asymmetric ``pack-quantized``
    checkpoints otherwise (it expects their packed zero points unpacked). Not for schemes that quantize
    activations (W8A8, FP8): that option drops their quantization scheme, so activations would stay float, while
    transformers' own load decompresses the weights on the CPU and keeps the scheme."""
    import json

    config = path / "config.json"
    if not path.is_dir() or not config.is_file():
        return {}
    quantization = json.loads(config.read_text()).get("quantization_config") or {}
    if quantization.get("quant_method") != "compressed-tensors":
        return {}
    groups = (quantization.get("config_groups") or {}).values()
    if any(group.get("input_activations") for group in groups):
        return {}
    from transformers import CompressedTensorsConfig

    return {"quantization_config": CompressedTensorsConfig(run_compressed=False)}
