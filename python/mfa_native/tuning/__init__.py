"""The on-device tuner: candidate rows of the tile tables (candidates.py), a problem set
(problems.py), one candidate run, checked and timed (trial.py), the sweep (sweep.py); and
`emit --report`'s table of kernels against alternative rows (kernel_report.py)."""
