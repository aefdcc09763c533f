"""calibration_io: the calibration folder's files, read by the formats and written by `moekv calibrate`.

  DIR/kv_calibration.safetensors  the learned tables by name (vq.layer{l}.*, nuq2.layer{l}.*)
  DIR/kv_calibration.json         what they were fitted on (model, text, tokens, shapes, bytes, date;
                                  keys_before_rope: the key tables fitted on keys before RoPE)

A leaf module: the formats import it to read the tables, the calibration tool (moekv/tools/calibrate.py)
to write them; it imports neither.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

CALIBRATION_FILE = "kv_calibration.safetensors"
RECORD_FILE = "kv_calibration.json"


def load_calibration(folder: str | Path, what: str) -> dict[str, torch.Tensor]:
    """The tensors of a calibration folder; `what` names the format asking (for the error message)."""
    path = Path(folder) / CALIBRATION_FILE
    if not path.is_file():
        raise ValueError(f"{what}: no {CALIBRATION_FILE} in kv_calibration={str(folder)!r}; run `moekv calibrate "
                         "--model PATH --text FILE --out DIR` and pass kv_calibration=DIR")
    from safetensors.torch import load_file

    return load_file(str(path))


def calibration_record(folder: str | Path) -> dict:
    """The folder's JSON record (what the tables were fitted on), or {} where it has none."""
    path = Path(folder) / RECORD_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def keys_fitted_before_rope(folder: str | Path) -> bool:
    """Whether the folder's key tables were fitted on keys before RoPE (`moekv calibrate
    --keys-before-rope` records it); a folder without that record was fitted after RoPE."""
    return bool(calibration_record(folder).get("keys_before_rope", False))


def other_side(folder: str | Path) -> str:
    """Why a format that stores keys on the other side of RoPE than `folder`'s key tables were
    fitted on cannot read them, and how to get matching ones."""
    if keys_fitted_before_rope(folder):
        return (f"the calibration in {str(folder)!r} fitted its key tables on keys before RoPE; pass "
                "kv_keys_before_rope=True (--kv-keys-before-rope), or calibrate without --keys-before-rope")
    return (f"the calibration in {str(folder)!r} fitted its key tables on keys after RoPE; run `moekv calibrate "
            "--keys-before-rope` for kv_keys_before_rope=True")


def save_calibration(folder: str | Path, tables: dict[str, torch.Tensor], record: dict | None = None) -> Path:
    """Write `tables` (and the JSON `record`, when given) into `folder`, made if missing; returns it."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tables.items()}, str(folder / CALIBRATION_FILE))
    if record is not None:
        (folder / RECORD_FILE).write_text(json.dumps(record, indent=2))
    return folder


def shard_head_tables(tables: dict[str, torch.Tensor], kv_heads: range, num_kv_heads: int) -> None:
    """Cut, in place, the tables of `tables` kept per KV head ([num_kv_heads, ...]) to the heads
    `kv_heads` (a tensor-parallel rank's); tables of other shapes stay whole."""
    for name, t in list(tables.items()):
        if t.dim() >= 1 and t.shape[0] == num_kv_heads:
            tables[name] = t[kv_heads.start:kv_heads.stop].contiguous()
