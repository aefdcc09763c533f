"""The engine over several processes (tensor_parallel_size > 1): rank 0 is the engine's own process
(scheduler, block manager, sampling); it starts ranks 1..N-1 as workers (torch.multiprocessing,
spawn), each of which loads the checkpoint, keeps its shard (layers/parallel.py) and its own KV
pools, and then waits for commands.

Under torchrun (or any launcher that sets torch.distributed's env:// variables RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) the engine starts no process: every process runs the same program, the
one of RANK 0 becomes the engine, the others become workers while the engine is built
(start_ranks, serve_worker_rank) and leave with SystemExit(0) once rank 0 shuts down (ranks on
several hosts; rank r's GPU is cuda:LOCAL_RANK). A process group initialised before the engine is joined, not replaced.

Three torch.distributed groups, all over the same N ranks:
- commands (gloo, no practical timeout: a worker may wait a long time for the next step): rank 0
  broadcasts each command with its inputs (a step's token ids, positions, slots, block tables ...,
  as host lists pickled into one tensor by broadcast_object_list);
- compute (NCCL on CUDA, gloo on the CPU; timeout `distributed_timeout`): the layers' all-reduces
  and expert-parallel sends;
- status (gloo, timeout twice `distributed_timeout`): after every step each rank reports whether its
  forward raised. A rank that raised leaves the others blocked in a compute collective until it
  times out; then every rank reports, the compute group is rebuilt, and rank 0 raises
  ParallelStepError naming the rank and its error (the engine fails the step's requests and
  frees their pages; freed pages are released on every rank with the next step).

Decode steps replayed from CUDA graphs (engine/cuda_graphs.py) hold the step's collectives inside
the graphs, so the ranks must capture and replay in lockstep, on rank 0's command:
- "capture_graph" (bucket, fill bucket): every rank captures that variant (its warm-up runs the
  collectives eagerly, with their timeouts), reports on the status group, and only then launches
  it once (the upload, which runs the captured collectives): a rank that failed to capture never
  leaves the others waiting inside a graph. A failed capture turns graphs off on every rank.
- "graph_step" (`GraphStep`: the variant and the step's unpadded inputs): every rank copies the
  inputs into its static buffers (and, for a follow-on step, receives rank 0's sampled tokens by
  an eager broadcast), lets its KV format do the step's host-side work (GraphStepHooks: tiered's
  FP8 slots for the fills, step count, re-ranking, each rank on its own KV heads), reports on the
  status group with its format's verdict, and only if every rank is ready replays the variant's
  graph. A rank whose format turned the step down makes every rank skip the replay: rank 0 then
  sends the same step as an eager "step" (a format that had prepared keeps what it did; its eager
  step does not count again). A collective captured in a graph has no timeout, so the status round
  comes before the replay; a replay itself runs no Python that could fail between collectives. On the
  CPU (emulated graphs, tests) the "replay" is the same static-buffer step run eagerly, whose
  collectives do time out, and a second status round follows it, as for an eager step.
A rebuilt compute group (after a failed step) invalidates every captured graph on every rank
(their collectives name the old communicator): they are dropped and recaptured on use.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moekv.envs import LaunchEnv, launcher_env
from moekv.layers.mlp import GatedMLP
from moekv.layers.parallel import ExpertParallel, TPGroup, check_tp_shapes, shard_attention, shard_mlp, shard_moe

log = logging.getLogger("moekv")

COMMAND_TIMEOUT = timedelta(days=365)  # workers idle between requests for as long as the server runs
# seconds a started worker process has to import torch and moekv and report on rank 0's store (a
# loaded machine takes tens of seconds; a worker alive past this is stuck, not slow)
WORKER_START_TIMEOUT = 300.0
_ACTIVE: list["ParallelGroup"] = []  # one group per process: torch.distributed has one default group


class ParallelStepError(RuntimeError):
    """A rank failed a step (its error, or a collective that timed out); the step's requests fail."""


