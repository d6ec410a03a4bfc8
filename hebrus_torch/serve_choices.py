"""The OpenAI response of ``python -m hebrus_torch.serve`` on the continuous-batching path. Moved: the layout is
:mod:`hebrus_torch.serving.openai_format`, the drivers :mod:`hebrus_torch.serving.handlers`, the request's
options :mod:`hebrus_torch.serving.options`; this module re-exports their names."""

from __future__ import annotations

from hebrus_torch.serving.handlers import Call, full_response, stream_response  # noqa: F401
from hebrus_torch.serving.openai_format import (Choice, StopTrimmer, chat_body, chat_chunk,  # noqa: F401
                                                chat_logprobs, completion_body, completion_chunk,
                                                completion_logprobs, sse, usage)
from hebrus_torch.serving.options import Options  # noqa: F401

__all__ = ["Options", "Choice", "StopTrimmer", "chat_body", "chat_chunk", "completion_body", "completion_chunk",
           "sse"]
