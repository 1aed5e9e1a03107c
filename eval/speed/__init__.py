"""`python -m eval speed` (decode, scan, rows, fair, startup) and `python -m eval profile`, and their section of the
results page."""
