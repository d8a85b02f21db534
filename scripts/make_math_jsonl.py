"""Write the worked example's dataset: arithmetic word problems with numeric answers, one JSON row a line.

    python scripts/make_math_jsonl.py storage/data/arith-word-problems.jsonl --rows 2400 --seed 0

`configs/examples/jsonl-math.yaml` writes the same file on first use (`task.generate`), so this script is
only needed for another size or seed, or to look at the rows a user's own file should resemble:
``{"uid": "arith-0", "prompt": "...", "answer": "19", "kind": "add", "solution": "12 + 7 = 19. answer: 19"}``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from pivotrl.tasks.arith import write_jsonl


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the JSONL file to write (storage/ is git-ignored)")
    ap.add_argument("--rows", type=int, default=2400)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.rows < 1:
        print(f"error: --rows {args.rows}: must be >= 1", file=sys.stderr)
        return 2
    path = write_jsonl(args.out, rows=args.rows, seed=args.seed)
    print(f"wrote {args.rows} rows to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
