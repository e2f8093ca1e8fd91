"""Foundation benchmark table (same as `python -m mfa_native bench core`)."""

import sys

from mfa_native.bench.core import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
