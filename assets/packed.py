"""Committed models stored at 8 bits a weight, unpacked by `make setup` into the layout every loader reads.

    python -m assets.packed pack models/eagle       model.safetensors -> model.safetensors.int8
    python -m assets.packed unpack models/draft     model.safetensors.int8 -> model.safetensors

models/ keeps to 40 MB of committed files, and the distilled draft (32 MB of bf16 weights, 25 of
them its tied embedding) and the EAGLE-3 head (23 MB) do not fit side by side at 16 bits. Packed,
each matrix of at least PACK_MIN elements is int8 with one scale a row (symmetric, the row's largest
magnitude over 127) and the rest is kept as it is, so the pair takes about half. `unpack` writes
model.safetensors back in the dtype it was packed from (weights = int8 x scale, rounded once to that
dtype), so transformers, vLLM and specdec's own loaders read an ordinary checkpoint. The packed file
is a safetensors file whose name does not end in .safetensors: loaders that take every *.safetensors
of a directory (vLLM's) must not read it beside the unpacked one. The unpacked file is not committed
(.gitignore); it records the packed file's sha256, and `unpack` writes it again whenever that
differs (a pull, a checkout, a copy that kept old times), so `make setup` runs it every time: where
nothing changed it reads two file headers and hashes ~30 MB, without importing torch.

What a row loses is at most half a step of 127 (0.4% of the row's largest weight); the pair's
acceptance before and after packing is in the README. Tensors named in `keep` stay at their own
precision (the head's fc, whose input channels' outliers a per-row scale would blur: see
Eagle3Head.quantize_int8).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
from pathlib import Path

PACKED = "model.safetensors.int8"
UNPACKED = "model.safetensors"
PACK_MIN = 4096  # smaller matrices are not worth a scale a row (norms and biases, 1-D, never are)
FORMAT = "specdec-int8-rows/1"
SCALE = ".int8_scale"
KEYS = ("specdec.packing", "specdec.dtype", "specdec.packed")  # beside the checkpoint's own metadata
SOURCE = "specdec.packed_sha256"  # in the unpacked file: the packed file it was made from
DTYPES = ("bfloat16", "float16", "float32")


def pack_tensors(tensors: dict, keep: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """Each floating matrix of at least PACK_MIN elements (and not named in keep) as int8 rows
    and float32 scales; the metadata names the packed ones and the dtype to unpack them to."""
    import torch

    out, packed, dtypes = {}, [], set()
    for name, t in tensors.items():
        if t.dim() == 2 and t.is_floating_point() and t.numel() >= PACK_MIN and name not in keep:
            w = t.float()
            scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
            out[name] = torch.round(w / scale).clamp_(-127, 127).to(torch.int8).contiguous()
            out[name + SCALE] = scale.squeeze(1).contiguous()
            packed.append(name)
            dtypes.add(str(t.dtype).removeprefix("torch."))
        else:
            out[name] = t.contiguous()
    if len(dtypes) > 1 or not dtypes <= set(DTYPES):
        raise ValueError(f"the packed matrices are {sorted(dtypes)}: one of {DTYPES} expected")
    return out, {KEYS[0]: FORMAT, KEYS[1]: next(iter(dtypes), "bfloat16"), KEYS[2]: json.dumps(sorted(packed))}


def unpack_tensors(tensors: dict, metadata: dict) -> dict:
    """pack_tensors' inverse, up to the rounding: packed matrices back in their dtype."""
    import torch

    if metadata.get(KEYS[0]) != FORMAT:
        raise ValueError(f"not a packed checkpoint ({KEYS[0]} {metadata.get(KEYS[0])!r}, expected {FORMAT!r})")
    if metadata.get(KEYS[1]) not in DTYPES:
        raise ValueError(f"a packed checkpoint's dtype must be one of {DTYPES}, not {metadata.get(KEYS[1])!r}")
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


def header_metadata(path: Path) -> dict:
    """A safetensors file's __metadata__, read from its header alone ({} where it has none)."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)).get("__metadata__") or {}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _read(path: Path) -> tuple[dict, dict]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}  # noqa: SIM118 (a safe_open handle)


def pack(directory: Path, keep: tuple[str, ...] = ()) -> Path:
    """directory/model.safetensors -> directory/model.safetensors.int8 (the unpacked file stays, and
    is marked as made from it)."""
    from safetensors.torch import save_file

    tensors, metadata = _read(directory / UNPACKED)
    out, packed_metadata = pack_tensors(tensors, keep)
    save_file(out, str(directory / PACKED), metadata={**metadata, **packed_metadata})
    unpack(directory, force=True)  # the unpacked file is then the packed one's rounding, as a clone gets it
    return directory / PACKED


def unpack(directory: Path, force: bool = False) -> bool:
    """directory/model.safetensors.int8 -> directory/model.safetensors, unless that was made from this
    very packed file (its sha256) and not force; returns whether it wrote. A directory without a
    packed file is left alone (a model committed unpacked, or one not made yet)."""
    src, dst = directory / PACKED, directory / UNPACKED
    if not src.is_file():
        return False
    digest = sha256(src)
    if not force and dst.is_file():
        try:
            if header_metadata(dst).get(SOURCE) == digest:
                return False
        except (OSError, ValueError, struct.error):
            pass  # unreadable: written again
    from safetensors.torch import save_file

    tensors, metadata = _read(src)
    kept = {k: v for k, v in metadata.items() if k not in KEYS}  # the original's own ("format": "pt")
    partial = dst.with_suffix(".partial")
    save_file(unpack_tensors(tensors, metadata), str(partial), metadata={**kept, SOURCE: digest})
    partial.replace(dst)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m assets.packed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("pack", "unpack"))
    parser.add_argument("directories", nargs="+", type=Path)
    parser.add_argument("--keep", action="append", default=[],
                        help="pack: a tensor to keep at its own precision (repeatable)")
    parser.add_argument("--force", action="store_true", help="unpack even where model.safetensors is up to date")
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
