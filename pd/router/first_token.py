"""P's first token, sent to the client at once (`router.first_token_from_prefill`).

A P/D prefill ends with P sampling the request's first output token. Without this, the
router drops it and D's first step gives the first token again: D recomputes the last
prompt position for its logits, so the client waits for the hop to D, D's pull of P's
blocks, D's queue and that step. With it, the router streams P's token as soon as P
answers and sends D the prompt plus that token: D pulls the prompt's KV and its first
step computes the token's own position, giving the second token. TTFT loses those hops,
and the output is what D's first token would have given: greedy, the same ids (P's token is
the argmax over the same prompt that D recomputed); sampled without a seed, a draw from the
same distribution.

Guarantees:
- only a request with no `seed` is forwarded: a seeded request's draws are numbered from
  its first token (pd.engine.sample), and D starting a fresh stream at the second one
  would break "the same seed, the same output" (such a request keeps D's first token);
- KV streaming (`transfer.streaming`, pd.router.streamed) keeps D's first token: D gets the
  request before P answers, so the prompt it continues from cannot hold P's token;
- a request that P's token ends (`max_tokens` 1, or a stop token: P's engine checks the
  request's own stop rule before its length) is answered by P alone with P's finish reason;
  no D is called and the caller aborts P's lease as for any request that ends before D;
- the planner (pd.router.planner) still weighs and learns a remote option by the time D's
  stream starts, not by the client's TTFT: a slow pull stalls the stream after P's token just as
  it delayed the first token before;
- D's request asks for exactly what is left: `max_tokens` less one, the token appended to
  the prompt, P's transfer params (naming the prompt's blocks only: the token's position is
  D's to compute).
"""
from __future__ import annotations

from pd.cluster.messages import FinishReason, GenerateRequest, KVTransferParams, Sampling, TokenEvent


def forwards(enabled: bool, sampling: Sampling) -> bool:
    """Whether P's first token goes to the client for a request with these parameters."""
    return enabled and sampling.seed is None


def finish_at_first(request: GenerateRequest, answer: TokenEvent) -> FinishReason | None:
    """The finish reason when P's token ends the request (`stop`: a stop token, P's engine checks
    that first; `length`: `max_tokens` is 1), else None: D goes on."""
    if answer.finish_reason == "stop":
        return "stop"
    return "length" if request.sampling.max_tokens <= len(answer.token_ids) else None


def first_event(answer: TokenEvent, num_cached_tokens: int, finish_reason: FinishReason | None) -> TokenEvent:
    """The client's first event: P's token(s), with the request's finish when P's token ends it."""
    return TokenEvent(token_ids=list(answer.token_ids), finished=finish_reason is not None,
                      finish_reason=finish_reason, num_cached_tokens=num_cached_tokens)


def decode_request(request: GenerateRequest, answer: TokenEvent, params: KVTransferParams | None) -> GenerateRequest:
    """D's request once P's `answer` went to the client (and did not end the request); `params`
    are P's transfer params as the router checked them (None: D computes the prompt itself)."""
    return request.model_copy(update={
        "prompt_token_ids": list(request.prompt_token_ids) + list(answer.token_ids),
        "sampling": request.sampling.model_copy(update={"max_tokens": request.sampling.max_tokens
                                                        - len(answer.token_ids)}),
        "kv_transfer_params": params})
