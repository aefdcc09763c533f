"""Engine behaviour on a tiny Mixtral: batching, preemption, stopping, sampling, logprobs.

Each test runs twice: with the engine synchronous, and with async scheduling (a decode step queued
before the host has read the step before it), which must not change any output."""
from __future__ import annotations

import pytest
import torch

from moekv import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 90, 4, 8, 100, 200, 3, 44, 55, 66, 77, 88, 99, 11, 12, 13, 14, 15, 16],
           [9, 8, 7], [250, 3, 3, 3, 3, 31, 64], [40] * 17, [1, 2]]


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(mixtral_ckpt, request):
    return LLM(mixtral_ckpt, dtype="float32", max_model_len=64, async_scheduling=request.param)


def same_mode(llm) -> dict:
    """Keyword arguments that give another LLM the scheduling mode of `llm`."""
    return {"async_scheduling": llm.engine.async_scheduling}


def assert_pool_empty(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.has_unfinished_requests()


def test_batch_equals_each_prompt_alone(llm):
    """Prompts of different lengths batched together give the tokens each gives alone, in input order."""
    batched = token_ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY))
    alone = [token_ids(llm.generate([{"prompt_token_ids": p}], GREEDY))[0] for p in PROMPTS]
    assert batched == alone
    assert_pool_empty(llm)


def test_preemption_gives_the_same_tokens(mixtral_ckpt, llm):
    """With pages for barely more than one full-length sequence, the scheduler must preempt and
    recompute, and the tokens must not change."""
    reference = token_ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY))
    tight = LLM(mixtral_ckpt, dtype="float32", max_model_len=64, block_size=16, num_kv_blocks=5, **same_mode(llm))
    outs = tight.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert tight.engine.scheduler.num_preemptions > 0
    assert sum(o.num_preemptions for o in outs) == tight.engine.scheduler.num_preemptions
    assert token_ids(outs) == reference
    assert_pool_empty(tight)


def test_seeded_sampling_is_independent_of_batch_and_preemption(mixtral_ckpt, llm):
    sp = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = token_ids(llm.generate([{"prompt_token_ids": PROMPTS[0]}], sp))[0]
    others = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    batch = llm.generate([{"prompt_token_ids": p} for p in (PROMPTS[1], PROMPTS[0], PROMPTS[2])], [others, sp, others])
    assert token_ids(batch)[1] == alone
    assert token_ids(llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 3, sp)) == [alone] * 3
    tight = LLM(mixtral_ckpt, dtype="float32", max_model_len=64, num_kv_blocks=5, **same_mode(llm))
    outs = tight.generate([{"prompt_token_ids": p} for p in [PROMPTS[3], PROMPTS[0], PROMPTS[2]]], sp)
    assert tight.engine.scheduler.num_preemptions > 0
    assert token_ids(outs)[1] == alone


def test_chunked_prefill_equals_whole_prefill(mixtral_ckpt, llm):
    whole = token_ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY))
    chunked = LLM(mixtral_ckpt, dtype="float32", max_model_len=64, max_num_batched_tokens=5, **same_mode(llm))
    assert token_ids(chunked.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)) == whole


def test_max_num_seqs_one_serialises_but_finishes_all(mixtral_ckpt, llm):
    serial = LLM(mixtral_ckpt, dtype="float32", max_model_len=64, max_num_seqs=1, **same_mode(llm))
    assert token_ids(serial.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)) == \
        token_ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY))


def test_generation_stops_at_max_model_len(llm):
    out = llm.generate([{"prompt_token_ids": [7] * 60}], SamplingParams(max_tokens=None, temperature=0.0,
                                                                        ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    assert out.outputs[0].finish_reason == "length"


def test_stop_token_ids_and_eos(llm):
    free = token_ids(llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY))[0]
    stop_at = free[5]
    first = free.index(stop_at)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                       SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert out.outputs[0].token_ids == free[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at
    # the same token as EOS stops too, unless ignore_eos; min_tokens holds it back
    llm.engine.eos_token_ids.add(stop_at)
    try:
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=24, temperature=0.0))[0]
        assert out.outputs[0].token_ids == free[:first + 1] and out.outputs[0].finish_reason == "stop"
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                           SamplingParams(max_tokens=24, temperature=0.0, min_tokens=first + 3))[0]
        assert stop_at not in out.outputs[0].token_ids[:first + 3]
    finally:
        llm.engine.eos_token_ids.discard(stop_at)


