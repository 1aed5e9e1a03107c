"""`python -m eval serve`: `h2o-stream serve` under load."""