@dataclass
class StepInputs:
    """What every rank needs to run one step's forward: host lists (T tokens, B sequences)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    block_tables: list[list[int]]  # padded to one width
    context_lens: list[int]
    query_start: list[int]
    logits_rows: list[int]
    seq_slots: list[int]
    max_query_len: int
    fills_no_page: bool
    fill_slots: list[int]
    fill_pages: list[int]
    split_mixed: bool
    # async scheduling's follow-on step: the input tokens are the ones rank 0 sampled on the device,
    # which the host has not seen (input_ids holds placeholders); rank 0 broadcasts them on the
    # compute group inside the step
    tokens_on_device: bool = False


@dataclass
class GraphStep:
    """Rank 0's command to replay one decode step from a graph: the variant (batch bucket, fill
    bucket) every rank replays, and the step's unpadded inputs (B sequences) each rank loads into
    its static buffers first (cuda_graphs.DecodeGraphs.load_step)."""

    bucket: int
    fills: int
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    block_tables: list[list[int]]
    context_lens: list[int]
    seq_slots: list[int]
    fill_slots: list[int]
    fill_pages: list[int]
    tokens_on_device: bool = False  # a follow-on step: rank 0 broadcasts its sampled tokens first


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """A rank's device: cuda:local_rank on CUDA (one GPU per rank; the local rank is the rank when
    the engine starts the ranks itself, LOCAL_RANK under torchrun), the CPU otherwise."""
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


class ParallelGroup:
    """This process's place among the ranks, its groups, and (rank 0) the worker processes."""

    def __init__(self, rank: int, world_size: int, init_method: str | None, device: torch.device, timeout: float,
                 local_rank: int | None = None, store: "dist.Store | None" = None) -> None:
        """init_method: where the ranks meet (tcp://, env://), or None with `store` (ranks rank 0 started)."""
        self.rank, self.world_size = rank, world_size
        self.device = rank_device(device, rank if local_rank is None else local_rank)
        self.timeout = timedelta(seconds=timeout)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # commands travel on the default group when the engine creates it; on a group of their own
        # when the program had initialised torch.distributed already (its default group is left alone)
        self.owns_default_group = not dist.is_initialized()
        self.command_group = None
        if self.owns_default_group:
            where = {"init_method": init_method} if store is None else {"store": store}
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=COMMAND_TIMEOUT, **where)
        else:
            if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
                raise ValueError(f"torch.distributed is initialised as rank {dist.get_rank()} of "
                                 f"{dist.get_world_size()}; the engine needs rank {rank} of {world_size}")
            self.command_group = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
        # a rank that failed early waits here while the others wait out a compute collective: longer
        self.status_group = dist.new_group(backend="gloo", timeout=2 * self.timeout + timedelta(seconds=10))
        self.tp = TPGroup(rank, world_size, dist.new_group(backend=self.backend, timeout=self.timeout))
        self.procs: list = []
        self.lock = threading.RLock()  # one command (and its collectives) at a time
        self.broken: str | None = None
        self._closed = False
        # times the compute group was rebuilt; on_rebuild: called after each rebuild (the runner drops
        # the CUDA graphs that captured the old group's collectives)
        self.generation = 0
        self.on_rebuild: list = []

    # -- rank 0 ------------------------------------------------------------------------------
    @classmethod
    def launch(cls, config, max_model_len: int, make_runner) -> "ParallelGroup":
        """Rank 0: start ranks 1..N-1 (each runs worker_main: builds its runner with make_runner,
        then serves commands) and join them."""
        if _ACTIVE:
            raise RuntimeError("this process already runs an engine with tensor_parallel_size > 1; shut it down "
                               "first (LLMEngine.shutdown()): torch.distributed allows one group per process")
        world = config.parallel.tensor_parallel_size
        # rank 0 holds the rendezvous store; each worker reports there once its process is up, so a
        # worker that dies first (or never reports) is an error here instead of a wait without end
        store = dist.TCPStore("127.0.0.1", 0, world_size=world, is_master=True, timeout=COMMAND_TIMEOUT,
                              wait_for_workers=False)
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=worker_main, args=(r, world, store.port, config, max_model_len, make_runner),
                             daemon=True, name=f"moekv-rank{r}") for r in range(1, world)]
        for p in procs:
            p.start()
        try:
            await_workers(store, procs, max(WORKER_START_TIMEOUT, config.parallel.distributed_timeout))
            group = cls(0, world, None, config.torch_device, config.parallel.distributed_timeout, store=store)
        except BaseException:
            for p in procs:
                p.kill()
            raise
        group.procs = procs
        _ACTIVE.append(group)
        weakref.finalize(group, ParallelGroup._finalize, procs)
        return group

    @classmethod
    def join(cls, config, env: LaunchEnv) -> "ParallelGroup":
        """Every rank of a launcher's (torchrun's) processes: join the others (env:// rendezvous)."""
        world = config.parallel.tensor_parallel_size
        if env.world_size != world:
            raise ValueError(f"tensor_parallel_size={world}, but the launcher (torchrun) started WORLD_SIZE="
                             f"{env.world_size} processes: give --nproc-per-node x --nnodes = {world}")
        if _ACTIVE:
            raise RuntimeError("this process already runs an engine with tensor_parallel_size > 1; shut it down "
                               "first (LLMEngine.shutdown()): torch.distributed allows one group per process")
        group = cls(env.rank, world, "env://", config.torch_device, config.parallel.distributed_timeout, env.local_rank)
        if env.rank == 0:
            _ACTIVE.append(group)
        return group

    def _check_workers(self) -> None:
        if self.broken is not None:
            raise ParallelStepError(f"the worker ranks are unusable: {self.broken}")
        dead = [(r + 1, p.exitcode) for r, p in enumerate(self.procs) if not p.is_alive()]
        if dead:
            self.broken = ", ".join(f"rank {r} exited (code {code})" for r, code in dead)
            raise ParallelStepError(f"the worker ranks are unusable: {self.broken}")

    def send(self, command: str, payload=None) -> None:
        """Rank 0: broadcast one command to the workers."""
        self._check_workers()
        dist.broadcast_object_list([(command, payload)], src=0, group=self.command_group)

    def receive(self):
        """Workers: the next command from rank 0."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.command_group)
        return box[0]

    # -- every rank --------------------------------------------------------------------------
    def finish_step(self, error: BaseException | None, ready: bool = True) -> bool:
        """Every rank says whether its forward raised; if any did, the compute group is rebuilt
        (a rank may have stopped between collectives) and ParallelStepError is raised on every rank.
        ready: this rank's verdict on what comes next (a replayed step: its KV format can do the
        step's host-side work); -> whether every rank was ready, the same answer on every rank."""
        msg = None if error is None else f"{type(error).__name__}: {error}"
        reports = [None] * self.world_size
        try:
            dist.all_gather_object(reports, (msg, bool(ready)), group=self.status_group)
        except Exception as e:  # a rank is gone: nothing more can be run
            self.broken = f"a rank did not report the step's status ({type(e).__name__}: {e})"
            raise ParallelStepError(self.broken) from error
        failed = [(r, m) for r, (m, _) in enumerate(reports) if m is not None]
        if not failed:
            return all(ok for _, ok in reports)
        old = self.tp.group
        self.tp.group = dist.new_group(backend=self.backend, timeout=self.timeout)
        try:
            dist.destroy_process_group(old)
        except Exception:  # already torn down by the failure
            pass
        self.generation += 1
        for hook in self.on_rebuild:
            hook()
        # the cause first: a rank whose own error is not a collective that waited for it
        failed.sort(key=lambda rm: "timed out" in rm[1].lower() or "timeout" in rm[1].lower())
        r, m = failed[0]
        others = "; ".join(f"rank {o}: {mo}" for o, mo in failed[1:])
        raise ParallelStepError(f"rank {r} failed the step: {m}" + (f" (then {others})" if others else ""))

    def gather(self, value) -> list:
        """Every rank's value, on every rank (status group)."""
        out = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.status_group)
        return out

    def shutdown(self) -> None:
        """Rank 0: stop the workers and leave the groups (the process may start another engine)."""
        if self._closed:
            return
        self._closed = True
        with self.lock:
            if self.broken is None and all(p.is_alive() for p in self.procs):
                try:
                    dist.broadcast_object_list([("shutdown", None)], src=0, group=self.command_group)
                except Exception:
                    log.exception("telling the workers to stop failed")
            for p in self.procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
            self.leave()
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def leave(self) -> None:
        """Destroy the engine's groups (and the default group when the engine created it)."""
        groups = [None] if self.owns_default_group else [self.tp.group, self.status_group, self.command_group]
        for g in groups:
            try:
                dist.destroy_process_group(g)
            except Exception:  # already torn down by a failure
                pass

    def leave_process(self) -> None:
        """A worker rank whose process exits next (under torchrun: serve_worker_rank's SystemExit out of
        the engine's construction): destroy every group, the program's default group too. A gloo group still alive
        when the interpreter finalizes can abort the process ("terminate called without an active
        exception"): its worker threads outlive Python; and the program never regains control to
        destroy it itself. Destroying the default group destroys every other group with it."""
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # already torn down by a failure
                pass

    @staticmethod
    def _finalize(procs) -> None:
        for p in procs:
            if p.is_alive():
                p.kill()


