"""Everyday assistant requests for training data: explanations, how-tos, recipes, short writing, code,
advice, emails, summaries, lists, facts; composed from templates over slot lists (typed as a user
types them, the grammar not always right, between an opener and a closer such as "Quick question:"
and "Use bullet points.").

The standard-library prompts and the target's own questions (distill.py) lean to Python and to
the target's idea of a question; the requests users send a chat model look more like these. The
benches' held-out chat prompts (assets/prompts.py) are kept out by topic, not only by text: their
subjects (photosynthesis, pancakes, autumn leaves, reversing a string, Fibonacci, lists and tuples,
Romeo and Juliet, a weekend hiking trip, staying focused while studying, a day off, the water
cycle, black holes, drinking water, a bicycle upright, the sky's colour) are in no slot list.
"""

from __future__ import annotations

import random

SCIENCE = "gravity, magnetism, electricity, rainbows, tides, earthquakes, volcanoes, the seasons, thunder, lightning, vaccines, DNA, evolution, the moon's phases, clouds, snowflakes, sound waves, the immune system, digestion, sleep, dreams, memory, muscles, bones, the heart, blood circulation, plate tectonics, the greenhouse effect, climate change, recycling, nuclear energy, solar panels, wind turbines, batteries, microwaves, refrigerators, airplanes flying, rockets, satellites, GPS, the internet, Wi-Fi, email, search engines, computers, smartphones, touch screens, 3D printers, electric cars, bridges, skyscrapers, compasses, telescopes, microscopes, bacteria, viruses, fungi, bees, ants, bird migration, hibernation, coral reefs, rainforests, deserts, glaciers, oceans, rivers, stars, the sun, galaxies, the big bang, comets, eclipses, time zones, inflation, interest rates, taxes, the stock market, credit scores, supply and demand, democracy, elections, the carbon cycle, fermentation, yeast, baking soda, soap, rust, fire, ice melting, boiling water, static electricity, mirrors, lenses, colors, the human eye, hearing, allergies, fevers, antibiotics, exercise, metabolism, caffeine".split(", ")
DISHES = "scrambled eggs, banana bread, tomato soup, guacamole, a green salad, spaghetti carbonara, chocolate chip cookies, fried rice, a fruit smoothie, lemonade, hummus, French toast, mashed potatoes, a vegetable stir-fry, chicken curry, lentil soup, oatmeal, muffins, brownies, a grilled cheese sandwich, pizza dough, garlic bread, a omelette, rice pudding, chili, roasted vegetables, a quiche, pesto pasta, apple pie, iced tea, hot chocolate, waffles, a tuna salad, potato salad, salsa, bread, crepes, popcorn, granola".split(", ")
POEM = "the ocean, a rainy day, the city at night, a cat, spring flowers, the moon, friendship, winter snow, a mountain, coffee, the first day of school, a lighthouse, a garden, the stars, a river, a summer evening, an old tree, a train journey, the wind, a birthday, the sunrise, a lost key, a library, home".split(", ")
FORMS = "a haiku, a short poem, a limerick, a four-line rhyme, a short story of five sentences, a two-sentence story, a short song verse".split(", ")
LANGS = ["Python", "JavaScript", "Java", "C", "Go", "Rust", "TypeScript", "Bash", "SQL", "C++"]
CODE_TASKS = "check if a number is prime, find the largest number in a list, count the vowels in a string, remove duplicates from a list, sort a list of numbers, read a file line by line, compute the factorial of a number, check if a word is a palindrome, merge two sorted lists, convert Celsius to Fahrenheit, find the average of a list, count word frequencies in a text, flatten a nested list, compute the greatest common divisor, check if two strings are anagrams, parse a JSON string, make an HTTP request, split a string by commas, capitalize each word in a sentence, find the second largest number, sum the digits of a number, validate an email address, shuffle a list, get today's date, binary search a sorted list, swap two variables, round a number to two decimals, iterate over a dictionary".split(", ")
CONCEPT_PAIRS = [("let", "const in JavaScript"), ("a process", "a thread"), ("TCP", "UDP"), ("RAM", "storage"), ("a virus", "bacteria"), ("weather", "climate"), ("a crocodile", "an alligator"), ("HTTP", "HTTPS"), ("an array", "a linked list"), ("a class", "an object"), ("speed", "velocity"), ("mass", "weight"), ("a stock", "a bond"), ("Git", "GitHub"), ("a compiler", "an interpreter"), ("SQL", "NoSQL databases"), ("a simile", "a metaphor"), ("affect", "effect"), ("baking soda", "baking powder"), ("a frog", "a toad"), ("a rabbit", "a hare"), ("machine learning", "deep learning"), ("a debit card", "a credit card"), ("a hurricane", "a tornado"), ("== ", "is in Python"), ("a function", "a method"), ("CSS", "HTML"), ("a meteor", "a meteorite"), ("an atom", "a molecule")]
BOOKS = "Hamlet, Macbeth, Pride and Prejudice, The Odyssey, Moby Dick, Frankenstein, Dracula, The Great Gatsby, To Kill a Mockingbird, 1984, Animal Farm, Alice in Wonderland, The Hobbit, Little Women, Jane Eyre, Treasure Island, The Little Prince, Don Quixote, A Christmas Carol, Cinderella, Snow White, The Wizard of Oz, Peter Pan, Robinson Crusoe, Oliver Twist, The Jungle Book, Sherlock Holmes's A Study in Scarlet, Gulliver's Travels, Charlotte's Web".split(", ")
TRIPS = "a beach holiday, a business trip, a camping trip, a ski trip, a long flight, a road trip, a week in Paris, a picnic, a day at the zoo, a music festival, a trip to the mountains in winter, a first day at a new job, a hospital stay, a move to a new city".split(", ")
GOALS = "sleeping better, saving money, learning a new language, staying healthy at work, getting more exercise, managing stress, being more productive, making new friends, preparing for a job interview, keeping a plant alive, reducing screen time, eating healthier, learning to cook, keeping a tidy home, public speaking, writing a good resume, starting to run, improving handwriting, remembering names, waking up early, learning to play guitar, taking better photos, working from home, studying for exams, staying motivated, reading more books, drinking more water, traveling on a budget, being a better listener".split(", ")
EMAILS = "thanking a colleague for their help, declining a meeting invitation, asking a teacher for an extension, following up after a job interview, inviting my team to lunch, apologizing for a late reply, asking a landlord to fix the heating, requesting a refund for a broken product, introducing myself to a new team, asking for feedback on my work, congratulating a friend on a new job, rescheduling a doctor's appointment, reminding a client about an unpaid invoice, asking a neighbor to keep the noise down".split(", ")
PROCESSES = "how a bill becomes a law, how bread is made, how coffee gets from the farm to the cup, how to change a flat tire, how to plant a tree, how paper is made, how a letter is delivered, how to do laundry, how to make a cup of tea, how the heart pumps blood, how to brush your teeth properly, how a seed grows into a plant, how to set up a fish tank, how to wash a car, how chocolate is made, how glass is made, how to back up a computer, how recycling works, how a caterpillar becomes a butterfly".split(", ")
THINGS = "a plane stay in the air, a fridge keep food cold, a microwave heat food, a compass work, a battery store energy, a rainbow form, soap clean hands, a boat float, a camera take pictures, the moon cause tides, a vaccine protect us, a thermostat work, a credit card work, a zipper work, a solar panel make electricity, a lock and key work, a toilet flush, an elevator work, a parachute slow someone down".split(", ")
WHYS = "is the ocean salty, is the sunset red, do leaves change color in autumn, do we need sleep, do cats purr, does ice float on water, do we get hiccups, do onions make us cry, does the moon change shape, do we yawn, does bread go stale, does metal feel cold, does the wind blow, do we have fingerprints, do some people snore, is grass green, does popcorn pop, do we dream, does my voice sound different on recordings, do stars twinkle".split(", ")
FACTS = ["What is the capital of {c}?", "What language do people speak in {c}?", "What is {c} famous for?", "What currency does {c} use?", "What is the weather like in {c}?"]
COUNTRIES = "Germany, Japan, Italy, Brazil, Canada, Australia, Egypt, India, Mexico, Spain, Kenya, Norway, Argentina, South Korea, Turkey, Greece, Peru, Thailand, Sweden, Portugal, Vietnam, Ireland, Morocco, Poland, Chile".split(", ")
PEOPLE = "Albert Einstein, Marie Curie, Isaac Newton, Leonardo da Vinci, William Shakespeare, Cleopatra, Napoleon, Abraham Lincoln, Nelson Mandela, Ada Lovelace, Charles Darwin, Galileo, Mozart, Frida Kahlo, Martin Luther King Jr., Gandhi, Julius Caesar, Alan Turing, Amelia Earhart, Beethoven".split(", ")
AUDIENCES = ["a ten-year-old", "a five-year-old", "a beginner", "my grandmother", "a high school student", "someone who has never heard of it"]
LENGTHS = ["in one sentence", "in two sentences", "in a few sentences", "briefly", "in simple words", "in a short paragraph"]
HEALTH = "walking every day, eating vegetables, getting enough sleep, meditation, stretching, green tea, swimming, yoga, eating fish, cycling, laughing, gardening, reading, spending time outdoors".split(", ")

