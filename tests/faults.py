"""Faults the parallel tests inject into one rank's runner, through ModelRunner.call_on_rank (each is
a picklable callable of the runner: it travels to a worker rank as a command). Each fires once."""
from __future__ import annotations


class FailLayer:
    """The next forward through layer `layer_idx`'s MLP raises on the rank (between the step's
    collectives: the other ranks wait in theirs until they time out)."""

    def __init__(self, layer_idx: int) -> None:
        self.layer_idx = layer_idx

    def __call__(self, runner) -> None:
        layer_idx, rank = self.layer_idx, runner.rank

        def hook(module, args):
            handle.remove()
            raise RuntimeError(f"injected fault in layer {layer_idx} on rank {rank}")

        handle = runner.model.layers[layer_idx].mlp.register_forward_pre_hook(hook)


class FailGraphLoad:
    """The next replayed step's input load (DecodeGraphs.load_step) raises on the rank, before any
    collective of the step: no rank replays."""

    def __call__(self, runner) -> None:
        graphs, rank = runner.graphs, runner.rank

        def load_step(*args, **kwargs):
            del graphs.load_step  # the class's own again
            raise RuntimeError(f"injected fault loading a graph step on rank {rank}")

        graphs.load_step = load_step


class RefuseGraphStep:
    """No fault: the rank's KV format turns the next replayed step down (its prepare_graph_step
    returns False, having done nothing), so every rank runs that step eagerly."""

    def __call__(self, runner) -> None:
        fmt = runner.kv_format

        def prepare_graph_step(*args, **kwargs) -> bool:
            del fmt.prepare_graph_step  # the class's own again
            return False

        fmt.prepare_graph_step = prepare_graph_step


def inject_fault(runner, rank: int, fault) -> None:
    """fault on rank `rank` (runner: rank 0's): a layer index (FailLayer), "graph_load"
    (FailGraphLoad) or "graph_verdict" (RefuseGraphStep)."""
    make = {"graph_load": FailGraphLoad, "graph_verdict": RefuseGraphStep}.get(fault)
    runner.call_on_rank(rank, make() if make is not None else FailLayer(fault))
