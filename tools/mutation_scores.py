"""Mutation score per module, from the results `mutmut run` left in mutants/ (`make mutants`).

mutmut prints one total; the issue asks for each core module to reach 90%, so this counts per
source file. Score = killed / (mutants - equivalent), where a timeout counts as killed (the
mutant changed behaviour enough to hang) and the equivalent mutants are the ones named in
mutants-equivalent.md: mutants that cannot change what the code does, so no test can kill
them. Survivors that are not listed there are printed, to be killed by a test or judged.

    python tools/mutation_scores.py [--min 90]   # exit 1 if a module scores below --min
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KILLED = {1: "killed", 3: "killed", 36: "timeout", 24: "timeout", -24: "timeout",
          152: "timeout", 255: "timeout", 37: "killed"}  # mutmut's exit codes (its stats.py)


def equivalent_mutants(path: Path) -> set[str]:
    """Mutant names written in backticks at the start of a list item of ``path``."""
    if not path.exists():
        return set()
    return set(re.findall(r"^\s*[-*]\s+`([\w.]+__mutmut_\d+)`", path.read_text(), re.M))


def status(exit_code: int | None) -> str:
    if exit_code is None:
        return "not checked"
    if exit_code in KILLED:
        return "killed"
    return {0: "survived", 5: "no tests", 33: "no tests"}.get(exit_code, "suspicious")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutants", type=Path, default=ROOT / "mutants")
    parser.add_argument("--equivalent", type=Path, default=ROOT / "mutants-equivalent.md")
    parser.add_argument("--min", type=float, default=None,
                        help="fail if a module's score is below this percentage")
    args = parser.parse_args()

    metas = sorted(args.mutants.rglob("*.py.meta"))
    if not metas:
        print(f"no mutmut results under {args.mutants}: run `make mutants` first")
        return 1
    equivalent = equivalent_mutants(args.equivalent)
    known = set()
    rows, survivors, failing = [], [], []
    for meta in metas:
        module = meta.relative_to(args.mutants).as_posix().removesuffix(".meta")
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        known |= set(codes)
        counts = Counter("equivalent" if name in equivalent and status(code) != "killed"
                         else status(code) for name, code in codes.items())
        judged = len(codes) - counts["equivalent"]
        score = 100.0 * counts["killed"] / judged if judged else 100.0
        rows.append((module, len(codes), counts, score))
        survivors += [name for name, code in codes.items()
                      if status(code) != "killed" and name not in equivalent]
        if args.min is not None and score < args.min:
            failing.append(module)

    print(f"{'module':32} {'mutants':>7} {'killed':>6} {'equiv':>5} {'alive':>5} {'score':>6}")
    for module, total, counts, score in rows:
        alive = total - counts["killed"] - counts["equivalent"]
        print(f"{module:32} {total:7d} {counts['killed']:6d} {counts['equivalent']:5d} "
              f"{alive:5d} {score:5.1f}%")
    if survivors:
        print("\nnot killed and not listed as equivalent (`mutmut show NAME` shows the diff):")
        for name in survivors:
            print("  ", name)
    stale = sorted(equivalent - known)
    if stale:
        print(f"\n{len(stale)} mutants in {args.equivalent.name} no longer exist (the code "
              f"changed: judge its survivors again):", *stale, sep="\n   ")
    if failing:
        print(f"\nbelow {args.min}%: {', '.join(failing)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