def start_ranks(config, model_cfg, max_model_len: int, make_runner) -> ParallelGroup | None:
    """The ranks of an engine with tensor_parallel_size > 1, before rank 0 builds its runner: -> rank
    0's group (None with one rank). The model's shapes are checked first. Without a launcher, rank
    0 starts ranks 1..N-1 (ParallelGroup.launch, worker_main); under torchrun every rank joins, and
    a worker rank serves rank 0 here and exits (serve_worker_rank). make_runner(config, model_cfg,
    max_model_len, parallel=group) builds a rank's runner (a ModelRunner; picklable for spawn)."""
    if config.parallel.tensor_parallel_size == 1:
        return None
    check_tp_shapes(model_cfg, config.parallel.tensor_parallel_size, config.parallel.enable_expert_parallel)
    env = launcher_env()
    if env is None:  # the engine starts ranks 1..N-1 itself
        return ParallelGroup.launch(config, max_model_len, make_runner)
    group = ParallelGroup.join(config, env)  # torchrun started every rank: this one joins them
    if group.rank != 0:
        serve_worker_rank(group, make_runner(config, model_cfg, max_model_len, parallel=group))
    return group


def await_workers(store: "dist.Store", procs: list, timeout: float) -> None:
    """Rank 0, before the ranks' groups are built: wait until every worker process has reported on the
    store (worker_main), or raise naming the rank that exited first or never reported, and the likely
    cause."""
    deadline = time.monotonic() + timeout
    pending = set(range(1, len(procs) + 1))
    while pending:
        pending = {r for r in pending if not store.check([_started_key(r)])}
        dead = sorted((r, procs[r - 1].exitcode) for r in pending if procs[r - 1].exitcode is not None)
        if dead:
            rank, code = dead[0]
            raise RuntimeError(
                f"rank {rank} of the tensor-parallel engine exited (code {code}) before it joined the others; its "
                "error is printed above. The likely cause: the program that builds the engine has no `if __name__ "
                "== \"__main__\":` guard. The ranks start with multiprocessing's spawn, which imports the program "
                "again in every rank, so unguarded code builds a second engine there; put the code that builds "
                "the LLM under that guard (as vLLM requires too)")
        if pending and time.monotonic() > deadline:
            raise RuntimeError(
                f"rank(s) {sorted(pending)} of the tensor-parallel engine did not report within {timeout:g} s of "
                "starting (their processes are still alive). Likely causes: the program has no `if __name__ == "
                "\"__main__\":` guard and blocks when spawn imports it again in a rank, or the machine is too "
                "loaded to start them (a --distributed-timeout above this allowance extends it)")
        if pending:
            time.sleep(0.05)


