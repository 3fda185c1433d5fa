"""How a generation request samples and stops: shared by gateways (validation at the edge)
and workers (the sampler), so both apply one set of rules. Plain data, no torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from services.common.errors import InvalidInput
from services.pb.inference.v1 import worker_pb2 as pb

#: Seeds are the proto's uint64: every value of it seeds torch's generator.
_MAX_SEED = 2**64
#: Below this a positive temperature divides logits into inf/NaN territory: it is refused
#: (0 is greedy, which is what such a temperature would mean anyway).
MIN_TEMPERATURE = 0.01
#: ... as the wire carries it: a float32 0.01 is 0.0099999998, which is allowed too.
_MIN_TEMPERATURE_ON_WIRE = MIN_TEMPERATURE * (1 - 1e-6)
MAX_TEMPERATURE = 100.0
#: Stop strings are scanned on every token: their count and length are bounded.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens, and when it stops."""

    # Tokens to generate at most (the reply may stop earlier at EOS or a stop condition).
    max_tokens: int = 16
    # 0 means greedy (argmax); higher flattens the distribution.
    temperature: float = 0.0
    # Keep only the k most likely tokens; 0 keeps all.
    top_k: int = 0
    # Keep the smallest set of most likely tokens whose probability sum reaches top_p.
    top_p: float = 1.0
    # Seeds the request's own generator: same seed, same prompt, same tokens. None: unseeded.
    seed: int | None = None
    # Token ids that end the reply (in addition to the model's EOS unless ignore_eos).
    stop_token_ids: tuple[int, ...] = ()
    # Strings that end the reply when they appear in the decoded output.
    stop: tuple[str, ...] = ()
    # Keep generating past the model's EOS token(s), up to max_tokens.
    ignore_eos: bool = False

    @property
    def is_greedy(self) -> bool:
        """True when the token is the argmax and no randomness is involved."""
        return self.temperature == 0.0

    def validate(self, max_model_len: int, prompt_len: int) -> None:
        """Raise ValueError naming the first rule broken (the client can fix the request)."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if prompt_len + self.max_tokens > max_model_len:
            raise ValueError(
                f"prompt of {prompt_len} tokens + max_tokens {self.max_tokens} exceeds the "
                f"model's maximum length of {max_model_len} tokens"
            )
        if not (
            self.temperature == 0 or _MIN_TEMPERATURE_ON_WIRE <= self.temperature <= MAX_TEMPERATURE
        ):
            raise ValueError(
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}],"
                f" got {self.temperature}"
            )
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < _MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids")
        if any(token < 0 for token in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not text or len(text) > MAX_STOP_STRING_CHARS for text in self.stop):
            raise ValueError(f"stop strings must be 1 to {MAX_STOP_STRING_CHARS} characters")


def sampling_from_pb(sampling: pb.SamplingParameters) -> SamplingParams:
    """SamplingParameters -> SamplingParams; proto zero values mean the documented defaults."""
    return SamplingParams(
        max_tokens=sampling.max_tokens or SamplingParams.max_tokens,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p or 1.0,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop=tuple(sampling.stop),
        stop_token_ids=tuple(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
    )


def checked_sampling(
    sampling: pb.SamplingParameters,
    *,
    max_model_len: int,
    prompt_len: int,
    fills_context: bool = False,
) -> SamplingParams:
    """Converts and validates; INVALID_ARGUMENT naming the first rule broken. `fills_context`:
    no max_tokens (0) reads as the rest of the context after the prompt (at least 1)."""
    params = sampling_from_pb(sampling)
    if fills_context and not sampling.max_tokens:
        params = dataclasses.replace(params, max_tokens=max(1, max_model_len - prompt_len))
    try:
        params.validate(max_model_len, prompt_len)
    except ValueError as error:
        raise InvalidInput(str(error)) from error
    return params
