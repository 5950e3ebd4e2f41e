import sys
from pathlib import Path

# tests import their helpers as plain modules (hf_models, ...)
sys.path.insert(0, str(Path(__file__).parent))
