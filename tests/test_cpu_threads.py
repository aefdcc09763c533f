"""The CPU's intra-op threads: chosen for the model's size and the free cores, or the user's (engine/cpu_threads.py)."""
from __future__ import annotations

import pytest
import torch

from moekv.engine import cpu_threads
from moekv.engine.cpu_threads import MAX_CPU_THREADS, choose_cpu_threads, set_cpu_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("num_params, cores, busy, want", [
    (10_000_000, 2, 0.0, 1),  # the bundled model on a 2-core laptop
    (10_000_000, 2, 1.0, 1),  # ... with another process busy
    (10_000_000, 64, 0.0, 2),  # a small model never gets more than two
    (10_000_000, 4, 1.0, 1),  # two only with at least four cores free
    (99_000_000, 8, 0.0, 2),
    (100_000_000, 8, 0.0, 8),  # a large one gets every free core
    (7_000_000_000, 16, 4.0, 12),
    (7_000_000_000, 16, 20.0, 1),  # an overloaded machine: at least one
    (7_000_000_000, 2, 0.4, 2),  # a fraction of a busy core rounds
    (7_000_000_000, 256, 0.0, MAX_CPU_THREADS),  # capped
    (7_000_000_000, 0, 0.0, 1),
])
def test_choice_for_size_and_cores(num_params, cores, busy, want):
    assert choose_cpu_threads(num_params, cores, busy) == want


def test_chosen_count_is_set_and_split_over_ranks(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "machine_cores", lambda: (16, 0.0))
    assert set_cpu_threads(None, 10_000_000) == 2 == torch.get_num_threads()
    assert set_cpu_threads(None, 1_000_000_000) == 16 == torch.get_num_threads()
    # four ranks on the host: four cores each
    assert set_cpu_threads(None, 250_000_000, ranks_on_host=4) == 4 == torch.get_num_threads()


def test_threads_flag_wins_and_reaches_the_config(monkeypatch, restore_threads):
    from moekv.cli import build_parser, engine_config_from
    from moekv.config import EngineConfig

    for command in (["generate", "--prompt", "x"], ["serve"], ["eval", "ppl", "--text", "t"]):
        assert engine_config_from(build_parser().parse_args([*command, "--threads", "3"])).parallel.cpu_threads == 3
        assert engine_config_from(build_parser().parse_args(command)).parallel.cpu_threads is None
    assert EngineConfig(cpu_threads=2).parallel.cpu_threads == 2
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="cpu_threads="):
            EngineConfig(cpu_threads=bad)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # --threads is the more specific choice
    assert set_cpu_threads(3, 10_000_000) == 3 == torch.get_num_threads()


def test_omp_num_threads_is_respected(monkeypatch, restore_threads):
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(cpu_threads, "machine_cores", lambda: (2, 1.0))  # would choose 1
    assert set_cpu_threads(None, 10_000_000) == 2 == torch.get_num_threads()


def test_torch_set_num_threads_before_the_engine_is_respected(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "machine_cores", lambda: (16, 0.0))
    monkeypatch.setattr(cpu_threads, "_threads_at_import", 4)
    monkeypatch.setattr(cpu_threads, "_chosen", None)
    torch.set_num_threads(3)  # neither torch's count at import nor the engine's: the user's
    assert set_cpu_threads(None, 1_000_000_000) == 3 == torch.get_num_threads()
    torch.set_num_threads(4)  # torch's own: the engine chooses
    assert set_cpu_threads(None, 1_000_000_000) == 16 == torch.get_num_threads()
    # the engine's own earlier choice does not count as the user's: a second engine chooses again
    assert set_cpu_threads(None, 10_000_000) == 2 == torch.get_num_threads()


def test_engine_on_the_cpu_sets_the_chosen_count(mixtral_ckpt, monkeypatch, restore_threads):
    """A CPU engine applies the choice for its model's parameters (the test checkpoint is tiny: 1 thread)."""
    from moekv.config import EngineConfig
    from moekv.engine.llm_engine import LLMEngine

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "machine_cores", lambda: (2, 0.0))
    monkeypatch.setattr(cpu_threads, "_threads_at_import", 2)  # torch's own count, whatever this process began with
    torch.set_num_threads(2)
    engine = LLMEngine(EngineConfig(model=mixtral_ckpt, max_model_len=32, max_num_seqs=1))
    try:
        assert torch.get_num_threads() == 1
    finally:
        engine.shutdown()
