"""Target features (speculative/protocol.py's Features) to and from tensors.

A target session asked for feature layers returns, with each answer, the hidden states its pass
computed for the positions it committed; an EAGLE-style draft reads them. They travel as float16,
or as bfloat16 where a value is beyond float16's range (a few models carry activations past
65,504), row-major, little-endian: 2 bytes a value, len(layers) x hidden values a position.
"""

from __future__ import annotations

import numpy as np
import torch

from speculative.errors import InvalidRequest
from speculative.protocol import Features

FLOAT16_MAX = 65504.0
MAX_FEATURE_LAYERS = 8
# the most feature bytes one answer carries: a long prompt's prefill sends its last rows only (the
# draft then attends to those), so that the message stays well inside gRPC's 16 MiB (an 8B target's
# three layers are 24 kB a position)
MAX_FEATURE_BYTES = 8 << 20


def pack(start: int, states: torch.Tensor) -> Features:
    """states [rows, layers, D] (or [rows, width]) for positions start.. -> Features (the last rows
    that fit MAX_FEATURE_BYTES)."""
    fit = max(1, MAX_FEATURE_BYTES // (2 * max(1, states[0].numel()))) if states.shape[0] else 0
    if states.shape[0] > fit:
        start, states = start + states.shape[0] - fit, states[-fit:]
    rows = states.shape[0]
    flat = states.flatten(1).float()
    if flat.device.type == "cpu":  # the same through numpy: a few calls, not ten of torch's (~0.1 ms after a pass)
        values = flat.numpy()
        if not rows or np.maximum(values.max(), -values.min()) <= FLOAT16_MAX:  # (NaN: not so; torch's way below)
            return Features(start, rows, flat.shape[1], "float16", values.astype("<f2").tobytes())
    if rows and not bool(flat.abs().max() <= FLOAT16_MAX):  # (also NaN: bfloat16 keeps it as it is)
        data = flat.to(torch.bfloat16).view(torch.int16).cpu().numpy().astype("<i2").tobytes()
        return Features(start, rows, flat.shape[1], "bfloat16", data)
    data = flat.to(torch.float16).cpu().numpy().astype("<f2").tobytes()
    return Features(start, rows, flat.shape[1], "float16", data)


def unpack(features: Features, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Features -> [rows, width] in `dtype` on `device`."""
    features.check()
    if not features.rows:
        return torch.empty(0, features.width, dtype=dtype, device=device)
    kind = torch.float16 if features.dtype == "float16" else torch.bfloat16
    raw = torch.frombuffer(bytearray(features.data), dtype=torch.int16)  # little-endian hosts (x86, arm64)
    return raw.view(kind).view(features.rows, features.width).to(device=device, dtype=dtype)


def check_layers(layers: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """A session's feature layers: each the input of one of the model's decoder layers."""
    if len(layers) > MAX_FEATURE_LAYERS:
        raise InvalidRequest(f"at most {MAX_FEATURE_LAYERS} feature layers, not {len(layers)}")
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise InvalidRequest(f"feature layer {bad[0]} is not one of this model's layers [0, {num_layers})")
    return tuple(layers)
