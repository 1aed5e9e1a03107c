"""`python -m eval calibration`: head_hybrid's head classifications per model and cache size."""
