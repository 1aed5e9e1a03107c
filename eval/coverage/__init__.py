"""`python -m eval coverage`: the test suite's coverage of h2o_stream, per package."""
