"""`python -m eval leaderboard` and `python -m eval long`: runs of `h2o-stream` over the corpus, and their boards."""
