"""OpenMP settings of a model service, applied before torch loads its OpenMP runtime.

A torch thread that finishes its share of an op spins, waiting for the next one
(libgomp: GOMP_SPINCOUNT, 300,000 iterations by default) before it sleeps. When the
draft, the target and the coordinator share a machine they take turns, and the turn
that just ended spins on a core the next one needs. A short spin keeps the wait
between consecutive ops of one forward and gives the core back soon after it:
measured on the shipped pair on 2 cores (d at K = 6, 16 prompts), 2.2 ms of gRPC
overhead per round instead of 2.55.

Import this module before torch; an explicit GOMP_SPINCOUNT or OMP_WAIT_POLICY in the
environment wins.
"""

import os

SPIN_COUNT = "10000"

if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
