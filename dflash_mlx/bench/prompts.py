"""The built-in prompt set of ``dflash-mlx bench`` and the JSONL prompt format.

Every prompt is a dict with the same three fields a ``--prompts FILE`` line has:

- ``id``: unique name (a file line without one gets ``<category>-<line number>``);
- ``category``: the tag results are split by (a line without one gets ``custom``);
- ``prompt``: the text, fed through the target's chat template when it has one.

The built-in set is written for this project (no benchmark text is copied) and
has four categories of eight, in the spirit of the public sets the published
DFlash figures use: ``math`` (gsm8k-style word problems), ``code`` (completion
and code from a description, humaneval-style), ``chat`` (open questions,
mt-bench-style) and ``summarize`` (two long passages, four tasks each).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import DFlashError
from ..jsonl import read_jsonl

CATEGORIES = ("math", "code", "chat", "summarize")

_MATH = [
    "A bakery sells muffins for $3 each and cookies for $1.25 each. On Saturday it sold 48 muffins "
    "and three times as many cookies. How much money did it take in? Show your reasoning step by step.",
    "A train leaves a station at 9:40 and travels 210 km at an average speed of 84 km/h. At what time "
    "does it arrive? Explain each step.",
    "Maria reads 18 pages on weekdays and 35 pages on each weekend day. Her novel has 412 pages. If she "
    "starts on a Monday, on which day does she finish, and how many pages are left for that last day?",
    "A rectangular garden is 14 m long and 9 m wide. A path 1.5 m wide runs around the outside of it. "
    "What is the area of the path? Work it out step by step.",
    "A shop marks a jacket up 40% over cost, then puts it on sale at 25% off the marked price. The sale "
    "price is $63. What did the jacket cost the shop, and what is the profit on the sale?",
    "Three friends share a taxi. The fare is a $4 flag fee plus $2.10 per kilometre. Ana rides 6 km, "
    "Ben rides 11 km and Chloe rides the whole 15 km; each pays for the part of the trip they were in "
    "the car, and the flag fee is split evenly. How much does each pay?",
    "A water tank holds 1,200 litres. One pipe fills it in 40 minutes and a drain empties it in 60 "
    "minutes. Starting empty with both open, how long until the tank is full? Explain.",
    "The sum of three consecutive even numbers is 222. What are the numbers? Then find the product of "
    "the smallest and the largest. Show every step.",
]

_CODE = [
    # completion
    "Complete this Python function.\n\n"
    "def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:\n"
    '    """Merge overlapping closed intervals and return them sorted by start.\n\n'
    "    >>> merge_intervals([(1, 3), (2, 6), (8, 10), (15, 18)])\n"
    "    [(1, 6), (8, 10), (15, 18)]\n"
    '    """\n',
    "Complete this Python function.\n\n"
    "def is_balanced(text: str) -> bool:\n"
    '    """Return True if every bracket in text, of the kinds (), [] and {}, is closed in the\n'
    "    right order, ignoring all other characters.\n\n"
    "    >>> is_balanced('f(a[1], {b: 2})')\n"
    "    True\n"
    "    >>> is_balanced('(]')\n"
    "    False\n"
    '    """\n',
    "Complete this Python class.\n\n"
    "class LRUCache:\n"
    '    """A least-recently-used cache holding at most `capacity` items."""\n\n'
    "    def __init__(self, capacity: int):\n"
    "        self.capacity = capacity\n"
    "        self.items = {}\n\n"
    "    def get(self, key):\n",
    "Complete this Python function.\n\n"
    "def run_length_encode(data: str) -> str:\n"
    '    """Encode runs of repeated characters as count + character.\n\n'
    "    >>> run_length_encode('aaabccdddd')\n"
    "    '3a1b2c4d'\n"
    '    """\n',
    # from a description
    "Write a Python function `word_frequencies(path)` that reads a UTF-8 text file and returns the ten "
    "most common words, lower-cased, with punctuation stripped, as a list of (word, count) pairs sorted "
    "by count and then alphabetically. Include a docstring and a short example.",
    "Write a Python function that takes a list of integers and returns the length of the longest "
    "strictly increasing contiguous run. Then write three pytest tests for it, including an empty list.",
    "Write a small command-line program in Python that converts temperatures between Celsius and "
    "Fahrenheit. It takes a number and a unit flag (--to-c or --to-f) and prints the result rounded to "
    "one decimal place. Use argparse.",
    "Write a Python generator `sliding_windows(seq, size, step=1)` that yields tuples of `size` "
    "consecutive items, advancing by `step`, and stops without a partial window. Explain the edge cases.",
]

