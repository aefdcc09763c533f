"""scripts/train_domain_moe.py --arch deepseek-v3 (domain-mla and its flat twin) and the routing experiment
(benchmarks/quality/group_routing.py) on tiny checkpoints."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoints import CORPUS, build_deepseek_checkpoint

REPO = Path(__file__).resolve().parent.parent


def _load(name: str, folder: str):
    spec = importlib.util.spec_from_file_location(name, REPO / folder / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


train = _load("train_domain_moe", "scripts")
prep = _load("prepare_domain_data", "scripts")
group_routing = _load("group_routing", "benchmarks/quality")


def _args(*extra: str):
    return train.parse_args(["--arch", "deepseek-v3", "--data", "unused", "--out", "unused", *extra])


def test_default_model_fits_the_repository_budget_and_the_flat_twin_matches_it():
    """The shipped shape: <= 5 M parameters (<= 10 MB in bf16), and the twin differs only in its routing."""
    args = _args()
    assert (args.num_experts, args.experts_per_tok, args.n_group, args.topk_group) == (32, 4, 4, 2)
    grouped = train.build_model(args, 4096, 0)
    flat = train.build_model(_args("--n-group", "1", "--topk-group", "1"), 4096, 0)
    n = sum(p.numel() for p in grouped.parameters())
    assert n <= 5_000_000 and 2 * n <= 10_000_000
    shapes = {k: v.shape for k, v in grouped.state_dict().items()}
    assert shapes == {k: v.shape for k, v in flat.state_dict().items()}
    assert (grouped.config.n_group, grouped.config.topk_group) == (4, 2)
    assert (flat.config.n_group, flat.config.topk_group) == (1, 1)
    assert grouped.config.first_k_dense_replace == 1 and grouped.config.num_hidden_layers == 4


@pytest.mark.parametrize("flags, message", [
    (("--n-group", "5"), "must divide"),
    (("--topk-group", "5"), "must be in"),
    (("--n-group", "8", "--topk-group", "1", "--experts-per-tok", "5"), "hold fewer"),
])
def test_groups_that_cannot_route_are_refused(flags, message, capsys):
    with pytest.raises(SystemExit):
        _args(*flags)
    assert message in capsys.readouterr().err


def test_balance_moves_each_bias_towards_the_mean_load_and_records_only_training_forwards():
    torch.manual_seed(0)
    args = _args("--smoke", "--bias-update-rate", "0.01")
    model = train.build_model(args, 128, 0)
    balance = train.RouterBalance(model, args)
    assert len(balance.routers) == args.num_layers - args.first_k_dense_replace
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (2, 16)))
    assert balance.records == []  # evaluation forwards leave the balance alone
    model.train()
    model(input_ids=torch.randint(0, 128, (2, 16)), **balance.forward_kwargs())
    assert len(balance.records) == len(balance.routers)
    loss = balance.loss(None)
    assert loss.requires_grad and 0.9 < loss.item() < args.num_experts
    loss.backward()
    assert balance.routers[0].weight.grad is not None and balance.routers[0].weight.grad.abs().sum() > 0
    loads = [torch.bincount(chosen.flatten(), minlength=args.num_experts).float()
             for _, _, chosen in balance.records]
    before = [r.e_score_correction_bias.clone() for r in balance.routers]
    balance.after_step()
    for router, load, old in zip(balance.routers, loads, before):
        step = router.e_score_correction_bias - old
        assert torch.allclose(step, 0.01 * torch.sign(load.mean() - load), atol=1e-7)
        assert (step[load > load.mean()] < 0).all() and (step[load < load.mean()] > 0).all()
    assert balance.records == [] and balance.max_load() >= 1.0 and balance.max_load() is None


def _heldout(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    words = CORPUS.split()
    for i, domain in enumerate(group_routing.DOMAINS):  # a different start for each domain
        (folder / f"{domain}.txt").write_text(" ".join((words[7 * i:] + words[:7 * i]) * 8))
    return folder


@pytest.mark.slow
def test_routing_experiment_bounds_fan_out_and_all_groups_is_flat(tmp_path):
    """Group placement: keeping k groups spans at most k devices (k = 1: every expert local); the flat twin
    with all its imposed groups kept routes exactly as by itself (its perplexity unchanged)."""
    from moekv import LLM
    from moekv.eval.perplexity import perplexity

    grouped = build_deepseek_checkpoint("deepseek_v3", tmp_path / "g", n_group=4, topk_group=2)
    flat = build_deepseek_checkpoint("deepseek_v3", tmp_path / "f", seed=1, n_group=1, topk_group=1)
    heldout = _heldout(tmp_path / "heldout")
    out = tmp_path / "routing.json"
    result = group_routing.main(["--model", f"grouped={grouped}", "--model", f"flat={flat}", "--heldout", str(heldout),
                                 "--max-tokens", "96", "--window", "32", "--max-model-len", "160",
                                 "--retrieval-lengths", "128", "--retrieval-depths", "0.5", "--retrieval-trials", "1",
                                 "--out", str(out)])
    assert json.loads(out.read_text())["summary"] == result["summary"]
    assert set(result["runs"]) == {f"{m} k={k}" for m in ("grouped", "flat") for k in (1, 2, 4)}
    own = {label for label, run in result["runs"].items() if run["own_routing"]}
    assert own == {"grouped k=2", "flat k=4"}
    for label, run in result["runs"].items():
        for r in run["domains"].values():
            assert r["placement"] == "grouped" and r["max_fan_out"] <= run["topk_group"]
            if run["topk_group"] == 1:
                assert r["locality"] == 1.0 and r["fan_out"] == 1.0
        assert ("retrieval" in run) == run["own_routing"]
        assert run["retrieval"]["total"] == 4 if run["own_routing"] else True
    assert result["summary"]["flat k=4"]["ppl_change"] == dict.fromkeys(group_routing.DOMAINS, 0.0)
    alone = perplexity(LLM(str(flat), dtype="float32", max_model_len=160), heldout / "code.txt", window=32,
                       max_tokens=96, mode="prefill", progress=False)
    assert alone.ppl == pytest.approx(result["runs"]["flat k=4"]["domains"]["code"]["ppl"], rel=1e-6)
    runs = result["runs"]
    assert runs["grouped k=1"]["domains"]["code"]["ppl"] != runs["grouped k=4"]["domains"]["code"]["ppl"]


@pytest.mark.slow
@pytest.mark.skipif(not (prep.DEFAULT_DATA_DIR / prep.NOVELS[0]).is_file(),
                    reason="needs the shared training data beside the repository (../shared/data)")
def test_smoke_training_gives_a_checkpoint_moekv_serves_as_transformers_does(tmp_path):
    """train --arch deepseek-v3 --smoke: the joined parts load in moekv (group-limited routing from the
    config, router weights and biases in float32) and its logits and greedy tokens match transformers'."""
    from safetensors.torch import load_file

    parity = _load("hf_parity_check", "scripts")
    data, out, ckpt = tmp_path / "data", tmp_path / "run", tmp_path / "ckpt"
    prep.main(["--out", str(data), "--smoke", "--data-dir", str(prep.DEFAULT_DATA_DIR)])
    result = train.main(["--arch", "deepseek-v3", "--data", str(data), "--out", str(out), "--smoke",
                         "--device", "cpu", "--bias-update-rate", "0.01"])
    assert result["routing"]["n_group"] == 4 and result["routing"]["bias_range"] > 0
    logged = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert all(r["max_load"] >= 1.0 for r in logged if r["kind"] == "train")
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"".join(p.read_bytes() for p in sorted(out.glob("*.part*"))))
    for name in ("config.json",):
        (ckpt / name).write_text((out / name).read_text())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (ckpt / name).write_text((data / name).read_text())
    tensors = load_file(ckpt / "model.safetensors")
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].abs().max() > 0
    assert parity.main(["--model", str(ckpt), "--text", str(data / "heldout" / "prose.txt"), "--tokens", "4"]) == 0
