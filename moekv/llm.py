"""LLM: the offline Python API, shaped like vLLM's `LLM`."""
from __future__ import annotations

import weakref
from typing import Any, Callable
from typing import Sequence as Seq

import torch
from tqdm.auto import tqdm

from moekv.config import EngineConfig
from moekv.engine.llm_engine import LLMEngine, PromptType
from moekv.outputs import RequestOutput
from moekv.sampling_params import SamplingParams


class EngineStepError(RuntimeError):
    """The model failed during a step; the affected requests were failed and their pages freed."""


class LLM:
    """llm = LLM(model=PATH, dtype=..., device=..., kv_cache_dtype=..., max_model_len=..., ...)

    Keyword arguments are EngineConfig's, flat (its own fields and every group's, kv_cache_dtype,
    max_num_seqs, kv_group_size, ...) or whole groups (cache=CacheConfig(...)).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        if model is not None:
            kwargs["model"] = model
        self.engine = LLMEngine(EngineConfig(**kwargs))
        # the worker ranks (tensor_parallel_size > 1) go when this LLM is garbage-collected, if not closed before
        self._finalizer = weakref.finalize(self, LLMEngine.shutdown, self.engine)

    def close(self) -> None:
        """Release what the engine holds beyond this process's memory: stop its worker ranks and leave
        their process group (tensor_parallel_size > 1), so another parallel LLM may start in this
        process. Idempotent; `with LLM(...) as llm:` calls it on leaving, and garbage collection too."""
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        prompts: a string, a {"prompt_token_ids": [...]} dict, or a list of either.
        All prompts are validated before any of them starts.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a string, a {{'prompt_token_ids': [...]}} dict, or a list of them; "
                            f"got {type(prompts).__name__}")
        prompts = list(prompts)
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; "
                                 "give one, or one per prompt")
        seqs = [self.engine.make_sequence(p, sp) for p, sp in zip(prompts, params_list)]
        return self._run(seqs, use_tqdm)

    def _run(self, seqs: list, use_tqdm: bool, on_step: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Queue validated sequences and step until all are done (on_step() after each engine step);
        aborts all of them on any failure."""
        engine = self.engine
        for seq in seqs:
            seq.output_kind = "final"  # only final outputs are read here
            engine.add_sequence(seq)
        order = {seq.request_id: i for i, seq in enumerate(seqs)}
        results: list[RequestOutput | None] = [None] * len(seqs)
        bar = tqdm(total=len(seqs), desc="generate", disable=not use_tqdm)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.error is not None:
                        raise EngineStepError(f"request {out.request_id} failed: {out.error}")
                    if out.finished:
                        results[order[out.request_id]] = out
                        bar.update(1)
                if on_step is not None:
                    on_step()
        except BaseException:
            for seq in seqs:  # nothing may keep pages after generate() returns or raises
                engine.abort_request(seq.request_id)
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]

    def score(self, prompts: Seq[PromptType], decode_from: Seq[int] | None = None,
              progress: Callable[[list[int]], None] | None = None) -> list[torch.Tensor]:
        """The model's logits [len(prompt), V] (fp32, CPU) at every prompt position, computed through
        the engine's paged KV cache (prefill chunks write and read pages).

        decode_from[i]: prompt i's tokens from this position on are fed one per step, as decode
        feeds generated tokens (teacher forcing), so their logits see the cache as generation does.
        progress: called after each engine step with each prompt's tokens computed so far (a prompt's
        logits row r exists once r + 1 of its tokens are).
        """
        engine = self.engine
        seqs = [engine.make_sequence(p, SamplingParams(max_tokens=1, temperature=0.0), scoring=True) for p in prompts]
        for i, seq in enumerate(seqs):
            seq.prompt_logits = []
            if decode_from is not None:
                seq.decode_from = decode_from[i]
        on_step = None if progress is None else lambda: progress([seq.num_computed_tokens for seq in seqs])
        self._run(seqs, use_tqdm=False, on_step=on_step)
        return [torch.cat(seq.prompt_logits) for seq in seqs]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        if not isinstance(messages, (list, tuple)):
            raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts (or a list of such lists); "
                            f"got {type(messages).__name__}")
        conversations = messages if messages and isinstance(messages[0], (list, tuple)) else [messages]
        for i, conversation in enumerate(conversations):
            if not conversation:  # as the server answers 400: there is nothing to respond to
                raise ValueError(f"messages{f'[{i}]' if conversations is messages else ''} is an empty conversation; "
                                 "give at least one message")
        prompts = [{"prompt_token_ids": self.engine.encode_text(self.tokenizer.apply_chat_template(list(c)),
                                                                add_special_tokens=False, name="messages")}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
