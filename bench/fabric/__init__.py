"""The fabric benchmark (`python -m bench.fabric`, see `__main__`) and its helpers:

- `stack`: starts the tiers (and the echo server) as processes for a configuration;
- `loadgen`: open- and closed-loop load generators; `sweep`: the goodput search;
- `measure`: one rate, a sweep, a closed loop; `phases`: the benchmark's phases; `raw`: the
  model alone, with no stack; `observe`: per-process CPU and metrics snapshots;
- `targets`: what each phase sends (texts, mixed lengths, identity tensors);
- `report`: summary, goals, table and plot;
- `echo_server`: the bare grpc.aio echo server, the overhead baseline;
- `peer_client` / `peer_ray_server`: the Ray Serve peer's client (this venv; `http_pool` its
  keep-alive HTTP) and server (the Ray venv, run as a script).
"""
