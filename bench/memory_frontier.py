"""The memory frontier of one 70B layout: the estimated peak per rank under each memory feature alone and all together.

    python bench/memory_frontier.py          # the table (tricorn/planning/frontier.py has the layout and flags)
    python bench/memory_frontier.py --walk   # also the cumulative walk docs/memory.md goes through
    python bench/memory_frontier.py --markdown   # the walk as docs/memory.md's table (paste it there)

llama3-70b on 16 x H100 80GB as TP 8 x PP 2 (sequence parallel), seq 8192, micro batch 1, global batch 512, bf16:
today's defaults, then each feature alone, then all together - the worst rank's device bytes by `tricorn estimate`
(CUDA context included), the host memory the offloads take, the saving against the defaults, and whether it
fits in 90% of the device (tricorn plan's margin). docs/memory.md ("Checked at 70B") gives `tricorn simulate`'s
measured peaks of this layout against these estimates (one-off runs of 2-6 minutes per rank, not this script).
Not run by CI.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tricorn.planning import frontier  # noqa: E402
from tricorn.planning.hardware import GiB, get_gpu  # noqa: E402


def table(rows: list[frontier.Row], base: float) -> str:
    usable = get_gpu(frontier.GPU).memory_bytes * (1 - frontier.MARGIN) / GiB
    out = [f"{'':34}{'peak/rank':>11}{'saving':>10}{'host':>10}   fits in {usable:.1f} GiB"]
    for r in rows:
        out.append(
            f"{r.name:<34}{r.total / GiB:7.2f} GiB{(base - r.total) / GiB:6.2f} GiB{r.host / GiB:6.2f} GiB   "
            f"{'yes' if r.fits else 'no'}"
        )
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if "--markdown" in argv:
        print(frontier.markdown(frontier.walk()))
        return 0
    print(f"tricorn estimate {' '.join(frontier.LAYOUT)} --world-size {frontier.WORLD_SIZE} (+ the flags of each row)\n")
    rows = frontier.alone()
    print(table(rows, rows[0].total))
    if "--walk" in argv:
        steps = frontier.walk()
        print("\ncumulative, each step keeping the ones before it:\n" + table(steps, steps[0].total))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
