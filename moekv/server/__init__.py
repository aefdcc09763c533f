"""The OpenAI-compatible HTTP server (`moekv serve`) and its load generator (`moekv bench serve`).

app.build_app(engine) -> FastAPI app; async_engine steps the engine in its own thread; protocol
holds the request models; completions / chat the endpoints; metrics the Prometheus series.
"""
