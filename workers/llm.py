"""Offline API: ``LLM(model, **engine_options).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from cluster.config import EngineConfig
from cluster.protocol import EngineStats, RequestOutput, SamplingParams, TokenDelta
from workers.detokenizer import DetokenizerStage
from workers.engine import Engine

# NOTE: bounds the wait for the detokenizer thread at the end of generate(); it trails the engine by
# at most the deltas of the last few steps.
_DRAIN_TIMEOUT_S = 60.0


class LLM:
    """Batch generation over one Engine. ``engine_options`` are EngineConfig / ModelConfig fields
    (block_size, num_kv_blocks, max_num_seqs, max_num_batched_tokens, enable_prefix_caching,
    attention_backend, dtype, max_model_len, device, ...); unknown names are an error.

    ``detokenize_thread`` (default on): the text of each output is produced on a ``DetokenizerStage``
    thread that lives for one ``generate`` call, not between the engine's steps; off, the engine
    detokenizes inline. Outputs are the same either way.
    """

    def __init__(self, model: str = "", *, detokenize_thread: bool = True, **engine_options: Any) -> None:
        config = EngineConfig.from_options(model, **engine_options)
        self.engine = Engine(config, detokenize=not detokenize_thread)
        self.detokenize_thread = detokenize_thread and self.engine.tokenizer is not None
        self._counter = 0

    def close(self) -> None:
        """Stops the engine's other tensor-parallel ranks, if it has any (``with LLM(...) as llm`` too)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Sequence[str] | Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order. All inputs are validated before any is
        queued, so a bad one raises ValueError and leaves the engine as it was."""
        token_prompts = [self._tokens(p) for p in prompts]
        if params is None:
            params = SamplingParams()
        param_list = [params] * len(token_prompts) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(token_prompts):
            raise ValueError(f"got {len(param_list)} SamplingParams for {len(token_prompts)} prompts")
        param_list = [self._with_bad_words(p) for p in param_list]
        for tokens, p in zip(token_prompts, param_list, strict=True):
            self.engine.validate(tokens, p)

        outputs: dict[str, RequestOutput] = {}
        order: list[str] = []
        bar = tqdm(total=len(token_prompts), desc="generate", disable=not use_tqdm)

        def apply(deltas: list[TokenDelta]) -> None:
            now = time.time()
            for delta in deltas:
                outputs[delta.request_id].apply(delta, now)
                if delta.finish_reason is not None:
                    bar.update(1)

        stage = None
        if self.detokenize_thread and self.engine.tokenizer is not None:
            stage = DetokenizerStage(self.engine.tokenizer, apply, name="llm-detokenizer")
        try:
            for tokens, p in zip(token_prompts, param_list, strict=True):
                request_id = f"llm-{self._counter}"
                self._counter += 1
                self.engine.add_request(request_id, tokens, p)
                outputs[request_id] = RequestOutput.start(request_id, tokens, p, time.time())
                order.append(request_id)
                if stage is not None:
                    stage.add_request(request_id, tokens, p)
            while self.engine.has_unfinished():
                if stage is None:
                    apply(self.engine.step())
                else:
                    stage.submit(self.engine.step_output())  # NOTE: the stage builds the deltas
                    if stage.error is not None:
                        stage.flush(_DRAIN_TIMEOUT_S)  # raises the stage's error
                failed = self.engine.take_failed()
                if failed:  # NOTE: a grammar that validate() compiled, evicted and then failed to recompile
                    raise ValueError("; ".join(f"{f.request_id}: {f.message}" for f in failed))
            if stage is not None:
                stage.flush(_DRAIN_TIMEOUT_S)
        finally:
            if stage is not None:
                stage.close(_DRAIN_TIMEOUT_S)
            bar.close()
        return [outputs[r] for r in order]

    def _tokens(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise ValueError("text prompts need a tokenizer.json in the model directory; pass token ids")
            return self.engine.tokenizer.encode(prompt)
        return list(prompt)

    def _with_bad_words(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its ``bad_words`` resolved to token ids as the HTTP edge resolves them
        (``Tokenizer.bad_words_token_ids``: vLLM's rule); the caller's object is left as it was."""
        if not params.bad_words or params.bad_words_token_ids:
            return params
        if self.engine.tokenizer is None:
            raise ValueError(
                "bad_words need a tokenizer.json in the model directory; pass bad_words_token_ids"
            )
        token_ids = self.engine.tokenizer.bad_words_token_ids(params.bad_words)
        return dataclasses.replace(params, bad_words_token_ids=token_ids)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def check_no_leaks(self) -> None:
        self.engine.check_no_leaks()
