"""The draft service: proposes tokens with the draft model, one round per call."""
