"""Features (speculative/protocol.py) and the coordinator's FeatureLog (speculative/round.py): rows
join in position order, overlaps take the later rows, a gap starts the rows again, float16 and
bfloat16 parts join as bfloat16, and the log keeps what a draft still needs and no more."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model_service import features as wire
from speculative.errors import InvalidRequest
from speculative.protocol import Features
from speculative.round import FeatureLog

W = 6


def rows(start: int, n: int, dtype: str = "float16") -> Features:
    """Rows whose every value is its position (exact in both dtypes)."""
    values = np.repeat(np.arange(start, start + n, dtype=np.float32), W)
    if dtype == "float16":
        data = values.astype("<f2").tobytes()
    else:
        data = (values.view("<u4") >> 16).astype("<u2").tobytes()
    return Features(start, n, W, dtype, data)


def positions(f: Features) -> list[int]:
    values = wire.unpack(f)
    assert bool((values == values[:, :1]).all())
    return values[:, 0].int().tolist()


def test_join_keeps_position_order_and_takes_the_later_rows():
    joined = Features.join([rows(0, 4), rows(4, 2), rows(3, 4)])
    assert (joined.start, joined.rows) == (0, 7) and positions(joined) == list(range(7))
    assert positions(Features.join([rows(5, 3), rows(2, 4)])) == [2, 3, 4, 5, 6, 7]  # a target started again
    assert Features.join([rows(0, 2), rows(5, 2)]).start == 5  # a gap: the rows start again
    assert Features.join([rows(5, 2), rows(0, 2)]).start == 5  # older rows past a gap add nothing
    assert Features.join([]) is None


def test_float16_and_bfloat16_parts_join_as_bfloat16():
    joined = Features.join([rows(0, 3, "float16"), rows(3, 2, "bfloat16")])
    assert joined.dtype == "bfloat16" and positions(joined) == [0, 1, 2, 3, 4]
    big = wire.pack(0, torch.tensor([[1e5] * W, [0.5] * W]))  # beyond float16's range: bfloat16
    assert big.dtype == "bfloat16" and wire.unpack(big)[0, 0] == 99840.0  # 1e5 to bfloat16's 8 bits
    assert wire.pack(0, torch.zeros(0, W)).rows == 0


def test_packed_rows_are_torchs_float16_and_rows_past_its_range_or_nan_bfloat16():
    """pack (numpy's conversion on the CPU) writes the bytes torch's float16 conversion gives, rounding,
    subnormals and the range's ends included; a row past float16's range, infinite or NaN goes as bfloat16,
    as torch's way decides."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 3, W, generator=g) * 300
    x[0, 0, :4] = torch.tensor([65504.0, -65504.0, 6e-8, 1e-6])  # the range's ends, float16 subnormals
    packed = wire.pack(7, x)
    assert (packed.start, packed.rows, packed.width, packed.dtype) == (7, 5, 3 * W, "float16")
    assert packed.data == x.flatten(1).to(torch.float16).numpy().astype("<f2").tobytes()
    for bad in (70000.0, float("inf"), float("nan")):
        y = x.clone()
        y[2, 1, 3] = bad
        assert wire.pack(7, y).dtype == "bfloat16"
    assert wire.pack(7, x[:0]).rows == 0


def test_check_refuses_inconsistent_rows():
    with pytest.raises(InvalidRequest, match="bytes"):
        Features(0, 2, W, "float16", b"\0" * 3).check()
    with pytest.raises(InvalidRequest, match="dtype"):
        Features(0, 1, W, "float32", b"\0" * 2 * W).check()


def test_the_log_keeps_unsent_rows_and_a_window_and_is_bounded():
    log = FeatureLog(window=4, max_bytes=40 * W * 2)
    log.add(rows(0, 10), sent=0)  # a prompt's rows: all kept for the draft's first call
    assert positions(log.held()) == list(range(10))
    for start in range(10, 16, 2):  # rounds before the draft's first call: the latest 10 rows
        log.add(rows(start, 2), sent=0)
    assert positions(log.held()) == list(range(6, 16))
    log.sent(16)
    assert positions(log.held()) == [12, 13, 14, 15]  # the window a restarted draft gets
    log.add(rows(16, 3), sent=16)
    assert positions(log.since(16)) == [16, 17, 18] and log.held().start == 15
    for start in range(19, 31, 3):  # rounds that call no draft: past the window it starts again after the gap
        log.add(rows(start, 3), sent=19)
    assert positions(log.since(19)) == [27, 28, 29, 30] and log.end == 31
    log.add(rows(29, 4), sent=19)  # rows again from 29 (a target session started again): the later ones
    assert positions(log.held()) == [29, 30, 31, 32]
    log.add(rows(40, 2), sent=19)  # a gap: the rows start again there
    assert positions(log.held()) == [40, 41]
    big = FeatureLog(window=4, max_bytes=8 * W * 2)
    big.add(rows(0, 20), sent=0)
    assert big.held().rows == 8  # and never more than max_bytes


def test_the_log_joins_rows_when_they_are_sent_not_as_they_come():
    log = FeatureLog(window=64)
    for start in range(0, 48, 3):
        log.add(rows(start, 3, "bfloat16" if start == 30 else "float16"), sent=0)
    assert len(log.parts) == 16  # each answer's rows as they came
    held = log.held()
    assert held.dtype == "bfloat16" and positions(held) == list(range(48))  # one dtype a message
    assert positions(log.since(40)) == list(range(40, 48)) and log.since(48) is None