CITIES = "Tokyo, Barcelona, New York, Lisbon, Prague, Istanbul, Cape Town, Vancouver, Edinburgh, Kyoto, Amsterdam, Vienna, Buenos Aires, Singapore, Marrakech, Dublin, Berlin, Seoul, Mexico City, Sydney".split(", ")
PRODUCTS = "a reusable water bottle, a standing desk, noise-cancelling headphones, a handmade candle, a backpack, a smartwatch, a coffee grinder, a yoga mat, a houseplant, a board game, a laptop stand, wireless earbuds, a cookbook, a bike helmet, a desk lamp".split(", ")
PROBLEMS = "a slow computer, a leaking faucet, a phone that will not charge, a squeaky door, a printer that will not print, a clogged drain, Wi-Fi that keeps dropping, a laptop that overheats, a frozen app, a flat bike tire, a sticky drawer, a noisy fridge, a full email inbox, a blurry photo".split(", ")
PROG_CONCEPTS = "recursion, closures, generators, decorators, classes, interfaces, error handling, unit tests, variables, loops, pointers, async functions, hash maps, regular expressions, immutability, type annotations, modules, inheritance, callbacks, lambdas".split(", ")
CLASS_THINGS = "a bank account, a to-do list, a shopping cart, a library book, a stopwatch, a queue, a stack, a temperature sensor, a playing card deck, a student record, a simple counter, a rectangle, a contact book".split(", ")
CHOICES = "working from home, living in a big city, buying an electric car, renting an apartment, learning online, owning a dog, using social media, public transport, a four-day work week, homeschooling, solar power, freelancing, a gap year, self-driving cars, nuclear power".split(", ")
HYPOTHETICALS = "the moon disappeared, humans could breathe underwater, the internet went down for a week, everyone spoke the same language, it never rained again, animals could talk, we had no electricity, the Earth spun twice as fast, plants stopped growing, nobody needed to sleep".split(", ")
TONES = "formal, friendly, confident, polite, persuasive, concise, cheerful, professional".split(", ")
SENTENCES = ["I can't come to the meeting tomorrow.", "Your order is late because of the weather.", "We need to talk about the budget.", "The new app is better than the old one.", "Please send me the report by Friday.", "I think we should try a different approach.", "Thanks for your help with the project.", "The store will be closed on Monday."]
DIETS = "a vegetarian, a runner, a busy student, someone on a budget, a family of four, someone who wants more protein, a vegan, someone who cannot eat gluten".split(", ")
GENRES = "mystery, science fiction, fantasy, adventure, funny, spooky, fairy tale, detective".split(", ")
HEROES = "a lonely robot, a brave mouse, a young inventor, a lost astronaut, a talking dog, a retired pirate, a curious girl, an old wizard, a clumsy dragon, a shy ghost, a time traveler, a kind giant".split(", ")
# each request is wrapped in an opener and a closer as users type them; the repeated "" make a
# quarter of each empty
OPENERS = ["", "", "", "Hi! ", "Hello, ", "Quick question: ", "Please help: ", "Hey, ", "I have a question. ", "Could you help me? ", "I'm a student. ", "I'm curious. "]
CLOSERS = ["", "", "", " Thanks!", " Keep it short.", " Use bullet points.", " Please be detailed.", " Give an example.", " Explain your answer.", " Thank you.", " Use simple language.", " Answer in a numbered list."]