def test_stop_strings_cut_the_text(llm):
    free = llm.generate("It was the best", GREEDY)[0].outputs[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    out = llm.generate("It was the best", SamplingParams(max_tokens=24, temperature=0.0, stop=[stop],
                                                         ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[:free.text.index(stop)]
    kept = llm.generate("It was the best", SamplingParams(max_tokens=24, temperature=0.0, stop=stop, ignore_eos=True,
                                                          include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == free.text[:free.text.index(stop) + len(stop)]


def test_logprobs_and_prompt_logprobs(llm):
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                       SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, prompt_logprobs=2,
                                      ignore_eos=True))[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 6
    for tok, lp in zip(comp.token_ids, comp.logprobs):
        assert tok in lp and len(lp) == 3  # greedy token is the top one
        assert lp[tok] == max(lp.values())
    assert comp.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(comp.token_ids, comp.logprobs)))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPTS[0])
    logits = llm.score([{"prompt_token_ids": PROMPTS[0]}])[0]
    ref = torch.log_softmax(logits, -1)
    for pos in range(1, len(PROMPTS[0])):
        target = PROMPTS[0][pos]
        assert out.prompt_logprobs[pos][target] == pytest.approx(ref[pos - 1, target].item(), abs=1e-5)


def test_streaming_deltas_add_up(llm):
    engine = llm.engine
    engine.add_request("s", "It was the best", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    text, ids, final = "", [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.delta_text
            ids += out.delta_token_ids
            final = out
    assert final.finished and text == final.outputs[0].text and ids == final.outputs[0].token_ids


def test_unstreamed_requests_report_only_their_end(llm):
    """output_kind "final" (what LLM.generate sets): step() returns nothing for the request until it
    finishes, then its whole output, equal to a streamed run's."""
    engine = llm.engine
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    engine.add_request("quiet", "It was the best", params, output_kind="final")
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    assert len(seen) == 1 and seen[0].finished and len(seen[0].outputs[0].token_ids) == 9
    engine.add_request("loud", "It was the best", params)
    streamed = []
    while engine.has_unfinished_requests():
        streamed += engine.step()
    assert len(streamed) == 9 and streamed[-1].finished
    assert seen[0].outputs[0].token_ids == streamed[-1].outputs[0].token_ids
    assert seen[0].outputs[0].text == streamed[-1].outputs[0].text


def test_delta_outputs_carry_only_the_step_and_add_up(llm):
    """output_kind "delta" (the server's): a running request's outputs hold the step's token, text and
    logprobs only; they add up to the final output, which holds everything, as a cumulative run's."""
    engine = llm.engine
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    engine.add_request("d", "It was the best", params, output_kind="delta")
    running, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
            else:
                running.append(out)
    assert len(running) == 9 and all(len(o.outputs[0].token_ids) == 1 == len(o.outputs[0].logprobs) for o in running)
    assert all(o.outputs[0].token_ids == o.delta_token_ids and o.outputs[0].text == o.delta_text for o in running)
    ids = [t for o in running for t in o.delta_token_ids] + final.delta_token_ids
    text = "".join(o.delta_text for o in running) + final.delta_text
    assert ids == final.outputs[0].token_ids and text == final.outputs[0].text
    assert [o.outputs[0].logprobs[0] for o in running] == final.outputs[0].logprobs[:9]
    engine.add_request("c", "It was the best", params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            cumulative = out
    assert cumulative.outputs[0].token_ids == final.outputs[0].token_ids
    assert cumulative.outputs[0].logprobs == final.outputs[0].logprobs
    with pytest.raises(ValueError, match="output_kind"):
        engine.add_request("x", "It was", params, output_kind="deltas")
    assert not engine.has_unfinished_requests()


def test_streamed_deltas_never_show_a_stop_string_in_part(llm):
    """Characters that might begin a stop string are held back until the string is ruled out, so
    the deltas add up to the final (cut) text even when the stop string spans tokens."""
    free = llm.generate("It was the best", GREEDY)[0].outputs[0]
    for cut in range(2, min(10, len(free.text) - 3)):
        stop = free.text[cut:cut + 3]
        engine = llm.engine
        engine.add_request("s", "It was the best", SamplingParams(max_tokens=24, temperature=0.0, stop=[stop],
                                                                 ignore_eos=True))
        text, final = "", None
        while engine.has_unfinished_requests():
            for out in engine.step():
                text += out.delta_text
                final = out
        assert final.outputs[0].finish_reason == "stop"
        assert text == final.outputs[0].text == free.text[:free.text.index(stop)], stop


def test_abort_returns_pages(llm):
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
    engine.add_request("b", {"prompt_token_ids": PROMPTS[1]}, GREEDY)
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    aborted = engine.abort_request("a")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert engine.abort_request("a") is None  # already gone
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_empty(llm)


def test_model_fault_fails_requests_and_frees_pages(llm, monkeypatch):
    """A crash inside the model fails the step's requests with a clear error; no page stays allocated."""
    def boom(*args, **kwargs):
        raise RuntimeError("simulated device fault")

    monkeypatch.setattr(llm.engine.runner, "launch", boom)
    with pytest.raises(RuntimeError, match="simulated device fault"):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    monkeypatch.undo()
    assert_pool_empty(llm)


def test_chat_template(llm):
    out = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("user: hello\nassistant:", add_special_tokens=False)


def test_default_sampling_params_follow_generation_config(llm):
    llm.engine.generation_config = {"temperature": 0.7, "top_p": 0.8, "max_new_tokens": 9}
    try:
        sp = llm.get_default_sampling_params()
        assert (sp.temperature, sp.top_p, sp.max_tokens) == (0.7, 0.8, 9)
    finally:
        llm.engine.generation_config = {}


@pytest.mark.parametrize("fmt", ["fp32", "nuq2", "tiered"])
def test_mixed_steps_split_in_two_give_the_same_tokens(hd32_ckpt, fmt, monkeypatch):
    """On CUDA a step with decodes beside prefill chunks attends in two parts (ctx.mixed: the decodes
    through the fused kernel). Forced on the CPU, where both parts take the reference, the split must
    change nothing: same tokens as the unsplit run, with some steps really split."""
    from moekv.context import Context
    from moekv.layers import attention as attention_module
    from moekv.layers.attention import attend_mixed

    kwargs = dict(dtype="float32", max_model_len=128, max_num_seqs=4, kv_cache_dtype=fmt,
                  block_size=16 if fmt == "fp32" else 32, max_num_batched_tokens=24,
                  kv_codebook="auto" if fmt == "fp32" else "page")
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 200 + 1 for j in range(n)]} for i, n in enumerate((5, 40, 70))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(hd32_ckpt, **kwargs).generate(prompts, params)]
    llm = LLM(hd32_ckpt, **kwargs)
    llm.engine.runner.split_mixed_steps = True
    split_steps = []

    def recording(attend, q, cache, ctx: Context, *args):
        if cache is llm.engine.runner.kv_caches[0]:
            split_steps.append((len(ctx.mixed.decode_rows), len(ctx.mixed.prefill_rows)))
        return attend_mixed(attend, q, cache, ctx, *args)

    monkeypatch.setattr(attention_module, "attend_mixed", recording)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert split_steps and all(d >= 1 and p >= 2 for d, p in split_steps)


def test_dummy_load_format_needs_no_weights(mixtral_ckpt, tmp_path):
    """load_format='dummy': a folder with config.json and tokenizer.json only; random finite weights
    (norms 1), generation runs; 'auto' on that folder names the missing weights; a bad value is refused."""
    import shutil

    for name in ("config.json", "tokenizer.json"):
        shutil.copy(mixtral_ckpt / name, tmp_path / name)
    llm = LLM(tmp_path, load_format="dummy", dtype="float32", max_model_len=64)
    model = llm.engine.runner.model
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))
    assert 0.01 < float(model.embed_tokens.detach().std()) < 0.03  # N(0, 0.02)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(tmp_path, dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="load_format='npz'.*accepted"):
        LLM(tmp_path, load_format="npz")


def test_abort_hands_out_the_text_held_back_for_a_stop_string():
    """While a request runs, a tail that could still grow into a stop string is held back from its
    deltas; an abort ends it, so that tail goes out with the abort's output and the deltas add up to
    the final text."""
    from moekv.config import default_model_path

    engine = LLM(str(default_model_path()), dtype="float32", max_model_len=64).engine
    free = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("free", "Once upon a time", free)
    text = ""
    while engine.has_unfinished_requests():
        text = next(o for o in engine.step()).outputs[0].text
    assert text
    stop = text[-1] + "\x00never"  # the last character starts the stop string: held back
    engine.add_request("held", "Once upon a time", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                                  stop=stop), output_kind="delta")
    deltas = []
    for _ in range(6):
        deltas += [o.delta_text for o in engine.step()]
    assert "".join(deltas) == text[:-1]
    aborted = engine.abort_request("held")
    assert aborted.delta_text == text[-1] and aborted.outputs[0].finish_reason == "abort"
    assert "".join(deltas) + aborted.delta_text == aborted.outputs[0].text == text
