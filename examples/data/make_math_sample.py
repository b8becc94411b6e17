"""Writes ``math_sample.jsonl``: short word problems in GSM8K's record format (``question``, ``answer`` ending in
``#### <number>``), written for moerl so that ``examples/math_cispo.yaml`` runs as shipped on a tiny model. One-step
sums and differences of small numbers; a real GSM8K-style file replaces it through ``env.kwargs.path``.

python examples/data/make_math_sample.py   (deterministic: the committed file is its output)
"""

import json
import random
from pathlib import Path

NAMES = ["Ana", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea"]
ITEMS = ["apples", "pens", "stamps", "shells", "cards", "books", "coins", "marbles"]
# (question template, operation, worked step): {n} name, {i} item, {a} {b} the numbers
TEMPLATES = [
    ("{n} has {a} {i}. {n} gets {b} more. How many {i} does {n} have?", "+", "{a} + {b} = {c}"),
    ("{n} had {a} {i} and found {b} more. How many {i} now?", "+", "{a} + {b} = {c}"),
    ("{n} has {a} {i} and gives away {b}. How many {i} are left?", "-", "{a} - {b} = {c}"),
    ("{n} had {a} {i} and lost {b} of them. How many {i} remain?", "-", "{a} - {b} = {c}"),
]


def main() -> None:
    rng = random.Random(2026)
    seen, records = set(), []
    while len(records) < 400:
        template, op, step = rng.choice(TEMPLATES)
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        if op == "-" and b > a:
            a, b = b, a
        c = a + b if op == "+" else a - b
        q = template.format(n=rng.choice(NAMES), i=rng.choice(ITEMS), a=a, b=b)
        if q not in seen:
            seen.add(q)
            records.append({"question": q, "answer": f"{step.format(a=a, b=b, c=c)}\n#### {c}"})
    out = Path(__file__).with_name("math_sample.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"wrote {len(records)} problems to {out}")


if __name__ == "__main__":
    main()
