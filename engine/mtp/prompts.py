"""The prompt set MTP draft heads are self-distilled on (``cadence train-mtp``), and its held-out split.

Prompts are built from templates x topics (explanations, lists, comparisons, advice), tasks on a
quoted paragraph (summaries, rewriting, questions about it, action items from meeting notes) and
small coding tasks. The held-out split shares no topic, paragraph or coding task with the
training split, so held-out acceptance measures a head on text it never saw. A validation split
(topics of its own) calibrates the head's probabilities.

Whisper heads are trained on speech of the chat model's answers to these prompts (see
:mod:`engine.mtp.command`), so the same split separates their training and held-out speech.
"""

from __future__ import annotations

import random

TOPICS = [
    "photosynthesis", "the water cycle", "black holes", "the immune system", "compound interest", "inflation",
    "the French Revolution", "plate tectonics", "machine learning", "the internet", "vaccines", "climate change",
    "the Roman Empire", "electric cars", "sleep", "coffee", "volcanoes", "the stock market", "bees",
    "renewable energy", "the human heart", "the moon landing", "recycling", "password security", "time zones",
    "the printing press", "earthquakes", "solar panels", "the Olympic Games", "bread baking", "jazz music",
    "the Great Wall of China", "DNA", "cloud computing", "rainbows", "public libraries", "remote work",
    "the piano", "ocean tides", "chess", "tea", "the Amazon rainforest", "antibiotics", "email etiquette",
    "budgeting", "gardening", "bicycles", "the solar system", "honey", "migration of birds", "marathon training",
    "the periodic table", "spreadsheets", "podcasts", "public speaking", "dinosaurs", "glaciers", "airplanes",
    "the Renaissance", "batteries", "nutrition", "meditation", "the Eiffel Tower", "wind turbines", "snow",
]
HELD_OUT_TOPICS = {"volcanoes", "jazz music", "antibiotics", "bicycles", "glaciers", "time zones", "the piano",
                   "spreadsheets"}

TEMPLATES = [
    "Explain {t} in simple terms.",
    "What is {t}? Answer in a short paragraph.",
    "Give me five interesting facts about {t}.",
    "Write a short introduction to {t} for a ten-year-old.",
    "List the main advantages and disadvantages of {t}.",
    "Why does {t} matter? Explain briefly.",
    "Write three quiz questions about {t}, with answers.",
    "Summarize the history of {t} in a few sentences.",
    "What are common misconceptions about {t}?",
    "Write a short poem about {t}.",
    "Describe {t} to someone who has never heard of it.",
    "Give a step-by-step explanation of how {t} works.",
    "Write a tweet about {t}.",
    "What should a beginner know about {t}?",
    "Compare {t} and {u} in a few sentences.",
    "Write a short story that involves {t}.",
    "Give me a list of tips related to {t}.",
    "Write an email to a friend recommending they learn about {t}.",
]

PARAGRAPHS = [
    "The city council met on Tuesday to discuss the new bus routes. Several residents complained that the "
    "current schedule leaves the northern neighborhoods without service after eight in the evening. The council "
    "agreed to run a six-month trial of two late-night routes and to review ridership numbers in the spring.",
    "Our team finished the first version of the mobile app last week. Testing showed that the login screen is "
    "slow on older phones and that the settings page crashes when the language is changed. We plan to fix both "
    "problems before the public release at the end of the month.",
    "Honeybees communicate the location of flowers through a movement called the waggle dance. The angle of the "
    "dance shows the direction relative to the sun, and its length tells the other bees how far they must fly. "
    "Scientists first decoded this behavior in the middle of the twentieth century.",
    "The bakery on Main Street has changed owners. The new owners kept the old recipes for sourdough and cinnamon "
    "rolls but added vegan pastries and a small coffee bar. They also extended the opening hours on weekends.",
    "Remote work has grown quickly in the last few years. Many employees enjoy the flexibility and the time saved "
    "on commuting, while some managers worry about communication and team spirit. Hybrid schedules, with two or "
    "three office days per week, have become a common compromise.",
    "The museum will close its east wing for renovation from March to August. During this time, the ancient art "
    "collection will be shown in the temporary gallery on the ground floor. Tickets bought in advance remain valid.",
    "A recent study followed two thousand adults for ten years and found that those who walked at least thirty "
    "minutes a day had a lower risk of heart disease. The researchers note that the study shows a link, not a cause.",
    "The library is introducing a new system for borrowing laptops. Students can reserve a laptop online for up to "
    "three days. Late returns will block further reservations for one week, and damaged devices must be reported "
    "at the front desk.",
    "The marketing team reviewed the results of the spring campaign. Online ads brought in most of the new "
    "customers, while the printed flyers had almost no effect. Next quarter, the budget for flyers will be moved "
    "to video ads and a newsletter.",
    "Heavy rain is expected across the region over the weekend. Authorities advise residents near the river to "
    "move valuables to higher floors and to avoid driving through flooded roads. Schools will decide on Monday "
    "morning whether to open.",
    "The software update adds a dark mode, faster search and support for two new languages. It also removes the "
    "old export format, which few people used. Users who still need it can download a free converter.",
    "Our hiking club plans a three-day trip to the mountains in July. Members should bring warm clothes, a sleeping "
    "bag and enough water for the first day. The group will meet at the train station at seven in the morning.",
    "The company reported higher sales in the third quarter, mainly because of strong demand for its smaller "
    "products. Costs also rose because of shipping delays. The chief executive expects growth to slow next year.",
    "The school garden project started with four raised beds and now covers half of the playground. Students grow "
    "tomatoes, beans and herbs, and the kitchen uses the vegetables for lunch twice a week.",
    "Engineers found a small crack in one of the bridge supports during a routine inspection. The bridge remains "
    "open, but heavy trucks must use the detour until repairs are finished, which should take about six weeks.",
    "The orchestra announced its new season, which opens with a program of film music in September. For the first "
    "time, tickets for students will cost only five dollars, and two concerts will be streamed online for free.",
    "The volunteer group cleaned three kilometers of beach on Saturday and collected more than two hundred kilograms "
    "of plastic. Most of it was bottle caps and fishing nets. The group will repeat the cleanup every month.",
    "The clinic now offers online appointments for routine questions. Patients can book a video call through the "
    "website, and prescriptions can be sent directly to the pharmacy. Emergencies still require a visit in person.",
    "A new study of sleep habits found that teenagers who used their phones in bed slept about forty minutes less "
    "than those who left the phone in another room. The authors recommend a screen-free hour before bedtime.",
    "The train company will replace its ticket machines next month. The new machines accept contactless payment "
    "and print tickets faster. Old paper tickets can still be used until the end of the year.",
]
HELD_OUT_PARAGRAPHS = {5, 11, 15, 19}

