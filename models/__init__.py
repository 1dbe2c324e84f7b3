"""Models and their data: `digits` (real), `speech` and `embedding` (synthetic)."""

from models import digits, embedding, speech

MODELS = {"digits": digits, "speech": speech, "embedding": embedding}

__all__ = ["MODELS", "digits", "embedding", "speech"]
