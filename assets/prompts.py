"""The benches' held-out chat prompts: `python -m training distill` never trains on these (HELD_OUT).

Sixteen questions of the kinds a chat model is asked (CHAT: facts, explanations, code, advice,
writing), each sent as one user message through the target's chat template; and eight
input-grounded requests (GROUNDED: rewrite, sort, fix, rename what the prompt holds), on which
copying from the context pays (the n-gram draft's rows, bench/ngram.py).
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

# Input-grounded requests (the n-gram draft's rows): each holds the material its answer copies.
GROUNDED = [
    "Rewrite this function with type hints:\n\ndef merge_counts(first, second):\n    result = dict(first)\n"
    "    for key, value in second.items():\n        result[key] = result.get(key, 0) + value\n    return result\n",
    "Repeat this list sorted alphabetically: banana, cherry, apple, mango, grape, kiwi, lemon, orange, peach, pear.",
    "Fix the typo in this paragraph: The quick brown fox jumps over the lazzy dog. It then runs into the forest,"
    " where it finds a small stream and drinks from it before resting under a tall oak tree.",
    "Add a docstring to this function:\n\ndef average(numbers):\n    if not numbers:\n        return 0.0\n"
    "    return sum(numbers) / len(numbers)\n",
    "Turn this list into a numbered list:\n- Buy milk\n- Call the plumber\n- Water the plants\n"
    "- Pay the electricity bill\n- Book a dentist appointment",
    "Rename the variable x to total in this code:\n\nx = 0\nfor price in prices:\n    x = x + price\nprint(x)\n",
    "Rewrite this email with the name Tom changed to Anna:\n\nHi Tom,\nThank you for your message. I will send"
    " the report by Friday. Please let me know if you need anything else.\nBest regards,\nSam",
    "Rewrite this sentence in the past tense: Every morning she walks to the station, buys a newspaper, reads the"
    " headlines on the train and arrives at the office before nine.",
]

# requests for a small JSON record (bench/structured.py: constrained by RECORD_SCHEMA, and not)
RECORDS = [
    "Give a short JSON record about the planet Mars: its name, category, a year linked to it and a one-sentence"
    " summary.",
    "Describe the violin as a JSON record with a name, a category, a year and a one-sentence summary.",
    "Return a JSON record for the city of Kyoto with fields name, category, year and summary.",
    "Write a JSON record about the telephone: name, category, the year it was invented and a short summary.",
    "Make a JSON record for Marie Curie with her name, a category, a year from her life and a one-sentence summary.",
    "Produce a JSON record about pizza: name, category, a year and a short summary.",
    "Create a JSON record describing the African elephant: name, category, a year and a summary in one sentence.",
    "Give me a JSON record for the sport of tennis with name, category, year and summary.",
]
RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "category": {"enum": ["planet", "instrument", "city", "invention", "person", "food", "animal", "sport"]},
        "year": {"type": "integer"},
        "summary": {"type": "string", "maxLength": 200},
    },
    "required": ["name", "category", "year", "summary"],
    "additionalProperties": False,
}

# requests for a tool call (bench/structured.py's t rows: tool_choice required, one call each)
TOOL_REQUESTS = [
    "What's the weather like in Paris today?",
    "What is 12.5 plus 30?",
    "Is it cold in Oslo right now, in celsius?",
    "Add 7 and 35 for me.",
    "What's the weather in Tokyo, in fahrenheit?",
    "What do 1999 and 2026 add up to?",
    "Do I need an umbrella in London?",
    "Sum 100 and 250.",
]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two numbers",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                       "required": ["a", "b"]}}},
]


def normalized(text: str) -> str:
    """The form two prompts are compared in to keep held-out prompts out of training."""
    return " ".join("".join(c for c in text.lower() if c.isalnum() or c.isspace()).split())


HELD_OUT = frozenset(normalized(p) for p in CHAT + GROUNDED + RECORDS + TOOL_REQUESTS)
