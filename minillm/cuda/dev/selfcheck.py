"""The lab's selfcheck:  python -m minillm.cuda.dev.selfcheck [--quick]  (the options of minillm.cuda.selfcheck)

Every kernel family against NumPy (elementwise, gemv, attention; earlier versions included) in fp16 and bf16,
the model checks on the shipped and the lab's decode steps (dev/model.py), then the production selfcheck's
timing (the full tables and HF: `minillm bench --device cuda`). Ends with one line: all checks passed, or
which failed (exit status 1).
"""
from __future__ import annotations

import sys

from minillm.cuda import selfcheck
from minillm.cuda.dev import attention, elementwise, gemv
from minillm.cuda.dev.common import run_cases, say
from minillm.cuda.dev.model import model_checks

FAMILIES = (elementwise, gemv, attention)


def checks(quick: bool) -> None:
    say("kernels vs NumPy (error relative to the reference's largest value; NaN-poisoned outputs)")
    for family in FAMILIES:
        run_cases(family.cases, quick=quick)
    model_checks(quick)


def main(argv=None) -> int:
    return selfcheck.main(argv, checks=checks, prog="python -m minillm.cuda.dev.selfcheck")


if __name__ == "__main__":
    sys.exit(main())