PARAGRAPH_TASKS = [
    "Summarize this text in one sentence:\n\n{p}",
    "Summarize the following paragraph in three bullet points.\n\n{p}",
    "Rewrite this paragraph in a more formal tone:\n\n{p}",
    "Rewrite the following text so that a child can understand it:\n\n{p}",
    "Read the text and answer: what is the main problem described, and what is being done about it?\n\n{p}",
    "Here is a text:\n\"{p}\"\nWrite two questions a reader might ask about it, and answer them.",
    "Turn this paragraph into a short news headline and a one-sentence lead:\n\n{p}",
    "List the key facts in this text:\n\n{p}",
    "Translate the meaning of this text into plain, simple English:\n\n{p}",
]

MEETINGS = [
    "Anna: We need the budget draft by Friday.\nBen: I can do the numbers, but I need the sales figures from Carl.\n"
    "Carl: I'll send them tomorrow morning.\nAnna: Good. Let's meet again on Monday to review.",
    "Maria: The website launch is delayed because the payment page is not ready.\nTom: The developers say two more "
    "days.\nMaria: Then we move the launch to Thursday and tell the customers.\nLisa: I'll write the announcement.",
    "Sam: The client asked for a cheaper version of the design.\nEva: We could remove the animations.\nSam: Fine, "
    "Eva prepares a new mockup by Wednesday, and I'll call the client.",
    "Priya: We had three support tickets about the login bug.\nJon: I fixed it yesterday, it goes out with the next "
    "release.\nPriya: Please also add a test for it.\nJon: Sure, today.",
    "Lee: The conference room is booked for the workshop on the tenth.\nKim: We still need a speaker for the "
    "afternoon.\nLee: I'll ask Daniel.\nKim: And I'll order lunch for twenty people.",
    "Omar: Sales in the north region dropped by ten percent.\nJulia: Mostly because our main competitor cut prices."
    "\nOmar: Let's prepare two pricing options for the board meeting next week. Julia, can you model them?",
    "Nina: The new intern starts on Monday.\nPaul: Who is going to train her?\nNina: You, please, for the first "
    "week. I'll prepare her laptop and accounts.",
    "Grace: The warehouse is running out of boxes.\nIvan: I'll order more today.\nGrace: Also check the delivery "
    "times; the last order took two weeks.",
]
HELD_OUT_MEETINGS = {3, 7}

MEETING_TASKS = [
    "Here are meeting notes:\n\n{m}\n\nList the action items with the person responsible for each.",
    "Summarize this conversation in two sentences:\n\n{m}",
    "Write a short follow-up email based on these notes:\n\n{m}",
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "counts the words in a sentence",
    "returns the largest number in a list", "computes the factorial of a number", "removes duplicates from a list",
    "converts Celsius to Fahrenheit", "checks whether a word is a palindrome", "sums the even numbers in a list",
    "finds the average of a list of numbers", "merges two sorted lists", "counts the vowels in a string",
    "returns the Fibonacci numbers below 100", "sorts a list of names alphabetically", "reads a file and prints "
    "its lines", "capitalizes the first letter of every word", "finds the second smallest number in a list",
    "checks whether two strings are anagrams", "converts a list of strings to integers", "computes the GCD of "
    "two numbers",
]
HELD_OUT_CODE = {2, 9, 15, 19}
CODE_TEMPLATES = [
    "Write a Python function that {c}.",
    "Write a JavaScript function that {c}, and explain it briefly.",
    "Show me a short Python example that {c}, with comments.",
]

