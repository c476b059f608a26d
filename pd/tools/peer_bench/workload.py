"""The peer benchmark's workload: waves of distinct chat prompts (pd/tools/peer_bench/cli.py).

A run is, per concurrency c: one warm-up wave, then `rounds` measured waves, each wave c
streamed chat requests sent at once. Every request of a run carries its own prompt (a
numbered variant of one of pd.tools.vs_hf's questions, the number first so that two prompts
part before the question), so neither a prefix cache nor a server's slot cache reuses a
previous request's user turn. Each server of a run gets the same prompts in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass

from pd.tools.vs_hf import QUESTIONS

WARMUP = -1  # the round number of a warm-up wave


@dataclass(frozen=True)
class Wave:
    concurrency: int
    round_index: int  # WARMUP, or 0 .. rounds-1
    prompts: tuple[str, ...]

    @property
    def warmup(self) -> bool:
        return self.round_index == WARMUP


def prompt_text(serial: int) -> str:
    """The `serial`-th prompt of a run: a request number, then one of the questions."""
    return f"Request {serial}. {QUESTIONS[serial % len(QUESTIONS)]}"


def build_waves(concurrencies: list[int] | tuple[int, ...], rounds: int, warmup: bool = True) -> list[Wave]:
    """The run's waves in order: per concurrency, the warm-up wave then `rounds` waves."""
    if rounds <= 0:
        raise ValueError(f"rounds must be positive, got {rounds}")
    if not concurrencies or any(c <= 0 for c in concurrencies):
        raise ValueError(f"concurrencies must be positive, got {list(concurrencies)}")
    waves: list[Wave] = []
    serial = 0
    for c in concurrencies:
        for r in ([WARMUP] if warmup else []) + list(range(rounds)):
            waves.append(Wave(c, r, tuple(prompt_text(serial + i) for i in range(c))))
            serial += c
    return waves


def messages_for(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]
