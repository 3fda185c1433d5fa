"""Client for the inference fabric's public gRPC API (no torch needed)."""

from inference_fabric_client.client import Client
from inference_fabric_client.results import (
    FabricError,
    GenerationChunk,
    PredictResult,
    ThrottledError,
)

__all__ = ["Client", "FabricError", "GenerationChunk", "PredictResult", "ThrottledError"]
