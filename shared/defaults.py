"""Where the embedded default target/draft pair lives (shipped inside the package)."""
from __future__ import annotations

from pathlib import Path

MODELS_DIR = Path(__file__).parent / "assets" / "models"
DEFAULT_TARGET = MODELS_DIR / "target"
DEFAULT_DRAFT = MODELS_DIR / "draft"
EMBEDDED_MODEL_NAME = "deltaspec-embedded"  # the embedded target's name in GetModel and on /v1/models
