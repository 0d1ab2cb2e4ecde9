"""specdec's int4 CPU kernel (csrc/q4_mm.cpp): `torch.ops.specdec.q4_mm(x, tiles, out)`, built for
this machine's CPU by torch's own extension builder (a C++ compiler and ninja), and a reference of
the same arithmetic in torch for where it cannot be built.

Why a kernel of our own: torch's `_weight_int4pack_mm_for_cpu` turns every weight into a float and
multiplies it by a bf16 activation: one row of SmolLM2-135M's products took 4.3 ms a pass on a
2-core AMD EPYC, at ~18 GB/s, and five rows 14 ms (each row another pass over the weights). This
one quantizes each activation block of 32 to int8, as llama.cpp does against its Q4 weights, and
multiplies 4-bit by 8-bit integers in one instruction (vpdpbusd), 16 outputs at a time, every row
against one read of the weights: the same products 1.8 ms for one row and 5.1 for five there (see
docs/performance.md). The weights keep GGUF Q4_1's numbers as they shipped (d and m in float16).

The same source holds specdec's float32 product, `torch.ops.specdec.f32_mm(x, panels, out)`:
float32 weights in panels of 16 outputs (panel()), each streamed once, prefetched ahead, for every
row of a pass, and a row computed by the same operations whatever it is batched with.
FastForward.pack keeps float32 weights on CPU in panels where the kernel builds (`--float-kernel`), and a
pass then runs its layers in the C++ loop as int4 does: SmolLM2-135M's five-token pass ~1.1x its
one-token pass, where oneDNN's packed product made it ~1.4x (docs/performance.md).

The ops' schemas are defined here on import, so TorchScript code that names it compiles whether or
not the kernel is loaded; `load()` adds the kernel, and is called only where int4 asks for it
(int4.quantize), so a service without int4 neither builds nor loads it. `make setup`
builds it (`python -m model_service.q4_kernel`); a process loads what was built, or builds it the
first time (~10 s). The build is keyed by this CPU's instruction sets (it is compiled with
-march=native): a machine of another kind builds its own. Where there is no compiler, `load()`
records why, the reference becomes the op's CPU kernel (`available()` is then False), and
`--quantize int4` keeps torch's kernel, saying so.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import torch

from speculative.sampling import logits_to_probs

SOURCE = Path(__file__).parent / "csrc" / "q4_mm.cpp"
TILE = 16  # outputs a tile
STALE_LOCK_S = 300  # a build takes ~10 s: a build lock this old was left by a killed build
BLOCK_BYTES = 320  # a tile's block of 32 inputs: d, m (16 float16 each) and 256 bytes of nibbles

_lock = threading.Lock()
_state: dict[str, object] = {}
# "built": bool, "why": str (when not), "path": the CPU path compiled, "threaded": built with OpenMP

# the schema (csrc/q4_mm.cpp adds the CPU kernel to it); kept alive with the module
_library = torch.library.Library("specdec", "FRAGMENT")
_library.define("q4_mm(Tensor x, Tensor blocks, int n) -> Tensor")
# float32 weights in panels of 16 outputs (csrc/q4_mm.cpp: f32_mm; FastForward.pack on CPU)
_library.define("f32_mm(Tensor x, Tensor panels, int n) -> Tensor")
# FastForward's layer loop for sequences whose every linear is in tiles (csrc/q4_mm.cpp)
_library.define("q4_layers(Tensor x, Tensor cos, Tensor sin, Tensor(a!)[] kv, int[] starts, int[] lengths, int[] keeps,"
                " int heads, int kv_heads,"
                " int head_dim, float eps, float[] scaling, Tensor[] in_norm, Tensor[] post_norm, int[] half,"
                " Tensor?[] qkv_bias, Tensor[] tiles, int[] outs, Tensor? final_norm=None, Tensor? head=None,"
                " int head_out=0, int[]? ids=None, Tensor? qk_norm=None, int window=0, int[]? rope=None) -> Tensor")
# (with a head, its tiles or panels, and final_norm: the kept rows' logits [R, head_out], not their states;
# with ids, the rows' token ids: x is the embedding table and cos and sin the RoPE tables they index;
# qk_norm [L, 2, head_dim] where the model norms each q and k head before RoPE (Qwen3): each layer's q's, k's;
# window > 0: each row sees only the last `window` keys up to its own, a sliding window (Mistral, Phi-3);
# rope: per layer, 1 where RoPE rotates its q and k, 0 where not (SmolLM3's NoPE layers); None: every layer)
# the same, and the inputs of the `capture` layers for every row ([T, len(capture), D]: an EAGLE head's features)
_library.define("q4_layers_capturing(Tensor x, Tensor cos, Tensor sin, Tensor(a!)[] kv, int[] starts, int[] lengths,"
                " int[] keeps, int heads, int kv_heads, int head_dim, float eps, float[] scaling, Tensor[] in_norm,"
                " Tensor[] post_norm, int[] half, Tensor?[] qkv_bias, Tensor[] tiles, int[] outs, int[] capture,"
                " Tensor? final_norm=None, Tensor? head=None, int head_out=0, int[]? ids=None, Tensor? qk_norm=None,"
                " int window=0, int[]? rope=None) -> (Tensor, Tensor)")
# the loop's output layer on its own: rows -> RMSNorm -> head (tiles or panels) -> logits (csrc/q4_mm.cpp)
_library.define("q4_output(Tensor x, Tensor final_norm, Tensor head, int head_out, float eps) -> Tensor")
# an EAGLE-3 head's step (Eagle3Head.step / step_many) with every linear in tiles (csrc/q4_mm.cpp)
_library.define("q4_eagle_step(Tensor embeds, Tensor hidden, Tensor cos, Tensor sin, Tensor(a!)[] keys,"
                " Tensor(b!)[] values, int[] pasts, int[] lengths, int heads, int kv_heads, int head_dim, float eps,"
                " float scale, bool norm_before_residual, Tensor[] norms, Tensor[] tiles, int[] outs, bool logits)"
                " -> (Tensor, Tensor)")
# up to k draft tokens per sequence, greedy or sampled, a q4_eagle_step each (EagleDraft's draft loop in one call)
_library.define("q4_eagle_draft(Tensor hidden, Tensor table, Tensor cos, Tensor sin, Tensor(a!)[] keys,"
                " Tensor(b!)[] values, int[] pasts, int[] positions, int[] ks, float[] p_mins, Tensor? known,"
                " Tensor target_ids, int heads, int kv_heads, int head_dim, float eps, float scale,"
                " bool norm_before_residual, Tensor[] norms, Tensor[] tiles, int[] outs, float[] temperatures,"
                " int[] top_ks, float[] top_ps, float[] min_ps, int max_support, Tensor? uniforms)"
                " -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
# a sampled draft token's q from one float32 row of logits (speculative.sampling.draft_token's support)
_library.define("q4_draft_support(Tensor row, float temperature, int top_k, float top_p, float min_p, int max_support,"
                " float p_min, Tensor? allowed=None) -> (Tensor, Tensor)")
# the target's p from float32 logits [..., V] (speculative.sampling.logits_to_probs, sampled), and a draw from p
_library.define("q4_target_probs(Tensor logits, float temperature, int top_k, float top_p, float min_p) -> Tensor")
_library.define("q4_sample(Tensor probs, float u) -> int")


def cflags(openmp: bool = True) -> list[str]:
    """What the kernel is compiled with: for this CPU, with OpenMP (`openmp`), plus
    $SPECDEC_Q4_CFLAGS (e.g. "-mno-avx512f" builds the AVX2 path on an AVX-512 machine: the tests
    build every path so).

    OpenMP is what makes ATen's `at::parallel_for` in the kernel's source split its work across
    torch's threads: the function is a header template, and compiled without -fopenmp it runs the
    whole range on the calling thread (every int4 pass then used one core). The OpenMP calls resolve
    against the runtime torch itself loaded (libtorch_cpu's libgomp), so one thread pool serves both;
    where the compiler has no OpenMP, load() builds without it."""
    return ["-O3", "-march=native", "-ffp-contract=off", *(["-fopenmp"] if openmp else []),
            *os.environ.get("SPECDEC_Q4_CFLAGS", "").split()]


def _cpu_key(openmp: bool = True) -> str:
    """A digest of this CPU's model and instruction sets (what -march=native compiles for) and the
    flags."""
    flags = " ".join(cflags(openmp)) + "\n"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip() and flags.count("\n") > 1:
                break  # the first processor's block is read
            if line.startswith(("flags", "model name", "Features", "CPU part")):
                flags += line + "\n"
    except OSError:
        import platform

        flags += platform.processor() + platform.machine()
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def build_directory(openmp: bool = True) -> Path:
    """Where the extension is built: $SPECDEC_EXTENSIONS, else torch's extensions directory."""
    from torch.utils.cpp_extension import _get_build_directory

    name = f"specdec_q4_{_cpu_key(openmp)}"
    root = os.environ.get("SPECDEC_EXTENSIONS")
    if root:
        path = Path(root) / name
        path.mkdir(parents=True, exist_ok=True)
        return path
    return Path(_get_build_directory(name, verbose=False))


def load() -> bool:
    """Load (building first where needed) the kernel into this process; -> whether it runs.
    Idempotent; a failure is recorded (path() says why) and makes the reference the op's kernel."""
    with _lock:
        if "built" in _state:
            return bool(_state["built"])
        errors = []
        for openmp in (True, False):  # without OpenMP only where the compiler has none
            try:
                _build(openmp)
                _state.update(built=True, path=torch.ops.specdec.q4_path(), threaded=torch.ops.specdec.q4_threaded())
                break
            except Exception as error:  # noqa: BLE001 - no compiler, no ninja, an unknown CPU: torch's kernel stays
                lines = str(error).strip().splitlines() or [""]
                errors.append(f"{type(error).__name__}: {lines[-1][:300]}")
        else:
            _state.update(built=False, why=errors[-1])
            _library.impl("q4_mm", reference_mm, "CPU")
            _library.impl("f32_mm", reference_f32_mm, "CPU")
        return bool(_state["built"])


def _build(openmp: bool) -> None:
    from torch.utils.cpp_extension import load as load_extension

    if shutil.which("ninja") is None:  # the venv's own (pip's ninja), when its bin is not on PATH
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    directory = build_directory(openmp)
    wait_for_build_lock(directory / "lock")
    load_extension(name=directory.name, sources=[str(SOURCE)], build_directory=str(directory),
                   extra_cflags=cflags(openmp), is_python_module=False, verbose=False)


def draft_support(row: torch.Tensor, params, p_min: float, max_support: int,
                  allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """speculative.sampling.draft_token's q for a sampled draft token from one row of logits [V] in one
    call of the kernel (q4_draft_support: the top `max_support` ids by one heap pass, top-k's mass in one
    vectorised sum of exponentials): -> (ids, q), or None where the draft stops. The row must be on the CPU
    and the kernel built (`available()`). The distilled draft's sampled K = 4 call over SmolLM2's 49,152 ids
    (int4, 1 Xeon core): 5.33 -> ~4.1 ms against torch's ops."""
    ids, q = torch.ops.specdec.q4_draft_support(row.float(), float(params.temperature), int(params.top_k),
                                                float(params.top_p), float(params.min_p), max_support, float(p_min),
                                                allowed)
    return (ids, q) if ids.numel() else None


def draft_support_on(device: torch.device | str):
    """draft_support where a draft's rows are on the CPU and the kernel is built, else None (then
    draft_token computes q with torch's ops)."""
    return draft_support if _runs_on(device) else None


def target_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """speculative.sampling.logits_to_probs for sampled params (temperature > 0) in one call of the kernel
    (q4_target_probs: the softmax's exponentials vectorised; top-p's cut sought among the tokens of
    probability >= 1e-3 first, not a torch.topk of 256): logits [..., V] on the CPU, float32 out. Greedy
    params: logits_to_probs' one-hot."""
    if params.greedy:
        return logits_to_probs(logits, params)
    return torch.ops.specdec.q4_target_probs(logits.float(), float(params.temperature), int(params.top_k),
                                             float(params.top_p), float(params.min_p))


def draw(probs: torch.Tensor, u: float) -> int:
    """speculative.sampling.sample's draw from p [V] (float32, on the CPU) with the uniform u in one call of the
    kernel (q4_sample: sums 16 ids at a time, then id by id in the block the draw lies in). -> the id, or -1
    where p's total is not a positive finite number."""
    return torch.ops.specdec.q4_sample(probs, u)


def sampling_on(device: torch.device | str):
    """(target_probs, draw) where the target's rows are on the CPU and the kernel is built, else (None, None)
    (then speculative.sampling computes p and draws with torch's ops)."""
    return (target_probs, draw) if _runs_on(device) else (None, None)


def _runs_on(device: torch.device | str) -> bool:
    """Whether the kernel's ops serve rows on `device`: the CPU, with the kernel built."""
    return torch.device(device).type == "cpu" and available()


def wait_for_build_lock(lock: Path, stale_s: float = STALE_LOCK_S, poll_s: float = 0.5) -> None:
    """Wait while another process's build holds torch's build lock `lock` (its FileBaton: made when a
    build starts, removed when it ends); remove it once it is `stale_s` old. A killed build leaves it
    behind, and torch's own wait for it never ends: a service or test started within `stale_s` of one
    (a run interrupted while it built the kernel) hung there until someone removed it."""
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > stale_s:
            lock.unlink(missing_ok=True)
            return
        time.sleep(poll_s)


def threaded() -> bool:
    """Whether the built kernel splits its work across torch's threads (built with OpenMP)."""
    return bool(load() and _state.get("threaded"))


def available() -> bool:
    return load()


def path() -> str:
    """The instruction path compiled ("avx512_vnni", "avx512", "avx2", "scalar"), or why there is none."""
    return str(_state["path"]) if load() else f"not built: {_state['why']}"


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> the kernel's activations: a [M, K / 32, 32] (integers in -127..127, as float64),
    s [M, K / 32] (max|x| / 127 of each block), the float sum of each block [M, K / 32]; a =
    round-half-even(x / s), 0 where s is 0."""
    x = x.float()
    blocks = x.reshape(x.shape[0], -1, 32)
    s = blocks.abs().amax(-1) / 127
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    return torch.round(blocks * inv[..., None]).double(), s, blocks.sum(-1)


def reference_mm(x: torch.Tensor, tiles: torch.Tensor, out: int) -> torch.Tensor:
    """What q4_mm computes, in float64 from the tiles (tests; where the kernel is not built)."""
    q, d, m = untile(tiles, x.shape[1], out)
    a, s, sums = quantize_rows(x)
    dots = torch.einsum("rbj,nbj->rnb", a, q.reshape(out, -1, 32).double())  # [M, N, nb]
    y = (dots * d.double()[None] * s.double()[:, None]).sum(-1) + sums.double() @ m.double().t()
    return y.to(x.dtype)


class Panels(NamedTuple):
    """A float32 weight [in, out] in the kernel's panels (panel()): `torch.ops.specdec.f32_mm(x,
    tiles, out)` reads it once for every row of x (FastForward.pack, float32 on CPU)."""

    tiles: torch.Tensor  # [ceil(out / 16), in * 16] float32
    out: int


def panel(w: torch.Tensor) -> Panels:
    """w [in, out] float32 -> the kernel's panels (see csrc/q4_mm.cpp, f32_mm): outputs in panels of
    16, each panel's inputs in order, 16 floats an input (w[k][16 p ... 16 p + 15]); the last
    panel's missing outputs are zeros."""
    k, n = w.shape
    count = -(-n // TILE)
    padded = torch.nn.functional.pad(w.float(), (0, count * TILE - n))
    return Panels(padded.reshape(k, count, TILE).transpose(0, 1).reshape(count, k * TILE).contiguous(), n)


def unpanel(tiles: torch.Tensor, n: int) -> torch.Tensor:
    """panel's inverse: the weights [in, n]."""
    count = tiles.shape[0]
    return tiles.reshape(count, -1, TILE).transpose(0, 1).reshape(-1, count * TILE)[:, :n]


def reference_f32_mm(x: torch.Tensor, tiles: torch.Tensor, out: int) -> torch.Tensor:
    """What f32_mm computes, in float64 (tests; where the kernel is not built)."""
    return (x.double() @ unpanel(tiles, out).double()).to(x.dtype)


def tile(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Weights w = d * q + m (q [N, K] in 0..15, d and m [N, K / 32], stored as float16) -> the
    kernel's layout [ceil(N / 16), K / 32 * 320] uint8 (see csrc/q4_mm.cpp): per tile of 16
    outputs and block of 32 inputs, d [16] and m [16] float16, then 4 chunks of 64 bytes whose byte
    4 i + j holds q[i][4 c + j] (low nibble) and q[i][16 + 4 c + j] (high). Missing outputs of the
    last tile are zeros."""
    n, k = q.shape
    nb, tiles = k // 32, -(-n // TILE)
    pad = tiles * TILE - n
    q = torch.nn.functional.pad(q.to(torch.uint8), (0, 0, 0, pad))
    d, m = (torch.nn.functional.pad(t.to(torch.float16), (0, 0, 0, pad)) for t in (d, m))
    blocks = q.reshape(tiles, TILE, nb, 32).permute(0, 2, 1, 3)  # [tile, block, output i, input]
    low, high = (blocks[..., h * 16:(h + 1) * 16].reshape(tiles, nb, TILE, 4, 4) for h in (0, 1))  # [.., i, c, j]
    nibbles = (low | (high << 4)).permute(0, 1, 3, 2, 4).reshape(tiles, nb, 256)  # [.., c, i, j]
    d, m = (t.reshape(tiles, TILE, nb).transpose(1, 2).contiguous().view(torch.uint8) for t in (d, m))
    return torch.cat([d, m, nibbles], dim=-1).reshape(tiles, nb * BLOCK_BYTES).contiguous()


def untile(tiles: torch.Tensor, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tile's inverse: -> q [n, k] (uint8), d, m [n, k / 32] (float16)."""
    nb, count = k // 32, tiles.shape[0]
    blocks = tiles.reshape(count, nb, BLOCK_BYTES)
    d, m = (blocks[..., s:s + 32].contiguous().view(torch.float16).transpose(1, 2).reshape(count * TILE, nb)
            for s in (0, 32))
    nibbles = blocks[..., 64:].reshape(count, nb, 4, TILE, 4).permute(0, 1, 3, 2, 4)  # [.., i, c, j]
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-2)  # [tile, block, i, 2 * 4 chunks, j]: q[4 c + j], q[16 + ...]
    q = q.reshape(count, nb, TILE, 32).permute(0, 2, 1, 3).reshape(count * TILE, k)
    return q[:n].contiguous(), d[:n].contiguous(), m[:n].contiguous()


def dequantized(tiles: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """The weights [k, n] (the [in, out] of FastForward) tiles stand for, in float32."""
    q, d, m = untile(tiles, k, n)
    w = q.reshape(n, -1, 32).float() * d.float()[..., None] + m.float()[..., None]
    return w.reshape(n, k).t()


if __name__ == "__main__":  # make setup: build it now rather than at a service's start
    ok = load()
    where = build_directory(threaded()) if ok else "torch kernel stays"
    print(f"specdec int4 kernel: {path()}{', OpenMP' if threaded() else ''} ({where})")
    sys.exit(0)
