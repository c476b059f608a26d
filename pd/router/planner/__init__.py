"""The per-request prefill planner: remote prefill on P, local prefill on D, or a prefix pull.

- `fit`: least-squares fits over a bounded window of recent samples;
- `figures`: the online cost figures (per-worker prefill seconds, per P->D link
  seconds, pending work, residual overhead), fed only by measured timings;
- `decision`: the options for one request, their predicted TTFT, the choice
  (with exploration and a cold-start rule);
- `explain`: the record of why a request went where it went.
"""
