"""The two model shapes and the quantities they are trained and judged on.

Shapes (vocab V = 8192, tied input / output embeddings, so the V x d matrix is counted once):
  target  d=384, 6 layers, 6 heads of 64, SwiGLU width 1024:
          V*d + L*(4*d^2 + 3*d*ff + 2*d) + d = 3,145,728 + 6*1,770,240 + 384 = 13,767,552 parameters
  draft   d=160, 2 layers, 5 heads of 32, SwiGLU width 480:
          1,310,720 + 2*333,120 + 160 = 1,977,120 parameters  (<= 2 M)

Losses, per position t of a window, with p the target's and q the draft's next-token distribution:
  cross_entropy   -log p(x_{t+1})                      (the target's pre-training loss)
  forward_kl      KL(p || q) = sum_v p(v) (log p(v) - log q(v))  (distillation at temperature 1, full vocab)
  agreement       [argmax p == argmax q]               (what greedy speculative decoding accepts)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    ffn: int


TARGET = Shape(hidden=384, layers=6, heads=6, ffn=1024)
DRAFT = Shape(hidden=160, layers=2, heads=5, ffn=480)


def llama_config(shape: Shape, vocab_size: int, eos_id: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def build(shape: Shape, vocab_size: int, eos_id: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(shape, vocab_size, eos_id))


def num_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters: a tied embedding counts once."""
    return sum(p.numel() for p in model.parameters())


def shape_dict(shape: Shape) -> dict:
    return asdict(shape)


def logits_of(model: LlamaForCausalLM, inputs: torch.Tensor) -> torch.Tensor:
    """inputs: [B, T] -> logits: [B, T, V] float32."""
    return model(input_ids=inputs).logits.float()


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logits: [B, T, V], labels: [B, T] -> mean -log p(label)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def forward_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """mean over positions of KL(p || q), p = softmax(teacher), q = softmax(student): [B, T, V] -> scalar."""
    log_p = F.log_softmax(teacher_logits, dim=-1)
    log_q = F.log_softmax(student_logits, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


def agreement(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """fraction of positions where argmax p == argmax q: [B, T, V] -> scalar."""
    return (teacher_logits.argmax(-1) == student_logits.argmax(-1)).float().mean()


def one_minus_tv(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """mean 1 - TV(p, q) = sum_v min(p, q): the acceptance probability of one sampled draft token."""
    p, q = teacher_logits.softmax(-1), student_logits.softmax(-1)
    return torch.minimum(p, q).sum(-1).mean()
