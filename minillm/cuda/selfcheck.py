"""`python -m minillm.cuda.selfcheck [--quick]`: the GPU's checks and benchmark in one run. The driver
lives with the other measuring code, in minillm/cuda/dev/selfcheck.py."""
import sys

from minillm.cuda.dev.selfcheck import main

if __name__ == "__main__":
    sys.exit(main())
