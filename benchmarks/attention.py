"""Attention forward benchmark table (same as `python -m mfa_native bench attention`)."""

import sys

from mfa_native.bench.attention import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
