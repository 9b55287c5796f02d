"""The step-time model against published Megatron-LM runs: per-run table, p10/p50/p90 of predicted / measured MFU.

    python bench/plan_calibration.py           # the table and the errors of the stored factors
    python bench/plan_calibration.py --refit   # fit again and rewrite tricorn/planning/data/step_time_calibration.json

Columns: measured MFU (model FLOPs, from the source's own FLOPs convention; see tricorn/planning/calibration.py),
predicted MFU, their ratio in sample and leave-one-out (factors fitted without that run), the layout, and the
assumptions the record needed. Also, per record, the planner's top choice for that model and cluster against
the published layout: 'ok' when the choice predicts at least the published layout's throughput, 'tie' when it
is within the interval of it. The ratio printed last is the in-sample p50. Not run by CI.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tricorn.planning import calibration as cal  # noqa: E402
from tricorn.planning.efficiency import Efficiency  # noqa: E402
from tricorn.planning.plan_checks import compare_with_published  # noqa: E402


def main(argv: list[str]) -> int:
    runs = cal.load_runs()
    if "--refit" in argv:
        data = cal.calibrate(runs)
        tmp = cal.FIT_FILE + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(data, fh, indent=1)
            fh.write("\n")
        os.replace(tmp, cal.FIT_FILE)
        cal.stored.cache_clear()
        print(f"wrote {cal.FIT_FILE}")
    data = cal.stored()
    effs = {gpu: Efficiency(**f) for gpu, f in data["factors"].items()}
    loo = cal.leave_one_out(runs)
    print(
        f"{'#':>2} {'run':<28} {'gpu':<5} {'TP':>2} {'PP':>3} {'VP':>2} {'DP':>4} {'mb':>2} {'rec':<4} Z "
        f"{'meas MFU':>8} {'pred':>6} {'ratio':>6} {'LOO':>6}  planner  assumptions"
    )
    ins = []
    for r in runs:
        x = cal.ratio(r, effs[r.gpu])
        ins.append(x)
        lay = r.layout
        verdict = compare_with_published(r)
        print(
            f"{r.index:2d} {r.name[:28]:<28} {r.gpu[:4]:<5} {lay.tp:2d} {lay.pp:3d} {lay.vpp:2d} {lay.dp:4d} "
            f"{lay.micro_batch:2d} {(lay.recompute or 'none')[:4]:<4} {lay.zero_stage} {r.measured_mfu:8.3f} "
            f"{r.measured_mfu * x:6.3f} {x:6.3f} {loo[r.index]:6.3f}  {verdict:<7}  {'; '.join(r.assumptions)}"
        )
    for gpu, e in effs.items():
        print(f"factors {gpu}: " + ", ".join(f"{k} {v:.3f}" for k, v in e.as_dict().items()))
    p = cal.quantiles(ins)
    lo = cal.quantiles([v for v in loo.values() if v is not None])
    print(f"predicted / measured MFU, in sample ({len(ins)} runs): p10 {p[0]:.3f}  p50 {p[1]:.3f}  p90 {p[2]:.3f}")
    print(f"leave one run out:                         p10 {lo[0]:.3f}  p50 {lo[1]:.3f}  p90 {lo[2]:.3f}")
    so = data["leave_one_source_out_p10_p50_p90"]
    print(
        f"leave one source out ({data['leave_one_source_out_runs']} runs with a source left): "
        f"p10 {so[0]:.3f}  p50 {so[1]:.3f}  p90 {so[2]:.3f}"
    )
    print(f"ratio (in-sample p50): {p[1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
