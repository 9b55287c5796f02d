"""--overlap-param-gather: the all-gathers are issued in the order the forward uses the buckets (the
embedding's first), and the first forward waits only for its own bucket, through a forward pre-hook."""

from pathlib import Path

from harness import run_script

WORKER = Path(__file__).parent / "workers" / "gather_order.py"


def test_param_gathers_issue_in_forward_order_and_first_forward_waits_only_for_its_bucket():
    assert run_script(WORKER, 2, timeout=300).strip().endswith("ok")
