"""The memory and step-time models against benchmarks/measured.jsonl, by feature (the tables of docs/planning.md).

Usage: python benchmarks/model_errors.py [--records FILE]   (prints two markdown tables)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys


def main(argv: list[str]) -> int:
    from meshtron.planning.measured import errors_by_feature, load_records, memory_errors, step_errors
    from meshtron.planning.profiles import H200

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", default=os.path.join(os.path.dirname(__file__), "measured.jsonl"))
    args = parser.parse_args(argv)
    records = load_records(args.records)
    for title, errors in (("peak memory", memory_errors(records)), ("step time", step_errors(records, H200))):
        median = statistics.median(abs(e.relative) for e in errors)
        print(f"\n{title}: {len(errors)} rows, median |error| {median:.1%}\n")
        print("| rows with | rows | median abs error | worst |")
        print("|---|---|---|---|")
        for name, n, med, bad in errors_by_feature(errors, records):
            print(f"| {name} | {n} | {med:.1%} | {bad.relative:+.1%} ({bad.id}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
