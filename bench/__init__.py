"""Benchmarks. Entry points (each a `make` target) are the modules at this level:

- `python -m bench.raw_model` (`make bench-model`): the embedding model alone, in process.
- `python -m bench.generation` (`make bench-generation`): continuous against static batching.
- `python -m bench.fabric` (`make bench-fabric`, `make bench-smoke`): the whole fabric under load,
  against batching off, a bare echo server and the Ray Serve peer. Its helpers live in the
  `bench.fabric` package (stack, load generator, measurements, report, peer client and server).
- `python -m bench.spread` (`make bench-spread`): the fabric with every tier spread over the
  machine's cores and the load from several generator processes (a GPU box's figure).
- The Makefile's `bench-*` targets and docs/benchmarks.md list the rest (tenants, jobs, the
  simulator's validations, the registry, fair share, the worker's intake and its bundle path
  in one process, server calls, what registered methods cost a call, the floor of a relayed
  stream message, generation steps, the host time of streaming one generated token).
"""
