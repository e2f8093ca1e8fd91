"""The on-device tuner: candidate rows of the tile tables (candidates.py), a problem set
(problems.py), one candidate run, checked and timed (trial.py), the sweep (sweep.py)."""
