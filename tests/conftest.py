import os
import sys

# Multi-rank tests start several processes on a 2-core machine: one thread each.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))
