"""Prometheus metrics of one server, named like vLLM's (`vllm:` -> `moekv:`), plus moekv's own:
the KV format and its bits per element, the format's own run statistics (tiered: the tier
occupancy and the bits attention read), routing locality and fan-out when the engine has a
cluster map, and the expert cache's hits, misses, host->device bytes and prediction recall when it
offloads experts.

Each server gets its own CollectorRegistry (not prometheus_client's global one), so several
servers can live in one process (tests start more than one). Request timings are observed in
the engine thread as outputs come out of a step; gauges are set after every step from the
engine's host-side figures, and at scrape time from the ones it keeps on the device (routing
locality) or in its KV pools (the format's statistics): everything is read through `engine.stats()`.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from moekv.kvcache.formats import format_class
from moekv.outputs import RequestOutput

# vLLM's buckets, so dashboards built for it read ours the same way
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TOKEN_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]


class ServerMetrics:
    def __init__(self, engine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, m = self.registry, {"model_name": model_name}

        def hist(name, doc, buckets):
            return Histogram(f"moekv:{name}", doc, ["model_name"], registry=r, buckets=buckets).labels(**m)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token (arrival to first token).",
                         TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                        TOKEN_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Per request: (last token - first token) / (output tokens - 1).", TOKEN_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token of finished requests.",
                        REQUEST_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS)

        def gauge(name, doc, labels=()):
            g = Gauge(f"moekv:{name}", doc, ["model_name", *labels], registry=r)
            return g.labels(**m) if not labels else g

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled (incl. preempted).")
        self.kv_usage = gauge("kv_cache_usage_perc", "Share of KV pages allocated (1 = full).")
        self.kv_pages_used = gauge("kv_cache_pages_used", "KV pages allocated to requests.")
        self.kv_bits = gauge("kv_cache_bits_per_element",
                             "Stored bits per cached K/V element of a full page, side tables included.")
        self.kv_info = gauge("kv_cache_config_info", "KV cache configuration (value 1; see labels).",
                             ("kv_cache_dtype", "block_size", "num_blocks", "bits_per_element"))
        self.weight_info = gauge("weight_config_info", "Model weights (value 1; see labels): quantization "
                                 "(fp8, int4, or none) and bytes on rank 0.", ("quantization", "weight_bytes"))
        stats = engine.stats()
        # the KV format's run statistics (KVFormat.run_statistics), one gauge per metric its class
        # declares (statistic_gauges: key -> metric and labels); keys it does not declare go to
        # kv_format_stat{name=<key>}, made when the first one is reported
        by_metric: dict[str, Gauge] = {}
        self._format_gauges: dict[str, tuple[Gauge, dict[str, str]]] = {}
        for key, declared in format_class(stats.kv_cache_dtype).statistic_gauges.items():
            if declared.metric not in by_metric:
                by_metric[declared.metric] = gauge(declared.metric, declared.doc,
                                                   tuple(label for label, _ in declared.labels))
            self._format_gauges[key] = (by_metric[declared.metric], dict(declared.labels))
        self._format_stat: Gauge | None = None
        self._gauge = gauge
        self.locality = self.fan_out = None
        if stats.routing_locality is not None:  # the engine counts routing under its cluster map
            self.locality = gauge(
                "routing_locality", "Share of (token, expert) assignments on the device of the token's top-1 expert "
                "(clustered placement, one cluster per device), since start.")
            self.fan_out = gauge("routing_fan_out", "Mean distinct devices a token's experts occupy, since start.")

        def counter(name, doc, labels=()):
            c = Counter(f"moekv:{name}", doc, ["model_name", *labels], registry=r)
            return c.labels(**m) if not labels else c

        self.expert_recall = None
        if stats.expert_offload:  # the engine offloads experts: its cache and prediction figures
            self.expert_recall = gauge("expert_prediction_recall",
                                       "Share of routed (token, expert) pairs the expert predictor named, since start.")
            self.expert_hits = counter("expert_cache_hits", "Expert lookups served by the on-device expert cache.")
            self.expert_misses = counter("expert_cache_misses", "Expert lookups copied from host memory on demand.")
            self.expert_bytes = counter("expert_host_to_device_bytes",
                                        "Expert weight bytes copied host -> device (prefetch and on demand).")
            self.expert_bytes_per_token = gauge("expert_host_to_device_bytes_per_token",
                                                "Expert weight bytes copied host -> device per token, since start.")
            self._expert_last = {"hits": 0, "misses": 0, "bytes": 0}

        self.preemptions = counter("num_preemptions", "Preemptions (a request lost its pages to recompute).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of accepted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.success = counter("request_success", "Requests ended, by finish reason.", ("finished_reason",))
        self.prefix_queries = counter("prefix_cache_queries", "Prefix caching: prompt tokens looked up (tokens).")
        self.prefix_hits = counter("prefix_cache_hits", "Prefix caching: prompt tokens found cached (tokens).")
        self.ep_sent = self.ep_received = None
        if stats.ep_bytes_sent is not None:  # expert parallel: what the ranks really sent each other
            self.ep_sent = counter("ep_bytes_sent", "Expert parallel: bytes of hidden states and expert outputs "
                                   "the ranks sent each other (dispatch and combine), all ranks, since start.")
            self.ep_received = counter("ep_bytes_received", "Expert parallel: bytes the ranks received, since start.")
            self._ep_last = [0, 0]
        self._model_name = model_name
        self._last = {"num_preemptions": 0, "prompt_tokens": 0, "generation_tokens": 0,
                      "prefix_cache_queries": 0, "prefix_cache_hits": 0}
        self._last_token_time: dict[str, float] = {}  # request id -> time of its latest token

        self.kv_bits.set(stats.bits_per_element)
        self.kv_info.labels(model_name=model_name, kv_cache_dtype=stats.kv_cache_dtype,
                            block_size=str(stats.block_size), num_blocks=str(stats.num_blocks),
                            bits_per_element=f"{stats.bits_per_element:.2f}").set(1)
        self.weight_info.labels(model_name=model_name, quantization=stats.weight_quantization or "none",
                                weight_bytes=str(stats.weight_bytes)).set(1)

    # -- engine thread -----------------------------------------------------------------------
    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            t = out.metrics
            if t is not None and t.last_token_time is not None and out.delta_token_ids:
                prev = self._last_token_time.get(out.request_id)
                if prev is None:
                    self.ttft.observe(t.first_token_time - t.arrival_time)
                    if t.first_scheduled_time is not None:
                        self.queue_time.observe(t.first_scheduled_time - t.arrival_time)
                else:
                    self.itl.observe(t.last_token_time - prev)
                self._last_token_time[out.request_id] = t.last_token_time
            if out.finished:
                self.on_finished(out)

    def on_finished(self, out: RequestOutput) -> None:
        self._last_token_time.pop(out.request_id, None)
        reason = out.outputs[0].finish_reason or "abort"
        self.success.labels(model_name=self._model_name, finished_reason=reason).inc()
        t = out.metrics
        if reason not in ("stop", "length") or t is None or t.finished_time is None:
            return  # aborted and failed requests would skew the latency histograms
        self.e2e.observe(t.finished_time - t.arrival_time)
        n = len(out.outputs[0].token_ids)
        if n > 1 and t.first_token_time is not None:
            self.tpot.observe((t.last_token_time - t.first_token_time) / (n - 1))

    def on_step(self, engine) -> None:
        stats = engine.stats(device=False)  # no wait for the device between steps
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.kv_pages_used.set(stats.kv_pages_used)
        for key, metric in (("num_preemptions", self.preemptions), ("prompt_tokens", self.prompt_tokens),
                            ("generation_tokens", self.generation_tokens),
                            ("prefix_cache_queries", self.prefix_queries), ("prefix_cache_hits", self.prefix_hits)):
            now = getattr(stats, key)
            if now > self._last[key]:
                metric.inc(now - self._last[key])
                self._last[key] = now

    def _format_series(self, key: str):
        """The series of one of the KV format's run statistics: its declared gauge, or kv_format_stat's."""
        if key in self._format_gauges:
            made, labels = self._format_gauges[key]
            return made.labels(model_name=self._model_name, **labels) if labels else made
        if self._format_stat is None:
            self._format_stat = self._gauge("kv_format_stat", "A figure of the KV format's run "
                                            "(KVFormat.run_statistics) it declares no gauge for, by name.", ("name",))
        return self._format_stat.labels(model_name=self._model_name, name=key)

    # -- scrape (event loop) -------------------------------------------------------------------
    def render(self, engine) -> bytes:
        stats = engine.stats()  # the device-side figures are read at scrape time only
        if self.locality is not None:
            self.locality.set(stats.routing_locality)
            self.fan_out.set(stats.routing_fan_out)
        if self.expert_recall is not None:
            e = stats.expert_offload
            self.expert_recall.set(e["prediction_recall"] or 0.0)
            now = {"hits": e["hits"], "misses": e["misses"], "bytes": e["bytes_prefetch"] + e["bytes_demand"]}
            for key, metric in (("hits", self.expert_hits), ("misses", self.expert_misses),
                                ("bytes", self.expert_bytes)):
                if now[key] > self._expert_last[key]:
                    metric.inc(now[key] - self._expert_last[key])
                    self._expert_last[key] = now[key]
            self.expert_bytes_per_token.set(e["bytes_per_token"])
        for key, value in stats.kv_format.items():
            self._format_series(key).set(value)
        if self.ep_sent is not None:
            for j, (now, metric) in enumerate(((stats.ep_bytes_sent, self.ep_sent),
                                               (stats.ep_bytes_received, self.ep_received))):
                if now > self._ep_last[j]:
                    metric.inc(now - self._ep_last[j])
                    self._ep_last[j] = now
        return generate_latest(self.registry)
