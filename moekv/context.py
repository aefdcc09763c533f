"""Context: the per-step metadata that travels from the model runner down to the attention ops.

Built once per step by the model runner (engine/model_runner.py); layers read it, never a Sequence.
Shapes: T = tokens in the step (all sequences back to back), B = sequences in the step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`, queued without waiting for the device: a plain
    torch.tensor(values, device="cuda") copies synchronously, which waits for all queued work and
    would stall the host behind a step queued ahead (async scheduling)."""
    t = torch.tensor(values, dtype=dtype)
    return t.to(device, non_blocking=True) if device.type == "cuda" else t


def filling_rows(context_lens: list[int], block_size: int) -> list[int]:
    """The sequences (rows) whose newest token completes a page in a decode step: a sequence now n
    tokens long fills its page n // P - 1 when n % P == 0 (the one rule for which pages a step fills)."""
    return [b for b, n in enumerate(context_lens) if n % block_size == 0]


@dataclass(frozen=True)
class HostLists:
    """Host copies of a step's small tables, as the runner built them (block_tables padded to one
    width): eager format code reads these instead of the device tensors, each `.tolist()` of
    which is a sync that stalls the host behind the queued layers."""

    context_lens: list[int]
    query_start: list[int]
    seq_slots: list[int]
    block_tables: list[list[int]]


@dataclass
class Context:
    positions: torch.Tensor        # [T] int64: position of each token in its sequence
    slot_mapping: torch.Tensor     # [T] int64: page * block_size + offset where the token's K/V go
    block_tables: torch.Tensor     # [B, max_pages] int32: each sequence's pages (padded with 0)
    context_lens: torch.Tensor     # [B] int32: tokens cached for each sequence once this step is written
    query_start_loc: torch.Tensor  # [B+1] int32: sequence b owns tokens query_start_loc[b]:query_start_loc[b+1]
    logits_indices: torch.Tensor   # [S] int64: rows of the step whose logits are needed (S <= T)
    seq_slots: torch.Tensor        # [B] int64: each sequence's staging slot (its partly filled newest page)
    max_query_len: int | None = None  # host-side max of the query lengths (1: a decode-only step); None: unknown
    # host-side: True when no sequence's page becomes full in this step, so staged formats may
    # append with one vectorized copy (no host sync: the step can be captured in a CUDA graph)
    fills_no_page: bool = False
    # decode-only steps whose token completes some sequences' pages: the staging slot of each and
    # the page it is quantized into ([F] int64 each; a CUDA-graph replay pads them with the scratch
    # slot and page). None: the step lists no fills (fills_no_page says whether it has any)
    fill_slots: torch.Tensor | None = None
    fill_pages: torch.Tensor | None = None
    # host-side: True when the step runs from the CUDA-graph runner's static buffers (warm-up,
    # capture, replay, or its eager stand-in): formats do device work only, and the runner applies
    # their host-side bookkeeping after each replay (GraphStepHooks.after_graph_replay)
    graph_step: bool = False
    # a step that runs one-token queries (decodes) beside longer ones (prefill chunks), on CUDA:
    # each part as its own Context, so that the decodes take the fused decode kernel (MixedSplit;
    # the attention layer splits, formats see only the parts)
    mixed: "MixedSplit | None" = None
    # host copies of context_lens, query_start_loc, seq_slots and block_tables (eager steps the
    # runner builds; None in graph steps and hand-made contexts: host_lists() reads them back)
    host: HostLists | None = None
    # values every layer of the step computes alike, computed by the first that needs them and read
    # by the others (MLA's RoPE cos / sin: layers/mla.MLAttention.rope_cos_sin); a new Context, an
    # empty dict
    step_values: dict = field(default_factory=dict, repr=False)

    def host_lists(self) -> HostLists:
        """The step's tables on the host: `host`, or read back from the device (a sync)."""
        if self.host is not None:
            return self.host
        return HostLists(self.context_lens.tolist(), self.query_start_loc.tolist(), self.seq_slots.tolist(),
                         self.block_tables.tolist())

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])


@dataclass
class MixedSplit:
    """A mixed step cut in two: `decode` holds the sequences whose query is one token, `prefill` the
    others, each with only its own sequences' rows (their tokens' rows of the step: decode_rows,
    prefill_rows [T_part] int64). Attention runs each part on its own (KVFormat.attend); writing
    the K/V still uses the whole step's Context."""

    decode: Context
    decode_rows: torch.Tensor
    prefill: Context
    prefill_rows: torch.Tensor
