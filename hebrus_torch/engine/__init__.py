"""Continuous batching for Qwen4Exp on the state holders (SPEC §8).

- ``scheduler.py``: which requests run each step and how many tokens (no tensors);
- ``runner.py``: executes a step on the model's own modules inside one ModelCache transaction;
- ``sampling.py``: per-request sampling as ``GenerationConfig`` describes it;
- ``prefix.py``: the prefix index for block sharing;
- ``prompt_cache.py``: kept prefixes as files that survive restarts (``prompt_cache_dir``);
- ``engine.py``: ``Engine`` ties them together (``add_request``, ``step``);
- ``manager.py``: the transformers-facing manager (``init_continuous_batching``, ``generate_batch``).
"""

from .engine import BadRequestError, Engine, EngineConfig, StepOutput
from .requests import FinishReason, Request, RequestStatus
from .runner import ModelRunner
from .sampling import SamplingParams
from .scheduler import ScheduledChunk, Scheduler, StepPlan

__all__ = ["Engine", "EngineConfig", "StepOutput", "BadRequestError", "Request", "RequestStatus",
           "FinishReason", "ModelRunner", "SamplingParams", "Scheduler", "StepPlan", "ScheduledChunk"]