def _started_key(rank: int) -> str:
    return f"moekv/started/{rank}"


def worker_main(rank: int, world: int, store_port: int, config, max_model_len: int, make_runner) -> None:
    """Ranks 1..N-1 of a tensor-parallel engine started by rank 0 (spawn): report on rank 0's store,
    join the groups, load the shard (the runner make_runner builds), then run rank 0's commands until
    told to stop."""
    from moekv.models.loader import load_model_config

    store = dist.TCPStore("127.0.0.1", store_port, world_size=world, is_master=False, timeout=COMMAND_TIMEOUT)
    store.set(_started_key(rank), "1")
    group = ParallelGroup(rank, world, None, config.torch_device, config.parallel.distributed_timeout, store=store)
    serve_commands(group, make_runner(config, load_model_config(config.model), max_model_len, parallel=group))


def serve_worker_rank(group: ParallelGroup, runner) -> NoReturn:
    """A worker rank under torchrun, whose process runs the program that builds the engine: serve
    rank 0's commands on `runner`, then leave every group (the program's default group too) and
    exit with SystemExit(0): the program never gets past building the engine on this rank."""
    serve_commands(group, runner)
    group.leave_process()
    log.info("rank %d: rank 0 shut the engine down; this process exits", group.rank)
    raise SystemExit(0)


