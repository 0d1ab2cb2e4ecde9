"""Tiny random-weight models for tests and demos, made locally (nothing is downloaded).

    python -m speculative.tiny OUT_DIR [--vocab bpe|chars]

writes OUT_DIR/target and OUT_DIR/draft: two causal LMs of different sizes and
random weights sharing one tokenizer, each a normal Hugging Face folder.
"""

from __future__ import annotations

import argparse
import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

EOS = "<|endoftext|>"
UNK = "<unk>"
CHARS = "abcdefgh ."  # the alphabet of the small-vocabulary tokenizer
# a ChatML-like template for the byte-level BPE tokenizer (its turns end with EOS); raises on an unknown
# role, as real templates do (the coordinator answers INVALID_ARGUMENT)
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{{ m['role'] + ':\n' + m['content'] + '" + EOS + "\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:\n' }}{% endif %}"
)

# a little text to learn byte-level merges from
_CORPUS = [
    "def speculative_round(draft, target, seq):\n    proposal = draft.propose(seq)\n    return target.verify(proposal)\n",
    "The draft proposes tokens; the target verifies them in one forward pass and accepts a prefix.\n",
    "for i in range(10):\n    print(i, i * i)\n",
    string.ascii_letters + string.digits + string.punctuation,
] * 20


def make_tokenizer(out: Path, vocab: str = "bpe", vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """'bpe': byte-level BPE (~vocab_size tokens) with a chat template; 'chars': one token per
    character of CHARS, no chat template."""
    if vocab == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
        tok.train_from_iterator(_CORPUS, trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
        fast.chat_template = CHAT_TEMPLATE
    elif vocab == "chars":
        tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate([EOS, UNK, *CHARS])}, unk_token=UNK))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tok.decoder = decoders.Fuse()
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, unk_token=UNK)
    else:
        raise ValueError(f"unknown vocabulary kind {vocab!r}")
    fast.save_pretrained(out)
    return fast


def make_model(
    out: Path,
    tokenizer: PreTrainedTokenizerFast,
    *,
    arch: str = "llama",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    max_context: int = 512,
    init_std: float = 0.02,
    intermediate: int | None = None,
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> Path:
    """A random-weight causal LM of the given family, saved with its tokenizer (smollm3: every second
    layer without RoPE, so that a 2-layer model has one; its checkpoints have every fourth).

    intermediate: the MLP width (default 2 x hidden); vocab_size: the embedding rows (default the
    tokenizer's; more leaves ids no text maps to); device: where to initialise (a GPU is much
    faster for billions of parameters)."""
    config = AutoConfig.for_model(
        arch,
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_context,
        initializer_range=init_std,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        **({"no_rope_layer_interval": 2} if arch == "smollm3" else {}),
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    with torch.no_grad():  # (Qwen3) the q and k heads' norms start at ones: give them weight
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_pair(out: Path, vocab: str = "bpe", init_std: float = 0.02, arch: str = "llama") -> tuple[Path, Path]:
    """(draft_dir, target_dir): a 1-layer draft and a 2-layer target, different random weights."""
    out = Path(out)
    tokenizer = make_tokenizer(out / "tokenizer", vocab)
    target = make_model(out / "target", tokenizer, arch=arch, hidden=64, layers=2, seed=1, init_std=init_std)
    draft = make_model(out / "draft", tokenizer, arch=arch, hidden=32, layers=1, heads=2, kv_heads=1, seed=2,
                       init_std=init_std)
    return draft, target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="directory to write draft/ and target/ into")
    parser.add_argument("--vocab", choices=["bpe", "chars"], default="bpe", help="tokenizer kind (default bpe)")
    parser.add_argument("--arch", default="llama",
                        help="model family: llama, qwen2, qwen3, mistral, phi3, granite, smollm3 (default llama)")
    args = parser.parse_args()
    draft, target = make_pair(args.out, args.vocab, arch=args.arch)
    print(f"draft: {draft}\ntarget: {target}")


if __name__ == "__main__":
    main()
