"""`python -m eval attention`: where each layer's queries put their attention, on the model alone."""
