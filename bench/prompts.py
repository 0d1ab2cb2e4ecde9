"""The benches' held-out chat prompts: `python -m training distill` never trains on these.

Sixteen questions of the kinds a chat model is asked (facts, explanations, code, advice,
writing), each sent as one user message through the target's chat template.
"""

CHAT = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain how photosynthesis works to a ten-year-old.",
    "What are three tips for staying focused while studying?",
    "Give me a short recipe for pancakes.",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "What is the difference between a list and a tuple in Python?",
    "How does a bicycle stay upright when it moves?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "What should I pack for a weekend hiking trip?",
    "Explain what a black hole is.",
    "How do I reverse a string in JavaScript?",
    "What are the health benefits of drinking water?",
    "Write a polite email asking my manager for a day off.",
    "Describe the water cycle step by step.",
]


def normalized(text: str) -> str:
    """The form two prompts are compared in to keep held-out prompts out of training."""
    return " ".join("".join(c for c in text.lower() if c.isalnum() or c.isspace()).split())


HELD_OUT = frozenset(normalized(p) for p in CHAT)
