"""Prefix caching: shared prompt pages give the same tokens as computing them, the counters count
tokens as vLLM does, and no page is leaked, double-owned or served with stale contents."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from moekv import LLM, SamplingParams
from moekv.config import default_model_path
from moekv.engine.block_manager import BlockManager, chain_hashes
from moekv.engine.llm_engine import LLMEngine
from moekv.engine.scheduler import Scheduler
from moekv.engine.sequence import Sequence
from moekv.kvcache.formats import compressed_formats
from moekv.layers.attention import Attention
from tests.kv_formats import formats_sharing_pages

SYSTEM = "You are a helpful assistant. Answer briefly and truthfully, in plain words. " * 3
TURNS = ["What is the capital of France?", "Name three colors.", "Count to five.", "Who wrote Hamlet?"]


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> str:
    """vq codebooks and nuq2 centroids of the shipped model's shape (4 layers, 2 KV heads, head_dim 128),
    fitted on Gaussian pages: any tables do, each test compares runs that read the same ones."""
    import torch
    from safetensors.torch import load_file, save_file

    from moekv.kvcache.formats.nuq2 import fit_centroids
    from moekv.kvcache.formats.vq import random_calibration
    from moekv.models.loader import load_model_config

    cfg = load_model_config(default_model_path())
    folder = random_calibration(tmp_path_factory.mktemp("calibration"), cfg.num_kv_heads, cfg.head_dim,
                                num_layers=cfg.num_layers, iters=1, max_vectors=256)
    tables = load_file(str(folder / "kv_calibration.safetensors"))
    pages = torch.randn(4, cfg.num_kv_heads, 64, cfg.head_dim, generator=torch.Generator().manual_seed(0))
    for layer in range(cfg.num_layers):
        for kind in ("key", "value"):
            tables[f"nuq2.layer{layer}.{kind}.centroids"] = fit_centroids(pages, kind).contiguous()
    save_file(tables, str(folder / "kv_calibration.safetensors"))
    return str(folder)


def calibrated(fmt: str, kwargs: dict, calibration: str) -> dict:
    """kwargs with the calibration folder for the formats that read one (nuq2: its calibrated codebooks)."""
    return dict(kwargs, kv_calibration=calibration) if fmt in ("nuq2", "vq") else kwargs


PROMPTS = [SYSTEM + turn for turn in TURNS] + [SYSTEM + TURNS[0]]


def read_prompts_through_the_cache(llm: LLM) -> None:
    """Every attention layer reads a prefill chunk's own tokens back from the cache, as decode does
    (LayerHooks.exact_prefill): outputs then do not depend on where chunks or a cached prefix end."""
    for module in llm.engine.runner.model.modules():
        if isinstance(module, Attention):
            module.hooks.exact_prefill = False


def run_scenario(fmt: str, enable: bool, max_tokens: int = 6, through_cache: bool = False,
                 **kwargs) -> tuple[dict[str, list[int]], LLMEngine, dict[str, int]]:
    """One request alone; two more once it finished; a fourth arriving while those two run; a fifth
    equal to the first. Greedy; returns each request's tokens, the engine and each request's cached
    prompt tokens. through_cache: read_prompts_through_the_cache."""
    kwargs = {"max_model_len": 256, "max_num_seqs": 4, **kwargs}
    llm = LLM(dtype="float32", kv_cache_dtype=fmt, enable_prefix_caching=enable, **kwargs)
    if through_cache:
        read_prompts_through_the_cache(llm)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = PROMPTS
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}

    def drain(until_finished: int | None = None) -> None:
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.error is None
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
                    cached[out.request_id] = out.num_cached_tokens
            steps += 1
            if until_finished is not None and steps == until_finished:
                return

    engine.add_request("r0", prompts[0], params)
    drain()
    engine.add_request("r1", prompts[1], params)
    engine.add_request("r2", prompts[2], params)
    drain(until_finished=2)  # r1 and r2 prefilled (and decoding), their pages indexed
    engine.add_request("r3", prompts[3], params)
    engine.add_request("r4", prompts[4], params)
    drain()
    engine.block_manager.check_invariants([])  # every page free or cached, none owned
    return tokens, engine, cached


# formats whose pages can be shared (the registry's, filtered); kivi2 only without its per-sequence
# residual window; the compressed ones on pages of 32 tokens, so that the prompts fill some
SHAREABLE = [(name, {**({"block_size": 32} if name in compressed_formats() else {}), **kwargs})
             for name, kwargs in formats_sharing_pages()]


@pytest.mark.slow
@pytest.mark.parametrize("fmt, kwargs", SHAREABLE, ids=[f for f, _ in SHAREABLE])
def test_greedy_outputs_identical_with_and_without_prefix_caching(fmt, kwargs, calibration):
    """Same tokens for every request, with pages really shared (hits > 0) only in the cached run, as
    long as both runs read prompts through the cache: then every read of the shared pages is checked."""
    kwargs = calibrated(fmt, kwargs, calibration)
    want, plain, _ = run_scenario(fmt, False, through_cache=True, **kwargs)
    got, cached, _ = run_scenario(fmt, True, through_cache=True, **kwargs)
    assert got == want
    assert plain.stats().prefix_cache_hits == 0 and plain.stats().prefix_cache_queries == 0
    assert cached.stats().prefix_cache_hits > 0


@pytest.mark.parametrize("fmt, kwargs", SHAREABLE, ids=[f for f, _ in SHAREABLE])
def test_a_cached_prefix_reads_as_an_earlier_prefill_chunk(fmt, kwargs, calibration):
    """A prefill chunk attends to its own tokens as computed and to earlier ones as the cache holds
    them, so a request starting from cached pages gives the tokens of computing its prompt alone in
    two chunks split where those pages end (a token budget of that many tokens), not of one chunk."""
    kwargs = calibrated(fmt, kwargs, calibration)
    got, cached, hits = run_scenario(fmt, True, **kwargs)
    assert cached.stats().prefix_cache_hits > 0 and any(hits.values())
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engines: dict[int, LLM] = {}
    for i, prompt in enumerate(PROMPTS):
        split = hits[f"r{i}"]
        if split not in engines:
            budget = {"max_num_batched_tokens": split} if split else {}
            engines[split] = LLM(dtype="float32", kv_cache_dtype=fmt, max_model_len=256, max_num_seqs=4,
                                 **budget, **kwargs)
        ids = engines[split].engine.encode_text(prompt)
        assert split == 0 or len(ids) - split <= split  # the rest in one chunk
        want = engines[split].generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
        assert got[f"r{i}"] == want, f"r{i} (cached {split})"


@pytest.mark.parametrize("fmt, kwargs, same_tokens", [("fp32", {}, True), ("int4", {"block_size": 16}, True),
                                                      ("nuq2", {"block_size": 16, "kv_residual": 0}, False)])
@pytest.mark.slow
def test_chunked_prefill_and_preemption_with_prefix_caching(fmt, kwargs, same_tokens, calibration):
    """A small token budget (prefill chunks after the cached pages) and a pool too small for every
    request at once (preemptions, evictions): still the tokens of the uncached run, every page back.
    Chunks end in different places in the two runs, so both read prompts through the cache.

    nuq2: every page back, not the same tokens. A preempted sequence's recompute (and a prompt's
    remainder after cache hits) computes its keys and values in other chunk shapes, equal only to
    float rounding (fp32 logprobs within 3e-6 of the uncached run's here), and nuq2's per-page fit
    (k-means, outlier slots) can turn such a difference into another code: on the shipped model (and
    on the 512-token one before it, at other token budgets) preemption alone, without prefix
    caching, changes nuq2's greedy tokens."""
    kwargs = dict(calibrated(fmt, kwargs, calibration), max_num_batched_tokens=40, max_model_len=96, num_kv_blocks=7)
    want, plain, _ = run_scenario(fmt, False, max_tokens=12, through_cache=True, **kwargs)
    got, engine, _ = run_scenario(fmt, True, max_tokens=12, through_cache=True, **kwargs)
    lengths = {r: len(t) for r, t in got.items()}
    assert got == want if same_tokens else lengths == {r: len(t) for r, t in want.items()} == dict.fromkeys(want, 12)
    assert engine.stats().prefix_cache_hits > 0
    assert plain.stats().num_preemptions > 0 and engine.stats().num_preemptions > 0


def test_hit_counters_count_tokens_as_vllm():
    """queries: prompt tokens of each admitted request; hits: its tokens read from the cache, whole
    pages of the longest common prefix with what was computed before, leaving one token to compute."""
    bs = 16
    llm = LLM(dtype="float32", enable_prefix_caching=True, block_size=bs, max_model_len=256)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    base = [(11 * j) % 300 + 5 for j in range(70)]
    a = base[:50]  # 3 full pages, indexed once computed
    b = base[:40] + [1, 2, 3, 4, 5]  # shares 40 tokens with a: 2 full pages
    c = base[:48]  # all 3 of its pages are a's, but one token must be computed: 2 pages
    d = [9] * 20  # nothing in common
    expected_hits = 0
    expected_queries = 0
    for prompt, hit_pages in ((a, 0), (b, 2), (c, 2), (d, 0), (a, 3)):
        out = llm.generate({"prompt_token_ids": prompt}, params)[0]
        assert out.num_cached_tokens == hit_pages * bs
        expected_queries += len(prompt)
        expected_hits += hit_pages * bs
        stats = engine.stats()
        assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (expected_queries, expected_hits)


def test_requests_wanting_every_prompt_position_do_not_read_the_cache():
    """prompt_logprobs need a row for every prompt position: such a request computes them all
    (no hit counted), and its logprobs equal those of an engine without prefix caching."""
    prompt = {"prompt_token_ids": [(7 * j) % 200 + 3 for j in range(40)]}
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    want = LLM(dtype="float32", block_size=16, max_model_len=128).generate(prompt, params)[0].prompt_logprobs
    llm = LLM(dtype="float32", block_size=16, max_model_len=128, enable_prefix_caching=True)
    llm.generate(prompt, SamplingParams(max_tokens=1))  # caches its pages
    hits = llm.engine.stats().prefix_cache_hits
    got = llm.generate(prompt, params)[0].prompt_logprobs
    assert llm.engine.stats().prefix_cache_hits == hits
    assert len(got) == len(want) == 40
    for g, w in zip(got[1:], want[1:]):
        assert g.keys() == w.keys()
        for k in g:
            assert g[k] == pytest.approx(w[k], abs=1e-4)


@pytest.mark.parametrize("fmt, kwargs, match", [
    ("tiered", {}, "re-ranking rewrites"),
    ("kivi2", {"block_size": 32}, "residual window"),
])
def test_formats_whose_pages_cannot_be_shared_are_refused(fmt, kwargs, match):
    """tiered rewrites written pages; kivi2 keeps a per-sequence 16-bit window: a clear error each."""
    expected = f"enable_prefix_caching=True does not work with kv_cache_dtype='{fmt}'.*{match}"
    with pytest.raises(ValueError, match=expected):
        LLM(dtype="float32", kv_cache_dtype=fmt, enable_prefix_caching=True, max_model_len=128, **kwargs)


def test_enable_prefix_caching_must_be_a_bool():
    from moekv import EngineConfig

    with pytest.raises(ValueError, match="enable_prefix_caching='yes' must be True or False"):
        EngineConfig(enable_prefix_caching="yes")


def test_prefix_cache_counters_in_metrics():
    """/metrics exports moekv:prefix_cache_queries_total and _hits_total, in tokens."""
    from pathlib import Path

    import httpx

    from tests.server_harness import ServerThread, scrape

    model = Path(__file__).resolve().parent.parent / "models" / "domain-moe"
    ids = [(5 * j) % 250 + 7 for j in range(40)]
    with ServerThread(model, enable_prefix_caching=True, block_size=16, max_model_len=128) as srv:
        for prompt in (ids, ids[:35] + [1, 2, 3]):
            r = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2},
                           timeout=60)
            assert r.status_code == 200, r.text
        values = scrape(srv.url)
    assert values["moekv:prefix_cache_queries_total"] == 40 + 38
    assert values["moekv:prefix_cache_hits_total"] == 32  # the second prompt: 2 full pages of 16


