"""Build the sample prompts shipped with batchgen (``batchgen/sample_data/prompts.parquet``).

    python -m batchgen.data.sample [OUT]     # default: the package's sample_data/prompts.parquet

The set is small (128 rows) but shaped like real batch jobs: few-shot templates, a long shared context with
different questions, instruction templates, and standalone prompts, shuffled so that rows sharing a prefix
are *not* adjacent (prefix grouping has work to do). Columns:

- ``id`` (string), ``task`` (string): a stable id and the template family;
- ``prompt`` (string): the plain-text prompt;
- ``messages`` (list<struct<role, content>>): the same request as chat messages (a shared system prompt
  per family), for ``data.messages_column=messages``;
- ``sampling`` (struct<max_tokens: int32>): per-row overrides (short answers for classification rows,
  null elsewhere), picked up by the default ``data.sampling_column``.

Deterministic: same code → same rows in the same order (no clock, no unseeded randomness).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

SENTIMENT_HEAD = (
    "Classify the sentiment of each customer review as positive or negative.\n\n"
    "Review: The pasta was cooked perfectly and the waiter remembered our names.\nSentiment: positive\n\n"
    "Review: We waited forty minutes for cold soup and nobody apologised.\nSentiment: negative\n\n"
    "Review: Great value, generous portions, and the dessert menu is worth the trip alone.\nSentiment: positive\n\n"
    "Review: The room smelled of smoke and the air conditioning rattled all night.\nSentiment: negative\n\n"
)
REVIEWS = [
    "Fast delivery and the headphones sound even better than I expected.",
    "The charger stopped working after two days and support never replied.",
    "Comfortable shoes, true to size, I have already ordered a second pair.",
    "The app crashes every time I try to upload a photo.",
    "Friendly staff, clean rooms and a lovely view of the harbour.",
    "The instructions were missing and two screws were the wrong size.",
    "Best coffee in town, and they roast the beans themselves.",
    "The battery drains in under an hour, which makes the laptop useless on trains.",
    "Our guide was knowledgeable and funny; the tour flew by.",
    "The package arrived crushed and the vase inside was broken.",
    "Simple to set up and the picture quality is excellent.",
    "They charged my card twice and refused to refund the difference.",
    "A cosy little bookshop with a cat asleep in the window.",
    "The seats were cramped and the film started twenty minutes late.",
    "My plants have never looked healthier since I switched to this soil.",
    "The jacket's zip broke the first time I wore it.",
    "Quiet, powerful and easy to clean: the best blender I have owned.",
    "The hotel lost our booking and the manager shrugged.",
    "Lovely fresh bread every morning and the jam is homemade.",
    "The subscription renewed without warning and cancelling took an hour on the phone.",
    "The course explained recursion more clearly than my university lecturer did.",
    "Paint started peeling off the walls within a month.",
    "Excellent battery life and the keyboard is a pleasure to type on.",
    "The delivery driver left the parcel in the rain.",
]

TRANSLATE_HEAD = (
    "Translate the English sentences into French.\n\n"
    "English: Good morning, how are you?\nFrench: Bonjour, comment allez-vous ?\n\n"
    "English: The library closes at six o'clock.\nFrench: La bibliothèque ferme à dix-huit heures.\n\n"
    "English: I would like a cup of tea, please.\nFrench: Je voudrais une tasse de thé, s'il vous plaît.\n\n"
)
SENTENCES = [
    "Where is the railway station?",
    "My sister lives in a small village near the sea.",
    "We are going to the market on Saturday.",
    "The children are playing in the garden.",
    "Could you speak more slowly, please?",
    "It has been raining since yesterday evening.",
    "This museum has a famous collection of paintings.",
    "I forgot my umbrella at the office.",
    "The train to Lyon leaves from platform four.",
    "Do you know a good restaurant nearby?",
    "He reads the newspaper every morning.",
    "The meeting has been moved to Thursday.",
    "Our neighbours have a very friendly dog.",
    "I am learning to play the piano.",
    "The shop on the corner sells fresh fish.",
    "Please close the window, it is cold.",
    "They visited their grandparents last summer.",
    "The bridge was built more than two hundred years ago.",
    "How much does this bicycle cost?",
    "She works as a nurse in the city hospital.",
    "The soup needs a little more salt.",
    "We missed the last bus and walked home.",
    "The concert starts at half past eight.",
    "Can I pay by card?",
]

HANDBOOK = (
    "You answer questions about the Northwind Travel employee handbook. Use only the handbook below.\n\n"
    "Handbook:\n"
    "1. Working hours. The core hours are 10:00 to 15:00; staff choose when to start between 07:00 and 10:00.\n"
    "2. Remote work. Employees may work remotely up to three days a week after their probation period of six "
    "months. Remote days must be recorded in the planning tool by Friday of the previous week.\n"
    "3. Holidays. Full-time employees receive 27 days of paid holiday per year plus public holidays. Up to five "
    "unused days can be carried over to the next year and must be taken before the end of March.\n"
    "4. Expenses. Travel expenses are reimbursed within 30 days when submitted with receipts. Meals on business "
    "trips are covered up to 45 euros per day. First-class rail travel requires a manager's approval.\n"
    "5. Equipment. Every employee receives a laptop and may claim up to 300 euros every two years for a desk "
    "chair, monitor or headset for home use.\n"
    "6. Training. Each employee has a training budget of 1,200 euros per year. Courses must be agreed with the "
    "team lead, and certificates are added to the personnel file.\n"
    "7. Sick leave. Employees who are ill must tell their team lead before 09:30. A doctor's note is needed "
    "from the fourth day of absence.\n\n"
)
QUESTIONS = [
    "How many days of paid holiday does a full-time employee get?",
    "When can a new employee start working remotely?",
    "What are the core working hours?",
    "How much can be spent on meals per day during a business trip?",
    "Until when must carried-over holiday days be taken?",
    "What is the yearly training budget?",
    "From which day of sick leave is a doctor's note required?",
    "How often can an employee claim money for home-office equipment?",
    "Who must approve first-class rail travel?",
    "By when must remote days be recorded?",
    "How long does reimbursement of travel expenses take?",
    "What must an employee do if they are ill?",
    "How many unused holiday days can be carried over?",
    "What is the earliest time staff can start work?",
    "Where are training certificates kept?",
    "Which items can be bought with the home-office allowance?",
    "Is a receipt needed to be reimbursed for expenses?",
    "How long is the probation period?",
    "How many remote days per week are allowed?",
    "Does the company provide a laptop?",
    "Who must agree to a training course?",
    "What is the latest time to report being ill?",
    "Are public holidays included in the 27 days?",
    "What is the maximum amount for home-office equipment?",
]

SUMMARY_HEAD = "Summarize the following text in one short sentence.\n\nText: "
TEXTS = [
    "The city council voted on Tuesday to extend the cycle lane network by forty kilometres over the next "
    "three years, funded partly by a new parking levy in the centre.",
    "Researchers found that honeybees exposed to low doses of a common pesticide were slower to learn the "
    "location of new flowers, which may reduce how much food a colony collects.",
    "After two years of delays, the new library opened its doors on Monday with a café, a children's wing "
    "and a rooftop garden that is open to the public at weekends.",
    "The company reported higher sales in the spring quarter, driven by demand for its electric bicycles, "
    "but warned that shipping costs would weigh on profits later in the year.",
    "Volunteers planted more than ten thousand trees along the river last weekend to reduce flooding and "
    "give birds new places to nest.",
    "A local bakery has started delivering bread by cargo bike, cutting its fuel bill and making morning "
    "deliveries faster in the narrow streets of the old town.",
    "The school introduced a four-day timetable for older pupils, with the fifth day reserved for projects, "
    "internships and independent study.",
    "Engineers replaced the old stone bridge's foundations without closing it to pedestrians, using "
    "temporary steel supports installed at night.",
    "The museum will return three statues to the country they were taken from a century ago, after a "
    "two-year review of its collection's history.",
    "Heavy snow closed mountain roads for two days, stranding hundreds of tourists in hotels that offered "
    "free rooms until the passes reopened.",
    "A new study suggests that short walks after meals help keep blood sugar levels stable, especially in "
    "older adults.",
    "The orchestra performed in a disused factory, drawing a young audience that rarely attends concerts "
    "in the main hall.",
    "Farmers in the valley are switching to drought-resistant crops after three dry summers in a row.",
    "The airport will open a third terminal next spring, adding capacity for eight million passengers a year.",
    "A software update fixed the bug that made some smart thermostats heat homes in the middle of the night.",
    "The town's annual chess festival attracted a record four hundred players, the youngest aged seven.",
]

CODE_HEAD = "Write a one-line Python docstring for the function below.\n\n```python\n"
FUNCS = [
    "def mean(xs):\n    return sum(xs) / len(xs)",
    "def is_palindrome(s):\n    s = s.lower()\n    return s == s[::-1]",
    "def chunks(xs, n):\n    return [xs[i:i + n] for i in range(0, len(xs), n)]",
    "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))",
    "def word_count(text):\n    return len(text.split())",
    "def flatten(rows):\n    return [x for row in rows for x in row]",
    "def celsius_to_fahrenheit(c):\n    return c * 9 / 5 + 32",
    "def unique(xs):\n    return list(dict.fromkeys(xs))",
    "def factorial(n):\n    return 1 if n <= 1 else n * factorial(n - 1)",
    "def read_lines(path):\n    with open(path) as f:\n        return f.read().splitlines()",
    "def dot(a, b):\n    return sum(x * y for x, y in zip(a, b))",
    "def first_or_none(xs):\n    return xs[0] if xs else None",
    "def invert(d):\n    return {v: k for k, v in d.items()}",
    "def is_even(n):\n    return n % 2 == 0",
    "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s.lower())",
    "def normalize(xs):\n    total = sum(xs)\n    return [x / total for x in xs]",
]

STANDALONE = [
    "Write a haiku about a lighthouse in winter.",
    "List three tips for keeping houseplants alive.",
    "Explain what a hash table is to a ten-year-old.",
    "Give me a name for a bakery that only sells sourdough.",
    "What is the difference between weather and climate?",
    "Suggest a weekend itinerary for a rainy city break.",
    "Why do cats knock things off tables?",
    "Describe the smell of a forest after rain.",
    "Write the opening line of a detective novel set on a train.",
    "How does a bicycle stay upright?",
    "Propose three questions to ask at the end of a job interview.",
    "What are the rules of rock, paper, scissors?",
    "Invent a holiday and describe how people celebrate it.",
    "Explain compound interest with a simple example.",
    "Write a short thank-you note to a neighbour who watered my plants.",
    "What should I pack for a day of hiking in the mountains?",
]

SYSTEM = {
    "sentiment": "You are a precise text classifier. Answer with a single word.",
    "translate": "You are a professional English-to-French translator.",
    "qa": "You are a helpful HR assistant. Answer briefly and cite the handbook section.",
    "summarize": "You are a concise news editor.",
    "docstring": "You are a senior Python developer who writes clear documentation.",
    "open": "You are a friendly, creative assistant.",
}


def sample_rows() -> list[dict]:
    """The sample rows, shuffled deterministically."""
    rows: list[dict] = []

    def add(task: str, prompt: str, user: str, max_tokens: int | None = None) -> None:
        rows.append(
            {
                "task": task,
                "prompt": prompt,
                "messages": [
                    {"role": "system", "content": SYSTEM[task]},
                    {"role": "user", "content": user},
                ],
                "sampling": {"max_tokens": max_tokens} if max_tokens is not None else None,
            }
        )

    for r in REVIEWS:
        add(
            "sentiment",
            f"{SENTIMENT_HEAD}Review: {r}\nSentiment:",
            f"{SENTIMENT_HEAD}Review: {r}\nSentiment:",
            2,
        )
    for s in SENTENCES:
        add("translate", f"{TRANSLATE_HEAD}English: {s}\nFrench:", f"{TRANSLATE_HEAD}English: {s}\nFrench:")
    for q in QUESTIONS:
        add("qa", f"{HANDBOOK}Question: {q}\nAnswer:", f"{HANDBOOK}Question: {q}")
    for t in TEXTS:
        add("summarize", f"{SUMMARY_HEAD}{t}\nSummary:", f"{SUMMARY_HEAD}{t}")
    for f in FUNCS:
        add("docstring", f"{CODE_HEAD}{f}\n```\nDocstring:", f"{CODE_HEAD}{f}\n```")
    for p in STANDALONE:
        add("open", p, p)
    random.Random(20240601).shuffle(rows)
    for i, r in enumerate(rows):
        r["id"] = f"sample-{i:04d}"
    return rows


def write_sample(path: str | Path) -> Path:
    """Write the sample Parquet file (two row groups) to `path`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = sample_rows()
    msg = pa.struct([("role", pa.string()), ("content", pa.string())])
    schema = pa.schema(
        [
            ("id", pa.string()),
            ("task", pa.string()),
            ("prompt", pa.string()),
            ("messages", pa.list_(msg)),
            ("sampling", pa.struct([("max_tokens", pa.int32())])),
        ]
    )
    table = pa.Table.from_pylist(rows, schema=schema)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=64, compression="zstd")
    return path


def default_path() -> Path:
    return Path(__file__).resolve().parent.parent / "sample_data" / "prompts.parquet"


if __name__ == "__main__":
    out = write_sample(sys.argv[1] if len(sys.argv) > 1 else default_path())
    print(f"wrote {out}")
