"""onegraph.runtime: artifact loading and the thin replay engine (no model code on the hot path)."""
from .artifact import Artifact, ArtifactError  # noqa: F401
from .engine import Engine, Event, QueueFull, Result  # noqa: F401
from .executor import GraphExecutor, Sampling  # noqa: F401