_CHAT = [
    "What are the main differences between a list and a tuple in Python, and when would you choose each?",
    "I have a job interview for a junior data analyst role next week. How should I prepare? Give me a "
    "concrete plan for the seven days.",
    "Explain to a curious twelve-year-old why the sky is blue during the day and red at sunset.",
    "What are the pros and cons of working from home compared with working in an office? Give a "
    "balanced answer.",
    "Write a short, friendly email to a neighbour asking them to water my plants while I am away for "
    "two weeks in August.",
    "How does a refrigerator keep food cold? Describe the cycle in plain language.",
    "Suggest a three-day itinerary for a first visit to a mid-sized European city with old town walls, "
    "a river and good museums. Keep it practical.",
    "What habits help people sleep better? List the most useful ones and say briefly why each works.",
]

_HARBOUR = """\
The harbour town of Keldrow sits at the mouth of a narrow estuary, where the river Aln meets a cold
and restless sea. For most of its history the town lived on three things: herring, salt and the
ferry that crossed the estuary to the farms on the southern shore. The herring came in great shoals
each autumn, and for six weeks every able person in Keldrow worked on the boats, on the quay or in
the long smoking sheds that still stand, roofless now, behind the fish market. The salt came from
shallow pans cut into the mudflats north of the town, where seawater was let in at high tide and
left to evaporate through the summer. The ferry was a flat wooden boat pulled across on a chain,
and the right to run it was passed down through one family for nearly two hundred years.

The first great change came with the railway. When the line from the county town reached Keldrow,
fresh fish could be sent inland overnight, and the price a boat could get for its catch rose by half
within a decade. The smoking sheds doubled in number. Families who had lived in two rooms above the
net lofts built stone houses on the hill, and the town council, flush with harbour dues, paid for a
new breakwater, a lifeboat station and a school with four classrooms. The salt pans, which could not
compete with salt brought cheaply by rail from the mines, were abandoned within a generation, and the
mudflats slowly returned to reed beds and wading birds.

The second change was slower and harder to see while it happened. The herring began to come later
each year, and in smaller shoals. Older fishermen blamed the steam trawlers working farther out, which
caught the fish before they reached the coast; younger ones blamed the weather. Both were partly
right. Catches fell for thirty years, with a few good seasons in between that kept hope alive and
delayed every decision. By the time the council commissioned a survey, the boats that remained were
mostly owned by men over fifty, and the survey's main recommendation, that the harbour be deepened so
larger vessels could use it, was judged too expensive. The last smoking shed closed the same year the
ferry was replaced by a road bridge two miles upstream.

For a while it seemed that Keldrow would simply empty. The school lost two of its four classrooms.
Shops on the harbour front were boarded up, and the population fell by a third. What turned things
round was not one plan but several small ones that happened to reinforce each other. A retired
teacher began to run guided walks along the old salt pans, which had become a nesting ground for
avocets and redshanks; within a few years the reed beds were a protected reserve and drew birdwatchers
in every season. Two of the empty smoking sheds were turned into workshops by a group of boat
builders who repaired and restored wooden craft, and their waiting list soon stretched to three years.
The lifeboat station, still run by volunteers, became a point of pride and a reason for young people to
stay.

Not everyone welcomed the new Keldrow. Holiday lets pushed up the price of houses on the hill until
few local families could afford them, and in winter whole streets stood dark. The council argued for
years over whether to limit second homes, and in the end it introduced a modest extra tax on them,
with the money going to a housing association that built twenty small homes for rent near the school.
Fishermen who remembered the herring years complained that the town had become a museum of itself.
The boat builders answered that a working workshop with apprentices was hardly a museum, and pointed
out that their trade now employed more people than the last years of fishing had.

Today Keldrow has roughly the population it had a century ago, though the people do very different
work. The harbour still shelters a handful of boats that fish for crab and lobster, and the quay is
busy in summer with visitors waiting for boat trips to the seal colony on the outer sandbank. The
school has three classrooms again. The smoking sheds that were not converted remain as they were left,
their blackened beams open to the sky, and the town has resisted every proposal to tidy them away.
As one councillor put it during the last debate, a town that forgets how it earned its living is
likely to make the same mistakes the next time the shoals stop coming.
"""

