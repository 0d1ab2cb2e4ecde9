"""Loading a model's weights for one rank: the whole model, or only the slices a tensor-parallel rank keeps.

    loaded = load_model(model_dir, torch.bfloat16, torch.device("cuda", 0), rank=1, world=4)
    fast = FastForward.build(loaded.model, max_context)
    adopt_shard(fast, loaded.world, loaded.logits_size)   # where loaded.world > 1 (sharding.py)

A tensor-parallel target is sharded because it does not fit one device; a rank that read the
whole checkpoint before sharding it would need the whole model's host memory, once per rank. So
a rank reads only its slices of each weight (safetensors' `get_slice`), straight into the target
dtype on its device, and its peak host memory is its shard plus one tensor. The model's skeleton
is built on the meta device (no memory), its parameters then replaced by the slices and its
rotary embedding, whose frequencies are not in the checkpoint, built again for real.

The split is Megatron's, as `sharding.shard` makes it from a whole model, written here in the
checkpoint's names (a weight is [out, in]):

    q_proj, k_proj, v_proj, gate_proj, up_proj   rows (output features): 1/world each
    qkv_proj, gate_up_proj (Phi-3)               rows: 1/world of each section (q, k, v; gate, up)
    o_proj, down_proj                            columns (input features): 1/world each
    lm_head                                      rows (vocabulary): ceil(V / world), the last rank's
                                                 block padded with zero rows
    embed_tokens, norms                          whole

TP = 1, and a checkpoint that is not safetensors, load the whole model with transformers'
`from_pretrained` (on the host; the caller shards it and moves it). `LoadMeter` measures a load's
time and peak resident memory, which the service logs at start-up and reports in its model card.
"""

from __future__ import annotations

import ctypes
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("specdec.load")

SPLIT = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1,
         "qkv_proj": 0, "gate_up_proj": 0}


def sections(owner: str, config) -> list[int]:
    """The row sections of a weight whose rows are several weights' (Phi-3's qkv_proj: q, k, v;
    gate_up_proj: gate, up), each split over the ranks as its own weight is; [] for any other weight."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if owner == "qkv_proj":
        return [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    if owner == "gate_up_proj":
        return [config.intermediate_size] * 2
    return []


@dataclass
class Loaded:
    model: torch.nn.Module  # in eval mode; where world > 1 its linears and output layer hold one rank's slices
    world: int  # ranks the weights are split over: 1 where the whole model was loaded
    num_parameters: int  # of the whole model
    logits_size: int  # rows of the whole output layer


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device, rank: int = 0, world: int = 1) -> Loaded:
    """Rank `rank` of `world`'s part of the model in `path`: its slices, on `device`, in `dtype`
    (from safetensors files); or, for world 1 or a checkpoint that is not safetensors, the whole
    model on the host."""
    path = Path(path)
    files = safetensors_files(path) if world > 1 else None
    if files is None:
        if world > 1:
            log.warning("%s has no safetensors checkpoint: rank %d loads the whole model before sharding it",
                        path, rank)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).eval()
        return Loaded(model, 1, sum(p.numel() for p in model.parameters()),
                      model.get_output_embeddings().weight.shape[0])
    return _load_slices(path, files, dtype, device, rank, world)


def mapped_checkpoints(under: Path | None = None) -> list[tuple[int, int]]:
    """Address spans of the safetensors files (those under `under`, if given) mapped into this
    process: [(start, end)], from /proc/self/maps (Linux; elsewhere none)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    prefix = str(under.resolve()) if under is not None else ""
    spans = []
    for line in maps:
        fields = line.split()
        if len(fields) >= 6 and fields[-1].endswith(".safetensors") and fields[-1].startswith(prefix):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            spans.append((lo, hi))
    return spans


def release_checkpoint_maps(model: torch.nn.Module) -> int:
    """Copy into the process's own memory every parameter and buffer that still lies in a mapped
    checkpoint file (Linux; elsewhere nothing). -> bytes copied.

    `from_pretrained` maps safetensors files and its tensors are views of those pages; once the
    lean forward has made its own fused copies of the big weights, a few small tensors (the
    norms) are all that is left there, yet they keep the whole file mapped and its pages
    resident: on SmolLM2 (538 MB of float32) a target served with 2.0 GB of RSS, 0.55 GB of it
    the file. Copying those few and dropping the last reference unmaps it."""
    spans = mapped_checkpoints()
    if not spans:
        return 0
    copied = 0
    with torch.no_grad():
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for tensor in table.values():
                    if tensor is None or tensor.device.type != "cpu" or tensor.numel() == 0:
                        continue
                    start = tensor.untyped_storage().data_ptr()
                    if any(lo <= start < hi for lo, hi in spans):
                        tensor.data = tensor.data.clone()
                        copied += tensor.numel() * tensor.element_size()
    return copied


