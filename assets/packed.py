"""Committed models stored at 8 bits a weight, unpacked by `make setup` into the layout every loader reads.

    python -m assets.packed pack models/eagle       model.safetensors -> model.int8.safetensors
    python -m assets.packed unpack models/draft     model.int8.safetensors -> model.safetensors

models/ keeps to 40 MB of committed files, and the distilled draft (32 MB of bf16 weights, 25 of
them its tied embedding) and the EAGLE-3 head (23 MB) do not fit side by side at 16 bits. Packed,
each matrix of at least PACK_MIN elements is int8 with one scale a row (symmetric, the row's largest
magnitude over 127) and the rest is kept as it is, so the pair takes about half. `unpack` writes
model.safetensors back in the dtype it was packed from (weights = int8 x scale, rounded once to that
dtype), so transformers, vLLM and specdec's own loaders read an ordinary checkpoint; the unpacked
file is not committed (.gitignore) and is made again whenever the packed one is newer.

What a row loses is at most half a step of 127 (0.4% of the row's largest weight): the head is served
in int8 anyway (Eagle3Head.quantize_int8, one scale a matrix), and the pair's acceptance before and
after packing is in docs/performance.md. Tensors named in `keep` stay at their own precision (the
head's fc, whose input channels' outliers a per-row scale would blur, see quantize_int8).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

PACKED = "model.int8.safetensors"
UNPACKED = "model.safetensors"
PACK_MIN = 4096  # smaller matrices are not worth a scale a row (norms and biases, 1-D, never are)
FORMAT = "specdec-int8-rows/1"
SCALE = ".int8_scale"
KEYS = ("specdec.packing", "specdec.dtype", "specdec.packed")  # beside the checkpoint's own metadata


def pack_tensors(tensors: dict[str, torch.Tensor], keep: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], dict]:
    """Each floating matrix of at least PACK_MIN elements (and not named in keep) as int8 rows
    and float32 scales; the metadata names the packed ones and the dtype to unpack them to."""
    out, packed, dtypes = {}, [], set()
    for name, t in tensors.items():
        if t.dim() == 2 and t.is_floating_point() and t.numel() >= PACK_MIN and name not in keep:
            w = t.float()
            scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
            out[name] = torch.round(w / scale).clamp_(-127, 127).to(torch.int8).contiguous()
            out[name + SCALE] = scale.squeeze(1).contiguous()
            packed.append(name)
            dtypes.add(t.dtype)
        else:
            out[name] = t.contiguous()
    if len(dtypes) > 1:
        raise ValueError(f"the packed matrices mix dtypes {sorted(map(str, dtypes))}")
    dtype = str(next(iter(dtypes), torch.bfloat16)).removeprefix("torch.")
    return out, {KEYS[0]: FORMAT, KEYS[1]: dtype, KEYS[2]: json.dumps(sorted(packed))}


def unpack_tensors(tensors: dict[str, torch.Tensor], metadata: dict) -> dict[str, torch.Tensor]:
    """pack_tensors' inverse, up to the rounding: packed matrices back in their dtype."""
    if metadata.get(KEYS[0]) != FORMAT:
        raise ValueError(f"not a packed checkpoint ({KEYS[0]} {metadata.get(KEYS[0])!r}, expected {FORMAT!r})")
    dtype = getattr(torch, metadata[KEYS[1]])
    packed = set(json.loads(metadata[KEYS[2]]))
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALE):
            continue
        if name in packed:
            t = (t.float() * tensors[name + SCALE].unsqueeze(1)).to(dtype)
        out[name] = t
    return out


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}


def pack(directory: Path, keep: tuple[str, ...] = ()) -> Path:
    """directory/model.safetensors -> directory/model.int8.safetensors (the unpacked file stays)."""
    tensors, metadata = _read(directory / UNPACKED)
    out, packed_metadata = pack_tensors(tensors, keep)
    save_file(out, str(directory / PACKED), metadata={**metadata, **packed_metadata})
    return directory / PACKED


def unpack(directory: Path, force: bool = False) -> bool:
    """directory/model.int8.safetensors -> directory/model.safetensors where the packed file is
    there and newer (or force); returns whether it wrote. A missing directory is no error (a head
    not made yet)."""
    src, dst = directory / PACKED, directory / UNPACKED
    if not src.is_file() or (not force and dst.is_file() and dst.stat().st_mtime >= src.stat().st_mtime):
        return False
    tensors, metadata = _read(src)
    kept = {k: v for k, v in metadata.items() if k not in KEYS}  # the original's own ("format": "pt")
    partial = dst.with_suffix(".partial")
    save_file(unpack_tensors(tensors, metadata), str(partial), metadata=kept or None)
    partial.replace(dst)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m assets.packed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("pack", "unpack"))
    parser.add_argument("directories", nargs="+", type=Path)
    parser.add_argument("--keep", action="append", default=[],
                        help="pack: a tensor to keep at its own precision (repeatable)")
    parser.add_argument("--force", action="store_true", help="unpack even where model.safetensors is newer")
    args = parser.parse_args(argv)
    for directory in args.directories:
        if args.action == "pack":
            path = pack(directory, tuple(args.keep))
            print(f"{path}: {path.stat().st_size / 1e6:.1f} MB (from {(directory / UNPACKED).stat().st_size / 1e6:.1f})")
        elif unpack(directory, args.force):
            print(f"{directory / UNPACKED}: unpacked from {PACKED}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
