"""Extract structured records from free text: JSON by schema, a date by regex, a verdict by select.

    .venv/bin/python examples/json_extraction.py [--url http://127.0.0.1:30000]

The JSON is constrained by a JSON schema (it always parses and validates), the date by a regex,
and whether the person is an adult is a `select` among fixed labels. The instruction and the
example are a constant prefix: `run_batch` caches it once for all documents.
Without `--url` the default model runs in-process.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import radixlm as sgl

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 20},
    },
    "required": ["name", "age", "city"],
}
DATE_REGEX = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
INSTRUCTIONS = """Extract the person as JSON, then the date, then whether they are an adult.

Text: Bob is 42 years old and lives in Berlin. He signed the lease on 2021-03-14.
JSON: {"name":"Bob","age":42,"city":"Berlin"}
Date: 2021-03-14
Adult: yes

"""
DOCUMENTS = [
    "Alice is 30 years old and lives in Paris. She was hired on 2019-06-01.",
    "Tom, a 12 year old from Madrid, won the chess cup on 2023-11-20.",
    "Maria is 67 years old and lives in Rome. She retired on 2020-01-31.",
]


@sgl.function
def extract(s, text: str, max_tokens: int = 48):
    s += INSTRUCTIONS + "Text: " + text + "\n"
    s += "JSON: " + sgl.gen("json", max_tokens=max_tokens, json_schema=PERSON_SCHEMA) + "\n"
    s += "Date: " + sgl.gen("date", max_tokens=12, regex=DATE_REGEX) + "\n"
    s += "Adult: " + sgl.select("adult", ["yes", "no"])


def main(argv: list[str] | None = None, backend: Any = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="a radixlm server; default: the model in-process")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args(argv)
    own = backend is None
    backend = backend or (sgl.RuntimeEndpoint(args.url) if args.url else sgl.Runtime())
    try:
        states = extract.run_batch(
            [{"text": t, "max_tokens": args.max_tokens} for t in DOCUMENTS],
            backend=backend,
            temperature=0,
        )
        records = []
        for text, s in zip(DOCUMENTS, states):
            if s.error() is not None:
                print(f"{text}\n  error: {s.error()}")
                continue
            record = {**json.loads(s["json"]), "date": s["date"], "adult": s["adult"]}
            records.append(record)
            print(f"{text}\n  -> {json.dumps(record)}")
        return records
    finally:
        if own:
            backend.shutdown()


if __name__ == "__main__":
    main()