TEMPLATES = [
    lambda r: f"Explain how {r.choice(SCIENCE)} works to {r.choice(AUDIENCES)}.",
    lambda r: f"Explain what {r.choice(SCIENCE)} is{' ' + r.choice(LENGTHS) if r.random() < .5 else ''}.",
    lambda r: f"What is {r.choice(SCIENCE)}? Answer {r.choice(LENGTHS)}.",
    lambda r: f"Give me a short recipe for {r.choice(DISHES)}.",
    lambda r: f"How do I make {r.choice(DISHES)}?",
    lambda r: f"What ingredients do I need for {r.choice(DISHES)}?",
    lambda r: f"Write {r.choice(FORMS)} about {r.choice(POEM)}.",
    lambda r: f"Write a {r.choice(LANGS)} function to {r.choice(CODE_TASKS)}.",
    lambda r: f"How do I {r.choice(CODE_TASKS)} in {r.choice(LANGS)}?",
    lambda r: f"Show me how to {r.choice(CODE_TASKS)} in {r.choice(LANGS)}.",
    lambda r: "What is the difference between {} and {}?".format(*r.choice(CONCEPT_PAIRS)),
    lambda r: f"Summarize the plot of {r.choice(BOOKS)} {r.choice(LENGTHS)}.",
    lambda r: f"Who are the main characters in {r.choice(BOOKS)}?",
    lambda r: f"What should I pack for {r.choice(TRIPS)}?",
    lambda r: f"What are {r.choice(['three', 'five', 'some', 'a few'])} tips for {r.choice(GOALS)}?",
    lambda r: f"Give me advice on {r.choice(GOALS)}.",
    lambda r: f"Write a polite email {r.choice(EMAILS)}.",
    lambda r: f"Write a short message {r.choice(EMAILS)}.",
    lambda r: f"Describe {r.choice(PROCESSES)} step by step.",
    lambda r: f"Explain {r.choice(PROCESSES)}.",
    lambda r: f"How does {r.choice(THINGS)}?",
    lambda r: f"Why {r.choice(WHYS)}?",
    lambda r: r.choice(FACTS).format(c=r.choice(COUNTRIES)),
    lambda r: f"Who was {r.choice(PEOPLE)}?",
    lambda r: f"Tell me {r.choice(['an interesting fact', 'three facts', 'a few facts'])} about {r.choice(PEOPLE + SCIENCE)}.",
    lambda r: f"What are the health benefits of {r.choice(HEALTH)}?",
    lambda r: f"Is {r.choice(HEALTH)} good for you?",
    lambda r: f"Write a short {r.choice(['birthday', 'thank-you', 'get-well', 'congratulations', 'farewell'])} note for {r.choice(['a friend', 'my mother', 'a coworker', 'my teacher', 'my neighbor'])}.",
    lambda r: f"Give me {r.choice(['three', 'five', 'ten'])} ideas for {r.choice(['a rainy afternoon', 'a birthday party', 'a team-building event', 'a science project', 'a short story', 'a weekend in the city', 'a healthy breakfast', 'a gift for my dad', 'a blog post', 'a family dinner'])}.",
    lambda r: f"Can you explain {r.choice(SCIENCE)} in simple terms?",
    lambda r: f"What is the best way to learn {r.choice(LANGS + ['Spanish', 'French', 'math', 'chess', 'the piano', 'to swim', 'to draw'])}?",
    lambda r: f"List {r.choice(['three', 'five'])} {r.choice(['animals that live in the desert', 'famous paintings', 'planets in our solar system', 'fruits high in vitamin C', 'programming languages', 'board games for families', 'musical instruments', 'European capitals', 'renewable energy sources', 'healthy snacks'])}.",
    lambda r: f"Translate '{r.choice(['Good morning', 'Thank you very much', 'Where is the train station?', 'I love reading books', 'How are you?', 'See you tomorrow'])}' into {r.choice(['French', 'Spanish', 'German', 'Italian', 'Portuguese'])}.",
    lambda r: f"What does the word '{r.choice(['serendipity', 'ephemeral', 'ubiquitous', 'resilient', 'nostalgia', 'algorithm', 'metaphor', 'democracy', 'empathy'])}' mean?",
    lambda r: f"Describe {r.choice(['a typical day of a nurse', 'the life cycle of a frog', 'how to be a good friend', 'what makes a good leader', 'the city of Rome', 'a perfect weekend', 'the rules of chess', 'the rules of soccer', 'how a library works', 'the solar system'])}.",
    lambda r: f"Write {r.choice(FORMS)} about {r.choice(SCIENCE)}.",
    lambda r: f"Explain {r.choice(SCIENCE)} using an everyday analogy.",
    lambda r: f"Plan a {r.choice(['one', 'two', 'three'])}-day trip to {r.choice(CITIES)}.",
    lambda r: f"What are the best things to do in {r.choice(CITIES)}?",
    lambda r: f"Write a short product description for {r.choice(PRODUCTS)}.",
    lambda r: f"How do I fix {r.choice(PROBLEMS)}?",
    lambda r: f"Explain {r.choice(PROG_CONCEPTS)} in {r.choice(LANGS)} with an example.",
    lambda r: f"Write a {r.choice(LANGS)} class for {r.choice(CLASS_THINGS)}.",
    lambda r: f"What are the pros and cons of {r.choice(CHOICES)}?",
    lambda r: f"What would happen if {r.choice(HYPOTHETICALS)}?",
    lambda r: f"Rewrite this sentence to sound more {r.choice(TONES)}: \"{r.choice(SENTENCES)}\"",
    lambda r: f"Suggest a {r.choice(['one-day', 'three-day', 'weekly'])} meal plan for {r.choice(DIETS)}.",
    lambda r: f"Write the opening of a {r.choice(GENRES)} story about {r.choice(HEROES)}.",
    lambda r: f"Write {r.choice(['three', 'five'])} quiz questions about {r.choice(SCIENCE + BOOKS + PEOPLE)}, with answers.",
    lambda r: "Compare {} and {}.".format(*r.sample(PEOPLE, 2)),
    lambda r: f"What can I learn from {r.choice(PEOPLE)}?",
]


def requests(count: int, seed: int, exclude: set[str] = frozenset()) -> list[str]:
    """Up to `count` distinct requests, drawn template by template (a fixed seed gives the same list);
    none whose exact text is in `exclude`."""
    rng = random.Random(seed)
    seen, out = set(exclude), []
    for _ in range(count * 20):
        if len(out) >= count:
            break
        text = f"{rng.choice(OPENERS)}{rng.choice(TEMPLATES)(rng).strip()}{rng.choice(CLOSERS)}"
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out
