"""The corpus, the tokenizer, and the token windows training draws from.

    python -m training corpus      # -> CACHE/corpus/{train,heldout}.txt + corpus.json
    python -m training tokenizer   # -> CACHE/tokenizer/ + CACHE/{train,heldout}.u16

The corpus is the running interpreter's standard library: every .py file under
sysconfig's "stdlib" path except site-packages / dist-packages, in sorted order,
decoded as UTF-8 (the few files that are not are skipped and counted). A seeded
shuffle of the file list puts ~2% of the FILES in the held-out split, so held-out
loss measures code the models never saw. Files are joined with EOS between them.
"""

from __future__ import annotations

import json
import random
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
SEED = 1234
HELDOUT_FRACTION = 0.02


def stdlib_files() -> tuple[Path, list[Path]]:
    """(stdlib root, its .py files in sorted order, third-party packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    excluded = {"site-packages", "dist-packages"}
    files = sorted(p for p in root.rglob("*.py") if not excluded & set(p.relative_to(root).parts) and p.is_file())
    return root, files


def build_corpus(out: Path, max_files: int | None = None) -> dict:
    """Write out/{train,heldout}.txt (files joined by EOS) and out/corpus.json; return the latter."""
    root, files = stdlib_files()
    texts, skipped = {}, []
    for path in files:
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(str(path.relative_to(root)))
            continue
        if EOS in text:  # would be read back as a file boundary
            skipped.append(str(path.relative_to(root)))
            continue
        texts[str(path.relative_to(root))] = text
    names = sorted(texts)
    if max_files:  # smoke runs: an evenly spread subset
        names = names[:: max(1, len(names) // max_files)][:max_files]
    shuffled = names[:]
    random.Random(SEED).shuffle(shuffled)
    n_heldout = max(1, round(HELDOUT_FRACTION * len(names)))
    heldout = sorted(shuffled[:n_heldout])
    train = sorted(shuffled[n_heldout:])
    out.mkdir(parents=True, exist_ok=True)
    for split, split_names in (("train", train), ("heldout", heldout)):
        (out / f"{split}.txt").write_text(EOS.join(texts[n] for n in split_names), encoding="utf-8")
    info = {
        "python_version": sys.version.split()[0],
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "stdlib": str(root),
        "seed": SEED,
        "files": len(names),
        "train_files": len(train),
        "heldout_files": len(heldout),
        "skipped_files": skipped,
        "train_bytes": sum(len(texts[n].encode()) for n in train),
        "heldout_bytes": sum(len(texts[n].encode()) for n in heldout),
        "heldout": heldout,
    }
    (out / "corpus.json").write_text(json.dumps(info, indent=1))
    return info


def read_split(corpus_dir: Path, split: str) -> list[str]:
    return (corpus_dir / f"{split}.txt").read_text(encoding="utf-8").split(EOS)


def train_tokenizer(corpus_dir: Path, out: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE learnt on the train split only; EOS is id 0 and serves as bos / pad too."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(read_split(corpus_dir, "train"), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS)
    fast.model_max_length = 1024
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return fast


def tokenize_split(tokenizer: PreTrainedTokenizerFast, corpus_dir: Path, split: str, out: Path) -> int:
    """Encode each file, join with the EOS id, save as uint16; return the token count."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for i, enc in enumerate(tokenizer.backend_tokenizer.encode_batch(read_split(corpus_dir, split))):
        if i:
            ids.append(eos)
        ids.extend(enc.ids)
    assert len(tokenizer) <= 1 << 16
    np.asarray(ids, dtype=np.uint16).tofile(out)
    return len(ids)


def load_tokens(path: Path) -> torch.Tensor:
    """A .u16 token file -> int64 tensor [N]."""
    return torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int64))


def random_windows(tokens: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """batch windows of length + 1 tokens at uniform random offsets: [B, T+1] (inputs [:, :-1], labels [:, 1:])."""
    starts = torch.randint(0, tokens.numel() - length - 1, (batch,), generator=generator)
    return torch.stack([tokens[s : s + length + 1] for s in starts.tolist()])


def heldout_windows(tokens: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """count evenly spaced, non-random windows of the held-out stream: [count, T+1]."""
    span = tokens.numel() - length - 1
    starts = torch.linspace(0, span, count).long()
    return torch.stack([tokens[s : s + length + 1] for s in starts.tolist()])
