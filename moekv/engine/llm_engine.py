"""LLMEngine: requests in, outputs out, one `step()` at a time.

add_request validates everything up front (prompt length, sampling values); step() asks the
scheduler what to run, lets the model runner run it, then appends tokens, detokenizes, and
checks stop conditions. Every accepted request ends finished, aborted or failed, and its pages
go back to the pool in each case.
"""
from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moekv.config import EngineConfig
from moekv.engine.block_manager import BlockManager
from moekv.engine.model_runner import PendingStep, start_runner
from moekv.engine.scheduler import Scheduler
from moekv.engine.sequence import OUTPUT_KINDS, Sequence
from moekv.engine.structured_output import GrammarCompiler
from moekv.models.loader import load_model_config, read_json
from moekv.models.tokenizer import IncrementalDetokenizer, NoTokenizer, Tokenizer, check_text
from moekv.outputs import CompletionOutput, RequestMetrics, RequestOutput
from moekv.sampling_params import SamplingParams

CALIBRATION_TOKENS = 8192  # of quantization_calibration's text (GPTQ rounding of int4 weights)

log = logging.getLogger("moekv")

PromptType = str | dict[str, Any] | list[int]


class PromptTooLongError(ValueError):
    pass


@dataclass
class EngineStats:
    """One snapshot of the engine's figures (LLMEngine.stats()); counters count since start."""

    prompt_tokens: int  # prompt tokens of accepted requests
    generation_tokens: int
    num_preemptions: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # share of KV pages allocated (1 = full)
    kv_pages_used: int
    # the KV cache's configuration
    kv_cache_dtype: str  # the format in use ('auto' resolved to the model's dtype: bf16, fp16 or fp32)
    block_size: int
    num_blocks: int
    bits_per_element: float  # stored bits per element of a full page, side tables included
    # read from the device (None / empty when not asked for, or not counted)
    routing_locality: float | None = None  # with a cluster map: share of assignments on the top-1 expert's device
    routing_fan_out: float | None = None  # ... and mean devices a token's experts occupy
    kv_format: dict[str, float] = field(default_factory=dict)  # the KV format's own figures (KVFormat.run_statistics)
    # prefix caching (vLLM's counters, in tokens): prompt tokens looked up, and of those found cached
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # expert offload's counters (ExpertOffload.stats: hits, misses, bytes, prediction_recall, ...); empty without
    expert_offload: dict = field(default_factory=dict)
    # expert parallel: bytes the ranks sent (and received) dispatching tokens to experts and back, all ranks
    ep_bytes_sent: int | None = None
    ep_bytes_received: int | None = None
    # the weights: their quantization ('fp8', 'int4'; None: 16/32-bit) and rank 0's bytes of them
    weight_quantization: str | None = None
    weight_bytes: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = Path(config.model)
        self.model_config = load_model_config(model_dir)
        self.tokenizer = NoTokenizer() if config.skip_tokenizer_init else Tokenizer(config.tokenizer or model_dir)
        gen_path = model_dir / "generation_config.json"
        self.generation_config = read_json(gen_path, "generation_config.json") if gen_path.is_file() else {}
        limit = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                             f"max_position_embeddings={limit}; accepted: 2..{limit}")
        self.max_model_len = config.max_model_len or limit
        self.runner = start_runner(config, self.model_config, self.max_model_len)
        # the prefix cache's chain root: what besides the tokens decides a page's bytes
        salt = repr((str(model_dir.resolve()), str(self.runner.dtype), config.cache.kv_cache_dtype,
                     sorted((k, str(v)) for k, v in config.kv_format_options().items()))).encode()
        self.block_manager = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                          enable_prefix_caching=config.cache.enable_prefix_caching, cache_salt=salt)
        self.scheduler = Scheduler(self.block_manager, config.scheduler.max_num_seqs,
                                   config.scheduler.max_num_batched_tokens)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        gen_eos = self.generation_config.get("eos_token_id")
        self.eos_token_ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._seqs: dict[str, Sequence] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._counter = itertools.count()
        # async scheduling: the step queued ahead, whose outputs the next step() call returns
        self.async_scheduling = config.async_scheduling_enabled
        self._inflight = None
        self.num_follow_on_steps = 0  # steps queued ahead of the host (async scheduling)
        self.num_dropped_steps = 0  # ... of which every sequence had stopped before it was read
        self._prompt_tokens = 0  # of accepted requests, since start
        self._generation_tokens = 0
        cfg = self.model_config
        self.grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size, sorted(self.eos_token_ids))
        self.kv_bits_per_element = self.runner.kv_format.bits_per_element(cfg.num_kv_heads, self.runner.block_size,
                                                                          cfg.head_dim)
        self.calibration_stats = None  # quantization_calibration's GPTQ (models/gptq.BlockwiseStats)
        if config.quantization_calibration is not None:
            self._calibrate_weights(Path(config.quantization_calibration), salt)

    def _calibrate_weights(self, text: Path, salt: bytes) -> None:
        """GPTQ rounding of the int4 weights (ModelRunner.start_weight_calibration): the text's first
        CALIBRATION_TOKENS tokens run through the engine as prompts of up to 512 tokens (prefill),
        the runner recording each step; then it rounds the model one decoder layer at a time on the
        recorded steps (models/gptq.round_blockwise: each expert on its routed inputs, the attention
        projections and, last, the LM head on theirs). Pages, prefix cache and counters start afresh after."""
        ids = self.tokenizer.encode(text.read_text(encoding="utf-8"))[:CALIBRATION_TOKENS]
        chunk = min(512, self.max_model_len - 1)
        prompts = [ids[i:i + chunk] for i in range(0, len(ids), chunk) if len(ids[i:i + chunk]) > 1]
        if not prompts:
            raise ValueError(f"quantization_calibration={str(text)!r} holds no text to calibrate on")
        self.runner.start_weight_calibration()
        done = False
        try:
            for prompt in prompts:
                self.add_sequence(self.make_sequence({"prompt_token_ids": prompt},
                                                     SamplingParams(max_tokens=1, temperature=0.0)))
            while self.has_unfinished_requests():
                self.step()
            done = True
        finally:
            self.calibration_stats = self.runner.finish_weight_calibration(round_weights=done)
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.cache.block_size,
                                          enable_prefix_caching=self.config.cache.enable_prefix_caching,
                                          cache_salt=salt)
        self.scheduler = Scheduler(self.block_manager, self.config.scheduler.max_num_seqs,
                                   self.config.scheduler.max_num_batched_tokens)
        self._prompt_tokens = self._generation_tokens = 0

    # -- requests ----------------------------------------------------------------------------
    def generation_defaults(self) -> dict[str, Any]:
        """The SamplingParams fields the checkpoint's generation_config.json sets (do_sample false:
        temperature 0), by SamplingParams' names; fields it does not name are left out."""
        g = self.generation_config
        kwargs: dict[str, Any] = {}
        if g.get("do_sample") is False:
            kwargs["temperature"] = 0.0
        for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                         ("repetition_penalty", "repetition_penalty"), ("max_new_tokens", "max_tokens")):
            if g.get(src) is not None and dst not in kwargs:
                kwargs[dst] = g[src]
        return kwargs

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams seeded from the checkpoint's generation_config.json, as vLLM does."""
        return SamplingParams(**self.generation_defaults())

    def encode_text(self, text: str, add_special_tokens: bool = True, name: str = "prompt") -> list[int]:
        """Token ids of a text prompt. Refused before tokenizing (ValueError naming `name`): invalid
        Unicode, and a text too long to fit max_model_len however it tokenizes (tokenizing it would
        cost seconds for nothing)."""
        if not isinstance(text, str):
            raise TypeError(f"{name} must be a str, got {type(text).__name__}")
        check_text(text, name)
        bound = self.tokenizer.max_chars_per_token
        if bound is not None and len(text) > bound * self.max_model_len:
            raise PromptTooLongError(
                f"the {name} has {len(text)} characters: at least {math.ceil(len(text) / bound)} tokens (a token of "
                f"this tokenizer covers at most {bound:g} characters), more than max_model_len={self.max_model_len}")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.encode_text(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
            elif "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self.encode_text(prompt["prompt"])
            else:
                raise ValueError("a prompt dict needs 'prompt_token_ids' (list of ints) or 'prompt' (string)")
        else:
            ids = prompt
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids holds ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        return None, list(ids)

    def make_sequence(self, prompt: PromptType, params: SamplingParams | None,
                      request_id: str | None = None, scoring: bool = False) -> Sequence:
        """Validate one request and build its Sequence, without queueing it.

        scoring: the request only wants its prompt's logits, so the prompt may fill max_model_len.
        """
        params = params or self.default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        if params.stop_strings and self.config.skip_tokenizer_init:
            raise ValueError("stop strings need the tokenizer (outputs have no text under skip_tokenizer_init=True); "
                             "use stop_token_ids")
        if params.structured_outputs is not None and self.config.skip_tokenizer_init:
            raise ValueError("structured outputs need the tokenizer (their grammar is over its tokens); "
                             "leave skip_tokenizer_init off")
        text, ids = self.tokenize_prompt(prompt)
        if not ids:
            raise ValueError("the prompt is empty (0 tokens); give at least one token")
        if scoring and len(ids) > self.max_model_len:
            raise PromptTooLongError(f"the prompt has {len(ids)} tokens; accepted: at most "
                                     f"max_model_len={self.max_model_len}")
        if not scoring and len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens but max_model_len={self.max_model_len} leaves no room to "
                f"generate; accepted: at most {self.max_model_len - 1} prompt tokens")
        room = max(1, self.max_model_len - len(ids))
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        request_id = str(next(self._counter)) if request_id is None else request_id
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        seq = Sequence(request_id=request_id, prompt_token_ids=ids, sampling_params=params,
                       max_tokens=max_tokens, prompt=text)
        if params.structured_outputs is not None:  # StructuredOutputsError (a ValueError) if it cannot compile
            seq.grammar = self.grammars.state_for(params.structured_outputs)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # position 0 has nothing before it
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        if seq.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"Sequence.output_kind={seq.output_kind!r} is not one of {OUTPUT_KINDS}")
        self._seqs[seq.request_id] = seq
        self._detokenizers[seq.request_id] = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, seq.sampling_params.skip_special_tokens)
        self.scheduler.add(seq)
        self._prompt_tokens += seq.num_prompt_tokens

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    output_kind: str = "cumulative") -> str:
        """Queue a request; output_kind: what its outputs carry while it runs (sequence.OUTPUT_KINDS)."""
        seq = self.make_sequence(prompt, params, request_id)
        seq.output_kind = output_kind
        self.add_sequence(seq)
        return seq.request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self._seqs.get(request_id)
        if seq is None or seq.is_finished:
            return None
        self._finish(seq, "abort")
        # the text held back while it could still grow into a stop string goes out with the abort
        return self._output(seq, self._emit(seq), [])

    def shutdown(self) -> None:
        """Stop the worker processes of a tensor-parallel engine (nothing to do with one process)."""
        self.runner.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_steps_in_flight(self) -> int:
        """Steps queued on the device whose outputs the next step() call returns (async scheduling: 0 or 1)."""
        return int(self._inflight is not None)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def stats(self, device: bool = True) -> EngineStats:
        """The engine's figures now. device: also the figures kept on the device or in the KV pools
        (routing locality and fan-out when a cluster map is configured, the KV format's own figures):
        reading them waits for the device, so a caller on the stepping thread leaves them out."""
        runner, bm = self.runner, self.block_manager
        snapshot = EngineStats(
            prompt_tokens=self._prompt_tokens, generation_tokens=self._generation_tokens,
            num_preemptions=self.scheduler.num_preemptions, num_running=self.num_running,
            num_waiting=self.num_waiting, kv_cache_usage=bm.usage, kv_pages_used=bm.num_used_blocks,
            kv_cache_dtype=runner.kv_format.name, block_size=runner.block_size, num_blocks=runner.num_blocks,
            bits_per_element=self.kv_bits_per_element,
            prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
            weight_quantization=runner.quantization, weight_bytes=runner.weight_bytes)
        if device:
            if runner.locality is not None:
                routing = runner.locality.snapshot()
                snapshot.routing_locality, snapshot.routing_fan_out = routing["locality"], routing["fan_out"]
            snapshot.kv_format = runner.kv_format.run_statistics(runner.kv_caches)
            if runner.experts is not None:
                snapshot.expert_offload = runner.experts.stats()
            ep = runner.expert_parallel_bytes()
            if ep is not None:
                snapshot.ep_bytes_sent = sum(v[0] for v in ep.values())
                snapshot.ep_bytes_received = sum(v[1] for v in ep.values())
        return snapshot

    # -- stepping ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step and return its outputs.

        With async scheduling a decode step is queued on the device before the host has read the
        step before it (`_follow_on`): each call returns the outputs of the step it waited for
        and leaves the next one running, so the host's work (outputs, detokenizing, stop checks,
        the next step's inputs) overlaps the device's. A sequence that stops on a token the host
        had not yet seen has had one token too many computed; that token is dropped.
        """
        pending = self._take_inflight()
        if pending is None:
            out = self.scheduler.schedule()
            if out.is_empty():
                return []
            blocked = {item.seq.request_id: self._blocked_ids(item.seq) for item in out.scheduled}
            try:
                self.runner.release_pages(self.block_manager.drain_freed())  # (on every rank: it may fail too)
                pending = self.runner.launch(out, blocked)
            except Exception as e:  # a fault fails the step's requests; nothing is left holding pages
                return self._fail_step([item.seq for item in out.scheduled], e)
            self.scheduler.on_step_done(out)
        follow_on = self._follow_on(pending) if self.async_scheduling else None
        try:
            results = pending.wait()
        except Exception as e:
            self._inflight = follow_on  # its sequences fail here too: it is dropped unread
            return self._fail_step([r.seq for r in pending.results], e)
        self._inflight = follow_on
        now = time.monotonic()
        outputs = []
        for result in results:
            seq = result.seq
            if seq.is_finished:  # a follow-on step's row for a sequence that stopped (or was aborted) meanwhile
                continue
            seq.prompt_logprobs.extend(result.prompt_logprobs)
            if result.prompt_logits is not None:
                seq.prompt_logits.append(result.prompt_logits)
            if result.sample is None:
                continue
            delta_text = self._append_token(seq, result.sample, now)
            if seq.output_kind != "final" or seq.is_finished:
                outputs.append(self._output(seq, delta_text, [result.sample.token_id]))
        return outputs

    def _take_inflight(self) -> PendingStep | None:
        """The step left running by the last call, unless none of its sequences is still live
        (stopped or aborted meanwhile: then its work is dropped unread)."""
        pending, self._inflight = self._inflight, None
        if pending is not None and all(r.seq.is_finished for r in pending.results):
            self.num_dropped_steps += 1
            return None
        return pending

    def _follow_on(self, prev: PendingStep) -> PendingStep | None:
        """Queue the next decode step while `prev` still runs, when it is the step the scheduler
        would choose anyway: prev's live sequences are all that run, each sampled in prev, no
        request waits to be admitted, and their next tokens fit the pool without preemption.
        Sequences that reach max_tokens with prev's token are left out; penalties (which read the
        tokens so far on the host) keep the engine synchronous. A grammar sequence follows on too:
        its bitmask waits for prev's token on the host after the follow-on's forward is queued
        (model_runner.follow_grammars)."""
        if not prev.followable or self.scheduler.waiting:
            return None
        live = [r.seq for r in prev.results if not r.seq.is_finished]
        running = self.scheduler.running
        if len(live) != len(running) or any(a is not b for a, b in zip(live, running)):
            return None
        seqs = [seq for seq in live if len(seq.output_token_ids) + 1 < seq.max_tokens]
        if not seqs or len(seqs) > self.scheduler.max_num_batched_tokens:
            return None
        if any(seq.sampling_params.has_penalties or seq.decode_from is not None or seq.prompt_logits is not None
               for seq in seqs):
            return None
        self.runner.release_pages(self.block_manager.drain_freed())  # before a freed page is reused
        for seq in seqs:  # prev's token is at position num_tokens: room for num_tokens + 1
            if not self.block_manager.allocate(seq, seq.num_tokens + 1):
                return None
        self.runner.release_pages(self.block_manager.drain_freed())  # cached pages evicted for these
        blocked = {seq.request_id: self._blocked_ids(seq, pending=1) for seq in seqs}
        try:
            follow_on = self.runner.launch_follow_on(prev, seqs, blocked)
        except Exception:  # the next step runs the ordinary way (and reports its own failure)
            log.exception("queueing the next decode step ahead failed; this step runs synchronously")
            return None
        for seq in seqs:  # (its num_tokens catches up when prev's token is appended)
            seq.num_computed_tokens += 1
        self.num_follow_on_steps += 1
        return follow_on

    def _fail_step(self, seqs: list[Sequence], e: Exception) -> list[RequestOutput]:
        log.error("model step failed", exc_info=e)
        outputs = []
        for seq in seqs:
            if not seq.is_finished:
                self.block_manager.forget(seq)  # what the failed step wrote is not served to others
                self._finish(seq, "error")
                outputs.append(self._output(seq, "", [], error=f"{type(e).__name__}: {e}"))
        return outputs

    def _blocked_ids(self, seq: Sequence, pending: int = 0) -> list[int]:
        """Tokens seq may not sample next (min_tokens); pending: its tokens sampled but not yet appended."""
        p = seq.sampling_params
        if len(seq.output_token_ids) + pending >= p.min_tokens:
            return []
        return list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos_token_ids))

    def _append_token(self, seq: Sequence, sampled, now: float) -> str:
        p = seq.sampling_params
        token = sampled.token_id
        seq.output_token_ids.append(token)
        seq.cumulative_logprob += sampled.logprob
        if p.logprobs is not None:
            seq.output_logprobs.append(sampled.top_logprobs)
        seq.first_token_time = seq.first_token_time or now
        seq.last_token_time = now
        self._generation_tokens += 1

        if seq.grammar is not None and not seq.grammar.accept_at(len(seq.output_token_ids) - 1, token):
            # the bitmask allowed only tokens the grammar takes: this is a bug, reported as the request's error
            log.error("request %s sampled token %d outside its grammar", seq.request_id, token)
            self._finish(seq, "error")
            return self._emit(seq)
        if token in p.stop_token_ids:
            self._finish(seq, "stop", stop_reason=token)
            return self._emit(seq)
        if token in self.eos_token_ids and not p.ignore_eos:
            self._finish(seq, "stop")
            return self._emit(seq)
        delta = self._detokenizers[seq.request_id].add(token)
        old_len = len(seq.output_text)
        seq.output_text += delta
        if p.stop_strings and delta:
            hit = self._find_stop_string(seq, old_len)
            if hit is not None:
                cut, stop = hit
                seq.output_text = seq.output_text[:cut]
                self._finish(seq, "stop", stop_reason=stop)
                return self._emit(seq)
        if seq.grammar is not None and seq.grammar.is_terminated:
            self._finish(seq, "stop")
        elif len(seq.output_token_ids) >= seq.max_tokens:
            self._finish(seq, "length")
        return self._emit(seq)

    @staticmethod
    def _emit(seq: Sequence) -> str:
        """The text to stream now: everything new, except (while the sequence runs) a tail that
        could still grow into a stop string, so a stop string never reaches a stream in part."""
        end = len(seq.output_text)
        if not seq.is_finished:
            for stop in seq.sampling_params.stop_strings:
                for n in range(min(len(stop) - 1, end), 0, -1):
                    if seq.output_text.endswith(stop[:n]):
                        end = min(end, len(seq.output_text) - n)
                        break
        end = max(end, seq.streamed_text_len)
        delta = seq.output_text[seq.streamed_text_len:end]
        seq.streamed_text_len = end
        return delta

    @staticmethod
    def _find_stop_string(seq: Sequence, old_len: int) -> tuple[int, str] | None:
        """Earliest stop string that ends in the new text -> (where the text is cut, which string)."""
        p = seq.sampling_params
        best = None
        for stop in p.stop_strings:
            start = max(0, old_len - len(stop) + 1)
            idx = seq.output_text.find(stop, start)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        return (idx + len(stop) if p.include_stop_str_in_output else idx), stop

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        self.scheduler.finish(seq, reason)
        seq.stop_reason = stop_reason
        seq.finished_time = time.monotonic()
        self.runner.release(seq)
        self._seqs.pop(seq.request_id, None)
        self._detokenizers.pop(seq.request_id, None)

    def _output(self, seq: Sequence, delta_text: str, delta_ids: list[int], error: str | None = None) -> RequestOutput:
        p = seq.sampling_params
        if seq.output_kind == "delta" and not seq.is_finished:  # this step's part only: O(1), not O(length)
            text, token_ids = delta_text, list(delta_ids)
            logprobs = (seq.output_logprobs[len(seq.output_logprobs) - len(delta_ids):]
                        if p.logprobs is not None else None)
        else:
            text, token_ids = seq.output_text, list(seq.output_token_ids)
            logprobs = list(seq.output_logprobs) if p.logprobs is not None else None
        completion = CompletionOutput(
            index=0, text=text, token_ids=token_ids,
            cumulative_logprob=seq.cumulative_logprob if p.logprobs is not None else None,
            logprobs=logprobs, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
        metrics = RequestMetrics(arrival_time=seq.arrival_time, first_scheduled_time=seq.first_scheduled_time,
                                 first_token_time=seq.first_token_time, last_token_time=seq.last_token_time,
                                 finished_time=seq.finished_time)
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
            outputs=[completion], finished=seq.is_finished,
            prompt_logprobs=list(seq.prompt_logprobs) if p.prompt_logprobs is not None else None,
            metrics=metrics, num_preemptions=seq.num_preemptions, delta_text=delta_text,
            delta_token_ids=delta_ids, error=error, num_cached_tokens=seq.num_cached_tokens)
