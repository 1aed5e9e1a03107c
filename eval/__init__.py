"""The benchmark suites of h2o-stream, one package each, and the renderer of their results (`python -m eval`)."""
