"""Continuous batching for Qwen4Exp on the state holders (SPEC §8).

- ``engine.py``: ``Engine`` (``add_request``, ``step``: schedule -> execute -> update);
- ``config.py``: ``EngineConfig`` and the counters; ``intake.py``: request validation;
- ``scheduler.py``: which requests run each step and how many tokens (no tensors), through
- ``cache_manager.py``: admission, prefix sharing and its alignment rules, the prefix LRU, reclaim;
- ``prefix.py``: the prefix index for block sharing;
- ``prompt_cache.py``: kept prefixes as files that survive restarts (``prompt_cache_dir``);
- ``drafting.py``, ``speculative.py``, ``draft_model.py``: speculative decoding;
- ``logits_layout.py``: where each row's logits sit in a step;
- ``runner.py``: executes a step on the model's own modules inside one ModelCache transaction;
- ``sampling.py``: per-request sampling as ``GenerationConfig`` describes it;
- ``outputs.py``: a step's output applied to the requests;
- ``manager.py``: the transformers-facing manager (``init_continuous_batching``, ``generate_batch``);
- ``constraints.py``: structured output (a request's grammar, its masks in the step; llguidance).
"""

from .constraints import CompiledConstraint, Constraint, ConstraintError, compile_constraint
from .engine import BadRequestError, Engine, EngineConfig, StepOutput
from .requests import FinishReason, Request, RequestStatus
from .runner import ModelRunner
from .sampling import SamplingParams
from .scheduler import ScheduledChunk, Scheduler, StepPlan

__all__ = ["Engine", "EngineConfig", "StepOutput", "BadRequestError", "Request", "RequestStatus",
           "FinishReason", "ModelRunner", "SamplingParams", "Scheduler", "StepPlan", "ScheduledChunk", "Constraint",
           "CompiledConstraint", "ConstraintError", "compile_constraint"]
