"""`python -m eval split`: the heavy-hitter share of h2o and h2o_sinks, chosen on some books, reported on others."""