# -- chained hashes ------------------------------------------------------------------------------

def test_chain_hash_depends_on_every_earlier_token_and_the_root():
    """A page's hash names its whole prefix: the same page after a different first page, or under
    another root (another KV format, say), hashes differently; equal prefixes hash equally."""
    root, other = b"a" * 32, b"b" * 32
    x = chain_hashes(root, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(x) == 2  # only full pages
    assert chain_hashes(root, [1, 2, 3, 4, 5, 6, 7, 8], 4) == x
    y = chain_hashes(root, [0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert y[0] != x[0] and y[1] != x[1]
    assert chain_hashes(other, [1, 2, 3, 4, 5, 6, 7, 8], 4)[0] != x[0]


# -- block manager: a state machine with a shadow of every page's contents ------------------------

@dataclass(eq=False)
class PSeq:
    prompt_token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    page_hashes: list[bytes] = field(default_factory=list)
    num_computed: int = 0
    num_extra: int = 0  # tokens appended after the prompt (decode)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + [1000 + i for i in range(self.num_extra)]


class PrefixMachine(RuleBasedStateMachine):
    """Admissions with shared prefixes (from a cached prefix, all or nothing), prefill of what is left,
    appends, finishes, aborts and preemptions, over a small pool. A shadow records what each page
    holds ((position, token) per slot), written when a sequence computes tokens and wiped when the
    pool hands a page out afresh: a sequence taking cached pages must find its own tokens in them."""

    @initialize(num_blocks=st.integers(4, 20), block_size=st.integers(1, 4))
    def setup(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
        self.live: list[PSeq] = []
        self.shadow: dict[int, dict[int, tuple[int, int]]] = {}  # page -> offset -> (position, token)

    def _wipe_reused(self):
        for page in self.bm.drain_freed():
            self.shadow.pop(page, None)

    def _write(self, seq: PSeq, start: int, end: int):
        bs, toks = self.bm.block_size, seq.tokens
        for p in range(start, end):
            page = seq.block_table[p // bs]
            self.shadow.setdefault(page, {})[p % bs] = (p, toks[p])

    def _check_holds(self, seq: PSeq, upto: int):
        bs, toks = self.bm.block_size, seq.tokens
        for p in range(upto):
            assert self.shadow.get(seq.block_table[p // bs], {}).get(p % bs) == (p, toks[p]), (
                f"position {p}: page {seq.block_table[p // bs]} does not hold the sequence's token")

    @rule(family=st.integers(0, 2), length=st.integers(1, 14), tail=st.integers(0, 3))
    def admit(self, family, length, tail):
        """A new (or preempted) prompt: common prefix of its family, then a distinct tail."""
        prompt = [family * 10 + (j % 3) for j in range(length)] + [500 + tail] * tail
        seq = PSeq(prompt)
        self._admit(seq)

    def _admit(self, seq: PSeq):
        cached = self.bm.find_cached_prefix(seq)
        bs = self.bm.block_size
        assert len(cached) * bs < len(seq.prompt_token_ids)  # at least one token left to compute
        free_before = self.bm.num_free_blocks
        if not self.bm.allocate(seq, len(seq.tokens), cached):
            assert seq.block_table == [] and self.bm.num_free_blocks == free_before
            return
        self._wipe_reused()
        seq.num_computed = len(cached) * bs
        self._check_holds(seq, seq.num_computed)  # the cached pages hold exactly its prefix
        self._write(seq, seq.num_computed, len(seq.tokens))  # prefill of the rest
        self.bm.register_computed(seq, seq.num_computed, len(seq.tokens))
        seq.num_computed = len(seq.tokens)
        self.live.append(seq)
        event(f"hit pages: {min(len(cached), 3)}")

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 6))
    def append(self, data, n):
        seq = data.draw(st.sampled_from(self.live))
        if not self.bm.allocate(seq, len(seq.tokens) + n):
            return
        self._wipe_reused()
        seq.num_extra += n
        self._write(seq, seq.num_computed, len(seq.tokens))
        self.bm.register_computed(seq, seq.num_computed, len(seq.tokens))
        seq.num_computed = len(seq.tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish_or_abort(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        held = len(set(seq.block_table))
        before = self.bm.num_free_blocks
        self.bm.free(seq)
        assert seq.block_table == []
        assert before <= self.bm.num_free_blocks <= before + held

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data):
        """Pages back, then the same sequence admitted again (from whatever is still cached)."""
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.bm.free(seq)
        seq.num_computed = 0
        self._admit(seq)

    @invariant()
    def pages_accounted_and_contents_right(self):
        if not hasattr(self, "bm"):
            return
        self.bm.check_invariants(self.live)
        owned = {p for s in self.live for p in s.block_table}
        assert self.bm.num_used_blocks == len(owned)
        for s in self.live:
            assert len(s.block_table) == len(set(s.block_table)), "a sequence holds a page twice"
            self._check_holds(s, s.num_computed)


PrefixMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestPrefixMachine = PrefixMachine.TestCase


# -- scheduler: random workloads with shared prefixes --------------------------------------------

@st.composite
def workloads(draw):
    block_size = draw(st.integers(1, 6))
    requests = draw(st.lists(st.tuples(st.integers(0, 10), st.integers(0, 2), st.integers(1, 30),
                                       st.integers(0, 4), st.integers(1, 8)), min_size=1, max_size=8))
    need = max(-(-(p + t + m - 1) // block_size) for _, _, p, t, m in requests)
    return dict(block_size=block_size, num_blocks=need + draw(st.sampled_from([0, 1, 3, 30])),
                max_num_seqs=draw(st.integers(1, 5)), budget=draw(st.integers(1, 48)), requests=requests,
                aborts=draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 50)), max_size=2)))


@settings(max_examples=250, deadline=None)
@given(workloads())
def test_scheduler_with_prefix_caching_keeps_pages_right(w):
    """The engine loop without a model: each step writes its tokens into a shadow of the pages; a
    running sequence's pages always hold its computed tokens (cached ones included), pages stay
    accounted for through preemptions and aborts, and everything drains back to free or cached."""
    bs = w["block_size"]
    bm = BlockManager(w["num_blocks"], bs, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=w["max_num_seqs"], max_num_batched_tokens=w["budget"])
    shadow: dict[int, dict[int, tuple[int, int]]] = {}
    pending = sorted(enumerate(w["requests"]), key=lambda r: (r[1][0], r[0]))
    everyone: list[Sequence] = []
    step = 0
    while pending or sched.has_unfinished():
        assert step < 2000, "did not drain"
        while pending and pending[0][1][0] <= step:
            i, (_, family, length, tail, max_tokens) = pending.pop(0)
            prompt = [family * 7 + j % 5 for j in range(length)] + [900 + i] * tail
            seq = Sequence(request_id=f"r{i}", prompt_token_ids=prompt,
                           sampling_params=SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)
            sched.add(seq)
            everyone.append(seq)
        for abort_step, k in w["aborts"]:
            live = sched.live_sequences()
            if abort_step == step and live:
                sched.finish(live[k % len(live)], "abort")
        out = sched.schedule()
        for page in bm.drain_freed():
            shadow.pop(page, None)
        for item in out.scheduled:  # the model writes the scheduled tokens
            s = item.seq
            toks = s.token_ids(0, s.num_tokens)
            for p in range(s.num_computed_tokens):  # what it reads was there already
                assert shadow.get(s.block_table[p // bs], {}).get(p % bs) == (p, toks[p])
            for p in range(s.num_computed_tokens, s.num_computed_tokens + item.num_tokens):
                shadow.setdefault(s.block_table[p // bs], {})[p % bs] = (p, toks[p])
        sched.on_step_done(out)
        for item in out.scheduled:
            s = item.seq
            if s.num_computed_tokens == s.num_tokens:
                s.output_token_ids.append(3)
                if len(s.output_token_ids) >= s.max_tokens:
                    sched.finish(s, "length")
        bm.check_invariants(sched.live_sequences())
        step += 1
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks
    event(f"hits: {bm.prefix_cache_hits > 0}; preempted: {sched.num_preemptions > 0}")
    for s in everyone:
        assert s.is_finished and s.block_table == []
