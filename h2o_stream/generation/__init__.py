"""Generation on top of the engine: one decode loop shared by chat, summarize and the evaluations."""