_GRID = """\
Most people never think about the electricity grid until it fails, yet it is one of the most
carefully balanced machines ever built. Its basic rule is simple to state and hard to keep: at every
moment, the power fed into the network must match the power taken out of it, plus the small amount
lost as heat in the wires. There is almost no storage inside the grid itself. When a kettle is
switched on somewhere, some generator, somewhere, must produce a little more power within seconds, or
the balance slips.

Operators watch that balance through the frequency of the alternating current. In many countries the
grid runs at fifty cycles per second. When demand rises faster than supply, the large spinning
generators connected to the network slow down very slightly, because the extra load is being drawn
from their rotating mass, and the frequency drops. When supply exceeds demand they speed up and the
frequency rises. A change of a few hundredths of a cycle is normal; a change of half a cycle is an
emergency. Frequency is therefore both a measurement and a signal that every generator on the network
can read at the same instant.

The response to a frequency change comes in layers. The first layer is inertia: the stored energy
in all those heavy spinning machines, which cushions a sudden loss of supply for a few seconds simply
because the rotors cannot stop instantly. The second layer is automatic: governors on selected power
stations sense the falling frequency and open their steam or water valves a little further, without
any instruction from a control room. The third layer is human and economic: operators call on
reserve plants, or on large customers who have agreed to reduce their demand in return for a payment,
to restore the balance over the following minutes and free the automatic reserves for the next event.

Wind and solar farms have changed this picture in two ways. First, their output depends on the
weather, so the operator must forecast it as carefully as demand and keep enough flexible capacity
ready for the hours when the forecast is wrong. Second, most of them connect to the grid through
power electronics rather than spinning machines, so they add little natural inertia. A grid that runs
mostly on wind and sun on a bright, breezy afternoon can therefore be more sensitive to a sudden fault
than the same grid running on coal and gas, even though it has plenty of energy available.

Engineers have several answers. Batteries can respond to a frequency change in a fraction of a
second, faster than any governor, and are now widely paid to do exactly that. Inverters can be
programmed to imitate the behaviour of a spinning machine, releasing a burst of power when the
frequency falls; this is often called synthetic inertia. Some operators have even installed large
flywheels and synchronous condensers, which are motors spinning freely on the network with no load,
purely to provide the stabilising mass that retiring power stations used to supply. Interconnectors
to neighbouring countries help as well, because a large shared network smooths out local swings.

Demand is becoming part of the solution too. Electric car chargers, heat pumps and water heaters can
shift their consumption by a few minutes or hours without their owners noticing, and aggregators
bundle thousands of such devices into a single resource that can be switched down when supply is
short. Industrial users such as cold stores and water pumping stations have done this for decades;
the difference now is the scale and the speed at which small devices can be coordinated.

None of this removes the need for careful planning. The grid must be designed for the worst plausible
day, not the average one: a still, cold winter evening with little wind, little sun and high demand
for heating. Meeting that peak reliably, at a price people can pay, is the central problem of the
energy transition, and it is as much a question of markets, rules and forecasting as of hardware.
"""

