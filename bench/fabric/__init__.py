"""The fabric benchmark (`python -m bench.fabric`, see `__main__`) and its helpers:

- `stack`: starts the tiers (and the echo server) as processes for a configuration;
- `loadgen`: open- and closed-loop load generators; `sweep`: the goodput search;
- `measure`: the benchmark's phases; `observe`: per-process CPU and metrics snapshots;
- `targets`: what each phase sends (texts, mixed lengths, identity tensors);
- `report`: summary, goals, table and plot;
- `echo_server`: the bare grpc.aio echo server, the overhead baseline;
- `peer_client` / `peer_ray_server`: the Ray Serve peer's client (this venv) and server (the Ray
  venv, run as a script).
"""
