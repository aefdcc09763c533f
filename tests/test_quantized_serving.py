"""What the engine reports about quantized weights: `moekv info`'s weight bytes and floors (against
the bytes a loaded model really holds), EngineStats, the server's /v1/models card and metrics.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_quantized_serving.py
"""
from __future__ import annotations

import httpx
import pytest

from moekv import LLM
from moekv.cli import main
from moekv.config import default_model_path
from moekv.models.loader import load_model_config
from moekv.models.quantize import weight_footprint
from tests.server_harness import ServerThread, scrape

MODEL = default_model_path()


@pytest.mark.parametrize("method", [None, "fp8", "int4"])
def test_weight_footprint_is_what_the_loaded_model_holds(method):
    llm = LLM(quantization=method, dtype="float32", max_model_len=64)
    runner = llm.engine.runner
    assert runner.quantization == method
    assert weight_footprint(llm.engine.model_config, method, elem_bytes=4)[0] == runner.weight_bytes
    stats = llm.engine.stats(device=False)
    assert (stats.weight_quantization, stats.weight_bytes) == (method, runner.weight_bytes)


def test_info_prints_each_quantization(capsys):
    assert main(["info", "--bandwidth-tbs", "2"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if "per step" in line}
    assert set(rows) == {"16-bit", "fp8", "int4"}
    floors = {name: float(line.split("floor")[1].split()[0]) for name, line in rows.items()}
    assert floors["int4"] < floors["fp8"] < floors["16-bit"]
    read_16 = weight_footprint(load_model_config(MODEL), None)[1]
    assert floors["16-bit"] == pytest.approx(1e3 * read_16 / 2e12, rel=1e-3)


def test_server_names_the_quantization():
    with ServerThread(MODEL, max_model_len=64, quantization="int4") as srv:
        card = httpx.get(f"{srv.url}/v1/models").json()["data"][0]
        assert card["quantization"] == "int4"
        metrics = scrape(srv.url)
        key = f"moekv:weight_config_info{{quantization=int4,weight_bytes={srv.engine.runner.weight_bytes}}}"
        assert metrics[key] == 1