def placement_of(config, model_cfg, moe_layer_ids: list[int]) -> dict[int, torch.Tensor] | None:
    """Expert parallel: the rank of every expert of each MoE layer ([E] int64). With a cluster map,
    its clusters spread over the ranks (cluster c on rank c mod N, as routing/placement.py counts);
    otherwise contiguous slices of E / N experts. None without expert parallelism."""
    world = config.parallel.tensor_parallel_size
    if not config.parallel.enable_expert_parallel or world == 1:
        return None
    if config.router.cluster_map is not None:
        from moekv.routing.cluster_map import ClusterMap
        from moekv.routing.placement import Placement

        cmap = ClusterMap.load(config.router.cluster_map)
        if cmap.num_clusters % world:
            raise ValueError(f"tensor_parallel_size={world} must divide the cluster map's {cmap.num_clusters} "
                             "clusters (each rank holds whole clusters)")
        return dict(Placement.from_clusters(cmap, world).device_of_expert)
    E = model_cfg.num_experts
    return {i: torch.arange(E) // (E // world) for i in moe_layer_ids}


def shard_model(model, model_cfg, tp: TPGroup, placement: dict[int, torch.Tensor] | None) -> None:
    """Cut a loaded model (every rank holds it whole) down to rank's shard, in place."""
    from moekv.layers.moe import SparseMoE

    for i, layer in enumerate(model.layers):
        shard_attention(layer.self_attn, model_cfg, tp)
        if isinstance(layer.mlp, SparseMoE):
            shard_moe(layer.mlp, tp, None if placement is None else placement[i], dispatch=True)
        elif isinstance(layer.mlp, GatedMLP):
            shard_mlp(layer.mlp, tp)
            layer.hooks.tp = tp


def expert_parallel_layers(model) -> dict[int, ExpertParallel]:
    """MoE layer -> its ExpertParallel, for the layers whose experts are spread over the ranks."""
    from moekv.layers.moe import SparseMoE

    return {i: layer.hooks.experts for i, layer in enumerate(model.layers)
            if isinstance(layer.mlp, SparseMoE) and isinstance(layer.hooks.experts, ExpertParallel)}


def expert_parallel_bytes(model) -> dict[int, tuple[int, int]]:
    """This rank's expert-parallel traffic so far: MoE layer -> (bytes sent, bytes received)."""
    return {i: (ep.bytes_sent, ep.bytes_received) for i, ep in expert_parallel_layers(model).items()}


def serve_commands(group: ParallelGroup, runner) -> None:
    """Ranks 1..N-1: run rank 0's commands on `runner` (a ModelRunner) until told to stop, or until
    rank 0 (or another rank) is gone; then leave the engine's groups."""
    try:
        _serve(group, runner)
    finally:
        group.leave()


def _serve(group: ParallelGroup, runner) -> None:
    while True:
        try:
            command, payload = group.receive()
        except Exception:  # rank 0 is gone
            return
        if command == "shutdown":
            runner.release_graphs()
            break
        if command == "step":
            error = None
            try:
                runner.run_model(payload)
            except Exception as e:  # reported to rank 0 through the status group
                error = e
            try:
                group.finish_step(error)
            except ParallelStepError:
                if group.broken is not None:  # rank 0 (or another rank) is gone
                    return
        elif command in ("graph_step", "capture_graph"):
            try:
                if command == "graph_step":
                    runner.run_graph_step(payload)
                else:
                    runner.capture_graph(*payload)
            except ParallelStepError:
                if group.broken is not None:  # rank 0 (or another rank) is gone, or a replay failed here
                    return
            except Exception:  # not reported to the others: rank 0 finds this rank gone at its next command
                log.exception("rank %d: the graph command %r failed", group.rank, command)
                return
        elif command == "release_pages":
            runner.release_pages(payload)
        elif command == "ep_bytes":
            group.gather(expert_parallel_bytes(runner.model))
        elif command == "graph_stats":
            group.gather(runner.graph_stats())
        elif command == "call":  # ModelRunner.call_on_rank (tests)
            if payload[0] == group.rank:
                payload[1](runner)
