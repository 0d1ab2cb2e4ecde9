"""The GPU checks run only where `pytest --device cuda` names a GPU that is there (make test-gpu);
elsewhere (CI, these 2-core machines) they skip."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def device(request) -> str:
    name = request.config.getoption("--device")
    if not name.startswith("cuda"):
        pytest.skip("GPU checks: run with --device cuda (make test-gpu)")
    if not torch.cuda.is_available():
        pytest.fail(f"--device {name}, but torch sees no GPU")
    return name
