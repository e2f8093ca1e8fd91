"""The user-facing ops: validate a call, build its pass, run it (warm calls skip to the run)."""