EXTRA = [
    "How do I make a good cup of tea?", "What are some healthy breakfast ideas?", "How can I improve my sleep?",
    "Give me tips for a job interview.", "How do I start learning a new language?", "What should I pack for a "
    "weekend trip?", "Write a thank-you note to a colleague who helped me with a project.", "Plan a simple "
    "three-day workout routine.", "How can I save money on groceries?", "Write a short speech for a friend's "
    "birthday.", "What is the difference between weather and climate?", "Suggest five names for a coffee shop.",
    "How do I write a good cover letter?", "Explain the difference between a virus and a bacterium.",
    "What are good habits for studying?", "Write a polite message declining a meeting invitation.",
    "How do I keep houseplants alive?", "Write a short product description for a reusable water bottle.",
    "What are the benefits of reading every day?", "How can a small team communicate better?",
    "Write a haiku about autumn.", "Give me a recipe for a simple tomato soup.", "How does a refrigerator work?",
    "What is a healthy way to deal with stress?",
]
HELD_OUT_EXTRA = {3, 10, 17, 22}


def _prompts() -> tuple[list[str], list[str]]:
    """(training prompts, held-out prompts), deterministic."""
    rng = random.Random(1234)
    train: list[str] = []
    held: list[str] = []
    for i, topic in enumerate(TOPICS):
        # every topic gets 5 templates (a different mix per topic)
        for template in rng.sample(TEMPLATES, 5):
            other = TOPICS[(i + 7) % len(TOPICS)]
            (held if topic in HELD_OUT_TOPICS else train).append(template.format(t=topic, u=other))
    for i, paragraph in enumerate(PARAGRAPHS):
        for task in rng.sample(PARAGRAPH_TASKS, 4):
            (held if i in HELD_OUT_PARAGRAPHS else train).append(task.format(p=paragraph))
    for i, notes in enumerate(MEETINGS):
        for task in MEETING_TASKS:
            (held if i in HELD_OUT_MEETINGS else train).append(task.format(m=notes))
    for i, code in enumerate(CODE_TASKS):
        for template in rng.sample(CODE_TEMPLATES, 2):
            (held if i in HELD_OUT_CODE else train).append(template.format(c=code))
    for i, prompt in enumerate(EXTRA):
        (held if i in HELD_OUT_EXTRA else train).append(prompt)
    rng.shuffle(train)
    rng.shuffle(held)
    return train, held


TRAIN_PROMPTS, HELD_OUT_PROMPTS = _prompts()

# A second batch of training prompts: each training topic with templates it did not get above.
VALIDATION_TOPICS = ["lighthouses", "origami", "submarines", "the violin", "thunderstorms", "coral reefs",
                     "board games", "the metric system"]
VALIDATION_EXTRA = ["How do I clean a cast iron pan?", "Write a short note reminding the team about Friday's deadline.",
                    "What is the difference between a lake and a pond?", "Give me ideas for a rainy afternoon."]


def _more_prompts() -> tuple[list[str], list[str]]:
    """(more training prompts, validation prompts); validation topics appear nowhere else."""
    rng = random.Random(4321)
    more: list[str] = []
    trained = [t for t in TOPICS if t not in HELD_OUT_TOPICS]
    for i, topic in enumerate(trained):
        used = {p for p in TRAIN_PROMPTS if topic in p}
        fresh = [t for t in TEMPLATES if t.format(t=topic, u=TOPICS[(TOPICS.index(topic) + 7) % len(TOPICS)]) not in used]
        for template in rng.sample(fresh, 5):
            more.append(template.format(t=topic, u=trained[(i + 3) % len(trained)]))
    for i, code in enumerate(CODE_TASKS):
        if i not in HELD_OUT_CODE:
            used = {p for p in TRAIN_PROMPTS if code in p}
            more += [t.format(c=code) for t in CODE_TEMPLATES if t.format(c=code) not in used]
    validation = [t.format(t=topic, u=VALIDATION_TOPICS[(i + 1) % len(VALIDATION_TOPICS)])
                  for i, topic in enumerate(VALIDATION_TOPICS) for t in rng.sample(TEMPLATES, 5)]
    validation += VALIDATION_EXTRA
    rng.shuffle(more)
    rng.shuffle(validation)
    return more, validation


MORE_TRAIN_PROMPTS, VALIDATION_PROMPTS = _more_prompts()


def mentions_held_out(prompt: str) -> bool:
    """Whether a prompt names a held-out topic (a few comparison prompts of the first batch do: their answers
    are left out of training)."""
    return any(topic in prompt for topic in HELD_OUT_TOPICS)


def texts_for_speech(held_out: bool) -> list[str]:
    """Paragraphs of the prompt set itself (Whisper training speech beside the chat answers)."""
    return [p for i, p in enumerate(PARAGRAPHS) if (i in HELD_OUT_PARAGRAPHS) == held_out]


__all__ = ["TRAIN_PROMPTS", "MORE_TRAIN_PROMPTS", "VALIDATION_PROMPTS", "HELD_OUT_PROMPTS", "texts_for_speech"]