def return_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's `malloc_trim`; elsewhere nothing).

    A load frees much (the float weights a quantized or fused forward replaced), but glibc keeps
    freed blocks below its mmap threshold in the heap, counted in RSS: after `--quantize int4`
    the SmolLM2 target held 1.37 GB resident, 0.58 GB once trimmed."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def safetensors_files(path: Path) -> dict[str, Path] | None:
    """Checkpoint name -> the safetensors file holding it (model.safetensors, or the files of
    model.safetensors.index.json); None where the directory has neither."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {name: path / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    return None


def read_slice(file: Path, name: str, dim: int | None, start: int, stop: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) start..stop of tensor `name`, or all of it (dim None), as a
    tensor of its own on `device`. The file is opened for this tensor alone: safetensors maps it
    into memory, and every page a slice touches stays resident while the mapping lives."""
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        view = f.get_slice(name)  # a view of the mapped file: nothing is read yet
        part = view[:] if dim is None else view[start:stop] if dim == 0 else view[:, start:stop]
        return part.to(device=device, dtype=dtype, copy=True).contiguous()


def _load_slices(path: Path, files: dict[str, Path], dtype: torch.dtype, device: torch.device, rank: int,
                 world: int) -> Loaded:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from .sharding import check_shardable

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    check_shardable(config, world)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    num_parameters = sum(p.numel() for p in model.parameters())
    names = {module: name for name, module in model.named_modules()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    head_name = names[head] + ".weight"
    vocab, hidden = head.weight.shape
    tied = head.weight is embed.weight

    def place(name: str, tensor: torch.Tensor, buffer: bool = False) -> None:
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if buffer:  # persistent: the checkpoint holds it
            module.register_buffer(leaf, tensor)
        else:
            setattr(module, leaf, torch.nn.Parameter(tensor, requires_grad=False))

    def source(name: str) -> Path:
        if name not in files:
            raise ValueError(f"{path}: the checkpoint has no {name}")
        return files[name]

    for name, param in model.named_parameters(remove_duplicate=False):
        if name == head_name:
            continue
        owner = name.rsplit(".", 2)[-2]
        dim = SPLIT.get(owner)
        if dim is None:
            place(name, read_slice(source(name), name, None, 0, 0, dtype, device))
            continue
        parts, offset = [], 0  # this rank's 1/world of the split dimension (of each section's rows)
        for whole in sections(owner, config) or [param.shape[dim]]:
            size = whole // world
            start = offset + rank * size
            parts.append(read_slice(source(name), name, dim, start, start + size, dtype, device))
            offset += whole
        place(name, parts[0] if len(parts) == 1 else torch.cat(parts))
    for name, buffer in model.named_buffers():
        if buffer.is_meta and name in files:  # a persistent buffer the checkpoint holds
            place(name, read_slice(files[name], name, None, 0, 0, dtype, device), buffer=True)

    # the output layer: this rank's block of ceil(V / world) vocabulary rows, the last one padded
    # with zero rows; where it is tied to the embedding, read from the embedding's rows (the head
    # becomes a tensor of its own: the embedding stays whole)
    width = -(-vocab // world)
    start, stop = min(rank * width, vocab), min((rank + 1) * width, vocab)
    head_source = head_name if head_name in files or not tied else names[embed] + ".weight"
    block = torch.zeros(width, hidden, dtype=dtype, device=device)
    if stop > start:
        block[: stop - start] = read_slice(source(head_source), head_source, 0, start, stop, dtype, device)
    head.weight = torch.nn.Parameter(block, requires_grad=False)

    # the rotary embedding's frequencies are computed, not stored: build the module again off meta
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)) and hasattr(module, "rope_type"):
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, type(module)(config=model.config).to(device))
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"{path}: rank {rank} could not load {', '.join(left)} from its checkpoint")
    return Loaded(model.eval(), world, num_parameters, vocab)


def import_model_code(path: str | Path) -> None:
    """Import the transformers code of the model in `path` (for Llama ~1 s and ~100 MB of resident
    memory), so that a LoadMeter around `load_model` measures the weights, not the code."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(path, local_files_only=True))]
    except (KeyError, ValueError):  # a model transformers does not ship: its code loads with it
        pass


def _status_mb(field: str) -> float:
    """A field of /proc/self/status (VmRSS, VmHWM), MB; 0 where there is none (not Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class LoadMeter:
    """`with LoadMeter() as meter:` -> meter.seconds, the time it took, and meter.peak_rss_mb, how far
    this process's resident memory rose above what it held at the start: the high-water mark
    (VmHWM) at the end less the resident set (VmRSS) at the start. Exact where the load raised the
    process's high-water mark, as in a fresh service or rank process; an upper bound where the
    process had been higher before. The mark is not reset, so other readers of it are unaffected."""

    def __enter__(self) -> LoadMeter:
        self.seconds, self.peak_rss_mb = 0.0, 0.0
        self._rss = _status_mb("VmRSS")
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._start
        self.peak_rss_mb = max(0.0, _status_mb("VmHWM") - self._rss)

    def record(self) -> dict:
        """-> ModelInfo's RankLoad, as a dict."""
        return {"load_seconds": round(self.seconds, 3), "peak_rss_mb": round(self.peak_rss_mb, 1)}


def describe(loads: list[dict]) -> str:
    """The ranks' load records in a line: 'rank 0 2.10 s, +380 MB peak RSS; rank 1 ...'."""
    return "; ".join(f"rank {rank} {load['load_seconds']:.2f} s, +{load['peak_rss_mb']:.0f} MB peak RSS"
                     for rank, load in enumerate(loads))