_SUMMARIZE_TASKS = [
    "Summarize the passage above in one paragraph of about 100 words.",
    "List the five most important points of the passage above as short bullet points.",
    "Write a headline and a two-sentence summary of the passage above for a newsletter.",
    "What is the main cause-and-effect chain described in the passage above? Explain it in your own words.",
]


def _summaries() -> list[dict]:
    out = []
    for name, passage in (("harbour", _HARBOUR), ("grid", _GRID)):
        for n, task in enumerate(_SUMMARIZE_TASKS, 1):
            out.append({"id": f"summarize-{name}-{n}", "category": "summarize",
                        "prompt": f"{passage.strip()}\n\n{task}"})
    return out


def builtin_prompts() -> list[dict]:
    """The built-in set: 32 prompts, eight per category, in a fixed order."""
    prompts = []
    for category, texts in (("math", _MATH), ("code", _CODE), ("chat", _CHAT)):
        prompts += [{"id": f"{category}-{n}", "category": category, "prompt": text}
                    for n, text in enumerate(texts, 1)]
    return prompts + _summaries()


def load_prompts(path: str | Path, default_category: str = "custom") -> list[dict]:
    """Read a JSONL prompt file: one object per line with ``prompt`` and
    optionally ``category`` and ``id``. Raises DFlashError naming the bad line."""
    path = Path(path)
    prompts, seen = [], set()
    for n, row in read_jsonl(path):
        where = f"{path}:{n}"
        if not isinstance(row, dict):
            raise DFlashError(f"{where}: expected an object with a 'prompt' field")
        text = row.get("prompt")
        if not isinstance(text, str) or not text.strip():
            raise DFlashError(f"{where}: 'prompt' must be a non-empty string")
        category = row.get("category", default_category)
        if not isinstance(category, str) or not category:
            raise DFlashError(f"{where}: 'category' must be a non-empty string")
        pid = row.get("id", f"{category}-{n}")
        if not isinstance(pid, (str, int)):
            raise DFlashError(f"{where}: 'id' must be a string")
        pid = str(pid)
        if pid in seen:
            raise DFlashError(f"{where}: duplicate id '{pid}'")
        seen.add(pid)
        prompts.append({"id": pid, "category": category, "prompt": text})
    if not prompts:
        raise DFlashError(f"prompt file '{path}' has no prompts")
    return prompts


def select(prompts: list[dict], categories: list[str] | None = None, limit: int | None = None) -> list[dict]:
    """Keep the given categories (all if None), then at most ``limit`` prompts taken
    round-robin over the categories so that every category stays represented."""
    if categories:
        known = {p["category"] for p in prompts}
        missing = [c for c in categories if c not in known]
        if missing:
            raise DFlashError(f"no prompts in categories {missing}; the set has {sorted(known)}")
        prompts = [p for p in prompts if p["category"] in categories]
    if not limit or limit >= len(prompts):
        return list(prompts)
    queues: dict[str, list[dict]] = {}
    for p in prompts:
        queues.setdefault(p["category"], []).append(p)
    picked: list[dict] = []
    while len(picked) < limit:
        for queue in queues.values():
            if queue and len(picked) < limit:
                picked.append(queue.pop(0))
    order = {id(p): i for i, p in enumerate(prompts)}
    return sorted(picked, key=lambda p: order[id(p)])


def select_prompts(source: str, categories: list[str] | None, limit: int | None) -> list[dict]:
    """``--prompts``: 'builtin', 'demo' (the demo pair's held-out prompts) or a JSONL
    file; then ``--category`` and ``--limit`` as in ``select``."""
    if source == "builtin":
        prompts = builtin_prompts()
    elif source == "demo":
        from ..demo import demo_pair

        prompts = load_prompts(demo_pair().prompts, default_category="heldout")
    else:
        prompts = load_prompts(source)
    return select(prompts, categories, limit)
